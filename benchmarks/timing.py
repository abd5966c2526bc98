"""Timing primitives: CUDA-graph replay timer, copy-bandwidth probe, empty-kernel launch.

Method (design §5 rule 3, the same as ``tuner/timing.py``): ``launches`` calls ``step(i)``
round-robin over ``copies`` input sets are captured into ONE CUDA graph after eager warm-up;
the graph is replayed ``replays`` times; each sample is replay time / launches (CUDA events),
reported as p20 / median / p80. ``copies > 1`` makes every launch read inputs that are not in
L2 (copies chosen so one pass streams >= 3x the L2); ``copies == 1`` is L2-warm.

Distributed (``dist_sync`` given): every rank captures and replays the same fixed counts; the
ranks agree that capture succeeded on all of them before any replay (a rank whose capture
failed would otherwise leave its peers waiting in NCCL inside a replay), and a barrier runs
before every timed replay.

On a CPU (smoke runs of the harness) the timer falls back to wall clock of eager calls; those
numbers mean nothing and the metric says so.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

LAUNCHES_MIN = 8
LAUNCHES_MAX = 64
REPLAYS = 30
WARMUP_CALLS = 2
WARMUP_REPLAYS = 3
L2_COLD_FACTOR = 3
COPIES_CAP = 32
COPY_BUDGET_BYTES = 6 << 30


class TimingError(RuntimeError):
    """Capture or replay failed (on this rank or, distributed, on any rank)."""


@dataclass(frozen=True)
class Stat:
    """Per-launch microseconds over replays."""

    p20: float
    p50: float
    p80: float
    launches: int = 0
    copies: int = 0
    metric: str = ""


def quantile(xs: list[float] | tuple[float, ...], q: float) -> float:
    """Linear-interpolated quantile (numpy's default) without numpy; NaN for no samples."""
    s = sorted(xs)
    if not s:
        return float("nan")
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(samples: list[float], launches: int, copies: int, metric: str) -> Stat:
    return Stat(
        quantile(samples, 0.2),
        statistics.median(samples),
        quantile(samples, 0.8),
        launches,
        copies,
        metric,
    )


def l2_bytes(device: Any) -> int:
    import torch

    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0) or 0) or (64 << 20)


def copies_for_cold(bytes_per_copy: int, device: Any, cap: int = COPIES_CAP) -> int:
    """Input copies so that one round-robin pass streams >= 3x the L2 (1 on CPU)."""
    if getattr(device, "type", str(device)) != "cuda" or bytes_per_copy <= 0:
        return 1
    want = -(-L2_COLD_FACTOR * l2_bytes(device) // bytes_per_copy)
    return max(1, min(cap, want, COPY_BUDGET_BYTES // bytes_per_copy))


def launches_for(copies: int) -> int:
    """Launches per graph: a multiple of ``copies`` (each copy equally often), >= LAUNCHES_MIN."""
    n = copies * max(1, -(-LAUNCHES_MIN // copies))
    return min(n, max(LAUNCHES_MAX, copies))


def measure(
    step: Callable[[int], Any],
    copies: int,
    device: Any,
    *,
    launches: int | None = None,
    replays: int = REPLAYS,
    dist_sync: Callable[[bool], bool] | None = None,
    barrier: Callable[[], None] | None = None,
    cold: bool = True,
) -> Stat:
    """Time ``step(i)`` (``i`` = input copy index) as the module docstring says.

    ``dist_sync(ok) -> all_ok`` is called once after capture on every rank (distributed);
    ``barrier`` runs before every timed replay.
    """
    n = launches if launches is not None else launches_for(copies)
    if getattr(device, "type", str(device)) != "cuda":
        return _measure_cpu(step, copies, n)
    import torch

    metric = f"cuda-graph replay, us per launch, L2-{'cold' if cold and copies > 1 else 'warm'}"
    err = ""
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for i in range(WARMUP_CALLS):  # compiles; the first call is never timed
                step(i % copies)
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
    except Exception as e:
        err = f"warm-up failed: {type(e).__name__}: {e}"
    graph = torch.cuda.CUDAGraph()
    if not err:
        try:
            # thread_local: the NCCL watchdog thread may query events while this one captures.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                for j in range(n):
                    step(j % copies)
        except Exception as e:
            err = f"cuda graph capture failed: {type(e).__name__}: {e}"
    ok = not err  # distributed: exactly one dist_sync per call on every rank, whatever failed
    if dist_sync is not None:
        ok = dist_sync(ok)
    if not ok:
        del graph
        raise TimingError(err or "warm-up or capture failed on another rank")
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
        samples.append(start.elapsed_time(end) * 1000.0 / n)
    del graph
    return summarize(samples, n, copies, metric)


def _measure_cpu(step: Callable[[int], Any], copies: int, n: int) -> Stat:
    step(0)
    samples = []
    for r in range(3):
        t0 = time.perf_counter()
        step(r % copies)
        samples.append((time.perf_counter() - t0) * 1e6)
    return summarize(samples, 1, copies, "cpu wall clock of eager calls (meaningless)")


def copy_bandwidth_gbps(device: Any, nbytes: int = 1 << 30, replays: int = 10) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read + written (graph replay)."""
    import torch

    if getattr(device, "type", str(device)) != "cuda":
        return float("nan")
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    bufs = [src, dst]
    st = measure(
        lambda i: bufs[1].copy_(bufs[0]), 1, device, launches=4, replays=replays, cold=False
    )
    bufs.clear()
    del src, dst
    torch.cuda.empty_cache()
    return 2.0 * nbytes / (st.p50 * 1e-6) / 1e9


def _empty_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def empty_kernel(out_ptr, STORE: tl.constexpr):
        if STORE:
            tl.store(out_ptr, 1)

    return empty_kernel


def empty_launch_us(device: Any, launches: int = 200, replays: int = REPLAYS) -> Stat:
    """One trivial Triton program (no memory traffic) per launch, under graph replay."""
    import torch

    kernel = _empty_kernel()
    buf = torch.zeros(1, dtype=torch.int32, device=device)

    def step(i: int) -> None:
        kernel[(1,)](buf, STORE=False)

    return measure(step, 1, device, launches=launches, replays=replays, cold=False)


def kernel_times(step: Callable[[], Any], calls: int = 20) -> dict[str, float]:
    """GPU us per call of ``step`` by kernel name (torch profiler over ``calls`` calls after one
    untimed call), largest first; names cut to 80 characters."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            out[e.name[:80]] = out.get(e.name[:80], 0.0) + us / calls
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))
