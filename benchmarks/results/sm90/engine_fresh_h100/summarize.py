"""The engine loop's CSVs of this folder (``benchmarks.engine`` on one H100, one machine session
for ``fresh8`` + ``replayed_top_p``, another for ``small_rows/run1`` + ``run2``) -> plugin.csv
and plugin.png: per run, traffic mix and row count, the plug-in's call (``plugin_path``; at
T = 1 the opt-in fold, its default there being vLLM's own chain) against vLLM 0.33's chain in
the same run: host us per call (mean) and tokens/s. Run from the repository root:
``python benchmarks/results/sm90/engine_fresh_h100/summarize.py``."""

import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from benchmarks.engine import load_csv, plugin_path

HERE = Path(__file__).parent
RUNS = {"fresh8": "8 fresh batches", "replayed_top_p": "1 batch, replayed",
        "small_rows/run1": "small rows, 8 fresh (run 1)",
        "small_rows/run2": "small rows, 8 fresh (run 2)"}  # fmt: skip
out: list[dict[str, object]] = []
for run, label in RUNS.items():
    rows = load_csv(HERE / run / "engine.csv")
    by = {(r["mix"], int(r["rows"]), r["path"]): r for r in rows}
    for mix, n in dict.fromkeys((k[0], k[1]) for k in by):
        path = plugin_path(mix, n, 1, {k[2] for k in by if k[:2] == (mix, n)})
        ours, vllm = by.get((mix, n, path or "")), by.get((mix, n, "vllm"))
        if ours is None or vllm is None:
            continue
        out.append({
            "run": run, "traffic": label, "mix": mix, "rows": n, "path": path,
            "host_us": round(float(ours["host_us_mean"]), 1),
            "vllm_host_us": round(float(vllm["host_us_mean"]), 1),
            "gpu_us_loop": round(float(ours["gpu_us_loop"]), 1),
            "vllm_gpu_us_loop": round(float(vllm["gpu_us_loop"]), 1),
            "tokens_per_s": round(float(ours["tokens_per_s"])),
            "vllm_tokens_per_s": round(float(vllm["tokens_per_s"])),
            "vs_vllm_pct": round(100 * (float(ours["tokens_per_s"]) / float(vllm["tokens_per_s"]) - 1), 1),
        })  # fmt: skip
with open(HERE / "plugin.csv", "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(out[0]))
    w.writeheader()
    w.writerows(out)
fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
for (run, label), marker in zip(RUNS.items(), "osv^", strict=True):
    for mix, color in (
        ("greedy", "tab:green"),
        ("temperature", "tab:orange"),
        ("top_p", "tab:blue"),
    ):
        pts = [r for r in out if r["run"] == run and r["mix"] == mix]
        if not pts:
            continue
        xs = [r["rows"] for r in pts]
        axes[0].plot(xs, [r["vs_vllm_pct"] for r in pts], marker=marker, color=color,
                     label=f"{mix}: {label}")  # fmt: skip
        axes[1].plot(xs, [r["host_us"] for r in pts], marker=marker, color=color)
axes[0].axhline(0, color="black", lw=0.8)
axes[0].set(xscale="log", xlabel="logits rows", ylabel="tokens/s vs vLLM's chain, %",
            title="plug-in's call vs vLLM 0.33 (same run)")  # fmt: skip
axes[1].axhline(50, color="tab:green", ls=":", lw=0.8)
axes[1].axhline(100, color="tab:blue", ls=":", lw=0.8)
axes[1].set(xscale="log", yscale="log", xlabel="logits rows", ylabel="host us per call (mean)",
            title="host time (dotted: issue 19's 50 / 100 us)")  # fmt: skip
axes[0].legend(fontsize=7)
fig.suptitle("Engine loop, H100, V = 200064 bf16, TP 1, K = 3, realistic traffic", fontsize=10)
fig.tight_layout()
fig.savefig(HERE / "plugin.png", dpi=110)
for r in out:
    print(f"{r['run']:16} {r['mix']:11} {r['rows']:4} {r['path']:19} host {r['host_us']:6.1f} "
          f"(vLLM {r['vllm_host_us']:7.1f})  GPU {r['gpu_us_loop']:7.1f} (vLLM "
          f"{r['vllm_gpu_us_loop']:7.1f})  {r['vs_vllm_pct']:+6.1f} %")  # fmt: skip
