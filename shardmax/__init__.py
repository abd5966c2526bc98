"""shardmax: keep tensor-parallel LM-head logits on their rank during speculative decoding.

Each TP rank reduces its vocab shard to packed 64-bit keys or fixed-size records (a few bytes per
row); only those cross the interconnect; small kernels finish the global argmax (draft side) or
the whole verification (target side: acceptance, synthetic acceptance, bonus token,
num_sampled / num_rejected), identical to vLLM on the full logits.

Runtime API (plan once, run every step; no host sync, CUDA-graph capturable):
    VocabShard                 one TP rank's vocab shard: .argmax(rows), .greedy_verify(rows),
                               .verify(rows, mode=...) return plans whose .run() launches
    check_step_batch           host checks of one step's batch tensors -> StepBatch

Functional API (one call per step, every check, geometry checked on every call):
    vocab_parallel_argmax      draft-side argmax over vocab shards
    sharded_greedy_verify      target-side greedy / synthetic verification over vocab shards
    sharded_verify             target-side verification of greedy and sampled requests
                               (temperature, top-k, top-p, min-p); mode="fast" (default,
                               compact records) or "strict" (vLLM's acceptance LSE bit for
                               bit); returns a per-request fallback mask and reason
    can_shard_verify           per-step gate: may this step take the sharded verification?

See README.md for the semantics contract and the data flow of one step.
"""

from shardmax.api import sharded_greedy_verify, sharded_verify, vocab_parallel_argmax
from shardmax.gate import ShardDecision, can_shard_verify
from shardmax.ops.sampled import FallbackReason, VerifyResult
from shardmax.plan import VocabShard
from shardmax.runtime.validation import (
    StepBatch,
    check_batch_values,
    check_step_batch,
    value_checks,
)

__all__ = [
    "FallbackReason",
    "ShardDecision",
    "StepBatch",
    "VerifyResult",
    "VocabShard",
    "can_shard_verify",
    "check_batch_values",
    "check_step_batch",
    "sharded_greedy_verify",
    "sharded_verify",
    "value_checks",
    "vocab_parallel_argmax",
]
__version__ = "0.2.0.dev0"
