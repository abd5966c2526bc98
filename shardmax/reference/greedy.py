"""Plain-torch reference implementations, written from the spec (no vLLM code).

These are the oracles the kernels are tested against. They favour obviousness over speed:
the argmax is a few vectorised torch ops, verification is a Python loop over requests.

* :func:`argmax` -- the total order of design §2 (``torch.argmax``'s rule), implemented without
  ``torch.argmax``/``torch.max`` indices so that it can be checked against them.
* :func:`argmax_of_shards` -- the same over vocab shards (unpadded columns, rank order).
* :func:`synthetic_uniform` -- vLLM's synthetic-acceptance random number (spec §1.6).
* :func:`rejection_sample_greedy` -- vLLM ``rejection_sample`` for greedy rows (spec §1.2-§1.6, §2).
* :func:`get_num_sampled_and_rejected` -- vLLM's function of the same name (spec §1.5), out of place.
* :func:`greedy_verify` -- the two chained, the contract of ``shardmax.sharded_greedy_verify``.
* :func:`unconditional_to_conditional_rates`, :func:`synthetic_rates_from_length` -- the
  synthetic-rate helpers of spec §1.6.

Token ids are always int64 tensors (never floats), vocabularies up to ``2**31 - 1``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = [
    "argmax",
    "argmax_of_shards",
    "get_num_sampled_and_rejected",
    "greedy_verify",
    "rejection_sample_greedy",
    "synthetic_rates_from_length",
    "synthetic_uniform",
    "unconditional_to_conditional_rates",
]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# --------------------------------------------------------------------------------------------
# argmax
# --------------------------------------------------------------------------------------------


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax under the total order of design §2.

    Order on (value, id): larger value first; equal values (``-0.0 == +0.0``) -> lowest id;
    NaN beats every number, lowest id among NaNs. Consequently an all ``-inf`` row gives id 0 and
    an all-NaN row gives id 0. This is ``torch.argmax``'s rule and, for rows without NaN, the
    result of vLLM's blocked Triton argmaxes (spec §2.1-§2.3; ``LogitsProcessor.get_top_tokens``
    spec §3.3 for NaN rows too).

    Implemented without ``torch.argmax``/``torch.max`` indices: the maximum over non-NaN values
    (``amax``), a candidate mask (NaNs if the row has any, else the values equal to the max), and
    the first candidate via ``arange``/``amin``.

    Args:
        logits: ``[B, V]`` float tensor (bf16/fp16/fp32/fp64, any strides, any device), ``V >= 1``.
            ``B`` may be 0.

    Returns:
        int64 ``[B]`` ids in ``[0, V)``, on the input device.

    Raises:
        ValueError: not 2-D, not a float dtype, or ``V == 0`` (no id to return).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [B, V], got shape {tuple(logits.shape)}")
    if logits.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"logits must be a float tensor, got {logits.dtype}")
    rows, vocab = logits.shape
    if vocab == 0:
        raise ValueError("logits has an empty vocabulary (V == 0): no argmax")
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    x = logits if logits.dtype == torch.float64 else logits.to(torch.float32)  # exact upcast
    isnan = torch.isnan(x)
    row_has_nan = isnan.any(dim=1, keepdim=True)
    finite_or_inf = torch.where(isnan, torch.full_like(x, -math.inf), x)
    row_max = finite_or_inf.amax(dim=1, keepdim=True)  # values only; -0.0 == +0.0 below
    candidates = torch.where(row_has_nan, isnan, finite_or_inf == row_max)
    ids = torch.arange(vocab, dtype=torch.int64, device=x.device).expand(rows, vocab)
    sentinel = torch.full_like(ids, vocab)
    return torch.where(candidates, ids, sentinel).amin(dim=1)


def argmax_of_shards(
    shards: Sequence[tuple[torch.Tensor, int, int]],
) -> torch.Tensor:
    """Argmax over vocab shards, as if over the concatenated unpadded logits.

    Args:
        shards: one ``(local_logits [B, W_r], vocab_start, num_valid)`` per rank, in rank order
            (e.g. :class:`shardmax.testing.Shard`). Column ``c < num_valid`` of rank ``r`` is
            global id ``vocab_start + c``; columns ``>= num_valid`` are padding and ignored.
            Ranks must tile ``[0, V)`` contiguously (``vocab_start`` of rank ``r`` equals the
            end of rank ``r - 1``); ``num_valid`` may be 0.

    Returns:
        int64 ``[B]`` global ids, equal to ``argmax(cat([l[:, :n] for l, _, n in shards], 1))``.

    Raises:
        ValueError: empty list, non-contiguous ``vocab_start``, ``num_valid`` outside
            ``[0, W_r]``, differing row counts, or a total vocabulary of 0.
    """
    if len(shards) == 0:
        raise ValueError("argmax_of_shards needs at least one shard")
    pieces = []
    expected_start = 0
    rows = shards[0][0].shape[0]
    for rank, (local, vocab_start, num_valid) in enumerate(shards):
        if local.dim() != 2 or local.shape[0] != rows:
            raise ValueError(
                f"shard {rank}: local logits must be [B={rows}, W], got {tuple(local.shape)}"
            )
        if not 0 <= num_valid <= local.shape[1]:
            raise ValueError(f"shard {rank}: num_valid={num_valid} outside [0, {local.shape[1]}]")
        if vocab_start != expected_start:
            raise ValueError(
                f"shard {rank}: vocab_start={vocab_start}, expected {expected_start} "
                "(shards must tile the vocabulary in rank order)"
            )
        pieces.append(local[:, :num_valid])
        expected_start += num_valid
    return argmax(torch.cat(pieces, dim=1))


# --------------------------------------------------------------------------------------------
# synthetic acceptance
# --------------------------------------------------------------------------------------------


def synthetic_uniform(seed: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The uniform number vLLM draws for synthetic acceptance (spec §1.6, vLLM ``tl_rand32``).

    ``u = max(tl.rand(seed, pos), 4.6566127342e-10)`` with Triton's own ``tl.rand`` on an int64
    seed and an int64 offset (see :mod:`shardmax.runtime.rand`). Element-wise.

    Args:
        seed: int64 ``[N]`` per-element seeds (the request's ``seed[idx_mapping[r]]``).
        pos: int64 ``[N]`` positions (``pos[start + i]`` of the verifying row).

    Returns:
        fp32 ``[N]`` in ``(0, 1)``, on the input device.

    Raises:
        ValueError: dtype/shape mismatch. RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.
    """
    from shardmax.runtime.rand import synthetic_uniform_triton

    return synthetic_uniform_triton(seed, pos)


def unconditional_to_conditional_rates(rates: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Per-position unconditional acceptance rates -> conditional ones (spec §1.6).

    ``c_i = p_i / p_{i-1}`` with ``p_{-1} = 1``, and ``c_i = 0`` where ``p_{i-1} == 0``; computed in
    Python floats, stored as fp32 like vLLM's ``RejectionSampler.synthetic_conditional_rates``.

    Args:
        rates: length-K unconditional rates in ``[0, 1]`` (vLLM's config also requires them to be
            non-increasing; that is not re-checked here).

    Returns:
        fp32 CPU tensor ``[K]``.

    Raises:
        ValueError: a rate outside ``[0, 1]`` (or NaN).
    """
    values = [float(r) for r in (rates.tolist() if isinstance(rates, torch.Tensor) else rates)]
    out: list[float] = []
    prev = 1.0
    for i, p in enumerate(values):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"synthetic acceptance rate[{i}]={p} outside [0, 1]")
        out.append(0.0 if prev == 0.0 else p / prev)
        prev = p
    return torch.tensor(out, dtype=torch.float32)


def synthetic_rates_from_length(length: float, num_speculative_steps: int) -> list[float]:
    """Unconditional rates for a mean acceptance length L (vLLM ``synthetic_acceptance_length``).

    ``[1.0] * floor(L - 1) + [frac(L - 1)] + [0.0] * rest``, truncated/padded to K entries
    (spec §1.6). Feed the result to :func:`unconditional_to_conditional_rates`.

    Raises:
        ValueError: ``K < 0`` or ``L`` outside ``[1, K + 1]``.
    """
    k = num_speculative_steps
    if k < 0:
        raise ValueError(f"num_speculative_steps={k} < 0")
    if not 1.0 <= length <= k + 1:
        raise ValueError(f"synthetic acceptance length {length} outside [1, {k + 1}]")
    x = float(length) - 1.0
    whole = math.floor(x)
    rates = [1.0] * whole + [x - whole]
    rates += [0.0] * max(0, k - len(rates))
    return rates[:k]


# --------------------------------------------------------------------------------------------
# greedy verification
# --------------------------------------------------------------------------------------------


def _check_int(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...], dim: int = 1) -> None:
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {dtypes}, got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")


_INTS = (torch.int32, torch.int64)


def rejection_sample_greedy(
    target_logits: torch.Tensor,
    draft_sampled: torch.Tensor,
    cu_num_logits: torch.Tensor,
    pos: torch.Tensor,
    idx_mapping: torch.Tensor,
    expanded_local_pos: torch.Tensor,
    seed: torch.Tensor,
    num_speculative_steps: int,
    synthetic_conditional_rates: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM ``rejection_sample`` restricted to greedy rows (spec §1.2-§1.6, §2).

    Request ``r`` owns logits rows ``[cu[r], cu[r+1])``; ``n = cu[r+1] - cu[r] - 1`` drafts. Draft
    ``i`` is ``d = draft_sampled[cu[r] + i + 1]`` (one row ahead) and is verified by row
    ``cu[r] + i`` with target argmax ``t`` (:func:`argmax`, i.e. design §2's order; equal to vLLM's
    8192-block argmax for rows without NaN). Draft ``i`` is accepted iff all earlier drafts were,
    ``d >= 0`` (``-1`` placeholders are never accepted and end verification), and

    * greedy: ``t == d``;
    * synthetic (``synthetic_conditional_rates`` given): ``u < rate[i]`` (strict, fp32), with
      ``u = synthetic_uniform(seed[idx_mapping[r]], pos[cu[r] + i])``.

    Accepted drafts are written as ``sampled[r, i] = d``; the first rejected position gets ``t``;
    if all ``n`` drafts are accepted, ``sampled[r, n]`` gets the argmax of the bonus row
    ``cu[r+1] - 1`` (vLLM's 1024-block argmax; same order). ``num_sampled[r] = accepted + 1``.

    Differences from vLLM: columns ``>= num_sampled[r]`` are ``-1`` (vLLM leaves them
    uninitialised); NaN rows follow design §2 (first NaN) where vLLM's answer depends on its
    reduction tree (spec §2.3-§2.4); ``expanded_local_pos`` is accepted for signature parity and
    only shape-checked (vLLM uses it solely to skip stage-A work of rows at local position >= K).

    Args:
        target_logits: ``[num_logits, V]`` float (bf16/fp16/fp32), unpadded full vocabulary.
        draft_sampled: int32/int64 ``[num_logits]``; slot ``cu[r]`` is the last sampled token.
        cu_num_logits: int32/int64 ``[num_reqs + 1]``, ``cu[0] == 0``, ``1 <= cu[r+1]-cu[r] <= K+1``.
        pos: int64 (or int32) ``[num_logits]`` positions.
        idx_mapping: int32/int64 ``[num_reqs]`` batch index -> request-state slot.
        expanded_local_pos: int32/int64 ``[num_logits]`` (unused, see above).
        seed: int64 ``[max_num_reqs]`` per-slot seeds, indexed through ``idx_mapping``.
        num_speculative_steps: K >= 0.
        synthetic_conditional_rates: optional fp32 ``[K]`` conditional rates (cast to fp32).

    Returns:
        ``(sampled int64 [num_reqs, K + 1], num_sampled int32 [num_reqs])`` on the logits device.

    Raises:
        ValueError: malformed shapes, dtypes or ``cu_num_logits``.
        RuntimeError: synthetic mode on CPU tensors without ``TRITON_INTERPRET=1``.
    """
    k = int(num_speculative_steps)
    if k < 0:
        raise ValueError(f"num_speculative_steps={k} < 0")
    if target_logits.dim() != 2:
        raise ValueError(f"target_logits must be 2-D, got shape {tuple(target_logits.shape)}")
    _check_int("cu_num_logits", cu_num_logits, _INTS)
    _check_int("draft_sampled", draft_sampled, _INTS)
    _check_int("pos", pos, _INTS)
    _check_int("idx_mapping", idx_mapping, _INTS)
    _check_int("expanded_local_pos", expanded_local_pos, _INTS)
    _check_int("seed", seed, _INTS)
    num_logits = target_logits.shape[0]
    num_reqs = cu_num_logits.numel() - 1
    if num_reqs < 0:
        raise ValueError("cu_num_logits must have num_reqs + 1 >= 1 entries")
    for name, t, n in (
        ("draft_sampled", draft_sampled, num_logits),
        ("pos", pos, num_logits),
        ("expanded_local_pos", expanded_local_pos, num_logits),
        ("idx_mapping", idx_mapping, num_reqs),
    ):
        if t.numel() != n:
            raise ValueError(f"{name} has {t.numel()} entries, expected {n}")
    cu = [int(c) for c in cu_num_logits.tolist()]
    if cu[0] != 0 or cu[-1] != num_logits:
        raise ValueError(f"cu_num_logits must run from 0 to num_logits={num_logits}, got {cu}")
    for r in range(num_reqs):
        if not 1 <= cu[r + 1] - cu[r] <= k + 1:
            raise ValueError(
                f"request {r} has {cu[r + 1] - cu[r]} logits rows, expected 1..K+1={k + 1}"
            )
    synthetic = synthetic_conditional_rates is not None
    rates: list[float] = []
    if synthetic_conditional_rates is not None:
        if synthetic_conditional_rates.numel() != k:
            raise ValueError(
                f"synthetic_conditional_rates has {synthetic_conditional_rates.numel()} entries, "
                f"expected K={k}"
            )
        rates = synthetic_conditional_rates.to(torch.float32).cpu().tolist()

    device = target_logits.device
    sampled = torch.full((num_reqs, k + 1), -1, dtype=torch.int64)
    num_sampled = torch.zeros(num_reqs, dtype=torch.int32)
    if num_reqs == 0:
        return sampled.to(device), num_sampled.to(device)

    target = argmax(target_logits).cpu().tolist()
    drafts = draft_sampled.cpu().tolist()
    slots = idx_mapping.cpu().to(torch.int64)
    u: list[float] = []
    if synthetic:
        req_of_row = torch.repeat_interleave(
            torch.arange(num_reqs), torch.tensor([cu[r + 1] - cu[r] for r in range(num_reqs)])
        )
        row_seed = seed.to(torch.int64)[slots.to(seed.device)[req_of_row.to(seed.device)]]
        u = synthetic_uniform(row_seed, pos.to(torch.int64).to(row_seed.device)).cpu().tolist()

    for r in range(num_reqs):
        start, end = cu[r], cu[r + 1]
        n = end - start - 1
        accepted = 0
        for i in range(n):
            d = drafts[start + i + 1]
            acc = u[start + i] < rates[i] if synthetic else target[start + i] == d
            if acc and d >= 0:
                sampled[r, i] = d
                accepted += 1
            else:
                sampled[r, i] = target[start + i]
                break
        if accepted == n:
            sampled[r, n] = target[end - 1]  # bonus row
        num_sampled[r] = accepted + 1
    return sampled.to(device), num_sampled.to(device)


def get_num_sampled_and_rejected(
    num_sampled: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_num_logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    prefill_len: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM ``get_num_sampled_and_rejected`` (spec §1.5), out of place.

    ``chunked = seq_lens[r] < prefill_len[idx_mapping[r]]`` (a chunked-prefill request that has
    not reached the end of its prompt); chunked requests get 0 and 0; otherwise
    ``num_rejected[r] = (cu[r+1] - cu[r]) - num_sampled[r]``.

    Unlike vLLM, which overwrites ``num_sampled`` in place and returns it, this returns new
    tensors and leaves every input untouched.

    Args:
        num_sampled: int32 ``[num_reqs]`` from :func:`rejection_sample_greedy`.
        seq_lens: int ``[num_reqs]`` (``num_computed + query_len``), batch order.
        cu_num_logits: int ``[num_reqs + 1]``.
        idx_mapping: int32/int64 ``[num_reqs]``.
        prefill_len: int ``[max_num_reqs]`` indexed by request-state slot.

    Returns:
        ``(num_sampled int32 [num_reqs], num_rejected int32 [num_reqs])`` on ``num_sampled``'s
        device.

    Raises:
        ValueError: length mismatch.
    """
    num_reqs = num_sampled.numel()
    if seq_lens.numel() != num_reqs or idx_mapping.numel() != num_reqs:
        raise ValueError(
            f"num_sampled, seq_lens, idx_mapping must have num_reqs={num_reqs} entries, got "
            f"{seq_lens.numel()} and {idx_mapping.numel()}"
        )
    if cu_num_logits.numel() != num_reqs + 1:
        raise ValueError(
            f"cu_num_logits has {cu_num_logits.numel()} entries, expected {num_reqs + 1}"
        )
    device = num_sampled.device
    ns = num_sampled.to(device=device, dtype=torch.int64)
    cu = cu_num_logits.to(device=device, dtype=torch.int64)
    plen = prefill_len.to(device=device, dtype=torch.int64)[idx_mapping.to(device).long()]
    chunked = seq_lens.to(device=device, dtype=torch.int64) < plen
    zero = torch.zeros_like(ns)
    out_sampled = torch.where(chunked, zero, ns).to(torch.int32)
    out_rejected = torch.where(chunked, zero, (cu[1:] - cu[:-1]) - ns).to(torch.int32)
    return out_sampled, out_rejected


def greedy_verify(
    full_logits: torch.Tensor,
    draft_sampled: torch.Tensor,
    cu_num_logits: torch.Tensor,
    pos: torch.Tensor,
    idx_mapping: torch.Tensor,
    expanded_local_pos: torch.Tensor,
    seed: torch.Tensor,
    num_speculative_steps: int,
    *,
    synthetic_conditional_rates: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    prefill_len: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference of ``shardmax.sharded_greedy_verify`` on the full (unpadded) logits.

    :func:`rejection_sample_greedy` followed by :func:`get_num_sampled_and_rejected` (vLLM
    ``RejectionSampler._verify`` + ``get_num_sampled_and_rejected``, spec §1.1 steps 5-6, for
    greedy/synthetic batches). Without ``seq_lens``/``prefill_len`` no request is prefilling
    (``num_rejected = num_logits_r - num_sampled``). Finally ``sampled[r, c] = -1`` for every
    ``c >= num_sampled[r]`` (final value), so chunked-prefill requests are all ``-1``.

    Returns:
        ``(sampled int64 [num_reqs, K + 1], num_sampled int32 [num_reqs],
        num_rejected int32 [num_reqs])``.

    Raises:
        ValueError: as the two functions, or only one of ``seq_lens``/``prefill_len`` given.
    """
    if (seq_lens is None) != (prefill_len is None):
        raise ValueError("seq_lens and prefill_len must be given together (or neither)")
    sampled, num_sampled = rejection_sample_greedy(
        full_logits,
        draft_sampled,
        cu_num_logits,
        pos,
        idx_mapping,
        expanded_local_pos,
        seed,
        num_speculative_steps,
        synthetic_conditional_rates,
    )
    if seq_lens is None or prefill_len is None:
        cu = cu_num_logits.to(device=num_sampled.device, dtype=torch.int64)
        num_rejected = ((cu[1:] - cu[:-1]) - num_sampled.to(torch.int64)).to(torch.int32)
    else:
        num_sampled, num_rejected = get_num_sampled_and_rejected(
            num_sampled, seq_lens, cu_num_logits, idx_mapping, prefill_len
        )
    cols = torch.arange(sampled.shape[1], device=sampled.device)
    sampled = sampled.masked_fill(cols[None, :] >= num_sampled.to(sampled.device)[:, None], -1)
    return sampled, num_sampled, num_rejected
