"""Strict mode of sampled verification without vLLM: the block plan of real geometries, partition
invariance (every TP size and shard cut gives the same bits as one rank holding the whole row),
agreement with compact mode wherever compact mode is sure, no LSE-margin flag ever, vLLM's chunk
gate, and the errors. Parity with vLLM's own kernels: ``tests/test_strict_vllm.py``."""

from __future__ import annotations

import itertools

import pytest
import torch

import shardmax
from shardmax.ops import strict
from shardmax.ops.sampled import (
    FallbackReason,
    chunk_needs_processing,
    max_chunk_rows,
)
from shardmax.testing import emulate_verify, random_verify_batch, shard_like_vllm
from shardmax.testing.shards import default_pad_to

TEMPS = (0.0, 0.5, 0.7, 1.0, 1.3)


def _geometry(vocab: int, tp: int) -> list[tuple[int, int]]:
    shards = shard_like_vllm(torch.zeros(1, vocab), tp, pad_to=default_pad_to(vocab, tp))
    return [(sh.vocab_start, sh.num_valid) for sh in shards]


def test_plan_of_real_geometries() -> None:
    # V = 200064, TP 2: 100032 per rank; block 12 = [98304, 106496) is cut, block 24 (the last,
    # [196608, 200064)) lies inside rank 1 and is reduced there like any other
    p = strict.plan(_geometry(200064, 2))
    assert (p.num_blocks, p.full, p.cut_blocks) == (25, ((0, 12), (13, 12)), (12,))
    assert [(s.lo, s.hi) for s in p.segments[0]] == [(98304, 100032)]
    assert [(s.lo, s.hi) for s in p.segments[1]] == [(100032, 106496)]
    assert (p.slots, p.piece_width, p.max_full) == (1, 6464, 12)
    # 262144 at TP 2..8 and 131072 at TP 2/4/8: shard edges on the 8192 grid, no raw pieces
    for vocab, tp in ((262144, 2), (262144, 8), (131072, 4)):
        p = strict.plan(_geometry(vocab, tp))
        assert p.cut_blocks == () and p.piece_width == 0
        assert sum(n for _, n in p.full) == p.num_blocks
    # 50257 at TP 8: shards of 6288 < 8192, every block but the short last one (inside rank 7)
    # is cut, some by three ranks
    p = strict.plan(_geometry(50257, 8))
    assert p.full[:7] == ((0, 0), (1, 0), (2, 0), (3, 0), (4, 0), (4, 0), (5, 0))
    assert p.full[7] == (6, 1) and p.cut_blocks == tuple(range(6))
    spans = [sum(seg.cut == c for segs in p.segments for seg in segs) for c in p.cut_blocks]
    assert max(spans) == 3 and p.slots == 2
    # every id of every cut block is carried by exactly one rank
    for c, b in enumerate(p.cut_blocks):
        covered = sorted((s.lo, s.hi) for segs in p.segments for s in segs if s.cut == c)
        lo, hi = b * 8192, min((b + 1) * 8192, p.vocab)
        assert covered[0][0] == lo and covered[-1][1] == hi
        assert all(a[1] == b_[0] for a, b_ in itertools.pairwise(covered))
    # wire: 8 B per whole block and row + the raw pieces (bf16: 2 B per element)
    assert (
        strict.extras_words(p, 3, torch.bfloat16)
        == 3 * p.max_full + (3 * 2 * p.piece_width * 2 + 7) // 8
    )


def test_plan_rejects_gaps() -> None:
    with pytest.raises(ValueError, match="tile"):
        strict.plan([(0, 100), (120, 100)])


def _batch(seed: int, vocab: int, k: int, dtype: torch.dtype, temps_from=TEMPS, num_reqs: int = 6):
    gen = torch.Generator().manual_seed(seed)
    rows = num_reqs * (k + 1)
    logits = torch.randn(rows, vocab, generator=gen) * 3.0
    b = random_verify_batch(num_reqs, k, vocab, seed=seed, logits=logits.to(dtype))
    temps = torch.tensor(temps_from)[
        torch.randint(0, len(temps_from), (b.max_num_reqs,), generator=gen)
    ]
    return b, temps


def _emulate(b, temps, tp: int, **kw):
    a = b.args()
    return emulate_verify(b.logits, tp, *a[:5], temps, *a[5:], **b.kwargs(), **kw)


@pytest.mark.parametrize(
    ("vocab", "dtype", "k", "temps_from", "tps"),
    [
        (12000, torch.bfloat16, 3, TEMPS, (2, 8)),  # processed chunk (T != 0, 1)
        (12000, torch.bfloat16, 3, (0.0, 1.0), (3,)),  # raw chunk
        (9001, torch.float16, 5, TEMPS, (4,)),
        (10001, torch.float32, 1, (0.0, 1.0), (3, 8)),  # V % 16 != 0
    ],
)  # fmt: skip
def test_strict_is_partition_invariant(
    vocab: int, dtype: torch.dtype, k: int, temps_from, tps
) -> None:
    """TP 2/3/4/8 (cut blocks, blocks spanning three ranks) == one rank holding the whole row,
    on every output; no finite row is ever flagged."""
    b, temps = _batch(vocab + k, vocab, k, dtype, temps_from, num_reqs=4)
    fp64 = k == 1
    one = _emulate(b, temps, 1, mode="strict", use_fp64_gumbel=fp64)
    assert not bool(one.fallback.any()), one.reason
    for tp in tps:
        got = _emulate(b, temps, tp, mode="strict", use_fp64_gumbel=fp64)
        for name, g, w in zip(got._fields, got, one, strict=True):
            assert torch.equal(g, w), f"tp={tp} {name}:\n{g}\n{w}"


def _margin_batch(seed: int, vocab: int = 9001):
    """fp32 logits, every sampled request's first draft within 2 ulps of the threshold."""
    import math

    from shardmax.runtime.gumbel import acceptance_uniform_triton

    b, temps = _batch(seed, vocab, 2, torch.float32, (0.7, 1.0, 1.3), num_reqs=5)
    slots = b.idx_mapping.long()
    cu = b.cu_num_logits.tolist()
    gen = torch.Generator().manual_seed(seed)
    for r in range(len(cu) - 1):
        if cu[r + 1] - cu[r] < 2:
            continue
        row, d, t = cu[r], int(torch.randint(0, vocab, (1,), generator=gen)), float(temps[slots[r]])
        b.draft_sampled[row + 1] = d
        u, _ = acceptance_uniform_triton(b.seed[slots[r]].reshape(1), b.pos[row].reshape(1))
        x = b.logits[row].double() / t
        rest = torch.logsumexp(torch.cat([x[:d], x[d + 1 :]]), 0).item()
        target = math.log(float(u)) + rest - math.log1p(-float(u))
        v = torch.tensor([target * t], dtype=torch.float32)
        for _ in range(r % 5):
            v = torch.nextafter(v, torch.tensor([math.inf]))
        b.logits[row, d] = v[0]
    return b, temps


@pytest.mark.parametrize("tp", [2, 3])
def test_strict_never_flags_margin_rows_and_agrees_with_fast_elsewhere(tp: int) -> None:
    b, temps = _margin_batch(40 + tp)
    fast = _emulate(b, temps, tp, mode="fast")
    got = _emulate(b, temps, tp, mode="strict")
    assert int((fast.reason == FallbackReason.LSE_MARGIN).sum()) >= 2  # the batch bites
    assert not bool(got.fallback.any()), got.reason
    sure = ~fast.fallback
    for name, g, w in zip(got._fields[:3], got[:3], fast[:3], strict=True):
        assert torch.equal(g[sure], w[sure]), name
    assert torch.equal(got[:3][0], _emulate(b, temps, 1, mode="strict").sampled)


def test_strict_topk_rows_match_fast_where_fast_is_sure() -> None:
    b, temps = _batch(77, 12000, 3, torch.float32)
    top_k = torch.tensor([0, 1, 20, 50])[torch.randint(0, 4, (b.max_num_reqs,))].to(torch.int32)
    fast = _emulate(b, temps, 2, mode="fast", top_k=top_k)
    got = _emulate(b, temps, 2, mode="strict", top_k=top_k)
    assert not bool((got.reason == FallbackReason.LSE_MARGIN).any())
    sure = ~fast.fallback & ~got.fallback
    assert int(sure.sum()) >= 3
    for g, w in zip(got[:3], fast[:3], strict=True):
        assert torch.equal(g[sure], w[sure])
    one = _emulate(b, temps, 1, mode="strict", top_k=top_k)
    for g, w in zip(got, one, strict=True):
        assert torch.equal(g, w)


def test_public_op_strict_single_rank_and_empty_batch() -> None:
    b, temps = _batch(5, 9001, 3, torch.bfloat16)
    a = b.args()
    got = shardmax.sharded_verify(
        b.logits, *a[:5], temps, *a[5:], vocab_start=0, mode="strict", **b.kwargs()
    )
    want = _emulate(b, temps, 1, mode="strict")
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    e = random_verify_batch(0, 3, 9001, seed=1)
    out = shardmax.sharded_verify(
        e.logits, *e.args()[:5], temps, *e.args()[5:], vocab_start=0, mode="strict"
    )
    assert out.sampled.shape == (0, 4) and out.fallback.shape == (0,)


def test_chunk_gate_is_vllms() -> None:
    idx = torch.tensor([0, 2])
    t = torch.tensor([0.0, 0.7, 1.0])
    assert not chunk_needs_processing(idx, t, 100)  # greedy + T == 1: raw logits
    assert chunk_needs_processing(torch.tensor([1]), t, 100)  # T = 0.7
    k = torch.tensor([5, 0, 100])
    assert not chunk_needs_processing(idx, t, 100, top_k=k)  # top-k on a greedy slot, k == V
    assert chunk_needs_processing(idx, t, 100, top_k=torch.tensor([0, 0, 99]))
    assert chunk_needs_processing(idx, t, 100, top_p=torch.tensor([1.0, 1.0, 0.9]))
    assert chunk_needs_processing(idx, t, 100, min_p=torch.tensor([0.0, 0.0, 0.1]))
    assert max_chunk_rows(200064) == 1341 and max_chunk_rows(2**31) == 1


def test_strict_errors() -> None:
    import numpy as np

    b, temps = _batch(3, 9001, 1, torch.float32)
    a = b.args()
    with pytest.raises(TypeError, match="logits_processed"):
        _emulate(b, temps, 2, mode="strict", logits_processed="yes")
    with pytest.raises(TypeError, match=r"numpy\.bool"):
        _emulate(b, temps, 2, mode="strict", logits_processed=np.bool_(True))
    # T = 0.7 somewhere: vLLM never verifies that chunk raw
    t07 = torch.full_like(temps, 0.7)
    with pytest.raises(ValueError, match="needs logits processing"):
        _emulate(b, t07, 2, mode="strict", logits_processed=False)
    top_k = torch.full((b.max_num_reqs,), 5, dtype=torch.int32)
    temps1 = torch.ones_like(temps)
    with pytest.raises(ValueError, match="logits_processed: False"):
        _emulate(b, temps1, 2, mode="strict", logits_processed=False, top_k=top_k)
    del a
    # the chunk limit (5 rows > 1 row at V = 2**28) is checked when the step is planned: no
    # 1 GB logits (a shard of 16 real columns in a group whose geometry says V = 2**28)
    from shardmax.ops.sampled import SampledVerifyPlan
    from shardmax.runtime.geometry import Geometry
    from shardmax.runtime.shard import ShardContext
    from shardmax.testing.emulate import EmulatedRank

    geo = Geometry(((0, 16), (16, 2**28 - 16)), 16, torch.float32)
    ctx = ShardContext(EmulatedRank(0, 2), geo, 0, torch.device("cpu"))
    with pytest.raises(ValueError, match="exceed one vLLM verification chunk"):
        SampledVerifyPlan(ctx, 5, 16, mode="strict")


def test_strict_models_the_row_stride_of_a_sliced_view(monkeypatch: pytest.MonkeyPatch) -> None:
    """A TP-1 caller passing vLLM's own sliced view (``[:, :V]`` of the padded LM-head output):
    vLLM's row stride is the padded width, and strict mode must model that one, not ``V``."""
    import shardmax.ops.sampled as sm

    b, temps = _batch(8, 10001, 1, torch.bfloat16)  # V % 16 != 0
    padded = torch.zeros(b.logits.shape[0], 10048, dtype=torch.bfloat16)
    padded[:, :10001] = b.logits
    view = padded[:, :10001]
    seen = []
    real = sm.strict_mod.StrictLayout

    def spy(p, processed, dtype, row_stride, *rest):
        seen.append(row_stride)
        return real(p, processed, dtype, row_stride, *rest)

    monkeypatch.setattr(sm.strict_mod, "StrictLayout", spy)
    a = b.args()
    got = shardmax.sharded_verify(view, *a[:5], temps, *a[5:], vocab_start=0, mode="strict",
                                  **b.kwargs())  # fmt: skip
    assert seen == [10048] and strict.vllm_row_stride(False, 1, seen[0], 10001) % 16 == 0
    want = _emulate(b, temps, 1, mode="strict")
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
