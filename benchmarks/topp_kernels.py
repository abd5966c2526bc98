"""The top-p replay kernels on the GPU: exact, deterministic, and what they cost.

``python -m benchmarks.topp_kernels [--out DIR] [--steps N]`` writes ``topp_kernels.csv``,
``topp_kernels.png`` and ``TOPP_KERNELS.md`` (default ``benchmarks/results/<arch>/topp_kernels``;
CUDA only).

Per case (V, TP, rows; K = 3, so 32 or 160 logits rows: vLLM's split pipeline or its monolithic
kernel) and realistic T = 1 / top-p 0.95 step (:func:`shardmax.testing.traffic.realistic_batch`,
bf16), every TP rank's shard (emulated on one GPU: each rank's slice in a padded buffer whose
padding would win if read) goes through ``topp_hist_*``; the records are stacked as an
``all_gather`` would leave them and ``topp_replay_*`` answers every row. Checked, per row:

* **parity**: the kernel's kept set ``==`` :func:`shardmax.reference.nucleus_replay.replay` on
  the histogram merged from the same records (every field; the reason where it flags);
* **oracle**: every certified kept set holds vLLM 0.33's own mask
  (``apply_top_k_top_p_triton`` on the fp32 rows, the step as one chunk, vLLM choosing its
  pipeline; :func:`shardmax.testing.topp_replay.kept_set_violation`);
* **determinism**: each step runs twice; records, kept sets and ``(m, z)`` compared bit for bit.

Timed (CUDA-graph replay, us per launch, L2-cold inputs; and the eager host cost of the
launches as vLLM would make them, mean over the timed calls): one rank's local stage on its
shard (``topp_hist`` at both blocks, split per row to fill the GPU, + ``topp_combine``), ``topp_replay`` on the gathered records, vLLM 0.33's ``apply_top_k_top_p_triton`` on the
full fp32 logits (what vLLM runs for the same rows after its all-gather), on the split pipelines
``topp_replay`` at 4 and 8 warps deciding a round's eight pivots 8, 4 or 2 at a time
(``pivots``; each launch's bits compared with 8 pivots' at the same warps, the count of those
that differ in ``other_bits``), and the HBM floor of
reading one shard once (bytes / measured copy bandwidth). Bytes: one rank's records against its
bf16 shard in the full-logits all-gather.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path
from typing import Any

import torch

CASES_V = (151936, 200064)
CASES_TP = (2, 4, 8)
CASES_REQS = (8, 40)
K = 3
SEED0 = 9100
FIELDS = ["vocab", "tp", "rows", "pipeline", "steps", "topp_rows", "certified_pct", "reasons",
          "parity_mismatch", "oracle_rows", "oracle_mismatch", "nondeterministic",
          "hist_us", "hist_b2048_atomic_us", "hist_b2048_histogram_us", "hist_b4096_atomic_us",
          "hist_b4096_histogram_us", "splits", "hist_us_per_splits", "replay_us",
          "replay_us_per_warps", "replay_us_per_warps_pivots", "vllm_topp_us",
          "floor_us", "host_us", "host_functions_us",
          "record_bytes_per_rank", "shard_bytes_per_rank", "bytes_pct"]  # fmt: skip


def _sigma(device: torch.device) -> tuple[Any, torch.Tensor]:
    from shardmax.testing.vllm_chain import NativeChain, chain_trees

    trees = [t for t in chain_trees() if t.name.startswith("0.33")]
    if not trees:
        raise SystemExit(
            "benchmarks.topp_kernels: no vLLM 0.33 tree (bash scripts/vllm_sources.sh)"
        )
    chain = NativeChain.load(trees[-1])
    table = chain.modules.topk_topp._NORMAL_CDF_TO_SIGMA_TABLE
    return chain, torch.tensor([float(v) for v in table], dtype=torch.float32, device=device)


def _shards(x: torch.Tensor, tp: int) -> list[tuple[torch.Tensor, int, int]]:
    """Every rank's (padded shard, num_valid, vocab_start); padding 1e4 would win if read."""
    from shardmax.testing.shards import vllm_shard_ranges

    ranks = []
    for start, n, width in vllm_shard_ranges(x.shape[1], tp):
        buf = torch.full((x.shape[0], width), 1e4, dtype=x.dtype, device=x.device)
        buf[:, :n] = x[:, start : start + n]
        ranks.append((buf, n, start))
    return ranks


def _step(ranks, temp, top_p, sigma, pipeline, rec, kept, stat) -> None:
    from shardmax.ops.topp import topp_histograms, topp_kept_sets

    for r, (buf, n, start) in enumerate(ranks):
        topp_histograms(buf, temp, num_valid=n, vocab_start=start, out=rec[r])
    topp_kept_sets(rec, temp, top_p, sigma, dtype=ranks[0][0].dtype, pipeline=pipeline,
                   out=(kept, stat))  # fmt: skip


def _time_case(
    ranks: list[tuple[torch.Tensor, int, int]],
    logits: torch.Tensor,
    temp: torch.Tensor,
    top_p: torch.Tensor,
    sigma: torch.Tensor,
    pipeline: Any,
    tp: int,
    chain: Any,
    gbps: float,
) -> tuple[dict[tuple[int, bool], float], float, float, dict[str, float], int, dict, dict, dict]:
    """(one rank's local stage us per (block 2048 / 4096, atomic counts or tl.histogram),
    topp_replay us, vLLM's top-p us, eager host us of the fastest local stage and the replay,
    its splits)."""
    from benchmarks.timing import copies_for_cold, measure
    from shardmax.ops.topp import (
        KEPT_WORDS,
        RECORD_WORDS,
        REPLAY_PIVOTS,
        STAT_WORDS,
        TOPP_HIST_BLOCK,
        ToppPlan,
        topp_hist_splits,
        topp_histograms,
        topp_kept_sets,
    )
    from shardmax.reference.nucleus_replay import HIST_LEVELS, Pipeline

    dev = logits.device
    rows = logits.shape[0]
    rank0 = ranks[0]
    copies = copies_for_cold(rank0[0].numel() * 2, dev)
    sets = [rank0[0].clone() for _ in range(copies)]
    n, start = rank0[1], rank0[2]
    rec = torch.zeros((tp, rows, RECORD_WORDS), dtype=torch.int32, device=dev)
    for r, (buf, nv, vs) in enumerate(ranks):  # the replay is timed on the step's real records
        topp_histograms(buf, temp, num_valid=nv, vocab_start=vs, out=rec[r])
    hist_out = torch.empty((rows, RECORD_WORDS), dtype=torch.int32, device=dev)
    kept = torch.empty((rows, KEPT_WORDS), dtype=torch.int32, device=dev)
    stat = torch.empty((rows, STAT_WORDS), dtype=torch.float64, device=dev)

    width = rank0[0].shape[1]
    splits = {b: topp_hist_splits(rows, width, b, dev) for b in (2048, 4096)}
    block, atomic, nsplit = 2048, True, splits[2048]
    bufs = {
        (b, k): (
            torch.empty((k * rows, RECORD_WORDS), dtype=torch.int32, device=dev),
            torch.empty((k * rows, HIST_LEVELS), dtype=torch.int32, device=dev),
        )
        for b in (2048, 4096)
        for k in (1, 2, 4, 8, 16, 32)
    }

    def hist(i: int) -> None:
        scr, cnt = bufs[(block, nsplit)]
        topp_histograms(sets[i], temp, num_valid=n, vocab_start=start, block=block,
                        splits=nsplit, out=hist_out, scratch=scr, counts=cnt,
                        atomic=atomic)  # fmt: skip

    rep_warps: list[int | None] = [None]
    rep_pivots: list[int | None] = [None]

    def rep(i: int) -> None:
        topp_kept_sets(rec, temp, top_p, sigma, dtype=logits.dtype, pipeline=pipeline,
                       out=(kept, stat), num_warps=rep_warps[0],
                       pivots=rep_pivots[0])  # fmt: skip

    full = [logits.float() for _ in range(max(1, copies // (2 * tp)))]

    def vllm(i: int) -> None:  # in place: later launches see masked rows
        chain.modules.topk_topp.apply_top_k_top_p_triton(full[i], None, top_p)

    t_hist: dict[tuple[int, bool], float] = {}
    for block in (2048, 4096):
        for atomic in (True, False):
            nsplit = splits[block]
            t_hist[(block, atomic)] = measure(hist, copies, dev).p50
    block, atomic = min(t_hist, key=t_hist.__getitem__)
    # the splits sweep at the faster (block, counting): splits 1 .. MAX_SPLITS
    t_split = {}
    for nsplit in (1, 2, 4, 8, 16, 32):
        if (nsplit - 1) * block < n:
            t_split[nsplit] = measure(hist, copies, dev).p50
    nsplit = splits[block]
    print(f"[topp_kernels] rows {rows} width {width} block {block} atomic {atomic}: "
          f"us per splits {t_split}", flush=True)  # fmt: skip
    t_rep_w = {}
    for warps in (1, 2, 4, 8):
        rep_warps[0] = warps
        t_rep_w[warps] = measure(rep, 1, dev).p50
    rep_warps[0] = None
    print(f"[topp_kernels] replay us per warps {t_rep_w}", flush=True)
    t_rep = min(t_rep_w.values())
    t_rep_p: dict[str, float] = {}
    other_bits: list[str] = []
    if pipeline != Pipeline.MONOLITHIC:  # the split searches: warps x pivots decided at once
        for warps in (4, 8):  # (the warps order fp64 sums: bits are compared at equal warps)
            want: tuple[torch.Tensor, torch.Tensor] | None = None
            for pivots in REPLAY_PIVOTS[::-1][:3]:  # 8 first
                rep_warps[0], rep_pivots[0] = warps, pivots
                kept.zero_()
                rep(0)
                torch.cuda.synchronize()
                if want is None:
                    want = (kept.clone(), stat.clone())
                elif not (torch.equal(kept, want[0]) and torch.equal(stat, want[1])):
                    other_bits.append(f"w{warps}_p{pivots}")
                t_rep_p[f"w{warps}_p{pivots}"] = measure(rep, 1, dev).p50
        rep_warps[0] = rep_pivots[0] = None
        print(f"[topp_kernels] replay us per warps / pivots {t_rep_p}; bits other than 8 "
              f"pivots' at the same warps: {other_bits or 'none'}", flush=True)  # fmt: skip
        t_rep_p["other_bits"] = len(other_bits)
    try:
        t_vllm = measure(vllm, len(full), dev).p50
    except Exception as e:
        print(f"[topp_kernels] vLLM top-p not timed: {type(e).__name__}: {e}")
        t_vllm = float("nan")
    torch.cuda.synchronize()
    # eager host cost as an engine would pay it every step: the functions (argument checks,
    # buffers given) and the plan (host work once; launches only), same number of calls
    block, atomic, nsplit = TOPP_HIST_BLOCK, True, splits[TOPP_HIST_BLOCK]
    plan = ToppPlan(rows, width, num_valid=n, vocab_start=start, tp=tp, dtype=logits.dtype,
                    pipeline=pipeline, sigma=sigma, device=dev)  # fmt: skip
    host = {}
    for name in ("functions", "plan"):
        for _ in range(3):  # warm
            plan.local(sets[0], temp)
            plan.kept(rec, temp, top_p)
        torch.cuda.synchronize()
        calls = 100
        t0 = time.perf_counter()
        for _ in range(calls):
            if name == "plan":
                plan.local(sets[0], temp)
                plan.kept(rec, temp, top_p)
            else:
                hist(0)
                rep(0)
        host[name] = (time.perf_counter() - t0) * 1e6 / calls
        torch.cuda.synchronize()
    return t_hist, t_rep, t_vllm, host, splits[block], t_split, t_rep_w, t_rep_p


def run(
    steps: int, vocabs: tuple[int, ...], reqs_list: tuple[int, ...], tps: tuple[int, ...]
) -> list[dict]:
    from benchmarks.timing import copy_bandwidth_gbps
    from shardmax.ops.topp import KEPT_WORDS, RECORD_WORDS, STAT_WORDS
    from shardmax.reference.nucleus_replay import KeptSet, ReplayReason, pipeline_for
    from shardmax.reference.nucleus_shards import decode_record
    from shardmax.testing.topp_replay import (
        kept_set_violation,
        kernel_row,
        replayed_row,
        row_params,
    )
    from shardmax.testing.traffic import realistic_batch

    dev = torch.device("cuda")
    chain, sigma = _sigma(dev)
    table = sigma.tolist()
    gbps = copy_bandwidth_gbps(dev)
    out = []
    for v in vocabs:
        for reqs in reqs_list:
            rows = reqs * (K + 1)
            cfg = pipeline_for(rows, "cuda", "0.33")
            for tp in tps:
                agg: dict[str, Any] = {"topp": 0, "ok": 0, "why": {}, "par": 0, "orc": 0,
                                       "orc_bad": 0, "nondet": 0}  # fmt: skip
                for s in range(steps):
                    b = realistic_batch(reqs, K, v, seed=SEED0 + s, device=dev)
                    temp, top_p = (t.to(dev) for t in row_params(b))
                    ranks = _shards(b.logits, tp)
                    res = []
                    for _ in range(2):
                        rec = torch.empty((tp, rows, RECORD_WORDS), dtype=torch.int32, device=dev)
                        kept = torch.empty((rows, KEPT_WORDS), dtype=torch.int32, device=dev)
                        stat = torch.empty((rows, STAT_WORDS), dtype=torch.float64, device=dev)
                        _step(ranks, temp, top_p, sigma, cfg.pipeline, rec, kept, stat)
                        res.append((rec, kept, stat))
                    agg["nondet"] += not all(torch.equal(a, c) for a, c in zip(*res, strict=True))
                    rec, kept, stat = (t.cpu() for t in res[0])
                    masked = chain.modules.topk_topp.apply_top_k_top_p_triton(
                        b.logits.float(), None, top_p
                    )
                    vk = (masked != float("-inf")).cpu()
                    raw = b.logits.cpu()
                    for i in range(rows):
                        if float(top_p[i]) >= 1.0:
                            continue
                        agg["topp"] += 1
                        row = kept[i].tolist()
                        agg["why"][row[0]] = agg["why"].get(row[0], 0) + 1
                        parts = [decode_record(rec[r, i]) for r in range(tp)]
                        want = replayed_row(parts, raw.dtype, float(temp[i]), float(top_p[i]),
                                            cfg, table)  # fmt: skip
                        agg["par"] += kernel_row(row) != want
                        if row[0] != 0:
                            continue
                        agg["ok"] += 1
                        ks = KeptSet(ReplayReason.OK, bool(row[1]), row[2], row[3], row[4],
                                     row[5], row[7], bool(row[6]))  # fmt: skip
                        agg["orc"] += 1
                        agg["orc_bad"] += kept_set_violation(raw[i], vk[i], ks, row[8]) is not None
                # timing on the last step's rows
                width = ranks[0][0].shape[1]
                t_hist, t_rep, t_vllm, host, splits, t_split, t_rep_w, t_rep_p = _time_case(
                    ranks, b.logits, temp, top_p, sigma, cfg.pipeline, tp, chain, gbps
                )
                shard_bytes = rows * width * 2
                out.append({
                    "vocab": v, "tp": tp, "rows": rows, "pipeline": cfg.pipeline.name.lower(),
                    "steps": steps, "topp_rows": agg["topp"],
                    "certified_pct": 100.0 * agg["ok"] / max(agg["topp"], 1),
                    "reasons": json.dumps({ReplayReason(k).name if k < 7 else "NONFINITE": c
                                           for k, c in sorted(agg["why"].items())}),
                    "parity_mismatch": agg["par"], "oracle_rows": agg["orc"],
                    "oracle_mismatch": agg["orc_bad"], "nondeterministic": agg["nondet"],
                    "hist_us": round(min(t_hist.values()), 2),
                    **{f"hist_b{b}_{'atomic' if a else 'histogram'}_us": round(t, 2)
                       for (b, a), t in t_hist.items()},
                    "splits": splits, "replay_us": round(t_rep, 2),
                    "hist_us_per_splits": json.dumps({k: round(t, 2) for k, t in t_split.items()}),
                    "replay_us_per_warps": json.dumps({k: round(t, 2) for k, t in t_rep_w.items()}),
                    "replay_us_per_warps_pivots": json.dumps({k: round(t, 2)
                                                              for k, t in t_rep_p.items()}),
                    "vllm_topp_us": round(t_vllm, 2),
                    "floor_us": round(shard_bytes / (gbps * 1e3), 2),
                    "host_us": round(host["plan"], 1),
                    "host_functions_us": round(host["functions"], 1), "record_bytes_per_rank": rows * RECORD_WORDS * 4,
                    "shard_bytes_per_rank": shard_bytes,
                    "bytes_pct": round(100.0 * RECORD_WORDS * 4 / (width * 2), 3),
                })  # fmt: skip
                print(json.dumps(out[-1]), flush=True)
    return out


def plot(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    labels = [f"V{r['vocab'] // 1000}k tp{r['tp']} r{r['rows']}" for r in rows]
    xs = range(len(rows))
    w = 0.27
    ax.bar([x - w for x in xs], [r["hist_us"] + r["replay_us"] for r in rows], w,
           label="shardmax: topp_hist (one rank) + topp_replay")  # fmt: skip
    ax.bar(list(xs), [r["vllm_topp_us"] for r in rows], w,
           label="vLLM 0.33 apply_top_k_top_p_triton (full V, fp32)")  # fmt: skip
    ax.bar([x + w for x in xs], [r["floor_us"] for r in rows], w, label="HBM floor: one shard read")
    ax.set_xticks(list(xs), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("us per step (CUDA-graph replay)")
    ax.set_title("Top-p kept sets from shards vs vLLM's top-p on gathered logits")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def summary(rows: list[dict], device: str) -> str:
    lines = [
        f"# Top-p replay kernels on {device}",
        "",
        "Realistic T = 1 / top-p 0.95 steps (bf16, K = 3), every TP rank emulated on one GPU. "
        "`certified` = rows whose kept set the kernels certify; parity = rows where the kernel's "
        "answer differs from the plain-torch replay on the same records; oracle = certified rows "
        "whose kept set vLLM 0.33's own mask breaks; nondeterministic = steps whose two runs "
        "differ in any bit. Times: CUDA-graph replay, us per launch (L2-cold shards); host = "
        "eager Python cost per step of one rank's launches (topp_hist, topp_combine, "
        "topp_replay) through a ToppPlan and through the checked functions.",
        "",
        "| V | TP | rows | pipeline | top-p rows | certified % | parity | oracle bad / rows | "
        "nondet | local us: atomic b2048 / b4096, tl.histogram b2048 / b4096 (splits) | "
        "replay us | vLLM top-p us | floor us | host us: plan / functions | bytes % |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['vocab']} | {r['tp']} | {r['rows']} | {r['pipeline']} | {r['topp_rows']} | "
            f"{r['certified_pct']:.2f} | {r['parity_mismatch']} | {r['oracle_mismatch']} / "
            f"{r['oracle_rows']} | {r['nondeterministic']} | {r['hist_b2048_atomic_us']} / "
            f"{r['hist_b4096_atomic_us']}, {r['hist_b2048_histogram_us']} / "
            f"{r['hist_b4096_histogram_us']} ({r['splits']}) | {r['replay_us']} | "
            f"{r['vllm_topp_us']} | {r['floor_us']} | {r['host_us']} / "
            f"{r['host_functions_us']} | {r['bytes_pct']} |"
        )
    swept = [r for r in rows if json.loads(r.get("replay_us_per_warps_pivots") or "{}")]
    if swept:
        cols = [f"w{w}_p{p}" for w in (4, 8) for p in (8, 4, 2)]
        lines += [
            "",
            "## The split search: warps x pivots decided at once (`topp_replay`'s `PIVOTS`)",
            "",
            "us per launch (CUDA-graph replay); `other bits` = launches whose kept sets or "
            "statistics differ from 8 pivots' at the same warps.",
            "",
            f"| V | TP | rows | {' | '.join(c.replace('_', ' ') for c in cols)} | other bits |",
            "|---|---|---|" + "---|" * (len(cols) + 1),
        ]
        for r in swept:
            t = json.loads(r["replay_us_per_warps_pivots"])
            cells = " | ".join(f"{t[c]:.1f}" if c in t else "-" for c in cols)
            lines.append(
                f"| {r['vocab']} | {r['tp']} | {r['rows']} | {cells} | {t.get('other_bits', 0)} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.topp_kernels", description=__doc__)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--vocab", type=int, nargs="+", default=list(CASES_V))
    ap.add_argument("--reqs", type=int, nargs="+", default=list(CASES_REQS))
    ap.add_argument("--tp", type=int, nargs="+", default=list(CASES_TP))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.topp_kernels: needs CUDA (the tests cover the interpreter)")
    if args.out is None:
        from shardmax.runtime.dispatch import detect_arch

        args.out = Path("benchmarks/results") / (detect_arch() or "cuda") / "topp_kernels"
    rows = run(args.steps, tuple(args.vocab), tuple(args.reqs), tuple(args.tp))
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "topp_kernels.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    plot(rows, args.out / "topp_kernels.png")
    text = summary(rows, torch.cuda.get_device_name())
    (args.out / "TOPP_KERNELS.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
