"""CUDA-graph replay of verification plans (:mod:`shardmax.runtime.graphs`, issue 19).

CPU (the Triton interpreter): everything but the capture -- the argument table, the byte copies
of ``table_copy``, the INDIRECT launches of the logits-reading kernels, the output slots (held
outputs never rewritten, released ones handed out again) and the outputs copied into fresh
tensors -- on greedy, temperature and top-p steps whose logits and batch tensors are new
tensors every step; results ``==`` the plan's own ``run`` on the same inputs, bit for bit.
Fallbacks (a logits address that is not 16-byte aligned, a step inside someone else's capture),
refusals (the plain path, another shard's plan), the per-signature cache. Plans whose kernels
read the logits directly (strict mode) replay on a static copy of them; level-histogram top-p
reads them INDIRECT.

GPU (marked ``gpu``): the real capture and replay, each step == the eager launches bit for bit
and every replay twice; held outputs never rewritten by later replays; no host sync on
replayed steps; a workspace that grows after a capture;
an NCCL group (one rank) whose all_gather is captured inside the graph; emulated TP 2 / 8 (the
other ranks' bytes replayed), where the graphs are split at the collectives, which run eagerly
between the replays.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch

from shardmax.plan import VocabShard
from shardmax.runtime import graphs, kernels
from shardmax.runtime.dispatch import override
from shardmax.runtime.graphs import GraphedStep, batch_signature
from shardmax.runtime.validation import StepBatch, check_step_batch
from shardmax.testing.syncs import host_syncs
from shardmax.testing.traffic import TrafficBatch, realistic_batch

K = 3


@pytest.fixture(autouse=True)
def _sigma_table():
    """A stand-in for vLLM's sigma table (the monolithic top-p replay reads one; replay and
    launches read the same)."""
    from shardmax.runtime.topp_tables import set_sigma_table, sigma_table

    if sigma_table() is not None:
        yield
        return
    sigma = torch.special.ndtri((torch.arange(200, dtype=torch.float64) + 0.5) / 200).float()
    set_sigma_table(sigma.tolist())
    yield
    set_sigma_table(None)


def _batch(t: TrafficBatch, mix: str, draft_dtype: torch.dtype = torch.int32) -> StepBatch:
    mix = _traffic(mix)
    rows = t.logits.shape[0]
    sampled = mix != "greedy"
    return check_step_batch(
        rows, t.logits.device, t.draft_sampled.to(draft_dtype), t.cu_num_logits, t.pos,
        t.idx_mapping, t.expanded_local_pos, t.seed, K, None, None, None,
        temperature=t.temperature if sampled else None, top_p=t.top_p,
    )  # fmt: skip


def _plan(shard: VocabShard, rows: int, mix: str, mode: str = "fast"):
    """``mix``: greedy / temperature / top_p (candidates), or ``strict`` (temperature rows in
    strict mode: its kernels read the logits directly, replayed on a static copy of them) and
    ``top_p_hist`` (top-p rows from level histograms, read INDIRECT)."""
    from shardmax.reference.nucleus_replay import pipeline_for

    if mix == "greedy":
        return shard.greedy_verify(rows)
    if mix == "strict":
        return shard.verify(rows, mode="strict")
    if mix == "top_p_hist":
        return shard.verify(rows, topp=pipeline_for(rows, shard.ctx.device.type))
    return shard.verify(rows, mode=mode, with_candidates=mix == "top_p")


def _traffic(mix: str) -> str:
    return {"strict": "temperature", "top_p_hist": "top_p"}.get(mix, mix)


def _shard(vocab: int, dtype: torch.dtype, device: str) -> VocabShard:
    return VocabShard(vocab_start=0, num_valid=vocab, width=vocab, dtype=dtype, device=device)


def _equal(a, b) -> bool:
    return type(a) is type(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _steps(mix: str, vocab: int, reqs: int, n: int, device: str, dtype=torch.bfloat16):
    """``n`` steps of one batch shape, each with its own logits and batch tensors."""
    kind = _traffic(mix)
    return [
        realistic_batch(reqs, K, vocab, seed=11 * i + 1, mix=kind, dtype=dtype, device=device)
        for i in range(n)
    ]


@pytest.mark.parametrize("mix", ["greedy", "temperature", "top_p", "strict", "top_p_hist"])
def test_replayed_steps_equal_the_plan_run(mix: str) -> None:
    steps = _steps(mix, 2053, 2, 3, "cpu")
    rows = steps[0].logits.shape[0]
    shard = _shard(2053, torch.bfloat16, "cpu")
    plan = _plan(shard, rows, mix)
    step = shard.graphed(plan)
    assert shard.graphed(plan) is step
    kept = []  # every output stays alive: a fresh output never reuses a freed one's bytes
    for i, t in enumerate(steps):
        batch = _batch(t, mix)
        ref = plan.run(t.logits, batch)
        got = step.run(t.logits.clone(), batch)
        assert _equal(got, ref), f"step {i}"
        kept += [ref, got]
        assert step.num_graphs == (0 if i + 1 < graphs.CAPTURE_AFTER else 1)
    # the steps differ, so a replay that read stale logits or batch tensors would have failed
    assert not _equal(kept[0], kept[-1])


def test_replay_reads_this_steps_logits_not_the_captured_ones() -> None:
    t = _steps("greedy", 3001, 2, 1, "cpu")[0]
    rows = t.logits.shape[0]
    shard = _shard(3001, torch.float32, "cpu")
    plan = shard.greedy_verify(rows)
    step = GraphedStep(plan)
    batch = _batch(t, "greedy")
    logits = t.logits.float()
    for _ in range(graphs.CAPTURE_AFTER):
        step.run(logits, batch)
    # a new argmax planted in every row, at the last real column (the tail block)
    planted = logits.clone()
    planted[:, -1] = 1e30
    got = step.run(planted, batch)
    ref = plan.run(planted, batch)
    assert _equal(got, ref)
    assert not _equal(got, plan.run(logits, batch))


@pytest.mark.parametrize("mix", ["top_p_hist", "strict"])
def test_only_strict_plans_replay_on_a_static_copy_of_the_logits(mix: str) -> None:
    """Level-histogram top-p reads the caller's logits INDIRECT (no copy before each replay,
    no static buffer); strict mode's block statistics still read a static copy."""
    steps = _steps(mix, 2053, 2, 3, "cpu")
    rows = steps[0].logits.shape[0]
    shard = _shard(2053, torch.bfloat16, "cpu")
    plan = _plan(shard, rows, mix)
    step = shard.graphed(plan)
    for t in steps:
        step.run(t.logits.clone(), _batch(t, mix))
    assert step.num_graphs == 1
    assert graphs.reads_logits_directly(plan) == (mix == "strict")
    assert (step._static is not None) == (mix == "strict")


def test_batch_signature_separates_dtypes_and_shapes() -> None:
    steps = _steps("temperature", 1031, 2, 1, "cpu")
    t = steps[0]
    a, b = _batch(t, "temperature"), _batch(t, "temperature", torch.int64)
    assert batch_signature(a) != batch_signature(b)
    shard = _shard(1031, torch.bfloat16, "cpu")
    plan = shard.verify(t.logits.shape[0])
    step = shard.graphed(plan)
    for batch in (a, b, a, b, a, b):
        assert _equal(step.run(t.logits, batch), plan.run(t.logits, batch))
    assert step.num_graphs == 2


def test_least_recently_used_signature_leaves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(graphs, "MAX_GRAPHS", 1)
    monkeypatch.setattr(graphs, "CAPTURE_AFTER", 1)
    t = _steps("greedy", 1031, 2, 1, "cpu")[0]
    shard = _shard(1031, torch.bfloat16, "cpu")
    plan = shard.greedy_verify(t.logits.shape[0])
    step = shard.graphed(plan)
    for dt in (torch.int32, torch.int64, torch.int32):
        batch = _batch(t, "greedy", dt)
        assert _equal(step.run(t.logits, batch), plan.run(t.logits, batch))
        assert step.num_graphs == 1


def test_unaligned_logits_run_the_plan_eagerly() -> None:
    t = _steps("greedy", 1031, 2, 1, "cpu")[0]
    rows, vocab = t.logits.shape
    flat = torch.empty(rows * vocab + 1, dtype=t.logits.dtype)
    logits = flat[1:].view(rows, vocab)  # 2 bytes past an aligned address
    logits.copy_(t.logits)
    assert logits.data_ptr() % 16
    shard = _shard(vocab, t.logits.dtype, "cpu")
    plan = shard.greedy_verify(rows)
    step = shard.graphed(plan)
    batch = _batch(t, "greedy")
    for _ in range(3):
        assert _equal(step.run(logits, batch), plan.run(t.logits, batch))
    assert step.num_graphs == 0


def test_bad_logits_get_the_plans_error() -> None:
    t = _steps("greedy", 1031, 2, 1, "cpu")[0]
    shard = _shard(1031, torch.bfloat16, "cpu")
    step = shard.graphed(shard.greedy_verify(t.logits.shape[0]))
    batch = _batch(t, "greedy")
    with pytest.raises(ValueError, match="local_logits: shape"):
        step.run(t.logits[:-1], batch)
    with pytest.raises(ValueError, match=r"local_logits: .*dtype torch.float32"):
        step.run(t.logits.float(), batch)


def test_plans_that_cannot_be_replayed_are_refused() -> None:
    t = _steps("temperature", 1031, 2, 1, "cpu")[0]
    rows = t.logits.shape[0]
    shard = _shard(1031, torch.bfloat16, "cpu")
    assert GraphedStep.supported(shard.verify(rows, mode="strict"))  # on a static logits copy
    with override(variant="plain"):
        plain = shard.greedy_verify(rows)
    with pytest.raises(ValueError, match="plan: the plain path"):
        shard.graphed(plain)
    other = _shard(1031, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="not made by this shard"):
        shard.graphed(other.greedy_verify(rows))


def _slot_steps(mix: str, vocab: int, device: str, reqs: int = 3) -> None:
    """Outputs held as a tensor, a view or the returned tuple are never rewritten by later steps
    (whose logits differ); released slots are handed out again, in turn, and a caller keeping
    its last outputs gets the next slot; with every slot held the step copies out into new
    tensors -- each result == the plan's own run, bit for bit."""
    steps = _steps(mix, vocab, reqs, 2 + graphs.SLOTS + 2, device)
    rows = steps[0].logits.shape[0]
    shard = _shard(vocab, torch.bfloat16, device)
    plan = _plan(shard, rows, mix)
    step = shard.graphed(plan)
    batches = [_batch(t, mix) for t in steps]
    refs = [plan.run(t.logits, b) for t, b in zip(steps, batches, strict=True)]
    for _ in range(graphs.CAPTURE_AFTER):  # captured (on the CPU: set up) here
        step.run(steps[0].logits, batches[0])
    (captured,) = step._graphs.values()
    assert len(captured.slots) == graphs.SLOTS
    slot_ptrs = [s.static[0].data_ptr() for s in captured.slots]
    held: list[Any] = []

    def run(i: int) -> Any:
        got = step.run(steps[i].logits.clone(), batches[i])
        assert _equal(got, refs[i]), f"step {i}"
        return got

    # released at once: the slots in turn
    turn = [run(i)[0].data_ptr() for i in range(graphs.SLOTS + 1)]
    assert sorted(turn[: graphs.SLOTS]) == sorted(slot_ptrs) and turn[-1] == turn[0]
    # the previous step's outputs kept (as vLLM keeps them): the next slot, never an allocation
    prev = run(0)
    for i in range(4):
        cur = run(i)
        assert cur[0].data_ptr() in slot_ptrs and cur[0].data_ptr() != prev[0].data_ptr()
        prev = cur
    del prev, cur
    # held in three ways: the tuple, one tensor, a view of another; then the slots are full
    got = [run(i) for i in range(graphs.SLOTS + 2)]
    held = [got[0], got[1][0], got[2][1][1:]]
    ptrs = [g[0].data_ptr() for g in got]
    assert set(ptrs[: graphs.SLOTS]) == set(slot_ptrs) and len(set(ptrs)) == len(ptrs)
    del got
    for i in range(3):  # later steps (other logits) leave the held outputs as they were
        run(3 + i)
    assert _equal(held[0], refs[0])
    assert torch.equal(held[1], refs[1][0]) and torch.equal(held[2], refs[2][1][1:])
    del held
    assert all(s.free() for s in captured.slots)
    assert run(0)[0].data_ptr() in slot_ptrs


@pytest.mark.parametrize("mix", ["greedy", "temperature"])
def test_held_outputs_are_never_rewritten_and_released_slots_return(mix: str) -> None:
    _slot_steps(mix, 2053, "cpu", reqs=2)


def _hold(how: str, res: Any) -> Callable[[], torch.Tensor]:
    """Keep step ``res``'s ``sampled`` (or ``num_sampled``) alive only through ``how``; returns
    a function reading it back."""
    t = res[0]
    if how == "storage":
        st, shape, dtype = t.untyped_storage(), t.shape, t.dtype
        return lambda: torch.empty(0, dtype=dtype).set_(st).view(shape)
    if how == "numpy":
        a = t.numpy()
        return lambda: torch.from_numpy(a)
    if how == "dlpack":
        cap = torch.utils.dlpack.to_dlpack(t)
        return lambda: torch.from_dlpack(cap)
    if how == "autograd":  # a tensor only autograd's saved-tensor list refers to
        w = torch.ones(res[1].shape, requires_grad=True)
        loss = (w * res[1]).sum()

        def grad() -> torch.Tensor:
            loss.backward()
            assert w.grad is not None
            return w.grad.to(res[1].dtype)

        return grad
    raise AssertionError(how)


class _Replayed(NamedTuple):
    """A captured greedy signature, ``SLOTS + 3`` steps of it and their eager results."""

    step: GraphedStep
    steps: list[TrafficBatch]
    batches: list[StepBatch]
    refs: list[Any]

    def run(self, i: int) -> Any:
        return self.step.run(self.steps[i].logits.clone(), self.batches[i])


def _replayed() -> _Replayed:
    steps = _steps("greedy", 2053, 3, graphs.SLOTS + 3, "cpu")
    rows = steps[0].logits.shape[0]
    shard = _shard(2053, torch.bfloat16, "cpu")
    plan = shard.greedy_verify(rows)
    step = shard.graphed(plan)
    batches = [_batch(t, "greedy") for t in steps]
    refs = [plan.run(t.logits, b) for t, b in zip(steps, batches, strict=True)]
    for _ in range(graphs.CAPTURE_AFTER):
        step.run(steps[0].logits, batches[0])
    return _Replayed(step, steps, batches, refs)


@pytest.mark.parametrize("how", ["storage", "numpy", "dlpack", "autograd"])
def test_outputs_held_by_any_reference_are_never_rewritten(how: str) -> None:
    """The caller keeps a step's memory without any of its tensors: every slot is then cycled
    through by later steps (other logits) and the kept memory still holds its own step's
    result; every result == the plan's run."""
    r = _replayed()
    res = r.run(0)
    (captured,) = r.step._graphs.values()
    assert res[0].data_ptr() in [s.static[0].data_ptr() for s in captured.slots]
    read = _hold(how, res)
    del res
    for i in range(1, len(r.steps)):
        assert _equal(r.run(i), r.refs[i]), f"step {i}"
    want = r.refs[0][1] if how == "autograd" else r.refs[0][0]
    assert torch.equal(read(), want)


@pytest.mark.parametrize("how", ["unsqueeze_", "set_", "resize_"])
def test_changes_to_dropped_outputs_stay_with_them(how: str) -> None:
    """A caller that reshapes, re-points or grows its tensors and drops them: later steps get
    the plan's shapes and values (a slot whose memory moved is retired, never replayed)."""
    r = _replayed()
    res = r.run(0)
    if how == "unsqueeze_":
        res[0].unsqueeze_(0)
    elif how == "set_":
        res[0].set_(torch.empty(0, dtype=res[0].dtype))
    else:
        res[0].resize_(1 << 16)  # grows the storage: its memory moves
    del res
    for i in range(1, len(r.steps)):
        got = r.run(i)
        assert [t.shape for t in got] == [t.shape for t in r.refs[i]]
        assert _equal(got, r.refs[i]), f"step {i}"
    (captured,) = r.step._graphs.values()
    assert sum(s.retired for s in captured.slots) == (how == "resize_")


def test_a_slot_whose_table_is_not_fetched_yet_is_skipped() -> None:
    """A slot's host table is rewritten only after the GPU acknowledged its previous fetch:
    the slot round robin would take next, without the acknowledgement (a GPU still behind the
    host, played here by resetting the word), is passed over and keeps its table; with none
    acknowledged the step copies out into new tensors; each result == the plan's run, and
    every fetch acknowledges its request."""
    r = _replayed()
    (captured,) = r.step._graphs.values()
    slots = captured.slots
    for s in slots:
        assert s.host[-1] == s.seq  # request 0 fetched at the slot's making
    first = r.run(0)
    a = next(s for s in slots if s.static[0].data_ptr() == first[0].data_ptr())
    del first
    assert a.host[-1] == a.host[-2] == a.seq == 1
    victim = slots[captured._next]  # the slot the next step would take
    victim.host[-1] = -1  # its last request not fetched yet
    before = victim.host.copy()
    got = r.run(1)
    assert _equal(got, r.refs[1]) and got[0].data_ptr() != victim.static[0].data_ptr()
    assert (victim.host == before).all()  # its table left as it was
    del got
    for s in slots:
        s.host[-1] = -1
    got = r.run(2)
    assert _equal(got, r.refs[2])
    assert all(got[0].data_ptr() != s.static[0].data_ptr() for s in slots)  # copied out
    assert all(s.host[-1] == -1 for s in slots)  # no slot's table written
    for s in slots:
        s.host[-1] = s.seq  # fetched at last
    got = r.run(3)
    assert _equal(got, r.refs[3]) and any(
        got[0].data_ptr() == s.static[0].data_ptr() for s in slots
    )


def test_dropped_slots_keep_their_unfetched_tables_alive() -> None:
    """A dropped slot whose last request the GPU has not fetched keeps its page-locked table
    (a queued fetch still reads it and writes its acknowledgement into it) until the
    acknowledgement arrives; fetched tables are let go at once."""
    r = _replayed()
    (captured,) = r.step._graphs.values()
    pending, done = captured.slots[0], captured.slots[1]
    pending.host[-1] = -1
    ptr = pending.buf.data_ptr()
    del captured, pending, done
    r.step._graphs.clear()  # the signature evicted: its slots dropped
    kept = [e for e in graphs._UNFETCHED if e[0].data_ptr() == ptr]
    assert len(kept) == 1 and len(graphs._UNFETCHED) == 1
    kept[0][1][kept[0][2]] = kept[0][3]  # the fetch arrives
    del kept
    graphs._release_fetched()
    assert graphs._UNFETCHED == []


def test_empty_batch_runs_the_plan() -> None:
    shard = _shard(1031, torch.bfloat16, "cpu")
    plan = shard.greedy_verify(0)
    logits = torch.empty(0, 1031, dtype=torch.bfloat16)
    z = torch.zeros(0, dtype=torch.int32)
    batch = check_step_batch(0, logits.device, z, torch.zeros(1, dtype=torch.int32),
                             z.long(), z, z, torch.zeros(1, dtype=torch.int64), K)  # fmt: skip
    out = shard.graphed(plan).run(logits, batch)
    assert out[0].shape == (0, K + 1)


# ------------------------------------------------------------------------------------------
# GPU: the real capture
# ------------------------------------------------------------------------------------------


def _gpu_steps(mix: str, vocab: int, reqs: int, n: int):
    return _steps(mix, vocab, reqs, n, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("mix", ["greedy", "temperature", "top_p", "strict", "top_p_hist"])
@pytest.mark.parametrize("reqs", [1, 24, 128])
def test_gpu_replay_equals_launches_twice(mix: str, reqs: int) -> None:
    vocab = 200064
    steps = _gpu_steps(mix, vocab, reqs, 5)
    rows = steps[0].logits.shape[0]
    shard = _shard(vocab, torch.bfloat16, "cuda")
    plan = _plan(shard, rows, mix)
    step = shard.graphed(plan)
    kept = []
    for i, t in enumerate(steps):
        batch = _batch(t, mix)
        ref = plan.run(t.logits, batch)
        got = step.run(t.logits.clone(), batch)
        again = step.run(t.logits.clone(), batch)
        assert _equal(got, ref), f"step {i}"
        assert _equal(again, got), f"step {i}: two replays differ"
        kept += [ref, got, again]
    assert step.num_graphs == 1


@pytest.mark.gpu
@pytest.mark.parametrize("mix", ["greedy", "temperature", "top_p", "strict", "top_p_hist"])
def test_gpu_held_outputs_are_never_rewritten(mix: str) -> None:
    _slot_steps(mix, 200064, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("mix", ["greedy", "temperature"])
def test_gpu_host_far_ahead_never_rewrites_an_unfetched_table(mix: str) -> None:
    """The GPU held up (a sleep kernel queued first) while the host makes many steps, each
    with its own logits and batch tensors, dropping each step's outputs after queueing a copy
    of them: the slots' host tables are not yet fetched, so after one step per slot the steps
    copy out; once the GPU catches up every copy == the plan's run on its own step, and every
    slot's last request is acknowledged."""
    steps = _gpu_steps(mix, 151936, 8, 2 * graphs.SLOTS + 2)
    rows = steps[0].logits.shape[0]
    shard = _shard(151936, torch.bfloat16, "cuda")
    plan = _plan(shard, rows, mix)
    step = shard.graphed(plan)
    batches = [_batch(t, mix) for t in steps]
    refs = [plan.run(t.logits, b) for t, b in zip(steps, batches, strict=True)]
    for _ in range(graphs.CAPTURE_AFTER):
        step.run(steps[0].logits, batches[0])
    (captured,) = step._graphs.values()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s: the host runs ahead of the GPU
    copies = []
    for t, b in zip(steps, batches, strict=True):
        got = step.run(t.logits.clone(), b)
        copies.append([x.clone() for x in got])
        del got
    pending = sum(s.host[-1] != s.seq for s in captured.slots)
    torch.cuda.synchronize()
    assert pending == graphs.SLOTS, "the GPU caught up too early to test anything"
    for i, (got, ref) in enumerate(zip(copies, refs, strict=True)):
        assert all(torch.equal(x, y) for x, y in zip(got, ref, strict=True)), f"step {i}"
    assert all(s.host[-1] == s.seq for s in captured.slots)


@pytest.mark.gpu
def test_gpu_failed_slot_capture_keeps_its_queued_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slot capture that fails after the slot's eager fetch was queued (the GPU held up by a
    sleep kernel): the step warns and copies out, the page-locked table stays alive until the
    fetch has read it and acknowledged, then it is let go; every result == the plan's run."""
    steps = _gpu_steps("greedy", 151936, 8, 3)
    rows = steps[0].logits.shape[0]
    shard = _shard(151936, torch.bfloat16, "cuda")
    plan = _plan(shard, rows, "greedy")
    step = shard.graphed(plan)
    batches = [_batch(t, "greedy") for t in steps]
    refs = [plan.run(t.logits, b) for t, b in zip(steps, batches, strict=True)]
    real, real_fetch = graphs._Segments.capture, graphs._Captured._fetch
    calls = {"n": 0}

    def capture(self: Any, body: Callable[[], Any]) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:  # the first slot's capture (the copy-out graph's was first)
            raise RuntimeError("simulated capture failure")
        return real(self, body)

    def fetch(self: Any, buf: torch.Tensor) -> None:
        if calls["n"] == 1 and not torch.cuda.is_current_stream_capturing():
            torch.cuda._sleep(100_000_000)  # the first slot's eager fetch queued behind ~50 ms
        real_fetch(self, buf)

    monkeypatch.setattr(graphs._Segments, "capture", capture)
    monkeypatch.setattr(graphs._Captured, "_fetch", fetch)
    step.run(steps[0].logits, batches[0])  # eager, counted
    torch.cuda.synchronize()
    graphs._UNFETCHED.clear()
    with pytest.warns(RuntimeWarning, match="output slots .* not captured"):
        got = step.run(steps[1].logits, batches[1])
    kept = list(graphs._UNFETCHED)
    assert len(kept) == 1 and kept[0][1][kept[0][2]] == -1, "the fetch ran too early to test"
    del kept
    torch.cuda.synchronize()
    graphs._release_fetched()
    assert graphs._UNFETCHED == []
    assert _equal(got, refs[1])
    assert _equal(step.run(steps[2].logits, batches[2]), refs[2])


@pytest.mark.gpu
@pytest.mark.parametrize("mix", ["greedy", "temperature", "top_p_hist"])
def test_gpu_replay_makes_no_host_sync(mix: str) -> None:
    steps = _gpu_steps(mix, 151936, 8, 3)
    rows = steps[0].logits.shape[0]
    shard = _shard(151936, torch.bfloat16, "cuda")
    plan = _plan(shard, rows, mix)
    step = shard.graphed(plan)
    batches = [_batch(t, mix) for t in steps]
    for _ in range(graphs.CAPTURE_AFTER):
        step.run(steps[0].logits, batches[0])
    refs = [plan.run(t.logits, b) for t, b in zip(steps, batches, strict=True)]
    outs: list[Any] = []
    assert (
        host_syncs(
            lambda: outs.extend(step.run(t.logits, b) for t, b in zip(steps, batches, strict=True))
        )
        == "none"
    )
    for got, ref in zip(outs, refs, strict=True):
        assert _equal(got, ref)


@pytest.mark.gpu
def test_gpu_workspace_growth_after_capture_keeps_the_graph_valid() -> None:
    small, big = _gpu_steps("temperature", 200064, 2, 1)[0], _gpu_steps("temperature", 200064,
                                                                        64, 1)[0]  # fmt: skip
    shard = _shard(200064, torch.bfloat16, "cuda")
    p_small = shard.verify(small.logits.shape[0])
    step = shard.graphed(p_small)
    b_small = _batch(small, "temperature")
    for _ in range(graphs.CAPTURE_AFTER):
        step.run(small.logits, b_small)
    gen = shard.ctx.workspace.generation
    p_big = shard.verify(big.logits.shape[0])
    p_big.run(big.logits, _batch(big, "temperature"))  # grows the shared workspace
    assert shard.ctx.workspace.generation > gen
    assert _equal(step.run(small.logits, b_small), p_small.run(small.logits, b_small))


@pytest.mark.gpu
def test_gpu_nccl_all_gather_is_captured(tmp_path) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))  # fmt: skip
    try:
        t = _gpu_steps("temperature", 151936, 16, 1)[0]
        rows = t.logits.shape[0]
        shard = VocabShard(vocab_start=0, num_valid=151936, width=151936, dtype=torch.bfloat16,
                           device="cuda", group=dist.group.WORLD)  # fmt: skip
        plan = shard.verify(rows)
        step = shard.graphed(plan)
        batch = _batch(t, "temperature")
        ref = plan.run(t.logits, batch)
        for _ in range(graphs.CAPTURE_AFTER + 2):
            assert _equal(step.run(t.logits, batch), ref)
        assert step.num_graphs == 1
    finally:
        dist.destroy_process_group()


_AOT_SCRIPT = """
import json, sys
from generator.aot import _compile, load_module, nominal_warps
from generator.render import generated_dir
from generator.space import ARCHES
out = {}
for name, over in json.loads(sys.argv[1]):
    mod = load_module(generated_dir() / f"{name}.py")
    base = {**mod.CONSTEXPRS, **{k: v for k, v in over.items() if k != "INDIRECT"}}
    warps = nominal_warps(name, mod)
    for arch in ("sm90", "gfx950"):
        direct = _compile(mod, base, ARCHES[arch], warps)
        indirect = _compile(mod, {**base, **over}, ARCHES[arch], warps)
        out[f"{name}/{arch}"] = (direct["spill_bytes"], indirect["spill_bytes"])
print(json.dumps(out))
"""


def test_indirect_launches_compile_ahead_of_time_without_spills() -> None:
    """The INDIRECT constexpr sets (not in the AOT report: one more load than the direct sets)
    compile for sm90 and gfx950 and spill no more than the direct sets, at the widest tile each
    family runs and its nominal warps (a subprocess: the AOT compiler needs Triton without the interpreter)."""
    from tests._aot import run_compiled

    cases = [
        ("shard_keys_bf16_va16_b8192", {"INDIRECT": True}),
        ("sampled_record_bf16_b4096", {"INDIRECT": True, "TOPK": False, "NOISE": False}),
        ("sampled_record_fp32_b2048", {"INDIRECT": True}),
        ("sampled_draw_bf16_b4096", {"INDIRECT": True}),
        ("topp_hist_bf16_b4096", {"INDIRECT": True}),
    ]
    spills = run_compiled(_AOT_SCRIPT, cases)
    assert len(spills) == 2 * len(cases)
    for key, (direct, indirect) in spills.items():
        assert indirect <= direct, (key, direct, indirect)


@pytest.mark.gpu
def test_gpu_pageable_table_upload_is_staged_at_the_call() -> None:
    """What ``_upload`` relies on: a non-blocking copy from pageable host memory queued behind
    milliseconds of device work returns at once and carries the bytes of the moment of the
    call, so the host table may be rewritten right after it."""
    import numpy as np

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    host = np.arange(64, dtype=np.int64)
    src = torch.from_numpy(host)
    dst = torch.zeros(64, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    for _ in range(40):  # ~5 ms queued
        a @ a
    done = torch.cuda.Event()
    dst.copy_(src, non_blocking=True)
    done.record()
    host[:] = -1  # the next step's table
    assert not done.query(), "the copy should still be queued behind the matmuls"
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), torch.arange(64))


def test_a_batch_the_plan_refuses_is_never_captured() -> None:
    """A batch the plan rejects raises the plan's error every time: it is not counted towards a
    capture (no false "capture failed" warning, no state kept), and the workspace stays in its
    plain growth mode (no graph exists on the CPU)."""
    import warnings

    t = _steps("greedy", 1031, 2, 1, "cpu")[0]
    shard = _shard(1031, torch.bfloat16, "cpu")
    step = shard.graphed(shard.verify(t.logits.shape[0]))
    greedy_batch = _batch(t, "greedy")  # no temperature: a sampled plan refuses it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(graphs.CAPTURE_AFTER + 1):
            with pytest.raises(ValueError, match="temperature: required"):
                step.run(t.logits, greedy_batch)
    assert step.num_graphs == 0 and not step._failed and not step._seen
    assert not shard.ctx.workspace.captured


def test_argmax_plans_are_refused() -> None:
    shard = _shard(1031, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="plan: ArgmaxPlan is not a verification plan"):
        shard.graphed(shard.argmax(4))


def test_workspace_after_a_capture_keeps_within_twice_its_largest_buffer() -> None:
    """Once a graph was captured, a replaced buffer is kept (a graph may point at it); growing
    by doubling bounds what is kept, whatever the sequence of sizes."""
    from shardmax.runtime.shard import Workspace

    ws = Workspace(torch.device("cpu"))
    ws.reserve("a", 100)
    ws.captured = True
    for n in range(101, 100_000, 37):
        ws.reserve("a", n)
    kept = sum(b.numel() for b in ws.retired)
    assert len(ws.retired) <= 11 and kept < ws.nbytes()


def _emulated_rank_steps(mix: str, vocab: int, reqs: int, tp: int, n: int, device: str):
    """One emulated rank (rank 0) of a TP ``tp`` group over ``n`` steps of one shape: its plan,
    its GraphedStep, and per step (its shard, batch, the other ranks' bytes). The rank's plan
    really calls its collective, which hands back what every rank sent
    (:class:`shardmax.testing.replayed.ReplayedCollective`)."""
    from shardmax.ops.sampled import SampledVerifyPlan
    from shardmax.reference.nucleus_replay import pipeline_for
    from shardmax.testing.emulate import _stride, emulated_ranks
    from shardmax.testing.replayed import ReplayedCollective, record_exchanges

    steps = _steps(mix, vocab, reqs, n, device)
    rows = steps[0].logits.shape[0]
    shards0, ctxs = emulated_ranks(steps[0].logits, tp)
    stride = _stride(shards0[0].local_logits)
    topp = pipeline_for(rows, "cuda") if mix == "top_p_hist" else None
    plans = [
        SampledVerifyPlan(c, rows, stride, mode="strict" if mix == "strict" else "fast", topp=topp)
        for c in ctxs
    ]
    out = []
    for t in steps:
        shards, _ = emulated_ranks(t.logits, tp)
        batch = _batch(t, mix)
        cu_np = t.cu_num_logits.cpu().numpy()
        gathered, _ = record_exchanges(shards, plans, batch, cu_np, topp is not None)
        out.append((shards[0].local_logits, batch, ReplayedCollective(tp, 0, gathered)))
    return plans[0], GraphedStep(plans[0]), out


@pytest.mark.parametrize("mix", ["top_p_hist", "strict"])
def test_emulated_tp_rank_replays_equal_launches(mix: str) -> None:
    """TP 2, one rank's whole step with its collectives (CPU: the eager body; the GPU test below
    captures it split at the collectives)."""
    plan, step, steps = _emulated_rank_steps(mix, 1031, 2, 2, graphs.CAPTURE_AFTER, "cpu")
    kept = []
    for i, (local, batch, coll) in enumerate(steps):
        plan.ctx.coll = coll
        coll.reset()
        ref = plan.run(local, batch)
        coll.reset()
        got = step.run(local.clone(), batch)
        assert _equal(got, ref), f"step {i}"
        kept += [ref, got]
    assert step.num_graphs == 1


@pytest.mark.gpu
@pytest.mark.parametrize("mix", ["temperature", "top_p_hist", "strict"])
@pytest.mark.parametrize("tp", [2, 8])
def test_gpu_graphs_split_at_the_collectives(mix: str, tp: int) -> None:
    """One emulated rank of TP 2 / 8 on the H200: its step captured as graphs split at the
    all_gathers (which run eagerly between the replays); each step's replay == the launches bit
    for bit, replayed twice; no host sync on replayed steps."""
    plan, step, steps = _emulated_rank_steps(mix, 151936, 24, tp, 5, "cuda")
    kept = []
    for i, (local, batch, coll) in enumerate(steps):
        plan.ctx.coll = coll
        coll.reset()
        ref = plan.run(local, batch)
        coll.reset()
        got = step.run(local.clone(), batch)
        coll.reset()
        again = step.run(local.clone(), batch)
        assert _equal(got, ref), f"{mix} TP{tp} step {i}"
        assert _equal(again, got), f"{mix} TP{tp} step {i}: two replays differ"
        kept += [ref, got, again]
    assert step.num_graphs == 1
    graph = next(iter(step._graphs.values())).graph
    assert graph is not None and len(graph.graphs) == len(graph.calls) + 1 >= 3  # two exchanges
    local, batch, coll = steps[-1]
    coll.reset()
    got: list[Any] = []
    assert host_syncs(lambda: got.append(step.run(local, batch))) == "none"
    out = got[0]
    assert _equal(out, kept[-1])


def test_failed_split_capture_restores_the_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture that fails inside a TP > 1 step (a host sync, an uncapturable launch) leaves the
    shard's real collective in place, even when ending the invalidated capture raises too -- the
    eager fallback then runs the real collective. CUDA's graph simulated on the CPU."""
    import types

    state = {"capturing": False, "invalid": False}

    class FakeGraph:
        def capture_begin(self, pool=None, capture_error_mode="global") -> None:
            state["capturing"] = True

        def capture_end(self) -> None:
            assert state["capturing"], "capture_end while not capturing"
            state["capturing"] = False
            if state["invalid"]:
                raise RuntimeError("operation failed due to a previous error during capture")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())

    class Pair:
        world_size, rank = 2, 0

        def all_gather_dim0(self, t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t])

        def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
            return t

    real = Pair()
    ctx = types.SimpleNamespace(coll=real)

    def body() -> None:
        out = ctx.coll.all_gather_dim0(torch.zeros(2))
        assert out.shape == (4,) and ctx.coll is not real  # split, not run
        state["invalid"] = True
        raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.raises(RuntimeError):
        graphs._Segments(ctx).capture(body)
    assert ctx.coll is real and not state["capturing"]


def _fake_cuda_graphs(monkeypatch: pytest.MonkeyPatch, log: list[str]) -> None:
    """CUDA's graph simulated on the CPU: captures record nothing, replays run nothing; every
    capture and replay event goes into ``log`` (graph ``i``'s replay as ``replay i``)."""

    class FakeGraph:
        made = 0

        def __init__(self) -> None:
            self.i, FakeGraph.made = FakeGraph.made, FakeGraph.made + 1

        def capture_begin(self, pool=None, capture_error_mode="global") -> None:
            log.append("begin")

        def capture_end(self) -> None:
            log.append("end")

        def replay(self) -> None:
            log.append(f"replay {self.i}")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())


class _Pair:
    """A stand-in group of two ranks whose other rank sends ``t + 10``; its MAX adds 100 and
    returns a new tensor (out of place). Logs each call into the shared ``log``."""

    world_size, rank = 2, 0

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def all_gather_dim0(self, t: torch.Tensor) -> torch.Tensor:
        self.log.append("gather")
        return torch.cat([t, t + 10])

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        self.log.append("max")
        return t + 100


class _PairInto(_Pair):
    """:class:`_Pair` with ``all_gather_dim0_into`` and the protocol's in-place MAX."""

    def all_gather_dim0_into(self, t: torch.Tensor, out: torch.Tensor) -> None:
        self.log.append("into")
        torch.cat([t, t + 10], out=out)

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        self.log.append("max")
        return t.add_(100)


@pytest.mark.parametrize("into", [True, False])
def test_split_replay_gathers_into_the_next_graphs_buffer(
    monkeypatch: pytest.MonkeyPatch, into: bool
) -> None:
    """Replayed at TP > 1, a step's all_gather writes straight into the static buffer the next
    graph reads (the collective's ``all_gather_dim0_into``: no gather output, no copy); without
    that method its result is copied there. MAX leaves the reduced values in the recorded input,
    which is the next graph's buffer (an out-of-place MAX is copied back). Each collective runs
    after the graph that produced its input and before the one that reads its result; nothing
    is gathered while capturing."""
    import types

    log: list[str] = []
    _fake_cuda_graphs(monkeypatch, log)
    real = _PairInto(log) if into else _Pair(log)
    ctx = types.SimpleNamespace(coll=real)
    sent, local = torch.arange(3), torch.arange(4)

    def body() -> tuple[torch.Tensor, torch.Tensor]:
        return ctx.coll.all_gather_dim0(sent), ctx.coll.all_reduce_max(local)

    seg = graphs._Segments(ctx)
    gathered, reduced = seg.capture(body)
    assert ctx.coll is real and log == ["begin", "end"] * 3  # no collective ran
    assert gathered.shape == (6,) and reduced.data_ptr() == local.data_ptr()
    del log[:]
    seg.replay()
    gather = "into" if into else "gather"
    assert log == ["replay 0", gather, "replay 1", "max", "replay 2"]
    assert torch.equal(gathered, torch.tensor([0, 1, 2, 10, 11, 12]))
    assert torch.equal(reduced, torch.arange(100, 104)) and torch.equal(local, reduced)


def test_stand_in_groups_gather_into_what_they_gather() -> None:
    """The test / benchmark stand-in groups' ``all_gather_dim0_into`` writes exactly what their
    ``all_gather_dim0`` returns (replayed split graphs use the former)."""
    from shardmax.runtime.collectives import SingleRank, gather_into
    from shardmax.testing.emulate import RepeatedRank
    from shardmax.testing.replayed import ReplayedCollective

    t = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    recorded = [torch.arange(24, dtype=torch.int64).reshape(6, 4) * k for k in (7, 9)]
    for coll in (
        SingleRank(),
        RepeatedRank(1),
        RepeatedRank(3),
        ReplayedCollective(2, 0, recorded),
    ):
        want = coll.all_gather_dim0(t)
        if isinstance(coll, ReplayedCollective):
            coll.reset()
        out = torch.full_like(want, -1)
        gather_into(coll, t, out)
        assert torch.equal(out, want), coll
    # the replayed group hands out its recordings in call order, each in a fresh buffer
    coll = ReplayedCollective(2, 0, recorded)
    out = torch.empty_like(recorded[0])
    first = coll.all_gather_dim0(t)
    gather_into(coll, t, out)
    assert torch.equal(first, recorded[0]) and torch.equal(out, recorded[1])
    assert first.data_ptr() != recorded[0].data_ptr()


class _MaxWithPeer:
    """A stand-in group of two ranks for the greedy all-reduce transport: MAX takes the
    elementwise max with the other rank's keys (``peer``) in place, as NCCL's all_reduce does."""

    world_size, rank = 2, 0

    def __init__(self) -> None:
        self.peer: torch.Tensor | None = None
        self.calls = 0

    def all_gather_dim0(self, t: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the all-reduce transport gathers nothing")

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        assert self.peer is not None
        return torch.maximum(t, self.peer, out=t)


def _greedy_allreduce_replays(device: str, vocab: int) -> None:
    """One rank of a TP 2 greedy step on the all-reduce transport, replayed (split at its MAX on
    a GPU) on three batches: the replay equals the launches bit for bit, and the other rank's
    keys change the answer (so the MAX's result is what the finish reads)."""
    from shardmax.ops.greedy import GreedyVerifyPlan
    from shardmax.runtime.geometry import Geometry
    from shardmax.runtime.shard import ShardContext
    from shardmax.testing.shards import vllm_shard_ranges

    ranges = vllm_shard_ranges(vocab, 2, 64)
    width = ranges[0][2]
    coll = _MaxWithPeer()
    ctx = ShardContext(
        coll, Geometry(tuple((s, n) for s, n, _ in ranges), width, torch.bfloat16), 0,
        torch.device(device),
    )  # fmt: skip
    step = None
    for seed in range(3):
        t = realistic_batch(4, 3, vocab, seed=seed, mix="greedy", device=device)
        pad = (0, width - ranges[0][1])
        local = torch.nn.functional.pad(t.logits[:, : ranges[0][1]], pad).contiguous()
        theirs = t.logits[:, ranges[1][0] : ranges[1][0] + ranges[1][1]]
        peer = torch.nn.functional.pad(theirs, (0, width - ranges[1][1]), value=float("-inf"))
        peer[1::2] += 5  # the other rank's best above this one's on every other row
        rows = local.shape[0]
        batch = check_step_batch(
            rows, local.device, t.draft_sampled, t.cu_num_logits, t.pos, t.idx_mapping,
            t.expanded_local_pos, t.seed, 3,
        )  # fmt: skip
        with override(transport="allreduce"):
            plan = GreedyVerifyPlan(ctx, rows, width) if step is None else step.plan
        assert plan.transport == "allreduce"
        coll.peer = plan.local(local).clone()  # the other rank sends this rank's keys
        alone = plan.run(local, batch)
        coll.peer = plan.local(peer.contiguous()).clone()
        ref = plan.run(local, batch)
        assert not _equal(alone, ref), f"seed {seed}: the other rank's keys change nothing"
        if step is None:
            step = GraphedStep(plan)
        for k in range(graphs.CAPTURE_AFTER + 2):  # eager, captured, replayed twice
            assert _equal(step.run(local.clone(), batch), ref), f"seed {seed} call {k}"
    assert step is not None and step.num_graphs == 1
    if device == "cuda":
        graph = next(iter(step._graphs.values())).graph
        assert graph is not None and [c[0] for c in graph.calls] == ["all_reduce_max"]


def test_greedy_allreduce_step_replays_with_its_max() -> None:
    _greedy_allreduce_replays("cpu", 1031)


@pytest.mark.gpu
def test_gpu_greedy_allreduce_step_replays_its_in_place_max() -> None:
    """On the H200 the step is captured split at its MAX, which runs eagerly in place on the
    recorded keys (the next graph's buffer)."""
    _greedy_allreduce_replays("cuda", 151936)


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("edge", ["zero", "one", "block-1", "block", "block+1", "2block+3"])
def test_table_fetch_copies_every_entry_and_acknowledges_its_request(edge: str, dev: str) -> None:
    """``table_fetch``: the ``n`` entries land in the device table and the request number the
    host left after them comes back as the acknowledgement, for tables around the kernel's
    ``BLOCK`` (none, one entry, one short of it, at it, past it, more than twice it); nothing
    past ``n`` is written, the host's entries and request stay as they were. Entries and
    requests span int64 (its limits, negatives, values past int32). On the CPU (the
    interpreter) and on the GPU (page-locked host memory read in place)."""
    fetch = kernels.kernel("table_fetch")
    block = int(fetch.module.BLOCK)
    n = {"zero": 0, "one": 1, "block-1": block - 1, "block": block, "block+1": block + 1,
         "2block+3": 2 * block + 3}[edge]  # fmt: skip
    if dev == "cpu" and torch.cuda.is_available():
        pytest.skip("the interpreter runs only without a GPU (tests/conftest.py)")
    big = 2**62 + 12345
    src = torch.arange(n + 2, dtype=torch.int64) * 3 - big
    if dev == "cuda":
        src = src.pin_memory()  # read in place by the GPU, as a slot's table is
    src[:n:3] = torch.iinfo(torch.int64).max  # the limits, and values past int32
    src[1:n:5] = torch.iinfo(torch.int64).min
    for request in (-(2**40) - 7 - n, 2**33 + n):  # negative, then past int32
        src[n] = request
        src[n + 1] = -1  # the acknowledgement, not yet written
        host = src[: n + 1].clone()
        dst = torch.full((n + 8,), -7, dtype=torch.int64, device=dev)
        fetch((1,), dst, src, n, BLOCK=block)
        if dev == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(dst[:n].cpu(), src[:n])
        assert (dst[n:] == -7).all()
        assert torch.equal(src[: n + 1], host), "the host's entries or request changed"
        assert int(src[n + 1]) == request
