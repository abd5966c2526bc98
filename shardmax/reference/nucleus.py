"""Plain-torch reference of the exact nucleus (top-p), min-p, and the guard that decides when a
sharded top-p row may be verified from per-rank candidates (issue: sampled verification part 2).

Written from ``shared/research/sampled-verification.md`` §1.1 (what vLLM does, in order: min-p,
then top-k, then top-p on the renormalised survivors), §1.5 (vLLM's two top-p pipelines are
approximate and batch-dependent) and §2.4 (guard rules); paraphrase only, no vLLM code.

vLLM computes its top-p mask with approximate pivot searches whose result depends on the number
of rows in the step, so "bit-identical to vLLM" is not a stable target for top-p rows. The
target here is the **exact nucleus**: in the ``(value desc, id asc)`` order of the processed row,
the smallest prefix whose probability mass reaches ``p`` (probabilities ``exp(x - LSE)`` of the
row that reaches top-p). A sharded finish knows the row only through every rank's top-``C``
candidates and the global ``(max, sum-exp)``; :func:`nucleus_guard` says when that is enough
*and* vLLM's own search would land on the same set, and otherwise names the reason
(:class:`GuardReason`) so the row falls back.

Functions:

* :func:`min_p_keep` -- vLLM's min-p rule ``x >= M + log(min_p)`` in fp32.
* :func:`top_k_keep` -- the converged top-k kept set (ties at the k-th value by lowest id).
* :func:`exact_nucleus_keep` -- the exact nucleus of each row, after min-p and top-k.
* :func:`candidates_of` -- every rank's top-``C`` ``(value, id)`` of a vLLM-sharded row.
* :func:`nucleus_guard` -- the guard for one row from the merged candidates, with the reason.
* :func:`split_pipeline_model_keep` -- a model of vLLM's split top-p pivot search (converged or
  the superset it falls back to), to check the guard's convergence rule against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum

import torch

from shardmax.runtime.defaults import SPLIT_PIPELINE_MAX_ROWS

__all__ = [
    "GuardReason",
    "NucleusDecision",
    "candidates_of",
    "exact_nucleus_keep",
    "lse_error_bound",
    "min_p_keep",
    "nucleus_guard",
    "split_pipeline_model_keep",
    "top_k_keep",
]

FP32_EPS = 2.0**-23


class GuardReason(IntEnum):
    """Why a top-p / min-p row may not be verified from candidates (0 = it may)."""

    OK = 0
    NAN = 1  # NaN / +inf in the row: vLLM's searches are undefined there
    NOT_COVERED = 2  # the nucleus or the first excluded value is below what candidates prove
    MASS_MARGIN = 3  # the mass at the boundary is within rounding of p: vLLM may pick j +- 1
    TIE_STRADDLE = 4  # the last kept and first excluded values are equal (pipelines differ)
    NOT_CONVERGED = 5  # the gap at the boundary is below vLLM's search resolution
    MIN_P_NOT_COVERED = 6  # a rank's C-th candidate still passes the min-p threshold
    MIN_P_MARGIN = 7  # a value sits within 2 ulp of the min-p threshold (log bits may differ)


@dataclass(frozen=True)
class NucleusDecision:
    """:func:`nucleus_guard`'s answer for one row: the kept ids when ``reason`` is OK."""

    reason: GuardReason
    kept_ids: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return self.reason == GuardReason.OK


def lse_error_bound(lse: float) -> float:
    """The LSE error bound of the compact exchange (research §2.3): ``2**-16 + 2**-20 |L|``."""
    return 2.0**-16 + 2.0**-20 * abs(lse)


def _check_rows(name: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.float32:
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name}: expected a 2-D fp32 tensor [B, V], got {got}")


def min_p_keep(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """vLLM's min-p rule on processed rows: keep ``x >= M + log(min_p)`` (fp32 threshold).

    ``M`` is the exact row max; ``log(min_p)`` is taken in fp32 (``torch.log``; vLLM's Triton
    ``tl.log`` may differ in the last bit, which :func:`nucleus_guard` guards with a 2-ulp
    margin). ``min_p <= 0`` disables the rule for that row.

    Args:
        x: fp32 ``[B, V]`` processed logits (after temperature).
        min_p: float ``[B]``.

    Returns:
        bool ``[B, V]`` keep mask.

    Raises:
        ValueError: shapes or dtypes.
    """
    _check_rows("x", x)
    if min_p.shape != (x.shape[0],):
        raise ValueError(f"min_p: expected shape ({x.shape[0]},), got {tuple(min_p.shape)}")
    mp = min_p.to(torch.float32)
    thr = x.max(dim=1).values + torch.log(torch.where(mp > 0, mp, torch.ones_like(mp)))
    keep = x >= thr[:, None]
    return torch.where((mp > 0)[:, None], keep, torch.ones_like(keep))


def top_k_keep(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The converged top-k kept set per row: the first ``k`` ids in ``(value desc, id asc)``
    order (``-0.0 == +0.0``); ``k <= 0`` or ``k >= V`` keeps everything.

    Args:
        x: fp32 ``[B, V]``. k: int ``[B]``.

    Returns:
        bool ``[B, V]`` keep mask.
    """
    _check_rows("x", x)
    order = _desc_order(x)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(x.shape[1]).expand_as(order).contiguous())
    kk = k.to(torch.int64)[:, None]
    on = (kk > 0) & (kk < x.shape[1])
    return torch.where(on, rank < kk, torch.ones_like(rank, dtype=torch.bool))


def _desc_order(x: torch.Tensor) -> torch.Tensor:
    """Ids sorted by (value desc, id asc), ``-0.0 == +0.0`` (stable sort of the canonical value)."""
    canon = torch.where(x == 0, torch.zeros_like(x), x)
    return torch.sort(canon, dim=1, descending=True, stable=True).indices


def exact_nucleus_keep(
    x: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """The exact nucleus of each processed row, after min-p then top-k (vLLM's order, §1.1).

    Survivors of min-p and top-k get probabilities ``exp(x - LSE)`` over the survivors (fp64);
    in ``(value desc, id asc)`` order the nucleus is the shortest prefix whose mass reaches
    ``top_p`` (``p >= 1``: every survivor; a tiny ``p``: the top survivor alone).

    Args:
        x: fp32 ``[B, V]`` processed logits. top_p: float ``[B]``. top_k, min_p: optional ``[B]``.

    Returns:
        bool ``[B, V]`` keep mask (min-p, top-k and top-p together).

    Raises:
        ValueError: shapes or dtypes, NaN in a row with an active rule (outside the contract:
            guarded to fallback).
    """
    _check_rows("x", x)
    active = top_p.to(torch.float64) < 1.0
    if top_k is not None:
        active |= (top_k > 0) & (top_k < x.shape[1])
    if min_p is not None:
        active |= min_p > 0
    if bool(torch.isnan(x[active]).any()):
        raise ValueError("x: NaN in an active row (outside the exact nucleus' contract: NAN)")
    keep = torch.ones_like(x, dtype=torch.bool)
    if min_p is not None:
        keep &= min_p_keep(x, min_p)
    xs = torch.where(keep, x, torch.full_like(x, -math.inf))
    if top_k is not None:
        keep &= top_k_keep(xs, top_k)
        xs = torch.where(keep, x, torch.full_like(x, -math.inf))
    x64 = xs.to(torch.float64)
    lse = torch.logsumexp(x64, dim=1, keepdim=True)
    order = _desc_order(xs)
    prob = torch.exp(torch.gather(x64, 1, order) - lse)
    mass = torch.cumsum(prob, dim=1)
    p = top_p.to(torch.float64)[:, None]
    # size = 1 + number of prefixes still below p (the prefix that first reaches p is kept)
    size = 1 + (mass < p).sum(dim=1, keepdim=True)
    in_prefix = torch.arange(x.shape[1])[None, :] < size
    nucleus = torch.zeros_like(keep)
    nucleus.scatter_(1, order, in_prefix)
    return torch.where(p >= 1.0, keep, keep & nucleus)


def candidates_of(
    row: torch.Tensor, ranges: list[tuple[int, int, int]], c: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's top-``c`` ``(values fp32, global ids int64)`` of one processed row, in
    ``(value desc, id asc)`` order (what each rank sends).

    Args:
        row: fp32 ``[V]``. ranges: ``(vocab_start, num_valid, width)`` per rank
            (:func:`shardmax.testing.shards.vllm_shard_ranges`). c: candidates per rank.
    """
    out = []
    for start, n, _ in ranges:
        part = row[start : start + n][None, :]
        order = _desc_order(part)[0, :c]
        out.append((part[0, order], order.to(torch.int64) + start))
    return out


def nucleus_guard(
    candidates: list[tuple[torch.Tensor, torch.Tensor]],
    lse: float,
    row_max: float,
    row_min_finite: float,
    top_p: float,
    *,
    rows_in_step: int,
    top_k: int = 0,
    min_p: float = 0.0,
    has_nan: bool = False,
) -> NucleusDecision:
    """May this top-p (and/or min-p) row be verified from the ranks' candidates?

    Inputs are what a sharded finish has: each rank's top-C ``(values, ids)`` (value desc,
    id asc), the global ``LSE`` (from per-rank ``(max, sum-exp)``; accurate to
    :func:`lse_error_bound`), the exact row max and smallest finite value. Rules, each against
    the vLLM behaviour it protects (research §2.4):

    * ``NAN``: NaN/+inf in the row -- vLLM's pivot searches are undefined.
    * ``MIN_P_NOT_COVERED``: a rank's C-th candidate is still ``>=`` the min-p threshold, so the
      candidates may not hold every survivor. ``MIN_P_MARGIN``: a candidate within 2 ulp of the
      threshold (vLLM's fp32 ``tl.log`` may round differently from ours).
    * ``NOT_COVERED``: the merged candidates are exact only above ``tau`` = the largest C-th
      value over ranks (a rank that sent all its values proves everything); the nucleus and the
      first excluded value must lie above ``tau``.
    * ``MASS_MARGIN``: ``|C_j - p|`` and ``|C_{j-1} - p|`` must exceed ``delta C + j 2**-23``
      (LSE error ``delta`` and fp32 accumulation of ``j`` terms), else vLLM's rounding can move
      the boundary by one; and the budget ``p - C_{j-1}`` must exceed ``delta C_{j-1} + (j + 2)
      2**-23`` (``C_0 = 0``): vLLM trims ``uint32((C_j - p) / p_j)`` boundary ties, whose three
      fp32 roundings (the sum's ``j`` terms, the difference, the quotient) reach a whole tie
      when the budget is within them -- a top-p far below the top token's probability (``p``
      below ~2**-25 ``p_1``) then trims the top token itself and vLLM masks the whole row
      (found by a review: token 0 where the exact nucleus keeps the top token, unflagged).
    * ``TIE_STRADDLE``: last kept value == first excluded value -- vLLM's monolithic kernel keeps
      every tied id, its split pipeline keeps them in index order (§1.5).
    * ``NOT_CONVERGED``: every row with both min-p and top-p (vLLM's top-p search runs on the
      min-p-masked row, a ``-inf`` tail, and can keep fewer ids than the survivors' exact
      nucleus: not reproduced); otherwise the monolithic kernel (``rows_in_step > 64`` or top-k
      active) needs
      ``p_b - p_next > p_max 2**-16``; split pipeline (``<= 64`` rows, top-p only) needs
      ``x_b - x_next > 2 (max - min) / 9**5`` (its 5 rounds of 8-pivot ladders).

    ``top_p >= 1`` checks the min-p / top-k rules only; top-k (``0 < top_k < C``, else
    ``NOT_COVERED``) is applied to the merged candidates before the nucleus (renormalised over
    the kept k).

    Raises:
        ValueError: top-p, min-p and top-k all off, or no candidates.

    Returns:
        :class:`NucleusDecision` with the kept global ids (value desc, id asc) when OK.
    """
    if top_p >= 1.0 and min_p <= 0.0 and top_k <= 0:
        raise ValueError("nucleus_guard: top-p, min-p and top-k all off: nothing to guard")
    if not candidates:
        raise ValueError("candidates: expected one (values, ids) pair per rank, got none")
    if has_nan or not math.isfinite(row_max):
        return NucleusDecision(GuardReason.NAN)
    c = max(int(v.numel()) for v, _ in candidates)
    if top_k >= c:  # the kept k are not all among the candidates
        return NucleusDecision(GuardReason.NOT_COVERED)
    vals = torch.cat([v for v, _ in candidates]).to(torch.float32)
    ids = torch.cat([i for _, i in candidates]).to(torch.int64)
    canon = torch.where(vals == 0, torch.zeros_like(vals), vals)
    # merge: value desc, id asc
    order = torch.argsort(ids)
    canon, vals, ids = canon[order], vals[order], ids[order]
    order = torch.sort(canon, descending=True, stable=True).indices
    vals, ids = vals[order], ids[order]
    # tau: values strictly above it are complete; a rank with fewer than C values proves all
    full = [v for v, _ in candidates if v.numel() >= c]
    tau = max((float(v[-1]) for v in full), default=-math.inf)
    if min_p > 0.0:
        thr = float(
            torch.tensor(row_max, dtype=torch.float32)
            + torch.log(torch.tensor(min_p, dtype=torch.float32))
        )
        if any(v.numel() >= c and float(v[-1]) >= thr for v, _ in candidates):
            return NucleusDecision(GuardReason.MIN_P_NOT_COVERED)
        ulp = 2.0 * abs(thr) * FP32_EPS + 1e-38
        if bool(((vals - thr).abs() <= ulp).any()):
            return NucleusDecision(GuardReason.MIN_P_MARGIN)
        if top_p < 1.0:  # vLLM's top-p search on the min-p-masked row (a -inf tail)
            return NucleusDecision(GuardReason.NOT_CONVERGED)
        keep = vals >= thr
        vals, ids = vals[keep], ids[keep]
        tau = max(tau, thr)  # below the threshold nothing survives: complete by construction
    if 0 < top_k < vals.numel():
        vals, ids = vals[:top_k], ids[:top_k]
        tau = -math.inf  # the k kept values are exact (k < C)
    if top_p >= 1.0:
        return NucleusDecision(GuardReason.OK, tuple(int(i) for i in ids))
    # probabilities over the survivors: renormalise when min-p / top-k removed mass
    x64 = vals.to(torch.float64)
    if min_p > 0.0 or top_k > 0:
        lse_used = float(torch.logsumexp(x64, 0))
        delta = 2.0**-20 * (1.0 + abs(lse_used))  # exact candidates: fp64 combine, fp32 inputs
    else:
        lse_used = lse
        delta = lse_error_bound(lse)
    prob = torch.exp(x64 - lse_used)
    mass = torch.cumsum(prob, 0)
    below = int((mass < top_p).sum())
    if below >= vals.numel():  # the candidates do not reach p
        return NucleusDecision(GuardReason.NOT_COVERED)
    j = below + 1  # nucleus size
    if j >= vals.numel():  # the first excluded value is not among the candidates
        return NucleusDecision(GuardReason.NOT_COVERED)
    v_last, v_next = float(vals[j - 1]), float(vals[j])
    if not (v_last > tau and v_next > tau):
        return NucleusDecision(GuardReason.NOT_COVERED)
    c_j = float(mass[j - 1])
    c_prev = float(mass[j - 2]) if j >= 2 else 0.0
    if (
        abs(c_j - top_p) <= delta * c_j + j * FP32_EPS
        or (j >= 2 and abs(c_prev - top_p) <= delta * c_prev + (j - 1) * FP32_EPS)
        or top_p - c_prev <= delta * c_prev + (j + 2) * FP32_EPS
    ):
        return NucleusDecision(GuardReason.MASS_MARGIN)
    if v_last == v_next:
        return NucleusDecision(GuardReason.TIE_STRADDLE)
    monolithic = rows_in_step > SPLIT_PIPELINE_MAX_ROWS or top_k > 0
    if monolithic:
        p_b, p_n, p_max = float(prob[j - 1]), float(prob[j]), float(prob[0])
        ok = p_b - p_n > p_max * 2.0**-16
    else:
        ok = v_last - v_next > 2.0 * (row_max - row_min_finite) / 9.0**5
    if not ok:
        return NucleusDecision(GuardReason.NOT_CONVERGED)
    return NucleusDecision(GuardReason.OK, tuple(int(i) for i in ids[:j]))


SPLIT_ROUNDS = 5
SPLIT_LADDER = 8


def split_pipeline_model_keep(x: torch.Tensor, top_p: float) -> tuple[torch.Tensor, bool]:
    """A model of vLLM's split top-p pipeline on one processed row: ``(keep bool [V], converged)``.

    From the research description (§1.1), in fp64 -- it models the search's *structure*, not
    vLLM's fp32 rounding or its slicing, and is no vLLM code: probabilities
    ``prob = exp(x - M) / Z``; ``SPLIT_ROUNDS`` rounds, each evaluating a geometric ladder of
    ``SPLIT_LADDER`` pivots strictly inside the current bracket (first bracket:
    ``exp(min - M) / Z`` .. ``1 / Z``); a pivot ``q`` is accepted when the mass above it,
    ``m(q) = sum(prob[prob > q])``, reaches ``p`` and ``m(q) - b * count(b) < p`` for the
    smallest kept probability ``b`` -- the kept value groups are then the nucleus's, and the
    boundary group's duplicates are kept in index order up to what ``p`` needs (so a converged
    search returns :func:`exact_nucleus_keep`'s set). Otherwise the bracket narrows to the two
    ladder pivots around ``p``; after the last round the largest evaluated pivot with
    ``m(q) >= p`` is used (a superset of the nucleus), or no mask at all.

    Raises:
        ValueError: ``x`` is not a 1-D float tensor with a finite value, or ``top_p`` is not in
            ``(0, 1]``.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 1 or not x.is_floating_point():
        raise ValueError(f"x: expected a 1-D float tensor, got {getattr(x, 'shape', type(x))}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p: expected a value in (0, 1], got {top_p}")
    x64 = x.to(torch.float64)
    finite = torch.isfinite(x64)
    if not bool(finite.any()):
        raise ValueError("x: no finite value")
    exact = exact_nucleus_keep(x.to(torch.float32)[None], torch.tensor([top_p]))[0]
    if top_p >= 1.0:
        return exact, True
    m = float(x64[finite].max())
    prob = torch.where(finite, torch.exp(x64 - m), torch.zeros_like(x64))
    prob = prob / prob.sum()
    lo_log = math.log(float(prob[finite].min()))
    hi_log = math.log(float(prob.max()))
    best: float | None = None  # the largest evaluated pivot whose mass reaches p
    steps = torch.arange(1, SPLIT_LADDER + 1, dtype=torch.float64) / (SPLIT_LADDER + 1)
    for _ in range(SPLIT_ROUNDS):
        qs = torch.exp(lo_log + (hi_log - lo_log) * steps)
        above = prob[None, :] > qs[:, None]  # [ladder, V]
        masses = (above * prob[None, :]).sum(dim=1)
        for i in range(SPLIT_LADDER):
            mass = float(masses[i])
            if mass < top_p:
                continue
            best = max(best, float(qs[i])) if best is not None else float(qs[i])
            b = float(prob[above[i]].min())
            if mass - b * int((prob[above[i]] == b).sum()) < top_p:
                return exact, True
        n_reach = int((masses >= top_p).sum())  # the ladder's lower pivots reach p
        if n_reach > 0:
            lo_log = math.log(float(qs[n_reach - 1]))
        if n_reach < SPLIT_LADDER:
            hi_log = math.log(float(qs[n_reach]))
    if best is None:
        return torch.ones_like(finite), False
    return (prob > best) | (x64 == m), False
