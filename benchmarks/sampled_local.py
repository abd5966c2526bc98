"""One rank's sampled verification against vLLM's own kernels on the same columns (issue 22).

For every (TP, rows) this times, on one GPU and in the same run, on realistic temperature-1
traffic (:func:`shardmax.testing.traffic.realistic_batch`, ``mix="temperature"``: LM entropy
profile, drafts the top token 80 % of the time, no top-k / top-p; V = 200064 bf16, K = 3):

``vllm_full``     vLLM's own chain on the full ``[rows, V]`` logits (the work every rank does
                  after vLLM's full-logits all-gather; :class:`shardmax.testing.vllm_chain.
                  NativeChain`: ``rejection_sample`` + ``get_num_sampled_and_rejected``)
``vllm_cols``     the same chain on ``[rows, W]`` -- the first ``W = V/TP`` columns, drafts
                  taken modulo ``W`` (the same work per column as a rank's shard)
``one_pass``      shardmax on rank 0's ``[rows, W]`` shard, fast mode, every record with its
                  Gumbel key (``phases=1``); the other ranks' bytes stood in by rank 0's
                  (:class:`shardmax.testing.emulate.RepeatedRank`: the all_gather is a tile;
                  at TP 1 none, as a real step of one rank)
``two_phase``     the same, two-phase (``phases=2``): records without noise, one drawn row per
                  request, a second small exchange
``one_pass_strict`` / ``two_phase_strict``   strict mode (vLLM's LSE bits)
``two_phase_d<N>`` two-phase with N draw programs per request (``--draw-sweep``; graph time
                  only, outputs compared with ``two_phase``'s): the measurement behind the draw
                  kernel's built-in program count
``two_phase_p1_b<B>_s<S>_w<W>``  two-phase with phase 1 (the noise-free record pass) at block
                  B, S programs per row, W warps (``--phase1-sweep``; graph time only, every
                  call's outputs compared with ``two_phase``'s): what ``python -m tuner
                  --phases-from`` writes into the tables as ``launch["phase1"]``
``greedy``        ``sharded_greedy_verify``'s plan on the same shard (temperature 0)
``greedy_rows``   ``sharded_verify``'s plan (the table's launch) on the same batch with every
                  request greedy (temperature 0): what a sampled step costs on greedy traffic
``<m>_nopdl``     ``two_phase``, ``greedy`` and ``greedy_rows`` launched without programmatic
                  dependent launch (:func:`shardmax.runtime.kernels.set_pdl` ``(False)`` while
                  the call is captured and timed, right after the method itself; outputs
                  compared with the method's): what PDL gains (on a GPU that supports it;
                  ``--no-pdl-ab`` leaves them out). The graph holds several steps back to back,
                  so one overlapped edge per step is the previous step's last kernel; a step the
                  plug-in replays starts at a graph boundary and overlaps its table fetch's
                  edge instead

Per method: CUDA-graph replay us per call (p20/p50/p80, L2-warm), eager host us per call (mean
over ``--eager`` calls, each started on an idle GPU) and the HBM floor of the shard (its bytes read
once at the D2D copy bandwidth of this run). ``kernel`` rows: a torch profile of 20 eager calls
per shardmax method, GPU us per call by kernel (the generated kernels carry their variant
names). At TP 1 the shard is the whole vocabulary and ``correct`` counts the requests of
``one_pass`` / ``two_phase`` (unflagged) that differ from ``vllm_full`` (must be 0), each call
run twice and compared bit for bit.

    python -m benchmarks.sampled_local [--tp 1,2,4,8] [--rows 4,32,96,256,512] [--out DIR]
    python -m benchmarks.sampled_local --plot benchmarks/results/sm90/sampled_local.csv
"""

from __future__ import annotations

import argparse
import csv
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

FIELDS = [
    "tp", "rows", "reqs", "vocab", "width", "method", "kernel", "p20_us", "p50_us", "p80_us",
    "host_us", "floor_us", "correct", "note",
]  # fmt: skip
METHODS = ("vllm_full", "vllm_cols", "one_pass", "two_phase", "one_pass_strict",
           "two_phase_strict", "greedy", "greedy_rows")  # fmt: skip
PROFILED = ("one_pass", "two_phase", "greedy", "greedy_rows", "vllm_cols")
"""Methods whose kernels the torch profile breaks down (per-kernel GPU us per call)."""
K = 3


def _host_us(step: Callable[[], Any], calls: int) -> float:
    import torch

    for _ in range(3):
        step()
    t = []
    for _ in range(calls):
        torch.cuda.synchronize()  # the call starts on an idle GPU, as after vLLM's forward
        h0 = time.perf_counter()
        step()
        t.append((time.perf_counter() - h0) * 1e6)
    torch.cuda.synchronize()
    return statistics.fmean(t)


def _same(a: Any, b: Any) -> bool:
    import torch

    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _agree(a: Any, b: Any) -> bool:
    """Tokens and counts equal on every request neither result flagged."""
    both = ~a.fallback & ~b.fallback
    rows = (a.sampled == b.sampled).all(dim=1) & (a.num_sampled == b.num_sampled)
    return bool((rows & (a.num_rejected == b.num_rejected) | ~both).all())


def _differ(ours: Any, theirs: Any) -> int:
    import torch

    ok = ~ours.fallback
    n = theirs[1].long()
    used = torch.arange(ours.sampled.shape[1], device=n.device)[None, :] < n[:, None]
    bad = ((ours.sampled != theirs[0]) & used).any(dim=1) | (ours.num_sampled.long() != n)
    return int((bad & ok).sum())


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    from benchmarks import timing
    from shardmax.ops.greedy import GreedyVerifyPlan
    from shardmax.ops.sampled import RecordLaunch, SampledVerifyPlan, record_variant
    from shardmax.runtime import dispatch, kernels
    from shardmax.runtime.geometry import Geometry
    from shardmax.runtime.shard import ShardContext
    from shardmax.runtime.validation import check_step_batch
    from shardmax.testing.emulate import RepeatedRank
    from shardmax.testing.shards import vllm_shard_ranges
    from shardmax.testing.traffic import realistic_batch
    from shardmax.testing.vllm_chain import NativeChain, verify_inputs

    chain = {c.version: c for c in NativeChain.discover()}[args.vllm_version]
    pdl_ab = not args.no_pdl_ab and kernels.pdl_supported(torch.cuda.current_device())
    bw = timing.copy_bandwidth_gbps("cuda")
    out: list[dict[str, Any]] = []
    for rows in [int(r) for r in args.rows.split(",")]:
        reqs = max(1, rows // (K + 1))
        b = realistic_batch(reqs, K, args.vocab, seed=rows, mix="temperature", device="cuda")
        kw = verify_inputs(b)
        whole = chain.verify(b.logits, **kw)
        for tp in [int(t) for t in args.tp.split(",")]:
            ranges = vllm_shard_ranges(args.vocab, tp, 64)
            width = ranges[0][2]
            geo = Geometry(tuple((s, n) for s, n, _ in ranges), width, b.logits.dtype)
            ctx = ShardContext(RepeatedRank(tp), geo, 0, torch.device("cuda"))
            local = b.logits[:, : ranges[0][1]].contiguous()
            if local.shape[1] < width:
                local = torch.nn.functional.pad(local, (0, width - local.shape[1]))
            common = {"tp": tp, "rows": reqs * (K + 1), "reqs": reqs, "vocab": args.vocab,
                      "width": width,
                      "floor_us": round(local.numel() * local.element_size() / bw / 1e3, 2)}  # fmt: skip
            batch = check_step_batch(
                local.shape[0], local.device, *b.sampled_args()[:5], b.seed, K,
                temperature=b.temperature,
            )  # fmt: skip
            greedy_batch = check_step_batch(
                local.shape[0], local.device, *b.sampled_args()[:5], b.seed, K
            )
            cols_kw = dict(kw, draft_sampled=(kw["draft_sampled"] % width).to(torch.int32))
            cols = b.logits[:, :width]
            paths: dict[str, Callable[[], Any]] = {}
            if tp == 1:
                paths["vllm_full"] = functools.partial(chain.verify, b.logits, **kw, checks=False)
            paths["vllm_cols"] = functools.partial(chain.verify, cols, **cols_kw, checks=False)
            results: dict[str, Any] = {}
            for name, mode, phases in (("one_pass", "fast", 1), ("two_phase", "fast", 2),
                                       ("one_pass_strict", "strict", 1),
                                       ("two_phase_strict", "strict", 2)):  # fmt: skip
                with dispatch.override(phases=phases):
                    plan = SampledVerifyPlan(ctx, local.shape[0], local.stride(0), mode=mode)
                paths[name] = functools.partial(plan.run, local, batch)
            for d in [int(x) for x in args.draw_sweep.split(",") if x]:
                with dispatch.override(phases=2):
                    plan = SampledVerifyPlan(ctx, local.shape[0], local.stride(0), draw_splits=d)
                paths[f"two_phase_d{d}"] = functools.partial(plan.run, local, batch)
            for blk, sp, w in _phase1_grid(args.phase1_sweep, width):
                launch = RecordLaunch(record_variant(local.dtype, blk), sp, w, 64, "sweep", 2)
                plan = SampledVerifyPlan(ctx, local.shape[0], local.stride(0), launch=launch)
                paths[f"two_phase_p1_b{blk}_s{sp}_w{w}"] = functools.partial(plan.run, local, batch)
            gplan = GreedyVerifyPlan(ctx, local.shape[0], local.stride(0))
            paths["greedy"] = functools.partial(gplan.run, local, greedy_batch)
            zero_batch = check_step_batch(
                local.shape[0], local.device, *b.sampled_args()[:5], b.seed, K,
                temperature=torch.zeros_like(b.temperature),
            )  # fmt: skip
            zplan = SampledVerifyPlan(ctx, local.shape[0], local.stride(0))
            paths["greedy_rows"] = functools.partial(zplan.run, local, zero_batch)
            if pdl_ab:
                for name in ("two_phase", "greedy", "greedy_rows"):
                    paths[f"{name}_nopdl"] = functools.partial(_without_pdl, paths[name])
            for name, step in paths.items():
                row = dict(common, method=name, kernel="", correct="", note="")
                first, again = step(), step()
                if name.startswith(("two_phase_p1_", "two_phase_d")):
                    # the interval test's flags may move with the splits (fp32 partial sums):
                    # tokens and counts must agree wherever neither run flagged the request
                    same = _same(first, again) and _agree(first, results["two_phase"])
                    row["note"] = (
                        f"agrees with two_phase ({int(first.fallback.sum())} flagged)"
                        if same
                        else "DIFFERS"
                    )
                if name.endswith("_nopdl"):
                    base = results.get(name[: -len("_nopdl")]) or paths[name[: -len("_nopdl")]]()
                    row["note"] = "same bits as with PDL" if _same(first, base) else "DIFFERS"
                    row["note"] += "" if _same(first, again) else "; NONDETERMINISTIC"
                if name in ("one_pass", "two_phase", "one_pass_strict", "two_phase_strict"):
                    row["note"] = "deterministic" if _same(first, again) else "NONDETERMINISTIC"
                    results[name] = first
                    if tp == 1:
                        row["correct"] = (
                            f"{_differ(first, whole)} of {int((~first.fallback).sum())}"
                        )
                st = timing.measure(lambda i, s=step: s(), 1, torch.device("cuda"), cold=False)
                row.update(
                    p20_us=round(st.p20, 2), p50_us=round(st.p50, 2), p80_us=round(st.p80, 2)
                )
                if not name.startswith(("two_phase_d", "two_phase_p1_")):  # sweeps: graph only
                    row["host_us"] = round(_host_us(step, args.eager), 1)
                out.append(row)
                print(row, flush=True)
                if name in PROFILED and not args.no_profile:
                    for kname, us in timing.kernel_times(step).items():
                        out.append(dict(common, method=name, kernel=kname, p50_us=round(us, 2)))
            if not _agree(results["one_pass"], results["two_phase"]):
                print(f"!! tp={tp} rows={rows}: one_pass != two_phase", flush=True)
                out[-1]["note"] = "ONE_PASS_DIFFERS"
    return out


def _without_pdl(step: Callable[[], Any]) -> Any:
    """``step()`` with programmatic dependent launch off (launched or captured that way)."""
    from shardmax.runtime import kernels

    before = kernels.set_pdl(False)
    try:
        return step()
    finally:
        kernels.set_pdl(before)


def _phase1_grid(spec: str, width: int) -> list[tuple[int, int, int]]:
    """``BLOCKS:SPLITS:WARPS`` (comma lists) -> the (block, splits, warps) to time; splits
    past one block per program at this width are left out."""
    if not spec:
        return []
    blocks, splits, warps = ([int(x) for x in part.split(",") if x] for part in spec.split(":"))
    return [(b, s, w) for b in blocks for s in splits if s <= max(1, -(-width // b)) for w in warps]


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in FIELDS})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.sampled_local", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--tp", default="1,2,4,8")
    ap.add_argument("--rows", default="4,32,96,256,512")
    ap.add_argument("--vocab", type=int, default=200064)
    ap.add_argument("--eager", type=int, default=200, help="eager calls timed per method")
    ap.add_argument("--vllm-version", default="0.33.0")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--no-pdl-ab", action="store_true", help="leave out the <m>_nopdl methods")
    ap.add_argument(
        "--draw-sweep",
        default="4,8,16,32,64,128",
        help="also time two-phase with these draw programs per request (graph only)",
    )
    ap.add_argument(
        "--phase1-sweep",
        default="",
        metavar="BLOCKS:SPLITS:WARPS",
        help="also time two-phase with these phase-1 launches, e.g. 1024,2048:4,8,16:4,8 "
        "(graph only; off by default)",
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None, metavar="CSV")
    args = ap.parse_args(argv)
    if args.plot is not None:
        from benchmarks.sampled_report import report

        report(args.plot)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("benchmarks.sampled_local: needs a GPU", file=sys.stderr)
        return 2
    from shardmax.runtime.dispatch import detect_arch

    out_dir = args.out or Path("benchmarks/results") / (detect_arch() or "unknown")
    rows = run(args)
    write_csv(rows, out_dir / "sampled_local.csv")
    print(f"wrote {out_dir / 'sampled_local.csv'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
