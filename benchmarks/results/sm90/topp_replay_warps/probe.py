"""The probe behind kernels_w*_run2.log: ``benchmarks.engine --kernels`` with, before each row
count's kernel listing, (1) the level-histogram plan's eager run 30 times, every output and flag
bit-compared with the first call's, and (2) the folded top-p path called 40 times with the host
running ahead unboundedly (no wait, as ``benchmarks.timing.kernel_times`` calls it), each call's
tokens and counts compared with vLLM's chain on the same step.

    PYTHONPATH=. python benchmarks/results/sm90/topp_replay_warps/probe.py \\
        --mixes top_p --rows 4,32,96 --steps 20 --rounds 2 --kernels --out /tmp/probe
"""

import sys
from typing import Any

import torch

import benchmarks.engine as engine

_listing = engine._print_kernels


def _probe(traffic: Any, mix: str, prefill: Any, config: Any, paths: dict[str, Any]) -> None:
    rows = traffic.logits.shape[0]
    theirs = [t.clone() for t in paths["vllm"]()[:3]]
    torch.cuda.synchronize()
    if config is not None:
        hist = engine._shardmax_step(traffic, mix, prefill, graphed=False, topp=config)
        outs = []
        for _ in range(30):
            r = hist()
            outs.append([r[0].clone(), r[1].clone(), r[2].clone(), r.fallback.clone()])
        torch.cuda.synchronize()
        diff = sum(
            any(not torch.equal(a, b) for a, b in zip(outs[0], o, strict=True)) for o in outs[1:]
        )
        print(f"PROBE {mix} rows={rows} hist eager: {diff} of 29 calls differ from the first; "
              f"flagged {int(outs[0][3].sum())}", flush=True)  # fmt: skip
    for name in ("shardmax-hist+fold", "shardmax+fold"):
        if name not in paths:
            continue
        step = paths[name]
        before = dict(step.calls)
        got = []
        for _ in range(40):
            r = step()
            got.append((r[0].clone(), r[1].clone(), r[2].clone()))
        torch.cuda.synchronize()
        bad = sorted({engine._mismatches(g, theirs) for g in got})
        after = {k: step.calls[k] - before[k] for k in before}
        print(f"PROBE {name} {mix} rows={rows}: 40 calls host far ahead: requests differing "
              f"(differing, left flagged) per call {bad}; steps {after}", flush=True)  # fmt: skip
    _listing(traffic, mix, prefill, config, paths)


if __name__ == "__main__":
    engine._print_kernels = _probe
    sys.exit(engine.main(sys.argv[1:]))
