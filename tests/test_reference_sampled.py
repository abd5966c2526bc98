"""Reference of vLLM's non-greedy verification for one-hot drafts (shardmax.reference.sampled).

Run with ``TRITON_INTERPRET=1`` on CPU (tests/conftest.py sets it when no GPU is present): the
Gumbel noise, ``u`` and ``log u`` come from Triton helpers.
"""

from __future__ import annotations

import itertools
import math
import struct

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from shardmax.reference import greedy_verify, rejection_sample_greedy, synthetic_uniform
from shardmax.reference.sampled import (
    apply_temperature,
    block_lse,
    gumbel_argmax,
    gumbel_noise,
    rejection_sample_sampled,
    top_k_mask,
    verify_sampled,
)
from shardmax.runtime import gumbel as _gumbel
from shardmax.testing import VerifyBatch, random_verify_batch

pytestmark = pytest.mark.skipif(
    not _gumbel._interpreted() and not torch.cuda.is_available(),
    reason="the Triton helpers on CPU need TRITON_INTERPRET=1 before importing triton",
)

INF = math.inf


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------
# temperature
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_apply_temperature_divides_in_fp32_and_skips_0_and_1(dtype):
    raw = (torch.randn(6, 3001, generator=_gen(0)) * 4).to(dtype)
    temperature = torch.tensor([0.7, 0.0, 1.0, 1.3, 0.05, 2.0], dtype=torch.float32)
    expanded = torch.tensor([2, 1, 0, 3, 4, 5], dtype=torch.int32)  # rows -> slots
    out = apply_temperature(raw, temperature, torch.arange(6), expanded)
    assert out.dtype == torch.float32 and out.shape == raw.shape
    up = raw.float()
    for row, slot in enumerate(expanded.tolist()):
        t = float(temperature[slot])
        if t in (0.0, 1.0):
            assert torch.equal(out[row].view(torch.int32), up[row].view(torch.int32))
        else:
            # IEEE fp32 division, checked against NumPy (independent of torch's kernel)
            want = up[row].numpy() / np.float32(t)
            assert want.dtype == np.float32
            assert np.array_equal(out[row].numpy().view(np.int32), want.view(np.int32))
    # a true division, not a multiplication by the fp32 reciprocal (row 3 has T = 1.3)
    by_recip = up[3] * (torch.tensor(1.0) / torch.tensor(1.3))
    assert not torch.equal(out[3], by_recip)
    # the input is untouched
    assert raw.dtype == dtype


def test_apply_temperature_one_row_per_request_and_errors():
    raw = torch.randn(3, 50, generator=_gen(1))
    temperature = torch.tensor([0.5, 1.0, 0.0, 4.0])
    out = apply_temperature(raw, temperature, torch.tensor([3, 0, 2]))
    assert torch.equal(out[0], raw[0] / torch.tensor(4.0))
    assert torch.equal(out[1], raw[1] / torch.tensor(0.5))
    assert torch.equal(out[2], raw[2])
    with pytest.raises(ValueError, match="one entry per logits row"):
        apply_temperature(raw, temperature, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="slot"):
        apply_temperature(raw, temperature, torch.tensor([0, 1, 4]))
    with pytest.raises(ValueError, match=">= 0"):
        apply_temperature(raw, torch.tensor([-1.0, 1, 1, 1]), torch.tensor([0, 1, 2]))
    assert apply_temperature(
        torch.empty(0, 7), temperature, torch.empty(0, dtype=torch.int64)
    ).shape == (0, 7)


# ------------------------------------------------------------------------------------------
# top-k
# ------------------------------------------------------------------------------------------


def _brute_top_k(row: list[float], k: int) -> set[int]:
    order = sorted(range(len(row)), key=lambda i: (-row[i], i))
    return set(order[:k])


def test_top_k_planted_ties_at_the_kth_value():
    row = [5.0, 3.0, 3.0, 1.0, 3.0, 7.0, 3.0, -INF, 3.0, 0.5]
    x = torch.tensor([row, row, row, row])
    out = top_k_mask(x, torch.tensor([4, 3, 6, 2]))
    kept = [set(torch.isfinite(out[b]).nonzero().flatten().tolist()) for b in range(4)]
    # k=4: 7 and 5, then the two lowest ids among the five 3.0s
    assert kept[0] == {5, 0, 1, 2}
    assert kept[1] == {5, 0, 1}
    assert kept[2] == {5, 0, 1, 2, 4, 6}
    assert kept[3] == {5, 0}
    for b, k in enumerate([4, 3, 6, 2]):
        assert kept[b] == _brute_top_k(row, k)
        # kept values are unchanged, the rest is -inf
        assert torch.equal(out[b][list(kept[b])], x[b][list(kept[b])])
        assert int(torch.isfinite(out[b]).sum()) == k


def test_top_k_signed_zero_tie_and_disabled_rows():
    x = torch.tensor(
        [
            [1.0, -0.0, 0.0, -1.0, 0.0],
            [1.0, 0.0, -0.0, -1.0, -0.0],
            [1.0, 2.0, 3.0, 4.0, 5.0],
            [1.0, 2.0, 3.0, 4.0, 5.0],
        ]
    )
    out = top_k_mask(x, torch.tensor([2, 3, 0, 5]))
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [0, 1]  # -0.0 at id 1 wins
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [0, 1, 2]
    assert torch.equal(out[2], x[2]) and torch.equal(out[3], x[3])  # k <= 0 / k >= V: off


def test_top_k_matches_brute_force_on_coarse_rows():
    g = _gen(2)
    x = torch.randint(-6, 6, (40, 300), generator=g).float() / 2  # many ties
    x[3, :290] = -INF  # fewer finite values than k
    ks = torch.randint(1, 320, (40,), generator=g)
    out = top_k_mask(x, ks)
    for b in range(40):
        k = int(ks[b])
        if k >= 300:
            assert torch.equal(out[b], x[b])
            continue
        want = _brute_top_k(x[b].tolist(), k)
        keep = torch.zeros(300, dtype=torch.bool)
        keep[list(want)] = True
        assert torch.equal(out[b], torch.where(keep, x[b], torch.full_like(x[b], -INF)))


def test_top_k_errors():
    with pytest.raises(ValueError, match="fp32"):
        top_k_mask(torch.zeros(2, 3, dtype=torch.bfloat16), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="entries"):
        top_k_mask(torch.zeros(2, 3), torch.tensor([1]))
    with pytest.raises(ValueError, match="NaN"):
        top_k_mask(torch.tensor([[0.0, math.nan, 1.0]]), torch.tensor([1]))
    # NaN is fine where top-k is off
    top_k_mask(torch.tensor([[0.0, math.nan, 1.0]]), torch.tensor([0]))


# ------------------------------------------------------------------------------------------
# LSE
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("vocab", "block"),
    [(1, 8192), (8191, 8192), (8192, 8192), (8193, 8192), (20000, 8192), (50257, 8192), (1000, 64)],
)
def test_block_lse_close_to_logsumexp(vocab, block):
    # allclose is the right check here: vLLM's LSE is only defined up to its summation order
    # (Triton's reduction tree, set by the load layout; research §1.4), it is accurate to
    # ~1.3 ulp, and this plain-torch version sums in another order. Bit-level agreement with
    # vLLM is a GPU layout-faithful replay question, not a property of this reference.
    g = _gen(vocab)
    x = torch.randn(5, vocab, generator=g) * 3
    x[1] *= 10  # peaked
    if vocab > 1:
        x[2, ::3] = -INF
    if vocab > 16384:
        x[3, 8192:16384] = -INF  # a whole block of -inf (sumexp_b = 0)
    lse = block_lse(x, block)
    assert lse.dtype == torch.float32 and lse.shape == (5,)
    want = torch.logsumexp(x.double(), dim=1)
    torch.testing.assert_close(lse.double(), want, rtol=2e-7, atol=2e-6)
    exact = block_lse(x, block, acc_dtype=torch.float64)
    assert exact.dtype == torch.float64
    torch.testing.assert_close(exact, want, rtol=1e-13, atol=1e-12)


def test_block_lse_edge_rows_and_errors():
    x = torch.tensor([[-INF, -INF, -INF], [-INF, 2.5, -INF], [0.0, 0.0, 0.0]])
    lse = block_lse(x, 2)
    assert math.isnan(float(lse[0]))  # the formula on an all -inf row; acceptance then rejects
    assert float(lse[1]) == 2.5  # one finite value: exactly that value
    assert float(lse[2]) == pytest.approx(math.log(3.0), rel=1e-7)
    assert block_lse(torch.empty(0, 10)).shape == (0,)
    with pytest.raises(ValueError, match="fp32"):
        block_lse(x.double())
    with pytest.raises(ValueError, match="V >= 1"):
        block_lse(torch.empty(2, 0))
    with pytest.raises(ValueError, match="acc_dtype"):
        block_lse(x, acc_dtype=torch.float16)


# ------------------------------------------------------------------------------------------
# Gumbel noise
# ------------------------------------------------------------------------------------------


def _murmur3_x86_32(data: bytes, seed: int) -> int:
    """Pure-Python MurmurHash3_x86_32 (any length), to check the Triton hash."""

    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF

    c1, c2, m = 0xCC9E2D51, 0x1B873593, 0xFFFFFFFF
    h = seed & m
    nblocks = len(data) // 4
    for i in range(nblocks):
        k = int.from_bytes(data[4 * i : 4 * i + 4], "little")
        k = rotl((k * c1) & m, 15) * c2 & m
        h = (rotl(h ^ k, 13) * 5 + 0xE6546B64) & m
    tail = data[4 * nblocks :]
    k = 0
    for i, b in enumerate(tail):
        k |= b << (8 * i)
    if tail:
        k = rotl((k * c1) & m, 15) * c2 & m
        h ^= k
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & m
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & m
    h ^= h >> 16
    return h


def test_pure_python_murmur3_published_vectors():
    # widely published MurmurHash3_x86_32 test vectors (also those of the mmh3 package)
    assert _murmur3_x86_32(b"", 0) == 0
    assert _murmur3_x86_32(b"", 1) == 0x514E28B7
    assert _murmur3_x86_32(b"", 0xFFFFFFFF) == 0x81F16F39
    assert _murmur3_x86_32(b"\0\0\0\0", 0) == 0x2362F9DE
    assert _murmur3_x86_32(b"hello", 0) == 613153351
    assert _murmur3_x86_32(b"aaaa", 0x9747B28C) == 0x5A97808A
    assert _murmur3_x86_32(b"Hello, world!", 0x9747B28C) == 0x24884CBA
    fox = b"The quick brown fox jumps over the lazy dog"
    assert _murmur3_x86_32(fox, 0x9747B28C) == 0x2FA826CD


def _keys(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _gen(seed)
    s = torch.randint(-(2**63), 2**63 - 1, (n,), dtype=torch.int64, generator=g)
    p = torch.randint(0, 2**40, (n,), dtype=torch.int64, generator=g)
    t = torch.randint(0, 2**31 - 1, (n,), dtype=torch.int64, generator=g)
    s[:4] = torch.tensor([0, -1, 2**62, -(2**63)])
    t[:4] = torch.tensor([0, 2**31 - 1, 151935, 1])
    return s, p, t


@pytest.mark.parametrize("fp64", [False, True])
def test_triton_hash_is_murmur3_of_the_16_byte_message(fp64):
    s, p, t = _keys(400, 3)
    h_lo, h_hi, _, _ = _gumbel.gumbel_components_triton(s, p, t, fp64)
    for i in range(400):
        seed = int(s[i]) & 0xFFFFFFFFFFFFFFFF
        msg = struct.pack(
            "<IIII", seed & 0xFFFFFFFF, seed >> 32, int(p[i]) & 0xFFFFFFFF, int(t[i]) & 0xFFFFFFFF
        )
        assert int(h_lo[i]) == _murmur3_x86_32(msg, _gumbel.HASH_SEED_LO)
        if fp64:
            assert int(h_hi[i]) == _murmur3_x86_32(msg, _gumbel.HASH_SEED_HI)
    # only the position's low word enters the message
    h2 = _gumbel.gumbel_components_triton(s, p + 2**32, t, fp64)[0]
    assert torch.equal(h_lo, h2)


@triton.jit
def _direct_gumbel_kernel(seed_ptr, pos_ptr, tok_ptr, out_ptr, FP64: tl.constexpr):
    # one program per element, scalar loads: the composed @jit helpers as a kernel would call them
    i = tl.program_id(0)
    seed = tl.load(seed_ptr + i)
    pos = tl.load(pos_ptr + i)
    tok = tl.load(tok_ptr + i)
    if FP64:
        tl.store(out_ptr + i, _gumbel.gumbel_fp64(seed, pos, tok))
    else:
        tl.store(out_ptr + i, _gumbel.gumbel_fp32(seed, pos, tok))


@pytest.mark.parametrize("fp64", [False, True])
def test_scalar_jit_helpers_equal_the_block_launcher(fp64):
    s, p, t = _keys(64, 9)
    out = torch.empty(64, dtype=torch.float64 if fp64 else torch.float32)
    _direct_gumbel_kernel[(64,)](s, p, t, out, FP64=fp64)
    assert torch.equal(out, gumbel_noise(s, p, t, fp64))


@pytest.mark.parametrize("fp64", [False, True])
def test_gumbel_noise_deterministic_and_independent_of_the_vocab_cut(fp64):
    vocab = 10007
    ids = torch.arange(vocab)
    full = gumbel_noise(-1234567890123, 777, ids, fp64)
    assert full.dtype == (torch.float64 if fp64 else torch.float32)
    assert torch.equal(full, gumbel_noise(-1234567890123, 777, ids, fp64))
    # shards with global ids (uneven cuts, evaluated in reverse order) give the same bits
    cuts = [0, 1, 2500, 5120, 8192, 9999, vocab]
    pieces = {
        a: gumbel_noise(-1234567890123, 777, ids[a:b].to(torch.int32), fp64)
        for a, b in reversed(list(itertools.pairwise(cuts)))
    }
    assert torch.equal(torch.cat([pieces[a] for a in cuts[:-1]]), full)
    # a permutation of the ids permutes the noise
    perm = torch.randperm(vocab, generator=_gen(4))
    assert torch.equal(gumbel_noise(-1234567890123, 777, perm, fp64), full[perm])
    # per-element seeds / positions equal the scalar form
    assert torch.equal(
        gumbel_noise(torch.full((vocab,), -1234567890123), torch.full((vocab,), 777), ids, fp64),
        full,
    )
    # other seeds / positions give other noise
    assert not torch.equal(gumbel_noise(-1234567890124, 777, ids, fp64), full)
    assert not torch.equal(gumbel_noise(-1234567890123, 778, ids, fp64), full)
    assert gumbel_noise(1, 2, torch.empty(0, dtype=torch.int64), fp64).shape == (0,)


def test_gumbel_fp32_range_planted_hashes_and_moments():
    s, p, t = _keys(200_000, 5)
    _, _, u, g = _gumbel.gumbel_components_triton(s, p, t)
    assert u.dtype == torch.float32 and g.dtype == torch.float32
    assert bool((u > 0).all()) and bool((u <= 1).all())
    assert bool(torch.isfinite(g).all())
    assert float(g.min()) >= _gumbel.GUMBEL_FP32_MIN and float(g.max()) <= _gumbel.GUMBEL_FP32_MAX
    # standard Gumbel: mean = Euler-Mascheroni, variance = pi^2 / 6
    assert float(g.double().mean()) == pytest.approx(0.5772157, abs=0.01)
    assert float(g.double().var()) == pytest.approx(math.pi**2 / 6, abs=0.03)
    # the formula on planted hash words: u extremes and the series/direct boundary
    words = torch.tensor(
        [0, 0xFFFFFFFF, 0xFFFF0000, 0x3FFF0000, 0x40000000, 0x3FFFFFFF, 0x12345678]
    )
    u, g = _gumbel.gumbel_from_hash_triton(words)
    assert float(u[0]) == 2.0**-33
    assert float(g[0]) == pytest.approx(33 * math.log(2), rel=1e-6)
    assert float(u[1]) == 1.0  # rounds up to 1.0 in fp32: the 2**-24 clamp applies
    assert float(g[1]) == pytest.approx(-math.log(24 * math.log(2)), rel=1e-6)
    assert float(u[3]) < 0.25 <= float(u[4])
    assert float(u[5]) == 0.25  # 0.25 - 2**-33 rounds to 0.25: direct branch
    for i in range(len(words)):
        w = int(words[i])
        want_u = np.float32(
            np.float32((w >> 16) * 2.0**-16) + np.float32(((w & 0xFFFF) + 0.5) * 2.0**-32)
        )
        assert np.float32(u[i].item()) == want_u
        exact = -math.log(-math.log1p(-float(u[i]))) if float(u[i]) < 1 else float(g[i])
        # Taylor degree-8 truncation near u = 0.25 is ~1.4e-6 relative: UNVERIFIED vs vLLM
        assert float(g[i]) == pytest.approx(exact, abs=3e-6)
    g_u = _gumbel.gumbel_from_hash_triton(torch.arange(0, 2**32, 2**20 + 7, dtype=torch.int64))[1]
    assert float(g_u.min()) >= _gumbel.GUMBEL_FP32_MIN and float(g_u.max()) <= 22.875


def test_gumbel_fp64_range_and_planted_hashes():
    s, p, t = _keys(50_000, 6)
    _, _, u, g = _gumbel.gumbel_components_triton(s, p, t, fp64=True)
    assert u.dtype == torch.float64 and g.dtype == torch.float64
    assert bool((u > 0).all()) and bool((u < 1).all()) and bool(torch.isfinite(g).all())
    assert float(g.mean()) == pytest.approx(0.5772157, abs=0.02)
    lo = torch.tensor([0, 0xFFFFFFFF, 0x800, 0x7FF])
    hi = torch.tensor([0, 0xFFFFFFFF, 0, 0])
    u, g = _gumbel.gumbel_from_hash_triton(lo, hi, fp64=True)
    assert float(u[0]) == 2.0**-54
    assert float(u[1]) == 1.0 - 2.0**-53  # (2**53 - 0.5) * 2**-53 rounds to 1.0: mapped below
    assert float(u[2]) == 1.5 * 2.0**-53  # r = 1 (bit 11 of the low word)
    assert float(u[3]) == 2.0**-54  # bits below 11 are dropped
    assert float(g.min()) >= _gumbel.GUMBEL_FP64_MIN and float(g.max()) <= _gumbel.GUMBEL_FP64_MAX
    assert float(g[0]) == pytest.approx(-math.log(54 * math.log(2)), rel=1e-12)


def test_gumbel_argmax_is_the_keyed_max_and_partition_free():
    vocab = 5000
    x = torch.randn(vocab, generator=_gen(7)) * 2
    for fp64 in (False, True):
        noise = gumbel_noise(99, 12345, torch.arange(vocab), fp64)
        keys = x.to(noise.dtype) + noise
        tok = gumbel_argmax(x, 99, 12345, fp64=fp64)
        assert tok == int(torch.argmax(keys))
        # sharded: per-shard winner with global ids, then (key desc, id asc) across shards
        best = max(
            (
                (float(keys[a:b].max()), -(a + int(torch.argmax(keys[a:b]))))
                for a, b in [(0, 1024), (1024, 2600), (2600, 4096), (4096, vocab)]
            )
        )
        assert -best[1] == tok
        # the masked id never wins, even when it dominates
        y = x.clone()
        y[17] = 1e4
        assert gumbel_argmax(y, 99, 12345, fp64=fp64) == 17
        assert gumbel_argmax(y, 99, 12345, masked_id=17, fp64=fp64) == tok
    assert gumbel_argmax(torch.full((10,), -INF), 1, 2) == 0
    with pytest.raises(ValueError, match="masked_id"):
        gumbel_argmax(x, 1, 2, masked_id=vocab)


@pytest.mark.parametrize("fp64", [False, True])
def test_gumbel_max_samples_the_softmax(fp64):
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5])
    n = 20_000
    pos = torch.arange(n).repeat_interleave(5)
    noise = gumbel_noise(2024, pos, torch.arange(5).repeat(n), fp64).view(n, 5)
    winners = torch.argmax(logits.to(noise.dtype) + noise, dim=1)
    freq = torch.bincount(winners, minlength=5).double() / n
    p = torch.softmax(logits.double(), 0)
    sigma = torch.sqrt(p * (1 - p) / n)
    assert bool(((freq - p).abs() < 5 * sigma).all()), (freq, p)


# ------------------------------------------------------------------------------------------
# verification
# ------------------------------------------------------------------------------------------


def _one_request(rows: torch.Tensor, drafts: list[int], *, t: float, seed: int = 5, p0: int = 40):
    """Single request with rows ``[n+1, V]`` and drafts ``d_0..d_{n-1}`` (slot 1 of 2)."""
    n = rows.shape[0] - 1
    assert len(drafts) == n
    return dict(
        target_logits=rows,
        draft_sampled=torch.tensor([3, *drafts], dtype=torch.int32),
        cu_num_logits=torch.tensor([0, n + 1], dtype=torch.int32),
        pos=torch.arange(p0, p0 + n + 1, dtype=torch.int64),
        idx_mapping=torch.tensor([1], dtype=torch.int32),
        expanded_local_pos=torch.arange(n + 1, dtype=torch.int32),
        temperature=torch.tensor([0.0, t]),
        seed=torch.tensor([0, seed], dtype=torch.int64),
        num_speculative_steps=n,
    )


@pytest.mark.parametrize("fp64", [False, True])
def test_overwhelming_drafts_accepted_and_neginf_draft_rejected(fp64):
    g = _gen(8)
    vocab = 3000
    rows = torch.randn(4, vocab, generator=g)
    drafts = [11, 2222, 5]
    for i, d in enumerate(drafts):
        rows[i, d] = 30.0  # overwhelming argmax; T = 0.1 makes it 300 nats ahead
    args = _one_request(rows, drafts, t=0.1)
    sampled, num = rejection_sample_sampled(**args, use_fp64_gumbel=fp64)
    assert num.tolist() == [4]
    assert sampled[0, :3].tolist() == drafts
    bonus = gumbel_argmax(rows[3] / torch.tensor(0.1), 5, 43, fp64=fp64)
    assert int(sampled[0, 3]) == bonus
    # a draft with a -inf logit is rejected; the resampled token is not the draft
    rows2 = rows.clone()
    rows2[1, 2222] = -INF
    for t in (0.1, 1.0, 1.7):
        sampled, num = rejection_sample_sampled(
            **_one_request(rows2, drafts, t=t), use_fp64_gumbel=fp64
        )
        assert num.tolist() == [2]
        assert int(sampled[0, 0]) == 11
        assert int(sampled[0, 1]) != 2222
        x1 = rows2[1] if t == 1.0 else rows2[1] / torch.tensor(t)
        assert int(sampled[0, 1]) == gumbel_argmax(x1, 5, 41, masked_id=2222, fp64=fp64)
        assert sampled[0, 2:].tolist() == [-1, -1]


def test_rejected_draft_is_masked_in_the_resample():
    # a dominant draft that is rejected anyway (synthetic rate 0): the resample must skip it
    vocab = 600
    rows = torch.randn(2, vocab, generator=_gen(9))
    rows[0, 77] = 50.0
    args = _one_request(rows, [77], t=1.0)
    sampled, num = rejection_sample_sampled(**args, synthetic_conditional_rates=torch.tensor([0.0]))
    assert num.tolist() == [1]
    assert int(sampled[0, 0]) != 77
    assert int(sampled[0, 0]) == gumbel_argmax(rows[0], 5, 40, masked_id=77)
    # rate 1: accepted whatever the logits, bonus from the last row without masking
    sampled, num = rejection_sample_sampled(**args, synthetic_conditional_rates=torch.tensor([1.0]))
    assert num.tolist() == [2]
    assert sampled[0].tolist() == [77, gumbel_argmax(rows[1], 5, 41)]


def test_placeholder_ends_verification_for_non_greedy_rows():
    vocab = 800
    rows = torch.randn(4, vocab, generator=_gen(10))
    rows[0, 9] = 40.0
    rows[2, 4] = 40.0
    for t in (0.0, 0.8):
        sampled, num = rejection_sample_sampled(**_one_request(rows, [9, -1, 4], t=t))
        assert num.tolist() == [2]
        assert int(sampled[0, 0]) == 9
        x1 = rows[1] if t == 0.0 else rows[1] / torch.tensor(0.8)
        want = int(torch.argmax(x1)) if t == 0.0 else gumbel_argmax(x1, 5, 41)  # no masking
        assert int(sampled[0, 1]) == want
        assert sampled[0, 2:].tolist() == [-1, -1]
        # a placeholder first draft: one token, sampled from row 0
        sampled, num = rejection_sample_sampled(**_one_request(rows, [-1, 4, 4], t=t))
        assert num.tolist() == [1]
        x0 = rows[0] if t == 0.0 else rows[0] / torch.tensor(0.8)
        assert int(sampled[0, 0]) == (
            int(torch.argmax(x0)) if t == 0.0 else gumbel_argmax(x0, 5, 40)
        )
    # also under synthetic acceptance with rate 1
    sampled, num = rejection_sample_sampled(
        **_one_request(rows, [9, -1, 4], t=0.8),
        synthetic_conditional_rates=torch.tensor([1.0, 1.0, 1.0]),
    )
    assert num.tolist() == [2]


def test_top_k_rows_in_verification():
    vocab = 500
    rows = torch.randn(3, vocab, generator=_gen(11))
    top = torch.argmax(rows, dim=1).tolist()
    second = torch.argsort(rows[0], descending=True)[1].item()
    args = _one_request(rows, [top[0], top[1]], t=0.9)
    top_k = torch.tensor([0, 1], dtype=torch.int32)
    # k = 1: the kept token is the argmax: drafts equal to it are always accepted ...
    sampled, num = rejection_sample_sampled(**args, top_k=top_k)
    assert num.tolist() == [3]
    assert sampled[0].tolist() == top
    # ... and any other draft is masked (-inf) -> rejected, resampled to the argmax
    args = _one_request(rows, [int(second), top[1]], t=0.9)
    sampled, num = rejection_sample_sampled(**args, top_k=top_k)
    assert num.tolist() == [1] and int(sampled[0, 0]) == top[0]
    # k = 2 with a draft outside the top 2: rejected, resample within the top 2
    third = int(torch.argsort(rows[0], descending=True)[2])
    args = _one_request(rows, [third, top[1]], t=0.9)
    sampled, num = rejection_sample_sampled(**args, top_k=torch.tensor([0, 2]))
    assert num.tolist() == [1] and int(sampled[0, 0]) in (top[0], int(second))


def _layout(
    b: VerifyBatch,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``draft_sampled, cu_num_logits, pos, idx_mapping, expanded_local_pos`` of a batch."""
    return (b.draft_sampled, b.cu_num_logits, b.pos, b.idx_mapping, b.expanded_local_pos)


def _temperatures(max_num_reqs: int, seed: int) -> torch.Tensor:
    g = _gen(seed)
    t = torch.rand(max_num_reqs, generator=g) * 1.5 + 0.05
    t[::3] = 0.0
    t[1::4] = 1.0
    return t


@pytest.mark.parametrize("synthetic", [False, True])
def test_greedy_rows_of_a_mixed_batch_equal_the_greedy_reference(synthetic):
    b = random_verify_batch(14, 3, 4099, seed=12, synthetic=synthetic, dtype=torch.bfloat16)
    temp = _temperatures(b.max_num_reqs, 13)
    sampled, num = rejection_sample_sampled(
        b.logits,
        *_layout(b),
        temp,
        b.seed,
        b.num_speculative_steps,
        top_k=torch.full((b.max_num_reqs,), 7),
        synthetic_conditional_rates=b.synthetic_conditional_rates,
    )
    g_sampled, g_num = rejection_sample_greedy(
        b.logits, *_layout(b), b.seed, b.num_speculative_steps, b.synthetic_conditional_rates
    )
    greedy = (temp[b.idx_mapping.long()] == 0).tolist()
    assert any(greedy) and not all(greedy)
    for r in range(b.num_reqs):
        if greedy[r]:
            assert int(num[r]) == int(g_num[r])
            assert torch.equal(sampled[r], g_sampled[r])
    # an all-greedy batch is the greedy reference, end to end
    zeros = torch.zeros(b.max_num_reqs)
    out = verify_sampled(
        b.logits,
        *_layout(b),
        zeros,
        b.seed,
        b.num_speculative_steps,
        synthetic_conditional_rates=b.synthetic_conditional_rates,
        seq_lens=b.seq_lens,
        prefill_len=b.prefill_len,
    )
    ref = greedy_verify(b.logits, *b.args(), **b.kwargs())
    for a, c in zip(out, ref, strict=True):
        assert torch.equal(a, c)


@pytest.mark.parametrize("fp64", [False, True])
def test_non_greedy_requests_follow_the_documented_chain(fp64):
    """Re-derive every non-greedy request step by step from the public helpers (exact fp64 LSE,
    decisions compared only where the margin is far from the fp32 rounding)."""
    vocab = 9000  # two 8192 blocks
    b = random_verify_batch(16, 3, vocab, seed=14, accept_prob=0.5, placeholder_prob=0.15)
    logits = b.logits * 3
    rows = torch.arange(logits.shape[0])
    logits[rows, torch.argmax(logits, dim=1)] += 4.0  # drafts equal to the argmax: often accepted
    temp = _temperatures(b.max_num_reqs, 15)
    top_k = torch.randint(0, 40, (b.max_num_reqs,), generator=_gen(16))
    args = (logits, *_layout(b), temp, b.seed, b.num_speculative_steps)
    sampled, num = rejection_sample_sampled(*args, top_k=top_k, use_fp64_gumbel=fp64)
    sampled2, num2 = rejection_sample_sampled(*args, top_k=top_k, use_fp64_gumbel=fp64)
    assert torch.equal(sampled, sampled2) and torch.equal(num, num2)  # deterministic
    cu = b.cu_num_logits.tolist()
    drafts = b.draft_sampled.tolist()
    checked = total_accepted = resampled_masked = bonus = 0
    for r in range(b.num_reqs):
        slot = int(b.idx_mapping[r])
        t = float(temp[slot])
        if t == 0.0:
            continue
        start, end = cu[r], cu[r + 1]
        x = logits[start:end].float()
        if t != 1.0:
            x = x / torch.tensor(t)
        x = top_k_mask(x, torch.full((end - start,), int(top_k[slot])))
        seed = int(b.seed[slot])
        accepted, ulp_margin = 0, False
        for i in range(end - start - 1):
            d = drafts[start + i + 1]
            if d < 0:
                break
            u = float(synthetic_uniform(torch.tensor([seed]), b.pos[start + i : start + i + 1]))
            margin = float(x[i, d]) - float(torch.logsumexp(x[i].double(), 0)) - math.log(u)
            ulp_margin = abs(margin) < 1e-4  # decision set by fp32 rounding: not re-derived
            if ulp_margin or margin <= 0:
                break
            accepted += 1
        if ulp_margin:
            continue
        assert int(num[r]) == accepted + 1
        assert sampled[r, :accepted].tolist() == drafts[start + 1 : start + 1 + accepted]
        j = start + accepted
        masked = drafts[j + 1] if j != end - 1 and drafts[j + 1] >= 0 else None
        want = gumbel_argmax(x[accepted], seed, int(b.pos[j]), masked, fp64)
        assert int(sampled[r, accepted]) == want
        assert masked is None or want != masked
        assert sampled[r, accepted + 1 :].tolist() == [-1] * (3 - accepted)
        checked += 1
        total_accepted += accepted
        resampled_masked += masked is not None
        bonus += j == end - 1
    # the batch exercises every branch: accepted drafts, masked resamples, bonus rows
    assert checked >= 8 and total_accepted >= 3 and resampled_masked >= 2 and bonus >= 2


def test_verify_sampled_prefill_rule_and_errors():
    b = random_verify_batch(10, 2, 700, seed=17, prefill_prob=0.3)
    temp = _temperatures(b.max_num_reqs, 18)
    sampled, num, rej = verify_sampled(
        b.logits,
        *_layout(b),
        temp,
        b.seed,
        b.num_speculative_steps,
        seq_lens=b.seq_lens,
        prefill_len=b.prefill_len,
    )
    raw_sampled, raw_num = rejection_sample_sampled(
        b.logits, *_layout(b), temp, b.seed, b.num_speculative_steps
    )
    plen = b.prefill_len.long()[b.idx_mapping.long()]
    chunked = (b.seq_lens.long() < plen).tolist()
    assert any(chunked)
    counts = (b.cu_num_logits[1:] - b.cu_num_logits[:-1]).tolist()
    for r in range(b.num_reqs):
        if chunked[r]:
            assert int(num[r]) == 0 and int(rej[r]) == 0
            assert sampled[r].tolist() == [-1] * 3
        else:
            assert int(num[r]) == int(raw_num[r])
            assert int(rej[r]) == counts[r] - int(raw_num[r])
            assert torch.equal(sampled[r], raw_sampled[r])
    assert num.dtype == torch.int32 and rej.dtype == torch.int32 and sampled.dtype == torch.int64
    base = (b.logits, *_layout(b))
    with pytest.raises(ValueError, match="together"):
        verify_sampled(*base, temp, b.seed, 2, seq_lens=b.seq_lens)
    with pytest.raises(ValueError, match="temperature"):
        rejection_sample_sampled(*base, temp[:1], b.seed, 2)
    bad = b.draft_sampled.clone()
    nongreedy_row = next(
        b.cu_num_logits[r] + 1
        for r in range(b.num_reqs)
        if float(temp[b.idx_mapping[r]]) != 0 and counts[r] > 1
    )
    bad[int(nongreedy_row)] = 700
    with pytest.raises(ValueError, match="outside"):
        rejection_sample_sampled(b.logits, bad, *_layout(b)[1:], temp, b.seed, 2)


def test_empty_batch():
    args = (
        torch.empty(0, 50),
        torch.empty(0, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
        torch.empty(0, dtype=torch.int64),
        torch.empty(0, dtype=torch.int32),
        torch.empty(0, dtype=torch.int32),
        torch.tensor([0.7]),
        torch.tensor([3], dtype=torch.int64),
        2,
    )
    sampled, num = rejection_sample_sampled(*args, use_fp64_gumbel=True)
    assert sampled.shape == (0, 3) and sampled.dtype == torch.int64
    assert num.shape == (0,) and num.dtype == torch.int32
    s, n, rj = verify_sampled(*args)
    assert s.shape == (0, 3) and n.shape == (0,) and rj.shape == (0,)
