"""The main job's demonstration: one draft-side argmax and one verification step on a real
model's vocabulary geometry, every TP rank emulated in this process, with the bytes that cross
ranks compared to the full-logits all-gather they replace.

    python -m shardmax.demo [--vocab 200064] [--tp 4] [--rows 32] [--reqs 24] [--k 3]

On a machine without a GPU the kernels run in the Triton interpreter (slow but exact).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

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
    from shardmax import reference
    from shardmax.dispatch import Problem, alignment_of, select
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
    return 0 if ok and same else 1


if __name__ == "__main__":
    raise SystemExit(main())
