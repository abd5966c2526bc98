"""Where a resolving top-p step's time goes (issues 19 and 18), on one GPU.

The plug-in's sampled call on a step that flags a request runs, after the plan's replayed
graphs: the host read of the flags (:func:`shardmax.ops.resolve.flagged_requests`: the step's
sync), the read of the rows to gather (:func:`~shardmax.ops.resolve.resolution_rows`), the
gather of those rows (:func:`~shardmax.ops.resolve.gather_rows`; at TP 1 an index copy), then
the resolution at a fixed capacity replayed from CUDA graphs
(:meth:`~shardmax.integrations.vllm.resolution.CapturedResolution.resolve`: one table upload,
``resolve_fill``, vLLM's chain on the padded sub-batch, ``resolve_apply``). This benchmark
times each part alone on realistic T = 1 / top-p 0.95 steps (V = 200064, bf16, K = 3, the
level-histogram plan the plug-in runs on top-p-only steps): host us of each part (the flag
read includes waiting for the replayed step's GPU work), the resolution from its call until its
GPU work is done (CUDA events around ``resolve`` on an idle GPU: its host work, then its
kernels), and a torch profile of the resolution's kernels alone (GPU us per call by kernel
name). Row counts whose batch flags no
request are reported as such. Needs a GPU and vLLM 0.33's kernels (``scripts/vllm_sources.sh
0.33.0``, ``SHARDMAX_VLLM_KERNELS``).

    python -m benchmarks.resolution [--rows 96,512] [--calls 30]
        [--out benchmarks/results/<arch>/resolution]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from .report import write_rows

PARTS = ("replayed step", "flag read", "resolution_rows", "gather_rows", "resolve (host)",
         "resolve (until its GPU work is done)")  # fmt: skip
FIELDS = ["rows", "reqs", "flagged", "gathered_rows", "part", "us_p50", "us_p90"]
KERNEL_FIELDS = ["rows", "kernel", "gpu_us_per_call"]


def measure(rows: int, calls: int, version: str = "0.33.0", vocab: int = 200064) -> Any:
    """``(part rows, kernel rows, note)`` for one row count (module docstring)."""
    from shardmax.integrations.vllm.resolution import CapturedResolution
    from shardmax.ops.resolve import flagged_requests, gather_rows, resolution_rows
    from shardmax.plan import VocabShard
    from shardmax.reference.nucleus_replay import pipeline_for
    from shardmax.runtime.topp_tables import set_sigma_table
    from shardmax.runtime.validation import check_step_batch
    from shardmax.testing.traffic import realistic_batch
    from shardmax.testing.vllm_chain import NativeChain, verify_inputs

    chain = {c.version: c for c in NativeChain.discover()}[version]
    set_sigma_table(list(chain.modules.topk_topp._NORMAL_CDF_TO_SIGMA_TABLE))
    reqs = max(1, rows // 4)
    t = realistic_batch(reqs, 3, vocab, seed=rows, mix="top_p", device="cuda")
    kw = verify_inputs(t)
    step_kw = {**kw, "checks": False}
    logits = t.logits
    shard = VocabShard(vocab_start=0, num_valid=vocab, width=vocab, dtype=logits.dtype,
                       device=logits.device)  # fmt: skip
    resolver = CapturedResolution(chain)

    def batch() -> Any:
        return check_step_batch(
            rows, logits.device, t.draft_sampled, t.cu_num_logits, t.pos, t.idx_mapping,
            t.expanded_local_pos, t.seed, t.num_speculative_steps, None, kw["seq_lens"],
            kw["prefill_len"], temperature=t.temperature, top_p=t.top_p,
        )  # fmt: skip

    graphed = shard.graphed(shard.verify(rows, topp=pipeline_for(rows, "cuda", version)))
    times: dict[str, list[float]] = {p: [] for p in PARTS}
    req: Any = None
    plan: Any = None
    gathered: Any = None
    res: Any = None
    for i in range(calls + 5):  # the first five: capture and warm-up
        torch.cuda.synchronize()
        h0 = time.perf_counter()
        res = graphed.run(logits, batch())
        h1 = time.perf_counter()
        req, _ = flagged_requests(res)
        h2 = time.perf_counter()
        if not req.size:
            return [], [], f"rows={rows}: the batch flags no request"
        plan = resolution_rows(res, kw["cu_num_logits_np"], req)
        h3 = time.perf_counter()
        gathered = gather_rows(shard.ctx, logits, plan.rows[plan.gather])
        h4 = time.perf_counter()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        h5 = time.perf_counter()
        resolver.resolve(res, gathered, plan, req, **step_kw)
        h6 = time.perf_counter()
        end.record()
        end.synchronize()
        if i >= 5:
            got = (h1 - h0, h2 - h1, h3 - h2, h4 - h3, h6 - h5, start.elapsed_time(end) / 1e3)
            for part, sec in zip(PARTS, got, strict=True):
                times[part].append(sec * 1e6)
    out = []
    for part, us in times.items():
        us.sort()
        out.append({"rows": rows, "reqs": reqs, "flagged": int(req.size),
                    "gathered_rows": int(plan.gather.sum()), "part": part,
                    "us_p50": statistics.median(us), "us_p90": us[int(0.9 * (len(us) - 1))]})  # fmt: skip
    kernels: list[dict[str, Any]] = []
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            resolver.resolve(res, gathered, plan, req, **step_kw)
        torch.cuda.synchronize()
    per: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total = getattr(e, "device_time_total", None)
            total = e.cuda_time_total if total is None else total
            per[e.name[:80]] = per.get(e.name[:80], 0.0) + total / 5
    for name, gpu_us in sorted(per.items(), key=lambda kv: -kv[1])[:12]:
        kernels.append({"rows": rows, "kernel": name, "gpu_us_per_call": gpu_us})
    return out, kernels, f"stats: {resolver.stats}"


def summary(parts: list[dict[str, Any]], kernels: list[dict[str, Any]], notes: list[str]) -> str:
    lines = ["# A resolving top-p step by part (TP 1, level-histogram plan)", "",
             "| rows | flagged / requests | rows gathered | part | us p50 | us p90 |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in parts:
        lines.append(f"| {r['rows']} | {r['flagged']} / {r['reqs']} | {r['gathered_rows']} | "
                     f"{r['part']} | {r['us_p50']:.1f} | {r['us_p90']:.1f} |")  # fmt: skip
    lines += ["", "# The resolution's kernels (torch profile, GPU us per call)", "",
              "| rows | kernel | GPU us |", "|---|---|---|"]  # fmt: skip
    for k in kernels:
        lines.append(f"| {k['rows']} | {k['kernel']} | {k['gpu_us_per_call']:.1f} |")
    lines += ["", *(f"- {n}" for n in notes)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.resolution", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--rows", default="96,512")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--vllm-version", default="0.33.0")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.resolution: needs a GPU", file=sys.stderr)
        return 2
    from shardmax.runtime.dispatch import detect_arch

    parts: list[dict[str, Any]] = []
    kernels: list[dict[str, Any]] = []
    notes = []
    for rows in (int(r) for r in args.rows.split(",")):
        p, k, note = measure(rows, args.calls, args.vllm_version)
        parts += p
        kernels += k
        notes.append(f"rows={rows}: {note}")
    out = args.out or Path("benchmarks/results") / (detect_arch() or "unknown") / "resolution"
    out.mkdir(parents=True, exist_ok=True)
    for name, fields, data in (("resolution.csv", FIELDS, parts),
                               ("kernels.csv", KERNEL_FIELDS, kernels)):  # fmt: skip
        write_rows(out / name, fields, data)
    text = summary(parts, kernels, notes)
    (out / "RESOLUTION.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
