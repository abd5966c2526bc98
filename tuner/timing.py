"""Kernel timing: CUDA-graph replay of R launches, medians with p20/p80 (design §5 rule 3).

Imports only torch (no optuna, no triton), so ``python -m tuner --help`` and this module work on
the GPU image before the Optuna wheels are installed.

``measure(step, copies)`` captures ``launches`` calls ``step(i)`` round-robin over ``copies``
input sets into ONE graph, replays it ``replays`` times and reports per-launch microseconds
(replay time / launches). ``copies > 1`` rotates inputs so that each launch reads cold data
(L2-cold); ``copies == 1`` is L2-warm (decode: the LM head has just written the logits).
Every count is fixed, so in a distributed sweep every rank runs the same number of collectives.
On the CPU (Triton interpreter) timing is wall clock of a few eager calls and means nothing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

LAUNCHES = 20
REPLAYS = 30
WARMUP_CALLS = 3
WARMUP_REPLAYS = 3
CPU_REPLAYS = 3
L2_COLD_FACTOR = 3
MALL_BYTES_GFX950 = 256 << 20
"""gfx950's last-level cache is the 256 MiB Infinity Cache (MALL), not ``L2_cache_size``."""


@dataclass(frozen=True)
class Timing:
    """Per-launch microseconds: p20/p50/p80 over replays (``samples`` kept for IQR)."""

    p20: float
    p50: float
    p80: float
    samples: tuple[float, ...] = field(default=(), repr=False)
    metric: str = ""

    @property
    def iqr(self) -> float:
        return quantile(self.samples, 0.75) - quantile(self.samples, 0.25) if self.samples else 0.0

    def attrs(self) -> dict[str, Any]:
        return {
            "p20_us": round(self.p20, 3),
            "p50_us": round(self.p50, 3),
            "p80_us": round(self.p80, 3),
            "iqr_us": round(self.iqr, 3),
            "metric": self.metric,
        }


def quantile(xs: tuple[float, ...] | list[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default) without numpy."""
    s = sorted(xs)
    if not s:
        return float("nan")
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(samples: list[float], metric: str) -> Timing:
    return Timing(
        quantile(samples, 0.2),
        statistics.median(samples),
        quantile(samples, 0.8),
        tuple(samples),
        metric,
    )


def last_level_cache_bytes(device: torch.device) -> int:
    props = torch.cuda.get_device_properties(device)
    l2 = int(getattr(props, "L2_cache_size", 0) or 0)
    if torch.version.hip:
        l2 = max(l2, MALL_BYTES_GFX950)
    return l2 or (64 << 20)


def copies_for_cold(
    bytes_per_copy: int, device: torch.device, *, cap: int = 64, budget_bytes: int = 8 << 30
) -> int:
    """Input copies so that one round-robin pass streams >= 3x the last-level cache."""
    if device.type != "cuda" or bytes_per_copy <= 0:
        return 1
    want = -(-L2_COLD_FACTOR * last_level_cache_bytes(device) // bytes_per_copy)
    return max(1, min(cap, want, budget_bytes // bytes_per_copy))


def metric_name(device: torch.device, cold: bool) -> str:
    if device.type != "cuda":
        return "cpu interpreter wall clock (meaningless)"
    return f"cuda-graph median us per launch, L2-{'cold' if cold else 'warm'}"


class TimingError(RuntimeError):
    pass


def measure(
    step: Callable[[int], Any],
    copies: int,
    device: torch.device,
    *,
    launches: int = LAUNCHES,
    replays: int = REPLAYS,
    barrier: Callable[[], None] | None = None,
    cold: bool = False,
) -> Timing:
    """Time ``step(i)`` (``i`` = input copy) as described in the module docstring.

    ``barrier`` (distributed) runs before every timed replay on every rank; counts are fixed.
    """
    metric = metric_name(device, cold)
    if device.type != "cuda":
        for i in range(min(copies, 1)):
            step(i)
        samples = []
        for r in range(CPU_REPLAYS):
            t0 = time.perf_counter()
            step(r % copies)
            samples.append((time.perf_counter() - t0) * 1e6)
        return summarize(samples, metric)

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for i in range(WARMUP_CALLS):  # compiles; never time the first call
            step(i % copies)
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for j in range(launches):
                step(j % copies)
    except Exception as e:  # capture failures become a pruned trial, never a wrong time
        raise TimingError(f"cuda graph capture failed: {type(e).__name__}: {e}") from e
    for _ in range(WARMUP_REPLAYS):
        graph.replay()
    torch.cuda.synchronize(device)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(replays):
        if barrier is not None:
            barrier()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / launches)
    del graph
    return summarize(samples, metric)
