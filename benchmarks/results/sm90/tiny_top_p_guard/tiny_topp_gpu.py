"""GPU: tiny top-p through sharded_verify's candidate path vs vLLM 0.32/0.33 chains (split
pipeline at 12 rows, monolithic at 120): unflagged requests ==, each call twice bit-equal."""

import torch

import shardmax
from shardmax.testing import random_verify_batch
from shardmax.testing.vllm_chain import NativeChain, verify_inputs

V = 200064
bad = 0
for chain in NativeChain.discover():
    for reqs in (4, 40):
        rows = reqs * 3
        gen = torch.Generator().manual_seed(7)
        x = torch.randn(rows, V, generator=gen) * 2
        x[torch.arange(rows), torch.randint(0, V, (rows,), generator=gen)] += 30.0
        for p in (1e-8, 2e-7, 1e-5, 0.95):
            b = random_verify_batch(reqs, 2, V, seed=7, prefill_prob=0.0, logits=x.to("cuda"),
                                    accept_prob=0.8, device="cuda")  # fmt: skip
            temp = torch.zeros(b.max_num_reqs, device="cuda")
            temp[b.idx_mapping.long()] = 1.0
            top_p = torch.full((b.max_num_reqs,), p, device="cuda")

            def call(b=b, temp=temp, top_p=top_p):
                return shardmax.sharded_verify(
                    b.logits, *b.args()[:5], temp, b.seed, b.num_speculative_steps,
                    vocab_start=0, top_p=top_p, **b.kwargs(),
                )  # fmt: skip

            r1, r2 = call(), call()
            same = all(torch.equal(a, c) for a, c in zip(r1, r2, strict=True))
            out = chain.verify(b.logits, **verify_inputs(b, temperature=temp, top_p=top_p))
            keep = ~r1.fallback
            n_o, n_t = r1.num_sampled[keep].long(), out.num_sampled[keep].long()
            cols = torch.arange(r1.sampled.shape[1], device="cuda")[None, :] < n_t[:, None]
            tok = ((r1.sampled[keep] != out.sampled[keep]) & cols).any(1)
            rej = r1.num_rejected[keep].long() != out.num_rejected[keep].long()
            diff = int((tok | (n_o != n_t) | rej).sum())
            bad += diff + (not same)
            print(f"vllm {chain.version} rows={rows} top_p={p}: flagged "
                  f"{int(r1.fallback.sum())}/{reqs}, unflagged differing {diff}, twice "
                  f"bit-equal {same}", flush=True)  # fmt: skip
print("TOTAL bad", bad)
