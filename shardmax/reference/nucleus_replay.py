"""vLLM's top-p pivot searches replayed from a level histogram, with certified decisions.

vLLM 0.32 / 0.33 never sort a row for top-p: ``apply_top_k_top_p_triton`` searches a pivot in
probability space (vLLM ``v1/sample/ops/topk_topp_triton.py``; research ``sampled-verification.md``
§1.1) and masks every token at or below it. Its answer is the exact nucleus on most rows but not
all (§1.5), and it depends on which of two pipelines runs:

* **monolithic** (``_topk_topp_kernel``, standalone top-p branch; chunks of more than 64 rows, or
  any chunk off CUDA): an outlier pre-filter from the mean / std of the first tile of the row, then
  at most 18 bisection steps ``pivot = (hi - lo) * 0.5 + lo`` over the probabilities, stopping at
  the first pivot whose mass ``S`` above it reaches ``p`` while ``S - g * n < p`` (``g`` the
  smallest probability above the pivot, ``n`` its count); the mask keeps ``x > log(pivot * Z) +
  max_sample``, and when the boundary value has more tokens than ``p`` needs, a recomputed
  duplicate logit may (or, bits permitting, may not) trim them in index order;
* **split** (``_topp_sb_*`` kernels; top-p-only rows of chunks of at most 64 rows on CUDA): five
  rounds of an eight-pivot geometric ladder between the smallest and the largest probability,
  the same stopping rule, the largest pivot whose mass reached ``p`` as the fallback; 0.33 keeps
  ``prob > pivot`` (or the row max) and trims the boundary value's duplicates in index order to
  exactly what ``p`` needs; 0.32 keeps ``x > log(pivot) + log(Z) + M`` and trims per 8192-block.

Every step of those searches depends on the row only through the **mass above a pivot** and the
**smallest probability above it**. On bf16 (and fp16) logits a row has few distinct values near
its top, so one rank can describe its shard by a histogram of counts per distinct value -- per
order-preserving 16-bit *level key*, relative to its top -- and, combined over ranks, the
histogram gives every such mass exactly (up to rounding) wherever the search looks. This module
replays each pipeline on a :class:`LevelHistogram` and **certifies** every decision:

* a probability within ``EPS_P`` (relative) of a pivot may sit on either side of it in vLLM's
  fp32 arithmetic (the *ambiguous* levels); tokens below the histogram's floor (its *tail*) are
  known only by their total mass;
* a mass within ``EPS_M`` (relative) of ``p`` may compare either way;
* an evaluation therefore has one or two possible outcomes; with two, the replay is a
  *branch point*. :func:`replay` runs the search twice -- the low outcome, then the high one at the
  first branch point -- and certifies the answer when a run meets at most one branch point and
  both runs end with the same kept set (the ties at its boundary may differ: a range);
* anything else (a second branch point, a mass within margin that decides, a boundary or pivot
  below the floor, the monolithic kernel's logit-space pivot next to a level, a non-contiguous
  kept set, vLLM's 1e-9 duplicate test reaching a neighbouring level where it decides, a value
  that matters too far from the monolithic kernel's normaliser ``max_sample`` -- the first
  tile's mean + 10 std -- for fp32 ``exp``) is a flag (:class:`ReplayReason`) -- the request is
  then verified the native way. A monolithic search anchored at the outlier threshold
  (mean + sigma(p) * std of the first tile) also carries that threshold's fp32 error
  (:func:`_tile_error`) in its pivot tolerance.

The answer, :class:`KeptSet`: every level above ``boundary`` kept, and ``ties`` tokens of the
boundary level, ``ties`` somewhere in ``[ties_lo, ties_hi]``, or no mask at all. Monolithic: the
first ``ties`` in global id order, the duplicate logit's bits deciding between ``num_keep`` and
all. Split: all, or -- where vLLM trims the boundary level -- an unknown subset
(``ties_ordered`` False; 0.32: at least its budget; 0.33: any size, as measured on the H200 with
many slices). The sharded verification then decides each request from what is certain (the
acceptance LSE over the kept set is an interval; a draw whose winner could be a boundary tie that
might not be kept is flagged).

Tolerances, from the fp32 arithmetic of vLLM's kernels on a GPU (Triton's ``tl.exp`` is
``ex2.approx`` of ``x * log2(e)``: relative error ``|x| * 2**-24`` for arguments up to ~50 nats
below the row's reference, plus ``2**-22.5``; ``/`` is an approximate division; sums of up to
``2**18`` fp32 terms in 8192 / 4096 / 2048-wide tiles):

* ``EPS_P = 2**-15``: a token's probability against a pivot (both carry such errors;
  ~``2**-17`` measured as the worst sum of the two bounds);
* ``EPS_M = 2**-16``: a mass against ``p`` (per-term errors plus ~64 levels of summation).

Written from vLLM 0.32.0's and 0.33.0's ``topk_topp_triton.py`` (read in the wheels' sources;
paraphrase only, no vLLM code) and checked against those kernels (``tests/test_nucleus_replay.py``
under the interpreter; ``scripts/gpu_checks.sh`` on CUDA).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch

__all__ = [
    "EPS_M",
    "EPS_P",
    "HIST_LEVELS",
    "KeptSet",
    "LevelHistogram",
    "Pipeline",
    "PipelineConfig",
    "ReplayReason",
    "kept_masks",
    "kept_mass",
    "level_histogram",
    "level_keys",
    "level_row",
    "level_value",
    "level_values",
    "pipeline_for",
    "replay",
]

EPS_P = 2.0**-15
EPS_M = 2.0**-16
HIST_LEVELS = 512
"""Bins of a level histogram: ``HIST_LEVELS - 1`` exact levels below the top, the last bin
collects everything deeper (the *tail*)."""

SPLIT_MAX_ROWS = 64  # vLLM's _SPLIT_MAX_BATCH
SPLIT_FANOUT = 8  # _SPLIT_FANOUT
SPLIT_ROUNDS = 5  # _SPLIT_ROUNDS
MONO_MAX_ITERS = 18
MONO_SIGMA_SHRINK = -0.25  # standalone top-p: sigma + |sigma| * -0.25
MONO_EXP_SPAN = 60.0
"""Nats between a value that matters and the monolithic kernel's ``max_sample`` within which
its fp32 ``exp(x - max_sample)`` and the row's sum stay finite and normal (fp32: ~88)."""
TIE_ABS = 1e-9  # vLLM's absolute tolerance when it groups probabilities equal to the minimum


class Pipeline(IntEnum):
    """Which of vLLM's top-p searches a row goes through (:func:`pipeline_for`)."""

    MONOLITHIC = 0  # _topk_topp_kernel, standalone top-p (0.32 == 0.33 there)
    SPLIT = 1  # _topp_sb_* of vLLM 0.33 (probability-space mask, index-ordered duplicates)
    SPLIT_V032 = 2  # _topp_sb_* of vLLM 0.32 (logit-space mask, per-block duplicate budget)


@dataclass(frozen=True)
class PipelineConfig:
    """A pipeline and the first-tile width the monolithic kernel samples its mean / std from
    (vLLM's ``BLOCK_SIZE``: 8192 on CUDA, 256 on the CPU)."""

    pipeline: Pipeline
    tile0: int = 8192


def pipeline_for(
    rows_in_chunk: int, device_type: str, vllm_version: str = "0.33", *, topp_only: bool = True
) -> PipelineConfig:
    """vLLM's choice for the top-p-only rows of one verification chunk of ``rows_in_chunk``
    logits rows (``apply_top_k_top_p_triton``): the split pipeline on CUDA(-alike) devices up to
    64 rows, else the monolithic kernel; its first tile is 8192 wide on CUDA, 256 on the CPU.
    ``topp_only=False`` (a row with an active top-k) always takes the monolithic kernel -- and its
    top-k branch, which this module does not replay.

    Raises:
        ValueError: a ``device_type`` vLLM launches other tile widths for (e.g. ``xpu``), or an
            unknown ``vllm_version``.
    """
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device_type: {device_type!r}, expected 'cuda' or 'cpu'")
    major_minor = ".".join(str(vllm_version).split(".")[:2])
    if major_minor not in ("0.32", "0.33"):
        raise ValueError(f"vllm_version: {vllm_version!r}, expected 0.32.x or 0.33.x")
    tile0 = 8192 if device_type == "cuda" else 256
    if topp_only and device_type == "cuda" and rows_in_chunk <= SPLIT_MAX_ROWS:
        split = Pipeline.SPLIT if major_minor == "0.33" else Pipeline.SPLIT_V032
        return PipelineConfig(split, tile0)
    return PipelineConfig(Pipeline.MONOLITHIC, tile0)


class ReplayReason(IntEnum):
    """Why :func:`replay` could not certify a row (0: it did)."""

    OK = 0
    NOT_COVERED = 1  # a deciding pivot, the boundary or the tail's part is below the floor
    MASS_MARGIN = 2  # a mass within rounding of p decides, with no second branch to settle it
    PIVOT_AT_LEVEL = 3  # vLLM's rounding may put a level on either side and the branches differ
    NOT_CONVERGED = 4  # a search end the replay does not model (non-contiguous set, tie merges)
    SATURATED = 5  # a histogram bin overflowed its 16-bit count
    NORMALIZER = 6  # the monolithic kernel's exp(x - max_sample) may over- or underflow


# --------------------------------------------------------------------------------------------
# level keys and histograms
# --------------------------------------------------------------------------------------------


def level_keys(raw: torch.Tensor) -> torch.Tensor:
    """Order-preserving 16-bit keys (int32 in ``[0, 65535]``) of bf16 / fp16 values: a larger
    value has a larger key, ``-0.0`` gets ``+0.0``'s key (vLLM compares them equal), NaN keys are
    unspecified (a NaN row is flagged before its histogram is used).

    Raises:
        TypeError: another dtype.
    """
    if raw.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"raw: level keys exist for bf16 / fp16, got {raw.dtype}")
    b = raw.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    b = torch.where(b == 0x8000, torch.zeros_like(b), b)  # -0.0 -> +0.0
    neg = (b & 0x8000) != 0
    return torch.where(neg, (~b) & 0xFFFF, b | 0x8000)


_LEVEL_TABLES: dict[torch.dtype, np.ndarray] = {}


def level_values(dtype: torch.dtype) -> np.ndarray:
    """fp32 ``[65536]``: the bf16 / fp16 value of every level key (the inverse of
    :func:`level_keys`; key ``0x8000`` is ``+0.0``, ``0x7FFF`` is ``-0.0``)."""
    table = _LEVEL_TABLES.get(dtype)
    if table is None:
        if dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"dtype: level keys exist for bf16 / fp16, got {dtype}")
        key = torch.arange(0x10000, dtype=torch.int32)
        bits = torch.where(key >= 0x8000, key & 0x7FFF, (~key) & 0xFFFF)
        bits = torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16)
        table = _LEVEL_TABLES[dtype] = bits.view(dtype).float().numpy()
    return table


def level_value(key: int, dtype: torch.dtype) -> float:
    """The bf16 / fp16 value of one level key (:func:`level_values`)."""
    return float(level_values(dtype)[int(key) & 0xFFFF])


def level_row(top_key: int, n: int, dtype: torch.dtype, temperature: float = 1.0) -> np.ndarray:
    """fp64 ``[n]``: the processed values (``fp32(v / T)``) of the keys ``top_key - j``,
    ``-inf`` past key 0."""
    keys = top_key - np.arange(n)
    vals = np.where(keys >= 0, level_values(dtype)[np.clip(keys, 0, 0xFFFF)], -np.inf)
    vals = vals.astype(np.float32)
    if temperature not in (0.0, 1.0):
        vals = vals / np.float32(temperature)
    return vals.astype(np.float64)


def _processed(raw: torch.Tensor, temperature: float) -> torch.Tensor:
    """vLLM's temperature step: ``x / T`` in fp32, ``T == 1`` (and 0) untouched."""
    x = raw.float()
    if temperature not in (0.0, 1.0):
        x = x / torch.tensor(temperature, dtype=torch.float32)
    return x


@dataclass(frozen=True)
class LevelHistogram:
    """One processed row as the replay sees it (on every rank after the exchange).

    ``values`` fp64 ``[L]`` (processed value of level ``j``, ``L = levels - 1``, descending;
    level ``j`` is the key ``top_key - j``), ``counts`` int64 ``[L]`` (tokens per level, 0 where
    no token has that key), ``m`` the processed row max, ``z`` = ``sum exp(x - m)`` over the whole
    row (fp64), ``floor_value`` the processed value of the first key past the exact levels,
    ``tail`` the probability mass of everything below the exact levels, ``min_value`` the
    smallest finite processed value, ``tile0_mean`` / ``tile0_std`` the mean and (population)
    standard deviation of the finite processed values of the first ``tile0`` ids."""

    values: np.ndarray
    counts: np.ndarray
    top_key: int
    m: float
    z: float
    floor_value: float
    tail: float
    min_value: float
    tile0_mean: float
    tile0_std: float
    saturated: bool = False


def level_histogram(
    raw_row: torch.Tensor,
    temperature: float = 1.0,
    *,
    levels: int = HIST_LEVELS,
    tile0: int = 8192,
    count_limit: int | None = 0xFFFF,
) -> LevelHistogram:
    """The :class:`LevelHistogram` of one full raw row (the oracle path; the kernels build the
    same from the ranks' shards). ``count_limit``: counts saturate there (the 16-bit counts of the
    exchange), ``saturated`` says so.

    Raises:
        TypeError: ``raw_row`` not a 1-D bf16 / fp16 tensor.
        ValueError: ``levels`` not a power of two >= 4, or a row without a finite value.
    """
    if not isinstance(raw_row, torch.Tensor) or raw_row.dim() != 1:
        raise TypeError("raw_row: expected a 1-D tensor")
    if levels < 4 or levels & (levels - 1):
        raise ValueError(f"levels: expected a power of two >= 4, got {levels}")
    raw_row = raw_row.detach().cpu()
    keys = level_keys(raw_row)
    x = _processed(raw_row, temperature)
    finite = torch.isfinite(x)
    if not bool(finite.any()):
        raise ValueError("raw_row: no finite value")
    top = int(keys[finite].max())
    depth = top - keys
    exact = finite & (depth >= 0) & (depth < levels - 1)
    counts = torch.bincount(depth[exact].long(), minlength=levels - 1)[: levels - 1]
    saturated = False
    if count_limit is not None and bool((counts > count_limit).any()):
        saturated = True
        counts = counts.clamp(max=count_limit)
    v64 = level_row(top, levels, raw_row.dtype, temperature)
    x64 = x.double()
    m = float(x64[finite].max())
    z = float(torch.exp(x64[finite] - m).sum())
    c = counts.numpy().astype(np.int64)
    deep = finite & ~exact
    tail = float(torch.exp(x64[deep] - m).sum()) / z if bool(deep.any()) else 0.0
    t0 = x64[:tile0]
    t0 = t0[torch.isfinite(t0)]
    mean = float(t0.mean()) if t0.numel() else 0.0
    std = float(((t0 - t0.mean()) ** 2).mean().sqrt()) if t0.numel() else 0.0
    return LevelHistogram(
        values=v64[: levels - 1],
        counts=c,
        top_key=top,
        m=m,
        z=z,
        floor_value=float(v64[levels - 1]),
        tail=tail,
        min_value=float(x64[finite].min()),
        tile0_mean=mean,
        tile0_std=std,
        saturated=saturated,
    )


# --------------------------------------------------------------------------------------------
# one pivot, certified
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Outcome:
    """One possible result of evaluating a pivot: vLLM's ``mass >= p`` (``over``) and its stopping
    test (``ok``), and what the search carries from there -- the mass, the smallest probability
    above the pivot ``g``, its count ``n`` and level. ``level`` is ``-1`` when that smallest
    probability belongs to the tail, ``-2`` when the configurations giving this decision disagree
    on it (using such a carried value raises)."""

    over: bool
    ok: bool
    mass: float
    g: float
    n: int
    level: int

    def carried(self) -> _Outcome:
        """This outcome, checked to carry a known level (else the reason it does not)."""
        if self.level == -1:
            raise _Flag(ReplayReason.NOT_COVERED)
        if self.level == -2:
            raise _Flag(ReplayReason.PIVOT_AT_LEVEL)
        return self


class _Flag(Exception):
    def __init__(self, reason: ReplayReason) -> None:
        super().__init__(reason.name)
        self.reason = reason


class _Row:
    """A histogram prepared for evaluations: per-level probabilities ``q`` and masses."""

    def __init__(self, h: LevelHistogram, top_p: float) -> None:
        self.h = h
        self.p = float(np.float32(top_p))
        live = h.counts > 0
        self.q = np.where(live, np.exp(np.where(live, h.values - h.m, -np.inf)) / h.z, 0.0)
        self.e = h.counts * self.q
        self.live = live
        self.floor_q = math.exp(h.floor_value - h.m) / h.z if h.floor_value > -math.inf else 0.0
        self.idx = np.arange(len(h.counts))
        self.eps_p = EPS_P
        """Tolerance of a probability against a pivot; the monolithic replay widens it by the
        fp32 error of a search anchored at the outlier threshold."""
        # vLLM counts the probabilities within 1e-9 (absolute) of the smallest one above a
        # pivot as its duplicates: a level whose next larger live level is that close may be
        # merged with it in a stopping test
        lv = self.idx[live]
        close = np.zeros(len(h.counts), dtype=bool)
        if lv.size > 1:
            q_lv = self.q[lv]
            gap = q_lv[:-1] - q_lv[1:]
            close[lv[1:]] = gap <= self.merge_reach(q_lv[:-1])
        self.merge_close = close

    @staticmethod
    def merge_reach(q: float | np.ndarray) -> float | np.ndarray:
        """How far above a probability (absolute) vLLM's 1e-9 duplicate test may reach, with
        the probabilities' own rounding."""
        return TIE_ABS * (1 + EPS_P) + 2 * EPS_P * q

    def outcomes(self, q: float) -> list[_Outcome]:
        """Every decision vLLM may reach at pivot ``q`` (low first): ``(over, ok)`` pairs, each
        with what it carries (:class:`_Outcome`)."""
        eps = self.eps_p
        r = self.q / q
        sure = self.live & (r > 1.0 + eps)
        amb = self.live & (np.abs(r - 1.0) <= eps)
        if int(amb.sum()) > 1:  # vLLM may put some of them above, some below
            raise _Flag(ReplayReason.PIVOT_AT_LEVEL)
        deep = self.h.tail > 0.0 and q < self.floor_q * (1.0 + eps)
        configs = [(sure, False)]
        if amb.any() or deep:
            configs.append((sure | amb, deep))  # every ambiguous level (and the tail) above
        p = self.p
        found: dict[tuple[bool, bool], _Outcome] = {}
        for above, tail in configs:
            mass = float(self.e[above].sum()) + (self.h.tail if tail else 0.0)
            if tail:
                lvl, g, n = -1, 0.0, 0  # the smallest probability above q is a tail token
            elif above.any():
                lvl = int(self.idx[above][-1])
                g, n = float(self.q[lvl]), int(self.h.counts[lvl])
                if self.merge_close[lvl] and _both(mass, p) != {False}:
                    # vLLM's stopping test may count near levels as duplicates of g: fine
                    # when the test decides the same with and without them
                    near = self.live & (self.idx < lvl) & (self.q - g <= self.merge_reach(g))
                    merged = n + int(self.h.counts[near].sum())
                    if _both(mass - g * n, p, scale=mass) != _both(
                        mass - g * merged, p, scale=mass
                    ):
                        raise _Flag(ReplayReason.NOT_CONVERGED)
            else:
                lvl, g, n = -3, 1.0, 0  # nothing above: vLLM's initial (1.0, 0)
            decisions: set[tuple[bool, bool]] = set()
            for over in _both(mass, p):
                if not over:
                    decisions.add((False, False))
                elif tail:  # rest = mass - (a tail level's mass), in [mass - tail, mass]
                    for rest_ge in _both(mass - self.h.tail, p) | _both(mass, p):
                        decisions.add((True, not rest_ge))
                else:
                    for rest_ge in _both(mass - g * n, p, scale=mass):
                        decisions.add((True, not rest_ge))
            for over, ok in decisions:
                o = _Outcome(over, ok, mass, g, n, lvl)
                prev = found.get((over, ok))
                if prev is not None and (prev.level != lvl or prev.n != n):
                    o = _Outcome(over, ok, min(prev.mass, mass), g, n, -2)
                found[(over, ok)] = o
        return [found[k] for k in sorted(found)]


def _both(value: float, p: float, *, scale: float | None = None) -> set[bool]:
    """The possible answers of vLLM's fp32 ``value >= p`` (``> p`` alike: exact equality counts
    as uncertain) for a value known to ``EPS_M`` of ``scale`` (default ``value``)."""
    tol = EPS_M * abs(value if scale is None else scale)
    if value - tol > p:
        return {True}
    if value + tol < p:
        return {False}
    return {False, True}


class _Search:
    """One run of a replay: branch point policy and bookkeeping."""

    def __init__(self, row: _Row, high: bool) -> None:
        self.row = row
        self.high = high  # take the high outcome at the first branch point
        self.branches = 0

    def decide(self, q: float) -> _Outcome:
        outs = self.row.outcomes(q)
        if len(outs) == 1:
            return outs[0]
        if len(outs) > 2:
            raise _Flag(self._reason(outs))
        self.branches += 1
        if self.branches > 1:
            raise _Flag(self._reason(outs))
        return outs[1] if self.high else outs[0]

    @staticmethod
    def _reason(outs: list[_Outcome]) -> ReplayReason:
        if any(o.level == -1 for o in outs):
            return ReplayReason.NOT_COVERED
        if len({o.level for o in outs}) > 1:
            return ReplayReason.PIVOT_AT_LEVEL
        return ReplayReason.MASS_MARGIN


@dataclass(frozen=True)
class KeptSet:
    """:func:`replay`'s answer for one row: no mask at all (``nomask``), or every level above
    ``boundary`` and the first ``ties`` tokens (global id order) of level ``boundary``, ``ties``
    in ``[ties_lo, ties_hi]`` (``ties_hi == count`` of that level when every tie may be kept).
    ``reason`` != OK: not certified (the other fields are meaningless). ``branches``: branch
    points met (for statistics). With ``ties_ordered`` False the kept ties are not a prefix."""

    reason: ReplayReason
    nomask: bool = False
    boundary: int = -1
    ties_lo: int = 0
    ties_hi: int = 0
    count: int = 0
    branches: int = 0
    ties_ordered: bool = True
    """False: the kept ties are *some* ``ties`` tokens of the boundary level, which ones unknown
    (vLLM's split pipelines); the request's outcome must then not depend on any boundary tie."""

    @property
    def certain_ties(self) -> bool:
        return self.nomask or self.ties_lo == self.ties_hi


def _budget_floor(mass: float, p: float, g: float) -> tuple[int, int]:
    """``floor((mass - p) / g)`` as vLLM's fp32 ``uint32`` cast may see it: the (lowest,
    highest) value over the rounding of ``mass`` (EPS_M) and ``g`` (EPS_P)."""
    lo = (mass * (1 - EPS_M) - p) / (g * (1 + EPS_P))
    hi = (mass * (1 + EPS_M) - p) / (g * (1 - EPS_P))
    return math.floor(lo), math.floor(hi)


def _check_tie_groups(row: _Row, b: int) -> None:
    """vLLM counts the probabilities within 1e-9 (absolute) of the smallest one above a pivot as
    its duplicates: the next larger live level must be farther than that."""
    above = row.live & (row.idx < b)
    if above.any():
        nxt = float(row.q[row.idx[above][-1]])
        if nxt - row.q[b] <= TIE_ABS * (1 + EPS_P) + EPS_P * nxt:
            raise _Flag(ReplayReason.NOT_CONVERGED)


def _boundary_of(row: _Row, prob_pivot: float) -> int:
    """The lowest live level whose probability is certainly above ``prob_pivot`` (a level within
    EPS_P of it: PIVOT_AT_LEVEL; the pivot below the floor with a tail: NOT_COVERED)."""
    if row.h.tail > 0.0 and prob_pivot < row.floor_q * (1.0 + row.eps_p):
        raise _Flag(ReplayReason.NOT_COVERED)
    r = row.q / prob_pivot
    if (row.live & (np.abs(r - 1.0) <= row.eps_p)).any():
        raise _Flag(ReplayReason.PIVOT_AT_LEVEL)
    above = row.live & (r > 1.0)
    if not above.any():
        raise _Flag(ReplayReason.NOT_CONVERGED)
    return int(row.idx[above][-1])


def _tile_error(h: LevelHistogram, tile0: int) -> tuple[float, float]:
    """Bounds (nats) of the error of vLLM's fp32 first-tile mean and standard deviation
    (``sum(x) / n``, ``sqrt(max(sum(x * x) / n - mean**2, 0))``) against the exact values: tree
    sums of up to ``tile0`` terms, ``sum |x| <= sqrt(n * sum x**2)``; ``sqrt`` moves by at most
    ``min(sqrt(d), d / std)`` when its argument moves by ``d``."""
    e2 = h.tile0_mean**2 + h.tile0_std**2
    c = (math.log2(max(tile0, 2)) + 3.0) * 2.0**-24
    d_mean = c * math.sqrt(e2)
    d_var = c * e2 + 2.0 * abs(h.tile0_mean) * d_mean + d_mean**2
    d_std = math.sqrt(d_var)
    if h.tile0_std > 0.0:
        d_std = min(d_std, d_var / h.tile0_std)
    return d_mean, d_std


def _monolithic(row: _Row, config: PipelineConfig, high: bool, sigma_table: list[float]) -> tuple:
    h, p = row.h, row.p
    run = _Search(row, high)
    pf = np.float32(p)
    idx = min(max(int(np.float32(pf * np.float32(200.0))), 0), 199)
    s32 = np.float32(sigma_table[idx])
    sigma = float(np.float32(s32 + np.float32(abs(s32)) * np.float32(MONO_SIGMA_SHRINK)))
    # vLLM computes every probability as exp(x - max_sample) / sum, max_sample = mean + 10 * std
    # of the first tile, not the row max: far from the row's values, exp over- or underflows
    # in fp32 (a NaN pivot: no mask at all, or tokens lost from the sum)
    d_mean, d_std = _tile_error(h, config.tile0)
    max_sample = h.tile0_mean + 10.0 * h.tile0_std
    d_ms = d_mean + 10.0 * d_std
    if not math.isfinite(max_sample + d_ms) or h.m - max_sample + d_ms > MONO_EXP_SPAN:
        raise _Flag(ReplayReason.NORMALIZER)  # (a first tile near the fp32 range: inf / NaN)
    outlier = h.tile0_mean + h.tile0_std * sigma
    outlier_prob = math.exp(min(outlier - h.m, 700.0)) / h.z
    max_r = 1.0 / h.z  # the top level's probability
    # the outlier threshold carries the fp32 error of the tile's mean / std (and its roundings):
    # every pivot of a search anchored there is that much less certain
    row.eps_p = EPS_P + d_mean + abs(sigma) * d_std + 2.0**-22 * (abs(outlier) + abs(max_sample))
    if outlier_prob > 0.0 and run.decide(outlier_prob).over:
        min_r = outlier_prob  # bisect over the compacted outliers: the same masses above pivots
    else:
        row.eps_p = EPS_P
        min_r = math.exp(h.min_value - h.m) / h.z
    it = 0
    while True:
        piv = (max_r - min_r) * 0.5 + min_r
        o = run.decide(piv)
        found = o.over and o.ok
        if found:
            p_pivot, carried = piv, o
        if o.over:  # mass > p (>= and > agree once certified)
            min_r = piv
        else:
            max_r = piv
        it += 1
        width = max_r - min_r
        if abs(width - 1e-9) <= 1e-9 * 4 * EPS_P + 2.0 * row.eps_p * (max_r + min_r):
            raise _Flag(ReplayReason.NOT_CONVERGED)
        if width < 1e-9 or it >= MONO_MAX_ITERS:
            p_pivot, carried = (max_r + min_r) / 2.0, o
            break
        if found:
            break
    # the mask keeps x > log(p_pivot * Z) + max_sample: the levels above p_pivot (no mask at all
    # when that pivot reaches the row max)
    top_q = 1.0 / h.z
    if abs(p_pivot / top_q - 1.0) <= row.eps_p:
        raise _Flag(ReplayReason.PIVOT_AT_LEVEL)
    if p_pivot > top_q:
        return (True, -1, 0, 0, 0, True, run.branches)
    b = _boundary_of(row, p_pivot)
    if h.values[b] - max_sample - d_ms < -MONO_EXP_SPAN:
        raise _Flag(ReplayReason.NORMALIZER)  # the kept tokens' exp underflows in vLLM's sum
    count = int(h.counts[b])
    if carried.level == -3:  # nothing above the last pivot: no duplicate to trim
        return (False, b, count, count, count, True, run.branches)
    carried = carried.carried()
    _check_tie_groups(row, carried.level)
    f_lo, f_hi = _budget_floor(carried.mass, p, carried.g)
    if f_hi < 0:  # no token to trim (a negative budget casts to 0 trimmed)
        return (False, b, count, count, count, True, run.branches)
    if f_lo < 0 or f_hi >= carried.n:
        raise _Flag(ReplayReason.NOT_CONVERGED)  # uint32 edges the replay does not model
    if carried.level > b:  # the trimmed level is below the mask's boundary: no effect
        return (False, b, count, count, count, True, run.branches)
    if carried.level < b:
        raise _Flag(ReplayReason.NOT_CONVERGED)  # trimming a level above the boundary
    keep_lo = carried.n - f_hi
    if keep_lo >= count:
        return (False, b, count, count, count, True, run.branches)
    if abs(h.values[b]) < 1e-6:
        raise _Flag(ReplayReason.NOT_CONVERGED)  # |x - dup| < 1e-9 could match neighbours
    # the recomputed duplicate logit may or may not equal the boundary value bit for bit
    return (False, b, max(keep_lo, 0), count, count, True, run.branches)


def _ladder(lo: float, hi: float) -> np.ndarray:
    f = np.arange(SPLIT_FANOUT, dtype=np.float64)
    return lo * np.exp(np.log(hi / lo) * (f + 1.0) / (SPLIT_FANOUT + 1.0))


def _split(row: _Row, config: PipelineConfig, high: bool) -> tuple:
    h, p = row.h, row.p
    run = _Search(row, high)
    max_prob = 1.0 / h.z
    min_prob = max(math.exp(h.min_value - h.m) / h.z, 1e-30)
    ratio = max_prob / (min_prob * (1.0 + 1e-6))
    if abs(ratio - 1.0) <= EPS_P:
        raise _Flag(ReplayReason.NOT_CONVERGED)
    if ratio < 1.0:
        return (True, -1, 0, 0, 0, True, run.branches)  # (nearly) uniform row: no mask
    lo, hi = min_prob, max_prob
    best, best_o = -1.0, None
    sel = None
    for rnd in range(SPLIT_ROUNDS):
        pivs = _ladder(lo, hi)
        outs = [run.decide(float(q)) for q in pivs]
        ge = [o.over for o in outs]
        ok = [o.over and o.ok for o in outs]
        ge_idx = max((f for f in range(SPLIT_FANOUT) if ge[f]), default=-1)
        ok_idx = max((f for f in range(SPLIT_FANOUT) if ok[f]), default=-1)
        if ge_idx >= 0 and pivs[ge_idx] > best:
            best, best_o = float(pivs[ge_idx]), outs[ge_idx]
        if ok_idx >= 0:
            sel = (float(pivs[ok_idx]), outs[ok_idx])
            break
        new_lo = max([lo] + [float(pivs[f]) for f in range(SPLIT_FANOUT) if ge[f]])
        new_hi = min([hi] + [float(pivs[f]) for f in range(SPLIT_FANOUT) if not ge[f]])
        r = new_hi / (new_lo * (1.0 + 1e-7))
        if abs(r - 1.0) <= EPS_P:
            raise _Flag(ReplayReason.NOT_CONVERGED)
        if rnd == SPLIT_ROUNDS - 1 or r <= 1.0:
            if best > 0.0 and best_o is not None:
                sel = (best, best_o)
                break
            return (True, -1, 0, 0, 0, True, run.branches)
        lo, hi = new_lo, new_hi
    assert sel is not None
    pivot, o = sel
    if abs(pivot / max_prob - 1.0) <= EPS_P:
        raise _Flag(ReplayReason.PIVOT_AT_LEVEL)
    if pivot >= max_prob:
        return (True, -1, 0, 0, 0, True, run.branches)  # pivot * Z >= 1: no mask
    o = o.carried()
    b = o.level  # the step and mask kernels compare the same fp32 probabilities
    if (
        config.pipeline == Pipeline.SPLIT_V032
        and (row.live & (np.abs(row.q / pivot - 1.0) <= EPS_P)).any()
    ):
        raise _Flag(ReplayReason.PIVOT_AT_LEVEL)  # 0.32 masks in logit space
    count = int(h.counts[b])
    _check_tie_groups(row, b)
    _, f_hi = _budget_floor(max(o.mass, p), p, o.g)
    keep_lo = min(max(count - max(f_hi, 0), 1), count)  # the fewest the budget keeps
    if keep_lo >= count:
        return (False, b, count, count, count, True, run.branches)
    if config.pipeline == Pipeline.SPLIT_V032:
        # its duplicate budget restarts per 8192-block: at least keep_lo, at most all, any ids
        return (False, b, keep_lo, count, count, False, run.branches)
    # 0.33 trims duplicates per slice with a budget carried over from lower slices, read from the
    # partials of the finalizing ladder slot; on CUDA (many slices) the kept duplicates were seen
    # to be neither an id-ordered prefix nor of the budget's size (benchmarks/topp_replay.py):
    # any subset of the boundary level
    return (False, b, 0, count, count, False, run.branches)


def replay(
    h: LevelHistogram,
    top_p: float,
    config: PipelineConfig,
    sigma_table: list[float] | None = None,
) -> KeptSet:
    """Replay vLLM's top-p search on one row and certify its kept set (module docstring).

    Args:
        h: the row's :class:`LevelHistogram` (every rank's, combined).
        top_p: the request's top-p in ``(0, 1)`` (compared in fp32, as vLLM).
        config: the pipeline (:func:`pipeline_for`).
        sigma_table: vLLM's ``_NORMAL_CDF_TO_SIGMA_TABLE`` for the monolithic pipeline (default
            :func:`shardmax.runtime.topp_tables.sigma_table`).

    Returns:
        :class:`KeptSet` (``reason`` OK when certified).

    Raises:
        ValueError: ``top_p`` outside ``(0, 1)``; the monolithic pipeline without a sigma table.
    """
    if not 0.0 < top_p < 1.0:
        raise ValueError(f"top_p: expected a value in (0, 1), got {top_p}")
    if config.pipeline == Pipeline.MONOLITHIC and sigma_table is None:
        from shardmax.runtime.topp_tables import sigma_table as lookup

        sigma_table = lookup()
        if sigma_table is None:
            raise ValueError(
                "sigma_table: the monolithic replay needs vLLM's _NORMAL_CDF_TO_SIGMA_TABLE "
                "(no vLLM found: shardmax.runtime.topp_tables.set_sigma_table)"
            )
    if h.saturated:
        return KeptSet(ReplayReason.SATURATED)
    row = _Row(h, top_p)
    results = []
    for high in (False, True):
        try:
            if config.pipeline == Pipeline.MONOLITHIC:
                assert sigma_table is not None
                res = _monolithic(row, config, high, sigma_table)
            else:
                res = _split(row, config, high)
        except _Flag as f:
            return KeptSet(f.reason)
        results.append(res)
        if res[-1] == 0:  # no branch point: the second run would repeat the first
            break
    first = results[0]
    if len(results) == 2 and (results[1][0] != first[0] or results[1][1] != first[1]):
        return KeptSet(ReplayReason.PIVOT_AT_LEVEL, branches=1)
    nomask, b = first[0], first[1]
    if nomask:
        return KeptSet(ReplayReason.OK, nomask=True, branches=first[-1])
    lo = min(r[2] for r in results)
    hi = max(r[3] for r in results)
    ordered = all(r[5] for r in results)
    return KeptSet(ReplayReason.OK, False, b, lo, hi, first[4], first[-1], ordered)


def kept_masks(raw_row: torch.Tensor, kept: KeptSet, top_key: int) -> list[torch.Tensor]:
    """The kept masks ``bool [V]`` a certified :class:`KeptSet` allows for the row it was replayed
    on (``top_key``: its histogram's; one mask, or two when the ties are a range: the least and
    the most kept).

    Raises:
        ValueError: ``kept`` not certified.
    """
    if kept.reason != ReplayReason.OK:
        raise ValueError(f"kept: not certified ({kept.reason.name})")
    if kept.nomask:
        return [torch.ones(raw_row.shape, dtype=torch.bool)]
    keys = level_keys(raw_row.detach().cpu())
    key_b = top_key - kept.boundary
    above = keys > key_b
    tie = keys == key_b
    rank = torch.cumsum(tie.to(torch.int64), 0)
    return [above | (tie & (rank <= t)) for t in sorted({kept.ties_lo, kept.ties_hi})]


def kept_mass(h: LevelHistogram, kept: KeptSet) -> tuple[float, float]:
    """``sum exp(x - m)`` over a certified kept set of the row ``h`` describes, with the fewest
    and with the most boundary ties kept (fp64; ``nomask``: ``h.z`` twice). The acceptance
    LSE vLLM computes on the masked row is ``m + log`` of a value in between (within its fp32
    rounding).

    Raises:
        ValueError: ``kept`` not certified.
    """
    if kept.reason != ReplayReason.OK:
        raise ValueError(f"kept: not certified ({kept.reason.name})")
    if kept.nomask:
        return h.z, h.z
    b = kept.boundary
    live = h.counts[:b] > 0
    above = float((h.counts[:b][live] * np.exp(h.values[:b][live] - h.m)).sum())
    e_b = math.exp(float(h.values[b]) - h.m)
    return above + kept.ties_lo * e_b, above + kept.ties_hi * e_b
