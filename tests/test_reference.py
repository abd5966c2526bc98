"""Reference argmax, synthetic uniform and greedy verification (shardmax.reference)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from shardmax.reference import (
    argmax,
    argmax_of_shards,
    get_num_sampled_and_rejected,
    greedy_verify,
    rejection_sample_greedy,
    synthetic_rates_from_length,
    synthetic_uniform,
    unconditional_to_conditional_rates,
)
from shardmax.runtime import rand as _rand
from shardmax.testing import adversarial_logits, assert_same_ids, shard_like_vllm

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
REAL_VOCABS = [50257, 128256, 151936, 200064, 262144]

needs_rand = pytest.mark.skipif(
    not _rand._interpreted(),
    reason="synthetic_uniform on CPU needs TRITON_INTERPRET=1 before importing triton",
)


# ------------------------------------------------------------------------------------------
# argmax
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("vocab", "tp", "block"), [(3000, 2, 512), (32001, 2, None), (705, 3, 64)])
def test_argmax_matches_torch_on_adversarial_rows(dtype, vocab, tp, block):
    x = adversarial_logits(60, vocab, dtype=dtype, seed=vocab + tp, tp_size=tp, block=block)
    assert_same_ids(argmax(x), torch.argmax(x, dim=-1), x)


@pytest.mark.parametrize("vocab", REAL_VOCABS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_argmax_matches_torch_on_real_vocabs(vocab, dtype):
    x = adversarial_logits(20, vocab, dtype=dtype, seed=7, tp_size=8, block=8192)
    assert_same_ids(argmax(x), torch.argmax(x, dim=-1), x)
    plain = torch.randn(3, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype)
    assert_same_ids(argmax(plain), torch.argmax(plain, dim=-1), plain)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_argmax_empty_batch(dtype):
    out = argmax(torch.empty(0, 50, dtype=dtype))
    assert out.dtype == torch.int64
    assert out.shape == (0,)


def test_argmax_rejects_bad_input():
    with pytest.raises(ValueError, match="2-D"):
        argmax(torch.zeros(5))
    with pytest.raises(ValueError, match="float"):
        argmax(torch.zeros(2, 5, dtype=torch.int32))
    with pytest.raises(ValueError, match="empty vocabulary"):
        argmax(torch.zeros(2, 0))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_argmax_signed_zero_tie(dtype):
    x = torch.full((2, 6), -1.0, dtype=dtype)
    x[0, 2], x[0, 4] = -0.0, 0.0
    x[1, 2], x[1, 4] = 0.0, -0.0
    assert argmax(x).tolist() == [2, 2]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_argmax_nan_first(dtype):
    inf, nan = float("inf"), float("nan")
    x = torch.tensor(
        [
            [inf, 1.0, nan, inf, nan],
            [nan, nan, nan, nan, nan],
            [0.0, 1.0, 2.0, 3.0, nan],
            [-inf, -inf, nan, -inf, -inf],
        ],
        dtype=dtype,
    )
    assert argmax(x).tolist() == [2, 0, 4, 2]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_argmax_all_neginf_and_ties(dtype):
    inf = float("inf")
    x = torch.tensor(
        [
            [-inf] * 5,
            [1.0, 3.0, 3.0, 0.0, 3.0],
            [inf, 2.0, inf, 0.0, 0.0],
            [-inf, -inf, -9.0, -inf, -9.0],
        ],
        dtype=dtype,
    )
    assert argmax(x).tolist() == [0, 1, 0, 2]


def test_argmax_non_contiguous_rows():
    x = torch.randn(8, 40, generator=torch.Generator().manual_seed(0))[::2, 3:]
    assert_same_ids(argmax(x), torch.argmax(x, dim=-1), x)


@pytest.mark.parametrize(("vocab", "tp"), [(32001, 2), (3050, 3), (10, 8), (129, 4)])
def test_argmax_of_shards_equals_full(vocab, tp):
    x = adversarial_logits(40, vocab, dtype=torch.bfloat16, seed=3, tp_size=tp)
    assert_same_ids(argmax_of_shards(shard_like_vllm(x, tp)), argmax(x), x)


def test_argmax_of_shards_validates():
    x = torch.randn(2, 100)
    shards = shard_like_vllm(x, 2)
    with pytest.raises(ValueError, match="vocab_start"):
        argmax_of_shards([shards[1], shards[0]])
    with pytest.raises(ValueError, match="at least one"):
        argmax_of_shards([])
    with pytest.raises(ValueError, match="num_valid"):
        argmax_of_shards([(x, 0, 101)])


# ------------------------------------------------------------------------------------------
# synthetic uniform
# ------------------------------------------------------------------------------------------


@triton.jit
def _direct_rand_kernel(seed_ptr, pos_ptr, out_ptr):
    # One program per element, scalar loads: the way vLLM's per-request kernel draws it.
    i = tl.program_id(0)
    seed = tl.load(seed_ptr + i)
    pos = tl.load(pos_ptr + i)
    u = tl.rand(seed, pos)
    tl.store(out_ptr + i, tl.maximum(u, 4.6566127342e-10))


def _seeds_and_positions(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    seed = torch.randint(-(2**63), 2**63 - 1, (n,), dtype=torch.int64, generator=g)
    seed[:4] = torch.tensor([0, 1, -1, 2**62])
    pos = torch.randint(0, 2**20, (n,), dtype=torch.int64, generator=g)
    pos[:4] = torch.tensor([0, 2**32 + 5, 2**40, 123])
    return seed, pos


@needs_rand
def test_synthetic_uniform_matches_direct_tl_rand():
    seed, pos = _seeds_and_positions(300)
    u = synthetic_uniform(seed, pos)
    direct = torch.empty(300, dtype=torch.float32)
    _direct_rand_kernel[(300,)](seed, pos, direct)
    assert u.dtype == torch.float32
    assert torch.equal(u.view(torch.int32), direct.view(torch.int32))
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert float(u.min()) >= _rand.RAND_MIN
    # int64 seed high word and position high word both matter
    assert len(set(u.tolist())) > 290


@needs_rand
def test_synthetic_uniform_edge_cases():
    assert synthetic_uniform(
        torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)
    ).shape == (0,)
    with pytest.raises(ValueError, match="int64"):
        synthetic_uniform(torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="1-D"):
        synthetic_uniform(torch.zeros(3, dtype=torch.int64), torch.zeros(4, dtype=torch.int64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_synthetic_uniform_cuda_matches_cpu_interpreter_values():
    seed, pos = _seeds_and_positions(300)
    u = synthetic_uniform(seed.cuda(), pos.cuda())
    direct = torch.empty(300, dtype=torch.float32, device="cuda")
    _direct_rand_kernel[(300,)](seed.cuda(), pos.cuda(), direct)
    assert torch.equal(u.cpu().view(torch.int32), direct.cpu().view(torch.int32))


def test_rate_helpers():
    c = unconditional_to_conditional_rates([1.0, 0.5, 0.25, 0.0, 0.0])
    assert c.dtype == torch.float32
    assert c.tolist() == [1.0, 0.5, 0.5, 0.0, 0.0]
    assert unconditional_to_conditional_rates([]).shape == (0,)
    with pytest.raises(ValueError):
        unconditional_to_conditional_rates([1.5])
    assert synthetic_rates_from_length(2.5, 4) == [1.0, 0.5, 0.0, 0.0]
    assert synthetic_rates_from_length(1, 3) == [0.0, 0.0, 0.0]
    assert synthetic_rates_from_length(4, 3) == [1.0, 1.0, 1.0]
    assert synthetic_rates_from_length(3, 2) == [1.0, 1.0]
    with pytest.raises(ValueError):
        synthetic_rates_from_length(0.5, 3)
    with pytest.raises(ValueError):
        synthetic_rates_from_length(5, 3)


# ------------------------------------------------------------------------------------------
# greedy verification, hand-built batches
# ------------------------------------------------------------------------------------------

V = 16


def _batch(reqs, k, *, idx_dtype=torch.int32, vocab=V):
    """reqs: list of (drafts, targets) with len(targets) == len(drafts) + 1."""
    rows, draft_sampled, cu, pos, local = [], [], [0], [], []
    for r, (drafts, targets) in enumerate(reqs):
        assert len(targets) == len(drafts) + 1
        draft_sampled += [vocab - 1 - r, *drafts]
        for j, t in enumerate(targets):
            row = torch.full((vocab,), -1.0)
            row[t] = 2.0
            rows.append(row)
            pos.append(100 * r + 40 + j)
            local.append(j)
        cu.append(cu[-1] + len(targets))
    n = len(reqs)
    max_num_reqs = n + 3
    idx_mapping = torch.tensor([(3 * r + 2) % max_num_reqs for r in range(n)], dtype=idx_dtype)
    return dict(
        target_logits=torch.stack(rows) if rows else torch.empty(0, vocab),
        draft_sampled=torch.tensor(draft_sampled, dtype=torch.int32),
        cu_num_logits=torch.tensor(cu, dtype=torch.int32),
        pos=torch.tensor(pos, dtype=torch.int64),
        idx_mapping=idx_mapping,
        expanded_local_pos=torch.tensor(local, dtype=torch.int32),
        seed=torch.arange(max_num_reqs, dtype=torch.int64) * 1_000_003 - 7,
        num_speculative_steps=k,
    )


def _verify(b, **kw):
    return greedy_verify(
        b["target_logits"],
        b["draft_sampled"],
        b["cu_num_logits"],
        b["pos"],
        b["idx_mapping"],
        b["expanded_local_pos"],
        b["seed"],
        b["num_speculative_steps"],
        **kw,
    )


GREEDY_CASES = {
    # name: ((drafts, targets), expected sampled row, num_sampled, num_rejected)
    "all_accepted": (([3, 5, 7], [3, 5, 7, 9]), [3, 5, 7, 9], 4, 0),
    "first_rejected": (([3, 5, 7], [2, 5, 7, 9]), [2, -1, -1, -1], 1, 3),
    "middle_rejected": (([3, 5, 7], [3, 4, 7, 9]), [3, 4, -1, -1], 2, 2),
    "last_rejected": (([3, 5, 7], [3, 5, 8, 9]), [3, 5, 8, -1], 3, 1),
    "placeholder": (([3, -1, 7], [3, 5, 7, 9]), [3, 5, -1, -1], 2, 2),
    "placeholder_first": (([-1, 5, 7], [3, 5, 7, 9]), [3, -1, -1, -1], 1, 3),
    "zero_drafts": (([], [6]), [6, -1, -1, -1], 1, 0),
    "fewer_drafts_all_accepted": (([4], [4, 11]), [4, 11, -1, -1], 2, 0),
}


@pytest.mark.parametrize("name", list(GREEDY_CASES))
def test_greedy_single_request(name):
    req, row, ns, nr = GREEDY_CASES[name]
    b = _batch([req], 3)
    sampled, num_sampled, num_rejected = _verify(b)
    assert sampled.dtype == torch.int64 and sampled.shape == (1, 4)
    assert num_sampled.dtype == torch.int32 and num_rejected.dtype == torch.int32
    assert sampled[0].tolist() == row
    assert num_sampled.tolist() == [ns]
    assert num_rejected.tolist() == [nr]


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64], ids=str)
def test_greedy_batch_of_all_cases(idx_dtype):
    cases = list(GREEDY_CASES.values())
    b = _batch([c[0] for c in cases], 3, idx_dtype=idx_dtype)
    sampled, num_sampled, num_rejected = _verify(b)
    assert sampled.tolist() == [c[1] for c in cases]
    assert num_sampled.tolist() == [c[2] for c in cases]
    assert num_rejected.tolist() == [c[3] for c in cases]


def test_bonus_and_rejection_use_tie_break_lowest_id():
    b = _batch([([3, 5], [3, 5, 9]), ([3], [2, 9])], 2)
    b["target_logits"][2, 4] = 2.0  # bonus row of request 0: tie 4 vs 9 -> 4
    b["target_logits"][3, 1] = 2.0  # rejection row of request 1: tie 1 vs 2 -> 1
    sampled, num_sampled, _ = _verify(b)
    assert sampled.tolist() == [[3, 5, 4], [1, -1, -1]]
    assert num_sampled.tolist() == [3, 1]


def test_rejection_sample_greedy_raw_output_and_validation():
    b = _batch([([3, 5, 7], [3, 4, 7, 9])], 3)
    sampled, num_sampled = rejection_sample_greedy(**b)
    assert sampled.tolist() == [[3, 4, -1, -1]]
    assert num_sampled.dtype == torch.int32 and num_sampled.tolist() == [2]
    bad = dict(b, num_speculative_steps=2)  # 4 rows > K + 1
    with pytest.raises(ValueError, match="logits rows"):
        rejection_sample_greedy(**bad)
    with pytest.raises(ValueError, match="pos"):
        rejection_sample_greedy(**dict(b, pos=b["pos"][:-1]))


def test_empty_batch():
    b = _batch([], 3)
    sampled, num_sampled, num_rejected = _verify(
        b, seq_lens=torch.empty(0, dtype=torch.int32), prefill_len=torch.zeros(3, dtype=torch.int32)
    )
    assert sampled.shape == (0, 4) and num_sampled.shape == (0,) and num_rejected.shape == (0,)


@needs_rand
def test_synthetic_rate_one_accepts_all_but_placeholders():
    b = _batch([([3, 5, 7], [0, 0, 0, 9]), ([3, -1, 7], [1, 2, 0, 9]), ([], [6])], 3)
    rates = torch.ones(3, dtype=torch.float32)
    sampled, num_sampled, num_rejected = _verify(b, synthetic_conditional_rates=rates)
    assert sampled.tolist() == [[3, 5, 7, 9], [3, 2, -1, -1], [6, -1, -1, -1]]
    assert num_sampled.tolist() == [4, 2, 1]
    assert num_rejected.tolist() == [0, 2, 0]


@needs_rand
def test_synthetic_rate_zero_accepts_none():
    b = _batch([([3, 5, 7], [3, 5, 7, 9]), ([2], [2, 4])], 3)
    rates = torch.zeros(3, dtype=torch.float32)
    sampled, num_sampled, num_rejected = _verify(b, synthetic_conditional_rates=rates)
    assert sampled.tolist() == [[3, -1, -1, -1], [2, -1, -1, -1]]
    assert num_sampled.tolist() == [1, 1]
    assert num_rejected.tolist() == [3, 1]


@needs_rand
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64], ids=str)
def test_synthetic_fractional_rates_follow_u(idx_dtype):
    reqs = [([1, 2, 3, 4], [0, 0, 0, 0, 5]) for _ in range(12)]
    b = _batch(reqs, 4, idx_dtype=idx_dtype)
    rates = torch.tensor([0.9, 0.7, 0.5, 0.3], dtype=torch.float32)
    sampled, num_sampled, _ = _verify(b, synthetic_conditional_rates=rates)
    cu = b["cu_num_logits"].tolist()
    seen = set()
    for r in range(len(reqs)):
        slot = int(b["idx_mapping"][r])
        rows = torch.arange(cu[r], cu[r + 1] - 1)
        u = synthetic_uniform(b["seed"][slot].repeat(len(rows)), b["pos"][rows])
        expect, accepted = [], 0
        for i in range(4):
            if float(u[i]) < float(rates[i]):
                expect.append(i + 1)
                accepted += 1
            else:
                expect.append(0)
                break
        if accepted == 4:
            expect.append(5)
        expect += [-1] * (5 - len(expect))
        assert sampled[r].tolist() == expect, (r, u.tolist())
        assert int(num_sampled[r]) == accepted + 1
        seen.add(accepted)
    assert len(seen) >= 2  # the fixture really exercises both outcomes


@needs_rand
def test_synthetic_uses_seed_through_idx_mapping():
    reqs = [([1, 2, 3, 4], [0, 0, 0, 0, 5]) for _ in range(8)]
    b = _batch(reqs, 4)
    rates = torch.full((4,), 0.5, dtype=torch.float32)
    base = _verify(b, synthetic_conditional_rates=rates)[1]
    b2 = dict(b, seed=b["seed"].clone())
    for r in range(8):  # slots in idx_mapping get other seeds; unused slots keep theirs
        b2["seed"][int(b["idx_mapping"][r])] += 1
    other = _verify(b2, synthetic_conditional_rates=rates)[1]
    b3 = dict(b, seed=b["seed"].clone())
    used = set(b["idx_mapping"].tolist())
    for s in range(b3["seed"].numel()):
        if s not in used:
            b3["seed"][s] += 1
    same = _verify(b3, synthetic_conditional_rates=rates)[1]
    assert same.tolist() == base.tolist()
    assert other.tolist() != base.tolist()


def test_chunked_prefill_and_finishing_step():
    b = _batch([([3, 5], [3, 5, 9]), ([], [6]), ([], [7]), ([2], [1, 4])], 2)
    prefill_len = torch.zeros(b["seed"].numel(), dtype=torch.int32)
    slots = b["idx_mapping"].tolist()
    seq_lens = torch.tensor([50, 10, 10, 60], dtype=torch.int32)
    prefill_len[slots[0]] = 20
    prefill_len[slots[1]] = 11  # chunked: 10 < 11
    prefill_len[slots[2]] = 10  # finishing the prompt: 10 == 10 samples
    prefill_len[slots[3]] = 60
    sampled, num_sampled, num_rejected = _verify(b, seq_lens=seq_lens, prefill_len=prefill_len)
    assert sampled.tolist() == [[3, 5, 9], [-1, -1, -1], [7, -1, -1], [1, -1, -1]]
    assert num_sampled.tolist() == [3, 0, 1, 1]
    assert num_rejected.tolist() == [0, 0, 0, 1]
    with pytest.raises(ValueError, match="together"):
        _verify(b, seq_lens=seq_lens)


def test_get_num_sampled_and_rejected_out_of_place():
    num_sampled = torch.tensor([3, 1, 2], dtype=torch.int32)
    before = num_sampled.clone()
    cu = torch.tensor([0, 3, 4, 7], dtype=torch.int32)
    idx = torch.tensor([4, 0, 2], dtype=torch.int64)
    prefill_len = torch.tensor([9, 0, 100, 0, 5], dtype=torch.int32)
    seq_lens = torch.tensor([5, 8, 99], dtype=torch.int32)
    ns, nr = get_num_sampled_and_rejected(num_sampled, seq_lens, cu, idx, prefill_len)
    assert ns.dtype == torch.int32 and nr.dtype == torch.int32
    assert ns.tolist() == [3, 0, 0]
    assert nr.tolist() == [0, 0, 0]
    assert torch.equal(num_sampled, before)
    ns, nr = get_num_sampled_and_rejected(
        num_sampled, torch.tensor([5, 9, 100], dtype=torch.int32), cu, idx, prefill_len
    )
    assert ns.tolist() == [3, 1, 2] and nr.tolist() == [0, 0, 1]
