"""One top-p verification step as the plug-in calls it at TP > 1, against vLLM's own path (issue 18).

Per case (V, TP, rows) and realistic T = 1 / top-p 0.95 step (:func:`shardmax.testing.traffic.
realistic_batch`, K = 3), on one GPU with the collectives emulated in-process:

* ``vllm``: what every rank runs today -- the full-logits all-gather, emulated as the copy of the
  TP shards into one ``[rows, V]`` tensor (an HBM copy: a LOWER bound of the NVLink all-gather,
  which favours vLLM), then vLLM 0.33's own chain on it (``NativeChain.verify``: the fp32 copy,
  its top-p kernels, ``rejection_sample``, ``get_num_sampled_and_rejected``), eager;
* ``shardmax-hist``: what the plug-in runs on one rank -- the step's host checks, the cached
  level-histogram plan (``VocabShard.verify(rows, topp=pipeline_for(rows, "cuda", "0.33"))``)
  replayed from CUDA graphs on this rank's ``[rows, W]`` shard (split at the step's two
  all_gathers, which run eagerly between the replays: :mod:`shardmax.runtime.graphs`), the host
  read of the flags, and the flagged requests resolved from their own rows by vLLM's own kernels
  at a fixed capacity, replayed from CUDA graphs too
  (:class:`shardmax.integrations.vllm.resolution.CapturedResolution`);
* ``shardmax-hist-eager``: the same with every launch eager -- the plan's ``run`` and vLLM's
  chain on the flagged requests (``NativeChain.verify_requests``): the plug-in's call before
  both graphs;
* ``shardmax-cand``: the candidate path (``with_candidates=True``), called as ``shardmax-hist``.

The shardmax paths' collectives return the bytes the other ranks really send: every rank's local
stage is run once beforehand (untimed), and the timed rank's collective hands back those gathered
bytes in call order (a device copy of them). So the timed work is one rank's real work, and
every timed call's outputs are checked ``==`` vLLM's whole chain (tokens, counts). Reported per
case: host us per call (until the call returns), latency us per call (until the GPU is done:
the call, then ``synchronize``), the flagged requests and the steps that needed a resolution.
The same fixed number of calls on every path.

    python -m benchmarks.topp_step [--vocab 151936,200064] [--tp 2,4,8] [--reqs 8,40]
        [--steps 4] [--calls 20] [--paths ...] [--out benchmarks/results/<arch>/topp_step]

Writes ``topp_step.csv``, ``topp_step.png`` and ``TOPP_STEP.md``. Needs a GPU and an extracted
vLLM 0.33 tree (``bash scripts/vllm_sources.sh 0.33.0``; ``SHARDMAX_VLLM_KERNELS``).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .report import write_rows

FIELDS = [
    "vocab", "tp", "rows", "path", "steps", "calls", "host_us", "latency_us", "flagged_req_pct",
    "resolved_steps_pct", "mismatch", "speedup_latency_vs_vllm",
]  # fmt: skip
K = 3
PATHS = ("shardmax-hist", "shardmax-hist-eager", "shardmax-cand", "vllm")


def _paths(
    b: Any, tp: int, chain: Any, resolver: Any, kw: dict[str, Any], paths: tuple[str, ...] = PATHS
) -> dict[str, Callable[[], Any]]:
    from shardmax.ops.resolve import flagged_requests, gather_rows, resolve_requests
    from shardmax.ops.sampled import SampledVerifyPlan
    from shardmax.reference.nucleus_replay import pipeline_for
    from shardmax.runtime.graphs import GraphedStep
    from shardmax.runtime.validation import check_step_batch
    from shardmax.testing.emulate import _stride, emulated_ranks
    from shardmax.testing.replayed import ReplayedCollective, record_exchanges

    logits = b.logits
    rows = logits.shape[0]
    config = pipeline_for(rows, "cuda", chain.version)
    cu_np = kw["cu_num_logits_np"]

    def batch_of() -> Any:
        """The plug-in's host checks of the step (a top-p-only step: top_p is its tensor)."""
        return check_step_batch(
            rows, logits.device, b.draft_sampled, b.cu_num_logits, b.pos, b.idx_mapping,
            b.expanded_local_pos, b.seed, K, None, kw["seq_lens"], kw["prefill_len"],
            temperature=b.temperature, top_p=b.top_p,
        )  # fmt: skip

    out: dict[str, Callable[[], Any]] = {}
    shards: list[Any] = []
    variants = {  # (top-p from histograms, resolver, plan replayed from CUDA graphs)
        "shardmax-hist": (True, resolver, True),  # the plug-in's call
        "shardmax-hist-eager": (True, chain, False),  # every launch eager (the plug-in before)
        "shardmax-cand": (False, resolver, True),
    }
    for name, (topp, resolve, graphed) in variants.items():
        if name not in paths:
            continue
        shards, ctxs = emulated_ranks(logits, tp, None)  # each path its own ranks and workspaces
        stride = _stride(shards[0].local_logits)
        plans = [
            SampledVerifyPlan(
                c, rows, stride, topp=config if topp else None, with_candidates=not topp
            )
            for c in ctxs
        ]
        gathered, _ = record_exchanges(shards, plans, batch_of(), cu_np, topp)
        coll = ReplayedCollective(tp, 0, gathered)
        ctxs[0].coll = coll
        plan0, local0 = plans[0], shards[0].local_logits
        step0 = GraphedStep(plan0) if graphed else plan0

        def call(
            plan0: Any = plan0, local0: torch.Tensor = local0, coll: ReplayedCollective = coll,
            resolve: Any = resolve, step0: Any = step0,
        ) -> Any:  # fmt: skip
            coll.reset()
            batch = batch_of()
            res = step0.run(local0, batch)
            req, _ = flagged_requests(res)  # the plug-in's host read of the flags
            if req.size:
                resolve_requests(
                    res, req, lambda rows: gather_rows(plan0.ctx, local0, rows), resolve, kw
                )
            return res, int(req.size)

        out[name] = call
    locals_ = [s.local_logits for s in shards]  # what the vLLM path's all-gather moves

    def vllm() -> Any:
        full = torch.cat(locals_, dim=1)[:, : logits.shape[1]]
        return chain.verify(full, **kw), 0

    out["vllm"] = vllm
    return out


def _time(call: Callable[[], Any], calls: int) -> tuple[float, float]:
    """(host us, latency us) per call: medians over ``calls`` calls after a warm-up."""
    call()
    torch.cuda.synchronize()
    host, lat = [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        call()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e6)
        lat.append((t2 - t0) * 1e6)
    return statistics.median(host), statistics.median(lat)


def run_case(
    vocab: int, tp: int, reqs: int, steps: int, calls: int, chain: Any, resolver: Any,
    paths: tuple[str, ...] = PATHS,
) -> list[dict]:  # fmt: skip
    from benchmarks.engine import _mismatches
    from shardmax.testing.traffic import realistic_batch
    from shardmax.testing.vllm_chain import verify_inputs

    acc: dict[str, dict[str, list[float]]] = {}
    for step in range(steps):
        b = realistic_batch(reqs, K, vocab, seed=4000 + step, mix="top_p", device="cuda")
        kw = verify_inputs(b)
        kw["checks"] = False
        calls_ = _paths(b, tp, chain, resolver, kw, paths)
        whole = calls_["vllm"]()[0]
        for name, call in calls_.items():
            got, flagged = call()
            bad, _ = _mismatches(got, whole) if name != "vllm" else (0, 0)
            host, lat = _time(call, calls)
            a = acc.setdefault(name, {"host": [], "lat": [], "flag": [], "res": [], "bad": []})
            a["host"].append(host)
            a["lat"].append(lat)
            a["flag"].append(flagged / reqs)
            a["res"].append(float(flagged > 0))
            a["bad"].append(bad)
    rows = []
    vl = statistics.fmean(acc["vllm"]["lat"])
    for name, a in acc.items():
        lat = statistics.fmean(a["lat"])
        rows.append({
            "vocab": vocab, "tp": tp, "rows": reqs * (K + 1), "path": name, "steps": steps,
            "calls": calls, "host_us": statistics.fmean(a["host"]), "latency_us": lat,
            "flagged_req_pct": 100 * statistics.fmean(a["flag"]),
            "resolved_steps_pct": 100 * statistics.fmean(a["res"]), "mismatch": int(sum(a["bad"])),
            "speedup_latency_vs_vllm": vl / lat,
        })  # fmt: skip
    return rows


def _profile(vocab: int, tp: int, reqs: int, steps: int, chain: Any, resolver: Any) -> None:
    import cProfile
    import pstats

    from shardmax.testing.traffic import realistic_batch
    from shardmax.testing.vllm_chain import verify_inputs

    for step in range(steps):
        b = realistic_batch(reqs, K, vocab, seed=4000 + step, mix="top_p", device="cuda")
        kw = verify_inputs(b)
        kw["checks"] = False
        call = _paths(b, tp, chain, resolver, kw, ("shardmax-hist", "vllm"))["shardmax-hist"]
        if call()[1] == 0:
            continue
        call()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            call()
        torch.cuda.synchronize()
        prof.disable()
        print(f"== V={vocab} TP{tp} {reqs * (K + 1)} rows, step {step}: 20 calls")
        pstats.Stats(prof).sort_stats("cumulative").print_stats(28)
        return
    print(f"== V={vocab} TP{tp} {reqs * (K + 1)} rows: no step resolved a request")


def _read_csv(path: Path) -> list[dict]:
    """The rows of a written ``topp_step.csv``, typed as :func:`run_case` returns them."""
    ints = {"vocab", "tp", "rows", "steps", "calls", "mismatch"}
    with path.open() as f:
        return [
            {k: (v if k == "path" else int(v) if k in ints else float(v)) for k, v in r.items()}
            for r in csv.DictReader(f)
        ]


def summary(rows: list[dict]) -> str:
    lines = [
        "# One top-p step as the plug-in calls it vs vLLM's path, emulated TP", "",
        "| V | TP | rows | path | host us | latency us | vs vLLM (latency) | requests flagged | "
        "steps resolving | != vLLM |", "|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['vocab']} | {r['tp']} | {r['rows']} | {r['path']} | {r['host_us']:.0f} | "
            f"{r['latency_us']:.0f} | {r['speedup_latency_vs_vllm']:.2f}x | "
            f"{r['flagged_req_pct']:.1f} % | {r['resolved_steps_pct']:.0f} % | {r['mismatch']} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({(r["vocab"], r["rows"]) for r in rows})
    fig, axes = plt.subplots(1, len(cases), figsize=(4.5 * len(cases), 3.8), squeeze=False)
    for ax, (v, n) in zip(axes[0], cases, strict=True):
        for path in [p for p in PATHS if any(r["path"] == p for r in rows)]:
            sel = sorted(
                (r for r in rows if (r["vocab"], r["rows"], r["path"]) == (v, n, path)),
                key=lambda r: r["tp"],
            )
            ax.plot([r["tp"] for r in sel], [r["latency_us"] for r in sel], marker="o", label=path)
        ax.set_title(f"V={v}, {n} rows: latency us per call")
        ax.set_xlabel("TP (emulated)")
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=90)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.topp_step", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--vocab", default="151936,200064")
    ap.add_argument("--tp", default="2,4,8")
    ap.add_argument("--reqs", default="8,40")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--paths", default=",".join(PATHS), help=f"comma-separated, of {','.join(PATHS)} (vllm "
        "always runs: the oracle and the baseline)",
    )  # fmt: skip
    ap.add_argument(
        "--profile",
        action="store_true",
        help="only print where the host time of the histogram path's call goes on the first "
        "step that resolves a request (cProfile, 20 calls), per case",
    )
    ap.add_argument(
        "--render", type=Path, default=None, metavar="CSV",
        help="only re-draw the PNG and the table of a measured topp_step.csv (into --out, "
        "default the CSV's folder)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.render is not None:
        rows = _read_csv(args.render)
        out = args.out or args.render.parent
        plot(rows, out / "topp_step.png")
        (out / "TOPP_STEP.md").write_text(summary(rows) + "\n")
        return 0
    if not torch.cuda.is_available():
        print("benchmarks.topp_step: needs a GPU", file=sys.stderr)
        return 2
    from benchmarks.flags import _vllm_033
    from shardmax.runtime.dispatch import detect_arch

    chain = _vllm_033()
    if chain is None:
        print("benchmarks.topp_step: no vLLM 0.33 tree (bash scripts/vllm_sources.sh 0.33.0)",
              file=sys.stderr)  # fmt: skip
        return 2
    from shardmax.integrations.vllm.resolution import CapturedResolution

    resolver = CapturedResolution(chain)
    paths = tuple(p for p in PATHS if p in args.paths.split(",") or p == "vllm")
    rows: list[dict] = []
    for vocab in (int(v) for v in args.vocab.split(",")):
        for reqs in (int(r) for r in args.reqs.split(",")):
            for tp in (int(t) for t in args.tp.split(",")):
                if args.profile:
                    _profile(vocab, tp, reqs, args.steps, chain, resolver)
                    continue
                for r in run_case(vocab, tp, reqs, args.steps, args.calls, chain, resolver, paths):
                    print(f"V={vocab} TP{tp} rows={r['rows']:4} {r['path']:14} host "
                          f"{r['host_us']:7.0f} us  latency {r['latency_us']:7.0f} us  "
                          f"({r['speedup_latency_vs_vllm']:.2f}x vLLM)  flagged "
                          f"{r['flagged_req_pct']:5.1f} %  mismatch {r['mismatch']}", flush=True)  # fmt: skip
                    rows.append(r)
    print(f"captured resolution: {resolver.stats}")
    if args.profile:
        return 0
    out = args.out or Path("benchmarks/results") / (detect_arch() or "unknown") / "topp_step"
    out.mkdir(parents=True, exist_ok=True)
    write_rows(out / "topp_step.csv", FIELDS, rows)
    plot(rows, out / "topp_step.png")
    (out / "TOPP_STEP.md").write_text(summary(rows) + "\n")
    print(summary(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
