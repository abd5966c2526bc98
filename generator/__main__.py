"""Command line: render templates -> generated/, optionally AOT-compile for sm90 / gfx950.

python -m generator                 render (write-if-different) into generated/
python -m generator --check         exit 1 if generated/ is stale (renders in memory)
python -m generator --arch all      also compile every variant for sm90 and gfx950 and
                                    write generated/<arch>/resources.json
python -m generator --check --arch all   CI: stale check + compile check (the committed
                                    resources.json == a fresh compile by the same Triton, and no
                                    new register spill in a launch a table can select: the
                                    variant at the warps the table names)

The same command is `shardmax-generate` (console script) or `python -m shardmax.generator`
from any directory once shardmax is installed; `python -m generator` works from the
repository root. The AOT compile (a few minutes on 2 CPU cores) shows its progress.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .aot import compile_all, launch_resources
from .console import prog_name, progress
from .render import generated_dir, render_all, stale_files, write_all
from .space import ARCHES
from .spills import extra_launches, launch_name, launches_lag, spill_report


def stale_resources(out: Path, variants: list[str]) -> list[str]:
    """Arches whose ``resources.json`` (the AOT report the tuner prunes with) does not list
    exactly these variants, or exactly the launches the arch's tables select at other warps
    (``"sm90: 3 missing, 0 extra"``, ``"sm90 launches: 2 missing, 0 extra"``)."""
    problems = []
    for arch in ARCHES:
        path = out / arch / "resources.json"
        have = set(json.loads(path.read_text()).get("variants", {})) if path.exists() else set()
        missing, extra = set(variants) - have, have - set(variants)
        if missing or extra:
            problems.append(f"{arch}: {len(missing)} missing, {len(extra)} extra")
            continue
        lag, stray = launches_lag(out, arch)
        if lag or stray:
            problems.append(f"{arch} launches: {len(lag)} missing, {len(stray)} extra")
    return problems


def resource_drift(committed: dict, compiled: dict) -> list[str]:
    """Variants whose committed AOT report differs from a fresh compile (``"name: registers
    46 -> 44"``), when both come from the same Triton version (else nothing to compare: another
    compiler may allocate differently, and the report is not pinned to one)."""
    if committed.get("triton_version") != compiled.get("triton_version"):
        return []
    out = []
    old = {**committed.get("variants", {}), **committed.get("launches", {})}
    new = {**compiled.get("variants", {}), **compiled.get("launches", {})}
    for name in sorted(set(old) & set(new)):
        diffs = [
            f"{k} {old[name].get(k)} -> {v}" for k, v in new[name].items() if old[name].get(k) != v
        ]
        if diffs:
            out.append(f"{name}: {', '.join(diffs)}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog=prog_name(__package__, "shardmax-generate"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--arch",
        choices=[*ARCHES, "all", "none"],
        default="none",
        help="AOT-compile every variant for this GPU arch (no GPU needed)",
    )
    ap.add_argument(
        "--check",
        action="store_true",
        help="do not write; exit 1 if generated/ differs from the templates",
    )
    ap.add_argument("--out", type=Path, default=None, help="output dir (default: generated/)")
    ap.add_argument(
        "--no-progress", action="store_true", help="no progress bar / lines during the compile"
    )
    args = ap.parse_args(argv)
    if args.arch != "none" and os.environ.get("TRITON_INTERPRET") == "1":
        # Ahead-of-time compilation needs real @jit functions; under the interpreter Triton
        # hands out interpreted ones. Run again in a child without the variable.
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        cmd = [sys.executable, "-m", __package__ or "generator", *(argv or sys.argv[1:])]
        return subprocess.call(cmd, env=env)

    out = args.out or generated_dir()
    files = render_all()
    names = [json_name for json_name in files if json_name.endswith(".py")]
    if args.check:
        stale = stale_files(out, files)
        if stale:
            print(
                f"generated/ is stale ({len(stale)} files): {', '.join(stale[:8])}"
                f"{' ...' if len(stale) > 8 else ''}\nrun: python -m generator",
                file=sys.stderr,
            )
            return 1
        missing = stale_resources(out, [n[:-3] for n in names])
        if missing:
            print(f"generated/<arch>/resources.json is stale: {missing}\nrun: python -m "
                  "generator --arch all", file=sys.stderr)  # fmt: skip
            return 1
        print(f"generated/ is up to date ({len(names)} variants)")
    else:
        changed = write_all(out, files)
        print(f"rendered {len(names)} variants into {out}: {len(changed)} changed")
        for c in changed:
            print(f"  {c}")

    arches = list(ARCHES) if args.arch == "all" else ([] if args.arch == "none" else [args.arch])
    stale_report = False
    if arches:
        t0 = time.time()
        variants = [n[:-3] for n in names]
        with progress(
            len(variants) * len(arches),
            f"AOT compile ({' + '.join(arches)})",
            enabled=not args.no_progress,
            min_interval=15.0,
        ) as bar:

            def tick(arch: str, name: str) -> None:
                bar.set_postfix_str(f"{arch} {name}")
                bar.update(1)

            records = compile_all(out, variants, arches, on_compiled=tick)
        for arch, rec in records.items():
            per = rec["variants"]
            rec["launches"] = {
                launch_name(x, int(per[x.variant]["num_warps"])): launch_resources(
                    str(out), arch, x.variant, x.num_warps, x.config
                )
                for x in extra_launches(out, arch, per)
            }
            spilling = [n for n, r in rec["variants"].items() if r["spill_bytes"] > 0]
            print(
                f"{arch}: compiled {len(rec['variants'])} variants and {len(rec['launches'])} "
                f"launches the tables select at other warps, with Triton {rec['triton_version']}; "
                f"variants spilling at their nominal warps: {spilling or 'none'}"
            )
            path = out / arch / "resources.json"
            new, gone = spill_report(out, arch, rec)
            if gone:
                print(f"{arch}: no longer spilling (drop from generator/spills.py KNOWN_SPILLS): "
                      f"{gone}")  # fmt: skip
            if new:
                print(f"{arch}: new register spills in launches a table can select: {new}\n"
                      "fix the template or the table (or list it, with the reason, in "
                      "generator/spills.py KNOWN_SPILLS)", file=sys.stderr)  # fmt: skip
                stale_report = stale_report or args.check
            if args.check:
                committed = json.loads(path.read_text()) if path.exists() else {}
                drift = resource_drift(committed, rec)
                if committed.get("triton_version") != rec["triton_version"]:
                    print(f"{arch}: resources.json was written with Triton "
                          f"{committed.get('triton_version')}, not compared")  # fmt: skip
                if drift:
                    print(f"generated/{arch}/resources.json is stale: {drift[:4]}"
                          f"{' ...' if len(drift) > 4 else ''}\nrun: python -m generator --arch "
                          "all", file=sys.stderr)  # fmt: skip
                    stale_report = True
            else:
                path.parent.mkdir(exist_ok=True)
                text = json.dumps(rec, indent=1, sort_keys=True) + "\n"
                if not path.exists() or path.read_text() != text:
                    path.write_text(text)
        print(f"compile time {time.time() - t0:.1f}s")
    return 1 if stale_report else 0


if __name__ == "__main__":
    sys.exit(main())
