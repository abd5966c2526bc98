# TRITON_INTERPRET=1 python scripts/cpu_example.py  (CPU; every TP rank emulated in one process)
import torch
from shardmax import reference
from shardmax.testing import emulate_greedy_verify, emulate_vocab_parallel_argmax, random_verify_batch

logits = torch.randn(8, 50257)  # full logits [rows, V], fp32; 4 TP ranks below, one shard each
ids = emulate_vocab_parallel_argmax(logits, 4)  # each rank reduces its shard to packed keys
assert torch.equal(ids, torch.argmax(logits, dim=-1))
batch = random_verify_batch(4, 3, 50257, seed=0)  # 4 requests, K = 3 drafts, vLLM's layout
got = emulate_greedy_verify(batch.logits, 4, *batch.args(), **batch.kwargs())
want = reference.greedy_verify(batch.logits, *batch.args(), **batch.kwargs())
assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
print("argmax ids", ids.tolist(), "num_sampled", got[1].tolist())
