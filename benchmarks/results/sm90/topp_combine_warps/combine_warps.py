"""topp_combine alone at (PARTS, num_warps) on real split records: V=200064 bf16, graph replay,
PDL off; each launch's records compared with the default launch's (==). Prints the CSV."""

import os

os.environ.setdefault("SHARDMAX_PDL", "0")

import torch

from shardmax.ops.topp import HIST_LEVELS, RECORD_WORDS, merge_block, topp_histograms
from shardmax.runtime.kernels import kernel
from shardmax.runtime.variants import VariantKey
from shardmax.testing.traffic import realistic_batch

V = 200064


def best_us(call) -> float:
    """us per call: 20 calls captured in a graph, 10 replays, best of 5."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        call()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            call()
    best = 1e9
    for _ in range(5):
        g.replay()
        torch.cuda.synchronize()
        a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            g.replay()
        e.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(e) * 1000 / 200)
    return best


def combine(k, rows, scratch, temp, res, splits, parts, warps):
    """One ``topp_combine`` launch of ``splits`` records per row, ``parts`` at a time."""

    def call() -> None:
        k((rows,), scratch, temp, res, rows, splits, LEVELS=HIST_LEVELS, PARTS=parts,
          num_warps=warps)  # fmt: skip

    return call


print("reqs,rows,splits,parts,warps,us_per_call,default,equal_default")
for reqs, splits in ((1, 16), (8, 16), (40, 4), (40, 3), (64, 4), (128, 2), (128, 4)):
    b = realistic_batch(reqs, 3, V, seed=11 + reqs, device="cuda")
    logits = b.logits
    rows = logits.shape[0]
    temp = torch.ones(rows, dtype=torch.float32, device="cuda")
    out = torch.empty((rows, RECORD_WORDS), dtype=torch.int32, device="cuda")
    scratch = torch.empty((splits * rows, RECORD_WORDS), dtype=torch.int32, device="cuda")
    counts = torch.empty((splits * rows, HIST_LEVELS), dtype=torch.int32, device="cuda")
    topp_histograms(logits, temp, num_valid=V, vocab_start=0, block=4096, splits=splits,
                    out=out, scratch=scratch, counts=counts)  # fmt: skip
    torch.cuda.synchronize()
    ref = out.clone()  # the default launch's records (PARTS = merge_block(splits), 8 warps)
    k = kernel(VariantKey("topp_combine", dtype="bf16").name)
    dflt_parts = merge_block(splits)
    for parts in sorted({1, 2, 4, 8, dflt_parts}):
        if parts > 8:
            continue
        for warps in (2, 4, 8, 16):
            res = torch.full_like(out, -7)
            call = combine(k, rows, scratch, temp, res, splits, parts, warps)
            call()
            torch.cuda.synchronize()
            same = bool(torch.equal(res, ref))
            us = best_us(call)
            dflt = int(parts == dflt_parts and warps == 8)
            print(f"{reqs},{rows},{splits},{parts},{warps},{us:.2f},{dflt},{same}", flush=True)
