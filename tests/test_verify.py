"""Sharded greedy verification vs the reference, emulated TP 1/2/3/4/8, exact `==`.

Sections: 1. every finish variant (tp2/tp4/tp8/tpn all_gather, all_reduce) on random vLLM-shaped
batches incl. synthetic acceptance and chunked prefill; 2. vocab sizes (shards narrower than a
block, padded shards), K 1/3/5, dtypes; 3. planted cases: all accepted / first / middle
rejected, placeholders, bf16 ties across shards, winning padding, NaN rows; 4. the public op.
"""

from __future__ import annotations

import pytest
import torch

import shardmax
from shardmax import reference
from shardmax.runtime.dispatch import Selection
from shardmax.testing import emulate_greedy_verify, random_verify_batch
from shardmax.testing.shards import default_pad_to, shard_like_vllm


def _check(batch, tp: int, selection: Selection | None = None, logits=None) -> None:
    logits = batch.logits if logits is None else logits
    kwargs = {k: v for k, v in batch.kwargs().items() if k not in ("vocab_start", "num_valid")}
    want = reference.greedy_verify(logits, *batch.args(), **kwargs)
    got = emulate_greedy_verify(logits, tp, *batch.args(), selection=selection, **kwargs)
    for name, w, g in zip(("sampled", "num_sampled", "num_rejected"), want, got, strict=True):
        assert g.dtype == w.dtype, name
        assert torch.equal(g, w), f"{name} differs at tp={tp}:\n got {g}\nwant {w}"


# (tp, transport) pairs covering every verify_finish variant
FINISHES = [
    (2, "allgather"),
    (4, "allgather"),
    (8, "allgather"),
    (3, "allgather"),
    (1, "allreduce"),
    (4, "allreduce"),
]


@pytest.mark.parametrize(("tp", "transport"), FINISHES)
@pytest.mark.parametrize("synthetic", [False, True])
def test_every_finish_variant(tp: int, transport: str, synthetic: bool) -> None:
    batch = random_verify_batch(12, 3, 3001, seed=tp * 7 + synthetic, synthetic=synthetic)
    sel = Selection(
        "shard_keys_fp32_va1_b1024",
        {"splits": 2, "num_warps": 4, "num_stages": 1, "transport": transport},
        False,
        "test",
    )
    _check(batch, tp, sel)


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("vocab", [1000, 32001, 50257, 200064])
def test_vocab_and_k(vocab: int, k: int) -> None:
    num_reqs = 8 if vocab <= 50257 else 3
    for tp in (1, 2, 3, 4, 8):
        batch = random_verify_batch(
            num_reqs, k, vocab, seed=vocab + k + tp, dtype=torch.bfloat16, synthetic=(tp % 2 == 1)
        )
        _check(batch, tp)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dtypes_and_empty_batch(dtype: torch.dtype) -> None:
    batch = random_verify_batch(10, 4, 5000, seed=3, dtype=dtype)
    _check(batch, 4)
    empty = random_verify_batch(0, 3, 5000, seed=0, dtype=dtype)
    out = emulate_greedy_verify(empty.logits, 2, *empty.args())
    assert [tuple(t.shape) for t in out] == [(0, 4), (0,), (0,)]


def _one_request(logits: torch.Tensor, drafts: list[int], k: int):
    """A single decode request verifying ``drafts`` (row i verifies drafts[i])."""
    n = len(drafts)
    batch = random_verify_batch(1, k, logits.shape[1], seed=0, logits=logits[: n + 1])
    batch.cu_num_logits = torch.tensor([0, n + 1], dtype=torch.int32)
    batch.draft_sampled = torch.tensor([5, *drafts], dtype=torch.int32)
    batch.pos = torch.arange(100, 101 + n, dtype=torch.int64)
    batch.expanded_local_pos = torch.arange(n + 1, dtype=torch.int32)
    batch.logits = logits[: n + 1]
    batch.seq_lens = None
    batch.prefill_len = None
    return batch


def test_planted_acceptance_patterns() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 4001)
    t = reference.argmax(logits).tolist()
    for drafts, accepted in (
        ([t[0], t[1], t[2]], 3),  # all accepted: bonus from row 3
        ([t[0] + 1, t[1], t[2]], 0),  # first rejected
        ([t[0], t[1] + 1, t[2]], 1),  # middle rejected
        ([t[0], -1, t[2]], 1),  # placeholder ends verification
    ):
        batch = _one_request(logits, drafts, 3)
        _check(batch, 2)
        got = emulate_greedy_verify(batch.logits, 3, *batch.args())
        assert int(got[1][0]) == accepted + 1
        assert int(got[0][0, accepted]) == t[accepted]


def test_bf16_ties_across_shards_and_winning_padding() -> None:
    vocab, tp = 32001, 2  # rank 1 holds [16032, 32001) + 63 padding columns
    logits = torch.randn(4, vocab).to(torch.bfloat16)
    logits[:, 16031] = 8.0  # last id of rank 0
    logits[:, 16032] = 8.0  # first id of rank 1: tie across the shard edge
    logits[2, 100] = 8.0
    drafts = [16031, 16031, 16032]
    batch = _one_request(logits, drafts, 3)
    _check(batch, tp)
    got = emulate_greedy_verify(batch.logits, tp, *batch.args())
    assert got[0][0].tolist() == [16031, 16031, 100, -1]
    shards = shard_like_vllm(logits, tp, pad_to=default_pad_to(vocab, tp))
    assert shards[1].num_valid < shards[1].local_logits.shape[1]  # padding exists and would win


def test_nan_rows_stay_in_vocabulary() -> None:
    logits = torch.randn(4, 5000)
    logits[0, 4321] = float("nan")
    logits[1, :] = float("nan")
    logits[2, :] = float("-inf")
    batch = _one_request(logits, [4321, 0, 0], 3)
    _check(batch, 4)
    got = emulate_greedy_verify(batch.logits, 4, *batch.args())
    assert got[0][0].tolist() == [4321, 0, 0, int(reference.argmax(logits[3:4]))]


def test_public_op_single_rank_matches_reference() -> None:
    batch = random_verify_batch(9, 3, 2500, seed=11, synthetic=True)
    want = batch.reference()
    got = shardmax.sharded_greedy_verify(
        batch.logits, *batch.args(), vocab_start=0, **batch.kwargs()
    )
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)
