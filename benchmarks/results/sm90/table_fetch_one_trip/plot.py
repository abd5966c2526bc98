"""fetch_ab.csv -> fetch_ab.png: GPU us per ``table_fetch`` under graph replay, before and after
the one-trip change, by table size. Run from the repository root:
``python benchmarks/results/sm90/table_fetch_one_trip/plot.py``."""

import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).parent
with open(HERE / "fetch_ab.csv") as f:
    rows = list(csv.DictReader(f))
fig, ax = plt.subplots(figsize=(6, 3.6))
labels = {
    "old": "loop of 64-word steps + request load (2c14e7f)",
    "new": "one load below 256 words",
}
for tag, label in labels.items():
    pts = [r for r in rows if r["variant"] == tag]
    sizes = [int(r["n"]) for r in pts]
    us = [float(r["us_per_fetch(min of 3 rounds)"]) for r in pts]
    ax.plot(sizes, us, marker="o", label=label)
ax.set_xlabel("table entries (int64 words)")
ax.set_ylabel("GPU us per fetch (graph replay)")
ax.set_ylim(bottom=0)
ax.set_title("table_fetch, H100, PDL off")
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(HERE / "fetch_ab.png", dpi=120)
