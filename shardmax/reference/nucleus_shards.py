"""The top-p level histograms as the TP ranks build and exchange them (plain torch reference).

:mod:`shardmax.reference.nucleus_replay` replays vLLM's top-p search on one row's
:class:`~shardmax.reference.nucleus_replay.LevelHistogram`. Here that histogram is built the
sharded way: every TP rank describes its vocab shard of a row by a fixed-size
:class:`ShardHistogram` -- counts per level key below *its own* top key, its max and ``sum
exp``, the mass of its tail, its smallest finite value and the first-tile sums -- the ranks
all-gather those bytes (:data:`RECORD_BYTES` per row), and every rank merges them into the same
:class:`LevelHistogram` (:func:`merge_shard_histograms`).

Why the merge is exact: rank ``r`` counts the levels ``top_r - j`` for ``j < L``; the merged
histogram needs the levels ``top - j`` for ``top = max_r top_r``, and ``top_r - L < top - L``, so
every rank's counts cover the merged range below its own top (it has no token above its top).
Levels a rank counted below the merged floor join the tail with their exact mass.

Per row and rank, in the exchange (:data:`RECORD_BYTES`): ``counts`` uint16 ``[L]``, ``top_key``
int32, ``m`` / ``s`` / ``tail_s`` / ``min`` fp32, the first tile's ``sum`` / ``sum of squares``
fp32 and count int32, NaN/+inf present int32 -- 1,056 bytes at ``L = 511``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from shardmax.reference.nucleus_replay import (
    HIST_LEVELS,
    LevelHistogram,
    _processed,
    level_keys,
    level_row,
)

__all__ = [
    "RECORD_BYTES",
    "ShardHistogram",
    "decode_record",
    "merge_shard_histograms",
    "record_bytes",
    "shard_histogram",
]


def record_bytes(levels: int = HIST_LEVELS) -> int:
    """Bytes one rank sends per top-p row: ``levels - 1`` uint16 counts and eight 4-byte
    fields."""
    return 2 * (levels - 1) + 8 * 4 + 2  # padded to a multiple of 4


RECORD_BYTES = record_bytes()


@dataclass(frozen=True)
class ShardHistogram:
    """One rank's description of its vocab shard of one row (module docstring). Values are
    processed (``x / T`` in fp32, vLLM's temperature step); ``counts[j]`` = tokens of key
    ``top_key - j`` (saturating at 65535); ``m = -inf`` and ``counts`` all 0 for a shard without a
    finite value."""

    counts: np.ndarray  # uint16 [levels - 1]
    top_key: int
    m: float
    s: float
    tail_s: float
    min_value: float
    tile0_sum: float
    tile0_sumsq: float
    tile0_n: int
    nonfinite: bool
    saturated: bool = False
    """A count of a part of this shard saturated (a split record merged into this one): the
    counts below the merged floor are not exact, the row is flagged."""


def shard_histogram(
    raw_shard: torch.Tensor,
    vocab_start: int,
    temperature: float = 1.0,
    *,
    levels: int = HIST_LEVELS,
    tile0: int = 8192,
) -> ShardHistogram:
    """The :class:`ShardHistogram` of one rank's shard of one row.

    Args:
        raw_shard: bf16 / fp16 ``[num_valid]`` -- the rank's valid columns (padding excluded).
        vocab_start: the global id of the shard's first column (for the first tile's sums).
        temperature: the request's temperature (``0`` / ``1``: values untouched).

    Raises:
        TypeError: ``raw_shard`` not a 1-D bf16 / fp16 tensor.
    """
    if not isinstance(raw_shard, torch.Tensor) or raw_shard.dim() != 1:
        raise TypeError("raw_shard: expected a 1-D tensor")
    raw_shard = raw_shard.detach().cpu()
    keys = level_keys(raw_shard)
    x = _processed(raw_shard, temperature)
    finite = torch.isfinite(x)
    nonfinite = bool((torch.isnan(x) | (x == math.inf)).any())
    n_exact = levels - 1
    t0 = x[: max(0, min(tile0 - vocab_start, x.numel()))]
    t0 = t0[torch.isfinite(t0)].double()
    if not bool(finite.any()):
        return ShardHistogram(
            np.zeros(n_exact, np.uint16), 0, -math.inf, 0.0, 0.0, math.inf,
            float(t0.sum()), float((t0 * t0).sum()), int(t0.numel()), nonfinite,
        )  # fmt: skip
    top = int(keys[finite].max())
    depth = top - keys
    exact = finite & (depth < n_exact)
    counts = torch.bincount(depth[exact].long(), minlength=n_exact)[:n_exact].clamp(max=0xFFFF)
    m = float(x[finite].max())
    e = torch.exp(x[finite].double() - m)
    tail = finite & ~exact
    tail_s = float(torch.exp(x[tail].double() - m).sum()) if bool(tail.any()) else 0.0
    return ShardHistogram(
        counts=counts.numpy().astype(np.uint16),
        top_key=top,
        m=m,
        s=float(e.sum()),
        tail_s=tail_s,
        min_value=float(x[finite].min()),
        tile0_sum=float(t0.sum()),
        tile0_sumsq=float((t0 * t0).sum()),
        tile0_n=int(t0.numel()),
        nonfinite=nonfinite,
    )


def merge_shard_histograms(
    parts: list[ShardHistogram],
    dtype: torch.dtype,
    temperature: float = 1.0,
) -> LevelHistogram | None:
    """Every rank's :class:`ShardHistogram` of a row (rank order) -> the row's
    :class:`LevelHistogram` (module docstring); ``None`` when the row holds NaN / +inf or no
    finite value (vLLM's answer there is not a nucleus: such a row is flagged).

    Raises:
        ValueError: no parts, or parts of different sizes.
    """
    if not parts:
        raise ValueError("parts: expected one ShardHistogram per rank, got none")
    n_exact = parts[0].counts.shape[0]
    if any(p.counts.shape[0] != n_exact for p in parts):
        raise ValueError("parts: every rank must send the same number of levels")
    if any(p.nonfinite for p in parts):
        return None
    live = [p for p in parts if p.m > -math.inf]
    if not live:
        return None
    top = max(p.top_key for p in live)
    m = max(p.m for p in live)
    z = sum(p.s * math.exp(p.m - m) for p in live)
    counts = np.zeros(n_exact, np.int64)
    saturated = False
    tail = 0.0
    values64 = level_row(top, n_exact + 1, dtype, temperature)
    for p in live:
        shift = top - p.top_key  # rank level j is merged level j + shift
        c = p.counts.astype(np.int64)
        saturated |= bool((c >= 0xFFFF).any()) or p.saturated
        keep = n_exact - shift
        if keep > 0:
            counts[shift:] += c[:keep]
        below = c[max(keep, 0) :]
        if below.any():  # counted by the rank, below the merged floor: exact mass into the tail
            lv = level_row(p.top_key, n_exact, dtype, temperature)[max(keep, 0) :]
            tail += float((below * np.exp(lv - m)).sum())
        tail += p.tail_s * math.exp(p.m - m)
    n0 = sum(p.tile0_n for p in parts)
    mean = sum(p.tile0_sum for p in parts) / n0 if n0 else 0.0
    var = max(sum(p.tile0_sumsq for p in parts) / n0 - mean * mean, 0.0) if n0 else 0.0
    return LevelHistogram(
        values=values64[:n_exact],
        counts=counts,
        top_key=top,
        m=m,
        z=z,
        floor_value=float(values64[n_exact]),
        tail=tail / z,
        min_value=min(p.min_value for p in live),
        tile0_mean=mean,
        tile0_std=math.sqrt(var),
        saturated=saturated,
    )


def decode_record(words: torch.Tensor) -> ShardHistogram:
    """The :class:`ShardHistogram` one rank's kernel record states (``topp_hist_*``, layout in
    :mod:`shardmax.ops.topp`): int32 ``[levels // 2 + 8]`` -> counts, top key, the fp32 fields.

    Raises:
        ValueError: not a 1-D int32 tensor of an even level count's record size.
    """
    if not isinstance(words, torch.Tensor) or words.dim() != 1 or words.dtype != torch.int32:
        raise ValueError("words: expected a 1-D int32 record")
    head = words.numel() - 8
    if head < 2:
        raise ValueError(f"words: {words.numel()} words is not a record")
    w = words.detach().cpu()
    c = w[:head].to(torch.int64)
    counts = torch.stack([c & 0xFFFF, (c >> 16) & 0xFFFF], 1).flatten()[: 2 * head - 1]
    f = w[head + 2 :].view(torch.float32).tolist()
    top, flags = int(w[head]), int(w[head + 1])
    return ShardHistogram(
        counts=counts.numpy().astype(np.uint16),
        top_key=max(top, 0),
        m=f[0],
        s=f[1],
        tail_s=f[2],
        min_value=f[3],
        tile0_sum=f[4],
        tile0_sumsq=f[5],
        tile0_n=flags & 0x1FFFFFFF,
        nonfinite=bool((flags >> 30) & 1),
        saturated=bool((flags >> 29) & 1),
    )
