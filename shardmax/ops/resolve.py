"""Per-request resolution: the requests a sampled step flagged, verified from their own rows only.

A sampled plan (:meth:`shardmax.VocabShard.verify`) verifies every request from per-rank records
and candidates and flags the few it cannot prove (``VerifyResult.fallback``: a nucleus wider than
the candidates, a tie straddling the top-p boundary, an LSE at the margin, NaN ...). Instead of
re-running the whole step on the all-gathered logits, the caller resolves only those requests:

1. :func:`flagged_requests` -- which requests and why (one device->host read of the codes, identical on
   every rank, so every rank takes the same branch);
2. :func:`request_rows` -- their logits rows (host arithmetic on ``cu_num_logits_np``);
3. :func:`gather_rows` -- those rows' full-vocabulary logits: one ``all_gather`` of ``m`` rows
   of the local shard (``m * W`` elements per rank, instead of ``num_logits * W`` for the whole
   step), laid out as vLLM's ``compute_logits`` lays out the gathered logits (``[m, tp * W]``
   viewed as ``[m, V]``);
4. a resolver that applies vLLM's semantics to those rows exactly as inside the whole step (the
   vLLM plug-in uses :meth:`shardmax.integrations.vllm.chain.NativeChain.verify_requests`, vLLM's own
   kernels with the whole step's per-chunk decisions);
5. :func:`apply_resolved` -- the answers written into the step's outputs, flags cleared.

Every rank calls 3.-5. with the same ``requests`` (collective), after 1.
"""

from __future__ import annotations

import numpy as np
import torch

from shardmax.ops.sampled import VerifyResult
from shardmax.runtime.shard import ShardContext

__all__ = [
    "apply_resolved",
    "check_requests",
    "flagged_requests",
    "gather_rows",
    "request_rows",
    "stage",
]


def stage(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on ``device`` without a host sync: on CUDA through pinned memory (PyTorch's
    caching host allocator) and a non-blocking copy in stream order; elsewhere a plain copy.
    (A copy from pageable memory would wait for every kernel queued before it.)"""
    t = torch.from_numpy(np.require(a, requirements=("C", "W")))  # copies only if needed
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def flagged_requests(result: VerifyResult) -> tuple[np.ndarray, np.ndarray]:
    """``(requests, reasons)``: int64 ``[n]`` the requests of ``result`` whose ``fallback`` flag
    is set, increasing, and int8 ``[n]`` their ``FallbackReason`` codes.

    One device->host copy of the ``[num_reqs]`` reason codes (a request is flagged exactly when
    its code is non-zero): the only host sync of a resolved step.
    """
    codes = result.reason.detach().to("cpu").numpy()
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
