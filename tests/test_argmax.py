"""Vocab-parallel argmax: every generated variant, emulated TP 1/2/3/4/8, exact `==`.

Sections: 1. every shard_keys variant x finish/transport on adversarial rows;
2. real-model vocabularies and dtypes through the public path (dispatcher default);
3. the public op on one rank (padding, vocab_start, empty batch).
"""

from __future__ import annotations

import pytest
import torch

import shardmax
from generator.space import BLOCKS, local_variants
from shardmax import reference
from shardmax.runtime.dispatch import Selection
from shardmax.runtime.variants import parse_name
from shardmax.testing import (
    ADVERSARIAL_CASES,
    adversarial_logits,
    assert_same_ids,
    emulate_vocab_parallel_argmax,
)

TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LOCAL = [k.name for k in local_variants()]

# (tp, transport, splits): covers argmax_pick_tp2/tp4/tp8/tpn_allgather and _allreduce.
TOPOLOGIES = [
    (1, "allreduce", 1),
    (2, "allgather", 2),
    (3, "allgather", 4),
    (4, "allgather", 1),
    (8, "allgather", 2),
    (4, "allreduce", 3),
]


@pytest.mark.parametrize("variant", LOCAL)
def test_every_local_variant_every_finish(variant: str) -> None:
    """Every local variant under two of the topologies (one of them with several splits),
    rotating with the variant: every finish meets every dtype and alignment and half the
    blocks; every variant meets splits, the masked tail and a cross-shard finish."""
    key = parse_name(variant)
    dtype = TORCH_DTYPE[str(key.dtype)]
    block = int(key.block or 0)
    first = LOCAL.index(variant) % len(TOPOLOGIES)
    for i in (first, (first + 2) % len(TOPOLOGIES)):
        tp, transport, splits = TOPOLOGIES[i]
        # shards about 2.5 blocks wide, so blocks, splits and the masked tail all occur
        vocab = int(2.5 * block * tp) + 37 * i + 1
        logits = adversarial_logits(
            len(ADVERSARIAL_CASES), vocab, dtype=dtype, seed=i, tp_size=tp, block=block
        )
        sel = Selection(
            variant,
            {"splits": splits, "num_warps": 4, "num_stages": 1, "transport": transport},
            False,
            "test",
        )
        got = emulate_vocab_parallel_argmax(logits, tp, selection=sel)
        assert_same_ids(got, reference.argmax(logits), logits)
        assert_same_ids(got, torch.argmax(logits, dim=-1), logits)


@pytest.mark.parametrize("vocab", [1000, 32001, 50257, 151936, 200064])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_real_vocabularies_all_tp(vocab: int, dtype: torch.dtype) -> None:
    rows = len(ADVERSARIAL_CASES) if vocab <= 50257 else 6
    for tp in (1, 2, 3, 4, 8):
        logits = adversarial_logits(rows, vocab, dtype=dtype, seed=tp, tp_size=tp, block=BLOCKS[0])
        got = emulate_vocab_parallel_argmax(logits, tp)
        assert_same_ids(got, torch.argmax(logits, dim=-1), logits)


def test_single_rank_public_op_padding_and_offset() -> None:
    torch.manual_seed(0)
    full = torch.randn(7, 3000)
    padded = torch.cat([full, torch.full((7, 40), float("inf"))], dim=1)  # winning padding
    got = shardmax.vocab_parallel_argmax(padded, vocab_start=500, num_valid=3000)
    assert torch.equal(got, torch.argmax(full, dim=-1) + 500)
    # a row stride wider than the row (a column slice of a bigger buffer)
    wide = torch.randn(5, 4096)
    view = wide[:, :2500]
    assert torch.equal(
        shardmax.vocab_parallel_argmax(view, vocab_start=0), torch.argmax(view, dim=-1)
    )


def test_empty_batch_and_empty_shard() -> None:
    out = shardmax.vocab_parallel_argmax(torch.empty(0, 128), vocab_start=0)
    assert out.shape == (0,) and out.dtype == torch.int64
    logits = adversarial_logits(4, 100, dtype=torch.float32, seed=3, tp_size=8, block=1024)
    # V=100 at TP8: every shard is 8 columns wide, the last ranks hold no real ids
    assert torch.equal(emulate_vocab_parallel_argmax(logits, 8), torch.argmax(logits, dim=-1))


def test_ids_above_2_pow_24_stay_exact() -> None:
    # ids never travel as floats: a shard starting at 2**24 + 1 keeps odd ids exact
    x = torch.randn(3, 2048)
    start = 2**24 + 1
    got = shardmax.vocab_parallel_argmax(x, vocab_start=start)
    assert torch.equal(got, torch.argmax(x, dim=-1) + start)
    got = shardmax.vocab_parallel_argmax(x, vocab_start=2**31 - 1 - 2048)
    assert torch.equal(got, torch.argmax(x, dim=-1) + 2**31 - 1 - 2048)
