"""kernels_w*_run*.log (``benchmarks.engine --kernels`` on an H100, the split top-p search at 4
or 8 warps, four machine sessions) -> ab.csv and ab.png: GPU us per call of the eager
level-histogram path and of the folded top-p call, and of ``topp_replay`` inside them."""

import csv
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).parent
HEAD = re.compile(r"--- kernels: (shardmax-hist \(eager, unresolved\)|shardmax-hist\+fold) "
                  r"top_p rows=(\d+): ([\d.]+) us per call in (\d+) kernels")  # fmt: skip
REPLAY = re.compile(r"^\s+([\d.]+)\s+topp_replay_\w+")
PATHS = {"shardmax-hist (eager, unresolved)": "hist eager", "shardmax-hist+fold": "fold"}
rows_out: list[dict[str, object]] = []
for log in sorted(HERE.glob("kernels_w*_run*.log")):
    warps, run = log.stem.removeprefix("kernels_w").split("_run")
    cur: dict[str, object] | None = None
    for line in log.read_text().splitlines():
        if m := HEAD.match(line):
            cur = {"warps": int(warps), "run": int(run), "path": PATHS[m[1]], "rows": int(m[2]),
                   "total_us": float(m[3]), "kernels": int(m[4])}  # fmt: skip
            rows_out.append(cur)
        elif line.startswith("---"):
            cur = None
        elif cur is not None and (m := REPLAY.match(line)):
            cur["topp_replay_us"] = float(m[1])
cols = ["warps", "run", "path", "rows", "total_us", "kernels", "topp_replay_us"]
with open(HERE / "ab.csv", "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=cols)
    w.writeheader()
    w.writerows(rows_out)
fig, axes = plt.subplots(1, 2, figsize=(11, 4))
for ax, key in zip(axes, ("topp_replay_us", "total_us"), strict=True):
    for path, marker in (("hist eager", "o"), ("fold", "s")):
        for warps, color in ((4, "tab:red"), (8, "tab:blue")):
            sel = [r for r in rows_out if r["path"] == path and r["warps"] == warps]
            ax.scatter([r["rows"] for r in sel], [r[key] for r in sel], marker=marker,
                       color=color, label=f"{path}, {warps} warps")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("logits rows")
    ax.set_ylabel("GPU us per call")
    ax.set_title("topp_replay" if key == "topp_replay_us" else "whole call (all kernels)")
axes[1].legend(fontsize=8)
fig.suptitle("Split top-p search at 4 vs 8 warps, engine loop --kernels, one H100 (4 sessions)")
fig.tight_layout()
fig.savefig(HERE / "ab.png", dpi=90)
