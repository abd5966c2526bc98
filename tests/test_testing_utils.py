"""Test utilities: vLLM shard layout, adversarial logits, verify batches, assert_same_ids."""

from __future__ import annotations

import math

import pytest
import torch

import shardmax.testing as testing
from shardmax.reference import argmax, argmax_of_shards
from shardmax.testing import (
    ADVERSARIAL_CASES,
    Shard,
    VerifyBatch,
    adversarial_logits,
    assert_same_ids,
    random_verify_batch,
    shard_like_vllm,
)
from shardmax.testing.shards import vllm_shard_ranges

DTYPES = [torch.bfloat16, torch.float16, torch.float32]

# (name, vocab): real model vocabularies
REAL_VOCABS = [
    ("llama2", 32000),
    ("llama2-extra-token", 32001),
    ("gpt2", 50257),
    ("llama3", 128256),
    ("deepseek-v3", 129280),
    ("qwen2", 151936),
    ("qwen2.5-7b", 152064),
    ("phi4-mini", 200064),
    ("gemma2", 256000),
    ("gemma3", 262144),
]


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.float().view(torch.int32)


# ------------------------------------------------------------------------------------------
# shard_like_vllm
# ------------------------------------------------------------------------------------------


def test_shard_layout_32001_tp2():
    x = torch.randn(3, 32001)
    s0, s1 = shard_like_vllm(x, 2)
    assert isinstance(s0, Shard)
    assert (s0.vocab_start, s0.num_valid, s0.local_logits.shape) == (0, 16032, (3, 16032))
    assert (s1.vocab_start, s1.num_valid, s1.local_logits.shape) == (16032, 15969, (3, 16032))
    assert s1.local_logits.shape[1] - s1.num_valid == 63
    assert torch.equal(s0.local_logits, x[:, :16032])
    assert torch.equal(s1.local_logits[:, :15969], x[:, 16032:])


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize(("name", "vocab"), REAL_VOCABS, ids=[n for n, _ in REAL_VOCABS])
def test_real_vocab_layouts(name, vocab, tp):
    padded = math.ceil(vocab / 64) * 64
    if padded % tp:
        with pytest.raises(ValueError, match=rf"{padded}.*tp_size={tp}"):
            vllm_shard_ranges(vocab, tp)
        with pytest.raises(ValueError, match=rf"{padded}.*tp_size={tp}"):
            shard_like_vllm(torch.zeros(1, vocab), tp)
        return
    ranges = vllm_shard_ranges(vocab, tp)
    width = padded // tp
    assert len(ranges) == tp
    expected_start = 0
    for r, (start, num_valid, w) in enumerate(ranges):
        assert w == width
        assert start == min(r * width, vocab)
        assert start == expected_start
        assert 0 <= num_valid <= width
        expected_start += num_valid
    assert expected_start == vocab
    # padding only where the padded range crosses V: at most the last non-empty rank
    padded_ranks = [r for r, (_, n, w) in enumerate(ranges) if 0 < n < w]
    assert len(padded_ranks) <= 1


def test_real_vocab_tensor_split_tp3():
    x = torch.randn(2, 128256, dtype=torch.bfloat16)
    shards = shard_like_vllm(x, 3)
    assert [s.num_valid for s in shards] == [42752, 42752, 42752]
    assert torch.equal(torch.cat([s.local_logits[:, : s.num_valid] for s in shards], 1), x)


def test_tiny_vocab_large_tp_has_empty_ranks():
    x = torch.randn(4, 10)
    shards = shard_like_vllm(x, 8)
    assert [s.num_valid for s in shards] == [8, 2, 0, 0, 0, 0, 0, 0]
    assert [s.vocab_start for s in shards] == [0, 8, 10, 10, 10, 10, 10, 10]
    assert all(s.local_logits.shape == (4, 8) for s in shards)
    assert_same_ids(argmax_of_shards(shards), argmax(x), x)


@pytest.mark.parametrize(("tp", "pad_to"), [(0, 64), (-1, 64), (2, 0)])
def test_shard_rejects_bad_sizes(tp, pad_to):
    with pytest.raises(ValueError, match=r"tp_size|pad_to"):
        shard_like_vllm(torch.zeros(1, 100), tp, pad_to)


def test_shard_rejects_indivisible():
    with pytest.raises(ValueError, match=r"padded vocab 32064 .* tp_size=5"):
        shard_like_vllm(torch.zeros(1, 32001), 5)
    with pytest.raises(ValueError, match="2-D"):
        shard_like_vllm(torch.zeros(32001), 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_padding_would_win(dtype):
    x = torch.randn(6, 32001).to(dtype)
    shards = shard_like_vllm(x, 2)
    pad = shards[1].local_logits[:, shards[1].num_valid :]
    assert bool(torch.isnan(pad[0]).all()) and bool(torch.isnan(pad[3]).all())
    assert bool((pad[1] == math.inf).all()) and bool((pad[4] == math.inf).all())
    assert bool((pad[2] == torch.finfo(dtype).max).all())
    raw = torch.cat([s.local_logits for s in shards], dim=1)
    raw_ids = argmax(raw)
    ref = argmax(x)
    assert bool((raw_ids != ref).all())
    assert bool((raw_ids >= 32001).all())  # a padding column wins the unmasked concatenation
    assert_same_ids(argmax_of_shards(shards), ref, x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shards_are_new_contiguous_same_dtype(dtype):
    x = torch.randn(5, 300).to(dtype)
    for s in shard_like_vllm(x, 4):
        assert s.local_logits.dtype == dtype
        assert s.local_logits.device == x.device
        assert s.local_logits.is_contiguous()
        assert s.local_logits.data_ptr() != x.data_ptr()


def test_shard_empty_batch():
    shards = shard_like_vllm(torch.empty(0, 100), 2)
    assert [s.local_logits.shape for s in shards] == [(0, 64), (0, 64)]


# ------------------------------------------------------------------------------------------
# adversarial_logits
# ------------------------------------------------------------------------------------------


def test_case_list():
    assert len(ADVERSARIAL_CASES) == len(set(ADVERSARIAL_CASES)) == 20
    assert ADVERSARIAL_CASES[0] == "random_normal"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_adversarial_deterministic(dtype):
    a = adversarial_logits(45, 999, dtype=dtype, seed=5, tp_size=2, block=128)
    b = adversarial_logits(45, 999, dtype=dtype, seed=5, tp_size=2, block=128)
    c = adversarial_logits(45, 999, dtype=dtype, seed=6, tp_size=2, block=128)
    assert a.dtype == dtype and a.shape == (45, 999)
    assert torch.equal(_bits(a), _bits(b))
    assert not torch.equal(_bits(a), _bits(c))


def _row(case: str, rep: int = 0) -> int:
    return ADVERSARIAL_CASES.index(case) + rep * len(ADVERSARIAL_CASES)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_adversarial_cases_are_what_they_claim(dtype):
    vocab, tp, block = 3050, 3, 256
    x = adversarial_logits(
        3 * len(ADVERSARIAL_CASES), vocab, dtype=dtype, seed=1, tp_size=tp, block=block
    )
    ids = argmax(x)
    assert_same_ids(ids, torch.argmax(x, dim=-1), x)
    starts = [s for s, n, _ in vllm_shard_ranges(vocab, tp) if 0 < s < vocab]
    for rep in range(3):

        def row(case, rep=rep):
            return x[_row(case, rep)]

        def win(case, rep=rep):
            return int(ids[_row(case, rep)])

        for case in (
            "tie_in_block",
            "tie_block_edge",
            "tie_shard_edge",
            "tie_across_shards",
            "coarse_values",
        ):
            r = row(case).float()
            assert int((r == r.max()).sum()) >= 2, case
        r = row("tie_in_block").float()
        tied = (r == r.max()).nonzero().flatten()
        assert len({int(t) // block for t in tied}) == 1
        w = win("tie_block_edge")
        assert (w + 1) % block == 0 and row("tie_block_edge")[w + 1] == row("tie_block_edge")[w]
        w = win("tie_shard_edge")
        assert w + 1 in starts and row("tie_shard_edge")[w + 1] == row("tie_shard_edge")[w]
        r = row("tie_across_shards").float()
        tied = (r == r.max()).nonzero().flatten().tolist()
        assert tied[0] < starts[0] and tied[-1] >= starts[-1]
        assert float(row("posinf_single").float().max()) == math.inf
        assert int((row("posinf_tied").float() == math.inf).sum()) == 3
        assert win("all_neginf") == 0 and bool((row("all_neginf") == -math.inf).all())
        assert int(torch.isfinite(row("neginf_one_finite")).sum()) == 1
        for case in ("signed_zero_max", "signed_zero_max_rev"):
            r = row(case).float()
            zeros = (r == 0).nonzero().flatten().tolist()
            assert len(zeros) == 2 and win(case) == zeros[0]
            assert bool((r[r != 0] < 0).all())
            signs = [math.copysign(1.0, float(r[z])) for z in zeros]
            assert sorted(signs) == [-1.0, 1.0]
        assert int(torch.isnan(row("nan_single")).sum()) == 1
        assert int(torch.isnan(row("nan_several")).sum()) == 3
        assert win("nan_last_id") == vocab - 1
        r = row("nan_with_posinf").float()
        nan_id = int(torch.isnan(r).nonzero())
        infs = (r == math.inf).nonzero().flatten().tolist()
        assert infs[0] < nan_id < infs[-1] and win("nan_with_posinf") == nan_id
        assert win("all_nan") == 0 and bool(torch.isnan(row("all_nan")).all())
        assert win("all_equal") == 0
        assert win("max_at_first") == 0
        assert win("max_at_last") == vocab - 1


@pytest.mark.parametrize("vocab", [1, 2, 3, 65])
def test_adversarial_tiny_vocab(vocab):
    x = adversarial_logits(40, vocab, dtype=torch.float32, seed=0, tp_size=1)
    assert_same_ids(argmax(x), torch.argmax(x, dim=-1), x)


def test_adversarial_validates_and_device():
    with pytest.raises(ValueError):
        adversarial_logits(2, 0, dtype=torch.float32, seed=0)
    with pytest.raises(ValueError):
        adversarial_logits(2, 10, dtype=torch.int32, seed=0)
    with pytest.raises(ValueError, match="tp_size=0"):
        adversarial_logits(2, 100, dtype=torch.float32, seed=0, tp_size=0)
    # padded 128 does not split over 3 ranks: the shard cases use pad_to = 64 * 3 instead
    x = adversarial_logits(len(ADVERSARIAL_CASES), 100, dtype=torch.float32, seed=0, tp_size=3)
    w = int(argmax(x)[ADVERSARIAL_CASES.index("tie_shard_edge")])
    assert w + 1 == 64
    assert adversarial_logits(0, 10, dtype=torch.float32, seed=0).shape == (0, 10)
    assert adversarial_logits(2, 10, dtype=torch.float32, seed=0, device="cpu").device.type == "cpu"


# ------------------------------------------------------------------------------------------
# random_verify_batch
# ------------------------------------------------------------------------------------------


def _check_structure(b: VerifyBatch, vocab: int) -> None:
    k = b.num_speculative_steps
    n = b.num_reqs
    assert b.cu_num_logits.dtype == torch.int32 and b.cu_num_logits.shape == (n + 1,)
    assert b.idx_mapping.dtype == torch.int32 and b.idx_mapping.shape == (n,)
    assert b.draft_sampled.dtype == torch.int32 and b.draft_sampled.shape == (b.num_logits,)
    assert b.expanded_local_pos.dtype == torch.int32
    assert b.pos.dtype == torch.int64 and b.seed.dtype == torch.int64
    assert b.seq_lens.dtype == torch.int32 and b.seq_lens.shape == (n,)
    assert b.prefill_len.dtype == torch.int32 and b.prefill_len.shape == (b.max_num_reqs,)
    assert b.max_num_reqs >= n
    assert b.logits.shape == (b.num_logits, vocab)
    cu = b.cu_num_logits.tolist()
    assert cu[0] == 0 and cu[-1] == b.num_logits
    slots = b.idx_mapping.tolist()
    assert len(set(slots)) == n and all(0 <= s < b.max_num_reqs for s in slots)
    if n > 1:
        assert slots != list(range(n))
    for r in range(n):
        rows = cu[r + 1] - cu[r]
        assert 1 <= rows <= k + 1
        assert b.expanded_local_pos[cu[r] : cu[r + 1]].tolist() == list(range(rows))
        p = b.pos[cu[r] : cu[r + 1]].tolist()
        assert p == list(range(p[0], p[0] + rows))
        chunked = int(b.seq_lens[r]) < int(b.prefill_len[slots[r]])
        if chunked:
            assert rows == 1
    d = b.draft_sampled.tolist()
    assert all(-1 <= t < vocab for t in d)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_verify_batch_structure_and_reference(seed):
    b = random_verify_batch(40, 4, 200, seed=seed, prefill_prob=0.15)
    _check_structure(b, 200)
    sampled, num_sampled, num_rejected = b.reference()
    assert sampled.shape == (40, 5)
    cu = b.cu_num_logits.tolist()
    target = argmax(b.logits)
    chunked = b.seq_lens < b.prefill_len[b.idx_mapping.long()]
    accepted_counts = []
    for r in range(40):
        ns = int(num_sampled[r])
        if chunked[r]:
            assert ns == 0 and int(num_rejected[r]) == 0
            assert sampled[r].tolist() == [-1] * 5
            continue
        rows = cu[r + 1] - cu[r]
        assert ns + int(num_rejected[r]) == rows
        acc = ns - 1
        accepted_counts.append(acc)
        # accepted drafts equal both the draft and the target argmax; then the target argmax
        for i in range(acc):
            assert (
                int(sampled[r, i]) == int(b.draft_sampled[cu[r] + i + 1]) == int(target[cu[r] + i])
            )
        assert int(sampled[r, acc]) == int(target[cu[r] + acc])
        assert sampled[r, ns:].tolist() == [-1] * (5 - ns)
    assert bool(chunked.any())
    assert min(accepted_counts) == 0 and max(accepted_counts) >= 2
    assert bool((b.draft_sampled == -1).any())


def test_random_verify_batch_deterministic():
    a = random_verify_batch(10, 3, 64, seed=9, synthetic=True)
    b = random_verify_batch(10, 3, 64, seed=9, synthetic=True)
    for f in (
        "logits",
        "draft_sampled",
        "cu_num_logits",
        "pos",
        "idx_mapping",
        "seed",
        "prefill_len",
        "seq_lens",
    ):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert a.synthetic_conditional_rates is not None and b.synthetic_conditional_rates is not None
    assert torch.equal(a.synthetic_conditional_rates, b.synthetic_conditional_rates)
    r = a.synthetic_conditional_rates
    assert r.dtype == torch.float32 and r.shape == (3,)
    assert bool(((r >= 0) & (r <= 1)).all())


def test_random_verify_batch_empty():
    b = random_verify_batch(0, 3, 50, seed=0)
    assert b.cu_num_logits.tolist() == [0]
    assert b.logits.shape == (0, 50) and b.draft_sampled.shape == (0,)
    sampled, num_sampled, num_rejected = b.reference()
    assert sampled.shape == (0, 4) and num_sampled.shape == (0,) and num_rejected.shape == (0,)


def test_random_verify_batch_k0_and_given_logits():
    b = random_verify_batch(5, 0, 30, seed=3)
    assert b.cu_num_logits.tolist() == [0, 1, 2, 3, 4, 5]
    adv = adversarial_logits(7, 300, dtype=torch.bfloat16, seed=0)
    b = random_verify_batch(12, 3, 300, seed=4, logits=adv)
    assert b.logits.dtype == torch.bfloat16
    for j in range(b.num_logits):
        assert torch.equal(_bits(b.logits[j]), _bits(adv[j % 7]))
    with pytest.raises(ValueError, match="vocab"):
        random_verify_batch(3, 2, 301, seed=0, logits=adv)


def test_verify_batch_args_order():
    b = random_verify_batch(3, 2, 20, seed=0)
    args = b.args()
    assert args[0] is b.draft_sampled and args[1] is b.cu_num_logits and args[2] is b.pos
    assert args[3] is b.idx_mapping and args[4] is b.expanded_local_pos and args[5] is b.seed
    assert args[6] == 2
    assert list(b.kwargs()) == ["synthetic_conditional_rates", "seq_lens", "prefill_len"]


# ------------------------------------------------------------------------------------------
# assert_same_ids and the package
# ------------------------------------------------------------------------------------------


def test_assert_same_ids_passes_and_reports():
    x = torch.tensor([[1.0, 3.0, 3.0], [0.0, 0.0, 5.0], [float("nan"), 1.0, float("nan")]])
    expected = torch.tensor([1, 2, 0])
    assert_same_ids(expected.to(torch.int32), expected)
    with pytest.raises(AssertionError) as err:
        assert_same_ids(torch.tensor([2, 2, 2]), expected, x)
    msg = str(err.value)
    assert "2 of 3 ids differ" in msg
    assert "row 0: actual 2, expected 1" in msg
    assert "values actual 3.0, expected 3.0; tie set [1, 2]" in msg
    assert "row 2: actual 2, expected 0; values actual nan, expected nan; tie set [0, 2]" in msg
    with pytest.raises(AssertionError, match="shape"):
        assert_same_ids(torch.tensor([1, 2]), expected)
    with pytest.raises(AssertionError, match="integer"):
        assert_same_ids(expected.float(), expected)
    with pytest.raises(AssertionError, match=r"at \(1, 0\)"):
        assert_same_ids(torch.tensor([[1, 2], [3, 4]]), torch.tensor([[1, 2], [0, 4]]))


def test_testing_package_exports():
    for name in testing.__all__:
        if name.startswith("emulate_"):
            continue  # lazily imported from shardmax.testing.emulate
        assert hasattr(testing, name), name
    assert {"emulate_greedy_verify", "emulate_vocab_parallel_argmax"} <= set(testing.__all__)
    with pytest.raises(AttributeError):
        _ = testing.no_such_name  # type: ignore[attr-defined]


def test_demo_runs_end_to_end_on_a_small_geometry(capsys: pytest.CaptureFixture[str]) -> None:
    """The main job's demo (argmax, greedy verification, strict + fast sampled requests) exits 0
    only when every part equals its reference."""
    from shardmax import demo

    assert demo.main(["--vocab", "9001", "--tp", "3", "--rows", "8", "--reqs", "2"]) == 0
    out = capsys.readouterr().out
    assert "[sampled]" in out and "strict:" in out and "== reference on the others: True" in out


def test_repeated_rank_tiles_and_a_group_of_one_returns_its_input():
    """The single-GPU timing stand-in: TP > 1 tiles rank 0's bytes, TP 1 copies nothing (as the
    runtime's own group of one), so a TP 1 timing has no copy a real step would not make."""
    from shardmax.runtime.collectives import SingleRank
    from shardmax.testing.emulate import RepeatedRank

    t = torch.arange(6, dtype=torch.int64).view(1, 6)
    assert RepeatedRank(1).all_gather_dim0(t) is t is SingleRank().all_gather_dim0(t)
    got = RepeatedRank(3).all_gather_dim0(t)
    assert got.shape == (3, 6) and torch.equal(got, t.expand(3, 6))
    assert got.data_ptr() != t.data_ptr()
    assert RepeatedRank(4).all_reduce_max(t) is t
