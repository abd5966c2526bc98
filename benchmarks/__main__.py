"""``python -m benchmarks [--part local|step|all] [--quick] [--out DIR]`` (from the repo root).

Runs part 1 (local kernel, GPU 0) and/or part 2 (TP2 step, 2 processes on GPUs 0 and 1, NCCL),
then writes the PNGs and SUMMARY.md from the CSVs and prints a short digest. Everything goes
to ``--out`` (default ``benchmarks/results/sm90``); if the environment variable ``OUT`` is set
(the device tool's output folder), the files are copied there as well.

Time: the whole run keeps inside ``--budget-s`` (default 480 s of measurement; the local part
gets ``--local-share`` of it). Past its share a part skips its remaining shapes (noted in the
log), and step workers still running after the deadline are stopped; rows already measured are
kept, because every CSV row is written and flushed as soon as it is measured.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

DEFAULT_OUT = Path("benchmarks/results/sm90")

ROWS_FULL = (1, 4, 16, 32, 96, 256, 512, 1024)
ROWS_QUICK = (4, 32, 96, 512)
VOCABS_FULL = (151936, 200064, 262144)
VOCABS_QUICK = (200064,)
TPS = (1, 2, 4, 8)
DTYPES = ("bf16", "fp32")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="shardmax benchmarks: local kernel (1 GPU) + whole TP2 step (2 GPUs)",
    )
    p.add_argument("--part", choices=("local", "step", "all"), default="all")
    p.add_argument("--quick", action="store_true", help="fewer rows/V (about 2-3 min)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT}")
    p.add_argument(
        "--budget-s", type=float, default=480.0, help="measurement time budget (default 480)"
    )
    p.add_argument(
        "--local-share",
        type=float,
        default=0.55,
        help="fraction of the budget for the local part when --part all (default 0.55)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="developer check of the harness on CPU (Triton interpreter, gloo): tiny shapes, "
        "meaningless times",
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.budget_s <= 0:
        raise SystemExit("--budget-s must be > 0")
    if not 0.0 < args.local_share < 1.0:
        raise SystemExit("--local-share must be in (0, 1)")
    return args


def plans(args: argparse.Namespace) -> tuple[object, object]:
    """(LocalPlan, StepPlan) for the arguments."""
    from benchmarks.local import LocalPlan
    from benchmarks.step import StepPlan

    if args.smoke:
        return (
            LocalPlan(dtypes=("bf16",), vocabs=(4096,), tps=(1, 2), rows=(2,)),
            StepPlan(dtypes=("fp32",), rows=(4,), vocab=4096),
        )
    if args.quick:
        return (
            LocalPlan(dtypes=DTYPES, vocabs=VOCABS_QUICK, tps=TPS, rows=ROWS_QUICK),
            StepPlan(dtypes=DTYPES, rows=ROWS_QUICK),
        )
    return (
        LocalPlan(dtypes=DTYPES, vocabs=VOCABS_FULL, tps=TPS, rows=ROWS_FULL),
        StepPlan(dtypes=DTYPES, rows=ROWS_FULL),
    )


def copy_to_env_out(out_dir: Path) -> Path | None:
    """Copy the result files (flat) to ``$OUT`` if it is set and is another folder."""
    env = os.environ.get("OUT")
    if not env:
        return None
    dest = Path(env)
    if dest.resolve() == out_dir.resolve():
        return None
    dest.mkdir(parents=True, exist_ok=True)
    for f in sorted(out_dir.iterdir()):
        if f.is_file() and f.suffix in (".csv", ".png", ".md", ".log"):
            shutil.copy2(f, dest / f.name)
    return dest


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    out_dir: Path = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    local_plan, step_plan = plans(args)
    do_local = args.part in ("local", "all")
    do_step = args.part in ("step", "all")
    local_budget = args.budget_s * (args.local_share if do_local and do_step else 1.0)

    _env_banner()
    if do_local:
        try:
            from benchmarks.local import run_local

            run_local(
                local_plan,  # type: ignore[arg-type]
                out_dir,
                deadline=t0 + local_budget,
                device="cpu" if args.smoke else None,
            )
        except Exception as e:  # the step part still runs
            print(f"[local] FAILED: {type(e).__name__}: {e}", flush=True)
        print(f"[local] finished after {time.monotonic() - t0:.0f} s", flush=True)
    if do_step:
        try:
            from benchmarks.step import run_step

            run_step(
                step_plan,  # type: ignore[arg-type]
                out_dir,
                deadline=t0 + args.budget_s,
                backend="gloo" if args.smoke else "nccl",
            )
        except Exception as e:
            print(f"[step] FAILED: {type(e).__name__}: {e}", flush=True)
        print(f"[step] finished after {time.monotonic() - t0:.0f} s", flush=True)

    from benchmarks import report

    try:
        report.generate(out_dir)
    except Exception as e:
        print(f"[report] FAILED: {type(e).__name__}: {e}", flush=True)
    dest = copy_to_env_out(out_dir)
    print(f"\nresults in {out_dir}" + (f" (copied to {dest})" if dest else ""))
    print(f"total {time.monotonic() - t0:.0f} s")
    try:
        print(report.short_table(report.read_csv(out_dir / "local.csv"),
                                 report.read_csv(out_dir / "step_tp2.csv")))  # fmt: skip
    except Exception as e:
        print(f"[report] digest FAILED: {type(e).__name__}: {e}")
    sys.stdout.flush()
    return 0


def _env_banner() -> None:
    try:
        import torch
        import triton

        dev = "cpu"
        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            dev = f"{n} x {torch.cuda.get_device_name(0)}"
        print(
            f"torch {torch.__version__}, triton {triton.__version__}, {dev}, "
            f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}",
            flush=True,
        )
    except Exception as e:
        print(f"env banner failed: {e}")


if __name__ == "__main__":
    raise SystemExit(main())
