"""The device-decided fallback (:class:`shardmax.integrations.vllm.fallback.DeviceFallback`):
vLLM's chain on the step's flagged requests (a padded sub-batch of them, picked on the device)
or on the whole step when more are flagged than that holds, run by the device only when a
request of the step is flagged.

The steps here are vLLM's own answers with planted damage: flagged requests get wrong tokens and
counts (the fallback must replace them by vLLM's), an unflagged request on a step with nothing
flagged keeps its (damaged) values (the body must not run: a fallback that always ran would
repair it). CPU (``emulate``: the same tables and kernels, the predicate read on the host) and
the H200 (the conditional CUDA graph, twice per step, bit-compared, no host sync).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardmax.integrations.vllm.fallback import SLOTS, DeviceFallback, _pow2, _StepTensors
from shardmax.ops.sampled import VerifyResult
from shardmax.testing.traffic import realistic_batch
from shardmax.testing.vllm_chain import NativeChain, verify_inputs

CHAINS = NativeChain.discover()
by_version = pytest.mark.parametrize("chain", CHAINS, ids=[c.id for c in CHAINS])


def _needs_gpu_and_chains() -> None:
    """Skips a GPU test without a CUDA GPU or an extracted vLLM chain tree."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if not CHAINS:
        pytest.skip("no vLLM chain tree (scripts/vllm_kernels.sh)")


def _result(want, flagged: list[int], damaged: list[int]) -> VerifyResult:
    """vLLM's answer as a VerifyResult (-1 past num_sampled), ``damaged`` requests wrong,
    ``flagged`` requests flagged (reason 9)."""
    sampled, num_sampled, num_rejected = (t.clone() for t in want[:3])
    cols = torch.arange(sampled.shape[1], device=sampled.device)[None, :]
    sampled = torch.where(cols < num_sampled[:, None], sampled, -1).to(torch.int64).contiguous()
    num_sampled = num_sampled.to(torch.int32).contiguous()
    num_rejected = num_rejected.to(torch.int32).contiguous()
    n = sampled.shape[0]
    fallback = torch.zeros(n, dtype=torch.bool, device=sampled.device)
    reason = torch.zeros(n, dtype=torch.int8, device=sampled.device)
    for r in damaged:
        sampled[r] = 7
        num_sampled[r] = 1
        num_rejected[r] = 3
    for r in flagged:
        fallback[r] = True
        reason[r] = 9
    return VerifyResult(sampled, num_sampled, num_rejected, fallback, reason)


def _same(res: VerifyResult, want, what: str) -> None:
    got = (res.sampled.cpu(), res.num_sampled.cpu(), res.num_rejected.cpu())
    w = [t.cpu() for t in want[:3]]
    assert torch.equal(got[1], w[1].to(torch.int32)), (what, got[1], w[1])
    assert torch.equal(got[2], w[2].to(torch.int32)), what
    cols = torch.arange(got[0].shape[1])[None, :] < got[1][:, None]
    assert torch.equal(got[0][cols], w[0].to(torch.int64)[cols]), what
    assert bool((got[0][~cols] == -1).all()), what
    assert not bool(res.fallback.any()) and not bool(res.reason.any()), what


def _tokens(out) -> list[list[int]]:
    """Each request's tokens of a chain's answer (``sampled`` up to ``num_sampled``; the columns
    past it are uninitialised memory, which may or may not repeat between calls)."""
    return [row[: int(n)].tolist() for row, n in zip(out[0], out[1], strict=True)]


def _step(seed: int, num_reqs: int, vocab: int, device: str):
    b = realistic_batch(num_reqs, 3, vocab, seed=seed, mix="temperature", device=device)
    return b, verify_inputs(b)


def _sub_step(logits: torch.Tensor, kw: dict, picks: list[tuple[int, int]], width: int = 0):
    """A step of some of a batch's requests, ``picks = [(request, rows), ...]`` (its first
    ``rows`` rows: fewer drafts), on the batch's per-slot state (vLLM's persistent buffers) and
    in new tensors (vLLM allocates them per step). ``width > V``: the logits a view of wider
    rows (the padded LM head's ``[:, :V]``)."""
    cu = kw["cu_num_logits_np"].astype(np.int64)
    rows = torch.tensor([int(cu[r]) + i for r, c in picks for i in range(c)], dtype=torch.int64)
    dev = logits.device
    sub_cu = np.concatenate([[0], np.cumsum([c for _, c in picks])]).astype(cu.dtype)
    reqs = torch.tensor([r for r, _ in picks], dtype=torch.int64)
    out = dict(kw)
    for name in ("draft_sampled", "pos", "expanded_idx_mapping", "expanded_local_pos"):
        out[name] = kw[name][rows.to(dev)].clone()
    for name in ("idx_mapping", "seq_lens"):
        out[name] = kw[name][reqs.to(dev)].clone()
    out["cu_num_logits"] = torch.from_numpy(sub_cu).to(dev, kw["cu_num_logits"].dtype)
    out["cu_num_logits_np"] = sub_cu
    out["idx_mapping_np"] = kw["idx_mapping_np"][reqs.numpy()].copy()
    sub = logits[rows.to(dev)]
    if width > sub.shape[1]:
        wide = torch.full((sub.shape[0], width), 99.0, dtype=sub.dtype, device=dev)
        wide[:, : sub.shape[1]] = sub  # padding columns that would win if read
        sub = wide[:, : logits.shape[1]]
    return sub, out


@pytest.mark.e2e
@by_version
def test_device_fallback_emulated(chain: NativeChain) -> None:
    b, kw = _step(3, 5, 512, "cpu")
    want = chain.verify(b.logits, **kw)
    fb = DeviceFallback(chain, emulate=True)
    # first step of a signature: the caller's host read
    res = _result(want, [1], [1])
    assert not fb.run(res, b.logits, **kw)
    assert bool(res.fallback[1]) and fb.stats["host_read"] == 1 and fb.stats["launched"] == 0
    # the second captures (each capture runs prologue and body once, as IfGraph's warm-up
    # does): with nothing flagged, the step's outputs stay as they are
    res = _result(want, [], [2])
    assert fb.run(res, b.logits, **kw)
    assert int(res.num_sampled[2]) == 1 and res.sampled[2].tolist() == [7] * 4
    assert fb.stats["captured"] == SLOTS and fb.stats["launched"] == 1
    # then on the device (emulated): flagged requests get vLLM's answer, flags cleared
    for flagged in ([1], [0, 4], [0, 1, 2, 3, 4]):
        res = _result(want, flagged, flagged)
        assert fb.run(res, b.logits, **kw)
        _same(res, want, f"flagged {flagged}")
    # nothing flagged: the body does not run (the planted damage stays)
    res = _result(want, [], [2])
    assert fb.run(res, b.logits, **{**kw, "checks": False})
    assert int(res.num_sampled[2]) == 1 and int(res.sampled[2, 0]) == 7
    assert fb.stats["launched"] == 5
    # the logits elsewhere (vLLM allocates them per step): the same signature, read there
    moved = b.logits.clone()
    res = _result(want, [3], [3])
    assert fb.run(res, moved, **kw)
    _same(res, want, "moved logits")
    # vLLM's per-slot state elsewhere (vLLM double-buffers it: its address alternates), here
    # with other seeds: the same signature, read where it is now
    kw_moved = {**kw, **{n: kw[n].clone() for n in ("temperature_gpu", "prefill_len")}}
    for mult in (3, 5, 7, 11, 13, 17, 19, 23):  # seeds that change vLLM's answer on this batch
        kw_moved["seed_gpu"] = kw["seed_gpu"] * mult + 1
        want_moved = chain.verify(b.logits, **kw_moved)
        if _tokens(want_moved) != _tokens(want):
            break
    else:
        pytest.fail("no other seeds change vLLM's answer on this batch: the check below is moot")
    res = _result(want_moved, [0, 1, 2, 3, 4], [0, 1, 2, 3, 4])
    assert fb.run(res, b.logits, **kw_moved)
    _same(res, want_moved, "per-slot state moved, other seeds")
    assert fb.stats["signatures"] == 1 and fb.stats["captured"] == SLOTS, fb.stats
    # the GPU has fetched none of the signature's tables yet (the host ran SLOTS steps ahead):
    # the caller reads the flags, nothing is launched
    bucket = next(iter(fb._buckets.values()))
    assert all(slot.seq >= 2 for slot in bucket.slots)  # round robin: every table in use
    for slot in bucket.slots:
        slot.seq += 1  # a request the GPU has not acknowledged
    res = _result(want, [3], [3])
    assert not fb.run(res, b.logits, **kw) and fb.stats["no_free_slot"] == 1
    assert bool(res.fallback[3]) and int(res.sampled[3, 0]) == 7
    for slot in bucket.slots:
        slot.seq -= 1
    # sampling values changed in place (same addresses): vLLM decides otherwise (temperature
    # launches, fp32 copy), so it is another signature -- never the old body
    kw_hot = {**kw, "temperature_np": kw["temperature_np"].copy()}
    saved = kw["temperature_gpu"].clone()
    kw_hot["temperature_gpu"].mul_(0.7)
    kw_hot["temperature_np"] *= np.float32(0.7)
    want_hot = chain.verify(b.logits, **kw_hot)
    res = _result(want_hot, [0], [0])
    assert not fb.run(res, b.logits, **kw_hot)
    res = _result(want_hot, [0, 2], [0, 2])
    assert fb.run(res, b.logits, **kw_hot)
    _same(res, want_hot, "temperatures changed in place")
    kw["temperature_gpu"].copy_(saved)
    # outputs the kernel cannot write: the caller reads the flags
    res = _result(want, [1], [1])
    res = res._replace(num_sampled=res.num_sampled.to(torch.int64))
    assert not fb.run(res, b.logits, **kw)
    # a batch tensor it cannot copy as bytes: the caller reads the flags
    strided = {**kw, "pos": torch.stack([kw["pos"], kw["pos"]], 1)[:, 0]}
    assert not fb.run(_result(want, [1], [1]), b.logits, **strided)
    assert fb.fold(b.logits, **strided) is None  # nor folded: the caller's path
    persistent = {**kw, "seed_gpu": torch.stack([kw["seed_gpu"], kw["seed_gpu"]], 1)[:, 0]}
    assert not fb.run(_result(want, [1], [1]), b.logits, **persistent)
    # an empty step: nothing to decide
    empty, kw_empty = _sub_step(b.logits, kw, [])
    none = _result([t[:0] for t in want[:3]], [], [])
    assert fb.run(none, empty, **kw_empty)
    # logits rows closer than V (broadcast, overlapping): not copyable as one span, host read
    row = b.logits[:1].expand(b.logits.shape[0], -1)
    want_row = chain.verify(row, **kw)
    assert not fb.run(_result(want_row, [1], [1]), row, **kw)
    assert fb.fold(row, **kw) is None


@pytest.mark.e2e
@by_version
def test_device_fallback_padded_step_tensors(chain: NativeChain) -> None:
    """vLLM pads ``seq_lens`` past the requests under full CUDA graphs (``input_buffers.
    seq_lens[:num_reqs_padded]``; the chain reads ``[num_reqs]`` of it): the fold copies the
    entries the chain reads, never the padding into a bucket buffer of ``reqs`` entries (found
    by a review helper: 96 bytes copied into a 32-byte buffer, the heap past it overwritten);
    a step tensor shorter than the chain reads is not copied at all (the caller's path)."""
    from shardmax.integrations.vllm.fallback import _BODY, _COPIED

    b, kw = _step(3, 5, 512, "cpu")
    want = chain.verify(b.logits, **kw)
    padded = torch.full((24,), 0x41414141, dtype=kw["seq_lens"].dtype)
    padded[:5] = kw["seq_lens"]
    rows = b.logits.shape[0]
    eim = torch.full((rows + 8,), 3, dtype=kw["expanded_idx_mapping"].dtype)
    eim[:rows] = kw["expanded_idx_mapping"]
    kwp = {**kw, "seq_lens": padded, "expanded_idx_mapping": eim[: rows + 8], "checks": False}
    fb = DeviceFallback(chain, emulate=True)
    assert not fb.run(_result(want, [1], [1]), b.logits, **kwp)  # the signature's first step
    assert fb.run(_result(want, [], []), b.logits, **kwp)  # captured
    bucket = next(iter(fb._buckets.values()))
    for name, n in (("seq_lens", 5), ("expanded_idx_mapping", rows)):
        i = _COPIED.index(name)
        copied = bucket.slots[0].host[_BODY + 3 * i + 2]
        assert copied == n * padded.element_size() <= bucket.static[name].nbytes, (name, copied)
    res = _result(want, [0, 2, 4], [0, 2, 4])
    assert fb.run(res, b.logits, **kwp)
    _same(res, want, "padded seq_lens and expanded_idx_mapping")
    short = {**kw, "seq_lens": kw["seq_lens"][:4], "checks": False}
    assert fb.fold(b.logits, **short) is None


@pytest.mark.e2e
@by_version
def test_device_fallback_buckets(chain: NativeChain) -> None:
    """Steps of 5 to 8 requests (K = 3, 1 to 4 rows each) share one bucket (8 requests, 32
    rows): one capture, padding requests and rows past the last request's in the static buffers,
    every step in new tensors, `==` vLLM's chain on the step itself; a step of 9 is the next
    bucket; logits rows wider than V (the padded LM head's view) a signature of their own."""
    b, kw = _step(11, 10, 384, "cpu")
    fb = DeviceFallback(chain, emulate=True)
    gen = np.random.default_rng(5)
    shapes = [
        [(r, 4) for r in range(8)],  # a full bucket: no padding
        [(0, 4), (3, 1), (5, 2), (7, 4), (9, 3)],  # 5 requests, 14 rows
        [(2, 2), (1, 4), (4, 1), (6, 3), (8, 4), (9, 1), (0, 2)],  # 7 requests, 17 rows
        [(r, 1) for r in range(6)],  # 6 requests, 6 rows: most of the rows past the last
    ]
    for i, picks in enumerate([shapes[0], *shapes]):
        logits, sub = _sub_step(b.logits, kw, picks)
        want = chain.verify(logits, **sub)
        n = len(picks)
        flagged = sorted(gen.choice(n, size=1 + i % n, replace=False).tolist())
        res = _result(want, flagged, flagged)
        assert fb.run(res, logits, **sub) == (i > 0), (i, fb.stats)
        if i > 0:
            _same(res, want, f"step {i}: {n} requests, flagged {flagged}")
    assert fb.stats["signatures"] == 1, fb.stats
    # 9 requests: the next bucket (16), first seen: the caller's host read
    logits, sub = _sub_step(b.logits, kw, [(r, 2) for r in range(9)])
    want = chain.verify(logits, **sub)
    assert not fb.run(_result(want, [4], [4]), logits, **sub)
    res = _result(want, [4, 8], [4, 8])
    assert fb.run(res, logits, **sub)
    _same(res, want, "9 requests in the bucket of 16")
    # wider logits rows: their own signature, the padding columns never read
    for step in range(2):
        logits, sub = _sub_step(b.logits, kw, shapes[1], width=448)
        want = chain.verify(logits, **sub)
        res = _result(want, [2], [2])
        assert fb.run(res, logits, **sub) == (step == 1)
        if step:
            _same(res, want, "logits rows 448 wide")
    assert fb.stats["signatures"] == 3, fb.stats


@pytest.mark.e2e
@by_version
def test_device_fallback_compact(chain: NativeChain) -> None:
    """A flagged step's body resolves up to ``capacity`` flagged requests on a padded sub-batch
    (picked on the device: ``resolve_select``) and runs vLLM's chain on the whole step only
    when more are flagged: flagged requests == vLLM's chain on the step; a damaged request that
    is not flagged keeps its damage unless the whole step ran (which rewrites every request);
    the whole step's static logits untouched unless it ran. Steps of 5 to 8 requests with
    fewer drafts for some share the bucket, in new tensors each; the default capacity of a
    bucket; a capacity of 0 (always the whole step)."""
    from shardmax.integrations.vllm.fallback import MAX_CAPACITY, default_capacity

    assert [default_capacity(r) for r in (1, 2, 8, 16, 17, 32, 33, 64, 128, 1024)] == [
        0, 1, 1, 1, 2, 2, 4, 4, 8, MAX_CAPACITY,
    ]  # fmt: skip
    b, kw = _step(13, 10, 384, "cpu")
    shapes = [
        [(r, 4) for r in range(8)],  # the capture step: a full bucket
        [(0, 4), (3, 1), (5, 2), (7, 4), (9, 3)],
        [(2, 2), (1, 4), (4, 1), (6, 3), (8, 4), (9, 1), (0, 2)],
        [(r, 4) for r in range(8)],
    ]
    cases = [  # (shape, flagged, damaged but not flagged)
        (0, [1], [2]),
        (1, [3], [0]),  # fewer than the capacity: one request of 4 rows, one of 3
        (1, [1, 2], [4]),  # exactly the capacity: requests of one and two rows
        (2, [0, 6], [3]),
        (2, [0, 3, 6], [5]),  # more: the whole step too
        (3, [7], [0]),
        (3, [], [1]),  # nothing flagged: the body does not run
        (3, list(range(8)), []),
    ]
    for capacity in (2, 0):
        fb = DeviceFallback(chain, emulate=True, capacity=capacity)
        for i, (shape, flagged, damaged) in enumerate(cases):
            logits, sub = _sub_step(b.logits, kw, shapes[shape])
            want = chain.verify(logits, **sub)
            res = _result(want, flagged, flagged + damaged)
            bucket = next(iter(fb._buckets.values()), None)
            if bucket is not None:  # (the capture step's warm-up runs every piece once)
                bucket.logits.fill_(-3.0)  # a sentinel only the whole step's copy overwrites
            assert fb.run(res, logits, **sub) == (i > 0), (capacity, i, fb.stats)
            if i == 0:
                continue
            whole = bool(flagged) and (capacity == 0 or len(flagged) > capacity)
            if bucket is not None:
                untouched = bool((bucket.logits == -3.0).all())
                assert untouched == (not whole), (capacity, i, flagged)
            bucket = next(iter(fb._buckets.values()))
            assert (bucket.compact is not None) == (capacity > 0)
            for r in range(len(shapes[shape])):
                if r in damaged and not whole:
                    assert int(res.num_sampled[r]) == 1 and int(res.sampled[r, 0]) == 7, (i, r)
                    continue
                one = VerifyResult(*(t[r : r + 1] for t in res[:5]))
                _same(one, [t[r : r + 1] for t in want[:3]], f"{capacity} {i} request {r}")
        assert fb.stats["signatures"] == 1, fb.stats


@pytest.mark.e2e
@by_version
def test_device_fallback_compact_buckets_share_sub_batch(chain: NativeChain) -> None:
    """Buckets of one capacity share one padded sub-batch (its logits rows and indices are
    rewritten by every body that runs): steps of a bucket of 4 requests and of one of 16,
    alternating, each with flagged requests == vLLM's chain on the step and a damaged
    unflagged request left alone (the compact body, not the whole step, ran)."""
    b, kw = _step(17, 12, 320, "cpu")
    small = [(r, 4) for r in range(4)]
    large = [(r, 4 - r % 3) for r in range(12)]  # fewer drafts for some
    fb = DeviceFallback(chain, emulate=True, capacity=2)
    steps = [(small, [1], [0]), (large, [3, 10], [4]), (small, [2, 3], [1]),
             (large, [0], [11]), (small, [0], [3]), (large, [7, 8], [2])]  # fmt: skip
    for picks in (small, large):  # each bucket's host-read step and its capture
        logits, sub = _sub_step(b.logits, kw, picks)
        want = chain.verify(logits, **sub)
        assert not fb.run(_result(want, [], []), logits, **sub)
        assert fb.run(_result(want, [], []), logits, **sub)
    subs = {id(bucket.compact.sub) for bucket in fb._buckets.values()}
    assert len(fb._buckets) == 2 and len(subs) == 1 == len(fb._subs), fb._buckets.keys()
    for picks, flagged, damaged in steps:
        logits, sub = _sub_step(b.logits, kw, picks)
        want = chain.verify(logits, **sub)
        res = _result(want, flagged, flagged + damaged)
        assert fb.run(res, logits, **sub)
        for r in range(len(picks)):
            if r in damaged:
                assert int(res.num_sampled[r]) == 1 and int(res.sampled[r, 0]) == 7, (picks, r)
                continue
            one = VerifyResult(*(t[r : r + 1] for t in res[:5]))
            _same(one, [t[r : r + 1] for t in want[:3]], f"{len(picks)} requests, {r}")


def _folded_run(shard, fb: DeviceFallback, logits: torch.Tensor, t, kw: dict, topp=None):
    """The plug-in's TP-1 sampled step with the fallback folded into the replayed graph: the
    fold made first, then the shard's replayed plan (``topp``: its level-histogram top-p
    pipeline) with it as the epilogue. Returns (result, fold)."""
    from shardmax.runtime.validation import check_step_batch

    rows = logits.shape[0]
    batch = check_step_batch(
        rows, logits.device, t.draft_sampled, t.cu_num_logits, t.pos, t.idx_mapping,
        t.expanded_local_pos, t.seed, 3, None, kw["seq_lens"], kw["prefill_len"],
        temperature=t.temperature, top_p=t.top_p if topp is not None else None,
    )  # fmt: skip
    fold = fb.fold(logits, **kw)
    plan = shard.verify(rows, topp=topp)
    return shard.graphed(plan).run(logits, batch, fold), fold


@pytest.mark.e2e
@by_version
def test_device_fallback_folded(chain: NativeChain) -> None:
    """The fallback as an epilogue of the step's own replayed graph (``GraphedStep.run``'s
    ``epilogue``; CPU: the slots' tables, fetches and kernels, the predicate read on the host):
    requests shardmax flags (a NaN row: NON_FINITE) get vLLM's answer on the step, == vLLM's
    chain on every request, nothing flagged left; steps without a flag keep shardmax's outputs
    (== vLLM's too); the first step of a signature runs eagerly and leaves the fold unqueued
    (the caller's second call or host read)."""
    from shardmax.plan import VocabShard

    vocab = 512
    fb = DeviceFallback(chain, emulate=True)
    shard = VocabShard(vocab_start=0, num_valid=vocab, width=vocab, dtype=torch.bfloat16,
                       device="cpu")  # fmt: skip
    queued = []
    for i, poison in enumerate([[1], [], [1], [0, 3], [], [], [2, 4]]):
        t, kw = _step(20 + i, 5, vocab, "cpu")
        logits = t.logits.clone()
        cu = kw["cu_num_logits_np"]
        for r in poison:
            logits[int(cu[r]), 11] = float("nan")  # request r's first row: always used
        want = chain.verify(logits, **kw)
        bucket = next(iter(fb._buckets.values()), None)
        if bucket is not None:  # a sentinel the body overwrites (the step's positions)
            bucket.static["pos"].fill_(-5)
        res, fold = _folded_run(shard, fb, logits, t, kw)
        assert fold is not None
        queued.append(fold.queued)
        if not fold.queued:  # the eager first step: flags as shardmax set them
            assert sorted(torch.nonzero(res.fallback).flatten().tolist()) == poison
            assert fb.run(res, logits, **kw) is False  # a first sighting: the host read
            continue
        _same(res, want, f"step {i}: poisoned requests {poison}")
        if bucket is not None:  # the body ran exactly on the steps with a flagged request
            sentinel = bool((fb._buckets[fold.bucket].static["pos"] == -5).all())
            assert sentinel == (not poison), (i, poison)
    assert queued == [False] + [True] * 6, queued
    assert fb.stats["signatures"] == 1 and fb.stats["launched"] == 0, fb.stats
    # a step of another shape: its own graph and fold signature
    t, kw = _step(40, 3, vocab, "cpu")
    for step in range(2):
        logits = t.logits.clone()
        logits[int(kw["cu_num_logits_np"][2]), 5] = float("inf")
        want = chain.verify(logits, **kw)
        res, fold = _folded_run(shard, fb, logits, t, kw)
        assert fold is not None and fold.queued == (step == 1)
        if step:
            _same(res, want, "3 requests, +inf row")
    assert fb.stats["signatures"] == 2, fb.stats
    # a synthetic rejection method or an empty step: no fold (the caller's path)
    synthetic = {
        "synthetic_conditional_rates": torch.ones(1),
        "rejection_sample_method": "synthetic",
    }
    assert fb.fold(t.logits, **kw, **synthetic) is None
    empty, kw_empty = _sub_step(t.logits, kw, [])
    assert fb.fold(empty, **kw_empty) is None


@pytest.mark.e2e
@by_version
def test_device_fallback_fold_not_capturable(chain: NativeChain, monkeypatch) -> None:
    """An epilogue whose capture raises: the signature's slots are made without it (warned),
    its steps replay from them with the fold unqueued (the caller's second call then runs), and
    the outputs are shardmax's own."""
    from shardmax.plan import VocabShard

    vocab = 512
    fb = DeviceFallback(chain, emulate=True)

    def refuse(*args, **kwargs):
        raise TypeError("not capturable here")

    monkeypatch.setattr(fb, "_folded", refuse)
    shard = VocabShard(vocab_start=0, num_valid=vocab, width=vocab, dtype=torch.bfloat16,
                       device="cpu")  # fmt: skip
    t, kw = _step(30, 4, vocab, "cpu")
    eager, _ = _folded_run(shard, fb, t.logits, t, kw)  # the signature's eager step
    with pytest.warns(RuntimeWarning, match="not captured with their epilogue"):
        res, fold = _folded_run(shard, fb, t.logits, t, kw)
    assert fold is not None and not fold.queued
    graphed = shard.graphed(shard.verify(t.logits.shape[0]))
    captured = next(iter(graphed._graphs.values()))
    assert len(captured.slots) > 0 and not captured.folded  # replayed, without the epilogue
    again, fold = _folded_run(shard, fb, t.logits, t, kw)
    assert not fold.queued
    for out in (res, again):
        assert all(torch.equal(a, b) for a, b in zip(eager[:5], out[:5], strict=True))


@pytest.mark.e2e
@by_version
def test_device_fallback_folded_topp(chain: NativeChain) -> None:
    """The folded fallback behind the level-histogram top-p plan (CPU: vLLM's CPU pipeline
    for the step's rows): top_p = 0.95 traffic with a request the replay itself flags and
    NaN-poisoned ones; every replayed step == vLLM's chain on every request, no flag left."""
    from shardmax.plan import VocabShard
    from shardmax.reference.nucleus_replay import pipeline_for
    from shardmax.runtime.topp_tables import set_sigma_table

    vocab = 1024
    t = realistic_batch(5, 3, vocab, seed=3, mix="top_p")
    kw = verify_inputs(t)
    cu = kw["cu_num_logits_np"]
    set_sigma_table(list(chain.modules.topk_topp._NORMAL_CDF_TO_SIGMA_TABLE))
    try:
        config = pipeline_for(t.logits.shape[0], "cpu", chain.version)
        fb = DeviceFallback(chain, emulate=True)
        shard = VocabShard(vocab_start=0, num_valid=vocab, width=vocab, dtype=t.logits.dtype,
                           device="cpu")  # fmt: skip
        for step, poison in enumerate([[], [], [1], [0, 4]]):
            logits = t.logits.clone()
            for r in poison:
                logits[int(cu[r]), 11] = float("nan")
            want = chain.verify(logits, **kw)
            res, fold = _folded_run(shard, fb, logits, t, kw, topp=config)
            assert fold is not None and fold.queued == (step > 0), step
            if step == 0:  # eager: the replay's own flag (this batch has one)
                assert bool(res.fallback.any())
                continue
            _same(res, want, f"top-p step {step}, poisoned {poison}")
    finally:
        set_sigma_table(None)


@pytest.mark.e2e
@by_version
def test_device_fallback_bad_input(chain: NativeChain) -> None:
    b, kw = _step(4, 3, 256, "cpu")
    want = chain.verify(b.logits, **kw)
    fb = DeviceFallback(chain, emulate=True)
    with pytest.raises(ValueError, match="result"):
        fb.run(_result(want, [], [])._replace(fallback=torch.zeros(2, dtype=torch.bool)),
               b.logits, **kw)  # fmt: skip
    with pytest.raises(ValueError, match="draft_sampled"):
        fb.run(_result(want, [], []), b.logits, **{**kw, "draft_sampled": kw["draft_sampled"][:3]})
    with pytest.raises(TypeError, match="unexpected"):
        fb.run(_result(want, [], []), b.logits, **kw, top_kk=3)
    with pytest.raises(NotImplementedError):
        fb.run(_result(want, [], []), b.logits, **kw, num_logprobs=5)
    with pytest.raises(ValueError, match="capture_after"):
        DeviceFallback(chain, capture_after=0)
    # off CUDA without emulate: never on the device
    plain = DeviceFallback(chain)
    assert plain.unavailable(torch.device("cpu")) is not None
    assert not plain.run(_result(want, [0], [0]), b.logits, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("num_reqs", [1, 8, 24])
def test_gpu_device_fallback(num_reqs: int) -> None:
    """On the H200: per vLLM version, steps with nothing / some / every request flagged, each
    run twice from the captured conditional graph (bits compared), all `==` vLLM's chain, no
    host sync on a launched step."""
    _needs_gpu_and_chains()
    from shardmax.testing.syncs import host_syncs

    b, kw = _step(num_reqs, num_reqs, 200064, "cuda")
    gen = np.random.default_rng(num_reqs)
    for chain in CHAINS:
        want = chain.verify(b.logits, **kw)
        fb = DeviceFallback(chain)
        why = fb.unavailable(b.logits.device)
        assert why is None, why
        assert not fb.run(_result(want, [0], [0]), b.logits, **kw)  # first: host read
        res = _result(want, [], [0])
        assert fb.run(res, b.logits, **kw)  # second: captured (a sync), then launched
        torch.cuda.synchronize()
        # nothing flagged: the captures' warm-up runs wrote nothing into the step's outputs
        assert res.sampled[0].tolist() == [7] * 4 and int(res.num_sampled[0]) == 1
        some = sorted(gen.choice(num_reqs, size=max(1, num_reqs // 3), replace=False).tolist())
        for flagged in ([0], some, list(range(num_reqs))):
            outs = []
            for _ in range(2):
                res = _result(want, flagged, flagged)
                syncs = host_syncs(
                    lambda res=res, fb=fb: fb.run(res, b.logits, **{**kw, "checks": False})
                )
                assert syncs == "none", syncs
                torch.cuda.synchronize()
                _same(res, want, f"vLLM {chain.version} {num_reqs} reqs flagged {flagged}")
                outs.append([t.clone() for t in res[:3]])
            assert all(torch.equal(x, y) for x, y in zip(*outs, strict=True))
        res = _result(want, [], [num_reqs - 1])
        assert fb.run(res, b.logits, **kw)
        torch.cuda.synchronize()
        assert int(res.sampled[num_reqs - 1, 0]) == 7  # nothing flagged: the body did not run
        # smaller steps of the same bucket, in new tensors (rows 1..K+1 per request): the same
        # graph, vLLM's answers on the step itself
        low = _pow2(num_reqs) // 2 + 1
        for n in sorted({low, (low + num_reqs) // 2, num_reqs}):
            picks = [(int(r), int(gen.integers(1, 5))) for r in gen.permutation(num_reqs)[:n]]
            logits, sub = _sub_step(b.logits, kw, picks)
            want_sub = chain.verify(logits, **sub)
            outs = []
            for _ in range(2):
                res = _result(want_sub, list(range(0, n, 2)), list(range(0, n, 2)))
                syncs = host_syncs(
                    lambda res=res, logits=logits, sub=sub, fb=fb: fb.run(
                        res, logits, **{**sub, "checks": False}
                    )
                )
                assert syncs == "none", syncs
                torch.cuda.synchronize()
                _same(res, want_sub, f"vLLM {chain.version}: {n} of {num_reqs} reqs, {picks}")
                outs.append([t.clone() for t in res[:3]])
            assert all(torch.equal(x, y) for x, y in zip(*outs, strict=True))
        assert fb.stats["no_free_slot"] == 0, fb.stats
        # the host ahead of the GPU (a long kernel queued first): SLOTS steps queue on the
        # page-locked tables, the next finds none acknowledged and goes back to the caller
        steps = []
        for i in range(SLOTS + 1):
            n = int(gen.integers(low, num_reqs + 1))
            picks = [(int(r), int(gen.integers(1, 5))) for r in gen.permutation(num_reqs)[:n]]
            logits, sub = _sub_step(b.logits, kw, picks)
            flagged = sorted(gen.choice(n, size=1 + i % n, replace=False).tolist())
            steps.append((logits, sub, chain.verify(logits, **sub), flagged))
        outputs = [_result(want_i, flagged, flagged) for _, _, want_i, flagged in steps]
        torch.cuda.synchronize()
        torch.cuda._sleep(400_000_000)  # ~0.2 s of GPU time
        slept = torch.cuda.Event()
        slept.record()
        results = []
        for res, (logits, sub, _, _) in zip(outputs, steps, strict=True):
            results.append((res, fb.run(res, logits, **{**sub, "checks": False})))
        ahead = not slept.query()  # the host still ahead: else a run waited for the GPU
        assert ahead and [ran for _, ran in results] == [True] * SLOTS + [False], (ahead, fb.stats)
        torch.cuda.synchronize()
        for (res, ran), (_, _, want_i, flagged) in zip(results, steps, strict=True):
            if ran:
                _same(res, want_i, f"vLLM {chain.version}: host ahead, flagged {flagged}")
            else:  # untouched: the caller reads its flags
                assert bool(res.fallback[flagged[0]]) and int(res.sampled[flagged[0], 0]) == 7
        assert fb.stats["no_free_slot"] == 1, fb.stats
        assert fb.stats["signatures"] == 1 and fb.stats["captured"] == SLOTS, fb.stats
        print(f"[device fallback] vLLM {chain.version} {num_reqs} requests: {fb.stats}")


@pytest.mark.gpu
@pytest.mark.parametrize("mix", ["temperature", "top_p"])
@pytest.mark.parametrize("num_reqs", [8, 24])
def test_gpu_device_fallback_compact(num_reqs: int, mix: str) -> None:
    """On the GPU: a flagged step's body at capacity 2 -- one or two flagged requests resolved
    on the padded sub-batch alone (the whole step's static logits untouched, a damaged request
    that is not flagged left as it is), three flagged: the whole step too. T = 1 and
    top_p = 0.95 traffic at 32 rows (vLLM's split top-p pipeline: the capacity is used only
    where its rows get the step's split count) and 96 rows (the monolithic kernel). Each step
    twice (bits compared), == vLLM's chain, no host sync."""
    _needs_gpu_and_chains()
    from shardmax.testing.syncs import host_syncs

    t = realistic_batch(num_reqs, 3, 200064, seed=num_reqs + 1, mix=mix, device="cuda")
    kw = verify_inputs(t)
    for chain in CHAINS:
        want = chain.verify(t.logits, **kw)
        fb = DeviceFallback(chain, capacity=2)
        assert not fb.run(_result(want, [0], [0]), t.logits, **kw)  # first: host read
        assert fb.run(_result(want, [0], [0]), t.logits, **kw)  # second: captured
        torch.cuda.synchronize()
        bucket = next(iter(fb._buckets.values()))
        compact = bucket.compact is not None
        assert compact or mix == "top_p", "a temperature step always fits the capacity"
        for flagged, damaged in (([3], [1]), ([0, num_reqs - 1], [2]), ([1, 4, 6], [5])):
            whole = not compact or len(flagged) > 2
            outs = []
            for _ in range(2):
                bucket.logits.fill_(-3.0)  # only the whole step's copy overwrites it
                res = _result(want, flagged, flagged + damaged)
                syncs = host_syncs(
                    lambda res=res, fb=fb: fb.run(res, t.logits, **{**kw, "checks": False})
                )
                assert syncs == "none", syncs
                torch.cuda.synchronize()
                assert bool((bucket.logits == -3.0).all()) == (not whole), (flagged, compact)
                for r in range(num_reqs):
                    one = VerifyResult(*(x[r : r + 1] for x in res[:5]))
                    if r in damaged and not whole:
                        assert int(one.num_sampled[0]) == 1 and int(one.sampled[0, 0]) == 7
                    else:
                        _same(one, [x[r : r + 1] for x in want[:3]], f"{mix} {flagged} {r}")
                outs.append([x.clone() for x in res[:3]])
            assert all(torch.equal(x, y) for x, y in zip(*outs, strict=True)), flagged
        print(f"[compact] vLLM {chain.version} {mix} {num_reqs} requests: capacity "
              f"{'2' if compact else 'none (another split count)'}, {fb.stats}")  # fmt: skip


def _gpu_folded_steps(chain, t, kw: dict, poisons: list[list[int]], topp=None, sentinel=True):
    """The GPU checks of the folded fallback on steps of ``t`` (a fresh fallback and shard):
    per step the requests in ``poisons[step]`` get a NaN in their first row; each step runs
    twice (bits compared); the signature's first call runs eagerly, the later ones replay
    with the fold queued, no host sync, == vLLM's chain on every request, no flag left.
    ``sentinel``: the body ran exactly on the poisoned steps (a value in the bucket's static
    positions that only the body overwrites). Returns the fallback's stats."""
    from shardmax.plan import VocabShard
    from shardmax.testing.syncs import host_syncs

    fb = DeviceFallback(chain)
    assert fb.unavailable(t.logits.device) is None
    vocab = t.logits.shape[1]
    shard = VocabShard(vocab_start=0, num_valid=vocab, width=vocab, dtype=t.logits.dtype,
                       device=t.logits.device)  # fmt: skip
    cu = kw["cu_num_logits_np"]
    for step, poison in enumerate(poisons):
        logits = t.logits.clone()
        for r in poison:
            logits[int(cu[r]), 11] = float("nan")
        want = chain.verify(logits, **kw)
        outs = []
        for i in range(2):
            got: list = []
            for bucket in fb._buckets.values():  # a sentinel the body overwrites
                bucket.static["pos"].fill_(-5)

            def call(logits=logits, got=got) -> None:
                got.extend(_folded_run(shard, fb, logits, t, {**kw, "checks": False}, topp))

            syncs = host_syncs(call) if step >= 1 else (call(), "none")[1]
            res, fold = got
            # the signature's first call runs eagerly, its second captures
            assert fold is not None and fold.queued == (step + i > 0), (step, i)
            if not fold.queued:
                continue
            assert syncs == "none", (step, syncs)
            torch.cuda.synchronize()
            _same(res, want, f"vLLM {chain.version} {t.logits.shape[0]} rows, poisoned {poison}")
            if sentinel and (step, i) != (0, 1):  # (the capture's warm-up runs the body)
                ran = not bool((fb._buckets[fold.bucket].static["pos"] == -5).all())
                assert ran == bool(poison), (step, i, poison)
            outs.append([x.clone() for x in res[:3]])
        if len(outs) == 2:
            assert all(torch.equal(x, y) for x, y in zip(*outs, strict=True)), poison
    capacities = [0 if b.compact is None else b.compact.sub.reqs for b in fb._buckets.values()]
    return {**fb.stats, "capacities": capacities}


@pytest.mark.gpu
@pytest.mark.parametrize("num_reqs", [1, 8, 24])
def test_gpu_device_fallback_folded(num_reqs: int) -> None:
    """On the GPU: the fallback folded into the replayed step's graph (one launch). Per vLLM
    version, steps with no / some / every request poisoned (a NaN in its first row: shardmax
    flags it NON_FINITE, vLLM's chain answers it), each step run twice (bits compared), ==
    vLLM's chain on every request, no flag left, no host sync on a replayed step."""
    _needs_gpu_and_chains()
    t, kw = _step(num_reqs, num_reqs, 200064, "cuda")
    gen = np.random.default_rng(num_reqs)
    some = sorted(gen.choice(num_reqs, size=max(1, num_reqs // 3), replace=False).tolist())
    for chain in CHAINS:
        stats = _gpu_folded_steps(chain, t, kw, [[], [], [0], some, list(range(num_reqs)), []])
        print(f"[folded fallback] vLLM {chain.version} {num_reqs} requests: {stats}")


@pytest.mark.gpu
@pytest.mark.parametrize("num_reqs", [8, 24, 128])
def test_gpu_device_fallback_folded_topp(num_reqs: int) -> None:
    """On the GPU: the folded fallback behind the level-histogram top-p plan (T = 1,
    top_p = 0.95 traffic): vLLM's chain on the step at its exact size (its
    top-p pipeline for the step's rows) where a request is flagged (poisoned with a NaN, or
    flagged by the replay itself). Per vLLM version, each step twice (bits compared), == vLLM's
    chain on every request, no flag left, no host sync on a replayed step."""
    _needs_gpu_and_chains()
    from shardmax.reference.nucleus_replay import pipeline_for
    from shardmax.runtime.topp_tables import set_sigma_table

    t = realistic_batch(num_reqs, 3, 200064, seed=num_reqs, mix="top_p", device="cuda")
    kw = verify_inputs(t)
    for chain in CHAINS:
        set_sigma_table(list(chain.modules.topk_topp._NORMAL_CDF_TO_SIGMA_TABLE))
        try:
            config = pipeline_for(t.logits.shape[0], "cuda", chain.version)
            # the replay may flag requests of its own: no sentinel check
            poisons = [[], [], [1], [0, num_reqs - 1], []]
            stats = _gpu_folded_steps(chain, t, kw, poisons, topp=config, sentinel=False)
        finally:
            set_sigma_table(None)
        print(f"[folded fallback top-p] vLLM {chain.version} {num_reqs} requests: {stats}")


def test_plugin_device_fallback_only_where_it_can_run(monkeypatch) -> None:
    """The plug-in's helper: on by default on CUDA; None when turned off, without a resolver,
    off CUDA, with graphs off or where conditional graphs are unavailable; a bad value raises."""
    from shardmax.integrations.vllm import fallback, step

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(step, "_FALLBACK", [])
    monkeypatch.setattr(step, "resolver", lambda: chain)
    monkeypatch.delenv(step.ENV_DEVICE_FALLBACK, raising=False)
    monkeypatch.delenv(step.ENV_GRAPHS, raising=False)
    chain = CHAINS[0] if CHAINS else object()
    # conditional graphs available (this machine has no GPU: the check is stubbed)
    monkeypatch.setattr(fallback.DeviceFallback, "unavailable", lambda self, device: None)
    got = step.device_fallback(cuda)  # on by default
    assert isinstance(got, fallback.DeviceFallback) and got.chain is chain
    assert step.device_fallback(cuda) is got  # one per process
    for off in ("0", "off", "false"):
        monkeypatch.setenv(step.ENV_DEVICE_FALLBACK, off)
        assert step.device_fallback(cuda) is None
    monkeypatch.setenv(step.ENV_DEVICE_FALLBACK, "maybe")
    with pytest.raises(ValueError, match="SHARDMAX_VLLM_DEVICE_FALLBACK"):
        step.device_fallback(cuda)
    monkeypatch.setattr(step, "_FALLBACK", [])
    monkeypatch.setenv(step.ENV_DEVICE_FALLBACK, "1")
    monkeypatch.setattr(step, "resolver", lambda: None)
    assert step.device_fallback(cuda) is None
    monkeypatch.setattr(step, "resolver", lambda: chain)
    assert step.device_fallback(torch.device("cpu")) is None
    monkeypatch.setenv(step.ENV_GRAPHS, "0")
    assert step.device_fallback(cuda) is None
    assert step._FALLBACK == []
    # conditional graphs unavailable: the flags read on the host (said once)
    monkeypatch.delenv(step.ENV_GRAPHS)
    monkeypatch.setattr(fallback.DeviceFallback, "unavailable", lambda self, device: "old driver")
    assert step.device_fallback(cuda) is None and step._FALLBACK == [None]


def test_plugin_uses_device_fallback_on_which_steps() -> None:
    """TP 1 only; temperature steps and level-histogram top-p steps (any size: the buckets hold
    what vLLM's chunk does); never the candidate path's."""
    from shardmax.integrations.vllm import step

    assert step.uses_device_fallback(1, nucleus=False, histogram=False)
    assert step.uses_device_fallback(1, nucleus=True, histogram=True)
    assert not step.uses_device_fallback(1, nucleus=True, histogram=False)
    for tp in (2, 4, 8):
        assert not step.uses_device_fallback(tp, nucleus=False, histogram=False)
        assert not step.uses_device_fallback(tp, nucleus=True, histogram=True)


def test_fold_signature_follows_the_requests_sampling_values_in_place() -> None:
    """The signature's gates are memoised on the bytes of the requests' slots and sampling
    values, read every step: vLLM rewrites its per-slot host arrays in place between steps, so
    a request whose temperature or top-p changed must get the gates computed from the new
    values (the memo's answer == NativeChain._gates' without the memo), and a top-p step's
    gates are those of its own row count."""
    from types import SimpleNamespace

    from shardmax.integrations.vllm.chain import NativeChain

    def fresh_gates(kw: dict, reqs: int, rows: int):
        slots = np.asarray(kw["idx_mapping_np"])[:reqs]
        state = NativeChain._State(
            kw["temperature_gpu"], kw["temperature_np"], kw.get("top_k_gpu"), kw.get("top_k_np"),
            kw.get("top_p_gpu"), kw.get("top_p_np"), kw.get("min_p_gpu"), kw.get("min_p_np"),
        )  # fmt: skip
        return NativeChain._gates(slots, state, V, rows)

    V = 4096
    fb = DeviceFallback(SimpleNamespace(max_chunk_rows=None), emulate=True)
    for mix in ("temperature", "top_p"):
        b = realistic_batch(6, 3, V, seed=5, mix=mix)
        kw = verify_inputs(b)
        reqs, rows = int(b.idx_mapping.shape[0]), int(b.logits.shape[0])
        tensors = _StepTensors.of(b.logits, kw)
        assert tensors is not None
        first = fb._key(b.logits, tensors, kw, reqs)
        assert first is not None
        slot = int(kw["idx_mapping_np"][2])
        changes = [("temperature_np", 1.0), ("temperature_np", 0.5)]
        if mix == "top_p":
            changes += [("top_p_np", 1.0), ("top_p_np", 0.9)]
        for name, value in changes:
            kw[name][slot] = value  # in place, as vLLM's SamplingStates does
            key = fb._key(b.logits, tensors, kw, reqs)
            assert key is not None
            gates = key[8]  # computed for the bucket's rows, key[1]
            assert gates == fresh_gates(kw, reqs, key[1]), (mix, name, value)
            if gates.do_p:
                assert key[:2] == (reqs, rows)  # top-p: the step's exact size
            else:
                assert key[:2] == (_pow2(reqs), _pow2(reqs) * 4)
