"""SAMPLED.md + sampled_local.png from a ``benchmarks.sampled_local`` CSV (issue 22's targets).

python -m benchmarks.sampled_local --plot benchmarks/results/sm90/sampled_local.csv
"""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path
from typing import Any

SHOWN = ("vllm_cols", "one_pass", "two_phase", "one_pass_strict", "two_phase_strict", "greedy")


def load(path: Path) -> list[dict[str, Any]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def _p50(rows: list[dict[str, Any]]) -> dict[tuple[int, int, str], float]:
    out = {}
    for r in rows:
        if not r["kernel"] and r["p50_us"]:
            out[(int(r["tp"]), int(r["rows"]), r["method"])] = float(r["p50_us"])
    return out


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
    out.append("## Exactness and determinism")
    out.append("")
    for (tp, n, m), (correct, note) in sorted(notes.items()):
        if correct or note:
            said = (
                f"{correct} unflagged requests differ from vLLM 0.33 (full V); " if correct else ""
            )
            out.append(f"- TP {tp}, {n} rows, {m}: {said}{note}")
    out.append("")
    out.append("## Targets (issue 22)")
    out.append("")
    for n in nrows:
        if (2, n, "two_phase") in p:
            a, b = p[(2, n, "two_phase")], p[(2, n, "vllm_cols")]
            out.append(f"- TP2 shard, {n} rows: shardmax two-phase {a:.1f} us <= vLLM on the same "
                       f"columns {b:.1f} us: {'PASS' if a <= b else 'FAIL'} ({a / b:.2f}x)")  # fmt: skip
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
