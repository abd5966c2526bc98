"""Top-p / min-p rows of sharded verification, between the all_gather and the finish kernel.

Every rank runs this on the same gathered bytes (so every rank decides the same): from the merged
top-C candidates of each row (exact global top-C, value desc / id asc), each rank's own C-th
candidate, and the global ``(max, sum-exp)`` and smallest finite value of the records, it returns
per logits row

* ``keep`` (int32): how many of the merged candidates vLLM keeps on this row -- min-p
  (``x >= max + log(min_p)`` in fp32), then top-k, then the exact nucleus of top-p -- or 0 where
  no top-p/min-p rule is active (the finish then uses its own top-k or temperature path);
* ``unsafe`` (bool): the row may not be decided from candidates (the guard of
  :func:`shardmax.reference_nucleus.nucleus_guard`, same rules, vectorised): the finish flags the
  request for fallback if the decision used this row.

Torch ops only (no host sync): CUDA-graph capturable. The rules and the vLLM behaviour each one
protects against are documented in :mod:`shardmax.reference_nucleus` (research §2.4).
"""

from __future__ import annotations

import math

import torch

from shardmax.keys import EMPTY_KEY
from shardmax.keys import unpack_values as keys_unpack_values
from shardmax.reference_nucleus import SPLIT_PIPELINE_MAX_ROWS

__all__ = ["nucleus_rows", "unpack_values"]

FP32_EPS = 2.0**-23


def unpack_values(keys: torch.Tensor) -> torch.Tensor:
    """fp32 values of packed int64 keys (:func:`shardmax.keys.unpack_values`), ``EMPTY_KEY``
    (an absent candidate) -> ``-inf``."""
    vals = keys_unpack_values(keys)
    return torch.where(keys == EMPTY_KEY, torch.full_like(vals, -math.inf), vals)


def _f32_pair(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hi = (words >> 32).to(torch.int32).view(torch.float32)
    lo = (words & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    return hi, lo


def nucleus_rows(
    merged: torch.Tensor,
    rank_last: torch.Tensor,
    records: torch.Tensor,
    ms_word: int,
    min_word: int,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    rows_in_step: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keep int32 [rows], unsafe bool [rows])`` -- see the module docstring.

    Args:
        merged: int64 ``[rows, C]`` merged candidate keys (value desc, id asc).
        rank_last: int64 ``[rows]`` the largest over ranks of each rank's C-th key (values above
            it are complete in ``merged``).
        records: int64 ``[parts, rows, W]`` the gathered records (all ranks and splits).
        ms_word, min_word: word index of ``(max, sum-exp)`` and of the smallest finite value.
        temperature, top_k, top_p, min_p: per logits row (fp32 / int64 / fp64 / fp32), already
            gathered through the request's slot; greedy rows have ``temperature == 0``.
        rows_in_step: logits rows of the step (vLLM's split top-p pipeline runs for <= 64 rows
            without top-k, its monolithic kernel otherwise).
    """
    rows, c = merged.shape
    dev = merged.device
    v = unpack_values(merged)  # [rows, C] fp32, sorted desc
    col = torch.arange(c, device=dev)[None, :]
    tau = unpack_values(rank_last)  # [rows]
    # global LSE and smallest finite value from the records (fp64 combine over parts)
    m32, s32 = _f32_pair(records[..., ms_word])
    m, s = m32.to(torch.float64), s32.to(torch.float64)
    big = m.max(dim=0).values
    safe_big = torch.where(torch.isfinite(big), big, torch.zeros_like(big))
    terms = torch.where(m == -math.inf, torch.zeros_like(s), s * torch.exp(m - safe_big))
    lse_all = safe_big + torch.log(terms.sum(dim=0))
    lo = _f32_pair(records[..., min_word])[0].min(dim=0).values.to(torch.float64)

    sampled = temperature != 0
    k_on = sampled & (top_k > 0) & (top_k < c)  # k >= C: the kernel flags it (capacity)
    p_on = sampled & (top_p < 1.0)
    m_on = sampled & (min_p > 0.0)
    active = p_on | m_on
    unsafe = torch.zeros(rows, dtype=torch.bool, device=dev)

    # min-p: threshold in fp32, survivors are a prefix of the sorted candidates
    one = torch.ones_like(min_p)
    thr = torch.where(m_on, v[:, 0] + torch.log(torch.where(m_on, min_p, one)), -math.inf)
    n1 = (v >= thr[:, None]).sum(dim=1)
    ulp = 2.0 * thr.abs() * FP32_EPS + 1e-38
    near = ((v - thr[:, None]).abs() <= ulp[:, None]).any(dim=1)
    unsafe |= m_on & ((tau >= thr) | near)  # survivors not all in the candidates / at the edge
    # top-k after min-p; with fewer survivors than k vLLM's search runs on a -inf tail
    n2 = torch.where(k_on, torch.minimum(n1, top_k), n1)
    unsafe |= m_on & k_on & (n1 <= top_k)
    complete = m_on | k_on  # survivors known exactly (the checks above)
    # top-p on the survivors: probabilities renormalised when min-p / top-k truncated the row
    x64 = v.to(torch.float64)
    surv = col < n2[:, None]
    trunc = torch.logsumexp(torch.where(surv, x64, -math.inf), dim=1)
    lse = torch.where(complete, trunc, lse_all)
    delta = torch.where(complete, 2.0**-20 * (1.0 + lse.abs()), 2.0**-16 + 2.0**-20 * lse.abs())
    prob = torch.where(surv, torch.exp(x64 - lse[:, None]), torch.zeros_like(x64))
    mass = torch.cumsum(prob, dim=1)
    p = top_p.to(torch.float64)
    below = ((mass < p[:, None]) & surv).sum(dim=1)
    j = torch.clamp(below + 1, max=n2)  # nucleus size (all survivors at most)
    reaches = below < n2  # the survivors' mass reaches p within the candidates
    idx = (j - 1).clamp(min=0)
    nxt = j.clamp(max=c - 1)
    v_last = v.gather(1, idx[:, None])[:, 0]
    has_next = j < n2
    v_next = torch.where(has_next, v.gather(1, nxt[:, None])[:, 0], -math.inf)
    c_j = mass.gather(1, idx[:, None])[:, 0]
    c_prev = torch.where(j >= 2, mass.gather(1, (j - 2).clamp(min=0)[:, None])[:, 0], 0.0)
    jf = j.to(torch.float64)
    margin_j = (c_j - p).abs() <= delta * c_j + jf * FP32_EPS
    margin_prev = (j >= 2) & ((c_prev - p).abs() <= delta * c_prev + (jf - 1) * FP32_EPS)
    covered = complete | (reaches & has_next & (v_last > tau) & (v_next > tau))
    covered &= reaches | complete
    tie = has_next & (v_last == v_next)
    monolithic = k_on | (rows_in_step > SPLIT_PIPELINE_MAX_ROWS)
    p_last = prob.gather(1, idx[:, None])[:, 0]
    p_next = torch.where(has_next, prob.gather(1, nxt[:, None])[:, 0], 0.0)
    conv_mono = (p_last - p_next) > prob[:, 0] * 2.0**-16
    span = x64[:, 0] - lo
    conv_split = (v_last.to(torch.float64) - v_next.to(torch.float64)) > 2.0 * span / 9.0**5
    converged = ~has_next | torch.where(monolithic, conv_mono, conv_split)
    top_p_bad = ~covered | margin_j | margin_prev | tie | ~converged
    unsafe |= p_on & top_p_bad
    unsafe |= active & ~torch.isfinite(v[:, 0])
    keep = torch.where(p_on, j, n2)
    keep = torch.where(active, keep.clamp(min=1), torch.zeros_like(keep))
    return keep.to(torch.int32), unsafe & active
