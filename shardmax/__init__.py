"""shardmax: keep tensor-parallel LM-head logits on their rank during speculative decoding.

Each TP rank reduces its vocab shard to packed 64-bit keys (a few bytes per row); only those
cross the interconnect; one small kernel finishes the global argmax (draft side) or the whole
greedy verification (target side: acceptance, synthetic acceptance, bonus token,
num_sampled / num_rejected), bit-identical to vLLM on the full logits.

Public API:
    vocab_parallel_argmax      draft-side argmax over vocab shards
    sharded_greedy_verify      target-side greedy / synthetic verification over vocab shards
    sharded_verify             target-side verification of greedy and sampled requests
                               (temperature, top-k, top-p, min-p); mode="fast" (default,
                               compact records) or "strict" (vLLM's acceptance LSE bit for
                               bit); returns a per-request fallback mask and reason
    can_shard_verify           per-step gate: may this step take the sharded verification?

See README.md for the semantics contract and the data flow of one step.
"""

from shardmax.gate import ShardDecision, can_shard_verify
from shardmax.ops import sharded_greedy_verify, vocab_parallel_argmax
from shardmax.sampled import FallbackReason, VerifyResult, sharded_verify

__all__ = [
    "FallbackReason",
    "ShardDecision",
    "VerifyResult",
    "can_shard_verify",
    "sharded_greedy_verify",
    "sharded_verify",
    "vocab_parallel_argmax",
]
__version__ = "0.1.0"
