"""``topp_replay`` A/B: a baseline module file against the tree's, on the same records.

``python -m benchmarks.topp_replay_ab --baseline FILE [--out DIR]`` (CUDA; the Triton
interpreter with ``--device cpu``, meaningless times) writes ``topp_replay_ab.csv``,
``topp_replay_ab.png`` and ``TOPP_REPLAY_AB.md`` (default
``benchmarks/results/<arch>/topp_replay_ab``). ``FILE`` is an earlier generated
``topp_replay_bf16.py``, e.g. ``git show <commit>:generated/topp_replay_bf16.py > old.py``.

Per case (requests, TP, vLLM's top-p pipeline; K = 3, V = ``--vocab``): realistic T = 1 /
top-p 0.95 steps (:func:`shardmax.testing.traffic.realistic_batch`, bf16, one per seed), every
TP rank's shard through ``topp_hist``, then both modules' ``topp_replay`` launched with the
runtime's constexprs and warps on the same records:

* **bits**: rows whose kept set or fp64 statistics differ between the two (``rows_differing``;
  the tree's module runs twice, and a difference between its two runs stops the benchmark);
* **time**: CUDA-graph replay us per launch (:func:`benchmarks.timing.measure`, the first
  seed's records), the two modules interleaved ``--repeat`` times, the fastest of each kept.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
from pathlib import Path
from typing import Any

import torch

FIELDS = ["reqs", "rows", "tp", "pipeline", "baseline_us", "tree_us", "ratio", "rows_differing",
          "certified_pct"]  # fmt: skip


def _baseline_kernel(path: Path) -> Any:
    """A :class:`~shardmax.runtime.kernels.Kernel` of the module file ``path`` (launched the way
    the runtime launches the tree's)."""
    import shardmax.runtime.kernels as kernels

    spec = importlib.util.spec_from_file_location("topp_replay_baseline", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--baseline: cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if getattr(mod, "FAMILY", None) != "topp_replay" or getattr(mod, "DTYPE", None) != "bf16":
        raise SystemExit(f"--baseline: {path} is not a generated topp_replay bf16 module")
    k = kernels.Kernel.__new__(kernels.Kernel)
    load = kernels.load
    setattr(kernels, "load", lambda name: mod)  # noqa: B010  (Kernel.__init__ loads by name)
    try:
        k.__init__("topp_replay_baseline")  # type: ignore[misc]
    finally:
        setattr(kernels, "load", load)  # noqa: B010
    return k


def _launcher(k: Any, launch: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    """``measure``'s step: one launch of ``k`` (its input copy index unused)."""
    return lambda i: k(*launch, **kw)


def _same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> Any:
    """Per row: kept words and fp64 statistics equal bit for bit."""
    return (a[0] == b[0]).all(1) & (a[1].view(torch.int64) == b[1].view(torch.int64)).all(1)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from benchmarks.timing import measure
    from benchmarks.topp_kernels import _shards, _sigma
    from shardmax.ops.topp import (
        _SPLIT_REPLAY_WARPS,
        KEPT_WORDS,
        RECORD_WORDS,
        STAT_WORDS,
        _replay_constexprs,
        topp_histograms,
    )
    from shardmax.reference.nucleus_replay import Pipeline
    from shardmax.runtime.kernels import kernel
    from shardmax.testing.traffic import realistic_batch

    dev = torch.device(args.device)
    base, tree = _baseline_kernel(args.baseline), kernel("topp_replay_bf16")
    _, sigma = _sigma(dev)
    out = []
    for reqs in args.reqs:
        for tp in args.tp:
            for pipe in (Pipeline.SPLIT, Pipeline.SPLIT_V032, Pipeline.MONOLITHIC):
                kw = dict(_replay_constexprs("topp_replay_bf16", pipe))
                if pipe != Pipeline.MONOLITHIC:
                    kw["num_warps"] = _SPLIT_REPLAY_WARPS
                differing = certified = total = 0
                first: Any = None
                for seed in range(args.seeds):
                    t = realistic_batch(reqs, 3, args.vocab, seed=7000 + seed, mix="top_p",
                                        device=dev)  # fmt: skip
                    rows = t.logits.shape[0]
                    temp = torch.ones(rows, device=dev)  # T = 1, top-p 0.95: the model defaults
                    top_p = torch.full((rows,), 0.95, dtype=torch.float32, device=dev)
                    rec = torch.zeros((tp, rows, RECORD_WORDS), dtype=torch.int32, device=dev)
                    for r, (buf, nv, vs) in enumerate(_shards(t.logits, tp)):
                        topp_histograms(buf, temp, num_valid=nv, vocab_start=vs, out=rec[r])
                    outs = []
                    for k in (base, tree, tree):
                        kept = torch.full((rows, KEPT_WORDS), -7, dtype=torch.int32, device=dev)
                        stat = torch.full((rows, STAT_WORDS), -7.0, dtype=torch.float64,
                                          device=dev)  # fmt: skip
                        k((rows,), rec, temp, top_p, sigma, kept, stat, rows, rec.stride(0), tp,
                          2048, **kw)  # fmt: skip
                        outs.append((kept, stat))
                    if not bool(_same(outs[1], outs[2]).all()):
                        raise SystemExit(f"topp_replay: two runs differ ({reqs} reqs, TP {tp})")
                    differing += int((~_same(outs[0], outs[1])).sum())
                    certified += int((outs[1][0][:, 0] == 0).sum())
                    total += rows
                    if first is None:
                        first = (rec, temp, top_p, rows, outs[1])
                rec, temp, top_p, rows, (kept, stat) = first
                launch = ((rows,), rec, temp, top_p, sigma, kept, stat, rows, rec.stride(0), tp,
                          2048)  # fmt: skip
                times: dict[str, list[float]] = {"baseline": [], "tree": []}
                for _ in range(args.repeat):
                    for name, k in (("baseline", base), ("tree", tree)):
                        times[name].append(measure(_launcher(k, launch, kw), 1, dev).p50)
                b, n = min(times["baseline"]), min(times["tree"])
                row = dict(reqs=reqs, rows=rows, tp=tp, pipeline=pipe.name.lower(),
                           baseline_us=round(b, 2), tree_us=round(n, 2), ratio=round(n / b, 3),
                           rows_differing=differing,
                           certified_pct=round(100 * certified / max(total, 1), 1))  # fmt: skip
                print(row, flush=True)
                out.append(row)
    return out


def plot(rows: list[dict[str, Any]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{r['pipeline']}\n{r['rows']} rows TP{r['tp']}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [float(r["baseline_us"]) for r in rows], 0.4, label="baseline")
    ax.bar([i + 0.2 for i in x], [float(r["tree_us"]) for r in rows], 0.4, label="tree")
    ax.set_xticks(list(x), labels, fontsize=6)
    ax.set_ylabel("us per launch (CUDA-graph replay)")
    ax.set_title("topp_replay: baseline module vs the tree's, same records")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def summary(rows: list[dict[str, Any]], device: str) -> str:
    lines = [f"# topp_replay A/B ({device})", "",
             "| requests | rows | TP | pipeline | baseline us | tree us | tree / baseline | rows "
             "differing | certified % |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['reqs']} | {r['rows']} | {r['tp']} | {r['pipeline']} | "
                     f"{r['baseline_us']} | {r['tree_us']} | {r['ratio']} | "
                     f"{r['rows_differing']} | {r['certified_pct']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from shardmax.runtime.dispatch import detect_arch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, required=True, help="a topp_replay_bf16.py file")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--vocab", type=int, default=200064)
    ap.add_argument("--reqs", type=int, nargs="+", default=[1, 8, 40])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks.topp_replay_ab: no GPU (--device cpu runs the interpreter)")
    rows = run(args)
    out = args.out or Path("benchmarks/results") / (detect_arch() or "unknown") / "topp_replay_ab"
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "topp_replay_ab.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    plot(rows, out / "topp_replay_ab.png")
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "Triton interpreter"
    (out / "TOPP_REPLAY_AB.md").write_text(summary(rows, dev))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
