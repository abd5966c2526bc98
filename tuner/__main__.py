"""CLI: ``shardmax-tune`` = ``python -m shardmax.tuner`` (installed, any directory) =
``python -m tuner`` (from the repository root). See README.md.

Imports only the standard library at module level so ``--help`` works on an image without
optuna; the sweep itself needs optuna (and torch/triton), imported after argument parsing.
On a machine without a GPU the sweep runs in the Triton interpreter: if ``TRITON_INTERPRET=1``
is not in the environment, the command runs itself again with it (Triton reads it when it
loads, which a console script has already done).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CPU_BANNER = """\
======================================================================================
 CPU MODE (no GPU): Triton kernels run in the interpreter (TRITON_INTERPRET=1).
 Timings are MEANINGLESS. This runs a tiny sweep end to end to exercise the pipeline
 (gate -> timing -> export). No table is written unless --write-table is passed, and a
 table written here is marked "tuned": false.
======================================================================================"""


def _prog() -> str:
    try:
        from shardmax.generator.console import prog_name
    except ModuleNotFoundError:  # shardmax not installed: only --help can work
        return "python -m tuner"
    return prog_name(__package__, "shardmax-tune")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=_prog(),
        description="Tune shardmax's local-stage variants, launch parameters and transport per "
        "GPU arch with Optuna; write generated/<arch>/<op>.json. The same tool is "
        "`shardmax-tune`, `python -m shardmax.tuner` (any directory) and `python -m tuner` "
        "(repository root).",
        epilog="Examples: `shardmax-tune --quick` (one GPU, < 10 min); "
        "`torchrun --nproc-per-node 2 -m shardmax.tuner --distributed --quick` (transport and "
        "plain path with a real TP=2 group).",
    )
    p.add_argument(
        "--op",
        choices=("argmax", "verify", "sampled", "all"),
        default="all",
        help="argmax / verify: the greedy local stage; sampled: the sampled-verification record "
        "kernel (block, splits, warps, candidates C; one GPU only); all: every op (with "
        "--distributed: argmax and verify)",
    )
    p.add_argument(
        "--top-k-max",
        type=int,
        default=None,
        help="op sampled: the largest top-k that must keep running sharded; only C > it are "
        "searched (default 63: the built-in contract k < 64)",
    )
    p.add_argument(
        "--arch",
        help="arch id (sm90, gfx950); default: detected. Must match the "
        "GPU; on CPU it picks the static limits (default sm90)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="small subset: V in {200064, 151936} (op sampled: 151936), TP 1/4/8, rows "
        "1/32/96/512, warps 4/8/16 (op sampled: 4/8), stages 2",
    )
    p.add_argument(
        "--distributed",
        action="store_true",
        help="run under torchrun: time real collectives (allgather vs allreduce) "
        "and the plain path at tp = world size; rank 0 owns the study",
    )
    p.add_argument(
        "--space",
        choices=("quick", "full"),
        help="search space: quick = warps 4/8/16, stages 2 (default with --quick and on CPU); "
        "full = every warps/stages value of the arch (default otherwise)",
    )
    p.add_argument("--dtype", nargs="+", default=["bf16"], choices=("bf16", "fp16", "fp32"))
    p.add_argument("--tp", nargs="+", type=int, help="TP sizes (default: 1 2 4 8)")
    p.add_argument("--vocab", nargs="+", type=int, help="vocabularies (default: problems.MODELS)")
    p.add_argument("--rows", nargs="+", type=int, help="row buckets (default: problems.ROWS)")
    p.add_argument(
        "--storage",
        help="Optuna storage URL (postgresql://..., mysql://..., "
        "journal://PATH) or a journal file path",
    )
    p.add_argument(
        "--studies-dir",
        type=Path,
        help="journal directory (default tuner/studies; one file per arch/op)",
    )
    p.add_argument(
        "--out",
        type=Path,
        help="tables root (default: the package's generated/); "
        "point SHARDMAX_TABLES_DIR here to use it",
    )
    w = p.add_mutually_exclusive_group()
    w.add_argument(
        "--write-table",
        dest="write",
        action="store_true",
        default=None,
        help="write the table (default on GPU; required on CPU)",
    )
    w.add_argument("--no-write-table", dest="write", action="store_false")
    p.add_argument(
        "--n-trials", type=int, help="max new trials per bucket (default: the whole grid; 3 on CPU)"
    )
    p.add_argument("--timeout", type=float, help="seconds per bucket")
    p.add_argument(
        "--budget-s",
        type=float,
        help="wall-clock budget of the whole sweep: buckets not started when it is spent are "
        "skipped (listed at the end); rows already finished are written",
    )
    p.add_argument("--seed", type=int, default=0, help="sampler and gate seed")
    p.add_argument("--l2-cold", action="store_true", help="rotate input copies (>= 3x L2/MALL)")
    p.add_argument("--rounds", type=int, help="interleaved re-measure rounds (5; 2 on CPU)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument(
        "--phases-from",
        type=Path,
        metavar="CSV",
        help="write one-pass / two-phase per sampled row from a benchmarks.sampled_local CSV "
        "(tuner/phases.py) into <out>/<arch>/sampled.json, then exit",
    )
    p.add_argument(
        "--exchange-from",
        type=Path,
        metavar="CSV",
        help="with --phases-from: charge two-phase steps at TP > 1 the second exchange's "
        "latency measured in a 2-GPU step CSV (benchmarks/results/<arch>/step_tp2.csv)",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bars (terminal) or progress lines with ETA (log file)",
    )
    p.add_argument(
        "--init-defaults",
        action="store_true",
        help='only write the portable untuned tables ("tuned": false) for --arch',
    )
    return p


def _report_lags(out_dir: Path, arch: str) -> None:
    """After writing tables next to an AOT report (``<out_dir>/<arch>/resources.json``): the
    report's ``launches`` -- every launch the tables select at other warps, compiled -- follow
    the tables only once the generator has run again; says so where they differ
    (``generator --check`` fails until then)."""
    from shardmax.generator.spills import launches_lag

    missing, extra = launches_lag(out_dir, arch)
    if missing or extra:
        print(
            f"note: {out_dir / arch / 'resources.json'} lacks {len(missing)} launches the new "
            f"tables select at other warps (and holds {len(extra)} they no longer do): run "
            f"`python -m shardmax.generator --arch all --out {out_dir}` (generator --check fails "
            "until then)"
        )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.budget_s is not None and not args.budget_s > 0:
        print(f"error: --budget-s must be > 0 seconds, got {args.budget_s}", file=sys.stderr)
        return 2
    import torch

    on_gpu = torch.cuda.is_available()
    from shardmax.runtime.dispatch import OPS, detect_arch

    from . import export

    out_dir: Path = args.out or export.packaged_generated_dir()
    if args.op == "all":
        ops: tuple[str, ...] = ("argmax", "verify") if args.distributed else OPS
    else:
        ops = (args.op,)
    if args.distributed and "sampled" in ops:
        print("error: --op sampled is tuned on one GPU (no --distributed)", file=sys.stderr)
        return 2
    if args.top_k_max is not None and not 0 <= args.top_k_max < 128:
        print(
            f"error: --top-k-max must be in [0, 127] (the largest C is 128), got {args.top_k_max}",
            file=sys.stderr,
        )
        return 2
    detected = detect_arch() if on_gpu else None
    arch = args.arch or detected or "sm90"
    if args.phases_from is not None:
        from .phases import write_phases

        print(f"wrote {write_phases(args.phases_from, out_dir, arch, args.exchange_from)}")
        _report_lags(out_dir, arch)
        return 0
    if args.init_defaults:
        for op in ops:
            print(f"wrote {export.write_portable(out_dir, arch, op)}")
        _report_lags(out_dir, arch)
        return 0
    # the sweep launches kernels: without a GPU in Triton's interpreter (the two table-only
    # jobs above run without it, so --phases-from can compile its phase-1 launches for the arch)
    if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        from shardmax.generator.console import rerun_with_interpreter

        rc = rerun_with_interpreter(__package__ or "tuner", argv)
        if rc is not None:
            return rc
    if detected is not None and args.arch and args.arch != detected:
        print(f"error: --arch {args.arch} but this GPU is {detected}", file=sys.stderr)
        return 2
    try:
        import optuna  # noqa: F401
    except ImportError:
        print(
            "error: the tuner needs optuna (pip install optuna; the GPU image carries wheels "
            "in .whl/: pip install --no-index --find-links .whl optuna)",
            file=sys.stderr,
        )
        return 2
    if not on_gpu:
        print(CPU_BANNER, flush=True)
    write = args.write if args.write is not None else on_gpu
    return _sweep(args, arch, ops, out_dir, on_gpu, write)


def _sweep(
    args: Any, arch: str, ops: tuple[str, ...], out_dir: Path, on_gpu: bool, write: bool
) -> int:
    import torch
    from shardmax.generator.space import ARCHES

    from . import export, study
    from .objective import BucketRunner, Dist, Lockstep, Runner, worker_loop
    from .problems import buckets
    from .sampled import SampledRunner
    from .space import DEFAULT_TOP_K_MAX, candidates, default_config, pruned_report
    from .timing import metric_name

    dist_ctx: Dist | None = None
    if args.distributed:
        import torch.distributed as tdist

        local = int(os.environ.get("LOCAL_RANK", "0"))
        if on_gpu:
            torch.cuda.set_device(local)
        device = torch.device("cuda", local) if on_gpu else torch.device("cpu")
        if on_gpu:
            tdist.init_process_group("nccl", device_id=device)
        else:
            tdist.init_process_group("gloo")
        dist_ctx = Dist(tdist.get_rank(), tdist.get_world_size(), device)
        tps: list[int] | None = [dist_ctx.world]
        mode = f"distributed tp={dist_ctx.world}"
    else:
        device = (
            torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        )
        tps = args.tp
        mode = (
            "single-gpu local stage (transport fixed to allgather; finish timed on tp "
            "copies of the keys; collective and plain path for tp > 1 not timed)"
        )
        if not on_gpu:
            mode = "cpu interpreter (meaningless timings)"
    root = dist_ctx is None or dist_ctx.is_root
    quick_space = args.space == "quick" if args.space else (args.quick or not on_gpu)
    # points at warps the AOT report does not hold are compiled for the arch and pruned where
    # they spill (tuner/space.py); a CPU run writes no table and keeps the report's verdicts
    compile_check = on_gpu and arch in ARCHES
    import time

    deadline = time.monotonic() + args.budget_s if args.budget_s is not None else None
    skipped: list[str] = []
    from .problems import QUICK_SAMPLED_TRIALS

    def trials_of(op: str) -> int | None:
        if args.n_trials is not None:
            return int(args.n_trials)
        if not on_gpu:
            return 3
        return QUICK_SAMPLED_TRIALS if op == "sampled" and args.quick else None

    rounds = args.rounds or (5 if on_gpu else 2)
    metric = metric_name(device, args.l2_cold)
    storage_desc = args.storage or str((args.studies_dir or study.default_studies_dir()) / arch)
    prov = export.provenance(
        arch=arch,
        device=device,
        mode=mode,
        metric=metric,
        quick=args.quick or not on_gpu,
        storage=storage_desc,
        space="quick" if quick_space else "full",
    )
    from shardmax.generator.console import format_us, progress

    plan = {
        op: buckets(
            op,
            quick=args.quick,
            tiny=not on_gpu,
            dtypes=args.dtype,
            tps=tps,
            vocabs=args.vocab,
            rows=args.rows,
        )
        for op in ops
    }
    bucket_bar = progress(
        sum(len(bs) for bs in plan.values()),
        f"[{arch}] buckets",
        enabled=root and not args.no_progress,
        every=1,
        leave=True,
    )
    for op, bs in plan.items():
        storage = study.make_storage(arch, op, args.storage, args.studies_dir) if root else None
        table_now = export.current_table(out_dir, arch, op) if root else None
        new_rows: list[dict[str, Any]] = []
        if root:
            print(f"[{arch} {op}] {len(bs)} buckets, mode: {mode}; metric: {metric}")
        for b in _ticking(bs, bucket_bar, op):
            if _out_of_budget(deadline, dist_ctx):
                skipped.append(b.slug)
                continue
            configs = candidates(
                b,
                arch,
                quick=quick_space,
                distributed=dist_ctx is not None,
                top_k_max=DEFAULT_TOP_K_MAX if args.top_k_max is None else args.top_k_max,
                compile_check=compile_check,
            )
            runner: BucketRunner
            if op == "sampled":
                runner = SampledRunner(b, device, cold=args.l2_cold)
            else:
                runner = Runner(b, device, dist=dist_ctx, cold=args.l2_cold)
            if not root:
                worker_loop(runner)
                continue
            notes = pruned_report(b, arch, quick=quick_space, compile_check=compile_check)
            print(
                f"  {b.slug} ({', '.join(b.models)}): {len(configs)} points"
                + (f"; pruned: {'; '.join(notes)}" if notes else ""),
                flush=True,
            )
            ls = Lockstep(runner)
            try:
                st = study.open_study(arch, b, configs, storage, args.seed, prov)
                inc = export.incumbent_of(table_now, b)
                if inc is not None and inc.is_sampled and inc not in configs:
                    inc = None  # e.g. a C the --top-k-max constraint excludes: never re-exported
                dflt = default_config(b)
                study.enqueue(st, configs, inc, dflt)
                study.run_bucket(
                    st,
                    ls,
                    configs,
                    seed=args.seed,
                    n_trials=trials_of(op),
                    timeout=args.timeout,
                    progress=not args.no_progress,
                )
                row = export.finalize_bucket(
                    st,
                    ls,
                    b,
                    incumbent=inc,
                    default=dflt,
                    configs=configs,
                    seed=args.seed,
                    rounds=rounds,
                )
            finally:
                ls.stop()
            if row is None:
                continue
            new_rows.append(row)
            print(
                f"    -> {row['variant']} {row['launch']} p50 {format_us(row['p50_us'])}"
                + (
                    f" (default {format_us(row['default_p50_us'])})"
                    if "default_p50_us" in row
                    else ""
                )
                + (f" (plain {format_us(row['plain_p50_us'])})" if "plain_p50_us" in row else ""),
                flush=True,
            )
            if write:
                export.write_table(out_dir, arch, op, new_rows, prov, tuned=on_gpu)
        if root and write and new_rows:
            path = export.table_path(out_dir, arch, op)
            print(f"[{arch} {op}] wrote {path}")
            if not args.no_plot:
                from .plot import plot_table

                png = plot_table(path)
                if png is not None:
                    print(f"[{arch} {op}] plot {png}")
        elif root and not write:
            print(f"[{arch} {op}] {len(new_rows)} rows NOT written (pass --write-table)")
    bucket_bar.close()
    if root and write:
        _report_lags(out_dir, arch)
    if root and skipped:
        print(f"budget spent: {len(skipped)} buckets not tuned: {' '.join(skipped)}")
    if dist_ctx is not None:
        import torch.distributed as tdist

        tdist.barrier()
        tdist.destroy_process_group()
    return 0


def _ticking(items: list[Any], bar: Any, op: str) -> Iterator[Any]:
    """Yield ``items``, counting each one on ``bar`` once its loop body is done."""
    for it in items:
        bar.set_postfix_str(f"{op} {getattr(it, 'slug', it)}")
        yield it
        bar.update(1)


def _out_of_budget(deadline: float | None, dist_ctx: Any) -> bool:
    """True once the sweep's budget is spent; rank 0 decides for every rank (broadcast)."""
    if deadline is None:
        return False
    import time

    over = time.monotonic() > deadline
    if dist_ctx is None:
        return over
    import torch.distributed as tdist

    flag = [over]
    tdist.broadcast_object_list(flag, src=0)
    return bool(flag[0])


if __name__ == "__main__":
    sys.exit(main())
