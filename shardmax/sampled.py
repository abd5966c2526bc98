"""Sharded verification of sampled (temperature, top-k/p, min-p) and greedy requests.

Research ``sampled-verification.md`` §1.2-§1.3 (what vLLM does) and §2.1-§2.4 (design). Data flow
of one call on one TP rank, one collective per step::

    local logits [rows, W] --sampled_record_<dtype>_b<block>--> records [S*rows, 3|4] int64
                               (candidate step: + 1 word, and [S*rows, C] int64 candidates)
    flat buffer [1, n] --all_gather(dim=0)--> [tp, n]   (24*S B per row and rank; fp64: 32*S B;
                                                         candidate step: +8*S*(1 + C) B)
    [tp, n] (candidate step: --sampled_merge--> merged [rows, C] (+ keep, unsafe for top-p/min-p))
        --sampled_finish_tp<N>_allgather--> sampled, num_sampled, num_rejected, fallback

A candidate step is one with top-k, top-p or min-p requests.

The record kernel's tile, ``S`` programs per row, warps and ``C`` come from the dispatcher
(:func:`record_launch`: the tuned ``generated/<arch>/sampled.json``, else the built-in rule:
1 program per row for a batch that fills the GPU on its own, up to 32 for a few rows, C = 64);
the finish combines the ``N = tp * S`` records of a row exactly as it combines ranks. None of
them changes a token or count of a request that is not flagged.

Exactness (vs :func:`shardmax.reference_sampled.verify_sampled` and vLLM):

* greedy requests (``T == 0``): exactly :func:`shardmax.reference.greedy_verify`;
* Gumbel resample / bonus tokens and synthetic acceptance: exact (partition-free keys);
* temperature acceptance, fast mode: the global LSE is rebuilt from per-rank ``(max, sumexp)``
  in fp64, so it is not vLLM's fp32 bits; every row whose decision could differ (interval test,
  research §2.3) sets ``fallback`` for its request -- all other decisions are vLLM's;
* temperature acceptance, strict mode: vLLM's fp32 LSE bits (:mod:`shardmax.strict`: the strict
  extras ride in the same all_gather after the records), every decision is vLLM's;
* top-k requests (``0 < k < C``, the step's candidates): the kept set comes from the top-C packed
  keys of ``x`` of every record split of every rank (selected in the record kernel's second
  pass), merged by ``sampled_merge`` into an exact prefix of the row's (value desc, id asc)
  order -- vLLM's converged top-k, ties at the k-th value by lowest id; acceptance as above with
  the kept set's LSE; the Gumbel token over the kept ids. Rows whose k-th value is too close to
  the next distinct one for vLLM's pivot search to be sure to converge (research §2.4:
  ``v_k - v' <= 3.5e-4 * (max - min_finite)``), or whose kept set reaches past the exact prefix,
  set ``fallback``;
* top-p / min-p requests: the kept count and the guard come from ``sampled_merge`` (the exact
  nucleus of the merged prefix, see :func:`sharded_verify`);
* requests with NaN / +inf / no finite logit in a used row, and requests with ``k >= C`` are
  returned with ``fallback = True``.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any, NamedTuple

import torch
import triton

from shardmax import kernels
from shardmax.collectives import Collective, resolve
from shardmax.geometry import check_geometry
from shardmax.ops import validate_verify_inputs
from shardmax.reference_nucleus import SPLIT_PIPELINE_MAX_ROWS
from shardmax.strict import (
    StrictPlan,
    extras_words,
    rank_extras,
    rebuild_block_stats,
    replay_kept,
    strict_lse,
)
from shardmax.validation import SUPPORTED_DTYPES, check_index_tensor, value_checks_enabled
from shardmax.variants import VariantKey, build_name, finish_variant, parse_name

__all__ = [
    "DEFAULT_RECORD_BLOCK",
    "FallbackReason",
    "VerifyResult",
    "record_variant",
    "sharded_verify",
]

DEFAULT_RECORD_BLOCK = 2048
"""Record-kernel tile of the built-in default (:func:`shardmax.dispatch.builtin_default`); any
block gives the same keys."""
MAX_RECORD_SPLITS = 32
TOPK_CANDIDATES = 64
"""C of the built-in default: candidates per row and record split (a power of two). Requests
with top-k ``k < C`` run sharded, larger ``k`` come back in ``fallback``. The dispatcher's
selection (``launch["candidates"]``, one of :data:`CANDIDATE_CHOICES`) sets the C of a step; it
depends only on the step's shape, so a captured CUDA graph never reallocates."""
CANDIDATE_CHOICES = (32, 64, 128)
"""The C a table row may select (the tuner's ``candidates`` axis)."""


def candidate_capacity(candidates: int) -> int:
    """Keys at or above a split's selection threshold the record kernel can hold (``4 C``, a
    power of two); beyond it the split's candidates are unknown and the rows that need them fall
    back."""
    return 4 * candidates


def selection_groups(candidates: int) -> int:
    """Lane groups of the record kernel's candidate selection (``2 C``): the threshold is the
    C-th largest group maximum, so about ``C + C**2 / (2 * groups)`` (``1.25 C``) keys of a split
    reach it on unstructured rows, well within :func:`candidate_capacity`."""
    return 2 * candidates


CANDIDATE_CAPACITY = candidate_capacity(TOPK_CANDIDATES)
""":func:`candidate_capacity` of the default C (256)."""
SELECTION_GROUPS = selection_groups(TOPK_CANDIDATES)
""":func:`selection_groups` of the default C (128)."""


def sorting_network(device: torch.device) -> bool:
    """Whether the selection kernels use Triton's bitonic ``tl.topk`` (compiled, GPU) or rank
    counting (the CPU interpreter, where the bitonic network is far slower); both give the
    same keys (``templates/_select.j2``)."""
    return device.type != "cpu"


MODES = ("fast", "strict")


class FallbackReason(IntEnum):
    """Why :func:`sharded_verify` returned a request with ``fallback`` (``VerifyResult.reason``,
    int8 per request). Codes 1-7 are the top-p / min-p guard's
    (:class:`shardmax.reference_nucleus.GuardReason`, same numbers); the request carries the
    reason of the first row its decision used that failed, or ``TOPK_CAPACITY``."""

    NONE = 0
    NUCLEUS_NAN = 1  # (GuardReason.NAN; sharded_verify reports such rows as NON_FINITE)
    NUCLEUS_NOT_COVERED = 2  # the nucleus or the first excluded value is past the candidates
    NUCLEUS_MASS_MARGIN = 3  # the mass at the boundary is within rounding of p
    NUCLEUS_TIE_STRADDLE = 4  # the last kept and the first excluded value are equal
    NUCLEUS_NOT_CONVERGED = 5  # the boundary gap is below vLLM's search resolution
    MIN_P_NOT_COVERED = 6  # min-p survivors may lie past the candidates
    MIN_P_MARGIN = 7  # a value within 2 ulp of the min-p threshold
    LSE_MARGIN = 8  # an acceptance test within the LSE error bound (interval test, §2.3)
    NON_FINITE = 9  # a used row holds NaN / +inf, no finite logit or no finite kept value
    TOPK_CAPACITY = 10  # top-k >= the step's C (outputs -1 / 0 / 0)
    TOPK_BOUNDARY = 11  # k-th value too close to the next one, past the exact prefix, or no
    # finite kept value known (e.g. a record split's candidates overflowed)
    NO_KEPT_TOKEN = 12  # the resampled row has no kept id left to draw


class VerifyResult(NamedTuple):
    """Outputs of :func:`sharded_verify` (identical on every rank)."""

    sampled: torch.Tensor  # int64 [num_reqs, K + 1], -1 at columns >= num_sampled
    num_sampled: torch.Tensor  # int32 [num_reqs]
    num_rejected: torch.Tensor  # int32 [num_reqs]
    fallback: torch.Tensor  # bool [num_reqs]: verify these requests the native way
    reason: torch.Tensor  # int8 [num_reqs]: FallbackReason, 0 where fallback is False


def record_variant(dtype: torch.dtype, block: int = DEFAULT_RECORD_BLOCK) -> str:
    """Name of the record kernel for a logits dtype and tile width."""
    return build_name(VariantKey("sampled_record", dtype=SUPPORTED_DTYPES[dtype], block=block))


def record_words(use_fp64_gumbel: bool) -> int:
    """int64 words per record: key, (m, s), (x[d], flag) + the key's id word in fp64 mode."""
    return 4 if use_fp64_gumbel else 3


class _Checked(NamedTuple):
    logits: torch.Tensor
    vocab_start: int
    num_valid: int
    vocab: int
    temperature: torch.Tensor  # fp32 [max_num_reqs]
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None


def validate_sampled_inputs(
    local_logits: torch.Tensor,
    draft_sampled: torch.Tensor,
    cu_num_logits: torch.Tensor,
    pos: torch.Tensor,
    idx_mapping: torch.Tensor,
    expanded_local_pos: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    num_speculative_steps: int,
    vocab_start: int,
    num_valid: int | None,
    top_k: torch.Tensor | None,
    synthetic_conditional_rates: torch.Tensor | None,
    seq_lens: torch.Tensor | None,
    prefill_len: torch.Tensor | None,
    use_fp64_gumbel: bool,
    mode: str,
    coll: Collective,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> _Checked:
    """Every check of :func:`sharded_verify` (those of the greedy op + sampling state)."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    if not isinstance(use_fp64_gumbel, bool):
        raise TypeError(f"use_fp64_gumbel: expected a bool, got {type(use_fp64_gumbel).__name__}")
    logits, vocab_start, num_valid = validate_verify_inputs(
        local_logits,
        draft_sampled,
        cu_num_logits,
        pos,
        idx_mapping,
        expanded_local_pos,
        seed,
        num_speculative_steps,
        vocab_start,
        num_valid,
        synthetic_conditional_rates,
        seq_lens,
        prefill_len,
        coll,
    )
    dev = logits.device
    if not isinstance(temperature, torch.Tensor):
        raise TypeError(f"temperature: expected a torch.Tensor, got {type(temperature).__name__}")
    if temperature.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"temperature: expected a float tensor, got {temperature.dtype}")
    if temperature.dim() != 1:
        raise ValueError(f"temperature: expected 1 dim, got shape {tuple(temperature.shape)}")
    if temperature.device != dev:
        raise ValueError(f"temperature: on {temperature.device}, expected {dev}")
    if top_k is not None:
        top_k = check_index_tensor("top_k", top_k, dev)
    probs: dict[str, torch.Tensor] = {}
    for name, t in (("top_p", top_p), ("min_p", min_p)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise TypeError(f"{name}: expected a float tensor, got {t.dtype}")
        if t.dim() != 1 or t.device != dev:
            raise ValueError(
                f"{name}: expected a 1-D tensor on {dev}, got shape {tuple(t.shape)} on {t.device}"
            )
        probs[name] = t
    geometry = check_geometry(coll, logits, vocab_start, num_valid)
    vocab = max(s + n for s, n in geometry)
    temp32 = temperature.to(torch.float32).contiguous()
    if value_checks_enabled(dev) and idx_mapping.numel():
        hi = int(idx_mapping.max())
        for name, t in (("temperature", temp32), ("top_k", top_k), *probs.items()):
            if t is not None and hi >= t.shape[0]:
                raise ValueError(
                    f"{name}: has {t.shape[0]} slots but idx_mapping refers to slot {hi}"
                )
        used = temp32[idx_mapping.long()]
        if bool((used < 0).any()) or bool(torch.isnan(used).any()):
            raise ValueError(
                f"temperature: must be >= 0 and not NaN on used slots, got {used.tolist()}"
            )
        slots = idx_mapping.long()
        if "top_p" in probs:
            tp_used = probs["top_p"][slots].double()
            if bool(((tp_used <= 0) | (tp_used > 1) | torch.isnan(tp_used)).any()):
                raise ValueError(f"top_p: must be in (0, 1] on used slots, got {tp_used.tolist()}")
        if "min_p" in probs:
            mp_used = probs["min_p"][slots].double()
            if bool(((mp_used < 0) | (mp_used > 1) | torch.isnan(mp_used)).any()):
                raise ValueError(f"min_p: must be in [0, 1] on used slots, got {mp_used.tolist()}")
    return _Checked(
        logits,
        vocab_start,
        num_valid,
        vocab,
        temp32,
        top_k,
        probs["top_p"].to(torch.float64).contiguous() if "top_p" in probs else None,
        probs["min_p"].to(torch.float32).contiguous() if "min_p" in probs else None,
    )


def chunk_needs_processing(
    idx_mapping: torch.Tensor,
    temperature: torch.Tensor,
    vocab: int,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> bool:
    """vLLM's chunk gate (``Sampler.apply_sampling_params``, research §1.1): True when a request of
    the batch needs logits processing -- ``T != 0`` and (``T != 1``, ``min_p != 0``, ``0 < k <
    V`` or ``top_p != 1``) -- so vLLM verifies an fp32 processed copy; False: it verifies the raw
    model-dtype logits. Reads the used slots on the host (a device sync). Logits processors
    (penalties, bias, bad words, custom) also make vLLM process a chunk; shardmax does not see
    them: a caller that has them passes ``logits_processed=True`` to :func:`sharded_verify`."""
    slots = idx_mapping.long()
    t = temperature[slots]
    need = t != 1.0
    if top_k is not None:
        k = top_k[slots].long()
        need |= (k > 0) & (k < vocab)
    if top_p is not None:
        need |= top_p[slots] != 1.0
    if min_p is not None:
        need |= min_p[slots] != 0.0
    return bool(((t != 0.0) & need).any())


def _row_request_slot(
    cu_num_logits: torch.Tensor, idx_mapping: torch.Tensor, rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``(request, slot)`` of every logits row (device ops, no host sync)."""
    cu = cu_num_logits.to(torch.int64)
    ar = torch.arange(rows, device=cu.device, dtype=torch.int64)
    req = torch.searchsorted(cu[1:].contiguous(), ar, right=True)
    req = req.clamp_(max=max(idx_mapping.shape[0] - 1, 0))
    return req, idx_mapping.to(torch.int64)[req]


class RowParams(NamedTuple):
    """Per logits row (:func:`row_params`)."""

    temperature: torch.Tensor  # fp32
    seed: torch.Tensor  # int64
    pos: torch.Tensor  # int64
    draft: torch.Tensor  # int64 global id of the draft the row verifies, -1 if none
    slot: torch.Tensor  # int64 request-state slot


def row_params(
    draft_sampled: torch.Tensor,
    cu_num_logits: torch.Tensor,
    pos: torch.Tensor,
    idx_mapping: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
) -> RowParams:
    """Per logits row: ``(temperature fp32, seed int64, pos int64, verified draft int64, slot
    int64)``.

    The verified draft of row ``j`` is ``draft_sampled[j + 1]``, or ``-1`` on the request's
    bonus (last) row. Device ops only (no host sync, CUDA-graph capturable).
    """
    rows = draft_sampled.shape[0]
    dev = draft_sampled.device
    cu = cu_num_logits.to(torch.int64)
    ar = torch.arange(rows, device=dev, dtype=torch.int64)
    req, slot = _row_request_slot(cu_num_logits, idx_mapping, rows)
    last = ar == cu[1:][req] - 1
    nxt = torch.cat([draft_sampled[1:], draft_sampled.new_full((1,), -1)]).to(torch.int64)
    draft_row = torch.where(last, torch.full_like(nxt, -1), nxt)
    return RowParams(
        temperature[slot].contiguous(),
        seed[slot].contiguous(),
        pos.to(torch.int64).contiguous(),
        draft_row.contiguous(),
        slot.contiguous(),
    )


def default_record_splits(rows: int, width: int, block: int, target_programs: int) -> int:
    """The built-in rule for the record kernel's programs per row (a power of two): about
    ``target_programs`` programs in all, at most :data:`MAX_RECORD_SPLITS`, and at least two
    tiles of ``block`` columns per split. ``width`` is the padded shard width, the same on every
    rank (so is the result, as the all_gather needs)."""
    if rows <= 0:
        return 1
    cap = min(triton.cdiv(target_programs, rows), max(1, width // (2 * block)))
    s = 1
    while s * 2 <= min(cap, MAX_RECORD_SPLITS):
        s *= 2
    return s


def record_splits(rows: int, width: int, block: int, device: torch.device) -> int:
    """Programs per row of the record kernel under the built-in rule
    (:func:`default_record_splits`): about :data:`shardmax.dispatch.TARGET_PROGRAMS` programs on
    a GPU, 1 on CPU (the interpreter gains nothing from more programs). :func:`sharded_verify`
    takes S from the dispatcher (:func:`record_launch`), whose tables may choose another.

    Tokens and counts of requests that are not flagged do not depend on S; which rows the
    interval test flags can (each split sums its exponentials in fp32, so the LSE moves in its
    last bits with S; a request at the margin may be flagged for one S and not another).
    """
    from shardmax.dispatch import TARGET_PROGRAMS

    target = TARGET_PROGRAMS if device.type == "cuda" else 1
    return default_record_splits(rows, width, block, target)


class RecordLaunch(NamedTuple):
    """How a step runs the record kernel (the same on every rank: it depends on the shape)."""

    variant: str  # sampled_record_<dtype>_b<block>
    splits: int  # programs per row and rank (S)
    num_warps: int
    candidates: int  # C of a candidate step (top-k requests need k < C)
    source: str  # the table row it came from, "builtin" or "override"


def record_launch(local_logits: torch.Tensor, tp: int) -> RecordLaunch:
    """The dispatcher's ``sampled`` selection for a step's ``[rows, W]`` local logits
    (:func:`shardmax.dispatch.select` for the current device's arch): ``generated/<arch>/
    sampled.json`` on a tuned GPU, the built-in default otherwise (block 2048, 4 warps, C = 64,
    :func:`record_splits`; on a CPU always). The problem is keyed by ``(dtype, tp, rows, W)``
    and ``align`` = 16 iff ``W % 16 == 0`` -- the padded width, not the tensor's row stride (the
    record kernel has no alignment variants), so every rank picks the same launch and sends the
    same number of words. To see what another GPU would pick, call
    ``select(Problem("sampled", ..., arch="sm90"))``.

    Raises:
        ValueError: the selection does not name a ``sampled_record_*`` variant of the logits'
            dtype (e.g. ``dispatch.override(variant=...)`` forced a greedy variant).
    """
    from shardmax.dispatch import Problem, select

    rows, width = local_logits.shape
    dtype = SUPPORTED_DTYPES[local_logits.dtype]
    problem = Problem("sampled", dtype, tp, rows, width, 16 if width % 16 == 0 else 1)
    sel = select(problem)
    check_record_selection(sel.variant, dtype)
    return RecordLaunch(
        sel.variant,
        min(sel.splits, MAX_RECORD_SPLITS),
        int(sel.launch.get("num_warps", 4)),
        sel.candidates,
        sel.source,
    )


def check_record_selection(variant: str, dtype: str) -> None:
    """Raise ValueError unless ``variant`` is a ``sampled_record_*`` name for ``dtype``."""
    try:
        key = parse_name(variant)
    except ValueError:
        key = None
    if key is None or key.family != "sampled_record" or key.dtype != dtype:
        raise ValueError(
            f"variant: {variant!r} is not a sampled_record_{dtype}_b<block> variant (sampled "
            "verification runs the record kernel of the logits' dtype; check "
            "dispatch.override(variant=...) or the selection passed in)"
        )


def sampled_records(
    local_logits: torch.Tensor,
    vocab_start: int,
    num_valid: int,
    params: tuple[torch.Tensor, ...],
    variant: str,
    use_fp64_gumbel: bool,
    num_warps: int = 4,
    splits: int = 1,
    with_candidates: bool = False,
    extra_words: int = 0,
    candidates: int = TOPK_CANDIDATES,
) -> torch.Tensor:
    """Local stage: ``[rows, W]`` logits -> one rank's flat int64 buffer: ``[splits * rows,
    3 | 4]`` records (split-major: record ``j * rows + r`` covers split ``j`` of row ``r``), and on
    a candidate step (``with_candidates``) one more record word (the split's smallest finite
    processed value) followed by ``[splits * rows, C]`` candidates: each split's exact top-``C``
    packed keys of ``x`` (``C`` = ``candidates``, one of :data:`CANDIDATE_CHOICES`);
    ``extra_words`` more words at the end are left for the caller (strict mode's extras).

    Raises:
        ValueError: ``splits`` not an int in ``[1, MAX_RECORD_SPLITS]`` or ``candidates`` not
            one of :data:`CANDIDATE_CHOICES`.
    """
    mod = kernels.load(variant)
    kernels._check_device(local_logits)
    if not isinstance(splits, int) or not 1 <= splits <= MAX_RECORD_SPLITS:
        raise ValueError(f"splits: expected an int in [1, {MAX_RECORD_SPLITS}], got {splits!r}")
    if candidates not in CANDIDATE_CHOICES or isinstance(candidates, bool):
        raise ValueError(f"candidates: expected one of {CANDIDATE_CHOICES}, got {candidates!r}")
    rows = local_logits.shape[0]
    dev = local_logits.device
    words = record_words(use_fp64_gumbel) + with_candidates
    c = candidates
    n_rec = splits * rows * words
    buf = torch.empty(n_rec + (splits * rows * c if with_candidates else 0) + extra_words,
                      dtype=torch.int64, device=dev)  # fmt: skip
    if rows == 0:
        return buf
    scratch = (
        torch.empty((splits * rows, candidate_capacity(c)), dtype=torch.int64, device=dev)
        if with_candidates
        else buf
    )
    chunk = triton.cdiv(triton.cdiv(num_valid, splits), mod.BLOCK) * mod.BLOCK
    temp_row, seed_row, pos_row, draft_row = params[:4]
    mod.kernel[(rows, splits)](
        local_logits,
        buf,
        buf[n_rec:] if with_candidates else buf,
        scratch,
        temp_row,
        seed_row,
        pos_row,
        draft_row,
        local_logits.stride(0),
        vocab_start,
        num_valid,
        chunk,
        BLOCK=mod.BLOCK,
        FP64=use_fp64_gumbel,
        TOPK=with_candidates,
        CAND=c,
        CAP=candidate_capacity(c),
        GROUPS=selection_groups(c),
        NETWORK=sorting_network(dev),
        num_warps=num_warps,
    )
    return buf


MAX_CHUNK_BYTES = 2**30
"""vLLM's cap on the fp32 logits copy of one verification chunk (``rejection_sampler.py``):
a chunk holds at most ``max(1, 2**30 // (4 * V))`` logits rows."""


def max_chunk_rows(vocab: int) -> int:
    """Logits rows of one vLLM verification chunk (vLLM 0.32 ``get_max_chunk_logits``)."""
    return max(1, MAX_CHUNK_BYTES // (4 * vocab))


class StrictStep(NamedTuple):
    """What strict mode needs to know about a step besides the batch (same on every rank)."""

    plan: StrictPlan  # where each 8192-block is reduced (shardmax.strict.plan)
    processed: bool  # vLLM verifies an fp32 processed copy (else the raw logits)
    dtype: torch.dtype  # the ranks' logits dtype
    width: int  # row stride of every rank's local logits (W for a contiguous shard)
    temp_row: torch.Tensor  # fp32 [rows] temperature of each logits row
    slot_row: torch.Tensor  # int64 [rows] request-state slot of each logits row


def local_buffer(
    local_logits: torch.Tensor,
    vocab_start: int,
    num_valid: int,
    params: tuple[torch.Tensor, ...],
    variant: str,
    use_fp64_gumbel: bool,
    splits: int,
    with_candidates: bool,
    strict: StrictStep | None = None,
    rank: int = 0,
    *,
    num_warps: int = 4,
    candidates: int = TOPK_CANDIDATES,
) -> torch.Tensor:
    """What one rank contributes to the step's all_gather: int64 ``[1, n]``
    (:func:`sampled_records` with ``num_warps`` and ``candidates``, then in strict mode
    :func:`shardmax.strict.rank_extras` of rank ``rank``); ``n`` is the same on every rank."""
    extra = extras_words(strict.plan, local_logits.shape[0], local_logits.dtype) if strict else 0
    buf = sampled_records(
        local_logits,
        vocab_start,
        num_valid,
        params,
        variant,
        use_fp64_gumbel,
        num_warps=num_warps,
        splits=splits,
        with_candidates=with_candidates,
        extra_words=extra,
        candidates=candidates,
    )
    if strict is not None:
        tp = len(strict.plan.starts)
        rank_extras(
            strict.plan, rank, local_logits, strict.processed, params[0], tp,
            out=buf[buf.shape[0] - extra :],
        )  # fmt: skip
    return buf.view(1, -1)


def _strict_lse(
    gathered: torch.Tensor,
    strict: StrictStep,
    rows: int,
    vocab: int,
    candidates: torch.Tensor | None,
    top_k: torch.Tensor | None,
    keep: torch.Tensor | None,
) -> torch.Tensor:
    """Every rank: vLLM's fp32 LSE of every row from the gathered strict extras (the tail of each
    rank's buffer); rows that keep a top-k / top-p / min-p set replay it from the candidates.
    Three launches: ``strict_rebuild``, ``strict_replay`` (candidate steps), ``strict_lse``."""
    p = strict.plan
    offset = gathered.shape[1] - extras_words(p, rows, strict.dtype)
    g_max, g_sum = rebuild_block_stats(
        p, gathered, offset, rows, strict.dtype, strict.processed, strict.temp_row,
        len(p.starts), strict.width,
    )  # fmt: skip
    if candidates is not None:
        replay_kept(
            g_max, g_sum, candidates, strict.temp_row, vocab, slot_row=strict.slot_row,
            top_k=top_k, keep=keep, cand_per_row=candidates.shape[1],
        )  # fmt: skip
    return strict_lse(g_max, g_sum)


def merge_candidates(
    gathered: torch.Tensor,
    splits: int,
    rows: int,
    words: int,
    cu_num_logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    *,
    vocab: int,
    rows_in_step: int | None = None,
    candidates: int = TOPK_CANDIDATES,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Every rank, on the gathered ``[tp, n]`` buffers: the merged candidates (int64
    ``[rows, C]``, ``C = candidates`` as the ranks' record kernels used, the exact global prefix
    in (value desc, id asc) order, ``EMPTY_KEY`` after it)
    and, when a top-p / min-p rule is given, per row ``keep`` (int32, kept candidates, 0 = no such
    rule on the row) and ``unsafe`` (int8, the guard). One ``sampled_merge`` launch.
    ``rows_in_step`` (default ``rows``) picks the vLLM top-p pipeline the guard models (split
    up to :data:`SPLIT_PIPELINE_MAX_ROWS` rows, monolithic beyond)."""
    c = candidates
    dev = gathered.device
    tp, n = gathered.shape
    merged = torch.empty((rows, c), dtype=torch.int64, device=dev)
    nucleus = top_p is not None or min_p is not None
    keep = torch.empty(rows, dtype=torch.int32, device=dev) if nucleus else None
    unsafe = torch.empty(rows, dtype=torch.int8, device=dev) if nucleus else None
    if rows == 0:
        return merged, keep, unsafe
    slot = _row_request_slot(cu_num_logits, idx_mapping, rows)[1] if nucleus else merged
    dummy = merged
    mod = kernels.load(build_name(VariantKey("sampled_merge")))
    mod.kernel[(rows,)](
        gathered,
        merged,
        keep if keep is not None else dummy,
        unsafe if unsafe is not None else dummy,
        slot,
        temperature,
        top_k.to(torch.int64) if top_k is not None else dummy,
        top_p if top_p is not None else dummy,
        min_p if min_p is not None else dummy,
        rows,
        rows if rows_in_step is None else rows_in_step,
        vocab,
        tp,
        splits,
        n,
        splits * rows * words,
        CAND=c,
        W=words,
        MS=2 if words == record_words(True) + 1 else 1,
        HAS_NUCLEUS=nucleus,
        HAS_TOPK=top_k is not None,
        HAS_TOP_P=top_p is not None,
        HAS_MIN_P=min_p is not None,
        SPLIT_MAX_ROWS=SPLIT_PIPELINE_MAX_ROWS,
        NETWORK=sorting_network(dev),
        num_warps=2,
    )
    return merged, keep, unsafe


def finish_gathered(
    gathered: torch.Tensor,
    tp: int,
    splits: int,
    with_candidates: bool,
    vocab: int,
    draft_sampled: torch.Tensor,
    cu_num_logits: torch.Tensor,
    pos: torch.Tensor,
    idx_mapping: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    num_speculative_steps: int,
    top_k: torch.Tensor | None,
    synthetic_conditional_rates: torch.Tensor | None,
    seq_lens: torch.Tensor | None,
    prefill_len: torch.Tensor | None,
    use_fp64_gumbel: bool,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    strict: StrictStep | None = None,
    candidates: int = TOPK_CANDIDATES,
) -> VerifyResult:
    """Every rank: ``[tp, n]`` gathered buffers -> :class:`VerifyResult`. On a candidate step
    the ranks' ``candidates`` (C) per record split are merged first (:func:`merge_candidates`);
    in strict mode vLLM's LSE of every row is rebuilt from the extras (:mod:`shardmax.strict`)."""
    rows = draft_sampled.shape[0]
    gathered = gathered.contiguous()
    n = gathered.shape[1]
    cand: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    unsafe: torch.Tensor | None = None
    if with_candidates:
        words = record_words(use_fp64_gumbel) + 1
        cand, keep, unsafe = merge_candidates(
            gathered, splits, rows, words, cu_num_logits, idx_mapping, temperature,
            top_k, top_p, min_p, vocab=vocab, candidates=candidates,
        )  # fmt: skip
        if top_k is None:  # candidates for top-p / min-p only: top-k off everywhere
            top_k = torch.zeros(temperature.shape[0], dtype=torch.int32, device=cand.device)
    lse = None
    if strict is not None:
        lse = _strict_lse(gathered, strict, rows, vocab, cand, top_k, keep)
    parts = tp * splits  # rank-major, then split-major: N records per row
    return sampled_finish(
        gathered,
        parts,
        finish_variant("sampled", parts, "allgather"),
        vocab,
        draft_sampled,
        cu_num_logits,
        pos,
        idx_mapping,
        temperature,
        seed,
        num_speculative_steps,
        top_k,
        synthetic_conditional_rates,
        seq_lens,
        prefill_len,
        use_fp64_gumbel,
        splits=splits,
        rank_words=n,
        candidates=cand,
        keep=keep,
        unsafe=unsafe,
        lse=lse,
    )


def sampled_finish(
    records: torch.Tensor,
    tp: int,
    variant: str,
    vocab: int,
    draft_sampled: torch.Tensor,
    cu_num_logits: torch.Tensor,
    pos: torch.Tensor,
    idx_mapping: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    num_speculative_steps: int,
    top_k: torch.Tensor | None,
    synthetic_conditional_rates: torch.Tensor | None,
    seq_lens: torch.Tensor | None,
    prefill_len: torch.Tensor | None,
    use_fp64_gumbel: bool,
    *,
    splits: int = 1,
    rank_words: int | None = None,
    candidates: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
    unsafe: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> VerifyResult:
    """Finish: gathered records -> :class:`VerifyResult` (one program per request).

    ``tp`` = parts per row (ranks x ``splits``); part ``e`` of a row starts at word
    ``(e // splits) * rank_words + (e % splits) * num_logits * W``; ``candidates`` = the merged
    ``[num_logits, C]`` keys of a top-k step (required with ``top_k``; C is its width); ``lse``
    (fp32 ``[num_logits]``, strict mode) vLLM's LSE of every row, used instead of the records'."""
    mod = kernels.load(variant)
    num_reqs = idx_mapping.shape[0]
    k = num_speculative_steps
    dev = records.device
    sampled = torch.empty((num_reqs, k + 1), dtype=torch.int64, device=dev)
    num_sampled = torch.empty(num_reqs, dtype=torch.int32, device=dev)
    num_rejected = torch.empty(num_reqs, dtype=torch.int32, device=dev)
    fallback = torch.empty(num_reqs, dtype=torch.int8, device=dev)
    reason = torch.empty(num_reqs, dtype=torch.int8, device=dev)
    if num_reqs == 0:
        return VerifyResult(sampled, num_sampled, num_rejected, fallback.bool(), reason)
    synthetic = synthetic_conditional_rates is not None
    has_prefill = seq_lens is not None and prefill_len is not None
    if top_k is not None and candidates is None:
        raise ValueError("candidates: required when top_k is given")
    rows = draft_sampled.shape[0]
    words = record_words(use_fp64_gumbel) + (top_k is not None)
    if rank_words is None:
        rank_words = splits * rows * words
    dummy_i32 = torch.zeros(1, dtype=torch.int32, device=dev)
    mod.kernel[(num_reqs,)](
        records,
        candidates if candidates is not None else records,
        keep if keep is not None else dummy_i32,
        unsafe if unsafe is not None else dummy_i32,
        draft_sampled,
        cu_num_logits,
        pos,
        idx_mapping,
        temperature,
        seed,
        top_k if top_k is not None else dummy_i32,
        synthetic_conditional_rates if synthetic else torch.zeros(1, device=dev),
        seq_lens if has_prefill else dummy_i32,
        prefill_len if has_prefill else dummy_i32,
        sampled,
        num_sampled,
        num_rejected,
        fallback,
        reason,
        lse if lse is not None else dummy_i32,
        draft_sampled.shape[0],
        tp,
        splits,
        rank_words,
        vocab,
        sampled.stride(0),
        K=k,
        KP1_P2=triton.next_power_of_2(k + 1),
        FP64=use_fp64_gumbel,
        SYNTHETIC=synthetic,
        HAS_PREFILL=has_prefill,
        HAS_TOPK=top_k is not None,
        CAND=candidates.shape[1] if candidates is not None else TOPK_CANDIDATES,
        HAS_KEEP=keep is not None,
        STRICT=lse is not None,
        num_warps=1,
    )
    return VerifyResult(sampled, num_sampled, num_rejected, fallback.bool(), reason)


def strict_step(
    geometry: list[tuple[int, int]],
    dtype: torch.dtype,
    row_stride: int,
    rows: int,
    idx_mapping: torch.Tensor,
    chk: _Checked,
    logits_processed: bool | None,
    params: RowParams,
) -> StrictStep:
    """The :class:`StrictStep` of a batch: the strict layout of the geometry and vLLM's chunk
    gate (``logits_processed``, or :func:`chunk_needs_processing` when None). ``row_stride`` is
    the row stride of the ranks' local logits (the same on every rank): vLLM's raw chunk is the
    ranks' LM-head outputs gathered and sliced to V, row stride ``tp * row_stride``.

    Raises:
        ValueError: the batch has more logits rows than one vLLM verification chunk
            (:func:`max_chunk_rows`: vLLM would gate each chunk separately), the ranks' ranges
            leave a gap, or (value checks on) ``logits_processed=False`` while a request needs
            processing (``T`` not 0 / 1, or top-k / top-p / min-p active): vLLM never verifies
            such a chunk raw.
        TypeError: ``logits_processed`` is not a bool or None.
    """
    from shardmax.strict import plan

    p = plan(geometry)
    if rows > max_chunk_rows(p.vocab):
        raise ValueError(
            f"mode='strict': {rows} logits rows exceed one vLLM verification chunk "
            f"({max_chunk_rows(p.vocab)} rows at V={p.vocab}); call once per chunk"
        )
    if logits_processed is None:
        processed = chunk_needs_processing(
            idx_mapping, chk.temperature, p.vocab, chk.top_k, chk.top_p, chk.min_p
        )
    elif isinstance(logits_processed, bool):
        processed = logits_processed
    else:
        raise TypeError(
            f"logits_processed: expected a Python bool or None, got {logits_processed!r} "
            f"({type(logits_processed).__module__}.{type(logits_processed).__qualname__})"
        )
    if (
        not processed
        and value_checks_enabled(chk.temperature.device)
        and chunk_needs_processing(
            idx_mapping, chk.temperature, p.vocab, chk.top_k, chk.top_p, chk.min_p
        )
    ):
        raise ValueError(
            "logits_processed: False, but a request of the batch needs logits processing "
            "(temperature not 0 or 1, or top-k / top-p / min-p active), so vLLM verifies an "
            "fp32 processed copy of this chunk, never the raw logits"
        )
    return StrictStep(p, processed, dtype, row_stride, params.temperature, params.slot)


def _empty(k: int, dev: torch.device) -> VerifyResult:
    return VerifyResult(
        torch.empty((0, k + 1), dtype=torch.int64, device=dev),
        torch.empty(0, dtype=torch.int32, device=dev),
        torch.empty(0, dtype=torch.int32, device=dev),
        torch.empty(0, dtype=torch.bool, device=dev),
        torch.empty(0, dtype=torch.int8, device=dev),
    )


def sharded_verify(
    local_logits: torch.Tensor,
    draft_sampled: torch.Tensor,
    cu_num_logits: torch.Tensor,
    pos: torch.Tensor,
    idx_mapping: torch.Tensor,
    expanded_local_pos: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    num_speculative_steps: int,
    *,
    vocab_start: int,
    num_valid: int | None = None,
    top_k: torch.Tensor | None = None,
    synthetic_conditional_rates: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    prefill_len: torch.Tensor | None = None,
    use_fp64_gumbel: bool = False,
    mode: str = "fast",
    group: Any = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    logits_processed: bool | None = None,
) -> VerifyResult:
    """Speculative verification of greedy and sampled requests from vocab shards.

    vLLM model runner V2 ``rejection_sample`` for one-hot drafts (research §1.2-§1.3) followed by
    ``get_num_sampled_and_rejected``, computed from one all-gather of fixed-size records (24 B per
    row and rank; 32 B with fp64 Gumbel) instead of the full logits. Per request ``r`` (rows
    ``[cu[r], cu[r+1])``, slot ``idx_mapping[r]``, ``T = temperature[slot]``):

    * ``T == 0`` (greedy): exactly :func:`shardmax.sharded_greedy_verify` / the greedy reference.
    * ``T > 0``: rows are processed as ``x / T`` in fp32 (``T == 1`` untouched); draft ``i``
      (``d = draft_sampled[cu[r]+i+1]``) is accepted iff ``x[d] - LSE > log u`` with
      ``u = tl.rand(seed[slot], pos[row])`` clamped (synthetic mode: ``u < rate[i]``); ``d < 0``
      ends verification; the first rejected row (draft removed) or the bonus row draws its token
      by keyed Gumbel-max; ``num_sampled = accepted + 1``.
    * chunked prefill (``seq_lens[r] < prefill_len[slot]``): 0 sampled, 0 rejected, all -1.

    Modes (the acceptance LSE; everything else is the same):

    * ``"fast"``: the LSE is rebuilt in fp64 from per-rank ``(max, sumexp)``; a decision within
      its error bound of vLLM's fp32 one sets ``fallback`` (interval test, research §2.3).
    * ``"strict"``: vLLM's fp32 LSE is rebuilt bit for bit (:mod:`shardmax.strict`: vLLM's
      per-8192-block statistics with vLLM's load layout, the raw values of the blocks cut by
      shard edges, vLLM's combine), so every acceptance decision is vLLM's and no row is flagged
      for the LSE. Costs 8 B per wholly-local block and row plus the raw pieces of at most two
      cut blocks per rank and row (``<= 16 KiB`` bf16), in the same all_gather; an fp32 copy of
      the shard's blocks on processed chunks; an fp32 ``[rows, V]`` replay scratch on steps with
      top-k / top-p / min-p rows. The batch must be one vLLM verification chunk
      (:func:`max_chunk_rows` rows).

    ``fallback[r]`` is True when the caller must verify request ``r`` the native way (its outputs
    here are then a valid sample but not guaranteed to be vLLM's bits): fast mode only, a row the
    decision used sits within the LSE error bound of the acceptance threshold; any mode,
    a used row holds NaN / +inf or no finite logit, a used top-k row fails the convergence guard
    (see the module docstring), or the request's top-k is ``>= C``, the step's candidates per
    record split (:func:`record_launch`; 64 unless a tuned table chose 32 or 128; its outputs
    are then ``-1`` / 0 / 0). Top-k requests with ``0 < k < C`` run sharded: vLLM's top-k kept
    set (ties at the k-th value by lowest id) from every rank's top-C candidates per record split.

    Args:
        local_logits, draft_sampled, cu_num_logits, pos, idx_mapping, expanded_local_pos, seed,
            num_speculative_steps, vocab_start, num_valid, synthetic_conditional_rates,
            seq_lens, prefill_len, group: as :func:`shardmax.sharded_greedy_verify`.
        temperature: float ``[max_num_reqs]`` per slot (cast to fp32); 0 = greedy.
        top_k: optional int32/int64 ``[max_num_reqs]`` per slot (``k <= 0`` or ``k >= V``: off).
        use_fp64_gumbel: vLLM's ``use_fp64_gumbel`` (fp64 Gumbel keys).
        mode: ``"fast"`` (compact records, LSE-margin rows flagged) or ``"strict"`` (vLLM's
            LSE bits, see above).
        top_p: optional float ``[max_num_reqs]`` per slot in ``(0, 1]`` (1 = off).
        min_p: optional float ``[max_num_reqs]`` per slot in ``[0, 1]`` (0 = off). With either,
            a request's rows keep min-p survivors, then its top-k, then the EXACT nucleus
            (:func:`shardmax.reference_nucleus.exact_nucleus_keep`; vLLM's own top-p search is
            approximate and batch-dependent, research §1.5) from the merged top-C candidates
            (the ``sampled_merge`` kernel); rows the guard cannot decide -- nucleus beyond the
            candidates, mass within rounding of ``p``, a tie at the boundary, a gap below vLLM's
            search resolution, min-p survivors beyond the candidates or at the threshold, min-p
            leaving ``<= k`` survivors for an active top-k -- set ``fallback``.

        logits_processed: strict mode only: vLLM's chunk gate -- True when vLLM verifies an
            fp32 processed copy of the batch's logits (some request needs logits processing:
            ``T`` not 0 / 1, top-k / top-p / min-p, penalties, bias, ...), False when it
            verifies the raw logits; None: computed from the sampling tensors
            (:func:`chunk_needs_processing`, one host read; logits processors are invisible
            here, so a caller that has them must pass True).

    Returns:
        :class:`VerifyResult` ``(sampled int64 [num_reqs, K+1], num_sampled int32,
        num_rejected int32, fallback bool, reason int8)``, identical on every rank; ``reason``
        is the :class:`FallbackReason` of each flagged request (0 elsewhere).

    Raises:
        TypeError / ValueError naming the argument (as the greedy op, plus temperature/top-k
        shape, dtype, slot range, negative or NaN temperature, an unknown ``mode``); strict mode:
        ValueError for more rows than one vLLM chunk, ranks' ranges with a gap, or
        ``logits_processed=False`` with a top-k / top-p / min-p request; TypeError for a
        non-bool ``logits_processed``.
    """
    coll = resolve(group)
    chk = validate_sampled_inputs(
        local_logits,
        draft_sampled,
        cu_num_logits,
        pos,
        idx_mapping,
        expanded_local_pos,
        temperature,
        seed,
        num_speculative_steps,
        vocab_start,
        num_valid,
        top_k,
        synthetic_conditional_rates,
        seq_lens,
        prefill_len,
        use_fp64_gumbel,
        mode,
        coll,
        top_p,
        min_p,
    )
    logits = chk.logits
    k = num_speculative_steps
    if idx_mapping.shape[0] == 0:
        return _empty(k, logits.device)
    params = row_params(draft_sampled, cu_num_logits, pos, idx_mapping, chk.temperature, seed)
    # from the padded shard width, not num_valid: every rank must pick the same launch
    launch = record_launch(logits, coll.world_size)
    with_candidates = chk.top_k is not None or chk.top_p is not None or chk.min_p is not None
    strict = None
    if mode == "strict":
        geometry = check_geometry(coll, logits, chk.vocab_start, chk.num_valid)
        strict = strict_step(
            geometry, logits.dtype, logits.stride(0), logits.shape[0], idx_mapping, chk,
            logits_processed, params,
        )  # fmt: skip
    buf = local_buffer(
        logits,
        chk.vocab_start,
        chk.num_valid,
        params,
        launch.variant,
        use_fp64_gumbel,
        launch.splits,
        with_candidates,
        strict,
        coll.rank,
        num_warps=launch.num_warps,
        candidates=launch.candidates,
    )
    return finish_gathered(
        coll.all_gather_dim0(buf),
        coll.world_size,
        launch.splits,
        with_candidates,
        chk.vocab,
        draft_sampled,
        cu_num_logits,
        pos,
        idx_mapping,
        chk.temperature,
        seed,
        k,
        chk.top_k,
        synthetic_conditional_rates,
        seq_lens,
        prefill_len,
        use_fp64_gumbel,
        chk.top_p,
        chk.min_p,
        strict,
        candidates=launch.candidates,
    )
