"""Sampled verification (compact "fast" mode) vs the plain-torch reference, emulated TP 1-8.

Every non-fallback request must give ``==`` sampled / num_sampled / num_rejected against
:func:`shardmax.reference.sampled.verify_sampled`; greedy requests must match
:func:`shardmax.reference.greedy_verify` and are never flagged; rows built within an ulp of the
acceptance threshold must be flagged. Sections: 1. every generated variant on mixed batches
(temperatures 0.5/0.7/1.0/1.3 + greedy, fp32/fp64 Gumbel, placeholders, prefill, dtypes,
synthetic); 2. ulp-margin rows; 3. top-k / strict / NaN / the public op.
"""

from __future__ import annotations

import math

import pytest
import torch

import shardmax
from generator.space import SAMPLED_BLOCKS
from shardmax import reference
from shardmax.ops.sampled import FallbackReason
from shardmax.reference.sampled import apply_temperature, verify_sampled
from shardmax.runtime.gumbel import acceptance_uniform_triton
from shardmax.runtime.variants import DTYPES
from shardmax.testing import adversarial, emulate_verify, random_verify_batch
from tests._twice import twice

TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TEMPS = (0.5, 0.7, 1.0, 1.3, 0.0)


def _batch(num_reqs: int, k: int, vocab: int, seed: int, dtype=torch.float32, **kw):
    """A vLLM-shaped batch with peaked logits (so sampled requests accept some drafts) and a
    temperature per slot drawn from TEMPS (0 = greedy)."""
    gen = torch.Generator().manual_seed(seed)
    rows = num_reqs * (k + 1)
    logits = (torch.randn(rows, vocab, generator=gen) * 3.0).to(dtype)
    batch = random_verify_batch(num_reqs, k, vocab, seed=seed, logits=logits, **kw)
    temps = torch.tensor(TEMPS)[torch.randint(0, len(TEMPS), (batch.max_num_reqs,), generator=gen)]
    return batch, temps


def _batch_with(need: tuple[str, ...], num_reqs: int, k: int, vocab: int, seed: int, **kw):
    """:func:`_batch` at the first seed ``seed + 1000 j`` whose few requests include each kind in
    ``need``: ``"greedy"`` (T = 0), ``"sampled"`` (T > 0 verifying at least one draft),
    ``"prefill"`` (a chunked-prefill request), ``"placeholder"`` (a -1 draft) -- so that a small
    batch still meets what a larger random one met by chance."""
    for s in range(seed, seed + 100_000, 1000):
        batch, temps = _batch(num_reqs, k, vocab, s, **kw)
        slots = batch.idx_mapping.long()
        lens = torch.diff(batch.cu_num_logits.long())
        has = {
            "greedy": bool((temps[slots] == 0).any()),
            "sampled": bool(((temps[slots] > 0) & (lens > 1)).any()),
            "prefill": bool((batch.seq_lens < batch.prefill_len[slots]).any()),
            "placeholder": bool((batch.draft_sampled == -1).any()),
        }
        if all(has[n] for n in need):
            return batch, temps
    raise AssertionError(f"no seed gives {need}")


def _run(batch, temps, tp: int, *, fp64: bool = False, block: int | None = None, **extra):
    a = batch.args()
    kw = dict(batch.kwargs(), use_fp64_gumbel=fp64, **extra)
    got = emulate_verify(batch.logits, tp, *a[:5], temps, *a[5:], record_block=block, **kw)
    want = verify_sampled(batch.logits, *a[:5], temps, *a[5:], **kw)
    return got, want


def _assert_equal_unflagged(got, want, batch, temps, tp: int) -> int:
    ok = ~got.fallback
    assert got.reason.dtype == torch.int8 and torch.equal(got.reason != 0, got.fallback)
    for name, g, w in zip(("sampled", "num_sampled", "num_rejected"), got[:3], want, strict=True):
        assert g.dtype == w.dtype, name
        assert torch.equal(g[ok], w[ok]), f"{name} differs at tp={tp}:\n got {g}\nwant {w}"
    # greedy requests: exactly the greedy reference, never flagged
    greedy = temps[batch.idx_mapping.long()] == 0
    ref = reference.greedy_verify(batch.logits, *batch.args(), **batch.kwargs())
    assert not bool(got.fallback[greedy].any())
    for g, w in zip(got[:3], ref, strict=True):
        assert torch.equal(g[greedy], w[greedy])
    return int(got.fallback.sum())


# every record variant (dtype x block), the finish variants cycled through TP 1/2/3/4/8
RECORDS = [(d, b) for d in DTYPES for b in SAMPLED_BLOCKS]
TPS = (2, 4, 8, 3, 1)


@pytest.mark.parametrize(("dtype", "block"), RECORDS)
def test_every_variant_mixed_batch(dtype: str, block: int) -> None:
    i = RECORDS.index((dtype, block))
    tp = TPS[i % len(TPS)]
    fp64 = i % 2 == 1
    vocab = 1200 + 37 * i  # shards narrower than a block, padded shards
    need = ("greedy", "sampled", "prefill", "placeholder")
    batch, temps = _batch_with(
        need, 4, 3, vocab, 100 + i, dtype=TORCH_DTYPE[dtype], placeholder_prob=0.2
    )
    got, want = _run(batch, temps, tp, fp64=fp64, block=block)
    flagged = _assert_equal_unflagged(got, want, batch, temps, tp)
    assert flagged <= 1  # random rows essentially never sit at the threshold


def _greedy_rows_case(
    dtype: str, tp: int, splits: int, block: int, phases: int, vocab: int, device: str
) -> None:
    """Greedy requests of a sampled step (the record kernel's argmax lanes): every adversarial
    row case (ties inside a block, at block and shard edges and across shards, -0.0 /
    +0.0, NaN, +inf, all -inf rows; NaN / +inf / max padding columns) next to sampled requests,
    drafts mostly the target argmax so each row's own argmax reaches the output: ``==`` the
    greedy reference, never flagged; on a GPU every call twice, bit-compared."""
    rows = 2 * len(adversarial.ADVERSARIAL_CASES)
    logits = adversarial.adversarial_logits(
        rows, vocab, dtype=TORCH_DTYPE[dtype], seed=tp + splits, tp_size=tp, block=block,
        device=device,
    )  # fmt: skip
    batch = adversarial.random_verify_batch(
        rows // 4, 3, vocab, seed=tp, logits=logits, accept_prob=0.9, placeholder_prob=0.0,
        prefill_prob=0.0, device=device,
    )  # fmt: skip
    temps = torch.zeros(batch.max_num_reqs, device=device)
    temps[batch.idx_mapping.long()[1::3]] = 0.7  # every third request sampled
    a = batch.args()
    kw = batch.kwargs()
    got = twice(
        emulate_verify, batch.logits, tp, *a[:5], temps, *a[5:], record_block=block,
        record_splits=splits, phases=phases, **kw,
    )  # fmt: skip
    greedy = temps[batch.idx_mapping.long()] == 0
    want = reference.greedy_verify(batch.logits, *a, **kw)
    assert not bool(got.fallback[greedy].any())
    for name, g, w in zip(("sampled", "num_sampled", "num_rejected"), got[:3], want, strict=True):
        assert torch.equal(g[greedy], w[greedy]), f"{name}:\n got {g[greedy]}\nwant {w[greedy]}"
    cu = batch.cu_num_logits.long()
    used, rows_of = want[1][greedy].sum(), (cu[1:] - cu[:-1])[greedy].sum()
    assert 2 * int(used) >= int(rows_of)  # most greedy rows' own argmax reaches the output


@pytest.mark.parametrize(
    ("dtype", "tp", "splits", "block", "phases"),
    [("bf16", 3, 3, 1024, 2), ("fp16", 2, 1, 2048, 1), ("fp32", 4, 2, 1024, 2),
     ("bf16", 1, 4, 1024, 1)],
)  # fmt: skip
def test_greedy_rows_adversarial(dtype: str, tp: int, splits: int, block: int, phases: int) -> None:
    _greedy_rows_case(dtype, tp, splits, block, phases, 5003, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dtype", "tp", "splits", "block", "vocab"),
    [("bf16", 2, 16, 4096, 151936), ("bf16", 3, 2, 2048, 128256), ("fp16", 8, 4, 1024, 200064),
     ("fp32", 1, 4, 2048, 50257), ("bf16", 4, 1, 1024, 262144)],
)  # fmt: skip
def test_greedy_rows_adversarial_on_gpu(
    dtype: str, tp: int, splits: int, block: int, vocab: int
) -> None:
    _greedy_rows_case(dtype, tp, splits, block, 2, vocab, "cuda")


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("fp64", [False, True])
def test_tp_sizes_fp32_fp64(tp: int, fp64: bool) -> None:
    batch, temps = _batch_with(
        ("greedy", "sampled", "prefill"), 3, 3, 2003, tp * 11 + fp64, prefill_prob=0.2
    )
    got, want = _run(batch, temps, tp, fp64=fp64, block=4096)
    assert _assert_equal_unflagged(got, want, batch, temps, tp) <= 1


@pytest.mark.parametrize(("tp", "splits", "fp64"), [(1, 4, False), (2, 3, True), (3, 4, False)])
def test_record_splits_are_virtual_ranks(tp: int, splits: int, fp64: bool) -> None:
    """Several record programs per row and rank (the last split short or empty) give the same
    tokens and counts as one: the finish combines tp * splits records as it combines ranks.
    (Flags can differ only at the interval test's margin, which these random rows avoid.)"""
    batch, temps = _batch_with(
        ("sampled", "prefill", "placeholder"), 4, 3, 5003, 40 + tp, placeholder_prob=0.2,
        prefill_prob=0.2,
    )  # fmt: skip
    assert batch.logits.shape[0] >= 6
    batch.logits[2, :] = -math.inf  # an all -inf row: its request falls back (no finite logit)
    batch.logits[5, 1500] = math.nan  # NaN in one split of one rank
    a = batch.args()
    kw = dict(batch.kwargs(), use_fp64_gumbel=fp64)
    one = emulate_verify(batch.logits, tp, *a[:5], temps, *a[5:], record_block=1024, **kw)
    many = emulate_verify(
        batch.logits, tp, *a[:5], temps, *a[5:], record_block=1024, record_splits=splits, **kw
    )
    want = verify_sampled(batch.logits, *a[:5], temps, *a[5:], **kw)
    assert torch.equal(many.fallback, one.fallback)
    ok = ~many.fallback
    for g, o, w in zip(many[:3], one[:3], want, strict=True):
        assert torch.equal(g[ok], o[ok]) and torch.equal(g[ok], w[ok])


def test_record_splits_rule() -> None:
    from shardmax.ops.sampled import MAX_RECORD_SPLITS, record_splits

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert record_splits(1, 100032, 2048, cpu) == 1  # the interpreter: one program per row
    assert record_splits(1, 100032, 2048, cuda) == 16  # >= 2 tiles of 2048 per split
    assert record_splits(1, 262144, 1024, cuda) == MAX_RECORD_SPLITS
    assert record_splits(96, 100032, 2048, cuda) == 2  # about 264 programs in all
    assert record_splits(512, 100032, 2048, cuda) == 1
    assert record_splits(4, 3000, 2048, cuda) == 1  # narrow shard: one tile is all there is
    from shardmax.ops.sampled import RecordLaunch, SampledVerifyPlan, record_variant
    from shardmax.testing.emulate import emulated_ranks

    _, ctxs = emulated_ranks(torch.zeros(1, 8), 1)
    for bad in (0, 33):
        with pytest.raises(ValueError, match="splits"):
            launch = RecordLaunch(record_variant(torch.float32), bad, 4, 64, "test")
            SampledVerifyPlan(ctxs[0], 1, 8, launch=launch)


@pytest.mark.parametrize("tp", [2, 3])
def test_synthetic(tp: int) -> None:
    batch, temps = _batch(6, 3, 1000, seed=7 + tp, synthetic=True)
    got, want = _run(batch, temps, tp, block=4096)
    assert _assert_equal_unflagged(got, want, batch, temps, tp) == 0  # no LSE: never risky


def test_k1_and_k5_no_prefill_args() -> None:
    for k, tp in ((1, 2), (5, 4)):
        batch, temps = _batch(4, k, 900, seed=k)
        a = batch.args()
        got = emulate_verify(batch.logits, tp, *a[:5], temps, *a[5:], record_block=4096)
        want = verify_sampled(batch.logits, *a[:5], temps, *a[5:])
        ok = ~got.fallback
        for g, w in zip(got[:3], want, strict=True):
            assert torch.equal(g[ok], w[ok])


# --------------------------------------------------------------------------------------------
# ulp-margin rows
# --------------------------------------------------------------------------------------------


def _nudge(x: float, ulps: int) -> float:
    t = torch.tensor([x], dtype=torch.float32)
    step = torch.tensor([math.inf if ulps > 0 else -math.inf], dtype=torch.float32)
    for _ in range(abs(ulps)):
        t = torch.nextafter(t, step)
    return float(t)


def _margin_batch(seed: int, vocab: int = 1000, num_reqs: int = 6):
    """Every request's first draft sits within ~1 ulp of vLLM's acceptance threshold."""
    batch, _ = _batch(num_reqs, 2, vocab, seed=seed, placeholder_prob=0.0, prefill_prob=0.0)
    gen = torch.Generator().manual_seed(seed)
    temps = torch.tensor([1.0, 0.7, 1.3])[torch.randint(0, 3, (batch.max_num_reqs,), generator=gen)]
    logits = batch.logits.clone()
    cu = batch.cu_num_logits.tolist()
    slots = batch.idx_mapping.long()
    drafts = batch.draft_sampled.clone()
    targets = []
    for r in range(num_reqs):
        row = cu[r]
        if cu[r + 1] - row < 2:
            continue
        d = int(torch.randint(0, vocab, (1,), generator=gen))
        drafts[row + 1] = d
        t = float(temps[slots[r]])
        seed_r = batch.seed[slots[r]].reshape(1)
        u, _ = acceptance_uniform_triton(seed_r, batch.pos[row].reshape(1))
        u = float(u)
        p = apply_temperature(logits[row : row + 1], torch.tensor([t]), torch.tensor([0]))[0]
        p = p.double()
        rest = torch.logsumexp(torch.cat([p[:d], p[d + 1 :]]), 0).item()
        target = math.log(u) + rest - math.log1p(-u)  # x_d - LSE(x) == log u exactly
        raw = float(torch.tensor(target * t, dtype=torch.float32))
        logits[row, d] = _nudge(raw, int(torch.randint(-2, 3, (1,), generator=gen)))
        targets.append(r)
    batch.logits = logits
    batch.draft_sampled = drafts
    return batch, temps, targets


@pytest.mark.parametrize(("seed", "tp"), [(1, 2), (2, 3), (3, 4)])
def test_ulp_margin_rows_are_flagged(seed: int, tp: int) -> None:
    batch, temps, targets = _margin_batch(seed)
    got, want = _run(batch, temps, tp, block=1024)
    assert targets and all(bool(got.fallback[r]) for r in targets), got.fallback
    assert all(int(got.reason[r]) == FallbackReason.LSE_MARGIN for r in targets), got.reason
    # non-flagged requests (none of the margin ones) never disagree
    _assert_equal_unflagged(got, want, batch, temps, tp)


def test_exact_vs_fp32_disagreements_are_flagged() -> None:
    """Count rows where vLLM-style fp32 decisions differ from exact arithmetic: all flagged."""
    disagree = flagged_disagree = 0
    for seed in (20, 21):  # 2 + 2 rows where fp32 and exact arithmetic disagree
        batch, temps, targets = _margin_batch(seed, num_reqs=6)
        got, _ = _run(batch, temps, 2, block=2048)
        cu = batch.cu_num_logits.tolist()
        slots = batch.idx_mapping.long()
        for r in targets:
            row = cu[r]
            d = int(batch.draft_sampled[row + 1])
            t = float(temps[slots[r]])
            p = apply_temperature(batch.logits[row : row + 1], torch.tensor([t]), torch.tensor([0]))
            _, log_u = acceptance_uniform_triton(
                batch.seed[slots[r]].reshape(1), batch.pos[row].reshape(1)
            )
            lse32 = torch.logsumexp(p[0], 0)
            fp32_dec = bool((p[0, d] - lse32) > log_u[0])
            exact = (p[0].double()[d] - torch.logsumexp(p[0].double(), 0)).item()
            if fp32_dec != (exact > float(log_u[0])):
                disagree += 1
                flagged_disagree += int(bool(got.fallback[r]))
    assert disagree > 0  # the seeds plant disagreements: the check below is not vacuous
    assert flagged_disagree == disagree


# --------------------------------------------------------------------------------------------
# top-k, strict, NaN, public op
# --------------------------------------------------------------------------------------------


def _topk_batch(
    seed: int, vocab: int, ks: tuple[int, ...], dtype=torch.float32, num_reqs: int = 5, **kw
):
    """A mixed batch whose sampled requests get a top-k from ``ks`` (0 = off), with ties planted
    at the k-th value of every row of those requests (the 3 next values set equal to it)."""
    batch, temps = _batch(num_reqs, 3, vocab, seed=seed, dtype=dtype, **kw)
    gen = torch.Generator().manual_seed(seed)
    slots = batch.idx_mapping.long()
    top_k = torch.zeros(batch.max_num_reqs, dtype=torch.int64)
    top_k[slots] = torch.tensor(ks)[torch.randint(0, len(ks), (slots.numel(),), generator=gen)]
    cu = batch.cu_num_logits.tolist()
    for r, slot in enumerate(slots.tolist()):
        k = int(top_k[slot])
        if k <= 0 or temps[slot] == 0:
            continue
        for row in range(cu[r], cu[r + 1]):
            order = torch.argsort(batch.logits[row].float(), descending=True)
            batch.logits[row, order[k : k + 3]] = batch.logits[row, order[k - 1]].clone()
    return batch, temps, top_k


@pytest.mark.parametrize(
    ("tp", "fp64", "dtype"),
    [(1, False, "fp32"), (2, True, "bf16"), (3, False, "fp16"), (4, False, "fp32"),
     (8, True, "fp32")],
)  # fmt: skip
def test_topk_matches_reference(tp: int, fp64: bool, dtype: str) -> None:
    """Top-k 1/20/50 (and off) mixed with temperatures and greedy rows, ties planted at the k-th
    value: every non-fallback request == the reference, and most top-k requests run sharded."""
    batch, temps, top_k = _topk_batch(50 + tp, 3001, (0, 1, 20, 50), TORCH_DTYPE[dtype])
    a = batch.args()
    kw = dict(batch.kwargs(), use_fp64_gumbel=fp64, top_k=top_k)
    got = emulate_verify(batch.logits, tp, *a[:5], temps, *a[5:], record_block=1024, **kw)
    want = verify_sampled(batch.logits, *a[:5], temps, *a[5:], **kw)
    _assert_equal_unflagged(got, want, batch, temps, tp)
    slots = batch.idx_mapping.long()
    active = (top_k[slots] > 0) & (temps[slots] != 0)
    assert int(active.sum()) >= 2
    assert int((active & ~got.fallback).sum()) >= int(active.sum()) // 2, got.fallback


def test_topk_with_record_splits_and_synthetic() -> None:
    batch, temps, top_k = _topk_batch(77, 5003, (1, 20, 50), synthetic=True)
    a = batch.args()
    kw = dict(batch.kwargs(), top_k=top_k)
    one = emulate_verify(batch.logits, 2, *a[:5], temps, *a[5:], record_block=1024, **kw)
    many = emulate_verify(
        batch.logits, 2, *a[:5], temps, *a[5:], record_block=1024, record_splits=4, **kw
    )
    want = verify_sampled(batch.logits, *a[:5], temps, *a[5:], **kw)
    assert torch.equal(one.fallback, many.fallback)
    ok = ~many.fallback
    for g, o, w in zip(many[:3], one[:3], want, strict=True):
        assert torch.equal(g[ok], w[ok]) and torch.equal(o[ok], w[ok])


def test_topk_guard_and_capacity_fall_back() -> None:
    """k >= 64 (beyond the candidates): -1 / 0 / 0 + fallback; a next distinct value within
    3.5e-4 of the range below the k-th (vLLM's pivot search may not converge): fallback."""
    batch, temps = _batch(6, 3, 900, seed=9, prefill_prob=0.0)
    slots = batch.idx_mapping.long()
    temps[slots] = 1.0
    top_k = torch.zeros(batch.max_num_reqs, dtype=torch.int64)
    top_k[slots] = 20
    top_k[slots[0]] = 64  # too large for the candidates
    top_k[slots[1]] = 900  # k >= V: top-k off, runs as a temperature row
    cu = batch.cu_num_logits.tolist()
    row = cu[2]  # first row of request 2: near-tie just below its 20th value
    order = torch.argsort(batch.logits[row], descending=True)
    batch.logits[row, order[20]] = batch.logits[row, order[19]].clone() - 1e-5
    a = batch.args()
    kw = dict(batch.kwargs(), top_k=top_k)
    got = emulate_verify(batch.logits, 2, *a[:5], temps, *a[5:], record_block=1024, **kw)
    want = verify_sampled(batch.logits, *a[:5], temps, *a[5:], **kw)
    assert bool(got.fallback[0]) and bool((got.sampled[0] == -1).all())
    assert int(got.num_sampled[0]) == 0 and int(got.num_rejected[0]) == 0
    assert bool(got.fallback[2])  # the row 2 verification starts on is unsafe
    assert int(got.reason[0]) == FallbackReason.TOPK_CAPACITY
    assert int(got.reason[2]) == FallbackReason.TOPK_BOUNDARY
    ok = ~got.fallback
    assert bool(ok[1])
    for g, w in zip(got[:3], want, strict=True):
        assert torch.equal(g[ok], w[ok])


def _split_top_c(
    x: torch.Tensor, vocab_start: int, num_valid: int, splits: int, block: int, c: int = 64
):
    """Expected candidates of the record kernel: per split, the top-``c`` packed keys of ``x``
    (value desc, id asc) over its columns, ``EMPTY_KEY`` padding; ``[splits * rows, c]``."""
    from shardmax.runtime.keys import EMPTY_KEY, pack_keys

    C = c
    rows = x.shape[0]
    chunk = math.ceil(math.ceil(num_valid / splits) / block) * block
    out = torch.full((splits, rows, C), EMPTY_KEY, dtype=torch.int64)
    for j in range(splits):
        c0, c1 = min(j * chunk, num_valid), min((j + 1) * chunk, num_valid)
        if c1 <= c0:
            continue
        ids = torch.arange(vocab_start + c0, vocab_start + c1).expand(rows, c1 - c0)
        keys = pack_keys(x[:, c0:c1], ids)
        top = torch.topk(keys, min(C, c1 - c0), dim=1).values
        out[j, :, : top.shape[1]] = top
    return out.view(splits * rows, C)


@pytest.mark.parametrize(
    ("dtype", "splits", "C"),
    [("bf16", 1, 64), ("fp32", 3, 64), ("fp16", 2, 64), ("bf16", 2, 32), ("fp32", 1, 128)],
)
def test_record_kernel_candidates_are_each_splits_exact_top_c(
    dtype: str, splits: int, C: int
) -> None:
    """The record kernel's candidates (candidate steps) == each split's top-C packed keys of
    ``x = raw / T`` (ties by lowest id -- bf16 rows are full of ties, planted ties straddle the
    C-th value for every C, -0.0 / +0.0, -inf columns, an all -inf row, a row with 10 finite
    values, padding columns that would win if read); greedy rows send ``EMPTY_KEY``."""
    from shardmax.ops.sampled import record_variant, record_words
    from shardmax.runtime.keys import EMPTY_KEY

    gen = torch.Generator().manual_seed(splits)
    rows, width, num_valid, vocab_start, block = 6, 5000, 4900, 1000, 1024
    raw = (torch.randn(rows, width, generator=gen) * 2.0).to(TORCH_DTYPE[dtype])
    raw[:, num_valid:] = 100.0  # padding: never read
    top = torch.argsort(raw[0, :num_valid].float(), descending=True)
    raw[0, top[20:140]] = raw[0, top[20]].clone()  # a tie group across the C-th place
    raw[1, :num_valid:2] = -0.0
    raw[1, 1:num_valid:2] = 0.0
    raw[2] = float("-inf")
    raw[3, :3000] = float("-inf")
    few = torch.randperm(num_valid, generator=gen)[:10]  # 10 finite values, then -inf ties
    raw[5] = float("-inf")
    raw[5, few] = torch.randn(10, generator=gen).to(raw.dtype)
    temps = torch.tensor([1.0, 0.7, 1.3, 0.5, 0.0, 1.0])
    buf = record_buffer(raw, vocab_start, num_valid, temps, record_variant(raw.dtype, block),
                        splits, C)  # fmt: skip
    n_rec = splits * rows * (record_words(False) + 1)
    got = buf[n_rec:].view(splits * rows, C)
    x = raw.float() / torch.where(temps == 0, 1.0, temps)[:, None]
    want = _split_top_c(x[:, :num_valid], vocab_start, num_valid, splits, block, C)
    greedy = (temps == 0).repeat(splits)
    want[greedy] = EMPTY_KEY
    assert torch.equal(got, want)


def test_candidate_overflow_falls_back() -> None:
    """A row whose largest values all sit in one lane group of the record kernel (period 128
    columns = ``SELECTION_GROUPS``): more than ``CANDIDATE_CAPACITY`` keys reach the selection
    threshold, the split's candidates are unknown, and the top-k request on that row falls back
    (TOPK_BOUNDARY), as does the top-p request on another such row (NUCLEUS_NOT_COVERED); the
    other requests still match the reference."""
    from shardmax.ops.sampled import CANDIDATE_CAPACITY, SELECTION_GROUPS

    block, width = 1024, 40 * 1024
    n_max = width // SELECTION_GROUPS
    assert n_max > CANDIDATE_CAPACITY
    batch, temps = _batch(4, 1, width, seed=12, prefill_prob=0.0)
    slots = batch.idx_mapping.long()
    temps[slots] = 1.0
    row = int(batch.cu_num_logits[1])  # request 1's first row
    for r in (row, int(batch.cu_num_logits[3])):  # requests 1 (top-k) and 3 (top-p only)
        batch.logits[r] = torch.rand(width) * 0.01
        batch.logits[r, ::SELECTION_GROUPS] = 10.0 + torch.arange(n_max) * 0.1  # well spaced
    top_k = torch.zeros(batch.max_num_reqs, dtype=torch.int64)
    top_k[slots] = 20
    top_p = torch.ones(batch.max_num_reqs)
    top_p[slots[2]] = 0.9
    top_k[slots[3]] = 0
    top_p[slots[3]] = 0.9
    a = batch.args()
    kw = dict(batch.kwargs(), top_k=top_k, top_p=top_p)
    got = emulate_verify(batch.logits, 1, *a[:5], temps, *a[5:], record_block=block, **kw)
    want = verify_sampled(batch.logits, *a[:5], temps, *a[5:], **kw)
    assert bool(got.fallback[1]) and int(got.reason[1]) == FallbackReason.TOPK_BOUNDARY
    assert int(got.reason[3]) == FallbackReason.NUCLEUS_NOT_COVERED  # no top-k on request 3
    ok = ~got.fallback
    assert bool(ok[0])  # request 0 (top-k 20, ordinary rows) runs sharded
    for g, w in zip(got[:3], want, strict=True):
        assert torch.equal(g[ok], w[ok])


def _nucleus_state(batch, seed: int, ps, mps, ks):
    gen = torch.Generator().manual_seed(seed)
    n = batch.max_num_reqs

    def pick(vals):
        return torch.tensor(vals)[torch.randint(0, len(vals), (n,), generator=gen)]

    return pick(ps).to(torch.float32), pick(mps).to(torch.float32), pick(ks).to(torch.int64)


@pytest.mark.parametrize(
    ("tp", "fp64", "dtype", "splits"),
    [(1, False, "fp32", 1), (2, True, "bf16", 2), (3, False, "fp16", 1), (4, False, "fp32", 3),
     (8, True, "fp32", 1)],
)  # fmt: skip
def test_top_p_min_p_match_reference(tp: int, fp64: bool, dtype: str, splits: int) -> None:
    """Top-p 0.8/0.9/0.95 (and off), min-p 0.05 (and off), top-k 20 (and off) mixed with
    temperatures and greedy rows: every non-fallback request == the reference (exact nucleus),
    and most top-p / min-p requests run sharded."""
    batch, temps = _batch(6, 3, 3001, seed=300 + tp, dtype=TORCH_DTYPE[dtype])
    batch.logits.mul_(2.0)  # peaked rows: nuclei of a few ids, as most decode steps
    top_p, min_p, top_k = _nucleus_state(batch, tp, (1.0, 0.8, 0.9, 0.95), (0.0, 0.05), (0, 20))
    a = batch.args()
    kw = dict(batch.kwargs(), use_fp64_gumbel=fp64, top_p=top_p, min_p=min_p, top_k=top_k)
    got = emulate_verify(
        batch.logits, tp, *a[:5], temps, *a[5:], record_block=1024, record_splits=splits, **kw
    )
    want = verify_sampled(batch.logits, *a[:5], temps, *a[5:], **kw)
    _assert_equal_unflagged(got, want, batch, temps, tp)
    slots = batch.idx_mapping.long()
    active = ((top_p[slots] < 1) | (min_p[slots] > 0)) & (temps[slots] != 0)
    # min-p together with top-k falls back when min-p leaves <= k survivors (vLLM's top-k search
    # would run on a -inf tail): the common case on peaked rows, so it is not counted here
    simple = active & ~((min_p[slots] > 0) & (top_k[slots] > 0))
    assert int(simple.sum()) >= 2
    assert int((simple & ~got.fallback).sum()) >= int(simple.sum()) // 2, got.fallback


def test_fp32_top_p_is_used_as_given_and_equals_its_fp64_widening() -> None:
    """vLLM keeps top-p in fp32: the step's checks keep that tensor itself (no host cast, which
    would launch a kernel every step) and the kernels widen it exactly, so every output ==
    the run on the fp64 copy; other float dtypes are cast to fp32."""
    from shardmax.runtime.validation import check_step_batch

    batch, temps = _batch(6, 3, 1031, seed=77, dtype=torch.bfloat16)
    batch.logits.mul_(2.0)
    top_p, _, _ = _nucleus_state(batch, 7, (1.0, 0.8, 0.9, 0.95), (0.0,), (0,))
    a = batch.args()
    checked = check_step_batch(
        batch.logits.shape[0], batch.logits.device, *a, top_p=top_p, temperature=temps
    )
    assert checked.top_p is top_p
    half = check_step_batch(
        batch.logits.shape[0], batch.logits.device, *a, top_p=top_p.half(), temperature=temps
    )  # fmt: skip
    assert half.top_p is not None and half.top_p.dtype == torch.float32
    runs = []
    for p in (top_p, top_p.double()):
        kw = dict(batch.kwargs(), top_p=p)
        runs.append(emulate_verify(batch.logits, 2, *a[:5], temps, *a[5:], **kw))
    assert all(torch.equal(x, y) for x, y in zip(*runs, strict=True))
    active = (top_p[batch.idx_mapping.long()] < 1) & (temps[batch.idx_mapping.long()] != 0)
    assert int((active & ~runs[0].fallback).sum()) >= 1  # a top-p request verified sharded


def test_top_p_guard_falls_back() -> None:
    """A nucleus wider than the candidates and a tie at the nucleus boundary fall back; p close
    to 0 keeps only the top token; invalid top_p / min_p raise naming the argument."""
    batch, temps = _batch(4, 3, 2000, seed=21, prefill_prob=0.0)
    slots = batch.idx_mapping.long()
    temps[slots] = 1.0
    top_p = torch.ones(batch.max_num_reqs)
    cu = batch.cu_num_logits.tolist()
    # request 0: flat rows, p = 0.99 -> nucleus of ~1900 ids, far beyond 64 candidates
    batch.logits[cu[0] : cu[1]] = torch.randn(cu[1] - cu[0], 2000) * 0.01
    top_p[slots[0]] = 0.99
    # request 1: a tie between the last kept and the first excluded value of its first row (a
    # peaked row, so that the nucleus fits in the candidates and the tie is what fails)
    row = batch.logits[cu[1]]
    row.copy_(torch.randn(2000) * 0.5 - 10.0)
    row[torch.randperm(2000)[:12]] = 5.0 - 0.4 * torch.arange(12.0)
    x = row.clone()
    order = torch.sort(x, descending=True, stable=True).indices
    prob = torch.softmax(x.double(), 0)[order]
    j = int((torch.cumsum(prob, 0) < 0.9).sum()) + 1  # nucleus size at p = 0.9
    row[order[j]] = row[order[j - 1]].clone()
    top_p[slots[1]] = 0.9
    # request 2: p -> 0, only the top token is kept: a draft other than the argmax is rejected
    top_p[slots[2]] = 1e-6
    a = batch.args()
    kw = dict(batch.kwargs(), top_p=top_p)
    got = emulate_verify(batch.logits, 2, *a[:5], temps, *a[5:], record_block=1024, **kw)
    want = verify_sampled(batch.logits, *a[:5], temps, *a[5:], **kw)
    assert bool(got.fallback[0]) and bool(got.fallback[1])
    assert not bool(got.fallback[2])
    assert int(got.reason[0]) == FallbackReason.NUCLEUS_NOT_COVERED
    assert int(got.reason[1]) == FallbackReason.NUCLEUS_TIE_STRADDLE, got.reason
    first = int(got.sampled[2, 0])
    assert first == int(torch.argmax(batch.logits[cu[2]]))  # accepted argmax or resampled top-1
    ok = ~got.fallback
    for g, w in zip(got[:3], want, strict=True):
        assert torch.equal(g[ok], w[ok])
    for name, bad in (("top_p", 0.0), ("top_p", 1.5), ("min_p", 1.5), ("min_p", -0.1)):
        t = torch.ones(batch.max_num_reqs) if name == "top_p" else torch.zeros(batch.max_num_reqs)
        t[slots[0]] = bad
        with pytest.raises(ValueError, match=name):
            emulate_verify(batch.logits, 2, *a[:5], temps, *a[5:], **{**batch.kwargs(), name: t})


def test_fallback_reason_codes_match_the_guard() -> None:
    """The nucleus codes of :class:`FallbackReason` are :class:`GuardReason`'s (same numbers), so
    the per-request reason can be read with either enum."""
    from shardmax.reference.nucleus import GuardReason

    for g in GuardReason:
        if g != GuardReason.OK:
            f = FallbackReason(int(g))
            assert f.name.removeprefix("NUCLEUS_") == g.name, (f, g)
    assert len({int(f) for f in FallbackReason}) == len(FallbackReason)


def test_bad_mode_and_temperature() -> None:
    batch, temps = _batch(2, 3, 300, seed=1)
    a = batch.args()
    with pytest.raises(ValueError, match="mode"):
        shardmax.sharded_verify(batch.logits, *a[:5], temps, *a[5:], vocab_start=0, mode="x")
    bad = temps.clone()
    bad[batch.idx_mapping.long()[0]] = -1.0
    with pytest.raises(ValueError, match="temperature"):
        shardmax.sharded_verify(batch.logits, *a[:5], bad, *a[5:], vocab_start=0)


def test_nan_rows_of_sampled_requests_fall_back() -> None:
    batch, temps = _batch(4, 3, 700, seed=9, prefill_prob=0.0)
    temps[batch.idx_mapping.long()] = 0.7
    batch.logits[batch.cu_num_logits[:-1].long(), 5] = float("nan")  # first row: always used
    a = batch.args()
    got = emulate_verify(batch.logits, 2, *a[:5], temps, *a[5:], record_block=4096)
    assert bool(got.fallback.all())
    assert bool((got.reason == FallbackReason.NON_FINITE).all())
    # a NaN only in rows the decision does not use (past a rejection) is not flagged
    batch.logits[batch.cu_num_logits[:-1].long(), 5] = 0.0
    last = batch.cu_num_logits[1:].long() - 1
    batch.logits[last, 5] = float("nan")
    got = emulate_verify(batch.logits, 2, *a[:5], temps, *a[5:], record_block=4096)
    full = got.num_sampled == (batch.cu_num_logits[1:] - batch.cu_num_logits[:-1])
    assert torch.equal(got.fallback, full)


def test_public_op_single_rank() -> None:
    batch, temps = _batch(5, 3, 1500, seed=21)
    a = batch.args()
    got = shardmax.sharded_verify(batch.logits, *a[:5], temps, *a[5:], vocab_start=0)
    assert isinstance(got, shardmax.VerifyResult)
    want = verify_sampled(batch.logits, *a[:5], temps, *a[5:])
    ok = ~got.fallback
    for g, w in zip(got[:3], want, strict=True):
        assert torch.equal(g[ok], w[ok])
    empty = shardmax.sharded_verify(
        batch.logits[:0],
        batch.draft_sampled[:0],
        batch.cu_num_logits[:1],
        batch.pos[:0],
        batch.idx_mapping[:0],
        batch.expanded_local_pos[:0],
        temps,
        batch.seed,
        3,
        vocab_start=0,
    )
    assert empty.sampled.shape == (0, 4) and empty.fallback.dtype == torch.bool


def test_min_p_survivors_past_the_merged_capacity_fall_back() -> None:
    """Every record split holds all of its min-p survivors (50 < 64 each) but their union (200)
    is more than the merged list keeps: the survivors are not known, the request falls back with
    MIN_P_NOT_COVERED instead of renormalising top-p over the first 64."""
    batch, temps = _batch(3, 1, 8192, seed=31, prefill_prob=0.0)
    slots = batch.idx_mapping.long()
    temps[slots] = 1.0
    gen = torch.Generator().manual_seed(5)
    row = int(batch.cu_num_logits[1])
    batch.logits[row] = torch.randn(8192, generator=gen) * 0.1
    for j in range(4):  # 50 survivors in each of the 4 splits of 2048 columns
        cols = j * 2048 + torch.randperm(2048, generator=gen)[:50]
        batch.logits[row, cols] = 10.0 + torch.rand(50, generator=gen)
    min_p = torch.zeros(batch.max_num_reqs)
    min_p[slots] = 0.05
    top_p = torch.ones(batch.max_num_reqs)
    top_p[slots] = 0.95
    a = batch.args()
    kw = dict(batch.kwargs(), top_p=top_p, min_p=min_p)
    got = emulate_verify(batch.logits, 1, *a[:5], temps, *a[5:], record_block=1024,
                         record_splits=4, **kw)  # fmt: skip
    want = verify_sampled(batch.logits, *a[:5], temps, *a[5:], **kw)
    assert bool(got.fallback[1]) and int(got.reason[1]) == FallbackReason.MIN_P_NOT_COVERED
    ok = ~got.fallback
    for g, w in zip(got[:3], want, strict=True):
        assert torch.equal(g[ok], w[ok])


def test_top_k_at_least_vocab_is_off_for_min_p() -> None:
    """A tiny vocabulary (V=40 < 64 candidates) with top-k 50 >= V (off, as in vLLM) and min-p:
    the requests run sharded like top-k 0 would (the min-p/top-k tail rule must not fire)."""
    batch, temps = _batch(4, 1, 40, seed=41, prefill_prob=0.0)
    slots = batch.idx_mapping.long()
    temps[slots] = 1.0
    top_k = torch.zeros(batch.max_num_reqs, dtype=torch.int64)
    top_k[slots] = 50
    min_p = torch.zeros(batch.max_num_reqs)
    min_p[slots] = 0.1
    a = batch.args()
    kw = dict(batch.kwargs(), top_k=top_k, min_p=min_p)
    got = emulate_verify(batch.logits, 2, *a[:5], temps, *a[5:], record_block=1024, **kw)
    want = verify_sampled(batch.logits, *a[:5], temps, *a[5:], **kw)
    assert int((~got.fallback).sum()) >= 2, got.reason
    ok = ~got.fallback
    for g, w in zip(got[:3], want, strict=True):
        assert torch.equal(g[ok], w[ok])


def record_buffer(
    raw: torch.Tensor,
    vocab_start: int,
    num_valid: int,
    temps: torch.Tensor,
    variant: str,
    splits: int,
    candidates: int,
) -> torch.Tensor:
    """One rank's record buffer of a candidate step whose every row is a one-row request with
    temperature ``temps[row]`` (the record kernel's launcher, as a plan calls it)."""
    from shardmax.ops.sampled import (
        RecordLaunch,
        candidate_capacity,
        record_words,
        row_params,
        sampled_records,
    )
    from shardmax.runtime.validation import check_step_batch

    rows, dev = raw.shape[0], raw.device
    i32, i64 = torch.int32, torch.int64
    batch = check_step_batch(
        rows, dev, torch.zeros(rows, dtype=i64, device=dev),
        torch.arange(rows + 1, dtype=i32, device=dev), torch.zeros(rows, dtype=i64, device=dev),
        torch.arange(rows, dtype=i32, device=dev), torch.zeros(rows, dtype=i32, device=dev),
        torch.arange(rows, dtype=i64, device=dev), 1, temperature=temps.to(dev),
    )  # fmt: skip
    launch = RecordLaunch(variant, splits, 4, candidates, "test")
    n = splits * rows * (record_words(False) + 1 + candidates)
    buf = torch.empty(n, dtype=i64, device=dev)
    scratch = torch.empty((splits * rows, candidate_capacity(candidates)), dtype=i64, device=dev)
    sampled_records(raw, vocab_start, num_valid, row_params(batch), launch, False, True, buf,
                    scratch)  # fmt: skip
    return buf
