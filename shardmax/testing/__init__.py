"""Test utilities: vLLM-layout shards, adversarial inputs, verify batches, exact comparison.

``emulate_vocab_parallel_argmax`` and ``emulate_greedy_verify`` live in
:mod:`shardmax.testing.emulate`, ``emulate_verify`` (sampled verification) in
:mod:`shardmax.testing.emulate_sampled`; they are imported lazily on first access.
"""

from __future__ import annotations

from typing import Any

from shardmax.testing.adversarial import (
    ADVERSARIAL_CASES,
    VerifyBatch,
    adversarial_logits,
    assert_same_ids,
    random_verify_batch,
)
from shardmax.testing.shards import Shard, shard_like_vllm

__all__ = [
    "ADVERSARIAL_CASES",
    "Shard",
    "VerifyBatch",
    "adversarial_logits",
    "assert_same_ids",
    "emulate_greedy_verify",
    "emulate_verify",
    "emulate_vocab_parallel_argmax",
    "random_verify_batch",
    "shard_like_vllm",
]

_LAZY = {"emulate_greedy_verify", "emulate_vocab_parallel_argmax"}


def __getattr__(name: str) -> Any:
    if name == "emulate_verify":
        from shardmax.testing.emulate_sampled import emulate_verify

        globals()[name] = emulate_verify
        return emulate_verify
    if name in _LAZY:
        from shardmax.testing import emulate

        value = getattr(emulate, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
