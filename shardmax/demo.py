"""The main job's demonstration: one draft-side argmax, one greedy verification step, a few
sampled requests (strict and fast mode), the top-p kept sets of a few LM-like rows and a top-p
step verified over them, on a real model's vocabulary geometry, every TP rank emulated in this
process, with the bytes that cross ranks compared to the full-logits all-gather they replace.

    python -m shardmax.demo [--vocab 200064] [--tp 4] [--rows 32] [--reqs 24] [--k 3]

On a machine without a GPU the kernels run in the Triton interpreter (slow but exact).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n} B"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m shardmax.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--vocab", type=int, default=200064)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--rows", type=int, default=32, help="draft rows for the argmax")
    ap.add_argument("--reqs", type=int, default=24, help="requests in the verification step")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_steps")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    args = ap.parse_args(argv)

    cuda = torch.cuda.is_available()
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton reads TRITON_INTERPRET when it is imported: start again with it set.
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        os.execve(sys.executable, [sys.executable, "-m", "shardmax.demo", *sys.argv[1:]], env)
    if not cuda:  # x / T on the greedy rows' T = 0 lanes, discarded by a where: numpy warns
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton")
    from shardmax import reference
    from shardmax.runtime.dispatch import Problem, alignment_of, select
    from shardmax.testing import (
        adversarial_logits,
        emulate_greedy_verify,
        emulate_vocab_parallel_argmax,
        random_verify_batch,
        shard_like_vllm,
    )

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    dev = "cuda" if cuda else "cpu"
    elem = torch.empty(0, dtype=dtype).element_size()
    mode = "GPU" if cuda else "CPU, Triton interpreter"
    print(f"shardmax demo ({mode}): V={args.vocab}, TP={args.tp}, dtype={args.dtype}")

    # 1. draft side: vocab-parallel argmax
    logits = adversarial_logits(
        args.rows, args.vocab, dtype=dtype, seed=0, tp_size=args.tp, device=dev
    )
    shards = shard_like_vllm(logits, args.tp)
    w = shards[0].local_logits.shape[1]
    sel = select(
        Problem("argmax", args.dtype, args.tp, args.rows, w, alignment_of(shards[0].local_logits))
    )
    t0 = time.perf_counter()
    ids = emulate_vocab_parallel_argmax(logits, args.tp)
    dt = time.perf_counter() - t0
    want = torch.argmax(logits, dim=-1)
    ok = bool(torch.equal(ids.cpu(), want.cpu()))
    key_bytes = 8 * sel.splits
    print(
        f"\n[argmax] {args.rows} rows, local shard width W={w} "
        f"(rank {args.tp - 1} holds {shards[-1].num_valid} real ids), variant {sel.variant}, "
        f"splits={sel.splits}, transport={sel.transport} ({dt:.2f} s)"
    )
    print(f"  first ids: {ids[:8].tolist()}")
    print(
        f"  == torch.argmax over the full logits: {ok} ({args.rows} rows, ties, ±inf, "
        f"-0.0, NaN and all -inf rows included)"
    )
    print(
        f"  bytes per row leaving each rank: {key_bytes} B of keys vs {_bytes(w * elem)} "
        f"for the full-logits all-gather ({w * elem / key_bytes:,.0f}x less)"
    )

    # 2. target side: greedy verification of a realistic batch
    batch = random_verify_batch(args.reqs, args.k, args.vocab, seed=1, dtype=dtype, device=dev)
    rows = batch.logits.shape[0]
    vsel = select(
        Problem("verify", args.dtype, args.tp, rows, w, alignment_of(shards[0].local_logits))
    )
    t0 = time.perf_counter()
    sampled, num_sampled, num_rejected = emulate_greedy_verify(
        batch.logits, args.tp, *batch.args(), **batch.kwargs()
    )
    dt = time.perf_counter() - t0
    ref = reference.greedy_verify(batch.logits, *batch.args(), **batch.kwargs())
    same = all(
        torch.equal(a.cpu(), b.cpu())
        for a, b in zip((sampled, num_sampled, num_rejected), ref, strict=True)
    )
    accepted = (num_sampled - 1).clamp(min=0)
    print(
        f"\n[verify] {args.reqs} requests x K={args.k}: {rows} logits rows, variant "
        f"{vsel.variant}, splits={vsel.splits}, transport={vsel.transport} ({dt:.2f} s)"
    )
    print(f"  accepted drafts per request: {accepted.tolist()}")
    print(f"  num_sampled: {num_sampled.tolist()}")
    print(f"  num_rejected: {num_rejected.tolist()}")
    print(f"  == reference rejection_sample + get_num_sampled_and_rejected: {same}")
    sharded = rows * 8 * vsel.splits
    plain = rows * w * elem
    print(
        f"  bytes leaving each rank this step: {_bytes(sharded)} of keys vs {_bytes(plain)} "
        f"for the full-logits all-gather in {args.dtype} ({plain / sharded:,.0f}x less; "
        f"{_bytes(rows * w * 4)} in fp32)"
    )
    # 3. target side, sampled requests: strict mode (vLLM's LSE bits) and fast mode
    ok3 = _sampled_demo(args, dtype, dev, elem, w)
    # 4. target side, top-p rows: kept sets from the ranks' level histograms
    ok4 = _topp_demo(args, dtype, dev, elem)
    return 0 if ok and same and ok3 and ok4 else 1


def _sampled_demo(
    args: argparse.Namespace, dtype: torch.dtype, dev: str, elem: int, w: int
) -> bool:
    """A few sampled requests (temperature 0.7 / 1.0 / 1.3 next to greedy ones) verified by
    every emulated rank in strict and in fast mode, checked against the sampled reference."""
    from shardmax.ops.strict import extras_words, plan
    from shardmax.reference.sampled import verify_sampled
    from shardmax.testing import emulate_verify, random_verify_batch, shard_like_vllm

    reqs = max(1, min(args.reqs, 6))
    batch = random_verify_batch(reqs, args.k, args.vocab, seed=2, dtype=dtype, device=dev)
    temps = torch.tensor([0.0, 0.7, 1.0, 1.3], device=dev)[
        torch.arange(batch.max_num_reqs, device=dev) % 4
    ]
    d, cu, pos, idx, elp, seed, k = batch.args()
    kw = batch.kwargs()
    want = verify_sampled(batch.logits, d, cu, pos, idx, elp, temps, seed, k, **kw)
    rows = batch.logits.shape[0]
    used = ", ".join(f"{t:g}" for t in temps[idx.long()].tolist())
    print(f"\n[sampled] {reqs} requests, temperatures {used} (0 = greedy)")
    ok = True
    for mode in ("strict", "fast"):
        t0 = time.perf_counter()
        got = emulate_verify(
            batch.logits, args.tp, d, cu, pos, idx, elp, temps, seed, k, mode=mode, **kw
        )
        dt = time.perf_counter() - t0
        keep = ~got.fallback
        same = all(
            torch.equal(g[keep].cpu(), x[keep].cpu()) for g, x in zip(got[:3], want, strict=True)
        )
        ok &= same
        print(
            f"  {mode:6}: num_sampled {got.num_sampled.tolist()}, fallback "
            f"{int(got.fallback.sum())}/{reqs}, == reference on the others: {same} ({dt:.2f} s)"
        )
    shards = shard_like_vllm(batch.logits, args.tp)
    p = plan([(sh.vocab_start, sh.num_valid) for sh in shards])
    fast_b = 24 * rows
    strict_b = fast_b + 8 * extras_words(p, rows, dtype)
    print(
        f"  bytes leaving each rank: fast {_bytes(fast_b)}, strict {_bytes(strict_b)} "
        f"(vLLM's block statistics + the raw values of {len(p.cut_blocks)} cut blocks) vs "
        f"{_bytes(rows * w * elem)} for the full-logits all-gather"
    )
    return ok


def _topp_demo(args: argparse.Namespace, dtype: torch.dtype, dev: str, elem: int) -> bool:
    """Top-p kept sets from shards: LM-like rows at T = 1 / top-p 0.95, every rank's level
    histogram, their merge and vLLM's top-p search replayed (kernels), checked against the
    plain-torch replay on the same records; then a whole top-p step over them."""
    if dtype not in (torch.bfloat16, torch.float16):
        print("\n[top-p] skipped: level histograms exist for bf16 / fp16 logits")
        return True
    from shardmax.ops.topp import RECORD_BYTES, ToppPlan
    from shardmax.reference.nucleus_replay import pipeline_for
    from shardmax.reference.nucleus_shards import decode_record
    from shardmax.testing import shard_like_vllm
    from shardmax.testing.topp_replay import kernel_row, replayed_row
    from shardmax.testing.traffic import lm_logits

    rows = max(1, min(args.reqs, 8))
    logits = lm_logits(rows, args.vocab, seed=3, dtype=dtype, device=dev)
    temp = torch.ones(rows, device=dev)
    top_p = torch.full((rows,), 0.95, device=dev)
    # a stand-in for vLLM's sigma table (the monolithic pipeline's; vLLM's own is found at run
    # time by shardmax.runtime.topp_tables): the split pipeline below does not read it
    sigma = torch.special.ndtri((torch.arange(200, dtype=torch.float64) + 0.5) / 200).float()
    cfg = pipeline_for(rows, "cuda", "0.33")
    t0 = time.perf_counter()
    shards = shard_like_vllm(logits, args.tp)
    recs = []
    for sh in shards:
        plan = ToppPlan(rows, sh.local_logits.shape[1], num_valid=sh.num_valid,
                        vocab_start=sh.vocab_start, tp=args.tp, dtype=dtype,
                        pipeline=cfg.pipeline, sigma=sigma.to(dev), device=torch.device(dev))  # fmt: skip
        recs.append(plan.local(sh.local_logits.contiguous(), temp).clone())
    gathered = torch.stack(recs)  # what all_gather(dim=0) leaves on every rank
    kept, _ = plan.kept(gathered, temp, top_p)
    dt = time.perf_counter() - t0
    rows_kept = kept.tolist()
    certified = sum(r[0] == 0 for r in rows_kept)
    sig = sigma.tolist()
    same = 0
    for i in range(rows):
        parts = [decode_record(gathered[r, i]) for r in range(args.tp)]
        same += kernel_row(rows_kept[i]) == replayed_row(parts, dtype, 1.0, 0.95, cfg, sig)
    w = shards[0].local_logits.shape[1]
    print(
        f"\n[top-p] {rows} LM-like rows, T = 1, top-p 0.95, vLLM 0.33's {cfg.pipeline.name.lower()} "
        f"pipeline replayed from {args.tp} ranks' level histograms ({dt:.2f} s)"
    )
    print(f"  kept sets certified: {certified}/{rows}; boundary levels below the top: "
          f"{[r[2] if r[0] == 0 and not r[1] else None for r in rows_kept]}")  # fmt: skip
    print(f"  == the plain-torch replay on the same records: {same == rows}")
    print(
        f"  bytes leaving each rank: {_bytes(RECORD_BYTES * rows)} of histograms vs "
        f"{_bytes(rows * w * elem)} for the full-logits all-gather"
    )
    return same == rows and _topp_step_demo(args, dtype, dev)


def _topp_step_demo(args: argparse.Namespace, dtype: torch.dtype, dev: str) -> bool:
    """A T = 1 / top-p 0.95 step verified from the ranks' level histograms (the records, the
    replay, the finish over the kept sets, the draw over them), checked against the reference on
    the masked rows."""
    from shardmax.reference.nucleus_replay import pipeline_for
    from shardmax.testing import emulate_verify
    from shardmax.testing.topp_replay import kept_set_reference
    from shardmax.testing.traffic import realistic_batch

    reqs = max(1, min(args.reqs, 3))
    b = realistic_batch(reqs, args.k, args.vocab, seed=4, dtype=dtype, device=dev)
    cfg = pipeline_for(b.logits.shape[0], "cuda", "0.33")
    t0 = time.perf_counter()
    got = emulate_verify(b.logits, args.tp, *b.sampled_args(), top_p=b.top_p, topp=cfg)
    dt = time.perf_counter() - t0
    keep = ~got.fallback.cpu()
    same = all(
        torch.equal(g.cpu()[keep], x[keep])
        for want in kept_set_reference(b, cfg)
        for g, x in zip(got[:3], want, strict=True)
    )
    print(
        f"  a step of {reqs} requests verified over the kept sets: num_sampled "
        f"{got.num_sampled.tolist()}, flagged {int(got.fallback.sum())}/{reqs}, == the reference "
        f"on the masked rows: {same} ({dt:.2f} s)"
    )
    return same


if __name__ == "__main__":
    raise SystemExit(main())
