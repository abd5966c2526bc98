"""combine_warps.png from combine_warps.csv (this folder): us per topp_combine launch by
(PARTS, warps) for each (rows, splits)."""

import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

here = Path(__file__).parent
with open(here / "combine_warps.csv") as f:
    rows = list(csv.DictReader(f))
cases = sorted({(int(r["rows"]), int(r["splits"])) for r in rows})
fig, axes = plt.subplots(1, len(cases), figsize=(3.2 * len(cases), 3.4), sharey=False)
for ax, (n, sp) in zip(axes, cases, strict=True):
    sel = [r for r in rows if int(r["rows"]) == n and int(r["splits"]) == sp]
    for parts in sorted({int(r["parts"]) for r in sel}):
        pts = sorted(
            (int(r["warps"]), float(r["us_per_call"])) for r in sel if int(r["parts"]) == parts
        )
        ax.plot([w for w, _ in pts], [u for _, u in pts], marker="o", label=f"PARTS {parts}")
    d = [r for r in sel if r["default"] == "1"]
    if d:
        ax.scatter(
            [int(d[0]["warps"])],
            [float(d[0]["us_per_call"])],
            s=120,
            facecolors="none",
            edgecolors="k",
            label="default before",
        )
    ax.set_xscale("log", base=2)
    ax.set_title(f"{n} rows, {sp} splits", fontsize=9)
    ax.set_xlabel("warps")
axes[0].set_ylabel("us per launch (graph replay, PDL off)")
axes[-1].legend(fontsize=7)
fig.suptitle("topp_combine by PARTS and warps (H100, V = 200064 bf16)", fontsize=10)
fig.tight_layout()
fig.savefig(here / "combine_warps.png", dpi=110)
