"""SAMPLED.md + sampled_local.png from a ``benchmarks.sampled_local`` CSV (issue 22's targets).

python -m benchmarks.sampled_local --plot benchmarks/results/sm90/sampled_local.csv
"""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path
from typing import Any

SHOWN = ("vllm_cols", "one_pass", "two_phase", "one_pass_strict", "two_phase_strict", "greedy",
         "greedy_rows")  # fmt: skip


def load(path: Path) -> list[dict[str, Any]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def _p50(rows: list[dict[str, Any]]) -> dict[tuple[int, int, str], float]:
    out = {}
    for r in rows:
        if not r["kernel"] and r["p50_us"]:
            out[(int(r["tp"]), int(r["rows"]), r["method"])] = float(r["p50_us"])
    return out


PDL_SUFFIX = "_nopdl"
PDL_SHOWN = ("two_phase", "greedy", "greedy_rows")


def pdl_section(p: dict[tuple[int, int, str], float]) -> list[str]:
    """The ``<m>_nopdl`` methods against ``<m>``: what programmatic dependent launch gains."""
    keys = sorted({(tp, n) for tp, n, m in p if m.endswith(PDL_SUFFIX)})
    if not keys:
        return []
    out = ["## Programmatic dependent launch (graph p50 us, without PDL -> with it)", ""]
    out.append("The same plans captured with PDL off (`shardmax.runtime.kernels.set_pdl(False)`) "
               "and on, same run; every output compared bit for bit (Exactness below).")  # fmt: skip
    out.append("")
    out.append("| TP | rows | " + " | ".join(PDL_SHOWN) + " |")
    out.append("|---|---" + "|---" * len(PDL_SHOWN) + "|")
    for tp, n in keys:
        cells = []
        for m in PDL_SHOWN:
            off, on = p.get((tp, n, m + PDL_SUFFIX)), p.get((tp, n, m))
            cells.append("" if off is None or on is None else
                         f"{off:.1f} -> {on:.1f} ({on - off:+.1f})")  # fmt: skip
        out.append(f"| {tp} | {n} | " + " | ".join(cells) + " |")
    out.append("")
    return out


SWEEP_PREFIX = "two_phase_p1_"
DRAW_PREFIX = "two_phase_d"


def summary(rows: list[dict[str, Any]]) -> str:
    p = _p50(rows)
    host = {(int(r["tp"]), int(r["rows"]), r["method"]): r["host_us"] for r in rows
            if not r["kernel"]}  # fmt: skip
    notes = {(int(r["tp"]), int(r["rows"]), r["method"]): (r["correct"], r["note"]) for r in rows
             if not r["kernel"]}  # fmt: skip
    tps = sorted({k[0] for k in p})
    nrows = sorted({k[1] for k in p})
    out = ["# One rank's sampled verification vs vLLM's own kernels on the same columns", ""]
    out.append("CUDA-graph p50 us per call (eager host us in brackets); `x vLLM` = the method / "
               "`vllm_cols` (vLLM 0.33's chain on the same number of columns).")  # fmt: skip
    out.append("")
    for tp in tps:
        out.append(f"## TP {tp}")
        out.append("")
        out.append("| rows | " + " | ".join(SHOWN) + " | two_phase x vLLM | one_pass / two_phase |")
        out.append("|---" * (len(SHOWN) + 3) + "|")
        for n in nrows:
            if (tp, n, "two_phase") not in p:
                continue
            cells = []
            for m in SHOWN:
                v = p.get((tp, n, m))
                cells.append("" if v is None else f"{v:.1f} [{host.get((tp, n, m)) or '-'}]")
            ratio = p[(tp, n, "two_phase")] / p[(tp, n, "vllm_cols")]
            gain = p[(tp, n, "one_pass")] / p[(tp, n, "two_phase")]
            out.append(f"| {n} | " + " | ".join(cells) + f" | {ratio:.2f} | {gain:.2f} |")
        out.append("")
    out += pdl_section(p)
    sweep: dict[tuple[int, int], list[tuple[float, str, str]]] = defaultdict(list)
    for (tp, n, m), (_, note) in notes.items():
        if m.startswith(SWEEP_PREFIX) and (tp, n, m) in p:
            sweep[(tp, n)].append((p[(tp, n, m)], m[len(SWEEP_PREFIX) :], note))
    if sweep:
        out.append("## Phase-1 launch sweep (two-phase step, graph p50 us)")
        out.append("")
        out.append("`b<block>_s<programs per row>_w<warps>`; `table` = the two-phase step with the "
                   "launch the table gave this run (`two_phase` above).")  # fmt: skip
        out.append("")
        out.append("| TP | rows | table | fastest | 2nd | 3rd | launches timed |")
        out.append("|---|---|---|---|---|---|---|")
        for (tp, n), runs in sorted(sweep.items()):
            best = sorted(runs)[:3]
            cells = [f"{name} {us:.1f}" for us, name, _ in best] + [""] * (3 - len(best))
            table = p.get((tp, n, "two_phase"))
            shown = "" if table is None else f"{table:.1f}"
            out.append(f"| {tp} | {n} | {shown} | " + " | ".join(cells) + f" | {len(runs)} |")
        out.append("")
    draws: dict[tuple[int, int], dict[int, float]] = defaultdict(dict)
    for (tp, n, m), us in p.items():
        if m.startswith(DRAW_PREFIX) and m[len(DRAW_PREFIX) :].isdigit():
            draws[(tp, n)][int(m[len(DRAW_PREFIX) :])] = us
    if draws:
        counts = sorted({d for v in draws.values() for d in v})
        out.append("## Draw programs per request (two-phase step, graph p50 us)")
        out.append("")
        out.append("`built-in` = the two-phase step with the draw kernel's built-in program count "
                   "(`two_phase` above); `d<N>` = N programs per drawing request.")  # fmt: skip
        out.append("")
        out.append("| TP | rows | built-in | " + " | ".join(f"d{d}" for d in counts) + " |")
        out.append("|---|---|---" + "|---" * len(counts) + "|")
        for (tp, n), by in sorted(draws.items()):
            cells = [f"{by[d]:.1f}" if d in by else "" for d in counts]
            table = p.get((tp, n, "two_phase"))
            shown = "" if table is None else f"{table:.1f}"
            out.append(f"| {tp} | {n} | {shown} | " + " | ".join(cells) + " |")
        out.append("")
    out.append("## Exactness and determinism")
    out.append("")
    for (tp, n, m), (correct, note) in sorted(notes.items()):
        if (correct or note) and not m.startswith((SWEEP_PREFIX, DRAW_PREFIX)):
            said = (
                f"{correct} unflagged requests differ from vLLM 0.33 (full V); " if correct else ""
            )
            out.append(f"- TP {tp}, {n} rows, {m}: {said}{note}")
    for (tp, n, m), (_, note) in sorted(notes.items()):
        if m.startswith(DRAW_PREFIX) and note and not note.startswith("agrees"):
            out.append(f"- TP {tp}, {n} rows, {m}: {note}")
    for (tp, n), runs in sorted(sweep.items()):
        bad = [name for _, name, note in runs if not note.startswith("agrees")]
        out.append(
            f"- TP {tp}, {n} rows, phase-1 sweep: {len(runs) - len(bad)} of {len(runs)} launches "
            "give two_phase's tokens and counts on every request neither run flagged"
            + (f"; DIFFER: {', '.join(bad)}" if bad else "")
        )
    out.append("")
    out.append("## Targets (issue 22)")
    out.append("")
    for n in nrows:
        if (2, n, "two_phase") in p:
            a, b = p[(2, n, "two_phase")], p[(2, n, "vllm_cols")]
            out.append(f"- TP2 shard, {n} rows: shardmax two-phase {a:.1f} us <= vLLM on the same "
                       f"columns {b:.1f} us: {'PASS' if a <= b else 'FAIL'} ({a / b:.2f}x)")  # fmt: skip
    for n in nrows:
        if (2, n, "greedy_rows") in p and (2, n, "greedy") in p:
            a, b = p[(2, n, "greedy_rows")], p[(2, n, "greedy")]
            out.append(f"- TP2 shard, {n} rows, every request greedy: sharded_verify's plan "
                       f"{a:.1f} us <= 1.5 x sharded_greedy_verify's {b:.1f} us: "
                       f"{'PASS' if a <= 1.5 * b else 'FAIL'} ({a / b:.2f}x)")  # fmt: skip
    out.append("")
    out.append("## Per-kernel GPU us per call (torch profile, eager)")
    out.append("")
    per: dict[tuple[int, int, str], list[str]] = defaultdict(list)
    for r in rows:
        if r["kernel"] and float(r["p50_us"] or 0) >= 0.5:
            per[(int(r["tp"]), int(r["rows"]), r["method"])].append(
                f"{r['kernel'][:48]} {float(r['p50_us']):.1f}"
            )
    for (tp, n, m), ks in sorted(per.items()):
        out.append(f"- TP {tp}, {n} rows, {m}: " + "; ".join(ks))
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = _p50(rows)
    tps = sorted({k[0] for k in p})
    fig, axes = plt.subplots(1, len(tps), figsize=(4.2 * len(tps), 3.8), squeeze=False)
    for ax, tp in zip(axes[0], tps, strict=True):
        for m in SHOWN:
            pts = sorted((n, v) for (t, n, mm), v in p.items() if t == tp and mm == m)
            if pts:
                ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", label=m)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"TP {tp}: one rank's shard")
        ax.set_xlabel("logits rows (K = 3)")
        ax.set_ylabel("GPU us per call (graph p50)")
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def report(csv_path: Path) -> None:
    rows = load(csv_path)
    plot(rows, csv_path.with_suffix(".png"))
    (csv_path.parent / "SAMPLED.md").write_text(summary(rows) + "\n")
    print(f"wrote {csv_path.with_suffix('.png')} and {csv_path.parent / 'SAMPLED.md'}")
