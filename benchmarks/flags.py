"""Flags and bytes of sampled verification on realistic top-p traffic (issue 18's targets).

For T = 1 / top-p 0.95 steps of realistic traffic (:func:`shardmax.testing.traffic.
realistic_batch`: LM entropy profile, drafts the top token 80 % of the time), emulated TP ranks
on one GPU, fast and strict mode, every candidate count ``C`` the kernels take: the share of
requests the step flags (they are resolved per request, :mod:`shardmax.ops.resolve`), the flag
reasons, and the bytes one rank sends per step -- its records and candidates (one all_gather)
plus its shard of the rows the resolution gathers (its all_gather) -- as a share of what
it sends in the full-logits all-gather (its ``[rows, W]`` shard). A whole-step native re-run is
never needed (resolution has no capacity limit in the eager plug-in), so its rate is 0 by
construction and not reported.

Two paths for the top-p rows: ``candidates`` (every C the kernels take, fast and strict mode) and
``histogram`` (fast mode: each rank's level-histogram record of every row rides in the same
all_gather, the kept sets are replayed on every rank with vLLM 0.33's pipeline for the step's
row count, and the draw is masked to them; its bytes add the second, small exchange of the draw
keys). With an extracted vLLM 0.33 tree (``SHARDMAX_VLLM_KERNELS``) the histogram path's
requests are compared with vLLM's own chain on the full logits, the flagged ones after their
per-request resolution (``oracle_mismatch``). The gathered rows counted in the bytes are the ones
the resolution gathers (``VerifyResult.need``: a flagged request's rows the step could not
certify, :func:`shardmax.ops.resolve.resolution_rows`).

    python -m benchmarks.flags [--seeds 20] [--vocab 151936,200064] [--reqs 8,40] [--tp 2,4,8]
        [--paths candidates,histogram] [--out benchmarks/results/<arch>]

Writes ``flags.csv``, ``flags.png`` and ``FLAGS.md`` (only after every case ran). Needs a GPU
(the interpreter would take hours at these vocabularies).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from .report import write_rows

FIELDS = [
    "vocab", "tp", "rows", "reqs_per_step", "steps", "path", "mode", "candidates",
    "flagged_req_pct", "flagged_rows_pct", "draw_rows_pct", "steps_flagged_pct",
    "record_bytes_per_rank",
    "wire_pct_of_allgather", "reasons", "replay_reasons", "oracle_requests", "oracle_mismatch",
]  # fmt: skip
WIRE_TARGET_PCT = 5.0
"""Issue 18: bytes crossing ranks <= 5 % of the full-logits all-gather."""


def _record_words(full: torch.Tensor, tp: int, mode: str, candidates: int) -> int:
    """Words (int64) one rank sends in the step's record all_gather (the plan's ``n_words``, the
    emulator's record launch: block 2048, one split)."""
    from shardmax.ops.sampled import RecordLaunch, SampledVerifyPlan, record_variant
    from shardmax.testing.emulate import _stride, emulated_ranks

    shards, ctxs = emulated_ranks(full, tp, None)
    launch = RecordLaunch(record_variant(full.dtype, 2048), 1, 4, candidates, "emulator")
    plan = SampledVerifyPlan(
        ctxs[0], full.shape[0], _stride(shards[0].local_logits), mode=mode,
        use_fp64_gumbel=False, with_candidates=True, processed=True, launch=launch,
    )  # fmt: skip
    return int(plan.n_words)


def run_case(
    vocab: int, tp: int, reqs: int, seeds: int, candidates: tuple[int, ...], device: str = "cuda"
) -> list[dict]:
    from shardmax.ops.resolve import flagged_requests, resolution_rows
    from shardmax.ops.sampled import FallbackReason
    from shardmax.testing.emulate_sampled import emulate_verify
    from shardmax.testing.traffic import realistic_batch

    width = -(-vocab // tp)
    out = []
    stats: dict[tuple[str, int], dict[str, Any]] = {}
    for seed in range(seeds):
        b = realistic_batch(reqs, 3, vocab, seed=1000 + seed, mix="top_p", device=device)
        rows = b.logits.shape[0]
        cu_np = b.cu_num_logits.cpu().numpy()
        for mode in ("fast", "strict"):
            for c in candidates:
                res = emulate_verify(
                    b.logits, tp, b.draft_sampled, b.cu_num_logits, b.pos, b.idx_mapping,
                    b.expanded_local_pos, b.temperature, b.seed, 3, top_p=b.top_p, mode=mode,
                    candidates=c,
                )  # fmt: skip
                req, codes = flagged_requests(res)
                st = stats.get((mode, c))
                if st is None:
                    words = _record_words(b.logits, tp, mode, c)
                    st = stats[(mode, c)] = {
                        "req": 0, "rows": 0, "steps": 0, "why": Counter(), "words": words
                    }  # fmt: skip
                st["req"] += int(req.size)
                st["steps"] += int(req.size > 0)
                st["rows"] += int(resolution_rows(res, cu_np, req).gather.sum())  # gathered
                st["why"].update(FallbackReason(int(x)).name for x in codes)
    del rows
    total_req, total_rows = reqs * seeds, reqs * 4 * seeds
    for (mode, c), st in stats.items():
        rec = 8 * st["words"]
        gathered = 2 * width * st["rows"] / seeds  # bf16 shard of the gathered rows, per step
        full = 2 * width * reqs * 4
        out.append(
            {
                "vocab": vocab,
                "tp": tp,
                "rows": reqs * 4,
                "reqs_per_step": reqs,
                "steps": seeds,
                "path": "candidates",
                "mode": mode,
                "candidates": c,
                "flagged_req_pct": 100.0 * st["req"] / total_req,
                "flagged_rows_pct": 100.0 * st["rows"] / total_rows,
                "record_bytes_per_rank": rec,
                "wire_pct_of_allgather": 100.0 * (rec + gathered) / full,
                "reasons": json.dumps(dict(st["why"].most_common()), sort_keys=False),
                "steps_flagged_pct": 100.0 * st["steps"] / seeds,
                "replay_reasons": "",
                "oracle_requests": "",
                "oracle_mismatch": "",
            }
        )
    return out


def _vllm_033() -> Any:
    """vLLM 0.33's chain from an extracted tree (None without one) -- also sets its sigma table
    for the monolithic replay."""
    from shardmax.runtime.topp_tables import set_sigma_table
    from shardmax.testing.vllm_chain import NativeChain

    chains = [c for c in NativeChain.discover() if c.version.startswith("0.33")]
    if not chains:
        return None
    set_sigma_table(list(chains[-1].modules.topk_topp._NORMAL_CDF_TO_SIGMA_TABLE))
    return chains[-1]


def run_hist_case(
    vocab: int, tp: int, reqs: int, seeds: int, chain: Any, device: str = "cuda"
) -> dict:
    """The histogram path on ``seeds`` realistic top-p steps: flags, bytes, and (with ``chain``)
    requests that differ from vLLM 0.33's chain on the full logits (the flagged ones resolved)."""
    from shardmax.ops.resolve import flagged_requests, resolution_rows, resolve_requests
    from shardmax.ops.sampled import FallbackReason, SampledVerifyPlan
    from shardmax.reference.nucleus_replay import ReplayReason, pipeline_for
    from shardmax.runtime.validation import check_step_batch
    from shardmax.testing.emulate import _stride, emulated_ranks
    from shardmax.testing.replayed import record_exchanges
    from shardmax.testing.traffic import realistic_batch
    from shardmax.testing.vllm_chain import verify_inputs

    width = -(-vocab // tp)
    rows = reqs * 4
    config = pipeline_for(rows, "cuda", "0.33")
    flagged = flagged_rows = draw_rows = steps_flagged = compared = mismatch = 0
    why: Counter[str] = Counter()
    replay_why: Counter[str] = Counter()
    words = 0
    for seed in range(seeds):
        b = realistic_batch(reqs, 3, vocab, seed=1000 + seed, mix="top_p", device=device)
        shards, ctxs = emulated_ranks(b.logits, tp, None)
        plans = [
            SampledVerifyPlan(c, rows, _stride(shards[0].local_logits), topp=config) for c in ctxs
        ]
        if not words:
            words = plans[0].n_words + plans[0].draw_words(reqs)
        batch = check_step_batch(
            rows, b.logits.device, b.draft_sampled, b.cu_num_logits, b.pos, b.idx_mapping,
            b.expanded_local_pos, b.seed, 3, None, None, None, temperature=b.temperature,
            top_p=b.top_p,
        )  # fmt: skip
        cu_np = b.cu_num_logits.cpu().numpy()
        _, res = record_exchanges(
            shards, plans, batch, cu_np, True
        )  # every rank's stages, no resolution
        kept = plans[0].kept_sets()[:, 0].cpu().numpy()
        req, codes = flagged_requests(res)
        for r, c in zip(req.tolist(), codes.tolist(), strict=True):
            if c == FallbackReason.TOPP_NOT_CERTIFIED:  # the first uncertified row's replay reason
                uncert = [int(x) for x in kept[cu_np[r] : cu_np[r + 1]] if x != 0]
                first = uncert[0] if uncert else -1
                replay_why[ReplayReason(first).name if 0 < first < 7 else str(first)] += 1
        flagged += int(req.size)
        plan = resolution_rows(res, cu_np, req)
        flagged_rows += int(plan.gather.sum())  # the rows gathered
        draw_rows += int(plan.draw.sum())  # certified draw rows: synthetic, not gathered
        steps_flagged += int(req.size > 0)
        why.update(FallbackReason(int(x)).name for x in codes)
        if chain is not None:
            from benchmarks.engine import _mismatches
            from shardmax.testing.replayed import full_rows

            kw = verify_inputs(b)
            whole = chain.verify(b.logits, **kw)
            # the flagged requests resolved as the plug-in resolves them (their uncertified rows
            # gathered, synthetic rows for the certified ones): every request compared
            resolve_requests(res, req, full_rows(b.logits), chain, kw)
            bad, _ = _mismatches(res, whole)
            mismatch += bad
            compared += reqs
    rec = 8 * words
    gathered = 2 * width * flagged_rows / seeds
    full = 2 * width * rows
    return {
        "vocab": vocab, "tp": tp, "rows": rows, "reqs_per_step": reqs, "steps": seeds,
        "path": "histogram", "mode": "fast", "candidates": 0,
        "flagged_req_pct": 100.0 * flagged / (reqs * seeds),
        "flagged_rows_pct": 100.0 * flagged_rows / (rows * seeds),
        "draw_rows_pct": 100.0 * draw_rows / (rows * seeds),
        "steps_flagged_pct": 100.0 * steps_flagged / seeds,
        "record_bytes_per_rank": rec,
        "wire_pct_of_allgather": 100.0 * (rec + gathered) / full,
        "reasons": json.dumps(dict(why.most_common()), sort_keys=False),
        "replay_reasons": json.dumps(dict(replay_why.most_common()), sort_keys=False),
        "oracle_requests": compared if chain is not None else "",
        "oracle_mismatch": mismatch if chain is not None else "",
    }  # fmt: skip


def plot(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for key in sorted({(r["vocab"], r["rows"], r["mode"]) for r in rows}):
        sel = [
            r for r in rows
            if (r["vocab"], r["rows"], r["mode"]) == key and r["tp"] == 2
            and r["path"] == "candidates"
        ]  # fmt: skip
        if not sel:
            continue
        sel.sort(key=lambda r: r["candidates"])
        x = [r["candidates"] for r in sel]
        label = f"V={key[0]} rows={key[1]} {key[2]}"
        axes[0].plot(x, [r["flagged_req_pct"] for r in sel], marker="o", label=label)
        axes[1].plot(x, [r["wire_pct_of_allgather"] for r in sel], marker="o", label=label)
    hist = [r for r in rows if r["path"] == "histogram" and r["tp"] == 2]
    for r in hist:
        label = f"V={r['vocab']} rows={r['rows']} histogram"
        axes[0].axhline(r["flagged_req_pct"], ls=":", lw=1.2, label=label)
        axes[1].axhline(r["wire_pct_of_allgather"], ls=":", lw=1.2, label=label)
    axes[0].set_title("TP2: requests flagged (%)")
    axes[1].set_title("TP2: bytes sent vs full-logits all-gather (%)")
    axes[1].axhline(WIRE_TARGET_PCT, color="k", ls="--", lw=0.8)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("candidates C per record split")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=90)


def _pct(x: Any) -> str:
    return "-" if x == "" or x is None else f"{float(x):.1f} %"


def summary(rows: list[dict]) -> str:
    lines = [
        "# Flags and bytes on realistic T = 1 / top-p 0.95 traffic (issue 18)", "",
        "| V | TP | rows | path | mode | C | requests flagged | steps with a flag | rows gathered "
        "| draw rows (synthetic) | record B / rank | bytes vs all-gather "
        "| != vLLM 0.33 (flagged: resolved) | reasons | replay reasons |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in rows:
        oracle = (
            f"{r['oracle_mismatch']} of {r['oracle_requests']}"
            if r["oracle_requests"] != ""
            else "-"
        )
        lines.append(
            f"| {r['vocab']} | {r['tp']} | {r['rows']} | {r['path']} | {r['mode']} | "
            f"{r['candidates'] or '-'} | {r['flagged_req_pct']:.1f} % | "
            f"{r['steps_flagged_pct']:.0f} % | {r['flagged_rows_pct']:.1f} % | "
            f"{_pct(r.get('draw_rows_pct', ''))} | {r['record_bytes_per_rank']} | "
            f"{r['wire_pct_of_allgather']:.1f} % | {oracle} | "
            f"{r['reasons']} | {r['replay_reasons'] or '-'} |"
        )
    ok = [r for r in rows if r["wire_pct_of_allgather"] <= WIRE_TARGET_PCT]
    lines += [
        "", f"Target: bytes <= {WIRE_TARGET_PCT:.0f} % of the full-logits all-gather: "
        f"{len(ok)} of {len(rows)} cases PASS.",
    ]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.flags", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--vocab", default="151936,200064")
    ap.add_argument("--reqs", default="8,40")
    ap.add_argument("--tp", default="2,4,8")
    ap.add_argument("--paths", default="candidates,histogram")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.flags: needs a GPU", file=sys.stderr)
        return 2
    from shardmax.runtime.defaults import CANDIDATE_CHOICES
    from shardmax.runtime.dispatch import detect_arch

    paths = args.paths.split(",")
    chain = _vllm_033() if "histogram" in paths else None
    if "histogram" in paths and chain is None:
        print("benchmarks.flags: no vLLM 0.33 tree: the histogram path needs its sigma table "
              "(bash scripts/vllm_sources.sh 0.33.0; SHARDMAX_VLLM_KERNELS)", file=sys.stderr)  # fmt: skip
        return 2
    rows: list[dict] = []
    for vocab in (int(v) for v in args.vocab.split(",")):
        for reqs in (int(r) for r in args.reqs.split(",")):
            for tp in (int(t) for t in args.tp.split(",")):
                got = []
                if "candidates" in paths:
                    got += run_case(vocab, tp, reqs, args.seeds, tuple(CANDIDATE_CHOICES))
                if "histogram" in paths:
                    got.append(run_hist_case(vocab, tp, reqs, args.seeds, chain))
                for r in got:
                    print(f"V={vocab} TP{tp} rows={r['rows']} {r['path']:10} {r['mode']:6} "
                          f"C={r['candidates']:3}: "
                          f"flagged {r['flagged_req_pct']:5.1f} % of requests, wire "
                          f"{r['wire_pct_of_allgather']:5.1f} %  {r['reasons']}", flush=True)  # fmt: skip
                rows += got
    out = args.out or Path("benchmarks/results") / (detect_arch() or "unknown")
    out.mkdir(parents=True, exist_ok=True)
    write_rows(out / "flags.csv", FIELDS, rows)
    plot(rows, out / "flags.png")
    (out / "FLAGS.md").write_text(summary(rows) + "\n")
    print(summary(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
