"""Where sharded top-p pays: the guard's pass rate vs row entropy, p, temperature and C.

``python -m benchmarks.nucleus_study [--out DIR] [--vocab V] [--rows N]`` (CPU, plain torch, a
minute or so) writes ``nucleus.csv``, ``nucleus.png`` and ``NUCLEUS.md``.

Rows are synthetic next-token distributions ``x_v = -alpha * log(rank_v)`` (Zipf-like, the shape of
LLM next-token distributions) plus small noise, ids shuffled, with ``alpha`` solved per row so
that the row's entropy at T = 1 hits a target in {0.01 .. 5} nats. Each row is cut into vLLM's
TP shards (V = 151936, TP 2), every rank keeps its top-C values, and
:func:`shardmax.reference.nucleus.nucleus_guard` decides (monolithic pipeline: a step of more than
64 logits rows; split pipeline: 64 or fewer). The pass rate is the fraction of rows the sharded
finish could verify without falling back.

Entropy weights for a traffic-level estimate come from the only published per-token entropy
measurement found for a current open model: Wang et al. 2025, "Beyond the 80/20 Rule"
(arXiv:2506.01939), Qwen3-8B chain-of-thought tokens -- more than half of the tokens have
near-zero entropy and the 80th percentile is 0.672 nats. The weighting used: 50 % of rows at
0.01 nats, 30 % spread over 0.03-0.67 nats, 20 % over 0.67-5 nats (log-uniform inside each
band). That is a reasoning-model measurement at the model's own sampling settings; chat traffic
at T = 1.0 is likely more diffuse, so the weighted number is an optimistic bound, and the
per-entropy curves are the result to read.
"""

from __future__ import annotations

import argparse
import csv
import math
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from shardmax.reference.nucleus import (
    GuardReason,
    exact_nucleus_keep,
    nucleus_guard,
    split_pipeline_model_keep,
)
from shardmax.testing.shards import vllm_shard_ranges

ENTROPIES = (0.01, 0.03, 0.1, 0.3, 0.67, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0)
TOP_PS = (0.8, 0.9, 0.95, 0.99)
TEMPS = (0.7, 1.0)
CS = (16, 32, 64, 128, 256)
PIPELINES = (("monolithic", 100), ("split", 8))
FIELDS = ["entropy_target", "entropy", "temperature", "top_p", "c", "pipeline", "rows",
          "passed", "pass_rate", "median_nucleus", "reasons", "model_differs",
          "passed_model_differs"]  # fmt: skip


def entropy_weights() -> dict[float, float]:
    """Weight of each target entropy (see the module docstring for the source)."""
    low = [h for h in ENTROPIES if h <= 0.01]
    mid = [h for h in ENTROPIES if 0.01 < h <= 0.67]
    high = [h for h in ENTROPIES if h > 0.67]
    w = {h: 0.5 / len(low) for h in low}
    w.update({h: 0.3 / len(mid) for h in mid})
    w.update({h: 0.2 / len(high) for h in high})
    return w


def _entropy(x: torch.Tensor) -> float:
    lp = torch.log_softmax(x.to(torch.float64), 0)
    return float(-(lp.exp() * lp).sum())


def zipf_row(vocab: int, target: float, gen: torch.Generator) -> torch.Tensor:
    """fp32 ``[vocab]`` logits with entropy ``target`` nats at T = 1 (bisection on alpha)."""
    base = -torch.log(torch.arange(1, vocab + 1, dtype=torch.float64))
    noise = 0.05 * torch.randn(vocab, generator=gen, dtype=torch.float64)
    lo, hi = 0.0, 200.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if _entropy(mid * base + noise) > target:
            lo = mid
        else:
            hi = mid
    x = (0.5 * (lo + hi)) * base + noise
    return x[torch.randperm(vocab, generator=gen)].to(torch.float32)


def _rank_tops(x: torch.Tensor, ranges: list[tuple[int, int, int]], c: int) -> list[Any]:
    out = []
    for start, n, _ in ranges:
        part = x[start : start + n]
        order = torch.sort(part, descending=True, stable=True).indices[:c]
        out.append((part[order], order.to(torch.int64) + start))
    return out


def run(vocab: int = 151936, tp: int = 2, rows: int = 12, seed: int = 0) -> list[dict[str, Any]]:
    """Every (entropy, T, p, C, pipeline) cell; see the module docstring."""
    gen = torch.Generator().manual_seed(seed)
    ranges = vllm_shard_ranges(vocab, tp, 64)
    out: list[dict[str, Any]] = []
    for h in ENTROPIES:
        base_rows = [zipf_row(vocab, h, gen) for _ in range(rows)]
        for t in TEMPS:
            xs = [r / t for r in base_rows]
            ent = sum(_entropy(x) for x in xs) / len(xs)
            tops = [_rank_tops(x, ranges, max(CS)) for x in xs]
            lses = [float(torch.logsumexp(x.to(torch.float64), 0)) for x in xs]
            for p in TOP_PS:
                exact = [exact_nucleus_keep(x[None], torch.tensor([p]))[0] for x in xs]
                sizes = [int(e.sum()) for e in exact]
                # the split pipeline's search (modelled) lands on another set on these rows
                differs = [not torch.equal(split_pipeline_model_keep(x, p)[0], e)
                           for x, e in zip(xs, exact, strict=True)]  # fmt: skip
                for c in CS:
                    for name, steps in PIPELINES:
                        reasons: Counter[str] = Counter()
                        missed = 0
                        for x, top, lse, dif in zip(xs, tops, lses, differs, strict=True):
                            cands = [(v[:c], i[:c]) for v, i in top]
                            d = nucleus_guard(cands, lse, float(x.max()), float(x.min()), p,
                                              rows_in_step=steps)  # fmt: skip
                            reasons[GuardReason(d.reason).name] += 1
                            missed += bool(d) and dif
                        ok = reasons.get("OK", 0)
                        split = name == "split"
                        out.append({
                            "entropy_target": h, "entropy": round(ent, 4), "temperature": t,
                            "top_p": p, "c": c, "pipeline": name, "rows": rows, "passed": ok,
                            "pass_rate": round(ok / rows, 4),
                            "median_nucleus": sorted(sizes)[len(sizes) // 2],
                            "reasons": ";".join(f"{k}={v}" for k, v in sorted(reasons.items())),
                            "model_differs": sum(differs) if split else "",
                            "passed_model_differs": missed if split else "",
                        })  # fmt: skip
    return out


def weighted_pass(cells: list[dict[str, Any]], **match: Any) -> float:
    """Entropy-weighted pass rate of the cells matching ``match`` (one cell per entropy)."""
    w = entropy_weights()
    sel = [r for r in cells if all(r[k] == v for k, v in match.items())]
    tot = sum(w[r["entropy_target"]] for r in sel)
    return sum(w[r["entropy_target"]] * r["pass_rate"] for r in sel) / tot if tot else math.nan


def recommend_c(cells: list[dict[str, Any]], tolerance: float = 0.01) -> int:
    """Smallest C whose weighted pass rate (T = 1, p = 0.95, monolithic) is within
    ``tolerance`` of the largest C's."""
    best = weighted_pass(cells, temperature=1.0, top_p=0.95, pipeline="monolithic", c=max(CS))
    for c in CS:
        got = weighted_pass(cells, temperature=1.0, top_p=0.95, pipeline="monolithic", c=c)
        if got >= best - tolerance:
            return c
    return max(CS)


def read_cells(path: Path) -> list[dict[str, Any]]:
    """Cells of a CSV written by :func:`write` (numbers parsed)."""
    ints = {"c", "rows", "passed", "median_nucleus", "model_differs", "passed_model_differs"}
    floats = {"entropy_target", "entropy", "temperature", "top_p", "pass_rate"}
    with path.open(newline="") as f:
        return [
            {k: int(v) if k in ints and v != "" else float(v) if k in floats else v
             for k, v in r.items()}
            for r in csv.DictReader(f)
        ]  # fmt: skip


def write(cells: list[dict[str, Any]], out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out / "nucleus.csv", "png": out / "nucleus.png", "md": out / "NUCLEUS.md"}
    with paths["csv"].open("w", newline="") as f:
        w = csv.DictWriter(f, FIELDS, lineterminator="\n")
        w.writeheader()
        w.writerows(cells)
    _plot(cells, paths["png"])
    paths["md"].write_text(_markdown(cells))
    return paths


def _plot(cells: list[dict[str, Any]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for j, t in enumerate(TEMPS):
        ax = axes[j]
        for i, p in enumerate(TOP_PS):
            pts = sorted(
                (r for r in cells if r["temperature"] == t and r["top_p"] == p and r["c"] == 64
                 and r["pipeline"] == "monolithic"), key=lambda r: r["entropy_target"])  # fmt: skip
            ax.plot([r["entropy_target"] for r in pts], [100 * r["pass_rate"] for r in pts],
                    "o-", color=f"C{i}", label=f"p={p}")  # fmt: skip
        ax.set(xscale="log", xlabel="row entropy at T=1 (nats)", ylabel="guard pass rate (%)",
               title=f"C=64, monolithic pipeline, T={t}", ylim=(-3, 103))  # fmt: skip
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[2]
    for i, c in enumerate(CS):
        pts = sorted(
            (r for r in cells if r["temperature"] == 1.0 and r["top_p"] == 0.95 and r["c"] == c
             and r["pipeline"] == "monolithic"), key=lambda r: r["entropy_target"])  # fmt: skip
        ax.plot([r["entropy_target"] for r in pts], [100 * r["pass_rate"] for r in pts], "o-",
                color=f"C{i}", label=f"C={c}")  # fmt: skip
    ax.set(xscale="log", xlabel="row entropy at T=1 (nats)", ylabel="guard pass rate (%)",
           title="T=1.0, p=0.95: candidates per rank", ylim=(-3, 103))  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def _markdown(cells: list[dict[str, Any]]) -> str:
    lines = [
        "# Sharded top-p: guard pass rate (synthetic rows, V=151936, TP2)",
        "",
        "Generated by `python -m benchmarks.nucleus_study` (CPU, plain torch; see its docstring "
        "for the row model and the entropy weights). Pass = the sharded finish could verify the "
        "row from per-rank candidates; otherwise the row falls back to vLLM's path.",
        "",
        "## Entropy-weighted pass rate (Qwen3-8B token-entropy profile, optimistic for chat)",
        "",
        "| T | p | C=16 | C=32 | C=64 | C=128 | C=256 |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in TEMPS:
        for p in TOP_PS:
            vals = [weighted_pass(cells, temperature=t, top_p=p, pipeline="monolithic", c=c)
                    for c in CS]  # fmt: skip
            lines.append(f"| {t} | {p} | " + " | ".join(f"{100 * v:.0f}%" for v in vals) + " |")
    lines += ["", "## Per entropy (C=64, monolithic; pass rate, median exact nucleus size)", ""]
    lines += ["| entropy (nats) | " + " | ".join(f"T={t} p={p}" for t in TEMPS for p in TOP_PS)
              + " |", "|---|" + "---|" * (len(TEMPS) * len(TOP_PS))]  # fmt: skip
    for h in ENTROPIES:
        row = []
        for t in TEMPS:
            for p in TOP_PS:
                r = next(r for r in cells if r["entropy_target"] == h and r["temperature"] == t
                         and r["top_p"] == p and r["c"] == 64 and r["pipeline"] == "monolithic")  # fmt: skip
                row.append(f"{100 * r['pass_rate']:.0f}% ({r['median_nucleus']})")
        lines.append(f"| {h} | " + " | ".join(row) + " |")
    lines += [
        "",
        "## Split (steps of <= 64 rows) vs monolithic pipeline, T=1.0, p=0.95 (weighted)",
        "",
        "| pipeline | " + " | ".join(f"C={c}" for c in CS) + " |",
        "|---|" + "---|" * len(CS),
    ]
    for name, _ in PIPELINES:
        vals = [weighted_pass(cells, temperature=1.0, top_p=0.95, pipeline=name, c=c) for c in CS]
        lines.append(f"| {name} | " + " | ".join(f"{100 * v:.0f}%" for v in vals) + " |")
    reasons: Counter[str] = Counter()
    for r in cells:
        if r["c"] == 64 and r["temperature"] == 1.0 and r["top_p"] == 0.95:
            for kv in str(r["reasons"]).split(";"):
                k, v = kv.split("=")
                reasons[k] += int(v)
    rec = recommend_c(cells)
    lines += [
        "",
        "The monolithic kernel resolves probabilities only to `p_max * 2**-16`, so diffuse rows "
        "whose nucleus the candidates do cover still fail its convergence rule; the split "
        "pipeline's logit-space rule passes them. Reasons at T=1, p=0.95, C=64 (all entropies, "
        "both pipelines): " + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())) + ".",
        "",
        f"**Recommended C for the pass rate: {rec}** (the smallest C within 1 point of C=256's "
        "weighted pass rate at T=1, p=0.95). The guard's pass rate does not depend on the GPU; "
        "what C costs (the candidate selection, the merge and a larger all_gather) does, and "
        "the tuner times it per GPU and step size (`python -m tuner --op sampled`). Under the "
        "fast mode's top-k contract (every top-k `k < 64` runs sharded, the tuner's default "
        "`--top-k-max 63`) only C = 64 and 128 are searched; a deployment whose requests never "
        "use top-k above 31 can admit C = 32 with `--top-k-max 31`.",
        "",
        *_tuned_c_section(),
        "",
        *_split_model_section(cells),
        "The monolithic kernel (steps of more than 64 rows, or with top-k) is not modelled: its "
        "outlier pre-filter (tile-0 mean + 10 std, a normal-CDF table) and its bisection over a "
        "compacted buffer are described in the research only in outline. Measured on an H200 with "
        "vLLM's kernels (research §1.5, V=151936, p=0.95, T=1, half the rows diffuse): the "
        "monolithic kernel matched the exact nucleus on 18/64 rows, the split pipeline on 57/64, "
        "the two agreed on 17/64; the guard's monolithic rule (`p_last - p_next > p_max * 2**-16`) "
        "is the reason its pass rate is lower on diffuse rows.",
        "",
    ]
    return "\n".join(lines)


def _split_model_section(cells: list[dict[str, Any]]) -> list[str]:
    """vLLM's split pipeline (modelled) vs the exact nucleus, and the guard on those rows."""
    lines = [
        "## vLLM's split top-p pipeline (modelled) vs the exact nucleus",
        "",
        "`shardmax.reference.nucleus.split_pipeline_model_keep`: the split pipeline's ladder "
        "search (5 rounds x 8 geometric pivots, research §1.1) in fp64 -- its structure, not "
        "vLLM's code or rounding. Differs = rows where the search does not converge and keeps a "
        "superset of the exact nucleus (vLLM's own answer then differs from the exact one). "
        "Passed and differs = rows the guard (split rule, C=64) would verify sharded although the "
        "modelled search differs: the guard must keep this at 0.",
        "",
        "| entropy (nats) | " + " | ".join(f"T={t} p={p}" for t in TEMPS for p in TOP_PS) + " |",
        "|---|" + "---|" * (len(TEMPS) * len(TOP_PS)),
    ]
    total = missed = rows = 0
    for h in ENTROPIES:
        row = []
        for t in TEMPS:
            for p in TOP_PS:
                r = next(r for r in cells if r["entropy_target"] == h and r["temperature"] == t
                         and r["top_p"] == p and r["c"] == 64 and r["pipeline"] == "split")  # fmt: skip
                row.append(f"{r['model_differs']}/{r['rows']}")
                total += int(r["model_differs"])
                missed += int(r["passed_model_differs"])
                rows += int(r["rows"])
        lines.append(f"| {h} | " + " | ".join(row) + " |")
    miss_all = sum(int(r["passed_model_differs"]) for r in cells if r["pipeline"] == "split")
    lines += [
        "",
        f"Over all {rows} (row, T, p) cases at C=64 the modelled search differs from the exact "
        f"nucleus on {total}; the guard passes {missed} of those at C=64 and {miss_all} at any C. "
        "On these rows the search fails only where the nucleus holds hundreds to tens of "
        "thousands of tokens (median sizes above), which the coverage rule already rejects at "
        "every C, so this does not isolate the guard's convergence rule; that rule is checked on "
        "a flat row in `tests/test_reference_nucleus.py::test_split_pipeline_model`.",
        "",
    ]
    return lines


def tuned_candidates(arch: str) -> dict[str, Counter[int]] | None:
    """C chosen per dtype by the packaged ``generated/<arch>/sampled.json`` (measured rows only;
    None when the table is untuned or missing)."""
    import json
    from importlib import resources

    try:
        text = (resources.files("shardmax.generated") / arch / "sampled.json").read_text()
    except (FileNotFoundError, OSError):
        return None
    table = json.loads(text)
    if not table.get("tuned"):
        return None
    out: dict[str, Counter[int]] = {}
    for row in table["rows"]:
        if row["match"] and row.get("tuned", True):
            dtype = str(row["match"].get("dtype", "any"))
            out.setdefault(dtype, Counter())[int(row["launch"]["candidates"])] += 1
    return out


def _tuned_c_section() -> list[str]:
    lines = ["C per GPU, as the tuner chose it (`generated/<arch>/sampled.json`, read now):", ""]
    for arch in ("sm90", "gfx950"):
        got = tuned_candidates(arch)
        if got is None:
            lines.append(f"- {arch}: untuned table; the built-in C = 64 until it is tuned.")
            continue
        per = "; ".join(
            f"{dtype}: " + ", ".join(f"C={c} in {n} rows" for c, n in sorted(cnt.items()))
            for dtype, cnt in sorted(got.items())
        )
        lines.append(f"- {arch}: {per}.")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.nucleus_study", description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/nucleus"))
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--rows", type=int, default=12, help="rows per entropy (default 12)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--from-csv", type=Path, help="re-render the summary and plot from a CSV")
    a = ap.parse_args(argv)
    if a.rows < 1 or a.vocab < max(CS) * a.tp:
        raise SystemExit(f"--rows must be >= 1 and --vocab >= {max(CS)} * tp")
    csv_in = a.from_csv
    cells = read_cells(csv_in) if csv_in is not None else run(a.vocab, a.tp, a.rows, a.seed)
    paths = write(cells, a.out)
    print(paths["md"].read_text())
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
