"""hist_splits.csv -> hist_splits.png: GPU us of one rank's top-p local stage (``topp_hist`` +
``topp_combine``) by splits per row, per block and request count. Run from the repository
root: ``python benchmarks/results/sm90/topp_hist_splits_small/plot.py``."""

import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).parent
with open(HERE / "hist_splits.csv") as f:
    rows = list(csv.DictReader(f))
fig, axes = plt.subplots(1, 3, figsize=(10, 3.4), sharey=False)
for ax, reqs in zip(axes, ("1", "2", "8"), strict=True):
    for block in ("4096", "2048"):
        pts = [r for r in rows if r["reqs"] == reqs and r["block"] == block]
        splits = [int(r["splits"]) for r in pts]
        us = [float(r["us_per_call"]) for r in pts]
        ax.plot(splits, us, marker="o", label=f"block {block}")
        for r in pts:
            if r["default"] == "1":
                ax.scatter([int(r["splits"])], [float(r["us_per_call"])], s=120,
                           facecolors="none", edgecolors="k")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_title(f"{reqs} request(s), {pts[0]['rows']} rows")
    ax.set_xlabel("splits per row")
    ax.set_ylim(bottom=0)
axes[0].set_ylabel("GPU us (graph replay)")
axes[0].legend(fontsize=8, title="circled: default", title_fontsize=8)
fig.suptitle("top-p local stage, V = 200064 bf16, H100, PDL off")
fig.tight_layout()
fig.savefig(HERE / "hist_splits.png", dpi=110)
