"""Plain-torch reference of vLLM's NON-greedy verification for one-hot (argmax) drafts.

Written from ``shared/research/sampled-verification.md`` §1.1-§1.4 (vLLM 0.33, model runner V2,
``draft_logits=None``) and ``shared/spec/vllm-semantics.md`` §1 (batch layout); paraphrase only,
no vLLM code. The conventions are those of :mod:`shardmax.reference` (argument names and dtypes,
``-1`` placeholders, ``-1`` in the columns past ``num_sampled``, chunked-prefill rule); greedy rows
*are* :func:`shardmax.reference.rejection_sample_greedy`.

* :func:`apply_temperature` -- ``x / T`` in fp32 per row (§1.1 step 2).
* :func:`top_k_mask` -- the exact ``(value desc, id asc)`` top-k (§1.1 step 4, §1.4).
* :func:`block_lse` -- the row LSE from per-8192-block ``(max, sumexp)`` (§1.2).
* :func:`gumbel_noise` / :func:`gumbel_argmax` -- the keyed Gumbel-max of the resample / bonus
  token (§1.3), noise from the Triton helpers of :mod:`shardmax.runtime.gumbel`.
* :func:`rejection_sample_sampled` -- vLLM ``rejection_sample`` on a batch mixing greedy and
  non-greedy requests (§1.2-§1.3).
* :func:`verify_sampled` -- the above + :func:`shardmax.reference.get_num_sampled_and_rejected`.

What is and is not claimed bit-exact against vLLM (see each function). The plug-in supports vLLM
0.32.x; the research text describes 0.33, and no difference between the two was found for anything
modelled here. Measured against vLLM **0.32.0**'s own Triton kernels (``rejection_sample``,
``apply_temperature``, ``gumbel_noised_argmax`` on CPU under ``TRITON_INTERPRET=1``,
``tests/e2e_vllm/test_vllm_sampled_parity.py``): ``num_sampled`` and every sampled token equal on
mixed greedy / T = 0.5, 0.7, 1.0, 1.3 batches with placeholders, fp32 and fp64 Gumbel -- the test's
5 batches (112 requests, 176 tokens) and a one-off sweep of 64 random batches (V 50..12000, K 1..5,
1333 requests, 2153 tokens, 820 accepted drafts; emulated TP 1..4 too): 0 differences. Top-k,
synthetic mode and the GPU backend were not part of that comparison.

* the Gumbel keys and the resample/bonus argmax: bit-exact; the noise is a pure function of
  ``(seed, pos, global id)`` whose every constant was verified against vLLM 0.32.0 (listed in
  :mod:`shardmax.runtime.gumbel`); ``tl.log`` bits are per backend (the same ``tl.log`` as vLLM's);
* ``u`` (``tl.rand``) and ``log u`` (``tl.log``): Triton's own, as vLLM (``u`` verified ``==``
  vLLM 0.32.0's ``tl_rand32``);
* the LSE: the same formula and dtypes as vLLM (fp32 per-8192-block stats, fp32 combine), but a
  different summation order than Triton's reduction tree -> not bit-exact; acceptance decisions can
  differ from vLLM on rows whose margin ``x[d] - LSE - log u`` is within an ulp or two of 0 (none
  did in the comparison above, whose margins are random);
* the temperature division: IEEE fp32 here; vLLM's Triton kernel uses Triton's default ``/``,
  which on NVIDIA lowers to an approximate division (see :func:`apply_temperature`).

Not modelled (vLLM's processing runs them before temperature/top-k, or they are other paths):
logits processors, penalties, bias, bad words, thinking budgets, min-p, top-p, draft logits,
block verification, watermarking, logprobs. NaN rows are outside the contract (research §2.1
class F) and get a documented but non-vLLM answer.
"""

from __future__ import annotations

import math

import torch

from shardmax.reference.greedy import (
    _INTS,
    _check_int,
    argmax,
    get_num_sampled_and_rejected,
    rejection_sample_greedy,
)

__all__ = [
    "LSE_BLOCK",
    "apply_temperature",
    "block_lse",
    "gumbel_argmax",
    "gumbel_noise",
    "rejection_sample_sampled",
    "top_k_mask",
    "verify_sampled",
]

LSE_BLOCK = 8192
"""Vocabulary block of vLLM's per-row stats kernel (research §1.2)."""

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# --------------------------------------------------------------------------------------------
# sampling-parameter processing
# --------------------------------------------------------------------------------------------


def _row_slots(
    num_rows: int, idx_mapping: torch.Tensor, expanded_idx_mapping: torch.Tensor | None
) -> torch.Tensor:
    if expanded_idx_mapping is None:
        _check_int("idx_mapping", idx_mapping, _INTS)
        if idx_mapping.numel() != num_rows:
            raise ValueError(
                f"without expanded_idx_mapping, idx_mapping must have one entry per logits row "
                f"({num_rows}), got {idx_mapping.numel()}"
            )
        return idx_mapping.cpu().to(torch.int64)
    _check_int("expanded_idx_mapping", expanded_idx_mapping, _INTS)
    if expanded_idx_mapping.numel() != num_rows:
        raise ValueError(
            f"expanded_idx_mapping has {expanded_idx_mapping.numel()} entries, expected {num_rows}"
        )
    return expanded_idx_mapping.cpu().to(torch.int64)


def _per_slot(name: str, t: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D [max_num_reqs], got shape {tuple(t.shape)}")
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= t.numel()):
        raise ValueError(
            f"{name} has {t.numel()} slots but the mapping refers to slot range "
            f"[{int(slots.min())}, {int(slots.max())}]"
        )
    return t.cpu()[slots]


def apply_temperature(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    idx_mapping: torch.Tensor,
    expanded_idx_mapping: torch.Tensor | None = None,
) -> torch.Tensor:
    """vLLM's temperature step (research §1.1 step 2): ``x / T`` in fp32, row by row.

    Row ``j`` uses ``T = temperature[slot_j]`` with ``slot_j = expanded_idx_mapping[j]`` (or
    ``idx_mapping[j]`` when ``expanded_idx_mapping`` is None, i.e. one logits row per request, the
    plain sampler's layout). Rows with ``T == 0`` (greedy) or ``T == 1`` are left untouched (only
    upcast); every other row is ``x.float() / T`` with ``T`` in fp32.

    Bit-exactness: torch's fp32 ``/`` is IEEE round-to-nearest, which is what the Triton
    interpreter computes for vLLM's kernel. On NVIDIA GPUs, Triton lowers the default fp32 ``/``
    (vLLM does not use ``tl.div_rn`` here, research §1.1; nor does 0.32.0's ``_temperature_kernel``)
    to PTX ``div.full.f32`` -- an approximate division (<= 2 ulp) -- as seen in the Triton sources'
    ``DivFOp`` lowering (UNVERIFIED on GPU for the Triton shipped with vLLM 0.32/0.33; on the
    interpreter this function equals vLLM 0.32.0's kernel bit for bit, see the parity test). So on GPU, processed values may differ from
    this reference by an ulp or two; a GPU parity test must apply the temperature with a Triton
    kernel using the same operator (as the sharded design does, §2.1), not with this function.

    Also differing from vLLM, without effect on values: vLLM leaves the chunk in the model dtype
    when no request needs processing (§1.1, §1.5); this always returns a fp32 copy (bf16/fp16 ->
    fp32 is exact).

    Args:
        logits: ``[num_logits, V]`` float (bf16/fp16/fp32; fp64 is rounded to fp32).
        temperature: float ``[max_num_reqs]`` per request-state slot (cast to fp32).
        idx_mapping: int32/int64 ``[num_reqs]`` (see above for its role without the expansion).
        expanded_idx_mapping: int32/int64 ``[num_logits]`` slot of every logits row, or None.

    Returns:
        New fp32 ``[num_logits, V]`` tensor on ``logits``' device.

    Raises:
        ValueError: shapes/dtypes, a slot outside ``temperature``, or a negative / NaN
            temperature on a used slot.
    """
    if logits.dim() != 2 or logits.dtype not in _FLOATS:
        raise ValueError(
            f"logits must be a 2-D float tensor, got {logits.dtype} {tuple(logits.shape)}"
        )
    if temperature.dtype not in _FLOATS:
        raise ValueError(f"temperature must be a float tensor, got {temperature.dtype}")
    slots = _row_slots(logits.shape[0], idx_mapping, expanded_idx_mapping)
    t_row = _per_slot("temperature", temperature.to(torch.float32), slots)
    if bool((t_row < 0).any()) or bool(torch.isnan(t_row).any()):
        raise ValueError(f"temperature must be >= 0 and not NaN, got {t_row.tolist()}")
    x = logits.to(torch.float32).clone()
    scale = (t_row != 0) & (t_row != 1)
    if bool(scale.any()):
        rows = scale.nonzero().flatten().to(x.device)
        x[rows] = x[rows] / t_row[scale].to(x.device)[:, None]  # fp32 / fp32, IEEE
    return x


def top_k_mask(logits_fp32: torch.Tensor, k_per_row: torch.Tensor) -> torch.Tensor:
    """Exact top-k mask: keep the ``k`` first ids of the ``(value desc, id asc)`` order.

    Research §1.1 step 4 / §1.4: vLLM's monolithic top-k kernel searches a pivot between the k-th
    value and the next distinct value and keeps the ties at the k-th value **in index order**, so
    a converged search keeps exactly ``k`` ids: every id with a value above the k-th value ``v_k``,
    then the lowest ids among those equal to ``v_k`` until ``k`` are kept. That converged result is
    what this function computes (the non-converged search, which the sharded design guards
    against, is not modelled). ``-0.0 == +0.0`` is a tie. Everything else becomes ``-inf``.

    Rows with ``k <= 0`` or ``k >= V`` are unchanged (top-k disabled: vLLM's ``top_k`` of 0 / -1
    means "all tokens"). A row with fewer than ``k`` finite values keeps its ``-inf`` entries
    (they stay ``-inf``).

    Args:
        logits_fp32: ``[B, V]`` fp32 (the temperature-processed logits).
        k_per_row: int32/int64 ``[B]``.

    Returns:
        New fp32 ``[B, V]`` tensor, same device.

    Raises:
        ValueError: shapes/dtypes, or NaN in a row whose top-k is active (outside the contract:
            vLLM's pivot search on NaN rows is undefined; research routes them to fallback).
    """
    if logits_fp32.dim() != 2 or logits_fp32.dtype != torch.float32:
        raise ValueError(
            f"logits_fp32 must be 2-D fp32, got {logits_fp32.dtype} {tuple(logits_fp32.shape)}"
        )
    _check_int("k_per_row", k_per_row, _INTS)
    rows, vocab = logits_fp32.shape
    if k_per_row.numel() != rows:
        raise ValueError(f"k_per_row has {k_per_row.numel()} entries, expected {rows}")
    out = logits_fp32.clone()
    ks = k_per_row.cpu().tolist()
    for b, k in enumerate(ks):
        if k <= 0 or k >= vocab:
            continue
        row = logits_fp32[b]
        if bool(torch.isnan(row).any()):
            raise ValueError(f"row {b}: NaN in a top-k row (outside the reference's contract)")
        vk = torch.sort(row, descending=True).values[k - 1]  # the k-th largest value
        above = row > vk
        tied = row == vk
        room = k - int(above.sum())  # >= 1 by definition of vk
        tied_rank = torch.cumsum(tied.to(torch.int64), dim=0)  # 1-based rank among ties, id order
        keep = above | (tied & (tied_rank <= room))
        out[b] = torch.where(keep, row, torch.full_like(row, -math.inf))
    return out


# --------------------------------------------------------------------------------------------
# LSE
# --------------------------------------------------------------------------------------------


def block_lse(
    x_fp32: torch.Tensor, block: int = LSE_BLOCK, acc_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Row LSE the way vLLM's non-greedy acceptance builds it (research §1.2).

    Per ``block``-wide slice ``b`` of the row (ids ``[b*block, (b+1)*block)``, the last one
    short): ``max_b = max(x)``, ``sumexp_b = sum(exp(x - max_b))`` (0 when ``max_b == -inf``); then
    ``M = max_b max_b`` and ``LSE = M + log(sum_b sumexp_b * exp(max_b - M))``.

    With ``acc_dtype=torch.float32`` (default) every step is fp32 like vLLM's kernels, but the
    additions run in torch's order, not Triton's reduction tree (per-thread chains, warp shuffles,
    set by the load layout, §1.4): **bit-exactness against vLLM's LSE is NOT claimed** (vLLM's
    LSE is itself only accurate to ~1.33 ulp and changes with the dtype of its batch, §1.5).
    ``acc_dtype=torch.float64`` upcasts the fp32 inputs and evaluates everything in fp64: the
    exact-arithmetic reference (to ~1e-16 relative), for judging ulp-margin decisions.

    Rows of all ``-inf`` give NaN (``exp(-inf - (-inf))``), as the formula does; a NaN LSE makes
    the acceptance test false (rejection), which is also what any ``-inf`` LSE would give.

    Args:
        x_fp32: ``[B, V]`` fp32 processed logits (``V >= 1``; ``B`` may be 0).
        block: block width (vLLM: 8192); any ``>= 1``.
        acc_dtype: ``torch.float32`` or ``torch.float64``.

    Returns:
        ``[B]`` LSE in ``acc_dtype``, same device.

    Raises:
        ValueError: not 2-D fp32, ``V == 0``, ``block < 1``, or another ``acc_dtype``.
    """
    if x_fp32.dim() != 2 or x_fp32.dtype != torch.float32:
        raise ValueError(f"x_fp32 must be 2-D fp32, got {x_fp32.dtype} {tuple(x_fp32.shape)}")
    if acc_dtype not in (torch.float32, torch.float64):
        raise ValueError(f"acc_dtype must be float32 or float64, got {acc_dtype}")
    rows, vocab = x_fp32.shape
    if vocab == 0:
        raise ValueError("block_lse needs V >= 1")
    if block < 1:
        raise ValueError(f"block={block} < 1")
    x = x_fp32.to(acc_dtype)
    nblocks = -(-vocab // block)
    pad = nblocks * block - vocab
    if pad:
        x = torch.cat([x, torch.full((rows, pad), -math.inf, dtype=acc_dtype, device=x.device)], 1)
    xb = x.view(rows, nblocks, block)
    max_b = xb.amax(dim=2)  # [B, nb]
    sumexp_b = torch.exp(xb - max_b[:, :, None]).sum(dim=2)
    sumexp_b = torch.where(max_b == -math.inf, torch.zeros_like(sumexp_b), sumexp_b)
    m = max_b.amax(dim=1)  # [B]
    total = (sumexp_b * torch.exp(max_b - m[:, None])).sum(dim=1)
    return m + torch.log(total)


# --------------------------------------------------------------------------------------------
# Gumbel-max
# --------------------------------------------------------------------------------------------


def gumbel_noise(
    seed: int | torch.Tensor,
    pos: int | torch.Tensor,
    token_ids: torch.Tensor,
    fp64: bool = False,
) -> torch.Tensor:
    """vLLM's keyed Gumbel noise ``G(seed, pos, id)`` (research §1.3), via :mod:`shardmax.runtime.gumbel`.

    A pure function of ``(seed, pos, global token id)``: any slice of the vocabulary evaluated
    with its global ids gives the same numbers as the full row. fp32 mode: ``G`` in
    ``[-2.8116, 22.875]``; fp64 mode: ``G`` in ``[-3.623, 36.74]``. The formula and its constants
    (verified against vLLM 0.32.0) are documented in :mod:`shardmax.runtime.gumbel`.

    Args:
        seed: the request's int64 seed (Python int, one-element tensor, or int ``[N]``).
        pos: the int64 position of the resample/bonus row (same forms).
        token_ids: int32/int64 ``[N]`` global token ids.
        fp64: ``use_fp64_gumbel``.

    Returns:
        fp32 ``[N]`` (fp64 ``[N]`` when ``fp64``), on ``token_ids``' device.

    Raises:
        ValueError: wrong dtype/shape. RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.
    """
    from shardmax.runtime.gumbel import gumbel_noise_triton

    return gumbel_noise_triton(seed, pos, token_ids, fp64)


def gumbel_argmax(
    logits_row: torch.Tensor,
    seed: int,
    pos: int,
    masked_id: int | None = None,
    fp64: bool = False,
) -> int:
    """The recovered / bonus token of a non-greedy row (research §1.3).

    ``key_v = x_v + G(seed, pos, v)`` over the processed row (no temperature here: it is already
    in ``x``), in fp32 (fp64 mode: ``float64(x_v) + G64``), with ``x[masked_id] := -inf`` first
    when ``masked_id`` is given (the rejected one-hot draft: ``max(p - q, 0)`` normalised is ``p``
    without it). The winner is the largest key, lowest id on ties (``-0.0 == +0.0``): vLLM's
    1024-block ``tl.max`` + ``tl.argmax`` with left tie-break is partition-free on such rows.

    NaN keys are treated as ``-inf`` (vLLM demotes NaN *block* maxima to ``-inf``, but which id of
    a block survives a NaN depends on Triton's reduction tree; not claimed). A row of all ``-inf``
    keys gives id 0.

    Args:
        logits_row: ``[V]`` float processed logits (fp32 in vLLM; bf16/fp16 upcast exactly).
        seed: the request's int64 seed.
        pos: the row's int64 position.
        masked_id: id in ``[0, V)`` to exclude, or None.
        fp64: ``use_fp64_gumbel``.

    Returns:
        The token id (Python int in ``[0, V)``).

    Raises:
        ValueError: not 1-D float, ``V == 0``, or ``masked_id`` out of range.
        RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.
    """
    if logits_row.dim() != 1 or logits_row.dtype not in _FLOATS:
        raise ValueError(
            f"logits_row must be a 1-D float tensor, got {logits_row.dtype} "
            f"{tuple(logits_row.shape)}"
        )
    vocab = logits_row.numel()
    if vocab == 0:
        raise ValueError("gumbel_argmax needs V >= 1")
    x = logits_row.to(torch.float64 if fp64 else torch.float32).clone()
    if masked_id is not None:
        if not 0 <= masked_id < vocab:
            raise ValueError(f"masked_id={masked_id} outside [0, {vocab})")
        x[masked_id] = -math.inf
    ids = torch.arange(vocab, dtype=torch.int64, device=x.device)
    keys = x + gumbel_noise(seed, pos, ids, fp64)
    keys = torch.where(torch.isnan(keys), torch.full_like(keys, -math.inf), keys)
    return int(argmax(keys[None, :])[0])


# --------------------------------------------------------------------------------------------
# verification
# --------------------------------------------------------------------------------------------


def rejection_sample_sampled(
    target_logits: torch.Tensor,
    draft_sampled: torch.Tensor,
    cu_num_logits: torch.Tensor,
    pos: torch.Tensor,
    idx_mapping: torch.Tensor,
    expanded_local_pos: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    num_speculative_steps: int,
    *,
    top_k: torch.Tensor | None = None,
    synthetic_conditional_rates: torch.Tensor | None = None,
    use_fp64_gumbel: bool = False,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM ``rejection_sample`` for a batch of greedy and non-greedy requests, one-hot drafts.

    Layout as :func:`shardmax.reference.rejection_sample_greedy` (spec §1.2-§1.4): request ``r``
    owns rows ``[cu[r], cu[r+1])``, ``n = cu[r+1] - cu[r] - 1`` drafts, draft ``i`` is
    ``d = draft_sampled[cu[r] + i + 1]`` verified by row ``cu[r] + i``; the last row is the bonus
    row. ``slot = idx_mapping[r]``, ``T = temperature[slot]`` (fp32), ``s = seed[slot]``.

    * **Greedy requests** (``T == 0``): exactly
      :func:`~shardmax.reference.rejection_sample_greedy` (its rows are taken from a call on the
      whole batch; temperature and top-k leave a greedy row's argmax unchanged).
    * **Non-greedy requests**: the processed logits ``x`` = :func:`apply_temperature`, then
      :func:`top_k_mask` with ``k = top_k[slot]`` (research §1.1 steps 2 and 4). For ``i = 0..n-1``:

      - ``d < 0`` (placeholder) ends verification -- no test, treated as the stopping point
        (research §1.2);
      - ``u, log u`` = Triton's ``tl.rand(s, pos[row])`` clamped to ``>= 4.66e-10`` and ``tl.log``
        (:func:`shardmax.runtime.gumbel.acceptance_uniform_triton`; ``u`` equals
        :func:`shardmax.reference.synthetic_uniform`);
      - accept iff ``fp32(x[d] - LSE) > log u`` with ``LSE`` = :func:`block_lse` (fp32, 8192
        blocks) of the processed row and ``x[d]`` the processed logit (``-inf`` if top-k masked
        it -> rejected); synthetic mode: accept iff ``u < rate[i]`` (fp32, strict; no LSE);
      - accepted drafts are written ``sampled[r, i] = d``; stop at the first rejection.

      Then with ``a`` accepted drafts the row ``j = cu[r] + a`` is resampled: if ``j`` is not the
      bonus row and ``d_j = draft_sampled[j + 1]`` is a valid draft, ``x[d_j] := -inf``; the token
      is :func:`gumbel_argmax` of that row with ``(s, pos[j])`` (fp64 keys if
      ``use_fp64_gumbel``), written to ``sampled[r, a]``. ``num_sampled[r] = a + 1``.

    Columns ``>= num_sampled[r]`` are ``-1`` (vLLM leaves them uninitialised).

    Exactness vs vLLM (see the module docstring): tokens of the Gumbel-max are exact given the
    noise; acceptance decisions can differ from vLLM's on ulp-margin rows (LSE summation order;
    GPU temperature division); NaN rows are outside the contract.

    Args:
        target_logits: ``[num_logits, V]`` float (bf16/fp16/fp32), raw (unprocessed) target logits.
        draft_sampled: int32/int64 ``[num_logits]``; slot ``cu[r]`` is the last sampled token.
        cu_num_logits: int32/int64 ``[num_reqs + 1]``, ``cu[0] == 0``, ``1 <= cu[r+1]-cu[r] <= K+1``.
        pos: int32/int64 ``[num_logits]`` positions.
        idx_mapping: int32/int64 ``[num_reqs]`` batch index -> request-state slot.
        expanded_local_pos: int32/int64 ``[num_logits]`` (shape-checked only, as in the greedy
            reference).
        temperature: float ``[max_num_reqs]`` per slot (cast to fp32); 0 = greedy.
        seed: int64 ``[max_num_reqs]`` per slot.
        num_speculative_steps: K >= 0.
        top_k: optional int32/int64 ``[max_num_reqs]`` per slot; ``k <= 0`` or ``k >= V`` = off.
        synthetic_conditional_rates: optional fp32 ``[K]`` conditional rates (synthetic mode, for
            greedy and non-greedy rows alike).
        use_fp64_gumbel: vLLM's ``use_fp64_gumbel``.
        top_p, min_p: optional float ``[max_num_reqs]`` per slot (``p >= 1`` / ``min_p <= 0``:
            off). With either, the processed row is masked by
            :func:`shardmax.reference.nucleus.exact_nucleus_keep` (min-p, then top-k, then the
            EXACT nucleus -- not vLLM's approximate top-p search, research §1.5).

    Returns:
        ``(sampled int64 [num_reqs, K + 1], num_sampled int32 [num_reqs])`` on the logits device.

    Raises:
        ValueError: malformed shapes/dtypes/``cu_num_logits`` (as the greedy reference), a slot
            outside ``temperature``/``seed``/``top_k``, negative/NaN temperature, a draft id
            ``>= V`` in a non-greedy request, NaN in an active top-k row.
        RuntimeError: CPU tensors without ``TRITON_INTERPRET=1`` (non-greedy or synthetic rows).
    """
    # Greedy path on the whole batch: also validates the layout arguments.
    greedy_sampled, greedy_num = rejection_sample_greedy(
        target_logits,
        draft_sampled,
        cu_num_logits,
        pos,
        idx_mapping,
        expanded_local_pos,
        seed,
        num_speculative_steps,
        synthetic_conditional_rates,
    )
    device = target_logits.device
    num_reqs = cu_num_logits.numel() - 1
    vocab = target_logits.shape[1]
    if temperature.dtype not in _FLOATS or temperature.dim() != 1:
        raise ValueError(
            f"temperature must be a 1-D float tensor, got {temperature.dtype} "
            f"{tuple(temperature.shape)}"
        )
    if top_k is not None:
        _check_int("top_k", top_k, _INTS)
    slots = idx_mapping.cpu().to(torch.int64)
    t_req = _per_slot("temperature", temperature.to(torch.float32), slots)
    _per_slot("seed", seed, slots)
    greedy = (t_req == 0).tolist()
    sampled = greedy_sampled.cpu().clone()
    num_sampled = greedy_num.cpu().clone()
    nongreedy = [r for r in range(num_reqs) if not greedy[r]]
    if not nongreedy:
        return sampled.to(device), num_sampled.to(device)

    cu = [int(c) for c in cu_num_logits.tolist()]
    counts = torch.tensor([cu[r + 1] - cu[r] for r in range(num_reqs)], dtype=torch.int64)
    row_slot = torch.repeat_interleave(slots, counts)
    x = apply_temperature(target_logits, temperature, idx_mapping, row_slot).cpu()
    if top_p is not None or min_p is not None:
        from shardmax.reference.nucleus import exact_nucleus_keep

        row_greedy = torch.repeat_interleave(t_req == 0, counts)
        k_row = torch.zeros(x.shape[0], dtype=torch.int64)
        if top_k is not None:
            k_row = _per_slot("top_k", top_k, row_slot).to(torch.int64)
        p_row = torch.ones(x.shape[0], dtype=torch.float64)
        if top_p is not None:
            p_row = _per_slot("top_p", top_p.to(torch.float64), row_slot)
        m_row = torch.zeros(x.shape[0], dtype=torch.float32)
        if min_p is not None:
            m_row = _per_slot("min_p", min_p.to(torch.float32), row_slot)
        # greedy rows: untouched
        k_row = torch.where(row_greedy, torch.zeros_like(k_row), k_row)
        p_row = torch.where(row_greedy, torch.ones_like(p_row), p_row)
        m_row = torch.where(row_greedy, torch.zeros_like(m_row), m_row)
        keep = exact_nucleus_keep(x, p_row, k_row, m_row)
        x = torch.where(keep, x, torch.full_like(x, -math.inf))
    elif top_k is not None:
        k_row = _per_slot("top_k", top_k, row_slot).to(torch.int64)
        row_greedy = torch.repeat_interleave(t_req == 0, counts)
        k_row = torch.where(row_greedy, torch.zeros_like(k_row), k_row)  # greedy rows: untouched
        x = top_k_mask(x, k_row)
    drafts = draft_sampled.cpu().to(torch.int64).tolist()
    seeds = seed.cpu().to(torch.int64)
    row_seed = seeds[row_slot]
    pos64 = pos.cpu().to(torch.int64)
    rates: list[float] = []
    synthetic = synthetic_conditional_rates is not None
    if synthetic_conditional_rates is not None:
        rates = synthetic_conditional_rates.to(torch.float32).cpu().tolist()

    # Rows that verify a draft of a non-greedy request: u / log u, and the LSE if not synthetic.
    verify_rows = [cu[r] + i for r in nongreedy for i in range(cu[r + 1] - cu[r] - 1)]
    for row in verify_rows:
        d = drafts[row + 1]
        if d >= vocab:
            raise ValueError(f"draft id {d} at logits row {row + 1} outside [0, V={vocab})")
    u_of: dict[int, float] = {}
    logu_of: dict[int, float] = {}
    lse_of: dict[int, float] = {}
    if verify_rows:
        from shardmax.runtime.gumbel import acceptance_uniform_triton

        vr = torch.tensor(verify_rows, dtype=torch.int64)
        # Triton helpers run where the logits live (the interpreter only on CPU tensors)
        u, log_u = acceptance_uniform_triton(row_seed[vr].to(device), pos64[vr].to(device))
        u, log_u = u.cpu(), log_u.cpu()
        u_of = dict(zip(verify_rows, u.tolist(), strict=True))
        logu_of = dict(zip(verify_rows, log_u.tolist(), strict=True))
        if not synthetic:
            lse_of = dict(zip(verify_rows, block_lse(x[vr]).tolist(), strict=True))

    f32 = torch.float32
    for r in nongreedy:
        start, end = cu[r], cu[r + 1]
        n = end - start - 1
        sampled[r] = -1
        accepted = 0
        for i in range(n):
            row = start + i
            d = drafts[row + 1]
            if d < 0:
                break  # placeholder: verification ends (non-greedy rule)
            if synthetic:
                acc = u_of[row] < rates[i]  # both exactly representable in fp32
            else:
                # fp32(x[d] - LSE) > log u, every operand fp32 as in vLLM's kernel
                xd = torch.tensor(float(x[row, d]), dtype=f32)
                diff = xd - torch.tensor(lse_of[row], dtype=f32)
                acc = bool(diff > torch.tensor(logu_of[row], dtype=f32))
            if not acc:
                break
            sampled[r, i] = d
            accepted += 1
        j = start + accepted
        masked = None
        if j != end - 1 and drafts[j + 1] >= 0:
            masked = drafts[j + 1]
        sampled[r, accepted] = gumbel_argmax(
            x[j].to(device), int(row_seed[j]), int(pos64[j]), masked, use_fp64_gumbel
        )
        num_sampled[r] = accepted + 1
    return sampled.to(device), num_sampled.to(device)


def verify_sampled(
    full_logits: torch.Tensor,
    draft_sampled: torch.Tensor,
    cu_num_logits: torch.Tensor,
    pos: torch.Tensor,
    idx_mapping: torch.Tensor,
    expanded_local_pos: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    num_speculative_steps: int,
    *,
    top_k: torch.Tensor | None = None,
    synthetic_conditional_rates: torch.Tensor | None = None,
    use_fp64_gumbel: bool = False,
    seq_lens: torch.Tensor | None = None,
    prefill_len: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`rejection_sample_sampled` + ``get_num_sampled_and_rejected`` (spec §1.1 steps 5-6).

    The non-greedy counterpart of :func:`shardmax.reference.greedy_verify`, same rules: without
    ``seq_lens``/``prefill_len`` no request is prefilling (``num_rejected = num_logits_r -
    num_sampled``); otherwise chunked-prefill requests (``seq_lens[r] < prefill_len[slot]``) get
    ``num_sampled = num_rejected = 0``. Finally ``sampled[r, c] = -1`` for every
    ``c >= num_sampled[r]`` (so chunked-prefill requests are all ``-1``).

    Returns:
        ``(sampled int64 [num_reqs, K + 1], num_sampled int32 [num_reqs],
        num_rejected int32 [num_reqs])`` on the logits device.

    Raises:
        ValueError: as :func:`rejection_sample_sampled` and
            :func:`~shardmax.reference.get_num_sampled_and_rejected`, or only one of
            ``seq_lens``/``prefill_len`` given.
        RuntimeError: as :func:`rejection_sample_sampled`.
    """
    if (seq_lens is None) != (prefill_len is None):
        raise ValueError("seq_lens and prefill_len must be given together (or neither)")
    sampled, num_sampled = rejection_sample_sampled(
        full_logits,
        draft_sampled,
        cu_num_logits,
        pos,
        idx_mapping,
        expanded_local_pos,
        temperature,
        seed,
        num_speculative_steps,
        top_k=top_k,
        synthetic_conditional_rates=synthetic_conditional_rates,
        use_fp64_gumbel=use_fp64_gumbel,
        top_p=top_p,
        min_p=min_p,
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
