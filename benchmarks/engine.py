"""Engine-faithful decode loop: verification as vLLM's model runner V2 calls it (issue 19).

V2 replays the model's forward from a CUDA graph and then calls verification EAGERLY, so the
host cost of the call counts as much as its GPU time. Each timed step of this loop is:

0. the engine's wait: with async scheduling vLLM keeps ``max_concurrent_batches`` = 2 steps in
   flight (V2 at pipeline size 1: the engine core's batch queue, then ``AsyncOutput.get_output``
   waits on the oldest step's copy event), so before step ``i`` the host waits for step
   ``i - --lookahead`` (default 2) to finish on the GPU -- untimed, outside the call; without it
   the host would run ever further ahead and a call's host time would include the driver's
   back-pressure;

1. the stand-in forward: a captured CUDA graph of matmuls taking about ``--forward-us`` of GPU
   time (replayed, as V2 replays the model);
2. the host work of preparing the step's batch tensors (a pinned host->device copy of the
   request slots, the same for every path);
3. verification, eager, with everything the engine's call does on the host:
   * ``vllm``: vLLM's own chain on the full logits (:mod:`shardmax.testing.vllm_chain`: the
     fp32 copy where a request needs processing, vLLM's temperature / top-k / top-p kernels,
     ``rejection_sample``, ``get_num_sampled_and_rejected``; at TP > 1 after the full-logits
     all-gather);
   * ``shardmax``: what the plug-in runs at TP 1 (``shardmax.integrations.vllm.step``): the
     step's host checks (``check_step_batch``), the shard's cached plan, its run replayed from a
     CUDA graph (``shard.graphed(plan).run``: the step's addresses written into an output
     slot's page-locked argument table and one graph launch) -- no host
     sync;
   * ``shardmax-eager``: the same with the plan's launches made eagerly (``plan.run``;
     ``SHARDMAX_VLLM_GRAPHS=0``);
   * ``shardmax+resolve``: what the plug-in runs on a sampled step: the same, one host read of
     the flags (a sync) and the flagged requests resolved per request
     (:mod:`shardmax.ops.resolve`: their rows gathered, vLLM's own kernels on them with the
     whole step's decisions, at a fixed capacity replayed from CUDA graphs:
     :class:`~shardmax.integrations.vllm.resolution.CapturedResolution`); every request of it is
     cross-checked against ``vllm``;
   * ``shardmax+device`` (TP 1, temperature traffic: where the plug-in uses it): the replayed
     run, then
     :class:`~shardmax.integrations.vllm.fallback.DeviceFallback` -- the device decides whether
     a request was flagged and, only then, runs vLLM's chain on the whole step inside a
     conditional CUDA graph (no host read); every request of it is cross-checked against
     ``vllm``;
   * ``shardmax+fold`` (where ``shardmax+device`` is): the same decision inside the step's own
     replayed graph (``DeviceFallback.fold`` as the epilogue of ``shard.graphed(plan).run``:
     one launch, one table, the predicate and vLLM's chain a conditional node behind the step's
     kernels) -- the plug-in's TP-1 temperature call (its default on CUDA);
   * ``shardmax-hist+fold`` (top-p traffic, TP 1): the histogram plan with the folded device
     fallback (vLLM's chain on the flagged requests' padded sub-batch, on the whole step at its
     exact size past the capacity; no host read) -- the plug-in's top-p call at TP 1;
   * ``shardmax-hist+resolve`` (top-p traffic): the same with the top-p rows verified from level
     histograms (``VocabShard.verify(rows, topp=pipeline_for(rows, "cuda", version))``, replayed
     from its CUDA graphs: the plug-in's top-p call) instead of
     candidates;
4. the accepted tokens accumulated on the device (read once at the end, as V2 reads its outputs
   asynchronously).

Every path runs the same fixed number of steps on the same batches (realistic traffic:
:func:`shardmax.testing.traffic.realistic_batch`: LM-like rows, drafts often right), in
``--rounds`` interleaved rounds (each round runs its share of every path's steps in turn), so a
slow spell of the host -- its speed moves by up to 2x over tens of seconds on the H200's host --
falls on every path alike. Reported per
(traffic mix, rows, path): host us per verification call (mean, p50, p90 over every step, and
the quietest round's p50), GPU us of the call in
the loop (CUDA events) and under graph replay, step time and tokens/s of the loop, and whether a
run of the path made a host sync (:func:`shardmax.testing.syncs.host_syncs`: torch's sync debug
mode and the event / stream waits it does not report). Targets of issue
19 are evaluated from these numbers only. Needs a GPU.

``--fresh N``: in serving, every step brings new logits and drafts. By default each row count
replays one batch, so the same requests are flagged (or accepted) on every step -- at a row
count whose batch happens to flag a request, every step pays vLLM's chain on it, which
realistic traffic does on a share of the steps only. With ``--fresh N`` each batch shape has N
realistic batches (other seeds, the same shape: the same plans, graphs and signatures), the
next one on each of its steps, so flags and acceptance vary from step to step as in serving;
the checks against vLLM run on every fresh batch of the first shape (the notes say "over N
batches"), the sync check on every batch. The batches of a row count stay resident while it is
timed (a 512-row batch at V = 200064: ~205 MB of bf16 logits, plus vLLM's arguments; at TP > 1
the full logits and the rank's shard each).

``--churn N``: a serving engine's batch changes from step to step as requests arrive and
finish. With it each row count's paths cycle through N batch shapes, one per call (its request
count and the N - 1 below it, each a realistic batch of its own; every shardmax path keeps one
VocabShard for all of them, as the plug-in's runner does), so what a path does per new shape --
a first sighting's host read, a capture, an eviction past its graphs' limit -- is timed in the
loop. The checks against vLLM run on the first shape (each of its ``--fresh`` batches).
``--churn-order walk`` drifts instead:
a random walk over the shapes, one request more, the same or one fewer per step (more shapes
than a cache holds then miss only as the walk leaves the recently seen ones; the walk may not
reach every shape: the note says how many it visits). ``--churn-warm``
gives every shape its first calls before the loop and reports their wall ms apart (a new
shape's one-off cost), so the loop times the steady state of a batch that keeps changing.

At ``--tp N`` (N GPUs; one process each, NCCL) every rank runs the same loop with the same
fixed step counts on its vLLM-layout shard of the same logits (each step built on the host, so
every rank holds the same bits; a rank that fails prints its traceback and exits, and the run
stops): shardmax's paths verify the shard
(replayed from graphs split at the step's collectives, which run eagerly between the replays;
the resolution all-gathers the flagged requests' rows), vLLM's path all-gathers the full logits
first as its LM head does (an all_gather of every rank's padded shard, then the ``[rows, V]``
view: :func:`vllm_full_logits`) and runs its chain on them; rank 0's host and loop times are
reported (the collectives keep the ranks in step), no path is captured whole.

    python -m benchmarks.engine [--rows 4,32,96,256,512] [--vocab 200064] [--steps 200]
        [--mixes greedy,temperature,top_p] [--forward-us 1000] [--lookahead 2] [--rounds 5]
        [--tp 1] [--fresh 1] [--churn 0] [--churn-order cycle] [--churn-warm] [--kernels]
        [--out benchmarks/results/<arch>]
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from .report import write_rows

FIELDS = [
    "mix", "rows", "reqs", "vocab", "dtype", "tp", "path", "host_us_mean", "host_us_p50",
    "host_us_p90", "host_us_p50_best_round", "gpu_us_loop", "gpu_us_graph", "step_us",
    "tokens_per_s", "accepted_per_req", "fallback_rate", "host_sync", "steps", "forward_us", "note",
]  # fmt: skip
HOST_TARGET_US = {"greedy": 50.0, "temperature": 100.0, "top_p": 100.0}
"""Issue 19's host budget per verification call: <= 50 us greedy, <= 100 us sampled."""


def _forward_graph(target_us: float) -> tuple[torch.cuda.CUDAGraph, float]:
    """A captured stand-in forward of about ``target_us`` GPU time (bf16 matmuls)."""
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.matmul(a, b, out=out)
    torch.cuda.synchronize()
    start.record()
    for _ in range(20):
        torch.matmul(a, b, out=out)
    end.record()
    torch.cuda.synchronize()
    per = start.elapsed_time(end) * 1000 / 20
    n = max(1, round(target_us / per))
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.matmul(a, b, out=out)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for _ in range(n):
            torch.matmul(a, b, out=out)
    g.replay()
    torch.cuda.synchronize()
    start.record()
    g.replay()
    end.record()
    torch.cuda.synchronize()
    g.shardmax_buffers = (a, b, out)  # type: ignore[attr-defined]  # the graph reads them
    return g, start.elapsed_time(end) * 1000


class RankShard(NamedTuple):
    """One TP rank's part of the loop: its padded ``[rows, W]`` shard of the step's logits (vLLM's
    layout: :func:`shardmax.testing.shards.vllm_shard_ranges`), its real columns and the group."""

    local: torch.Tensor
    vocab_start: int
    num_valid: int
    group: Any


def vllm_full_logits(gathered: torch.Tensor, tp: int, vocab: int) -> torch.Tensor:
    """vLLM's logits after its LM head's gather: ``gathered`` ``[tp * rows, W]`` (every rank's
    padded shard, all_gather along dim 0, rank-major) -> ``[rows, V]``, the ``[:, :V]`` view of
    the ``[rows, tp * W]`` concatenation (rank ``r``'s columns at ``[r W, r W + W)``, padding
    past ``V`` dropped), as vLLM's ``compute_logits`` returns it."""
    rows, width = gathered.shape[0] // tp, gathered.shape[1]
    return gathered.view(tp, rows, width).permute(1, 0, 2).reshape(rows, tp * width)[:, :vocab]


def _shardmax_step(
    traffic: Any,
    mix: str,
    prefill: Any,
    resolve: tuple[Any, dict[str, Any]] | None = None,
    graphed: bool = True,
    topp: Any = None,
    rank: RankShard | None = None,
    device: Any = None,
    fold: bool = False,
    shard: Any = None,
) -> Callable[[], Any]:
    """The plug-in's verification call on one rank (TP 1: the shard is the whole vocabulary;
    ``rank``: this rank's shard of ``traffic.logits`` and its group): the step's host checks,
    the shard's cached plan, its run (from the plan's CUDA graphs when ``graphed``, split at the
    collectives at TP > 1, else ``plan.run``); with ``resolve = (chain, verify_inputs)`` also
    the flagged requests resolved per request (their rows all-gathered at TP > 1); ``topp``: a
    top-p pipeline (level histograms); ``device``: a
    :class:`~shardmax.integrations.vllm.fallback.DeviceFallback` queued after the run (TP 1),
    the host read and ``resolve`` only on the steps it returns False for; ``fold``: the
    fallback first offered to the replayed run as its epilogue (``DeviceFallback.fold``: inside
    the step's own graph, as the plug-in calls it), the second call only where the step did
    not replay from a slot; ``shard``: the :class:`~shardmax.plan.VocabShard` to run on (its
    cached plans and graphs shared with other calls, as the plug-in's one shard per runner;
    default: a new one). Returns the result."""
    from shardmax.ops.resolve import flagged_requests, gather_rows, resolve_requests
    from shardmax.plan import VocabShard
    from shardmax.runtime.validation import check_step_batch

    if rank is None:
        logits = traffic.logits
        rows, vocab = logits.shape
        if shard is None:
            shard = VocabShard(vocab_start=0, num_valid=vocab, width=vocab, dtype=logits.dtype,
                               device=logits.device)  # fmt: skip
    else:
        logits = rank.local
        rows, width = logits.shape
        if shard is None:
            shard = VocabShard(vocab_start=rank.vocab_start, num_valid=rank.num_valid,
                               width=width, dtype=logits.dtype, device=logits.device,
                               group=rank.group)  # fmt: skip
    t = traffic
    sampled = mix != "greedy"
    seq_lens, prefill_len = prefill

    calls = {"steps": 0, "folded": 0, "second_call": 0, "host_read": 0}

    def step() -> Any:
        batch = check_step_batch(
            rows, logits.device, t.draft_sampled, t.cu_num_logits, t.pos, t.idx_mapping,
            t.expanded_local_pos, t.seed, t.num_speculative_steps, None, seq_lens, prefill_len,
            temperature=t.temperature if sampled else None, top_p=t.top_p,
        )  # fmt: skip
        plan: Any
        if topp is not None:
            plan = shard.verify(rows, topp=topp)
        elif sampled:
            plan = shard.verify(rows, with_candidates=t.top_p is not None)
        else:
            plan = shard.greedy_verify(rows)
        ep = None
        if fold and device is not None and resolve is not None and graphed:
            ep = device.fold(logits, **resolve[1], checks=False)
        res = shard.graphed(plan).run(logits, batch, ep) if graphed else plan.run(logits, batch)
        calls["steps"] += 1
        if not sampled or (ep is not None and ep.queued):
            calls["folded"] += ep is not None
            return res  # greedy, or the device decides inside the replayed graph
        if (
            device is not None
            and resolve is not None
            and device.run(res, logits, **resolve[1], checks=False)
        ):
            calls["second_call"] += 1
            return res  # the device decides; no host read
        if resolve is not None:
            calls["host_read"] += 1
            chain, kw = resolve
            req, _ = flagged_requests(res)  # the plug-in's one host read
            if req.size:
                resolve_requests(
                    res, req, lambda rows: gather_rows(shard.ctx, logits, rows), chain,
                    {**kw, "checks": False},
                )  # fmt: skip
        return res

    step.shard = shard  # type: ignore[attr-defined]  # host_costs times the step's parts
    step.calls = calls  # type: ignore[attr-defined]  # how its steps were decided
    return step


def _vllm_step(
    traffic: Any, chain: Any, kw: dict[str, Any], rank: RankShard | None = None
) -> Callable[[], Any]:
    """vLLM's own chain on the full logits, as ``RejectionSampler.__call__`` runs it; at TP > 1
    (``rank``) on the logits its LM head all-gathers first (:func:`vllm_full_logits`)."""
    if rank is None:

        def step() -> Any:
            return chain.verify(traffic.logits, **kw, checks=False)

        return step
    from shardmax.runtime.collectives import resolve

    coll = resolve(rank.group)
    tp, vocab = coll.world_size, traffic.logits.shape[1]

    def gathered_step() -> Any:
        full = vllm_full_logits(coll.all_gather_dim0(rank.local), tp, vocab)
        return chain.verify(full, **kw, checks=False)

    return gathered_step


def _mismatches(ours: Any, theirs: Any) -> tuple[int, int]:
    """(requests whose tokens or counts differ among those shardmax did not flag, flagged)."""
    flagged = getattr(ours, "fallback", None)
    keep = torch.ones_like(ours[1], dtype=torch.bool) if flagged is None else ~flagged
    n_ours, n_theirs = ours[1].long(), theirs[1].long()
    cols = torch.arange(ours[0].shape[1], device=ours[0].device)[None, :]
    used = cols < n_theirs[:, None]
    tok = ((ours[0] != theirs[0]) & used).any(dim=1)
    bad = (tok | (n_ours != n_theirs) | (ours[2].long() != theirs[2].long())) & keep
    return int(bad.sum()), int((~keep).sum())


class _Cycle:
    """``--churn`` / ``--fresh``: one path's calls on several batches. With ``--churn`` the
    batch shape changes from call to call -- an engine whose batch changes from step to step
    (requests arriving and finishing), so the path's per-shape work (first sightings, captures,
    evictions) falls inside the timed loop. Each shape is one step or a list of its ``--fresh``
    batches (the same shape, other logits and drafts), taken in turn on that shape's calls.
    ``order``: the shapes' indices the calls go through, repeated (default: each in turn).
    :meth:`turn` calls every batch once; :meth:`warm` calls each shape's batches directly
    (neither moves the loop's place in ``order`` or a shape's turn)."""

    def __init__(
        self,
        steps: list[Callable[[], Any]] | list[list[Callable[[], Any]]],
        order: list[int] | None = None,
    ) -> None:
        self.steps: list[list[Callable[[], Any]]] = [
            list(s) if isinstance(s, list) else [s] for s in steps
        ]
        self.order = order or list(range(len(self.steps)))
        self.i = 0
        self._next = [0] * len(self.steps)  # each shape's next fresh batch

    def __call__(self) -> Any:
        shape = self.order[self.i]
        self.i = (self.i + 1) % len(self.order)
        variants = self.steps[shape]
        j = self._next[shape]
        self._next[shape] = (j + 1) % len(variants)
        return variants[j]()

    def turn(self) -> list[Any]:
        """Every batch of every shape once, in order (the checks that must see each of them)."""
        return [step() for variants in self.steps for step in variants]

    def held_calls(self, run: Callable[[Callable[[], Any]], Any], keep: int) -> list[Any]:
        """Every batch of every shape once, in order, each through ``run(call)`` while the
        ``keep`` results before it are held (older ones released, as an engine releases them);
        returns what ``run`` returned for each. Like :meth:`turn`, the loop's place is left as
        it was."""
        held: list[Any] = []
        got = []
        for variants in self.steps:
            for step in variants:
                box: list[Any] = []
                got.append(run(lambda step=step, box=box: box.append(step())))
                held = (held + box)[-keep:] if keep else []
        return got

    def warm(self, calls: int = 3) -> list[list[float]]:
        """``--churn-warm``: each shape's first ``calls`` calls (its fresh batches in turn),
        before the timed loop; the wall ms of each (the device synchronised around it: a first
        sighting's host read and a capture included), per shape."""
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        ms = []
        for variants in self.steps:
            one = []
            for c in range(calls):
                sync()
                t0 = time.perf_counter()
                variants[c % len(variants)]()
                sync()
                one.append((time.perf_counter() - t0) * 1e3)
            ms.append(one)
        return ms


def churn_reqs(reqs: int, shapes: int) -> list[int]:
    """The request counts ``--churn`` cycles through at a row count of ``reqs`` requests:
    ``shapes`` counts from ``reqs`` down (at least 1 request; fewer shapes where ``reqs`` is
    smaller), the row count's own first."""
    return [reqs - j for j in range(min(max(1, shapes), reqs))]


def churn_order(shapes: int, steps: int, walk: bool, seed: int = 0) -> list[int]:
    """The shapes' order of ``--churn-order``: ``cycle`` (each in turn) or ``walk`` -- a random
    walk over the shapes (request counts), one request more, the same or one fewer per step, as
    a batch drifts while requests arrive and finish (``steps`` long, seeded; held at the ends),
    then the same walk backwards, so that the order repeats without a jump."""
    if not walk or shapes <= 1:
        return list(range(max(1, shapes)))
    rng = np.random.default_rng(seed)
    order, at = [], 0
    for move in rng.integers(-1, 2, size=steps):
        at = min(max(at + int(move), 0), shapes - 1)
        order.append(at)
    return order + order[::-1]


def fresh_seed(rows: int, reqs: int, shape_reqs: int, variant: int) -> int:
    """The traffic seed of one batch of the loop at a row count of ``rows`` (``reqs``
    requests): the row count's own batch is seeded ``rows``, a ``--churn`` shape of
    ``shape_reqs`` requests ``rows + shape_reqs`` (the seeds of runs before ``--fresh``), and
    its ``--fresh`` batch ``variant`` (> 0) that seed plus ``FRESH_STRIDE * variant``: distinct
    from the shape's other batches and from every seed below ``FRESH_STRIDE``. (A ``--churn``
    shape's seed may equal another row count's own, e.g. ``20 + 4`` and ``24``: another shape,
    so other logits rows.)"""
    base = rows if shape_reqs == reqs else rows + shape_reqs
    return base + FRESH_STRIDE * variant


FRESH_STRIDE = 1_000_003
"""Seed distance between a shape's ``--fresh`` batches (above any row count plus requests)."""


def _warm(step: Callable[[], Any]) -> None:
    """Three untimed calls (compiles, plans, caches, the graph capture), then a sync."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()


def _timed_steps(
    step: Callable[[], Any],
    forward: torch.cuda.CUDAGraph,
    steps: int,
    reqs: int,
    lookahead: int = 2,
) -> dict[str, Any]:
    """``steps`` steps of the loop (module docstring, 0.-4.) for one path; raw measurements:
    host us per call, GPU us per call (events), wall seconds, tokens accepted."""
    slots = torch.arange(reqs, dtype=torch.int32).pin_memory()
    slots_dev = torch.empty(reqs, dtype=torch.int32, device="cuda")
    acc = torch.zeros((), dtype=torch.int64, device="cuda")
    host: list[float] = []
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(steps)]  # fmt: skip
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        if lookahead and i >= lookahead:  # the engine's own wait (module docstring, 0.), untimed
            events[i - lookahead][1].synchronize()
        forward.replay()
        slots_dev.copy_(slots, non_blocking=True)
        events[i][0].record()
        h0 = time.perf_counter()
        out = step()
        h1 = time.perf_counter()
        events[i][1].record()
        acc += out[1].sum()
        host.append((h1 - h0) * 1e6)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    gpu = [a.elapsed_time(b) * 1000 for a, b in events]
    return {"host": host, "gpu": gpu, "wall": wall, "tokens": int(acc.item())}


def _measure_interleaved(
    paths: dict[str, Callable[[], Any]],
    forward: torch.cuda.CUDAGraph,
    steps: int,
    reqs: int,
    lookahead: int = 2,
    rounds: int = 5,
    warm_shapes: bool = False,
) -> dict[str, dict[str, Any]]:
    """Every path's ``steps`` timed steps in ``rounds`` interleaved rounds (round r runs
    ``steps / rounds`` steps of each path in turn), so a slow spell of the host (this machine's
    host speed moves by up to 2x over tens of seconds) falls on every path alike. Per path: host
    us per call (mean, p50, p90 over all steps; ``host_us_p50_best_round``: the lowest round
    p50, the host at its quietest), GPU us per call in the loop, step time, tokens/s.
    ``warm_shapes``: a :class:`_Cycle`'s shapes each take their first calls before the loop
    (:meth:`_Cycle.warm`; ``new_shape_ms``: the median over its shapes of each call's wall ms),
    so the loop times the steady state."""
    per = max(1, steps // rounds)
    raw: dict[str, list[dict[str, Any]]] = {name: [] for name in paths}
    new_shape: dict[str, list[float]] = {}
    for name, step in paths.items():
        if warm_shapes and isinstance(step, _Cycle) and len(step.steps) > 1:
            ms = step.warm()
            later = ms[1:] or ms  # the first shape was called by the checks already
            new_shape[name] = [statistics.median(c) for c in zip(*later, strict=True)]
        _warm(step)
    for _ in range(rounds):
        for name, step in paths.items():
            raw[name].append(_timed_steps(step, forward, per, reqs, lookahead))
    out = {}
    for name, parts in raw.items():
        host = [h for p in parts for h in p["host"]]
        gpu = [g for p in parts for g in p["gpu"]]
        wall = sum(p["wall"] for p in parts)
        tokens = sum(p["tokens"] for p in parts)
        host_sorted = sorted(host)
        out[name] = {
            "host_us_mean": statistics.fmean(host),
            "host_us_p50": statistics.median(host),
            "host_us_p90": host_sorted[int(0.9 * (len(host) - 1))],
            "host_us_p50_best_round": min(statistics.median(p["host"]) for p in parts),
            "gpu_us_loop": statistics.median(gpu),
            "step_us": wall / len(host) * 1e6,
            "tokens_per_s": tokens / wall,
            "accepted_per_req": tokens / (len(host) * reqs),
            "new_shape_ms": new_shape.get(name),
        }
    return out


def _graph_gpu_us(step: Callable[[], Any]) -> float | str:
    """GPU time of one call replayed from a CUDA graph (no host cost), or why not capturable."""
    try:
        step()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        g.replay()
        torch.cuda.synchronize()
        start.record()
        for _ in range(50):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1000 / 50
    except Exception as e:  # a path with a host sync cannot be captured
        torch.cuda.synchronize()
        return f"not capturable: {type(e).__name__}"


def _profile(step: Callable[[], Any], tag: str, show: bool = True) -> None:
    """The host functions of 300 calls, by own time (the GPU runs behind, never waited for);
    printed when ``show`` (every TP rank makes the calls, rank 0 prints)."""
    import cProfile
    import pstats

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        step()
    prof.disable()
    torch.cuda.synchronize()
    if not show:
        return
    print(f"--- host profile: {tag} (300 calls; tottime s)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


def _print_kernels(
    traffic: Any,
    mix: str,
    prefill: Any,
    config: Any,
    paths: dict[str, Callable[[], Any]],
    show: bool = True,
) -> None:
    """``--kernels``: GPU us per call by kernel (:func:`benchmarks.timing.kernel_times`) of the
    plan's eager launches, the level-histogram plan's (top-p), the folded call as replayed (the
    kernels inside its graphs, where the profiler sees them) and vLLM's chain. Every rank of a
    TP group runs it (the paths' collectives), ``show`` prints (rank 0)."""
    from .timing import kernel_times

    rows = traffic.logits.shape[0]
    steps = {"shardmax-eager": paths["shardmax-eager"]}
    if config is not None:
        steps["shardmax-hist (eager, unresolved)"] = _shardmax_step(
            traffic, mix, prefill, graphed=False, topp=config
        )
    for name in ("shardmax+fold", "shardmax-hist+fold", "vllm"):
        if name in paths:
            steps[name] = paths[name]
    for name, step in steps.items():
        times = kernel_times(step)
        if not show:
            continue
        print(f"--- kernels: {name} {mix} rows={rows}: {sum(times.values()):.1f} us per call "
              f"in {len(times)} kernels", flush=True)  # fmt: skip
        for kname, us in list(times.items())[:16]:
            print(f"  {us:8.1f}  {kname}", flush=True)


def _syncs(step: Callable[[], Any]) -> str:
    """How one call synchronised with the device (:func:`shardmax.testing.syncs.host_syncs`:
    torch's sync debug mode and the event / stream waits it does not report); for a
    :class:`_Cycle`, one call on each of its batches (the first sync found), so a sync that only
    some batches make -- a flagged step's -- is seen. Each call is checked on its own, as the
    loop makes it: the host not more than :data:`ENGINE_HELD` steps ahead (``host_syncs``
    starts each call on an idle device) and the :data:`ENGINE_HELD` results before it held --
    not every result, and not back to back: a caller holding more outputs than a replayed
    plan's output slots (:data:`~shardmax.runtime.graphs.SLOTS`), or running further ahead
    than the GPU has fetched them, takes the copy-out path, whose folded fallback is a second
    call with a capture of its own (a sync; 97fdbac's check did that and reported it as the
    call's)."""
    from shardmax.testing.syncs import host_syncs

    if not isinstance(step, _Cycle):
        return host_syncs(step)
    found = step.held_calls(host_syncs, ENGINE_HELD)
    return next((f for f in found if f != "none"), "none")


ENGINE_HELD = 2
"""Steps' outputs vLLM holds while it makes the next call (``max_concurrent_batches`` with async
scheduling; module docstring, 0.)."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.engine", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--rows", default="4,32,96,256,512")
    ap.add_argument("--vocab", type=int, default=200064)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--mixes", default="greedy,temperature,top_p")
    ap.add_argument("--forward-us", type=float, default=1000.0)
    ap.add_argument(
        "--lookahead",
        type=int,
        default=2,
        help="steps the host may run ahead of the GPU (vLLM's max_concurrent_batches; 0: none)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="interleaved rounds: each runs steps/rounds steps of every path in turn",
    )
    ap.add_argument(
        "--tp",
        type=int,
        default=1,
        help="TP ranks, one process and GPU each (NCCL): each verifies its vocab shard, vLLM's "
        "path all-gathers the full logits first",
    )
    ap.add_argument(
        "--churn",
        type=int,
        default=0,
        help="batch shapes per row count cycled from step to step (its request count and the "
        "ones below it, e.g. 4: n, n-1, n-2, n-3 requests; 0 or 1: one batch, replayed)",
    )
    ap.add_argument(
        "--churn-order",
        choices=("cycle", "walk"),
        default="cycle",
        help="--churn's order: each shape in turn, or a random walk (one request more, the "
        "same or one fewer per step)",
    )
    ap.add_argument(
        "--churn-warm",
        action="store_true",
        help="--churn: each shape's first calls (host read, capture) before the timed loop, "
        "their wall ms reported apart; the loop then times the steady state",
    )
    ap.add_argument(
        "--fresh",
        type=int,
        default=1,
        help="realistic batches per batch shape, the next one on each of its steps (other "
        "logits and drafts, the same shape: flags and acceptance vary from step to step as "
        "in serving; 1: one batch, replayed)",
    )
    ap.add_argument("--vllm-version", default="0.33.0")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="CSV",
        help="only draw engine.png and write ENGINE.md next to an engine.csv of an earlier run",
    )
    ap.add_argument(
        "--kernels",
        action="store_true",
        help="print each path's GPU us per call by kernel (torch profiler, 20 calls)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="print where the host time of shardmax's call goes (cProfile, 300 calls)",
    )
    args = ap.parse_args(argv)
    if args.plot is not None:
        plot(args.plot, args.plot.with_suffix(".png"))
        (args.plot.parent / "ENGINE.md").write_text(summary(load_csv(args.plot)) + "\n")
        print(f"wrote {args.plot.with_suffix('.png')} and {args.plot.parent / 'ENGINE.md'}")
        return 0
    if not torch.cuda.is_available():
        print("benchmarks.engine: needs a GPU (it times CUDA graphs and eager GPU calls)",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.tp > 1:
        return _spawn(args)
    _run(args)
    return 0


def _spawn(args: argparse.Namespace) -> int:
    """``--tp N``: one process per GPU (NCCL over NVLink, multicast off), each running the loop
    on its rank's shard with the same fixed step counts; rank 0 writes the results."""
    import os

    import torch.multiprocessing as mp

    from .step import free_port

    found = torch.cuda.device_count()
    if found < args.tp:
        print(f"benchmarks.engine: --tp {args.tp} needs {args.tp} GPUs, found {found}",
              file=sys.stderr)  # fmt: skip
        return 2
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    mp.start_processes(_rank_main, args=(args.tp, free_port(), args), nprocs=args.tp,
                       start_method="spawn", join=True)  # fmt: skip
    return 0


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    """One rank of ``--tp``: its GPU, the NCCL group, the loop. A rank that fails prints its
    traceback and exits at once (the other ranks would wait in a collective it never makes; the
    parent then stops them) instead of meeting them in a barrier they are not in."""
    import os
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    from . import ensure_shardmax_layout

    ensure_shardmax_layout()
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=180), device_id=dev)  # fmt: skip
    try:
        _run(args, rank, world, dist.group.WORLD)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)
    dist.barrier(device_ids=[rank])
    dist.destroy_process_group()


def _paths(
    traffic: Any,
    mix: str,
    kw: dict[str, Any] | None,
    me: RankShard | None,
    chain: Any,
    resolver: Any,
    fallback: Any,
    shards: dict[str, Any],
) -> tuple[dict[str, Callable[[], Any]], Any]:
    """The loop's paths on one batch (module docstring), and the top-p pipeline of its
    level-histogram paths (None off top-p). ``shards``: each shardmax path's VocabShard by path
    name, filled on first use and reused (``--churn``'s shapes share them, as one runner's calls
    share the plug-in's shard)."""
    prefill = (kw["seq_lens"], kw["prefill_len"]) if kw is not None else (None, None)

    def step(name: str, *args: Any, **kwargs: Any) -> Callable[[], Any]:
        made = _shardmax_step(traffic, mix, prefill, *args, shard=shards.get(name), **kwargs)
        shards.setdefault(name, made.shard)  # type: ignore[attr-defined]
        return made

    paths: dict[str, Callable[[], Any]] = {
        "shardmax": step("shardmax", rank=me),
        "shardmax-eager": step("shardmax-eager", graphed=False, rank=me),
    }
    config = None
    if chain is not None and kw is not None:
        if mix != "greedy":
            paths["shardmax+resolve"] = step("shardmax+resolve", (resolver, kw), rank=me)
            if fallback is not None and me is None and mix == "temperature":
                # the plug-in's use at TP 1 (not behind the candidate plan's top-p, which
                # flags a request on most steps: vLLM's whole chain on each of them)
                paths["shardmax+device"] = step("shardmax+device", (resolver, kw), device=fallback)
                paths["shardmax+fold"] = step(
                    "shardmax+fold", (resolver, kw), device=fallback, fold=True
                )
        if mix == "top_p":
            from shardmax.reference.nucleus_replay import pipeline_for
            from shardmax.runtime.topp_tables import set_sigma_table

            set_sigma_table(list(chain.modules.topk_topp._NORMAL_CDF_TO_SIGMA_TABLE))
            config = pipeline_for(traffic.logits.shape[0], "cuda", chain.version)
            paths["shardmax-hist+resolve"] = step(
                "shardmax-hist+resolve", (resolver, kw), topp=config, rank=me
            )
            if fallback is not None and me is None:  # TP 1: the fold behind top-p
                paths["shardmax-hist+fold"] = step(
                    "shardmax-hist+fold", (resolver, kw), topp=config, device=fallback, fold=True
                )
        paths["vllm"] = _vllm_step(traffic, chain, kw, rank=me)
    return paths, config


class _Built(NamedTuple):
    """One batch of the loop on this rank: its traffic, vLLM's arguments (None without an
    extracted vLLM), this rank's shard (None at TP 1), its paths and their top-p pipeline."""

    traffic: Any
    kw: dict[str, Any] | None
    me: RankShard | None
    paths: dict[str, Callable[[], Any]]
    config: Any


def _built(
    args: argparse.Namespace,
    mix: str,
    reqs: int,
    seed: int,
    chain: Any,
    resolver: Any,
    fallback: Any,
    shards: dict[str, Any],
    rank: int,
    world: int,
    group: Any,
) -> _Built:
    """A realistic batch of ``reqs`` requests (``seed``) and its paths (:func:`_paths`, on the
    shared ``shards``); at TP > 1 built on the host (the same bits on every rank), then moved."""
    from shardmax.testing.traffic import realistic_batch

    traffic = realistic_batch(reqs, args.k, args.vocab, seed=seed, mix=mix,
                              device="cuda" if world == 1 else "cpu")  # fmt: skip
    if world > 1:
        for fld in dataclasses.fields(traffic):
            if isinstance(v := getattr(traffic, fld.name), torch.Tensor):
                setattr(traffic, fld.name, v.to("cuda"))
    me = _rank_shard(traffic.logits, rank, world, group)
    kw = None
    if chain is not None:
        from shardmax.testing.vllm_chain import verify_inputs

        kw = verify_inputs(traffic)
    paths, config = _paths(traffic, mix, kw, me, chain, resolver, fallback, shards)
    return _Built(traffic, kw, me, paths, config)


def _check_batch(b: _Built, mix: str, fallback: Any) -> dict[str, Any]:
    """Every path of one batch against vLLM's chain on it: requests that differ among the
    unflagged (``bad``), flagged (``flagged``); after the per-request resolution (``bad_r``,
    ``left``); the level-histogram plan's own flags unresolved (``bad_h``, ``flagged_h``) and
    resolved (``bad_hr``, ``left_h``); per device path ``[differ, left flagged, flagged
    before]`` (``device``: each run to its capture first, so the compared call replays)."""
    paths = b.paths
    prefill = (b.kw["seq_lens"], b.kw["prefill_len"]) if b.kw is not None else (None, None)
    theirs = paths["vllm"]()
    out: dict[str, Any] = dict.fromkeys(
        ("bad_r", "left", "bad_h", "flagged_h", "bad_hr", "left_h"), 0
    )
    out["bad"], out["flagged"] = _mismatches(paths["shardmax"](), theirs)
    if "shardmax+resolve" in paths:
        out["bad_r"], out["left"] = _mismatches(paths["shardmax+resolve"](), theirs)
    if "shardmax-hist+resolve" in paths:
        plain = _shardmax_step(
            b.traffic, mix, prefill, graphed=False, topp=b.config, rank=b.me
        )()  # unresolved: its flags
        out["bad_h"], out["flagged_h"] = _mismatches(plain, theirs)
        out["bad_hr"], out["left_h"] = _mismatches(paths["shardmax-hist+resolve"](), theirs)
    # each device path's flags are its own plan's: the histogram plan's behind top-p
    flagged_by = {"shardmax+device": out["flagged"], "shardmax+fold": out["flagged"],
                  "shardmax-hist+fold": out["flagged_h"]}  # fmt: skip
    out["device"] = {}
    for name, before in flagged_by.items():
        if name not in paths or fallback is None:
            continue
        dev_step = paths[name]
        for _ in range(fallback.capture_after):
            dev_step()  # the signature's host-read steps, then its capture
        got = dev_step()
        torch.cuda.synchronize()
        out["device"][name] = [*_mismatches(got, theirs), before]
    return out


def _calls(steps: list[Callable[[], Any]]) -> dict[str, int]:
    """How a device path's calls on these batches were decided, summed (``step.calls``)."""
    total: dict[str, int] = {}
    for step in steps:
        for k, v in getattr(step, "calls", {}).items():
            total[k] = total.get(k, 0) + v
    return total


def _run(
    args: argparse.Namespace, rank: int = 0, world: int = 1, group: Any = None
) -> list[dict[str, Any]]:
    """The loop over mixes, row counts and paths on this rank (TP ``world``; at TP 1 the shard
    is the whole vocabulary); rank 0 prints and writes engine.csv / engine.png / ENGINE.md."""
    from shardmax.runtime.dispatch import detect_arch

    say = print if rank == 0 else (lambda *a, **k: None)
    chain = None
    note = ""
    try:
        from shardmax.testing.vllm_chain import NativeChain

        chain = {c.version: c for c in NativeChain.discover()}[args.vllm_version]
    except Exception as e:  # no extracted vLLM tree: the vllm path is not measured
        note = f"vllm chain unavailable: {type(e).__name__}: {str(e).splitlines()[0][:100]}"
        say(note, file=sys.stderr)
    resolver = fallback = None
    if chain is not None:
        from shardmax.integrations.vllm.resolution import CapturedResolution

        resolver = CapturedResolution(chain)  # the plug-in's resolver
        fallback = None
        if world == 1:
            from shardmax.integrations.vllm.fallback import DeviceFallback

            fallback = DeviceFallback(chain)
            why = fallback.unavailable(torch.device("cuda", torch.cuda.current_device()))
            if why is not None:
                say(f"shardmax+device not measured: {why}", file=sys.stderr)
                fallback = None
    out_dir = args.out or Path("benchmarks/results") / (detect_arch() or "unknown")
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    forward, forward_us = _forward_graph(args.forward_us)
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    for mix in args.mixes.split(","):
        for rows in rows_list:
            reqs = max(1, rows // (args.k + 1))
            shards: dict[str, Any] = {}  # one VocabShard per path, shared by its batches
            shapes = churn_reqs(reqs, args.churn) if args.churn > 1 else [reqs]
            fresh = max(1, args.fresh)
            # every shape's fresh batches, each with its own paths (the first: the checks'
            # batch, and the one a run without --churn / --fresh replays)
            built = [
                [
                    _built(args, mix, n, fresh_seed(rows, reqs, n, j), chain, resolver,
                           fallback, shards, rank, world, group)
                    for j in range(fresh)
                ]
                for n in shapes
            ]  # fmt: skip
            traffic, kw, _, paths, config = built[0][0]
            prefill = (kw["seq_lens"], kw["prefill_len"]) if kw is not None else (None, None)
            timed_paths = paths
            if len(shapes) > 1 or fresh > 1:
                order = churn_order(len(shapes), args.steps, args.churn_order == "walk",
                                    seed=rows)  # fmt: skip
                timed_paths = {
                    name: _Cycle([[b.paths[name] for b in variants] for variants in built],
                                 order)
                    for name in paths
                }  # fmt: skip
            firsts = built[0]  # the first shape's batches: the checks run on each of them
            over = f" over {fresh} batches" if fresh > 1 else ""
            same = resolved_note = hist_note = ""
            device_notes: dict[str, str] = {}
            if "vllm" in paths:
                tally = {k: 0 for k in ("bad", "flagged", "bad_r", "left", "bad_h", "flagged_h",
                                    "bad_hr", "left_h")}  # fmt: skip
                dev: dict[str, list[int]] = {}
                for b in firsts:
                    got = _check_batch(b, mix, fallback)
                    for k in tally:
                        tally[k] += got[k]
                    for name, counts in got["device"].items():
                        dev[name] = [x + y for x, y in zip(dev.get(name, [0, 0, 0]), counts,
                                                           strict=True)]  # fmt: skip
                of = reqs * fresh
                same = (
                    f"{tally['bad']} unflagged requests differ from vLLM, {tally['flagged']} flagged of "
                    f"{of}{over}"
                )
                if "shardmax+resolve" in paths:
                    resolved_note = (
                        f"{tally['bad_r']} of {of} requests differ from vLLM{over} after resolving "
                        f"{tally['flagged']} ({tally['left']} left flagged)"
                    )
                if "shardmax-hist+resolve" in paths:
                    hist_note = (
                        f"{tally['bad_h']} unflagged requests differ from vLLM, {tally['flagged_h']} "
                        f"flagged of {of}{over}; {tally['bad_hr']} differ after resolving "
                        f"({tally['left_h']} left flagged)"
                    )
                for name, (bad_d, left_d, before) in dev.items():
                    device_notes[name] = (
                        f"{bad_d} of {of} requests differ from vLLM{over} ({left_d} left "
                        f"flagged; {before} flagged before the device fallback); its first "
                        f"steps: {_calls([b.paths[name] for b in firsts])}"
                    )
            if args.kernels:  # every rank: the paths' collectives; rank 0 prints
                _print_kernels(traffic, mix, prefill, config, paths, show=rank == 0)
            if args.profile:
                for name in (
                    "shardmax",
                    "shardmax+resolve",
                    "shardmax+device",
                    "shardmax+fold",
                    "shardmax-hist+resolve",
                    "shardmax-hist+fold",
                ):
                    if name in paths:
                        _profile(paths[name], f"{name} {mix} rows={reqs * (args.k + 1)}",
                                 show=rank == 0)  # fmt: skip
            # how the device paths' steps were decided while timed (a host read counts as host
            # time); with --churn, the first shape's steps (each of its --fresh batches)
            counted = {n: _calls([b.paths[n] for b in firsts]) for n in device_notes}
            timed = _measure_interleaved(
                timed_paths, forward, args.steps, reqs, args.lookahead, args.rounds,
                warm_shapes=args.churn_warm,
            )  # fmt: skip
            for path_name, at_start in counted.items():
                now = _calls([b.paths[path_name] for b in firsts])
                delta = {k: now[k] - at_start[k] for k in at_start}
                shape = " (its first batch shape)" if len(shapes) > 1 else ""
                device_notes[path_name] += f"; timed loop with its warm-up{shape}: {delta}"
            churn = ""
            if len(shapes) > 1:
                how = "cycled"
                if args.churn_order == "walk":
                    walked = set(churn_order(len(shapes), args.steps, True, seed=rows))
                    how = f"a random walk visiting {len(walked)} of them"
                warmed = "; warmed before the loop" if args.churn_warm else ""
                churn = (f"churn: {len(shapes)} batch shapes, {how} per step ({shapes[0]}.."
                         f"{shapes[-1]} requests; checks on the first{warmed}); ")  # fmt: skip
            if fresh > 1:
                churn += f"fresh: {fresh} realistic batches per shape, the next on each step; "
            for path, step in timed_paths.items():
                row = {"mix": mix, "rows": reqs * (args.k + 1), "reqs": reqs,
                       "vocab": args.vocab, "dtype": "bf16", "tp": world, "path": path,
                       "steps": args.steps, "forward_us": round(forward_us, 1),
                       "note": note if path == "vllm" else ""}  # fmt: skip
                row.update(timed[path])
                # a replayed step cannot be captured again: its GPU time is the loop's; at
                # TP > 1 no path is captured whole (its collectives would sit in the graph)
                row["gpu_us_graph"] = (
                    "replayed" if path == "shardmax"
                    else "replayed (conditional graph)" if path == "shardmax+device"
                    else "replayed (folded conditional node)"
                    if path in ("shardmax+fold", "shardmax-hist+fold")
                    else "n/a at TP > 1" if world > 1
                    else _graph_gpu_us(step)
                )  # fmt: skip
                row["host_sync"] = _syncs(step)
                row["fallback_rate"] = ""
                if path == "shardmax+resolve":
                    row["note"] = resolved_note
                if path in device_notes:
                    row["note"] = device_notes[path]
                if path == "shardmax-hist+resolve":
                    row["note"] = hist_note
                if path == "shardmax" and same:
                    bitwise, rates = True, []
                    for b in firsts:
                        eager = b.paths["shardmax-eager"]()
                        ours = b.paths["shardmax"]()
                        bitwise &= all(torch.equal(x, y) for x, y in zip(ours, eager, strict=True))
                        if hasattr(ours, "fallback"):  # the same call's flags
                            rates.append(float(ours.fallback.float().mean()))
                    row["note"] = f"{same}; replay == eager launches bit for bit: {bitwise}"
                    if rates:
                        row["fallback_rate"] = statistics.fmean(rates)
                if row.get("new_shape_ms"):
                    first = ", ".join(f"{m:.1f}" for m in row["new_shape_ms"])
                    row["note"] = f"a new shape's first calls: {first} ms; " + row["note"]
                row["note"] = churn + row["note"]
                row.pop("new_shape_ms", None)
                results.append(row)
                say(
                    f"{mix:11} rows={row['rows']:4} {path:14} host {row['host_us_mean']:7.1f} us"
                    f" (p50 {row['host_us_p50']:6.1f})  gpu(loop) {row['gpu_us_loop']:7.1f} us"
                    f"  step {row['step_us']:7.1f} us  {row['tokens_per_s']:9.0f} tok/s"
                    f"  sync: {row['host_sync']}  {row['note']}",
                    flush=True,
                )
            # this row count's batches and paths go before the next row count's are built
            del built, firsts, paths, timed_paths, traffic, kw, shards
    if rank == 0:
        csv_path = out_dir / "engine.csv"
        write_rows(csv_path, FIELDS, results)
        print(f"wrote {csv_path}")
        plot(csv_path, csv_path.with_suffix(".png"))
        print(summary(results))
        (out_dir / "ENGINE.md").write_text(summary(results) + "\n")
    return results


def _rank_shard(full: torch.Tensor, rank: int, world: int, group: Any) -> RankShard | None:
    """This rank's padded shard of the step's full logits at TP ``world`` > 1 (the step is
    built on the host, so every rank holds the same bits), None at TP 1."""
    if world == 1:
        return None
    from shardmax.testing.shards import default_pad_to, vllm_shard_ranges

    vocab = full.shape[1]
    start, num_valid, width = vllm_shard_ranges(vocab, world, default_pad_to(vocab, world))[rank]
    local = torch.zeros((full.shape[0], width), dtype=full.dtype, device=full.device)
    local[:, :num_valid] = full[:, start : start + num_valid]
    return RankShard(local, start, num_valid, group)


def plot(csv_path: Path, png_path: Path) -> None:
    """Host us per call and tokens/s of the loop, per traffic mix, against rows (one PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with csv_path.open() as f:
        rows = list(csv.DictReader(f))
    mixes = list(dict.fromkeys(r["mix"] for r in rows))
    fig, axes = plt.subplots(2, len(mixes), figsize=(5 * len(mixes), 7), squeeze=False)
    for j, mix in enumerate(mixes):
        for path in dict.fromkeys(r["path"] for r in rows if r["mix"] == mix):
            sel = [r for r in rows if r["mix"] == mix and r["path"] == path]
            x = [int(r["rows"]) for r in sel]
            axes[0][j].plot(x, [float(r["host_us_mean"]) for r in sel], marker="o", label=path)
            axes[1][j].plot(x, [float(r["tokens_per_s"]) for r in sel], marker="o", label=path)
        axes[0][j].set_title(f"{mix}: host us per verification call")
        axes[1][j].set_title(f"{mix}: tokens/s of the loop")
        for ax in (axes[0][j], axes[1][j]):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("logits rows (K = 3)")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        axes[0][j].set_yscale("log")
    fig.suptitle(
        f"engine-faithful loop, V={rows[0]['vocab']}, {rows[0]['dtype']}, TP{rows[0]['tp']}"
    )
    fig.tight_layout()
    fig.savefig(png_path, dpi=90)


def plugin_path(mix: str, rows: int, tp: int, paths: set[str]) -> str | None:
    """The loop's path that is the plug-in's call for a step of ``mix`` and ``rows`` logits rows
    at TP ``tp`` (:func:`shardmax.integrations.vllm.step.verify_sampled`'s routing, its
    defaults on CUDA -- top-p steps at TP 1 included,
    :func:`~shardmax.integrations.vllm.step.topp_fold_routing` -- and at TP 1
    ``SHARDMAX_VLLM_SAMPLED=1`` for temperature steps, which by default,
    :func:`~shardmax.integrations.vllm.step.sampled_routing`, the plug-in leaves to vLLM's own
    chain, the loop's ``vllm`` path): greedy steps replay (``shardmax``);
    sampled steps at TP 1 run the folded device fallback (top-p: behind the level-histogram
    plan), else (TP > 1) the host read and per-request resolution (top-p: behind the histogram
    plan). None where the
    loop did not run that path."""
    from shardmax.integrations.vllm.step import uses_device_fallback

    if mix == "greedy":
        path = "shardmax"
    elif mix == "top_p":
        path = (
            "shardmax-hist+fold"
            if uses_device_fallback(tp, True, True)
            else "shardmax-hist+resolve"
        )
    else:
        path = "shardmax+fold" if uses_device_fallback(tp, False, False) else "shardmax+resolve"
    return path if path in paths else None


def _targets(
    by: dict[tuple[Any, ...], dict[str, Any]], mix: str, rows: Any, path: str
) -> list[str]:
    """One path's issue-19 checks at one row count: host budget, no sync, against vLLM."""
    r = by[(mix, rows, path)]
    budget = HOST_TARGET_US[mix]
    ok = r["host_us_mean"] <= budget
    best = r.get("host_us_p50_best_round")
    quiet = f" (p50 {r['host_us_p50']:.1f}, quietest round's p50 {best:.1f})" if isinstance(
        best, float) else ""  # fmt: skip
    out = [f"- {mix} rows {rows}, `{path}`: host {r['host_us_mean']:.1f} us{quiet} <= "
           f"{budget:.0f}: {'PASS' if ok else 'FAIL'}; sync-free: "
           f"{'PASS' if r['host_sync'] == 'none' else 'FAIL'}"]  # fmt: skip
    v = by.get((mix, rows, "vllm"))
    if v is not None:
        out.append(
            f"  - vs vLLM: host {r['host_us_mean']:.1f} vs {v['host_us_mean']:.1f} us "
            f"({'PASS' if r['host_us_mean'] < v['host_us_mean'] else 'FAIL'}); tokens/s "
            f"{r['tokens_per_s']:.0f} vs {v['tokens_per_s']:.0f} "
            f"({'PASS' if r['tokens_per_s'] >= v['tokens_per_s'] else 'FAIL'})"
        )
    return out


def summary(results: list[dict[str, Any]]) -> str:
    """Markdown: one table per mix and the issue-19 targets, PASS/FAIL from these numbers."""
    tp = int(results[0]["tp"]) if results else 1
    at = f" at TP {tp} (one process and GPU per rank, NCCL)" if tp > 1 else ""
    lines = [f"# Engine-faithful loop{at} (verification eager, as model runner V2 calls it)", ""]
    by = {(r["mix"], r["rows"], r["path"]): r for r in results}
    for mix in dict.fromkeys(r["mix"] for r in results):
        lines += [f"## {mix}", "", "| rows | path | host us (mean / p50) | GPU us loop / graph | "
                  "step us | tokens/s | host sync | vs vLLM |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in (r for r in results if r["mix"] == mix):
            g = r["gpu_us_graph"]
            gs = f"{g:.1f}" if isinstance(g, float) else g
            lines.append(
                f"| {r['rows']} | {r['path']} | {r['host_us_mean']:.1f} / {r['host_us_p50']:.1f} "
                f"| {r['gpu_us_loop']:.1f} / {gs} | {r['step_us']:.1f} | "
                f"{r['tokens_per_s']:.0f} | {r['host_sync']} | {r['note']} |"
            )
        lines.append("")
    lines += ["## Targets (issue 19): the plug-in's call", ""]
    lines.append("The path the plug-in takes for each row count (`plugin_path`; temperature "
                 "steps at TP 1 with `SHARDMAX_VLLM_SAMPLED=1`: its default there, `auto`, leaves "
                 "them to vLLM's own chain; top-p steps at TP 1 are its default's, "
                 "`step.topp_fold_routing`), against the targets and vLLM's chain:")  # fmt: skip
    lines.append("")
    for mix, rows in dict.fromkeys((k[0], k[1]) for k in by):
        path = plugin_path(mix, int(rows), tp, {k[2] for k in by if k[:2] == (mix, rows)})
        if path is not None:
            lines += _targets(by, mix, rows, path)
    bare = [(mix, rows) for mix, rows, path in by if path == "shardmax" and mix != "greedy"]
    if bare:
        lines += ["", "## The sampled steps' bare replay (flags counted as verified)", ""]
        for mix, rows in bare:
            lines += _targets(by, mix, rows, "shardmax")
    titles = {
        "shardmax+resolve": ("The plug-in's resolving call (issue 18)", "One host read of the "
                             "flags, then the flagged requests verified from their own rows by "
                             "vLLM's own kernels (`shardmax+resolve`)"),
        "shardmax+device": ("The device fallback as a second call", "The replayed step, then "
                            "`DeviceFallback.run`'s conditional graph (`shardmax+device`)"),
        "shardmax+fold": ("The device fallback folded into the replayed step (issue 19)",
                          "One graph launch: the step's kernels, then the predicate and vLLM's "
                          "chain as a conditional node (`shardmax+fold`)"),
        "shardmax-hist+fold": ("The folded device fallback behind level-histogram top-p",
                               "The histogram plan replayed, "
                               "vLLM's chain on the step where a request is flagged, no host "
                               "read (`shardmax-hist+fold`)"),
    }  # fmt: skip
    for name, (title, what) in titles.items():
        calls = [(k, r) for k, r in by.items() if k[2] == name]
        if not calls:
            continue
        lines += ["", f"## {title}", "", f"{what}, against vLLM's whole chain:", ""]
        for (mix, rows, _), r in calls:
            v = by.get((mix, rows, "vllm"))
            if v is None:
                continue
            lines.append(
                f"- {mix} rows {rows}: host {r['host_us_mean']:.1f} vs {v['host_us_mean']:.1f} us; "
                f"tokens/s {r['tokens_per_s']:.0f} vs {v['tokens_per_s']:.0f} "
                f"({'PASS' if r['tokens_per_s'] >= v['tokens_per_s'] else 'FAIL'}); {r['note']}"
            )
    return "\n".join(lines)


def load_csv(csv_path: Path) -> list[dict[str, Any]]:
    """The rows of an ``engine.csv`` with its numbers as numbers (for :func:`summary`)."""
    with csv_path.open() as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for k, v in r.items():
            if k in ("rows", "reqs", "vocab", "tp", "steps"):
                r[k] = int(v)
            elif k not in ("mix", "dtype", "path", "host_sync", "note"):
                with contextlib.suppress(ValueError):  # "not capturable: ...", "" stay text
                    r[k] = float(v)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
