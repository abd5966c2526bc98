"""In the engine loop (forward graph replay, lookahead 2): the fold call's host time by part.

``python3 loop_parts.py top_p:4,top_p:256,greedy:256 [--freeze]`` (a GPU; vLLM's extracted
kernels in $SHARDMAX_VLLM_KERNELS); ``--freeze``: the GC heap frozen first, as vLLM's engine
core does after start-up."""

import gc
import statistics
import sys
import time

import torch

from benchmarks.engine import _forward_graph
from shardmax.integrations.vllm.fallback import DeviceFallback
from shardmax.plan import VocabShard
from shardmax.reference.nucleus_replay import pipeline_for
from shardmax.runtime.topp_tables import set_sigma_table
from shardmax.runtime.validation import check_step_batch
from shardmax.testing.traffic import realistic_batch
from shardmax.testing.vllm_chain import NativeChain, verify_inputs

chain = {c.version: c for c in NativeChain.discover()}["0.33.0"]
set_sigma_table(list(chain.modules.topk_topp._NORMAL_CDF_TO_SIGMA_TABLE))
forward, fus = _forward_graph(750.0)
pc = time.perf_counter_ns
PARTS = ("check", "plan", "fold", "graphed", "run", "whole")
LAUNCH = []


class Timed:
    def __init__(self, g):
        self.g = g

    def replay(self):
        a = pc()
        self.g.replay()
        LAUNCH.append((pc() - a) / 1e3)


def wrap_slots():
    import gc

    from shardmax.runtime.graphs import _Slot

    n = 0
    for o in gc.get_objects():
        if isinstance(o, _Slot) and o.graph is not None and not isinstance(o.graph, Timed):
            o.graph = Timed(o.graph)
            n += 1
    return n


def make(mix, reqs, seed):
    t = realistic_batch(reqs, 3, 200064, seed=seed, mix=mix, device="cuda")
    kw = verify_inputs(t)
    rows, vocab = t.logits.shape
    shard = VocabShard(
        vocab_start=0, num_valid=vocab, width=vocab, dtype=t.logits.dtype, device=t.logits.device
    )
    sampled = mix != "greedy"
    topp = pipeline_for(rows, "cuda", chain.version) if mix == "top_p" else None
    fb = DeviceFallback(chain) if sampled else None
    acc = {p: [] for p in PARTS}
    calls = {"folded": 0, "other": 0}

    def step():
        a = pc()
        batch = check_step_batch(
            rows,
            t.logits.device,
            t.draft_sampled,
            t.cu_num_logits,
            t.pos,
            t.idx_mapping,
            t.expanded_local_pos,
            t.seed,
            t.num_speculative_steps,
            None,
            kw["seq_lens"],
            kw["prefill_len"],
            temperature=t.temperature if sampled else None,
            top_p=t.top_p,
        )
        b = pc()
        plan = shard.verify(rows, topp=topp) if sampled else shard.greedy_verify(rows)
        c = pc()
        ep = fb.fold(t.logits, **kw, checks=False) if sampled else None
        d = pc()
        g = shard.graphed(plan)
        e = pc()
        res = g.run(t.logits, batch, ep)
        f = pc()
        if sampled and not ep.queued:
            calls["other"] += 1
            if not fb.run(res, t.logits, **kw, checks=False):
                from shardmax.ops.resolve import flagged_requests

                flagged_requests(res)
        else:
            calls["folded"] += 1
        for p, x in zip(PARTS, (b - a, c - b, d - c, e - d, f - e, f - a), strict=True):
            acc[p].append(x / 1e3)
        return res

    return step, acc, calls


def loop(steps_fns, n):
    evs = [torch.cuda.Event() for _ in range(n)]
    for i in range(n):
        if i >= 2:
            evs[i - 2].synchronize()
        forward.replay()
        steps_fns[i % len(steps_fns)]()
        evs[i].record()
    torch.cuda.synchronize()


GC = {"n": 0, "ns": 0, "t": 0, "gen2": 0}


def _cb(phase, info):
    if phase == "start":
        GC["t"] = pc()
    else:
        GC["n"] += 1
        GC["ns"] += pc() - GC["t"]
        GC["gen2"] += info["generation"] == 2


gc.callbacks.append(_cb)
FREEZE = "--freeze" in sys.argv
rows_mix = [(m, int(r)) for m, r in (x.split(":") for x in sys.argv[1].split(","))]
for mix, rows in rows_mix:
    reqs = max(1, rows // 4)
    made = [make(mix, reqs, rows + 1000 * j) for j in range(4)]
    fns = [m[0] for m in made]
    for f in fns:
        for _ in range(4):
            f()
    torch.cuda.synchronize()
    print("wrapped", wrap_slots())
    LAUNCH.clear()
    for m in made:
        for v in m[1].values():
            v.clear()
    if FREEZE:
        gc.collect()
        gc.freeze()
    GC.update(n=0, ns=0, gen2=0)
    t0 = pc()
    loop(fns, 400)
    wall = (pc() - t0) / 1e3
    print(
        f"  gc: {GC['n']} collections ({GC['gen2']} gen2) {GC['ns'] / 1e3:.0f} us in 400 steps; loop wall {wall / 400:.1f} us/step; frozen={gc.get_freeze_count()}"
    )
    acc = {p: [x for m in made for x in m[1][p]] for p in PARTS}
    calls = {k: sum(m[2][k] for m in made) for k in ("folded", "other")}
    print(f"{mix} rows={rows} calls={calls}")
    for p in PARTS:
        v = acc[p]
        print(
            f"   {p:8} mean {statistics.fmean(v):7.1f}  p50 {statistics.median(v):7.1f}  p90 {sorted(v)[int(0.9 * len(v))]:7.1f}"
        )
    v = LAUNCH
    if v:
        print(
            f"   {'launch':8} mean {statistics.fmean(v):7.1f}  p50 {statistics.median(v):7.1f}  p90 {sorted(v)[int(0.9 * len(v))]:7.1f}  n={len(v)}"
        )
    sys.stdout.flush()
