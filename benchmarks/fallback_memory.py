"""GPU memory the device fallback holds, per row count (TP 1, one GPU).

The plug-in's TP-1 temperature step runs :class:`~shardmax.integrations.vllm.fallback.
DeviceFallback` folded into its replayed graph (``DeviceFallback.fold``): the graphs keep a
static copy of the bucket's logits and vLLM's chain's temporaries in their pool, memory that
vLLM's own profiling run does not see. Per row count, on the engine benchmark's traffic
(realistic, V = 200064 bf16, K = 3), this measures ``torch.cuda.memory_allocated`` /
``memory_reserved`` after the replayed step without the fallback reached its steady state
(captured), then after the same step with the fold did (a fresh shard, fallback and caches for
each row count; the baseline's graphs are dropped first), and writes the differences:

    python -m benchmarks.fallback_memory [--rows 4,32,96,256,512] [--out DIR]

Writes ``fallback_memory.csv``, ``fallback_memory.png`` and ``FALLBACK_MEMORY.md`` under
``--out`` (default ``benchmarks/results/<arch>/fallback_memory``). Needs CUDA and vLLM's
kernels (``SHARDMAX_VLLM_KERNELS``, ``scripts/vllm_sources.sh``).
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path
from typing import Any

import torch

from .report import write_rows

FIELDS = ["rows", "reqs", "vocab", "dtype", "path", "allocated_mib", "reserved_mib",
          "allocated_over_plain_mib", "reserved_over_plain_mib", "logits_mib"]  # fmt: skip
_MIB = 1 << 20


def _settle() -> tuple[float, float]:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated() / _MIB, torch.cuda.memory_reserved() / _MIB


def _measure(rows: int, vocab: int, k: int, chain: Any) -> list[dict[str, Any]]:
    from benchmarks.engine import _shardmax_step
    from shardmax.integrations.vllm.fallback import DeviceFallback
    from shardmax.integrations.vllm.resolution import CapturedResolution
    from shardmax.testing.traffic import realistic_batch
    from shardmax.testing.vllm_chain import verify_inputs

    reqs = max(1, rows // (k + 1))
    traffic = realistic_batch(reqs, k, vocab, seed=rows, mix="temperature", device="cuda")
    kw = verify_inputs(traffic)
    prefill = (kw["seq_lens"], kw["prefill_len"])
    logits_mib = traffic.logits.numel() * traffic.logits.element_size() / _MIB
    base = _settle()
    out = []
    for path in ("shardmax", "shardmax+fold"):
        resolver = CapturedResolution(chain)
        fb = DeviceFallback(chain) if path == "shardmax+fold" else None
        step = _shardmax_step(traffic, "temperature", prefill, (resolver, kw), device=fb,
                              fold=fb is not None)  # fmt: skip
        for _ in range(4):  # eager, captured, then replayed from the slots
            res = step()
        del res
        alloc, reserved = _settle()
        out.append({"rows": reqs * (k + 1), "reqs": reqs, "vocab": vocab, "dtype": "bf16",
                    "path": path, "allocated_mib": alloc - base[0],
                    "reserved_mib": reserved - base[1], "logits_mib": logits_mib})  # fmt: skip
        del step, fb, resolver
        _settle()
    plain = out[0]
    for row in out:
        row["allocated_over_plain_mib"] = row["allocated_mib"] - plain["allocated_mib"]
        row["reserved_over_plain_mib"] = row["reserved_mib"] - plain["reserved_mib"]
    return out


def plot(rows: list[dict[str, Any]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fold = [r for r in rows if r["path"] == "shardmax+fold"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = [str(r["rows"]) for r in fold]
    ax.bar(x, [r["reserved_over_plain_mib"] for r in fold], label="reserved over the plain replay")
    ax.plot(x, [r["logits_mib"] for r in fold], "k.-", label="one step's logits")
    ax.set_xlabel("logits rows (V = 200064, bf16, K = 3)")
    ax.set_ylabel("MiB")
    ax.set_title("GPU memory the folded device fallback holds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=90)


def summary(rows: list[dict[str, Any]]) -> str:
    lines = ["# GPU memory of the folded device fallback", "",
             "| rows | path | allocated MiB | reserved MiB | allocated over plain | reserved over "
             "plain | one step's logits MiB |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['rows']} | {r['path']} | {r['allocated_mib']:.1f} | {r['reserved_mib']:.1f} | "
            f"{r['allocated_over_plain_mib']:.1f} | {r['reserved_over_plain_mib']:.1f} | "
            f"{r['logits_mib']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="4,32,96,256,512")
    ap.add_argument("--vocab", type=int, default=200064)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--vllm-version", default="0.33.0")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("fallback_memory: needs CUDA")
        return 2
    from shardmax.runtime.dispatch import detect_arch
    from shardmax.testing.vllm_chain import NativeChain

    chain = {c.version: c for c in NativeChain.discover()}[args.vllm_version]
    out_dir = (
        args.out or Path("benchmarks/results") / (detect_arch() or "unknown") / "fallback_memory"
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in (int(r) for r in args.rows.split(",")):
        got = _measure(n, args.vocab, args.k, chain)
        for r in got:
            print(f"rows={r['rows']:4} {r['path']:14} allocated {r['allocated_mib']:8.1f} MiB "
                  f"reserved {r['reserved_mib']:8.1f} MiB (over plain: "
                  f"{r['reserved_over_plain_mib']:8.1f}); logits {r['logits_mib']:.1f} MiB",
                  flush=True)  # fmt: skip
        rows += got
    write_rows(out_dir / "fallback_memory.csv", FIELDS, rows)
    plot(rows, out_dir / "fallback_memory.png")
    (out_dir / "FALLBACK_MEMORY.md").write_text(summary(rows) + "\n")
    print(summary(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
