"""kernels_*.log (``benchmarks.engine --kernels``) -> ab.csv and ab.png: the top-p kernels' GPU
us per call in the engine loop's eager level-histogram path, per kernel form and row count."""

import csv
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).parent
HEAD = re.compile(r"--- kernels: shardmax-hist \(eager, unresolved\) top_p rows=(\d+): ([\d.]+) us")
KERN = re.compile(r"^\s+([\d.]+)\s+(topp_replay|topp_combine|topp_hist)\w*")
rows_out = []
for log in sorted(HERE.glob("kernels_*.log")):
    form = log.stem.removeprefix("kernels_")
    cur = None
    for line in log.read_text().splitlines():
        if m := HEAD.match(line):
            cur = {"form": form, "rows": int(m[1]), "total_us": float(m[2])}
            rows_out.append(cur)
        elif line.startswith("---"):
            cur = None
        elif cur is not None and (m := KERN.match(line)):
            cur[m[2] + "_us"] = float(m[1])
cols = ["form", "rows", "total_us", "topp_hist_us", "topp_combine_us", "topp_replay_us"]
with open(HERE / "ab.csv", "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=cols)
    w.writeheader()
    w.writerows(rows_out)
fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
for ax, rows in zip(axes, (4, 32), strict=True):
    sel = [r for r in rows_out if r["rows"] == rows]
    names = [r["form"] for r in sel]
    bottom = [0.0] * len(sel)
    for k in ("topp_hist_us", "topp_combine_us", "topp_replay_us"):
        vals = [r.get(k, 0.0) for r in sel]
        ax.barh(names, vals, left=bottom, label=k.removesuffix("_us"))
        bottom = [a + b for a, b in zip(bottom, vals, strict=True)]
    ax.set_title(f"{rows} rows: top-p kernels, GPU us per call")
axes[0].legend(loc="lower right")
fig.tight_layout()
fig.savefig(HERE / "ab.png", dpi=90)
