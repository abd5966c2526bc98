"""One rank's top-p local stage (``topp_histograms``: ``topp_hist`` + ``topp_combine``) at
blocks 4096 / 2048 and 8-64 splits per row, for 1, 2 and 8 requests (K = 3: 4 / 8 / 32 rows) of
realistic T = 1 / top-p 0.95 traffic, V = 200064 bf16, TP 1. GPU us per call under CUDA-graph
replay (20 calls per graph, 10 replays, best of 3), PDL off; each configuration's level counts
compared with the first's (the splits must not change them). Needs a GPU. Run from the
repository root: ``python benchmarks/results/sm90/topp_hist_splits_small/hist_splits.py >
hist_splits.csv`` (the run of this folder used an uncommitted copy of this script, the same
measurement in a looser form)."""

import os

os.environ.setdefault("SHARDMAX_PDL", "0")  # before shardmax reads it

import torch

from shardmax.ops.topp import (
    HIST_LEVELS,
    RECORD_WORDS,
    topp_hist_splits,
    topp_histograms,
)
from shardmax.testing.traffic import realistic_batch

V = 200064
CALLS, REPLAYS, ROUNDS = 20, 10, 3


def time_us(call: object) -> float:
    """GPU us per ``call()`` under graph replay."""
    assert callable(call)
    with torch.cuda.stream(torch.cuda.Stream()):
        call()  # warm the capture's side stream
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            call()
    best = float("inf")
    for _ in range(ROUNDS):
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPLAYS):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / (CALLS * REPLAYS))
    return best


def main() -> None:
    print("reqs,rows,block,splits,us_per_call,default,counts_equal_ref")
    for reqs in (1, 2, 8):
        logits = realistic_batch(reqs, 3, V, seed=11 + reqs, device="cuda").logits
        rows = logits.shape[0]
        temp = torch.ones(rows, dtype=torch.float32, device="cuda")
        ref = None
        for block in (4096, 2048):
            default = topp_hist_splits(rows, V, block, logits.device)
            for splits in (8, 16, 32, 64):
                if V // (block * splits) < 1:
                    continue
                out = torch.empty((rows, RECORD_WORDS), dtype=torch.int32, device="cuda")
                scratch = torch.empty(
                    (splits * rows, RECORD_WORDS), dtype=torch.int32, device="cuda"
                )
                counts = torch.empty((splits * rows, HIST_LEVELS), dtype=torch.int32, device="cuda")
                kw = {"num_valid": V, "vocab_start": 0, "block": block, "splits": splits,
                      "out": out, "scratch": scratch, "counts": counts}  # fmt: skip

                def call(x: torch.Tensor = logits, t: torch.Tensor = temp, kw: dict = kw) -> None:
                    topp_histograms(x, t, **kw)

                call()
                torch.cuda.synchronize()
                words = out[:, : HIST_LEVELS // 2].clone()
                ref = words if ref is None else ref
                same = bool(torch.equal(words, ref))
                us = time_us(call)
                print(f"{reqs},{rows},{block},{splits},{us:.2f},{int(splits == default)},{same}")


if __name__ == "__main__":
    main()
