"""gate_host.png from gate_host.csv (this folder): us of gate work per step, before / after."""

import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

here = Path(__file__).parent
with open(here / "gate_host.csv") as f:
    rows = list(csv.DictReader(f))
mixes = sorted({r["mix"] for r in rows})
fig, axes = plt.subplots(1, len(mixes), figsize=(4.2 * len(mixes), 3.4), sharey=True)
for ax, mix in zip(axes, mixes, strict=True):
    for label in dict.fromkeys(r["label"] for r in rows):
        pts = sorted(
            (int(r["reqs"]), float(r["us_per_step"]))
            for r in rows
            if r["mix"] == mix and r["label"] == label
        )
        ax.plot([n for n, _ in pts], [u for _, u in pts], marker="o", label=label)
    ax.set_title(f"{mix} step (vLLM {rows[0]['vllm']}, CPU)")
    ax.set_xlabel("requests")
    ax.set_ylim(bottom=0)
axes[0].set_ylabel("gate host us per step (min of 7)")
axes[0].legend()
fig.tight_layout()
fig.savefig(here / "gate_host.png", dpi=110)
