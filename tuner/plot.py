"""One PNG per table (``generated/<arch>/<op>.png``): time per bucket, winner vs built-in
default vs plain path, log-scale rows axis. matplotlib is optional (returns None without it)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any


def plot_table(table_path: Path, png: Path | None = None) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    table: dict[str, Any] = json.loads(Path(table_path).read_text())
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for row in table["rows"]:
        m = row["match"]
        if "rows_le" in m and "p50_us" in row:
            groups[(m.get("dtype"), m.get("tp"), m.get("width_le"))].append(row)
    if not groups:
        return None
    tps = sorted({k[1] for k in groups}, key=lambda t: (t is None, t))
    fig, axes = plt.subplots(1, len(tps), figsize=(5.5 * len(tps), 4.2), squeeze=False)
    for ax, tp in zip(axes[0], tps, strict=True):
        for i, (key, rows) in enumerate(sorted((k, v) for k, v in groups.items() if k[1] == tp)):
            rows = sorted(rows, key=lambda r: r["match"]["rows_le"])
            x = [r["match"]["rows_le"] for r in rows]
            color = f"C{i % 10}"
            label = f"{key[0]} W={key[2]}"
            ax.plot(x, [r["p50_us"] for r in rows], "-o", color=color, ms=3, label=f"{label} tuned")
            d = [
                (xx, r["default_p50_us"])
                for xx, r in zip(x, rows, strict=True)
                if "default_p50_us" in r
            ]
            if d:
                ax.plot(
                    *zip(*d, strict=True), "--", color=color, alpha=0.7, label=f"{label} default"
                )
            pl = [
                (xx, r["plain_p50_us"])
                for xx, r in zip(x, rows, strict=True)
                if "plain_p50_us" in r
            ]
            if pl:
                ax.plot(*zip(*pl, strict=True), ":", color=color, alpha=0.7, label=f"{label} plain")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("rows (tokens per step, bucket upper edge)")
        ax.set_ylabel("p50 us")
        ax.set_title(f"{table['arch']} {table['op']} tp={tp}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    prov = table.get("provenance", {})
    fig.suptitle(
        f"{prov.get('device_name', '')} | {prov.get('metric', '')} | {prov.get('mode', '')[:60]}",
        fontsize=8,
    )
    fig.tight_layout()
    out = png or Path(table_path).with_suffix(".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
