"""Sharded verification of sampled (temperature, top-k/p, min-p) and greedy requests.

Research ``sampled-verification.md`` §1.2-§1.3 (what vLLM does) and §2.1-§2.4 (design). Data flow
of one run on one TP rank, one collective per step::

    batch --row_params--> per row: slot, temperature, seed, verified draft       (one launch)
    local logits [rows, W] --sampled_record_<dtype>_b<block>--> records [S*rows, 3|4] int64
                               (candidate step: + 1 word, and [S*rows, C] int64 candidates;
                                strict mode: + vLLM's block statistics and cut-block pieces)
    flat buffer [1, n] --all_gather(dim=0)--> [tp, n]   (24*S B per row and rank; fp64: 32*S B;
                                                         candidate step: +8*S*(1 + C) B)
    [tp, n] (candidate step: --sampled_merge--> merged [rows, C] (+ keep, unsafe for top-p/min-p))
            (strict: --strict_rebuild / strict_replay / strict_lse--> vLLM's fp32 LSE per row)
        --sampled_finish_tp<N>_allgather--> sampled, num_sampled, num_rejected, fallback, reason

A candidate step is one with top-k, top-p or min-p requests. The record kernel's tile, ``S``
programs per row, warps and ``C`` come from the dispatcher (:func:`record_launch`: the tuned
``generated/<arch>/sampled.json``, else the built-in rule of :mod:`shardmax.runtime.defaults`);
the finish combines the ``N = tp * S`` records of a row exactly as it combines ranks. None of
them changes a token or count of a request that is not flagged.

Exactness (vs :func:`shardmax.reference.sampled.verify_sampled` and vLLM):

* greedy requests (``T == 0``): exactly :func:`shardmax.reference.greedy_verify`;
* Gumbel resample / bonus tokens and synthetic acceptance: exact (partition-free keys);
* temperature acceptance, fast mode: the global LSE is rebuilt from per-rank ``(max, sumexp)``
  in fp64, so it is not vLLM's fp32 bits; every row whose decision could differ (interval test,
  research §2.3) sets ``fallback`` for its request -- all other decisions are vLLM's;
* temperature acceptance, strict mode: vLLM's fp32 LSE bits (:mod:`shardmax.ops.strict`: the
  strict extras ride in the same all_gather after the records), every decision is vLLM's;
* top-k requests (``0 < k < C``): the kept set comes from the top-C packed keys of ``x`` of every
  record split of every rank, merged by ``sampled_merge`` into an exact prefix of the row's
  (value desc, id asc) order -- vLLM's converged top-k, ties at the k-th value by lowest id;
  acceptance as above with the kept set's LSE; the Gumbel token over the kept ids. Rows whose
  k-th value is too close to the next distinct one for vLLM's pivot search to be sure to converge
  (research §2.4: ``v_k - v' <= 3.5e-4 * (max - min_finite)``), or whose kept set reaches past
  the exact prefix, set ``fallback``;
* top-p / min-p requests: the kept count and the guard come from ``sampled_merge`` (the exact
  nucleus of the merged prefix);
* requests with NaN / +inf / no finite logit in a used row, and requests with ``k >= C`` are
  returned with ``fallback = True``.
"""

from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple

import torch
import triton

from shardmax.ops import strict as strict_mod
from shardmax.ops import topp as topp_mod
from shardmax.reference.nucleus_replay import Pipeline, PipelineConfig
from shardmax.runtime import kernels
from shardmax.runtime.defaults import (
    CANDIDATE_CHOICES,
    DEFAULT_RECORD_BLOCK,
    DRAW_TARGET_PROGRAMS,
    DRAW_WARPS,
    MAX_DRAW_SPLITS,
    MAX_RECORD_SPLITS,
    PHASE_CHOICES,
    SPLIT_PIPELINE_MAX_ROWS,
    TARGET_PROGRAMS,
    TOPK_CANDIDATES,
    default_record_splits,
)
from shardmax.runtime.dispatch import Problem, Selection, select
from shardmax.runtime.indirect import logits_arg
from shardmax.runtime.shard import ShardContext
from shardmax.runtime.validation import SUPPORTED_DTYPES, StepBatch
from shardmax.runtime.variants import VariantKey, build_name, finish_variant, parse_name

__all__ = [
    "CANDIDATE_CHOICES",
    "DEFAULT_RECORD_BLOCK",
    "MAX_DRAW_SPLITS",
    "MAX_RECORD_SPLITS",
    "MODES",
    "TOPK_CANDIDATES",
    "DrawLaunch",
    "FallbackReason",
    "RecordLaunch",
    "SampledVerifyPlan",
    "VerifyResult",
    "chunk_needs_processing",
    "max_chunk_rows",
    "record_launch",
    "record_variant",
]

MODES = ("fast", "strict")


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


class FallbackReason(IntEnum):
    """Why a request came back with ``fallback`` (``VerifyResult.reason``, int8 per request).
    Codes 1-7 are the top-p / min-p guard's (:class:`shardmax.reference.nucleus.GuardReason`,
    same numbers); the request carries the reason of the first row its decision used that
    failed, or ``TOPK_CAPACITY``."""

    NONE = 0
    NUCLEUS_NAN = 1  # (GuardReason.NAN; such rows are reported as NON_FINITE)
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
    TOPP_NOT_CERTIFIED = 13  # level-histogram top-p: the replay could not certify the kept set
    TOPP_TIE = 14  # level-histogram top-p: the draft or the drawn token is a boundary tie vLLM
    # may or may not keep


class VerifyResult(NamedTuple):
    """Outputs of a sampled verification (identical on every rank)."""

    sampled: torch.Tensor  # int64 [num_reqs, K + 1], -1 at columns >= num_sampled
    num_sampled: torch.Tensor  # int32 [num_reqs]
    num_rejected: torch.Tensor  # int32 [num_reqs]
    fallback: torch.Tensor  # bool [num_reqs]: verify these requests the native way
    reason: torch.Tensor  # int8 [num_reqs]: FallbackReason, 0 where fallback is False
    need: torch.Tensor | None = None
    """int8 ``[num_logits]``: 1 on the rows of flagged requests a per-request resolution must
    gather (:func:`shardmax.ops.resolve.resolution_rows`; the others are certified and verified
    on synthetic rows), 2 on the row a flagged request drew from past its first flagged row with
    a certified decision and token (a synthetic row of that token), 0 on their other rows;
    unspecified on rows of unflagged requests. None: every row of a flagged request is
    gathered."""


def empty_result(num_reqs: int, k: int, device: torch.device, num_logits: int = 0) -> VerifyResult:
    """Uninitialised outputs of ``num_reqs`` requests over ``num_logits`` logits rows."""
    return VerifyResult(
        torch.empty((num_reqs, k + 1), dtype=torch.int64, device=device),
        torch.empty(num_reqs, dtype=torch.int32, device=device),
        torch.empty(num_reqs, dtype=torch.int32, device=device),
        torch.empty(num_reqs, dtype=torch.bool, device=device),
        torch.empty(num_reqs, dtype=torch.int8, device=device),
        torch.empty(num_logits, dtype=torch.int8, device=device),
    )


def record_variant(dtype: torch.dtype, block: int = DEFAULT_RECORD_BLOCK) -> str:
    """Name of the record kernel for a logits dtype and tile width."""
    return build_name(VariantKey("sampled_record", dtype=SUPPORTED_DTYPES[dtype], block=block))


def record_words(use_fp64_gumbel: bool) -> int:
    """int64 words per record: key, (m, s), (x[d], flag) + the key's id word in fp64 mode."""
    return 4 if use_fp64_gumbel else 3


MAX_CHUNK_BYTES = 2**30
"""vLLM's cap on the fp32 logits copy of one verification chunk (``rejection_sampler.py``):
a chunk holds at most ``max(1, 2**30 // (4 * V))`` logits rows."""


def max_chunk_rows(vocab: int) -> int:
    """Logits rows of one vLLM verification chunk (vLLM 0.32/0.33 ``get_max_chunk_logits``)."""
    return max(1, MAX_CHUNK_BYTES // (4 * vocab))


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
    them: a caller that has them passes ``logits_processed=True``."""
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


def check_logits_processed(logits_processed: object) -> None:
    """``logits_processed`` is a Python bool or None (a numpy bool is refused: it would be
    truthy in every test below and hide a caller's mistake).

    Raises:
        TypeError: naming the value and its type.
    """
    if logits_processed is not None and not isinstance(logits_processed, bool):
        raise TypeError(
            f"logits_processed: expected a Python bool or None, got {logits_processed!r} "
            f"({type(logits_processed).__module__}.{type(logits_processed).__qualname__})"
        )


def resolve_chunk_gate(
    batch: StepBatch, vocab: int, logits_processed: bool | None, value_checks: bool
) -> bool:
    """Strict mode's ``processed`` flag of a batch: ``logits_processed`` when given, else vLLM's
    chunk gate computed from the sampling tensors (:func:`chunk_needs_processing`, a host read).
    With ``value_checks`` a given ``False`` is checked against the tensors too.

    Raises:
        ValueError: ``logits_processed=False`` while a request of the batch needs processing
            (vLLM never verifies such a chunk raw).
    """
    if batch.num_reqs == 0 or batch.temperature is None:
        return bool(logits_processed)
    need = None
    if logits_processed is None or (value_checks and logits_processed is False):
        need = chunk_needs_processing(
            batch.idx_mapping, batch.temperature, vocab, batch.top_k, batch.top_p, batch.min_p
        )
    if logits_processed is False and need:
        raise ValueError(
            "logits_processed: False, but a request of the batch needs logits processing "
            "(temperature not 0 or 1, or top-k / top-p / min-p active), so vLLM verifies an "
            "fp32 processed copy of this chunk, never the raw logits"
        )
    return bool(need) if logits_processed is None else logits_processed


class RecordLaunch(NamedTuple):
    """How a step runs the record kernel (the same on every rank: it depends on the shape).

    ``phases``: 1 = one pass (every sampled row's record carries its Gumbel key), 2 = two-phase
    on steps without candidates (records without noise; the finish names one row per request,
    ``sampled_draw_*`` draws only there after a second, small exchange). Candidate steps always
    run one pass. Both give the same tokens and counts."""

    variant: str  # sampled_record_<dtype>_b<block>
    splits: int  # programs per row and rank (S)
    num_warps: int
    candidates: int  # C of a candidate step (top-k requests need k < C)
    source: str  # the table row it came from, "builtin" or "override"
    phases: int = 1  # 1 | 2 (steps without candidates)

    @classmethod
    def of(cls, sel: Selection, *, two_phase: bool = False) -> RecordLaunch:
        """The launch of a selection. ``two_phase``: of a step that runs two-phase if the
        selection says so (no candidates): phase 1 then takes the row's ``phase1`` launch where
        the table has one (:attr:`~shardmax.runtime.dispatch.Selection.phase1`: block, splits,
        warps measured on noise-free records)."""
        p1 = sel.phase1 if two_phase and sel.phases == 2 else None
        if p1 is None:
            return cls(
                sel.variant,
                min(sel.splits, MAX_RECORD_SPLITS),
                int(sel.launch.get("num_warps", 4)),
                sel.candidates,
                sel.source,
                sel.phases,
            )
        key = parse_name(sel.variant)
        variant = build_name(VariantKey("sampled_record", dtype=key.dtype, block=p1["block"]))
        return cls(
            variant,
            min(p1["splits"], MAX_RECORD_SPLITS),
            p1["num_warps"],
            sel.candidates,
            f"{sel.source} [phase1]",
            2,
        )


class DrawLaunch(NamedTuple):
    """Phase 2 of a two-phase step: the draw kernel and its programs per drawing request (a
    pure function of the step's shape and request count: the same on every rank)."""

    variant: str  # sampled_draw_<dtype>_b<block>
    splits: int  # programs per request and rank
    num_warps: int
    chunk: int  # columns per program (a multiple of the block)


def draw_launch(
    dtype: torch.dtype,
    num_reqs: int,
    num_valid: int,
    width: int,
    device: torch.device,
    splits: int | None = None,
) -> DrawLaunch:
    """The built-in rule of the draw kernel (:mod:`shardmax.runtime.defaults`): block
    :data:`DEFAULT_RECORD_BLOCK`, about ``DRAW_TARGET_PROGRAMS`` programs over the drawing requests on
    a GPU (1 per request on a CPU; at most :data:`MAX_DRAW_SPLITS` per request, one tile each at
    least) unless ``splits`` fixes the programs per request,
    :data:`DRAW_WARPS` warps. ``width`` is the padded shard width (the same on every rank, so is
    the split count), ``num_valid`` this rank's real columns."""
    if splits is None:
        target = DRAW_TARGET_PROGRAMS if device.type == "cuda" else 1
        splits = default_record_splits(
            num_reqs, width, DEFAULT_RECORD_BLOCK, target, MAX_DRAW_SPLITS, min_tiles=1
        )
    chunk = triton.cdiv(triton.cdiv(num_valid, splits), DEFAULT_RECORD_BLOCK) * DEFAULT_RECORD_BLOCK
    name = build_name(
        VariantKey("sampled_draw", dtype=SUPPORTED_DTYPES[dtype], block=DEFAULT_RECORD_BLOCK)
    )
    return DrawLaunch(name, splits, DRAW_WARPS, max(chunk, DEFAULT_RECORD_BLOCK))


def _check_topp(ctx: ShardContext, topp: object, mode: str, with_candidates: bool) -> None:
    """A ``topp`` plan argument: a PipelineConfig on a fast, candidate-free step of bf16 / fp16
    logits (the level histograms key 16-bit values)."""
    if not isinstance(topp, PipelineConfig):
        raise TypeError(f"topp: expected a PipelineConfig or None, got {type(topp).__name__}")
    if with_candidates:
        raise ValueError("topp: level-histogram top-p steps carry no candidates")
    if mode != "fast":
        raise ValueError(
            "topp: level-histogram top-p is fast mode only (strict mode verifies top-p rows "
            "through candidates)"
        )
    if ctx.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"topp: level histograms need bf16 / fp16 logits, got {ctx.dtype}")


_SIGMAS: dict[tuple[torch.device, tuple[float, ...]], torch.Tensor] = {}


def topp_sigma(pipeline: Pipeline, device: torch.device) -> torch.Tensor:
    """fp32 ``[200]`` on ``device``: vLLM's sigma table for the monolithic pipeline
    (:func:`shardmax.runtime.topp_tables.sigma_table`), zeros for the split pipelines (which never
    read it); cached per device.

    Raises:
        ValueError: a monolithic pipeline and no table known.
    """
    from shardmax.runtime.topp_tables import sigma_table

    mono = Pipeline(pipeline) == Pipeline.MONOLITHIC
    table = sigma_table() if mono else None
    if mono and table is None:
        raise ValueError(
            "topp: the monolithic top-p replay needs vLLM's sigma table; no vLLM is importable "
            "-- call shardmax.runtime.topp_tables.set_sigma_table(...) first"
        )
    vals = tuple(table) if table is not None else (0.0,) * 200
    key = (torch.device(device), vals)
    got = _SIGMAS.get(key)
    if got is None:
        got = _SIGMAS[key] = torch.tensor(vals, dtype=torch.float32, device=device)
    return got


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


def record_launch(
    dtype: torch.dtype, tp: int, rows: int, width: int, *, with_candidates: bool = True
) -> RecordLaunch:
    """The dispatcher's ``sampled`` selection for a step of ``rows`` logits rows over ``[rows,
    W]`` local shards (:func:`shardmax.runtime.dispatch.select` for the current device's arch):
    ``generated/<arch>/sampled.json`` on a tuned GPU, the built-in rule otherwise (on a CPU
    always). Keyed by ``(dtype, tp, rows, W)`` and ``align`` = 16 iff ``W % 16 == 0`` -- the padded
    width, not a tensor's row stride (the record kernel has no alignment variants), so every rank
    picks the same launch and sends the same number of words. ``with_candidates=False`` (a step
    without top-k / top-p / min-p tensors): a two-phase row's phase 1 launch
    (:meth:`RecordLaunch.of`).

    Raises:
        ValueError: the selection does not name a ``sampled_record_*`` variant of ``dtype``
            (e.g. ``dispatch.override(variant=...)`` forced a greedy variant).
    """
    name = SUPPORTED_DTYPES[dtype]
    sel = select(Problem("sampled", name, tp, rows, width, 16 if width % 16 == 0 else 1))
    check_record_selection(sel.variant, name)
    return RecordLaunch.of(sel, two_phase=not with_candidates)


def record_splits(rows: int, width: int, block: int, device: torch.device) -> int:
    """Programs per row of the record kernel under the built-in rule
    (:func:`shardmax.runtime.defaults.default_record_splits`): about ``TARGET_PROGRAMS`` on a GPU,
    1 on a CPU. Tokens and counts of requests that are not flagged do not depend on S; which rows
    the interval test flags can (each split sums its exponentials in fp32)."""
    target = TARGET_PROGRAMS if device.type == "cuda" else 1
    return default_record_splits(rows, width, block, target)


class RowParams(NamedTuple):
    """Per logits row of a step (the ``row_params`` kernel's outputs, and vLLM's positions)."""

    temperature: torch.Tensor  # fp32
    seed: torch.Tensor  # int64
    draft: torch.Tensor  # int64 global id of the draft the row verifies, -1 if none
    slot: torch.Tensor  # int64 request-state slot
    pos: torch.Tensor  # int64 position (the batch's own tensor)


def row_params(batch: StepBatch, out: tuple[torch.Tensor, ...] | None = None) -> RowParams:
    """The per-row parameters of a batch (one ``row_params`` launch; no host sync). ``out``:
    ``(temperature, seed, draft, slot)`` buffers to write (a plan's workspace), else new ones.
    The batch must carry ``temperature``."""
    rows = batch.num_logits
    dev = batch.draft_sampled.device
    if out is None:
        out = (
            torch.empty(rows, dtype=torch.float32, device=dev),
            torch.empty(rows, dtype=torch.int64, device=dev),
            torch.empty(rows, dtype=torch.int64, device=dev),
            torch.empty(rows, dtype=torch.int64, device=dev),
        )
    temp, seed, draft, slot = out
    res = RowParams(temp, seed, draft, slot, batch.pos)
    if batch.num_reqs == 0 or rows == 0:
        return res
    assert batch.temperature is not None
    kernels.kernel("row_params")(
        (batch.num_reqs,),
        batch.cu_num_logits,
        batch.idx_mapping,
        batch.draft_sampled,
        batch.temperature,
        batch.seed,
        res.slot,
        res.temperature,
        res.seed,
        res.draft,
        rows,
        batch.num_slots,
        KP1_P2=triton.next_power_of_2(batch.num_speculative_steps + 1),
    )
    return res


def rows_aligned(logits: torch.Tensor) -> bool:
    """The record and draw kernels' ``ALIGNED``: every row of ``logits`` starts 16 elements
    apart (``stride % 16 == 0``; one row: its offset is 0), so whole tiles load as vectors."""
    return logits.shape[0] == 1 or logits.stride(0) % 16 == 0


def sampled_records(
    local_logits: torch.Tensor,
    vocab_start: int,
    num_valid: int,
    params: RowParams,
    launch: RecordLaunch,
    use_fp64_gumbel: bool,
    with_candidates: bool,
    buf: torch.Tensor,
    scratch: torch.Tensor | None,
    two_phase: bool = False,
    best: torch.Tensor | None = None,
) -> None:
    """Local stage: ``[rows, W]`` logits -> one rank's records into the flat int64 ``buf``:
    ``[splits * rows, 3 | 4]`` records (split-major: record ``j * rows + r`` covers split ``j``
    of row ``r``), and on a candidate step one more record word (the split's smallest finite
    processed value) followed by ``[splits * rows, C]`` candidates: each split's exact top-``C``
    packed keys of ``x``. ``scratch``: ``[splits * rows, 4 C]`` int64 workspace of the
    selection (candidate steps). ``two_phase``: phase 1 of a two-phase step (records without
    the Gumbel key, :class:`RecordLaunch`); ``best``: its int64 ``[rows * slots]`` slots (1 or 2
    per row) that a combining draw (:func:`draw_keys`) takes its atomic max into, cleared to
    ``EMPTY_KEY`` here."""
    rows = local_logits.shape[0]
    if rows == 0:
        return
    slots = 0
    if best is not None:
        slots = best.numel() // rows
        if slots not in (1, 2) or best.numel() != rows * slots or best.dtype != torch.int64:
            raise ValueError(
                f"best: expected int64 [{rows} * 1 | 2] (a slot or two per logits row), got "
                f"{best.dtype} of {best.numel()} elements"
            )
    k = kernels.kernel(launch.variant)
    kernels.check_device(local_logits)
    splits, c = launch.splits, launch.candidates
    n_rec = splits * rows * (record_words(use_fp64_gumbel) + with_candidates)
    chunk = triton.cdiv(triton.cdiv(num_valid, splits), k.module.BLOCK) * k.module.BLOCK
    arg, indirect = logits_arg(local_logits)
    k(
        (rows, splits),
        arg,
        buf,
        buf[n_rec:] if with_candidates else buf,
        scratch if scratch is not None else buf,
        best if best is not None else buf,
        params.temperature,
        params.seed,
        params.pos,
        params.draft,
        local_logits.stride(0),
        vocab_start,
        num_valid,
        chunk,
        BLOCK=k.module.BLOCK,
        FP64=use_fp64_gumbel,
        TOPK=with_candidates,
        CAND=c,
        CAP=candidate_capacity(c),
        GROUPS=selection_groups(c),
        NETWORK=sorting_network(local_logits.device),
        NOISE=not two_phase,
        INDIRECT=indirect,
        ALIGNED=rows_aligned(local_logits),
        BEST_SLOTS=slots,
        num_warps=launch.num_warps,
    )


def merge_candidates(
    gathered: torch.Tensor,
    splits: int,
    rows: int,
    words: int,
    slot_row: torch.Tensor,
    batch: StepBatch,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    vocab: int,
    candidates: int,
    rows_in_step: int | None = None,
) -> None:
    """Every rank, on the gathered ``[tp, n]`` buffers: the merged candidates (``out[0]``, int64
    ``[rows, C]``, the exact global prefix in (value desc, id asc) order, ``EMPTY_KEY`` after it)
    and, when a top-p / min-p rule is given, per row ``keep`` (``out[1]``, int32, kept
    candidates, 0 = no such rule on the row) and ``unsafe`` (``out[2]``, int8, the guard). One
    ``sampled_merge`` launch. ``rows_in_step`` (default ``rows``) picks the vLLM top-p pipeline
    the guard models (split up to :data:`SPLIT_PIPELINE_MAX_ROWS` rows, monolithic beyond)."""
    merged, keep, unsafe = out
    if rows == 0:
        return
    nucleus = batch.top_p is not None or batch.min_p is not None
    tp, n = gathered.shape
    kernels.kernel("sampled_merge")(
        (rows,),
        gathered,
        merged,
        keep,
        unsafe,
        slot_row,
        batch.temperature,
        batch.top_k if batch.top_k is not None else merged,
        batch.top_p if batch.top_p is not None else merged,
        batch.min_p if batch.min_p is not None else merged,
        rows,
        rows if rows_in_step is None else rows_in_step,
        batch.num_slots,
        vocab,
        tp,
        splits,
        n,
        splits * rows * words,
        CAND=candidates,
        W=words,
        MS=2 if words == record_words(True) + 1 else 1,
        HAS_NUCLEUS=nucleus,
        HAS_TOPK=batch.top_k is not None,
        HAS_TOP_P=batch.top_p is not None,
        HAS_MIN_P=batch.min_p is not None,
        SPLIT_MAX_ROWS=SPLIT_PIPELINE_MAX_ROWS,
        NETWORK=sorting_network(gathered.device),
    )


def sampled_finish(
    records: torch.Tensor,
    parts: int,
    variant: str,
    vocab: int,
    batch: StepBatch,
    use_fp64_gumbel: bool,
    *,
    splits: int,
    rank_words: int,
    top_k: torch.Tensor | None,
    candidates: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
    unsafe: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    draw: torch.Tensor | None = None,
    kept: tuple[torch.Tensor, torch.Tensor] | None = None,
    level_fp16: bool = False,
) -> VerifyResult:
    """Finish: gathered records -> :class:`VerifyResult` (one program per request).

    ``parts`` = records per row (ranks x ``splits``); part ``e`` of a row starts at word
    ``(e // splits) * rank_words + (e % splits) * num_logits * W``; ``candidates`` = the merged
    ``[num_logits, C]`` keys of a candidate step (with ``top_k``: the per-slot top-k, zeros when
    the batch has none); ``lse`` (fp32 ``[num_logits]``, strict mode) vLLM's LSE of every row,
    used instead of the records'; ``draw`` (int32 ``[2 * num_reqs]``, a two-phase step without
    candidates): the finish leaves each sampled request's drawn token ``-1`` and writes there the
    row that draws (``-1``: none) and its column, for :func:`draw_keys` / :func:`pick_tokens`;
    ``kept`` (with ``draw``): the rows' top-p kept sets and statistics from the level histograms
    (int32 ``[num_logits, 10]``, fp64 ``[num_logits, 4]``: :func:`shardmax.ops.topp.
    topp_kept_sets`), ``level_fp16`` whether their level keys are fp16's (else bf16's)."""
    k = batch.num_speculative_steps
    dev = records.device
    res = empty_result(batch.num_reqs, k, dev, batch.num_logits)
    if batch.num_reqs == 0:
        return res
    fallback = res.fallback.view(torch.int8)
    rates = batch.synthetic_conditional_rates
    has_prefill = batch.seq_lens is not None and batch.prefill_len is not None
    if top_k is not None and candidates is None:
        raise ValueError("candidates: required when top_k is given")
    if kept is not None and (draw is None or top_k is not None):
        raise ValueError("kept: top-p kept sets need a two-phase step (draw) without candidates")
    dummy = res.num_sampled
    kernels.kernel(variant)(
        (batch.num_reqs,),
        records,
        candidates if candidates is not None else records,
        keep if keep is not None else dummy,
        unsafe if unsafe is not None else dummy,
        batch.draft_sampled,
        batch.cu_num_logits,
        batch.pos,
        batch.idx_mapping,
        batch.temperature,
        batch.seed,
        top_k if top_k is not None else dummy,
        rates if rates is not None else res.num_rejected,
        batch.seq_lens if has_prefill else dummy,
        batch.prefill_len if has_prefill else dummy,
        res.sampled,
        res.num_sampled,
        res.num_rejected,
        fallback,
        res.reason,
        lse if lse is not None else dummy,
        draw if draw is not None else dummy,
        kept[0] if kept is not None else dummy,
        kept[1] if kept is not None else records,
        res.need,
        batch.num_logits,
        batch.num_slots,
        parts,
        splits,
        rank_words,
        vocab,
        res.sampled.stride(0),
        K=k,
        KP1_P2=triton.next_power_of_2(k + 1),
        FP64=use_fp64_gumbel,
        SYNTHETIC=rates is not None,
        HAS_PREFILL=has_prefill,
        HAS_TOPK=top_k is not None,
        CAND=candidates.shape[1] if candidates is not None else TOPK_CANDIDATES,
        HAS_KEEP=keep is not None,
        STRICT=lse is not None,
        DRAW=draw is not None,
        HAS_KEPT=kept is not None,
        LEVEL_FP16=level_fp16,
    )
    return res


def draw_keys(
    local_logits: torch.Tensor,
    vocab_start: int,
    num_valid: int,
    params: RowParams,
    draw: torch.Tensor,
    launch: DrawLaunch,
    use_fp64_gumbel: bool,
    keys: torch.Tensor,
    kept: torch.Tensor | None = None,
    combine: bool = False,
) -> None:
    """Phase 2 of a two-phase step on one rank: for each request ``r`` of ``draw`` (int32
    ``[2 * num_reqs]``, :func:`sampled_finish`'s) the Gumbel keys of its drawing row over this
    rank's columns, ``launch.splits`` programs per request, into the flat int64 ``keys``
    (``[splits * num_reqs, 1 | 2]``, split-major; with ``kept``, int32 ``[num_logits, 10]``
    top-p kept sets, the draw is masked to them and each slot doubles: ``[.., 2 | 4]``, the
    unsure boundary ties' best key second). ``combine`` (fp32 keys): every split's key goes
    into its request's slot by an atomic max instead -- ``keys`` then holds ``[num_reqs, 1 |
    2]``, cleared to ``EMPTY_KEY`` by the step's phase 1 (:func:`sampled_records`' ``best``). One
    ``sampled_draw_*`` launch."""
    num_reqs = draw.numel() // 2
    if num_reqs == 0:
        return
    k = kernels.kernel(launch.variant)
    arg, indirect = logits_arg(local_logits)
    k(
        (num_reqs, launch.splits),
        arg,
        keys,
        draw,
        params.temperature,
        params.seed,
        params.pos,
        params.draft,
        kept if kept is not None else draw,
        local_logits.stride(0),
        vocab_start,
        num_valid,
        launch.chunk,
        local_logits.shape[0],
        BLOCK=k.module.BLOCK,
        FP64=use_fp64_gumbel,
        INDIRECT=indirect,
        KEPT=kept is not None,
        ALIGNED=rows_aligned(local_logits),
        COMBINE=combine,
        num_warps=launch.num_warps,
    )


PICK_REQUESTS = 32
"""Most requests per program of ``sampled_pick``."""
PICK_TILE = 2048
"""Keys one ``sampled_pick`` program loads at once: requests per program x parts (a power of
two), so a step with many draw splits packs fewer requests per program."""


def pick_requests(parts: int) -> int:
    """Requests per ``sampled_pick`` program for ``parts`` keys per request (a power of two in
    ``[1, PICK_REQUESTS]``)."""
    return max(1, min(PICK_REQUESTS, PICK_TILE // triton.next_power_of_2(max(parts, 1))))


def pick_tokens(
    gathered: torch.Tensor,
    draw: torch.Tensor,
    splits: int,
    use_fp64_gumbel: bool,
    res: VerifyResult,
    row_draft: torch.Tensor,
    kept: bool = False,
) -> None:
    """Every rank, on the gathered ``[tp, n]`` draw keys: each drawing request's token into
    ``res.sampled`` (int64 ``[num_reqs, K + 1]``) at the column ``draw`` names; a drawn row
    without a draft (``row_draft``, int64 ``[num_logits]``: :class:`RowParams` ``draft``) that
    holds NaN / ``+inf`` or no finite value flags its request ``NON_FINITE`` in ``res`` (phase 1
    did not read it); ``kept``: the keys come from a draw masked to top-p kept sets (two slots
    per part), and a request whose unsure boundary ties' best key wins is flagged ``TOPP_TIE``.
    One launch."""
    num_reqs = draw.numel() // 2
    if num_reqs == 0:
        return
    tp, n = gathered.shape
    parts = tp * splits
    per = pick_requests(parts)
    kernels.kernel("sampled_pick")(
        (triton.cdiv(num_reqs, per),),
        gathered,
        draw,
        res.sampled,
        row_draft,
        res.fallback.view(torch.int8),
        res.reason,
        res.need if res.need is not None else torch.empty_like(row_draft, dtype=torch.int8),
        num_reqs,
        row_draft.numel(),
        parts,
        splits,
        n,
        res.sampled.stride(0),
        K=res.sampled.shape[1] - 1,
        FP64=use_fp64_gumbel,
        BLOCK_R=per,
        PARTS_P2=triton.next_power_of_2(parts),
        KEPT=kept,
    )


class SampledVerifyPlan:
    """Verification of greedy and sampled requests over ``num_logits`` logits rows (row stride
    ``row_stride``) of one kind of step: ``mode`` ("fast" | "strict"), fp64 Gumbel or not, with
    candidates (the batch has top-k / top-p / min-p tensors) or not, and in strict mode vLLM's
    chunk gate ``processed`` (raw logits, or an fp32 processed copy). Everything that depends only
    on that -- the dispatcher's record launch, the buffer layout of the exchange, the strict
    layout of the geometry, the finish variant -- is computed here, once.

    Stages: :meth:`local` (row parameters, records, strict extras) -> the group's all_gather ->
    :meth:`finish` (merge, strict LSE, finish). A two-phase plan (``launch.phases == 2`` on a step
    without candidates, :attr:`two_phase`) then runs :meth:`draw` (the drawing rows' Gumbel
    keys) -> a second all_gather -> :meth:`pick` (the tokens). :meth:`run` does them all.

    ``topp`` (a :class:`~shardmax.reference.nucleus_replay.PipelineConfig`: the top-p pipeline
    vLLM runs for these rows, :func:`~shardmax.reference.nucleus_replay.pipeline_for`): top-p
    steps without top-k / min-p verified from level histograms instead of candidates
    (:mod:`shardmax.ops.topp`): :meth:`local` appends each row's :data:`~shardmax.ops.topp.
    RECORD_BYTES`-byte histogram record to the same all_gather, :meth:`finish` replays vLLM's
    search on every rank (``topp_replay_*``) and decides each request over the certified kept
    set, and the draw is masked to it. Always two-phase, fast mode, bf16 / fp16 logits.

    Raises:
        ValueError: an unknown mode; strict mode with more rows than one vLLM verification chunk
            (:func:`max_chunk_rows`) or ranks' ranges with a gap (:func:`shardmax.ops.strict.plan`);
            a ``launch`` that is not a record kernel of the shard's dtype; ``draw_splits``
            (programs per request of a two-phase step's draw; default the built-in rule) not in
            ``[1, MAX_DRAW_SPLITS]`` (128); ``topp`` with candidates, strict mode or fp32
            logits, or a monolithic ``topp`` pipeline without vLLM's sigma table
            (:func:`shardmax.runtime.topp_tables.set_sigma_table`).
    """

    op = "sampled"

    def __init__(
        self,
        ctx: ShardContext,
        num_logits: int,
        row_stride: int,
        *,
        mode: str = "fast",
        use_fp64_gumbel: bool = False,
        with_candidates: bool = False,
        processed: bool = False,
        launch: RecordLaunch | None = None,
        draw_splits: int | None = None,
        topp: PipelineConfig | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        self.topp = topp
        if topp is not None:
            _check_topp(ctx, topp, mode, with_candidates)
        self.ctx = ctx
        self.num_logits = rows = num_logits
        self.row_stride = row_stride
        self.mode = mode
        self.use_fp64_gumbel = use_fp64_gumbel
        self.with_candidates = with_candidates
        self.processed = processed
        if launch is None:
            launch = record_launch(
                ctx.dtype, ctx.tp, rows, ctx.width, with_candidates=with_candidates
            )
        else:
            check_record_selection(launch.variant, ctx.dtype_name)
            if not isinstance(launch.splits, int) or not 1 <= launch.splits <= MAX_RECORD_SPLITS:
                raise ValueError(
                    f"splits: expected an int in [1, {MAX_RECORD_SPLITS}], got {launch.splits!r}"
                )
            if launch.candidates not in CANDIDATE_CHOICES or isinstance(launch.candidates, bool):
                raise ValueError(
                    f"candidates: expected one of {CANDIDATE_CHOICES}, got {launch.candidates!r}"
                )
        if launch.phases not in PHASE_CHOICES or isinstance(launch.phases, bool):
            raise ValueError(f"phases: expected one of {PHASE_CHOICES}, got {launch.phases!r}")
        if topp is not None:
            launch = launch._replace(phases=2)
        self.launch = launch
        self.two_phase = launch.phases == 2 and not with_candidates
        if draw_splits is not None and (
            isinstance(draw_splits, bool)
            or not isinstance(draw_splits, int)
            or not 1 <= draw_splits <= MAX_DRAW_SPLITS
        ):
            raise ValueError(
                f"draw_splits: expected an int in [1, {MAX_DRAW_SPLITS}], got {draw_splits!r}"
            )
        self.draw_splits = draw_splits
        self._draws: dict[int, DrawLaunch] = {}
        self.vocab = ctx.geometry.vocab
        self.words = record_words(use_fp64_gumbel) + with_candidates
        s, c = launch.splits, launch.candidates
        self.n_records = s * rows * self.words
        self.n_words = self.n_records + (s * rows * c if with_candidates else 0)
        self.topp_words = 0  # int64 words of this rank's top-p histogram records
        self.topp_splits = 1
        if topp is not None:
            self.topp_words = rows * topp_mod.RECORD_WORDS // 2
            self.n_words += self.topp_words
            self.topp_splits = topp_mod.topp_hist_splits(
                rows, ctx.width, topp_mod.TOPP_HIST_BLOCK, ctx.device
            )
            self._sigma = topp_sigma(topp.pipeline, ctx.device)
        self.strict: strict_mod.StrictLayout | None = None
        if mode == "strict":
            if rows > max_chunk_rows(self.vocab):
                raise ValueError(
                    f"mode='strict': {rows} logits rows exceed one vLLM verification chunk "
                    f"({max_chunk_rows(self.vocab)} rows at V={self.vocab}); call once per chunk"
                )
            self.strict = strict_mod.StrictLayout(
                strict_mod.plan(ctx.geometry.ranges),
                processed,
                ctx.dtype,
                row_stride,
                rows,
                ctx.device,
            )
            self.n_words += self.strict.extras_words
        self.finish_variant = finish_variant("sampled", ctx.tp * s, "allgather")
        self._views: dict[str, torch.Tensor] = {}
        self._gen = -1
        self._reserve()

    def _reserve(self) -> None:
        ws, rows, c, s = (
            self.ctx.workspace,
            self.num_logits,
            self.launch.candidates,
            self.launch.splits,
        )
        ws.reserve("sampled.send", 8 * self.n_words)
        for name in ("row.temp", "row.seed", "row.draft", "row.slot"):
            ws.reserve(name, 8 * rows)
        if self.two_phase:
            ws.reserve("sampled.draw", 4 * 2 * rows)
            slot = (1 + self.use_fp64_gumbel) * (2 if self.topp is not None else 1)
            if self.use_fp64_gumbel:  # every draw split's (key, id) pairs are sent
                ws.reserve("sampled.keys", 8 * MAX_DRAW_SPLITS * rows * slot)
            else:  # the splits' keys combined in place: one slot per row (two with kept sets)
                ws.reserve("sampled.best", 8 * rows * slot)
        if self.topp is not None:
            ts = self.topp_splits
            ws.reserve("topp.scratch", 4 * ts * rows * topp_mod.RECORD_WORDS)
            ws.reserve("topp.counts", 4 * ts * rows * topp_mod.HIST_LEVELS)
            ws.reserve("topp.kept", 4 * rows * topp_mod.KEPT_WORDS)
            ws.reserve("topp.stat", 8 * rows * topp_mod.STAT_WORDS)
            ws.reserve("topp.top_p", 8 * rows)
        if self.with_candidates:
            ws.reserve("sampled.scratch", 8 * s * rows * candidate_capacity(c))
            ws.reserve("sampled.merged", 8 * rows * c)
            ws.reserve("sampled.keep", 4 * rows)
            ws.reserve("sampled.unsafe", rows)

    def _view(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A workspace view, cached until the workspace grows (a view costs host time)."""
        ws = self.ctx.workspace
        if self._gen != ws.generation:
            self._views.clear()
            self._gen = ws.generation
        v = self._views.get(name)
        if v is None:
            v = self._views[name] = ws.view(name, shape, dtype)
        return v

    def _row_buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The workspace's per-row ``(temperature, seed, draft, slot)`` that ``row_params``
        writes and the record and draw kernels read."""
        rows = self.num_logits
        return (
            self._view("row.temp", (rows,), torch.float32),
            self._view("row.seed", (rows,), torch.int64),
            self._view("row.draft", (rows,), torch.int64),
            self._view("row.slot", (rows,), torch.int64),
        )

    def _sliced(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, n: int
    ) -> torch.Tensor:
        """The first ``n`` elements of a flat workspace view, cached per ``n`` like the view."""
        key = f"{name}[:{n}]"
        full = self._view(name, shape, dtype)  # clears the cache when the workspace grew
        v = self._views.get(key)
        if v is None:
            v = self._views[key] = full[:n]
        return v

    def row_params(self, batch: StepBatch) -> RowParams:
        """The ``row_params`` launch into the workspace."""
        return row_params(batch, self._row_buffers())

    def _check_batch(self, batch: StepBatch) -> None:
        if batch.num_logits != self.num_logits:
            raise ValueError(
                f"draft_sampled: {batch.num_logits} logits rows, this plan has {self.num_logits}"
            )
        if batch.temperature is None:
            raise ValueError("temperature: required by sampled verification")
        has = batch.top_k is not None or batch.top_p is not None or batch.min_p is not None
        if self.topp is not None:
            if batch.top_p is None or batch.top_k is not None or batch.min_p is not None:
                raise ValueError(
                    "top_p: this plan verifies top-p from level histograms; its steps carry "
                    "top_p and neither top_k nor min_p"
                )
        elif has != self.with_candidates:
            raise ValueError(
                "top_k / top_p / min_p: this plan was made "
                f"{'with' if self.with_candidates else 'without'} candidates (top-k / top-p / "
                "min-p tensors); plan the step with the sampling tensors it has"
            )

    def local(
        self, local_logits: torch.Tensor, batch: StepBatch, params: RowParams | None = None
    ) -> torch.Tensor:
        """This rank's contribution to the all_gather: int64 ``[1, n]`` (records, candidates,
        strict extras), ``n`` the same on every rank. A view of the workspace: valid until the
        next run of a plan of this shard."""
        ctx = self.ctx
        logits = ctx.check_logits(local_logits, self.num_logits, self.row_stride)
        if params is None:  # run() checked the batch and made the row parameters already
            self._check_batch(batch)
            params = self.row_params(batch)
        rows = self.num_logits
        buf = self._view("sampled.send", (self.n_words,), torch.int64)
        scratch = None
        if self.with_candidates:
            cap = candidate_capacity(self.launch.candidates)
            scratch = self._view("sampled.scratch", (self.launch.splits * rows, cap), torch.int64)
        sampled_records(
            logits, ctx.vocab_start, ctx.num_valid, params, self.launch, self.use_fp64_gumbel,
            self.with_candidates, buf, scratch, self.two_phase,
            self._best() if self.two_phase and not self.use_fp64_gumbel else None,
        )  # fmt: skip
        if self.strict is not None:
            extra = self.strict.extras_words
            self.strict.rank_extras(
                ctx.rank, logits, params.temperature, ctx.tp, buf[self.n_words - extra :]
            )
        if self.topp is not None:
            self._topp_local(logits, params)
        sent = self._views.get("sampled.send[1, n]")
        if sent is None:
            sent = self._views["sampled.send[1, n]"] = buf.view(1, -1)
        return sent

    def _topp_records(self, buf: torch.Tensor) -> torch.Tensor:
        """The top-p record region of a flat exchange buffer (``[n]`` sent or ``[tp, n]``
        gathered int64) as int32 ``[rows, RECORD_WORDS]`` / ``[tp, rows, RECORD_WORDS]``."""
        rows, a = self.num_logits, self.n_records
        region = buf[..., a : a + self.topp_words]
        return region.view(torch.int32).unflatten(-1, (rows, topp_mod.RECORD_WORDS))

    def _topp_local(self, logits: torch.Tensor, params: RowParams) -> None:
        ctx, rows, ts, topp = self.ctx, self.num_logits, self.topp_splits, self.topp
        assert topp is not None
        buf = self._view("sampled.send", (self.n_words,), torch.int64)
        out = self._views.get("topp.out")
        if out is None:
            out = self._views["topp.out"] = self._topp_records(buf)
        recs = topp_mod.RECORD_WORDS
        topp_mod._launch_local(
            logits, params.temperature, out,
            self._view("topp.scratch", (ts * rows, recs), torch.int32),
            self._view("topp.counts", (ts * rows, topp_mod.HIST_LEVELS), torch.int32),
            dtype_name=ctx.dtype_name, num_valid=ctx.num_valid, vocab_start=ctx.vocab_start,
            tile0=topp.tile0, block=topp_mod.TOPP_HIST_BLOCK, splits=ts, atomic=True,
        )  # fmt: skip

    def _topp_kept(
        self, gathered: torch.Tensor, batch: StepBatch, params: RowParams
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's kept set from the gathered histogram records (``topp_replay_*``)."""
        rows, topp = self.num_logits, self.topp
        assert topp is not None
        kept = self.kept_sets()
        stat = self._view("topp.stat", (rows, topp_mod.STAT_WORDS), torch.float64)
        assert batch.top_p is not None  # fp64 per slot (the batch's), rounded to fp32 by the replay
        top_p = self._view("topp.top_p", (rows,), batch.top_p.dtype)
        torch.index_select(batch.top_p, 0, params.slot, out=top_p)
        topp_mod._launch_replay(
            self._topp_records(gathered), params.temperature, top_p, self._sigma, kept, stat,
            dtype_name=self.ctx.dtype_name, pipeline=topp.pipeline, tile0=topp.tile0,
        )  # fmt: skip
        return kept, stat

    def exchange(self, sent: torch.Tensor) -> torch.Tensor:
        return self.ctx.coll.all_gather_dim0(sent)

    def finish(
        self, gathered: torch.Tensor, batch: StepBatch, params: RowParams | None = None
    ) -> VerifyResult:
        """Every rank, on the same ``[tp, n]`` bytes: the :class:`VerifyResult`."""
        if params is None:  # run() checked the batch and made the row parameters already
            self._check_batch(batch)
            if batch.num_reqs == 0:
                return empty_result(
                    0, batch.num_speculative_steps, gathered.device, batch.num_logits
                )
            params = self.row_params(batch)
        rows, c = self.num_logits, self.launch.candidates
        gathered = gathered.contiguous()
        cand = keep = unsafe = None
        top_k = batch.top_k
        if self.with_candidates:
            cand = self._view("sampled.merged", (rows, c), torch.int64)
            keep_buf = self._view("sampled.keep", (rows,), torch.int32)
            unsafe_buf = self._view("sampled.unsafe", (rows,), torch.int8)
            merge_candidates(
                gathered, self.launch.splits, rows, self.words, params.slot, batch,
                (cand, keep_buf, unsafe_buf), vocab=self.vocab, candidates=c,
            )  # fmt: skip
            if batch.top_p is not None or batch.min_p is not None:
                keep, unsafe = keep_buf, unsafe_buf
            if top_k is None:  # candidates for top-p / min-p only: top-k off everywhere
                top_k = self.ctx.zeros_int32(batch.num_slots)
        kept = None
        if self.topp is not None:
            kept = self._topp_kept(gathered, batch, params)
        lse = None
        if self.strict is not None:
            lse = self.strict.lse(
                gathered, self.n_words - self.strict.extras_words, params.temperature,
                params.slot, self.vocab, cand, top_k, keep,
            )  # fmt: skip
        return sampled_finish(
            gathered, self.ctx.tp * self.launch.splits, self.finish_variant, self.vocab, batch,
            self.use_fp64_gumbel, splits=self.launch.splits, rank_words=self.n_words,
            top_k=top_k, candidates=cand, keep=keep, unsafe=unsafe, lse=lse,
            draw=self.draw_rows(batch.num_reqs) if self.two_phase else None,
            kept=kept, level_fp16=self.ctx.dtype == torch.float16,
        )  # fmt: skip

    def draw_rows(self, num_reqs: int) -> torch.Tensor:
        """Two-phase plans: the finish's int32 ``[2 * num_reqs]`` draw buffer (row that draws,
        ``-1`` none; then its column), a workspace view."""
        return self._sliced("sampled.draw", (2 * self.num_logits,), torch.int32, 2 * num_reqs)

    def draw_launch(self, num_reqs: int) -> DrawLaunch:
        """The draw kernel's launch for ``num_reqs`` requests (cached per count)."""
        got = self._draws.get(num_reqs)
        if got is None:
            ctx = self.ctx
            got = self._draws[num_reqs] = draw_launch(
                ctx.dtype, num_reqs, ctx.num_valid, ctx.width, ctx.device, self.draw_splits
            )
        return got

    def kept_sets(self) -> torch.Tensor:
        """``topp`` plans: the int32 ``[num_logits, KEPT_WORDS]`` kept sets :meth:`finish` wrote
        (:func:`shardmax.ops.topp.topp_kept_sets`), a workspace view."""
        return self._view("topp.kept", (self.num_logits, topp_mod.KEPT_WORDS), torch.int32)

    def draw(
        self,
        local_logits: torch.Tensor,
        batch: StepBatch,
        draw: torch.Tensor | None = None,
        kept: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Phase 2 on this rank (two-phase plans, after :meth:`finish`): int64 ``[1, n]`` Gumbel
        keys of every request's drawing row over this rank's columns, ``n`` the same on every
        rank. ``draw``: the finish's draw buffer (default this plan's own, :meth:`draw_rows`);
        ``kept`` (``topp`` plans): the finish's kept sets (default this plan's, :meth:`kept_sets`).
        Reads the row parameters :meth:`local` wrote. A workspace view, like :meth:`local`'s.
        Call it once per :meth:`local`: with fp32 keys the draw takes an atomic max into the slots
        :meth:`local` cleared, so a second draw of the same step would combine with the first's
        keys."""
        if not self.two_phase:
            raise ValueError("draw: this plan runs one pass (launch.phases == 1 or candidates)")
        logits = self.ctx.check_logits(local_logits, self.num_logits, self.row_stride)
        return self._draw(logits, batch, draw, kept)

    def _draw(
        self,
        local_logits: torch.Tensor,
        batch: StepBatch,
        draw: torch.Tensor | None,
        kept: torch.Tensor | None = None,
    ) -> torch.Tensor:
        ctx, reqs = self.ctx, batch.num_reqs
        launch = self.draw_launch(reqs)
        ms = (1 + self.use_fp64_gumbel) * (2 if self.topp is not None else 1)
        # packed fp32 keys order as (noised value desc, id asc) in one int64 (each slot: the
        # best key, and with kept sets the unsure boundary ties' best): the max over this
        # rank's splits is what the pick's max over every part takes from them, so the draw
        # combines them (atomic max into the slots phase 1 cleared) and only it is sent
        combine = not self.use_fp64_gumbel
        if combine:
            keys = self._sliced("sampled.best", (self.num_logits * ms,), torch.int64, reqs * ms)
        else:
            keys = self._sliced(
                "sampled.keys", (MAX_DRAW_SPLITS * self.num_logits * ms,), torch.int64,
                launch.splits * reqs * ms,
            )  # fmt: skip
        params = RowParams(*self._row_buffers(), batch.pos)
        draw_keys(
            local_logits, ctx.vocab_start, ctx.num_valid, params,
            self.draw_rows(reqs) if draw is None else draw, launch, self.use_fp64_gumbel, keys,
            (self.kept_sets() if kept is None else kept) if self.topp is not None else None,
            combine,
        )  # fmt: skip
        return keys.view(1, -1)

    def _best(self) -> torch.Tensor:
        """fp32-key two-phase plans: the int64 ``[num_logits * slots]`` slots phase 1 clears and
        the draw combines its splits' keys into (1 slot per row, 2 with kept sets), a workspace
        view."""
        ms = 2 if self.topp is not None else 1
        return self._view("sampled.best", (self.num_logits * ms,), torch.int64)

    def sent_draw_splits(self, num_reqs: int) -> int:
        """Draw splits per request in what each rank sends in the draw exchange: 1 when the rank
        combines its splits' keys first (packed fp32 keys: a max; fp64 mode's ``(key, id)``
        pairs are sent per split), else the draw launch's splits."""
        return 1 if not self.use_fp64_gumbel else self.draw_launch(num_reqs).splits

    def draw_words(self, num_reqs: int) -> int:
        """int64 words one rank sends in the draw exchange of a step of ``num_reqs`` requests."""
        ms = (1 + self.use_fp64_gumbel) * (2 if self.topp is not None else 1)
        return self.sent_draw_splits(num_reqs) * num_reqs * ms

    def pick(
        self, gathered: torch.Tensor, res: VerifyResult, draw: torch.Tensor | None = None
    ) -> VerifyResult:
        """Every rank, on the gathered ``[tp, n]`` draw keys: the drawn tokens written into
        ``res.sampled`` (:meth:`finish`'s result, returned)."""
        reqs = res.num_sampled.shape[0]
        pick_tokens(
            gathered.contiguous(), self.draw_rows(reqs) if draw is None else draw,
            self.sent_draw_splits(reqs), self.use_fp64_gumbel, res, self._row_buffers()[2],
            kept=self.topp is not None,
        )  # fmt: skip
        return res

    def run(self, local_logits: torch.Tensor, batch: StepBatch) -> VerifyResult:
        """One step from this rank's shard; identical on every rank. No host sync; CUDA-graph
        capturable."""
        self._check_batch(batch)
        if batch.num_reqs == 0:
            self.ctx.check_logits(local_logits, self.num_logits, self.row_stride)
            return empty_result(0, batch.num_speculative_steps, self.ctx.device, batch.num_logits)
        params = self.row_params(batch)
        res = self.finish(self.exchange(self.local(local_logits, batch, params)), batch, params)
        if self.two_phase:
            res = self.pick(self.exchange(self._draw(local_logits, batch, None)), res)
        return res
