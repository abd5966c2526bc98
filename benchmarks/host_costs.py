"""The host's elementary costs on the verification step's path (issue 19), on the GPU.

**1. Reading a step's flags.** The plug-in's sampled step reads its ``[num_reqs]`` fallback codes on the host once per step (the
one host sync of a sampled step: a flagged request is resolved before the step returns). The
host then waits for the forward and the verification, and the GPU idles from the moment the
codes are ready until the host has woken up, looked at them and launched the next work: that
gap, paid on every step, is what this benchmark measures for each way of reading the codes:

* ``to_cpu``: ``codes.to("cpu")`` (a pageable copy; torch synchronises the stream);
* ``pinned_stream``: a non-blocking copy into a pinned buffer, then
  ``torch.cuda.current_stream().synchronize()``;
* ``pinned_event``: the same copy, an event recorded behind it, ``event.synchronize()`` (CUDA's
  default: the thread spins or yields as the driver decides);
* ``pinned_event_blocking``: the same with ``torch.cuda.Event(blocking=True)`` (the thread
  sleeps until the event);
* ``pinned_poll``: the same copy and event, polled with ``event.query()`` in a loop;
* ``none``: no read (the step stays asynchronous: the floor).

Each timed step is the engine loop's: a captured stand-in forward (``--forward-us``), a small
eager verification stand-in producing int8 codes for ``--reqs`` requests, the read, then the
next step. Reported per method: the GPU gap (CUDA events: from the codes being ready to the
next launch the host makes after the read; median), the host time of the read, the step time
(wall / steps) and its ratio to ``none``.

**2. Launching.** Host microseconds of one ``CUDAGraph.replay()`` of a graph of ``n`` small
kernels (n = 1, 4, 16, 64), with the GPU idle and with it busy (the stand-in forward queued
first), next to one eager torch launch and one Triton launch (``table_copy``, through
shardmax's launcher): what a step's launches and replays cost the host.

**3. The replayed call by part.** Host microseconds of the engine benchmark's ``shardmax`` call
(``benchmarks.engine``: the plug-in's call without the flag read, replayed from the plan's CUDA
graph) on realistic traffic (V = 200064, bf16, K = 3; greedy, temperature and top-p steps, the
last through the candidates plan), whole and part by part, each part timed
alone behind the stand-in forward: the step's host checks (``check_step_batch``), the shard's
cached plan and its graphed step, :class:`~shardmax.runtime.graphs.GraphedStep`'s own checks
(logits, alignment, batch signature), finding a free output slot, the slot's argument table
(its input entries written into its page-locked host table, which the slot's graph fetches
itself: no copy call) and the slot's graph replay. ``sum of parts`` against ``whole`` shows
what is left in the glue between them. Two more rows, not part of the call, time what a step
whose slots are all held pays instead: allocating its outputs, and writing the copy-out
path's table and copying it to the device (then the copy-out graph replays); and ``whole
call, every slot held`` times the whole call on that path (the outputs of
:data:`~shardmax.runtime.graphs.SLOTS` calls kept alive meanwhile): the same run's
before/after of the output slots and their host tables.

**4. The replayed step split at its exchanges (TP > 1).** One rank's step at TP 2 / 8 on one
GPU (rank 0's shard of V = 200064, the other ranks' bytes stood in by rank 0's:
:class:`~shardmax.testing.emulate.RepeatedRank`), replayed from its graphs split at the
exchanges, which run eagerly between the replays; greedy (one exchange) and two-phase T = 1
steps (two). The same captured graphs are replayed with each exchange gathering straight into
the next graph's static buffer (``into``: the stand-in's ``all_gather_dim0_into``, as the
built-in collectives have) and with the gather returning a new tensor that is then copied there
(``gather + copy``: a collective without that method).
Host us per call (behind the stand-in forward) and us per call of 50 calls back to back with
nothing else queued (CUDA events: the slower of the GPU's work and the host's launches); the
stand-in's own tile copy is in both.

**5. The folded call by part (TP 1; temperature and top-p traffic).** The plug-in's sampled
call with :class:`~shardmax.integrations.vllm.fallback.DeviceFallback` folded into the replayed
step's graph (:func:`fold_parts`): the call without the fallback and with it, the fold's own
host work, its words, the folded slot graph's launch (a conditional graph) against the plain
slot graph's replay, and a conditional graph with a one-kernel body; ``--only-fold``: this
section alone, with a cProfile of the folded call per row count. Needs vLLM's extracted chain
and conditional graphs (else skipped, the reason printed).

Needs a GPU.

    python -m benchmarks.host_costs [--reqs 8,128] [--steps 300] [--forward-us 750]
        [--part-rows 32,512] [--split-rows 32,512] [--fold-rows 32,256]
        [--only-fold]
        [--out benchmarks/results/<arch>/host_costs]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .report import write_rows

METHODS = ("none", "to_cpu", "pinned_stream", "pinned_event", "pinned_event_blocking",
           "pinned_poll")  # fmt: skip
FIELDS = ["reqs", "method", "gap_us_p50", "gap_us_p90", "read_host_us_p50", "step_us",
          "vs_none"]  # fmt: skip


def _reader(method: str, reqs: int) -> Callable[[torch.Tensor], Any]:
    """The host read of ``codes`` (int8 ``[reqs]`` on the GPU) by ``method``."""
    pinned = torch.empty(reqs, dtype=torch.int8).pin_memory()
    event = torch.cuda.Event(blocking=method == "pinned_event_blocking")

    def read(codes: torch.Tensor) -> Any:
        if method == "none":
            return None
        if method == "to_cpu":
            return codes.to("cpu").numpy()
        pinned.copy_(codes, non_blocking=True)
        if method == "pinned_stream":
            torch.cuda.current_stream().synchronize()
        else:
            event.record()
            if method == "pinned_poll":
                while not event.query():
                    pass
            else:
                event.synchronize()
        return pinned.numpy()

    return read


def measure(method: str, reqs: int, steps: int, forward: Any) -> dict[str, Any]:
    """One method's loop (see the module docstring)."""
    logits = torch.randn(reqs * 4, 4096, device="cuda")
    read = _reader(method, reqs)

    def verify() -> torch.Tensor:  # a few small eager launches, int8 codes per request
        top = logits.amax(dim=1).view(reqs, 4)
        return (top.sum(dim=1) < -1e30).to(torch.int8)

    for _ in range(5):
        forward.replay()
        read(verify())
    torch.cuda.synchronize()
    ready = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
    after = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
    host: list[float] = []
    t0 = time.perf_counter()
    for i in range(steps):
        forward.replay()
        codes = verify()
        ready[i].record()
        h0 = time.perf_counter()
        read(codes)
        host.append((time.perf_counter() - h0) * 1e6)
        after[i].record()  # the next launch the host makes after the read
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    gaps = sorted(a.elapsed_time(b) * 1000 for a, b in zip(ready, after, strict=True))
    return {
        "reqs": reqs,
        "method": method,
        "gap_us_p50": statistics.median(gaps),
        "gap_us_p90": gaps[int(0.9 * (len(gaps) - 1))],
        "read_host_us_p50": statistics.median(host),
        "step_us": wall / steps * 1e6,
    }


LAUNCH_FIELDS = ["what", "gpu", "host_us_p50", "host_us_p90"]


def _host_us(call: Callable[[], Any], busy: Callable[[], Any] | None, n: int = 200) -> list[float]:
    """Host microseconds of ``n`` calls of ``call``, each behind ``busy()`` when given (the GPU
    then runs behind the host: the engine's situation, at most two calls ahead of the GPU as
    vLLM's async scheduling keeps it -- ``benchmarks.engine --lookahead``), sorted."""
    times = []
    done = [torch.cuda.Event() for _ in range(n)]
    for i in range(n):
        if busy is not None:
            if i >= 2:
                done[i - 2].synchronize()  # untimed, as the engine's own wait
            busy()
        h0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - h0) * 1e6)
        if busy is None:
            torch.cuda.synchronize()
        else:
            done[i].record()
    torch.cuda.synchronize()
    return sorted(times)


def launches(forward: Any) -> list[dict[str, Any]]:
    """Section 2: a replay of a graph of ``n`` small kernels, one torch launch, one Triton
    launch; with the GPU idle and busy."""
    from shardmax.runtime import kernels

    x = torch.zeros(1024, device="cuda")
    graphs = {}
    for n in (1, 4, 16, 64):
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            x.add_(1.0)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            for _ in range(n):
                x.add_(1.0)
        g.replay()
        graphs[n] = g
    copy = kernels.kernel("table_copy")
    table = torch.tensor([x.data_ptr(), x.data_ptr(), 0], dtype=torch.int64, device="cuda")
    copy((1,), table, BLOCK=copy.module.BLOCK, SPREAD=False)  # compiled before timing
    calls: dict[str, Callable[[], Any]] = {f"graph replay, {n} kernels": g.replay
                                           for n, g in graphs.items()}  # fmt: skip
    calls["torch launch (x.add_)"] = lambda: x.add_(1.0)
    calls["Triton launch (table_copy)"] = lambda: copy(
        (1,), table, BLOCK=copy.module.BLOCK, SPREAD=False
    )
    rows = []
    for what, call in calls.items():
        for gpu, busy in (("idle", None), ("busy", forward.replay)):
            t = _host_us(call, busy)
            rows.append({"what": what, "gpu": gpu, "host_us_p50": statistics.median(t),
                         "host_us_p90": t[int(0.9 * (len(t) - 1))]})  # fmt: skip
            print(f"{what:30} GPU {gpu:4}: host p50 {rows[-1]['host_us_p50']:6.1f} us  p90 "
                  f"{rows[-1]['host_us_p90']:6.1f} us", flush=True)  # fmt: skip
    return rows


PART_FIELDS = ["mix", "rows", "part", "host_us_p50", "host_us_p90"]
PARTS = ("check_step_batch", "plan + graphed lookup", "GraphedStep checks", "free slot lookup",
         "slot's argument table (write)", "graph replay", "sum of parts", "whole call",
         "output allocations (slots held)", "argument table (write + copy, slots held)",
         "whole call, every slot held")  # fmt: skip
NOT_IN_CALL = PARTS[7:]
MIXES = ("greedy", "temperature", "top_p")
"""Section 3's request mixes (``benchmarks.engine``'s): top-p steps through the candidates plan."""


def replay_parts(forward: Any, rows_list: list[int], vocab: int = 200064) -> list[dict[str, Any]]:
    """Section 3: the engine's replayed ``shardmax`` call, whole and by part (GPU busy)."""
    from benchmarks.engine import _shardmax_step
    from shardmax.runtime.graphs import batch_signature
    from shardmax.runtime.validation import check_step_batch
    from shardmax.testing.traffic import realistic_batch

    def plan_of(shard: Any, n: int, mix: str) -> Any:  # the engine step's plan
        if mix == "greedy":
            return shard.greedy_verify(n)
        return shard.verify(n, with_candidates=mix == "top_p")

    out = []
    for mix in MIXES:
        for rows in rows_list:
            t = realistic_batch(max(1, rows // 4), 3, vocab, seed=rows, mix=mix, device="cuda")
            step = _shardmax_step(t, mix, (None, None))
            for _ in range(4):  # eager, captured, replayed
                step()
            torch.cuda.synchronize()
            logits, n = t.logits, t.logits.shape[0]
            temp = t.temperature if mix != "greedy" else None

            def check(t: Any = t, n: int = n, temp: Any = temp) -> Any:
                return check_step_batch(
                    n, t.logits.device, t.draft_sampled, t.cu_num_logits, t.pos, t.idx_mapping,
                    t.expanded_local_pos, t.seed, t.num_speculative_steps, None, None, None,
                    temperature=temp, top_p=t.top_p,
                )  # fmt: skip

            batch = check()
            shard = step.shard  # type: ignore[attr-defined]  # the step's VocabShard
            plan = plan_of(shard, n, mix)
            graphed = shard.graphed(plan)
            captured = graphed._graphs[batch_signature(batch)]  # this batch's captured step
            slot = captured.slots[0]  # the slot every call of this loop gets (none is held)

            def lookup(shard: Any = shard, n: int = n, mix: str = mix) -> Any:
                return shard.graphed(plan_of(shard, n, mix))

            def own_checks(plan: Any = plan, graphed: Any = graphed, batch: Any = batch,
                           logits: Any = logits) -> Any:  # fmt: skip
                plan.ctx.check_logits(logits, plan.num_logits, plan.row_stride)
                return logits.data_ptr() % 16, graphed._graphs.get(batch_signature(batch))

            def table(c: Any = captured, batch: Any = batch, logits: Any = logits,
                      slot: Any = slot) -> None:  # fmt: skip
                # the slot's own host table, read by its graph in place; the request number
                # written as slot.request() writes it, without advancing it (no fetch follows)
                c._fill(slot.host, logits, batch, ())  # the slot's graph writes its outputs
                slot.host[-2] = slot.seq

            def upload(c: Any = captured, batch: Any = batch, logits: Any = logits) -> None:
                c._fill(c.host, logits, batch, c.outputs)  # the copy-out path's table
                c._upload()

            calls = {
                "check_step_batch": check,
                "plan + graphed lookup": lookup,
                "GraphedStep checks": own_checks,
                "free slot lookup": lambda c=captured: next(s for s in c.slots if s.free()),
                "slot's argument table (write)": table,
                "graph replay": slot.graph.replay,
                "whole call": step,
                "output allocations (slots held)": lambda c=captured: [
                    torch.empty_like(o) for o in c.outputs
                ],
                "argument table (write + copy, slots held)": upload,
                "whole call, every slot held": step,
            }
            got = {}
            for part, call in calls.items():
                held = [step() for _ in captured.slots] if part == PARTS[-1] else []
                times = _host_us(call, forward.replay)
                del held
                got[part] = (statistics.median(times), times[int(0.9 * (len(times) - 1))])
            parts = [v for k, v in got.items() if k not in NOT_IN_CALL]
            got["sum of parts"] = (sum(p[0] for p in parts), sum(p[1] for p in parts))
            for part in PARTS:
                p50, p90 = got[part]
                out.append({"mix": mix, "rows": n, "part": part, "host_us_p50": p50,
                            "host_us_p90": p90})  # fmt: skip
                print(f"{mix:11} rows={n:4} {part:30} host p50 {p50:6.1f} us  p90 {p90:6.1f} us",
                      flush=True)  # fmt: skip
    return out


FOLD_PARTS = ("shardmax call (no fallback)", "whole call, fallback folded", "DeviceFallback.fold",
              "epilogue words (write)", "plain slot graph replay (GPU busy)",
              "folded slot graph launch (GPU busy)", "folded slot graph launch (GPU idle)",
              "conditional graph, 1-kernel body (GPU busy)")  # fmt: skip


def _graph_nodes(graph: Any) -> int:
    """Nodes of a torch CUDA graph kept with ``keep_graph=True`` (``cuGraphGetNodes``)."""
    import ctypes

    from shardmax.runtime.conditional import _driver

    n = ctypes.c_size_t(0)
    _driver()("cuGraphGetNodes", ctypes.c_void_p(graph.raw_cuda_graph()), None, ctypes.byref(n))
    return int(n.value)


def _captured(step: Any, folded: bool) -> Any:
    """The replayed signature of an engine ``step`` (``benchmarks.engine._shardmax_step``) that
    has slots (``folded``: the one whose slots run the device fallback)."""
    for graphed in step.shard._graphed.values():
        for got in graphed._graphs.values():
            if got.slots and got.folded == folded:
                return got
    return None


def fold_parts(forward: Any, rows_list: list[int], vocab: int = 200064,
               profile: bool = False) -> list[dict[str, Any]]:  # fmt: skip
    """Section 5: the plug-in's sampled call at TP 1 with the device fallback folded into its
    replayed graph (``benchmarks.engine``'s ``shardmax+fold`` on temperature traffic and
    ``shardmax-hist+fold`` on top-p traffic) by part: the replayed call without the fallback
    and with it, :meth:`DeviceFallback.fold` alone, the epilogue's words, the plain slot graph's
    replay against the folded slot graph's launch (a conditional graph: GPU busy / idle, on
    the last table's flags -- printed: whether the body runs) and a conditional graph with a
    one-kernel body (what the conditional node costs by itself); the folded graph's nodes (its
    prologue -- the step -- and its body, vLLM's chain) are printed. ``profile``: a cProfile
    of the whole folded call per row count (the 16 costliest functions by own time)."""
    from benchmarks.engine import _shardmax_step
    from shardmax.integrations.vllm.fallback import DeviceFallback
    from shardmax.integrations.vllm.resolution import CapturedResolution
    from shardmax.reference.nucleus_replay import pipeline_for
    from shardmax.runtime.conditional import IfGraph
    from shardmax.runtime.topp_tables import set_sigma_table
    from shardmax.testing.traffic import realistic_batch
    from shardmax.testing.vllm_chain import NativeChain, verify_inputs

    chains = {c.version: c for c in NativeChain.discover()}
    if not chains:
        print("section 5 not measured: no vLLM chain (scripts/vllm_sources.sh)", file=sys.stderr)
        return []
    chain = list(chains.values())[-1]  # discover() sorts by version
    resolver = CapturedResolution(chain)
    why = DeviceFallback(chain).unavailable(torch.device("cuda", torch.cuda.current_device()))
    if why is not None:
        print(f"section 5 not measured: {why}", file=sys.stderr)
        return []
    set_sigma_table(list(chain.modules.topk_topp._NORMAL_CDF_TO_SIGMA_TABLE))
    flag = torch.zeros(1, dtype=torch.bool, device="cuda")
    scratch = torch.zeros(1024, device="cuda")
    tiny = IfGraph(lambda: flag, lambda: scratch.add_(1), torch.device("cuda"))
    out = []
    for mix in ("temperature", "top_p"):
        for rows in rows_list:
            fb = DeviceFallback(chain)
            t = realistic_batch(max(1, rows // 4), 3, vocab, seed=rows, mix=mix, device="cuda")
            n = int(t.logits.shape[0])
            kw = verify_inputs(t)
            prefill = (kw["seq_lens"], kw["prefill_len"])
            topp = pipeline_for(n, "cuda", chain.version) if mix == "top_p" else None
            plain = _shardmax_step(t, mix, prefill, topp=topp)
            step = _shardmax_step(t, mix, prefill, (resolver, kw), topp=topp, device=fb,
                                  fold=True)  # fmt: skip
            for _ in range(4):  # eager, captured, replayed (the fold's first steps host-read)
                plain()
                step()
            torch.cuda.synchronize()
            got, bare = _captured(step, True), _captured(plain, False)
            if got is None or bare is None or step.calls["folded"] == 0:
                print(f"section 5, {mix} {n} rows: not folded ({fb.stats}, {step.calls})",
                      file=sys.stderr)  # fmt: skip
                continue
            folded, slot0 = got.slots[0].graph.graph, got.slots[0]
            # the launches below replay the table the step wrote last: its flags decide
            flagged = int(slot0.static[3].sum())
            prologue, body = (_graph_nodes(g) for g in (folded._prologue, folded._body))
            ep = fb.fold(t.logits, **kw, checks=False)
            words = np.zeros(ep.words, dtype=np.int64)

            def fold(fb: Any = fb, t: Any = t, kw: Any = kw) -> Any:
                return fb.fold(t.logits, **kw, checks=False)

            def write(ep: Any = ep, words: Any = words, slot: Any = slot0) -> None:
                ep.write(words, slot.made)

            def launch(slot: Any) -> Callable[[], None]:
                def go() -> None:  # the table the step wrote last
                    slot.request()
                    slot.graph.replay()

                return go

            calls = {FOLD_PARTS[0]: (plain, forward.replay), FOLD_PARTS[1]: (step, forward.replay),
                     FOLD_PARTS[2]: (fold, forward.replay), FOLD_PARTS[3]: (write, forward.replay),
                     FOLD_PARTS[4]: (launch(bare.slots[0]), forward.replay),
                     FOLD_PARTS[5]: (launch(slot0), forward.replay),
                     FOLD_PARTS[6]: (launch(slot0), None),
                     FOLD_PARTS[7]: (tiny.launch, forward.replay)}  # fmt: skip
            body_runs = f"{flagged} requests flagged: the body runs" if flagged else "body skipped"
            print(f"{mix} rows={n}: folded graph {prologue} step nodes + {body} body nodes "
                  f"(vLLM's chain); calls {step.calls}; launches: {body_runs}", flush=True)  # fmt: skip
            for part, (call, busy) in calls.items():
                times = _host_us(call, busy)
                p50, p90 = statistics.median(times), times[int(0.9 * (len(times) - 1))]
                out.append({"mix": mix, "rows": n, "part": part, "host_us_p50": p50,
                            "host_us_p90": p90})  # fmt: skip
                print(f"{mix:11} rows={n:4} {part:44} host p50 {p50:6.1f} us  p90 {p90:6.1f} us",
                      flush=True)  # fmt: skip
            if profile:
                import cProfile
                import pstats

                prof = cProfile.Profile()
                prof.enable()
                _host_us(step, forward.replay)
                prof.disable()
                print(f"--- host profile: {mix} rows={n}, whole folded call (200 calls)")
                pstats.Stats(prof).sort_stats("tottime").print_stats(16)
    return out


def _fold_table(rows: list[dict[str, Any]]) -> str:
    """Section 5's table (markdown)."""
    lines = ["# The folded call by part (TP 1, GPU busy unless said)", "",
             "| mix | rows | part | host us p50 | host us p90 |", "|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['mix']} | {r['rows']} | {r['part']} | {r['host_us_p50']:.1f} | "
                     f"{r['host_us_p90']:.1f} |")  # fmt: skip
    return "\n".join(lines)


SPLIT_FIELDS = ["tp", "mix", "rows", "exchange", "host_us_p50", "host_us_p90", "b2b_us_p50"]


class _GatherThenCopy:
    """A stand-in group without ``all_gather_dim0_into``: a replayed step's gather returns a
    new tensor, copied into the next graph's buffer (section 4's ``gather + copy``)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.world_size, self.rank = inner, inner.world_size, inner.rank

    def all_gather_dim0(self, t: torch.Tensor) -> torch.Tensor:
        return self.inner.all_gather_dim0(t)

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        return self.inner.all_reduce_max(t)


def split_replay(forward: Any, rows_list: list[int], tps: tuple[int, ...] = (2, 8),
                 vocab: int = 200064) -> list[dict[str, Any]]:  # fmt: skip
    """Section 4: the replayed step split at its exchanges, gathering into the next graph's
    buffer against gathering then copying (same graphs, same run)."""
    from shardmax.ops.greedy import GreedyVerifyPlan
    from shardmax.ops.sampled import SampledVerifyPlan
    from shardmax.runtime.geometry import Geometry
    from shardmax.runtime.graphs import GraphedStep
    from shardmax.runtime.shard import ShardContext
    from shardmax.runtime.validation import check_step_batch
    from shardmax.testing.emulate import RepeatedRank
    from shardmax.testing.shards import vllm_shard_ranges
    from shardmax.testing.traffic import realistic_batch

    out = []
    for tp in tps:
        ranges = vllm_shard_ranges(vocab, tp, 64)
        width = ranges[0][2]
        for rows in rows_list:
            reqs = max(1, rows // 4)
            b = realistic_batch(reqs, 3, vocab, seed=rows, mix="temperature", device="cuda")
            local = torch.nn.functional.pad(b.logits[:, : ranges[0][1]], (0, width - ranges[0][1]))
            n = local.shape[0]
            geo = Geometry(tuple((s, v) for s, v, _ in ranges), width, local.dtype)
            for mix in ("greedy", "temperature"):
                ctx = ShardContext(RepeatedRank(tp), geo, 0, local.device)
                batch = check_step_batch(
                    n, local.device, b.draft_sampled, b.cu_num_logits, b.pos, b.idx_mapping,
                    b.expanded_local_pos, b.seed, 3,
                    temperature=b.temperature if mix == "temperature" else None,
                )  # fmt: skip
                plan = (GreedyVerifyPlan(ctx, n, width) if mix == "greedy"
                        else SampledVerifyPlan(ctx, n, width))  # fmt: skip
                step = GraphedStep(plan)
                for _ in range(4):  # eager, captured, replayed
                    step.run(local, batch)
                torch.cuda.synchronize()
                into, copying = ctx.coll, _GatherThenCopy(ctx.coll)
                for name, coll in (("into", into), ("gather + copy", copying),
                                   ("into", into), ("gather + copy", copying)):  # fmt: skip
                    ctx.coll = coll
                    times = _host_us(partial(step.run, local, batch), forward.replay)
                    a, z = (
                        torch.cuda.Event(enable_timing=True),
                        torch.cuda.Event(enable_timing=True),
                    )
                    gpu = []
                    for _ in range(5):
                        a.record()
                        for _ in range(50):
                            step.run(local, batch)
                        z.record()
                        z.synchronize()
                        gpu.append(a.elapsed_time(z) * 1000 / 50)
                    out.append({"tp": tp, "mix": mix, "rows": n, "exchange": name,
                                "host_us_p50": statistics.median(times),
                                "host_us_p90": times[int(0.9 * (len(times) - 1))],
                                "b2b_us_p50": statistics.median(gpu)})  # fmt: skip
                    r = out[-1]
                    print(
                        f"split TP{tp} {mix:11} rows={n:4} {name:13} host p50 "
                        f"{r['host_us_p50']:6.1f} us  back to back {r['b2b_us_p50']:6.1f} us",
                        flush=True,
                    )
                ctx.coll = into
    return out


def summary(rows: list[dict[str, Any]], launch_rows: list[dict[str, Any]],
            part_rows: list[dict[str, Any]] | None = None,
            split_rows: list[dict[str, Any]] | None = None) -> str:  # fmt: skip
    lines = [
        "# Reading a step's flags on the host after an eager verification", "",
        "| requests | method | GPU gap us (p50 / p90) | read host us (p50) | step us | vs none |",
        "|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['reqs']} | {r['method']} | {r['gap_us_p50']:.1f} / {r['gap_us_p90']:.1f} | "
            f"{r['read_host_us_p50']:.1f} | {r['step_us']:.1f} | {r['vs_none']:.3f}x |"
        )
    lines += ["", "# Host cost of a launch", "", "| what | GPU | host us p50 | host us p90 |",
              "|---|---|---|---|"]  # fmt: skip
    for r in launch_rows:
        lines.append(f"| {r['what']} | {r['gpu']} | {r['host_us_p50']:.1f} | "
                     f"{r['host_us_p90']:.1f} |")  # fmt: skip
    if part_rows:
        lines += ["", "# The replayed call by part (GPU busy)", "",
                  "| mix | rows | part | host us p50 | host us p90 |", "|---|---|---|---|---|"]  # fmt: skip
        for r in part_rows:
            lines.append(f"| {r['mix']} | {r['rows']} | {r['part']} | {r['host_us_p50']:.1f} | "
                         f"{r['host_us_p90']:.1f} |")  # fmt: skip
    if split_rows:
        lines += ["", "# The replayed step split at its exchanges (one rank of TP > 1, stand-in "
                  "group)", "", "Two alternating rounds per case; host behind the stand-in "
                  "forward; back to back: us per call of 50 calls with nothing else queued "
                  "(the slower of the GPU's work and the host's launches).", "",
                  "| TP | mix | rows | exchange | host us p50 | host us p90 | back to back us p50 |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in split_rows:
            lines.append(f"| {r['tp']} | {r['mix']} | {r['rows']} | {r['exchange']} | "
                         f"{r['host_us_p50']:.1f} | {r['host_us_p90']:.1f} | "
                         f"{r['b2b_us_p50']:.1f} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.host_costs", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--reqs", default="8,128")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--forward-us", type=float, default=750.0)
    ap.add_argument("--part-rows", default="32,512", help="row counts of section 3")
    ap.add_argument("--split-rows", default="32,512", help="row counts of section 4")
    ap.add_argument(
        "--fold-rows", default="32,256", help="row counts of section 5 (the folded call by part)"
    )
    ap.add_argument(
        "--only-fold",
        action="store_true",
        help="section 5 alone (with a cProfile of the folded call)",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.host_costs: needs a GPU", file=sys.stderr)
        return 2
    from benchmarks.engine import _forward_graph
    from shardmax.runtime.dispatch import detect_arch

    forward, forward_us = _forward_graph(args.forward_us)
    print(f"stand-in forward: {forward_us:.0f} us")
    fold_rows_list = [int(r) for r in args.fold_rows.split(",")]
    out = args.out or Path("benchmarks/results") / (detect_arch() or "unknown") / "host_costs"
    if args.only_fold:
        out.mkdir(parents=True, exist_ok=True)
        fold_rows = fold_parts(forward, fold_rows_list, profile=True)
        write_rows(out / "fold_parts.csv", PART_FIELDS, fold_rows)
        (out / "HOST_COSTS.md").write_text(_fold_table(fold_rows) + "\n")
        return 0
    rows = []
    for reqs in (int(r) for r in args.reqs.split(",")):
        base = None
        for method in METHODS:
            r = measure(method, reqs, args.steps, forward)
            base = r["step_us"] if method == "none" else base
            r["vs_none"] = r["step_us"] / base if base else float("nan")
            rows.append(r)
            print(f"reqs={reqs:4} {method:22} gap p50 {r['gap_us_p50']:6.1f} us  read "
                  f"{r['read_host_us_p50']:6.1f} us  step {r['step_us']:7.1f} us "
                  f"({r['vs_none']:.3f}x)", flush=True)  # fmt: skip
    launch_rows = launches(forward)
    part_rows = replay_parts(forward, [int(r) for r in args.part_rows.split(",")])
    split_rows = split_replay(forward, [int(r) for r in args.split_rows.split(",")])
    fold_rows = fold_parts(forward, fold_rows_list)
    out.mkdir(parents=True, exist_ok=True)
    for name, fields, data in (("flag_read.csv", FIELDS, rows),
                               ("launches.csv", LAUNCH_FIELDS, launch_rows),
                               ("replay_parts.csv", PART_FIELDS, part_rows),
                               ("split_replay.csv", SPLIT_FIELDS, split_rows),
                               ("fold_parts.csv", PART_FIELDS, fold_rows)):  # fmt: skip
        write_rows(out / name, fields, data)
    text = summary(rows, launch_rows, part_rows, split_rows)
    if fold_rows:
        text += "\n\n" + _fold_table(fold_rows)
    (out / "HOST_COSTS.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
