"""Per-request resolution: the requests a sampled step flagged, verified from their own rows only.

A sampled plan (:meth:`shardmax.VocabShard.verify`) verifies every request from per-rank records
and candidates and flags the few it cannot prove (``VerifyResult.fallback``: a nucleus wider than
the candidates, a tie straddling the top-p boundary, an LSE at the margin, NaN ...). Instead of
re-running the whole step on the all-gathered logits, the caller resolves only those requests:

1. :func:`flagged_requests` -- which requests and why (one device->host read of the codes, identical on
   every rank, so every rank takes the same branch);
2. :func:`resolution_rows` -- their logits rows (:func:`request_rows`, host arithmetic on
   ``cu_num_logits_np``) and which of them must be gathered (``VerifyResult.need``, one more
   small read): a flagged request's rows up to its first flagged one were accepted with
   certified decisions, and so may later rows be; only the others cross the ranks;
3. :func:`gather_rows` -- those rows' full-vocabulary logits: one ``all_gather`` of ``m'`` rows
   of the local shard (``m' * W`` elements per rank, instead of ``num_logits * W`` for the whole
   step), laid out as vLLM's ``compute_logits`` lays out the gathered logits (``[m', tp * W]``
   viewed as ``[m', V]``);
4. :func:`resolution_logits` -- the requests' ``[m, V]`` rows: the gathered ones, and for every
   certified row a *synthetic* row on which vLLM's chain surely does what it does on the real
   row: accept the draft (the draft far above every other id), or, on the row the step drew
   from with a certified decision and token, reject the draft and draw that token (the token
   far above every other id, the draft among them);
5. a resolver that applies vLLM's semantics to those rows exactly as inside the whole step (the
   vLLM plug-in uses :meth:`shardmax.integrations.vllm.chain.NativeChain.verify_requests`, vLLM's own
   kernels with the whole step's per-chunk decisions);
6. :func:`apply_resolved` -- the answers written into the step's outputs, flags cleared.

Every rank calls 3.-6. with the same ``requests`` (collective), after 1. and 2.

Why a synthetic row gives the real row's answer: a request's outcome is its accepted prefix and
the token drawn at the first rejected row (or the bonus row). A synthetic row puts one id ``t``
at 0 and every other id at ``-60 max(1, T)`` (model dtype; ``T <=``
:data:`SYNTHETIC_MAX_TEMPERATURE`); vLLM's processed row (temperature, then top-k / top-p / min-p,
which all keep the unique maximum) has every other id at least 59.7 below ``t`` (the model
dtype's rounding of ``-60 T`` included), so its fp32 ``sum exp`` is exactly 1 (``262144
exp(-59.7) < 2**-25``) and ``log p(t) = 0``, ``log p(v) <= -59.7`` elsewhere.

* Certified accept (``t`` = the draft ``d``): vLLM 0.32 and 0.33 accept iff ``log p(d) > log u``
  with ``u`` in ``(0, 1)`` -- for a real row it accepted, ``log u < log p(d) <= 0``, so it accepts
  the synthetic row for the same ``u`` (keyed by ``(seed, pos)``, unchanged); greedy rows accept
  iff the argmax is ``d``.
* Certified draw (``t`` = the token the step drew at that row; ``VerifyResult.need == 2``):
  ``log p(d) <= -59.7`` is below every ``log u`` vLLM draws (its acceptance uniform is clamped:
  ``tl_rand32(seed, pos, includes_zero=False)``, ``u >= 4.66e-10``, ``log u >= -21.5``, in 0.32
  and 0.33), so vLLM rejects (greedy: the argmax is ``t != d``), and draws from the row with its
  keyed Gumbel noise, which lies in ``[-2.9, 22.9]`` (fp32) or ``[-3.7, 36.8]`` (fp64: its
  uniforms are open intervals of 32 and 53 bits): ``t`` scores at least -3.7, every other id at
  most ``-59.7 + 36.8``, so it draws ``t`` -- the token it draws on the real row, whenever it reaches
  that row (it does only after accepting every row before, as this step did).

Rows after a certified stop are never reached; they are synthetic too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

from shardmax.ops.sampled import VerifyResult
from shardmax.runtime.host import stage, to_host
from shardmax.runtime.shard import ShardContext

__all__ = [
    "SYNTHETIC_GAP",
    "SYNTHETIC_MAX_TEMPERATURE",
    "ResolutionRows",
    "SyntheticSources",
    "apply_resolved",
    "check_requests",
    "flagged_requests",
    "gather_rows",
    "request_rows",
    "resolution_logits",
    "resolution_rows",
    "resolve_requests",
    "synthetic_sources",
]

SYNTHETIC_GAP = 60.0
"""A synthetic row's other ids sit ``SYNTHETIC_GAP * max(1, T)`` below its top id (module doc)."""
SYNTHETIC_MAX_TEMPERATURE = 1000.0
"""Above it (or NaN) no row of a request is synthetic (``sampled_finish_*`` marks every row to
gather): ``SYNTHETIC_GAP * T`` must stay finite in fp16 (65504)."""


def flagged_requests(result: VerifyResult) -> tuple[np.ndarray, np.ndarray]:
    """``(requests, reasons)``: int64 ``[n]`` the requests of ``result`` whose ``fallback`` flag
    is set, increasing, and int8 ``[n]`` their ``FallbackReason`` codes.

    One device->host copy of the ``[num_reqs]`` reason codes (a request is flagged exactly when
    its code is non-zero; :func:`shardmax.runtime.host.to_host`): the host sync of a sampled
    step (:func:`resolution_rows`' read of ``need`` comes after it and waits for nothing).
    """
    codes = to_host(result.reason)
    req = np.flatnonzero(codes).astype(np.int64)
    return req, codes[req]


def request_rows(cu_num_logits_np: np.ndarray, requests: np.ndarray) -> np.ndarray:
    """int64 ``[m]``: the logits rows ``cu[r] .. cu[r+1] - 1`` of each of ``requests``, in order.

    Raises:
        ValueError: ``cu_num_logits_np`` not non-decreasing, ``requests`` not strictly
            increasing in ``[0, num_reqs)`` (named). TypeError: ``requests`` not integers.
    """
    cu = np.asarray(cu_num_logits_np, dtype=np.int64)
    if cu.ndim != 1 or cu.size < 1 or bool((np.diff(cu) < 0).any()):
        raise ValueError(
            f"cu_num_logits_np: expected a 1-D non-decreasing array, got {cu.tolist()}"
        )
    req = check_requests(requests, len(cu) - 1)
    if req.size == 0:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(cu[r], cu[r + 1], dtype=np.int64) for r in req])


class ResolutionRows(NamedTuple):
    """The logits rows of a resolution (:func:`resolution_rows`), host arrays of one length."""

    rows: np.ndarray
    """int64 ``[m]``: every logits row of the resolved requests, in order."""
    gather: np.ndarray
    """bool ``[m]``: the rows whose real logits the resolution gathers."""
    draw: np.ndarray
    """bool ``[m]``: synthetic rows of a certified draw (the step's token on top); the other rows
    not gathered are synthetic certified accepts (the draft on top)."""


def resolution_rows(
    result: VerifyResult, cu_num_logits_np: np.ndarray, requests: np.ndarray
) -> ResolutionRows:
    """Every logits row of ``requests`` in order (:func:`request_rows`), which of them the
    resolution must gather and which become synthetic rows of a certified draw
    (``result.need`` 1 and 2, written by the finish: see its kernel's docstring; every row is
    gathered when ``result.need`` is None). One device->host copy of ``need`` (``[num_logits]``
    int8), made after :func:`flagged_requests`' read, so it waits for nothing.

    Raises:
        ValueError / TypeError: as :func:`request_rows`; ``result.need`` shorter than the rows.
    """
    rows = request_rows(cu_num_logits_np, requests)
    if result.need is None or rows.size == 0:
        return ResolutionRows(rows, np.ones(rows.size, dtype=bool), np.zeros(rows.size, dtype=bool))
    need = to_host(result.need)
    if need.shape[0] <= int(rows[-1]):
        raise ValueError(
            f"result.need: expected [num_logits >= {int(rows[-1]) + 1}], got {need.shape}"
        )
    return ResolutionRows(rows, need[rows] == 1, need[rows] == 2)


def resolution_logits(
    gathered: torch.Tensor,
    gather: np.ndarray,
    requests: np.ndarray,
    cu_num_logits_np: np.ndarray,
    idx_mapping_np: np.ndarray,
    draft_sampled: torch.Tensor,
    temperature: torch.Tensor,
    draw: np.ndarray | None = None,
    sampled: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``[m, V]`` logits rows of ``requests`` a resolver verifies: the gathered rows where
    ``gather`` is set, a synthetic row elsewhere (module doc: one id at 0, every other id at
    ``-SYNTHETIC_GAP * clamp(T, 1, SYNTHETIC_MAX_TEMPERATURE)`` in the model dtype; that id is the
    row's draft, or where ``draw`` is set the token ``sampled`` holds at the row's position).

    Args:
        gathered: ``[m', V]`` the rows :func:`gather_rows` returned for ``rows[gather]`` (model
            dtype, ``stride(-1) == 1``).
        gather: bool ``[m]`` (:func:`resolution_rows`).
        requests: int ``[n]`` the resolved requests; ``cu_num_logits_np`` ``[num_reqs + 1]`` and
            ``idx_mapping_np`` ``[num_reqs]`` the step's (host).
        draft_sampled: ``[num_logits]`` the step's drafts (row ``g`` verifies ``draft_sampled[g +
            1]``); ``temperature``: fp32 ``[max_num_reqs]`` per request-state slot (device).
        draw: bool ``[m]`` (:func:`resolution_rows`), never set where ``gather`` is; None: none.
        sampled: the step's ``VerifyResult.sampled`` (``[num_reqs, K + 1]`` int64; request
            ``r``'s row ``cu[r] + j`` drew the token at column ``j``); required where ``draw`` is
            set.

    Returns:
        ``gathered`` itself when every row is gathered; else a new ``[m, V]`` tensor with
        ``gathered``'s row stride (vLLM's ``compute_logits`` layout when it has it).

    Raises:
        ValueError: ``gather`` / ``draw`` not ``[m]`` booleans, ``gathered.shape[0]`` not the
            rows gathered, a row both gathered and drawn, ``gathered`` not ``[m', V]``, or draw
            rows without a ``[num_reqs, K + 1]`` ``sampled`` that holds their columns.
    """
    if gathered.dim() != 2:
        raise ValueError(f"gathered: expected [m', V], got {list(gathered.shape)}")
    src = synthetic_sources(
        ResolutionRows(
            request_rows(cu_num_logits_np, requests), gather,
            np.zeros(np.shape(gather), dtype=bool) if draw is None else draw,
        ),
        requests, cu_num_logits_np, idx_mapping_np, draft_sampled.shape[0], gathered.shape[0],
        None if sampled is None else tuple(sampled.shape),
    )  # fmt: skip
    m = int(src.slot.size)
    keep, drawn = src.gathered_at >= 0, src.sampled_at >= 0
    if bool(keep.all()):
        return gathered
    vocab, dev = gathered.shape[1], gathered.device
    parts = [src.draft_at, src.slot, np.flatnonzero(keep)]
    if drawn.any():
        parts += [np.flatnonzero(drawn), src.sampled_at[drawn]]
    idx = stage(np.concatenate(parts), dev)
    token = draft_sampled.index_select(0, idx[:m]).long()
    if sampled is not None and drawn.any():
        nd, at = int(drawn.sum()), 2 * m + int(keep.sum())
        picked = sampled.reshape(-1).index_select(0, idx[at + nd :])
        token.index_copy_(0, idx[at : at + nd], picked.long())
    token.clamp_(0, vocab - 1)
    low = temperature.index_select(0, idx[m : 2 * m]).clamp_(1.0, SYNTHETIC_MAX_TEMPERATURE)
    low.mul_(-SYNTHETIC_GAP)  # exact in fp32, then rounded once to the model dtype by the copy
    width = max(vocab, gathered.stride(0)) if gathered.shape[0] else vocab
    out = torch.empty((m, width), dtype=gathered.dtype, device=dev)[:, :vocab]
    out.copy_(low[:, None].expand(m, vocab))
    out.scatter_(1, token[:, None], 0.0)
    if gathered.shape[0]:
        out.index_copy_(0, idx[2 * m : 2 * m + int(keep.sum())], gathered)
    return out


class SyntheticSources(NamedTuple):
    """Where each row of a resolution comes from (:func:`synthetic_sources`; host, ``[m]``)."""

    gathered_at: np.ndarray
    """int64: the row's index among the gathered rows, -1 for a synthetic row."""
    draft_at: np.ndarray
    """int64: the index of the row's draft in ``draft_sampled`` (``row + 1``, clamped)."""
    sampled_at: np.ndarray
    """int64: a draw row's token's index in the flattened ``VerifyResult.sampled``, else -1."""
    slot: np.ndarray
    """int64: the row's request-state slot (its temperature's index)."""


def synthetic_sources(
    plan: ResolutionRows,
    requests: np.ndarray,
    cu_num_logits_np: np.ndarray,
    idx_mapping_np: np.ndarray,
    num_drafts: int,
    num_gathered: int,
    sampled_shape: tuple[int, ...] | None,
) -> SyntheticSources:
    """The sources of the rows :func:`resolution_logits` builds (and ``resolve_fill`` builds in
    place), checked: host arithmetic only.

    Args:
        plan: the resolution's rows (:func:`resolution_rows`).
        requests, cu_num_logits_np, idx_mapping_np: as :func:`resolution_logits`.
        num_drafts: ``draft_sampled``'s length; num_gathered: the gathered rows' count;
        sampled_shape: ``VerifyResult.sampled``'s shape (None: no draw row allowed).

    Raises:
        ValueError: ``gather`` / ``draw`` not ``[m]`` booleans or overlapping, ``num_gathered``
            not the rows gathered, draw rows without a ``[num_reqs, K + 1]`` ``sampled`` that
            holds their columns; as :func:`request_rows`.
    """
    rows = np.asarray(plan.rows, dtype=np.int64)
    m = int(rows.size)
    keep = np.asarray(plan.gather)
    if keep.shape != (m,) or keep.dtype != np.bool_:
        raise ValueError(f"gather: expected bool [{m}], got {keep.dtype} {list(keep.shape)}")
    drawn = np.asarray(plan.draw)
    if drawn.shape != (m,) or drawn.dtype != np.bool_ or bool((drawn & keep).any()):
        raise ValueError(
            f"draw: expected bool [{m}] set only on rows not gathered, got {drawn.dtype} "
            f"{list(drawn.shape)}"
        )
    if num_gathered != int(keep.sum()):
        raise ValueError(
            f"gathered: expected [{int(keep.sum())}, V] (the rows to gather), got "
            f"{num_gathered} rows"
        )
    cu = np.asarray(cu_num_logits_np, dtype=np.int64)
    req = check_requests(requests, len(cu) - 1)
    counts = np.diff(cu)[req]
    sampled_at = np.full(m, -1, dtype=np.int64)
    if drawn.any():
        if sampled_shape is None or len(sampled_shape) != 2 or sampled_shape[0] != len(cu) - 1:
            raise ValueError(
                f"sampled: expected [{len(cu) - 1}, K + 1] (the step's tokens) for the draw rows, "
                f"got {None if sampled_shape is None else list(sampled_shape)}"
            )
        col = rows - np.repeat(cu[req], counts)  # each row's column in its request's tokens
        if int(col[drawn].max()) >= sampled_shape[1]:
            raise ValueError(f"sampled: {list(sampled_shape)} lacks a draw row's column")
        flat = np.repeat(req, counts) * sampled_shape[1] + col
        sampled_at[drawn] = flat[drawn]
    return SyntheticSources(
        np.where(keep, np.cumsum(keep) - 1, -1),
        np.minimum(rows + 1, num_drafts - 1),
        sampled_at,
        np.repeat(np.asarray(idx_mapping_np, dtype=np.int64)[req], counts),
    )


def check_requests(requests: np.ndarray, num_reqs: int) -> np.ndarray:
    """``requests`` as int64, checked: 1-D integers (else TypeError), strictly increasing in
    ``[0, num_reqs)`` (else ValueError). Host only."""
    req = np.asarray(requests)
    if req.ndim != 1 or (req.size and req.dtype.kind not in "iu"):
        raise TypeError(f"requests: expected a 1-D integer array, got {req!r}")
    req = req.astype(np.int64)
    if req.size and (
        int(req[0]) < 0 or int(req[-1]) >= num_reqs or bool((np.diff(req) <= 0).any())
    ):
        raise ValueError(
            f"requests: expected strictly increasing indices in [0, {num_reqs}), got {req.tolist()}"
        )
    return req


def _vllm_layout(ranges: tuple[tuple[int, int], ...], width: int) -> bool:
    """Rank ``r`` holds ids ``[r W, r W + n_r)`` with ``n_r = clamp(V - r W, 0, W)``: vLLM's
    vocab-parallel layout, where the gathered ``[m, tp W]`` row IS the row of global ids."""
    vocab = max(s + n for s, n in ranges)
    return all(
        s == min(r * width, vocab) and n == max(0, min(width, vocab - r * width))
        for r, (s, n) in enumerate(ranges)
    )


def gather_rows(ctx: ShardContext, local_logits: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
    """The full-vocabulary logits of some rows, from every rank's shard (collective).

    Args:
        ctx: the shard (``VocabShard.ctx``): its collective and every rank's geometry.
        local_logits: this rank's ``[num_logits, W]`` shard (model dtype, ``stride(-1) == 1``).
        rows: int ``[m]`` rows to gather, the same on every rank (host).

    Returns:
        ``[m, V]`` in the model dtype, ``V = ctx.geometry.vocab``: column ``v`` holds global id
        ``v``. In vLLM's layout (rank ``r`` holds ``[r W, r W + W)``, the last rank padded) it is
        a ``[:, :V]`` view of an ``[m, tp * W]`` tensor: the layout and row stride of vLLM's
        ``compute_logits`` output for those rows; otherwise a contiguous tensor, ids no rank
        holds are ``-inf``.

    Raises:
        ValueError: ``local_logits`` not ``[num_logits, W]`` of the shard, or a row out of range.
    """
    g = ctx.geometry
    if local_logits.dim() != 2 or local_logits.shape[1] != g.width:
        raise ValueError(
            f"local_logits: expected [num_logits, {g.width}] (the shard's width), got "
            f"{list(local_logits.shape)}"
        )
    idx = np.asarray(rows, dtype=np.int64)
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= local_logits.shape[0]):
        raise ValueError(
            f"rows: must lie in [0, {local_logits.shape[0]}), got [{int(idx.min())}, "
            f"{int(idx.max())}]"
        )
    m = int(idx.size)
    mine = local_logits.index_select(0, stage(idx, local_logits.device))
    parts = ctx.coll.all_gather_dim0(mine)  # [tp * m, W], rank-major
    if _vllm_layout(g.ranges, g.width):
        full = parts.view(g.tp, m, g.width).permute(1, 0, 2).reshape(m, g.tp * g.width)
        return full[:, : g.vocab]
    out = torch.full((m, g.vocab), float("-inf"), dtype=local_logits.dtype, device=parts.device)
    for r, (start, num_valid) in enumerate(g.ranges):
        out[:, start : start + num_valid] = parts[r * m : (r + 1) * m, :num_valid]
    return out


def apply_resolved(
    result: VerifyResult,
    requests: np.ndarray,
    sampled: torch.Tensor,
    num_sampled: torch.Tensor,
    num_rejected: torch.Tensor,
) -> VerifyResult:
    """Write the resolved requests' answers into ``result`` (in place) and clear their flags.

    Args:
        result: the step's outputs (``sampled [num_reqs, K + 1]`` int64, counts int32).
        requests: int ``[n]`` the resolved requests (host).
        sampled: ``[n, K + 1]`` their tokens (any integer dtype; columns ``>= num_sampled``
            become -1, as in every :class:`VerifyResult`).
        num_sampled, num_rejected: ``[n]`` their counts.

    Returns:
        ``result`` itself.

    Counts are written as given (checking their range would read the device).

    Raises:
        ValueError: ``requests`` not strictly increasing in ``[0, num_reqs)``; shapes that do not
            match ``requests`` / ``result``.
    """
    req = check_requests(requests, result.sampled.shape[0])
    n = int(req.size)
    k1 = result.sampled.shape[1]
    if tuple(sampled.shape) != (n, k1) or num_sampled.shape != (n,) or num_rejected.shape != (n,):
        raise ValueError(
            f"resolved outputs: expected sampled [{n}, {k1}] and counts [{n}], got "
            f"{list(sampled.shape)}, {list(num_sampled.shape)}, {list(num_rejected.shape)}"
        )
    if n == 0:
        return result
    idx = stage(req, result.sampled.device)
    cols = torch.arange(k1, device=sampled.device)[None, :]
    tokens = torch.where(cols < num_sampled.to(torch.int64)[:, None], sampled.to(torch.int64), -1)
    result.sampled.index_copy_(0, idx, tokens.to(result.sampled.dtype))
    result.num_sampled.index_copy_(0, idx, num_sampled.to(result.num_sampled.dtype))
    result.num_rejected.index_copy_(0, idx, num_rejected.to(result.num_rejected.dtype))
    result.fallback.index_fill_(0, idx, False)
    result.reason.index_fill_(0, idx, 0)
    return result


def resolve_requests(
    result: VerifyResult,
    requests: np.ndarray,
    fetch_rows: Callable[[np.ndarray], torch.Tensor],
    resolver: Any,
    inputs: Mapping[str, Any],
) -> np.ndarray:
    """Steps 2.-6. for the flagged ``requests`` of ``result`` (in place): which rows to gather
    (:func:`resolution_rows`), ``fetch_rows(rows)`` -> their ``[m', V]`` logits (the plug-in:
    :func:`gather_rows` on the shard, a collective; tests: rows of the full tensor), the
    synthetic rows (:func:`resolution_logits`), ``resolver.verify_requests(logits, requests,
    **inputs)`` (:meth:`~shardmax.integrations.vllm.chain.NativeChain.verify_requests`'
    contract: ``inputs`` are the whole step's arguments, with ``cu_num_logits_np``,
    ``idx_mapping_np``, ``draft_sampled`` and ``temperature_gpu``) and :func:`apply_resolved`.
    A resolver with ``resolve(result, gathered, rows, requests, **inputs)``
    (``CapturedResolution``) does the last three itself -- synthetic rows built in its own
    buffers, answers written into ``result`` --; one with only ``verify_resolution(gathered,
    rows, requests, sampled, **inputs)`` builds the synthetic rows itself.

    Returns:
        int64 ``[m']``: the logits rows gathered (what crossed the ranks).
    """
    cu = inputs["cu_num_logits_np"]
    plan = resolution_rows(result, cu, requests)
    gathered = fetch_rows(plan.rows[plan.gather])
    resolve_into = getattr(resolver, "resolve", None)
    if resolve_into is not None:  # CapturedResolution: builds the synthetic rows in its own
        resolve_into(result, gathered, plan, requests, **inputs)  # buffers, writes the answers
        return plan.rows[plan.gather]
    fused = getattr(resolver, "verify_resolution", None)
    if fused is not None:
        sub = fused(gathered, plan, requests, result.sampled, **inputs)
    else:
        logits = resolution_logits(
            gathered, plan.gather, requests, cu, inputs["idx_mapping_np"],
            inputs["draft_sampled"], inputs["temperature_gpu"], plan.draw, result.sampled,
        )  # fmt: skip
        sub = resolver.verify_requests(logits, requests, **inputs)
    apply_resolved(result, requests, sub[0], sub[1], sub[2])
    return plan.rows[plan.gather]
