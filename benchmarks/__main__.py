"""``shardmax-bench`` / ``python -m shardmax.benchmarks`` / ``python -m benchmarks`` (repo root).

Runs part 1 (local kernel, GPU 0) and/or part 2 (TP2 step, 2 processes on GPUs 0 and 1, NCCL),
then writes the PNGs and SUMMARY.md from the numbers measured in this run and prints a short
digest of them.

Where the results go: ``--out``, by default ``benchmarks/results/<arch>/`` (``sm90``, ``gfx950``:
the detected GPU). Without a GPU the benchmark refuses to run (exit code 2) unless
``--interpreter`` (or ``--smoke``, tiny shapes) asks for the Triton interpreter on CPU; that run
goes to ``benchmarks/results/interpreter/`` (git-ignored: its times are meaningless).
``benchmarks/results`` is the checkout's folder, or ``./benchmarks/results`` for an installed
package.

What is written, and when: every part measures into a fresh staging folder first. Only a run
in which every part that could run on this machine is complete (at least one case measured,
none failed, none cut by the time budget) copies its files (CSV, PNG, SUMMARY.md) into
``--out``; a failed or partial run leaves ``--out`` untouched, keeps its files in the staging
folder (printed) and exits 1. The exit code is 0 for a complete run, 1 when no case ran or a
case failed or the budget cut the plan, 2 for a refused run. If the environment variable
``OUT`` is set (the device tool's output folder), this run's files are copied there as well,
complete or not.

Time: the whole run keeps inside ``--budget-s`` (default 480 s of measurement; the local part
gets ``--local-share`` of it). Past its share a part skips its remaining shapes (noted in the
log), and step workers still running after the deadline are stopped.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .outcome import PartOutcome

ROWS_FULL = (1, 4, 16, 32, 96, 256, 512, 1024)
ROWS_QUICK = (4, 32, 96, 512)
VOCABS_FULL = (151936, 200064, 262144)
VOCABS_QUICK = (200064,)
TPS = (1, 2, 4, 8)
DTYPES = ("bf16", "fp32")
INTERPRETER_FOLDER = "interpreter"
"""Results folder of CPU runs (git-ignored)."""
RESULT_SUFFIXES = (".csv", ".png", ".md")
EXIT_REFUSED = 2


def results_root() -> Path:
    """``<checkout>/benchmarks/results`` when this package is the checkout's ``benchmarks/``
    folder (``python -m benchmarks``, an editable install), else ``./benchmarks/results``."""
    pkg = Path(__file__).resolve().parent
    if (pkg.parent / "pyproject.toml").is_file() and (pkg / "results").is_dir():
        return pkg / "results"
    return Path.cwd() / "benchmarks" / "results"


def _prog() -> str:
    try:
        from shardmax.generator.console import prog_name
    except ModuleNotFoundError:  # a checkout that was not pip-installed
        return "python -m benchmarks"
    return prog_name(__package__, "shardmax-bench")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=_prog(),
        description="shardmax benchmarks: local kernel (1 GPU) + whole TP2 step (2 GPUs). "
        "Writes CSV, PNG and SUMMARY.md to benchmarks/results/<arch>/ only from a complete "
        "run; on a machine without a GPU it runs only when asked for the interpreter.",
    )
    p.add_argument("--part", choices=("local", "step", "all"), default="all")
    p.add_argument("--quick", action="store_true", help="fewer rows/V (about 2-3 min)")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results folder (default: benchmarks/results/<detected arch>, or "
        f"benchmarks/results/{INTERPRETER_FOLDER} with --interpreter / --smoke)",
    )
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
        "--interpreter",
        action="store_true",
        help="run on CPU in the Triton interpreter (gloo for the step part): meaningless times, "
        "slow at the real shapes (use --smoke for a harness check)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="developer check of the harness on CPU (implies --interpreter): tiny shapes, "
        "meaningless times, a few minutes on 2 cores",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar / lines")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.budget_s <= 0:
        raise SystemExit("--budget-s must be > 0")
    if not 0.0 < args.local_share < 1.0:
        raise SystemExit("--local-share must be in (0, 1)")
    args.interpreter = args.interpreter or args.smoke
    return args


def plans(args: argparse.Namespace) -> tuple[object, object]:
    """(LocalPlan, StepPlan) for the arguments."""
    from .local import LocalPlan
    from .step import StepPlan

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


def result_files(folder: Path) -> list[Path]:
    """The result files of a folder (CSV, PNG, Markdown), sorted."""
    if not folder.is_dir():
        return []
    return sorted(f for f in folder.iterdir() if f.is_file() and f.suffix in RESULT_SUFFIXES)


def copy_to_env_out(out_dir: Path) -> Path | None:
    """Copy the result files (flat) to ``$OUT`` if it is set and is another folder."""
    env = os.environ.get("OUT")
    if not env:
        return None
    dest = Path(env)
    if dest.resolve() == out_dir.resolve():
        return None
    dest.mkdir(parents=True, exist_ok=True)
    for f in result_files(out_dir):
        shutil.copy2(f, dest / f.name)
    return dest


def publish(staging: Path, out_dir: Path) -> list[Path]:
    """Copy this run's result files from ``staging`` into ``out_dir``; returns the new paths.
    Files of ``out_dir`` that this run did not write are left as they are."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for f in result_files(staging):
        dest = out_dir / f.name
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.copy2(f, tmp)
        tmp.replace(dest)
        written.append(dest)
    return written


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    has_gpu = torch.cuda.is_available()
    if not has_gpu and not args.interpreter:
        print(
            "error: no GPU found. The benchmarks time CUDA/ROCm kernels; on this machine they "
            "can only run in the Triton interpreter, whose times mean nothing. Pass --smoke (a "
            "harness check on tiny shapes, a few minutes) or --interpreter (the chosen shapes "
            f"on CPU) to run it anyway; results then go to benchmarks/results/"
            f"{INTERPRETER_FOLDER}/ (git-ignored).",
            file=sys.stderr,
        )
        return EXIT_REFUSED
    if args.interpreter and os.environ.get("TRITON_INTERPRET") != "1":
        import subprocess

        # Triton must see the variable before it loads (a console script has already imported
        # shardmax, and with it Triton): run again with it set.
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
        cmd = [sys.executable, "-m", __package__ or "benchmarks"]
        return subprocess.call([*cmd, *(sys.argv[1:] if argv is None else argv)], env=env)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if args.interpreter:
        arch = INTERPRETER_FOLDER
    else:
        from shardmax.runtime.dispatch import detect_arch

        arch = detect_arch() or "unknown"
    out_dir: Path = args.out if args.out is not None else results_root() / arch
    return run(args, out_dir)


def run(args: argparse.Namespace, out_dir: Path) -> int:
    """Measure into a staging folder, report, publish if complete (see the module docstring)."""
    from . import report
    from .outcome import PartOutcome

    t0 = time.monotonic()
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    staging = Path(tempfile.mkdtemp(prefix="shardmax-bench-"))
    local_plan, step_plan = plans(args)
    do_local = args.part in ("local", "all")
    do_step = args.part in ("step", "all")
    local_budget = args.budget_s * (args.local_share if do_local and do_step else 1.0)
    device = _env_banner()
    outcomes: list[PartOutcome] = []
    if do_local:
        try:
            from .local import run_local

            outcomes.append(
                run_local(
                    local_plan,  # type: ignore[arg-type]
                    staging,
                    deadline=t0 + local_budget,
                    device="cpu" if args.interpreter else None,
                    show_progress=not args.no_progress,
                )
            )
        except Exception as e:  # the step part still runs
            print(f"[local] FAILED: {type(e).__name__}: {e}", flush=True)
            outcomes.append(PartOutcome("local", None, failed=[f"{type(e).__name__}: {e}"]))
        print(f"[local] finished after {time.monotonic() - t0:.0f} s", flush=True)
    if do_step:
        try:
            from .step import run_step

            outcomes.append(
                run_step(
                    step_plan,  # type: ignore[arg-type]
                    staging,
                    deadline=t0 + args.budget_s,
                    backend="gloo" if args.interpreter else "nccl",
                    show_progress=not args.no_progress,
                )
            )
        except Exception as e:
            print(f"[step] FAILED: {type(e).__name__}: {e}", flush=True)
            outcomes.append(PartOutcome("step", None, failed=[f"{type(e).__name__}: {e}"]))
        print(f"[step] finished after {time.monotonic() - t0:.0f} s", flush=True)

    ran = [o for o in outcomes if not o.unavailable]
    complete = bool(ran) and all(o.complete for o in ran)
    # only this run's CSVs are read: the staging folder started empty
    local_rows = report.read_csv(staging / "local.csv")
    step_rows = report.read_csv(staging / "step_tp2.csv")
    provenance = _provenance(started, device, outcomes, out_dir)
    try:
        report.generate(staging, provenance=provenance)
    except Exception as e:
        print(f"[report] FAILED: {type(e).__name__}: {e}", flush=True)
    dest = copy_to_env_out(staging)

    print(f"\ntotal {time.monotonic() - t0:.0f} s")
    for o in outcomes:
        print(o.describe())
    try:
        print(report.short_table(local_rows, step_rows))
    except Exception as e:
        print(f"[report] digest FAILED: {type(e).__name__}: {e}")
    if complete:
        written = publish(staging, out_dir)
        shutil.rmtree(staging, ignore_errors=True)
        print(f"results in {out_dir}: {', '.join(p.name for p in written)}")
        if dest:
            print(f"(copied to {dest})")
        sys.stdout.flush()
        return 0
    why = (
        "no case ran"
        if not any(o.measured for o in ran)
        else "a case failed"
        if any(o.failed for o in ran)
        else "the time budget cut the plan"
    )
    print(
        f"NOT written to {out_dir} ({why}; its files are unchanged). This run's files: "
        f"{staging}" + (f" (copied to {dest})" if dest else "")
    )
    sys.stdout.flush()
    return 1


def _provenance(started: str, device: str, outcomes: list[PartOutcome], out_dir: Path) -> str:
    """The SUMMARY's first paragraph: when, where, and which parts this run measured."""
    parts = {o.part: o for o in outcomes}
    files = {"local": "local.csv", "step": "step_tp2.csv"}
    have = [files[p] for p, o in parts.items() if o.measured]
    missing = [f for p, f in files.items() if p not in parts or not parts[p].measured]
    text = (
        f"Written by `python -m benchmarks` (started {started}, {device}) from the numbers it "
        f"measured: {', '.join(have) or 'none'}. Times are CUDA-graph replay medians (p50, "
        "microseconds per call); targets are evaluated as ratios of numbers from this run only."
    )
    if missing:
        text += (
            f" Not measured in this run: {', '.join(missing)} (a file of that name in "
            f"{out_dir.name}/ is from an earlier run and is not evaluated here)."
        )
    return text


def _env_banner() -> str:
    """Print and return one line about the software and the device."""
    try:
        import torch
        import triton

        dev = "CPU (Triton interpreter)"
        if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            n = torch.cuda.device_count()
            dev = f"{n} x {torch.cuda.get_device_name(0)}"
        line = f"torch {torch.__version__}, triton {triton.__version__}, {dev}"
        print(f"{line}, NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}", flush=True)
        return line
    except Exception as e:
        print(f"env banner failed: {e}")
        return "unknown device"


if __name__ == "__main__":
    raise SystemExit(main())
