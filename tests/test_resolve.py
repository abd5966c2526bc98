"""Per-request resolution (:mod:`shardmax.ops.resolve`, issue 18): flagged requests verified from
their own gathered rows, exactly as vLLM verifies them inside the whole step.

CPU, no vLLM needed: row bookkeeping, the gather's layout (vLLM's ``[m, tp * W]`` view and other
geometries), writing answers back, bad input.

CPU, vLLM's kernels under the Triton interpreter (marked ``e2e``: ``tests/e2e_vllm/run.sh``, one
run per extracted vLLM version):

* :meth:`NativeChain.verify_requests` on any subset of a step == :meth:`NativeChain.verify` on
  the whole step for those requests, with several chunks, mixed temperature / top-p / greedy
  requests, and the whole chunk's gates (a T = 1 request alone would be verified on the raw
  tensor; inside a top-p chunk vLLM verifies an fp32 copy -- the subset must too);
* :class:`CapturedResolution` (the plug-in's resolver: the chain on a padded, fixed-capacity
  sub-batch, replayed from CUDA graphs on the GPU; eagerly here) == :meth:`NativeChain.verify`
  on the whole step for any subset, every capacity; what does not fit runs the eager chain;
* the whole flow on realistic T = 1 / top-p 0.95 traffic: emulated TP 2 / 4 sharded verification
  (fast and strict), its flagged requests resolved from their gathered rows: every request of
  the step == vLLM's chain on the full logits, none left flagged.

GPU (marked ``gpu``): the same on the H200 over both top-p pipelines (split <= 64 rows, the
monolithic kernel above), V = 151936 / 200064, TP 2 / 4 / 8, every call twice and compared bit
for bit; the captured resolution (graph replays) == the eager one == the whole step.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from shardmax.integrations.vllm.resolution import CapturedResolution
from shardmax.ops.resolve import (
    SYNTHETIC_GAP,
    SYNTHETIC_MAX_TEMPERATURE,
    ResolutionRows,
    apply_resolved,
    flagged_requests,
    gather_rows,
    request_rows,
    resolution_logits,
    resolution_rows,
    resolve_requests,
)
from shardmax.ops.sampled import FallbackReason, VerifyResult
from shardmax.runtime.geometry import Geometry
from shardmax.runtime.shard import ShardContext
from shardmax.testing.replayed import full_rows
from shardmax.testing.traffic import TrafficBatch, realistic_batch
from shardmax.testing.vllm_chain import NativeChain, verify_inputs

CHAINS = NativeChain.discover()
by_version = pytest.mark.parametrize("chain", CHAINS, ids=[c.id for c in CHAINS])


class _FakeGroup:
    """An in-process TP group seen from one rank: all_gather returns every rank's rows."""

    def __init__(self, shards: list[torch.Tensor], rows: np.ndarray, rank: int) -> None:
        self.shards, self.rows, self.rank = shards, torch.from_numpy(rows), rank
        self.world_size = len(shards)
        self.calls = 0

    def all_gather_dim0(self, t: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        assert torch.equal(t, self.shards[self.rank][self.rows])
        return torch.cat([s[self.rows] for s in self.shards])

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:  # pragma: no cover - unused
        raise AssertionError("gather_rows runs one all_gather")


def _ctx(ranges, width, shards, rows, rank=1) -> ShardContext:
    geo = Geometry(tuple(ranges), width, shards[0].dtype)
    return ShardContext(_FakeGroup(shards, rows, rank), geo, rank, torch.device("cpu"))


# --------------------------------------------------------------------------------------------
# CPU, no vLLM
# --------------------------------------------------------------------------------------------


def test_request_rows() -> None:
    cu = np.array([0, 4, 5, 9, 12])
    assert request_rows(cu, np.array([0, 2])).tolist() == [0, 1, 2, 3, 5, 6, 7, 8]
    assert request_rows(cu, np.array([1, 3])).tolist() == [4, 9, 10, 11]
    assert request_rows(cu, np.array([], dtype=np.int64)).size == 0
    with pytest.raises(ValueError, match="requests"):
        request_rows(cu, np.array([4]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gather_rows_is_vllms_layout(dtype) -> None:
    """vLLM's layout (rank r holds [r W, r W + W), the last rank padded): a view of the gathered
    [m, tp W] tensor trimmed to V, with vLLM's row stride; column v is global id v."""
    tp, width, vocab, num_logits = 3, 8, 21, 6
    full = torch.randn(num_logits, tp * width).to(dtype)
    full[:, vocab:] = 99.0  # padding columns: never part of the answer
    shards = [full[:, r * width : (r + 1) * width].contiguous() for r in range(tp)]
    ranges = [(r * width, min(width, vocab - r * width)) for r in range(tp)]
    rows = np.array([5, 0, 3])
    ctx = _ctx(ranges, width, shards, rows)
    out = gather_rows(ctx, shards[1], rows)
    assert out.shape == (3, vocab) and out.stride() == (tp * width, 1) and out.dtype == dtype
    assert torch.equal(out, full[rows][:, :vocab])
    assert ctx.coll.calls == 1


def test_gather_rows_other_geometries() -> None:
    """Ranges that do not tile [0, V) in rank order (a gap, reversed ranks): ids land at their
    global column, ids nobody holds are -inf."""
    width, num_logits = 4, 3
    logits = torch.randn(num_logits, 12)
    ranges = [(8, 4), (0, 3)]  # rank 0 holds 8..11, rank 1 holds 0..2; 3..7 held by nobody
    shards = [logits[:, 8:12].contiguous(), torch.cat([logits[:, 0:3], torch.zeros(3, 1)], 1)]
    rows = np.array([2, 1])
    out = gather_rows(_ctx(ranges, width, shards, rows, rank=0), shards[0], rows)
    assert out.shape == (2, 12)
    assert torch.equal(out[:, 8:], logits[rows][:, 8:]) and torch.equal(
        out[:, :3], logits[rows][:, :3]
    )
    assert bool(torch.isneginf(out[:, 3:8]).all())


@pytest.mark.parametrize(
    "ranges", [[(0, 3), (3, 4)], [(0, 4), (4, 0), (4, 4)], [(0, 2), (2, 2)]], ids=str
)
def test_gather_rows_contiguous_but_not_vllms_layout(ranges) -> None:
    """Ranges that tile [0, V) without gaps but not at r * W: every id at its column."""
    width, num_logits = 4, 3
    vocab = max(s + n for s, n in ranges)
    logits = torch.randn(num_logits, vocab)
    shards = []
    for s, n in ranges:
        shard = torch.full((num_logits, width), 99.0)  # padding columns would win if read
        shard[:, :n] = logits[:, s : s + n]
        shards.append(shard)
    rows = np.array([1, 2])
    out = gather_rows(_ctx(ranges, width, shards, rows, rank=0), shards[0], rows)
    assert torch.equal(out, logits[rows])


def test_gather_rows_bad_input() -> None:
    shards = [torch.randn(4, 8)]
    ctx = _ctx([(0, 8)], 8, shards, np.array([0]), rank=0)
    with pytest.raises(ValueError, match="local_logits"):
        gather_rows(ctx, torch.randn(4, 7), np.array([0]))
    with pytest.raises(ValueError, match="rows"):
        gather_rows(ctx, shards[0], np.array([4]))


def test_apply_resolved_writes_and_clears() -> None:
    res = VerifyResult(
        torch.full((4, 3), 7, dtype=torch.int64),
        torch.full((4,), 3, dtype=torch.int32),
        torch.zeros(4, dtype=torch.int32),
        torch.tensor([False, True, False, True]),
        torch.tensor([0, 2, 0, 4], dtype=torch.int8),
    )
    req, why = flagged_requests(res)
    assert req.tolist() == [1, 3] and why.tolist() == [2, 4]
    sampled = torch.tensor([[11, 12, 13], [21, 22, 23]], dtype=torch.int32)
    apply_resolved(res, req, sampled, torch.tensor([1, 2]), torch.tensor([2, 1]))
    assert res.sampled.tolist() == [[7, 7, 7], [11, -1, -1], [7, 7, 7], [21, 22, -1]]
    assert res.num_sampled.tolist() == [3, 1, 3, 2] and res.num_rejected.tolist() == [0, 2, 0, 1]
    assert not bool(res.fallback.any()) and res.reason.tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="resolved outputs"):
        apply_resolved(res, req, sampled[:1], torch.tensor([1]), torch.tensor([1]))
    for bad in (np.array([3, 1]), np.array([1, 1]), np.array([4]), np.array([-1])):
        with pytest.raises(ValueError, match="requests"):
            apply_resolved(
                res, bad, sampled[: bad.size], torch.ones(bad.size), torch.ones(bad.size)
            )
    with pytest.raises(ValueError, match="cu_num_logits_np"):
        request_rows(np.array([0, 4, 2]), np.array([0]))


def test_stage_takes_read_only_arrays() -> None:
    from shardmax.runtime.host import stage

    a = np.arange(5)
    a.setflags(write=False)
    assert stage(a, torch.device("cpu")).tolist() == [0, 1, 2, 3, 4]


def _planted(row3: str, topp: bool):
    """Two T = 1 requests, K = 4, V = 512 (rows 0-4, 5-9): request 0's rows 0-1 hold their draft
    40 above every other id (certified accepts), row 2 a NaN (NON_FINITE: its first flagged row),
    row 3 its draft 40 above the rest (``accept``) or 40 below another id (``reject``), row 4 the bonus
    row (one id 40 above the rest); request 1 certified accepts throughout (not flagged).
    ``flat2``: row 2 flat with its draft 40 below (top-p)."""
    b = realistic_batch(2, 4, 512, seed=7, mix="top_p" if topp else "temperature")
    logits = torch.zeros(10, 512)
    draft = b.draft_sampled.long()
    for row in range(10):
        d = 100 + row if row in (4, 9) else int(draft[row + 1])  # bonus rows: a peak too
        if row == 3 and row3 == "reject":
            d = (d + 1) % 512  # the peak on another id: the draft 40 below it
        logits[row, d] = 40.0
    if row3 == "flat2":  # row 2 flat (no certified kept set), its draft 40 below: vLLM surely
        logits[2] = 0.0  # rejects it, so it is the stop (top-p steps)
        logits[2, int(draft[3])] = -40.0
    else:
        logits[2, 17] = float("nan")
    b.logits = logits.to(torch.bfloat16)
    b.temperature[b.idx_mapping.long()] = 1.0
    return b


@pytest.mark.parametrize(
    "topp,row3,gathered,drawn",
    [
        (t, r, g, d)
        for t in (False, True)
        for r, g, d in (("reject", [2], [3]), ("accept", [2], [4]))
    ]
    + [(True, "flat2", [2], [])],
)
def test_need_names_the_rows_a_resolution_gathers(
    row3: str, gathered: list[int], drawn: list[int], topp: bool
) -> None:
    """The finish's ``need`` on planted rows: the first flagged row, then the later rows up to the
    first sure stop (a certified rejection; ``flat2``: the flagged row itself, whose draft sits
    40 below its maximum) except certified accepts -- and except the row the step drew from past
    the flagged one (a certified rejection or the bonus row, reached because the step accepted
    the NaN row: a synthetic draw row, need 2); nothing of an unflagged request."""
    from shardmax.reference.nucleus_replay import pipeline_for
    from shardmax.testing.emulate_sampled import emulate_verify

    b = _planted(row3, topp)
    config = pipeline_for(10, "cuda", "0.33") if topp else None
    res = emulate_verify(b.logits, 2, *b.sampled_args(), **b.sampling_kwargs(), topp=config)
    req, why = flagged_requests(res)
    flag = FallbackReason.TOPP_NOT_CERTIFIED if row3 == "flat2" else FallbackReason.NON_FINITE
    assert req.tolist() == [0] and why.tolist() == [flag], (req, why)
    rows, gather, draw = resolution_rows(res, b.cu_num_logits.numpy(), req)
    assert rows[gather].tolist() == gathered and rows[draw].tolist() == drawn
    if drawn:  # the step's token at the draw row's column
        assert int(res.num_sampled[0]) == drawn[0] + 1 and int(res.sampled[0, drawn[0]]) >= 0
    if row3 == "flat2":
        return
    # a temperature above SYNTHETIC_MAX_TEMPERATURE: every row of the request is gathered (a
    # NaN in its first row flags it; row 1 is a certified rejection there, the stop otherwise)
    b.temperature[int(b.idx_mapping[0])] = 2 * SYNTHETIC_MAX_TEMPERATURE  # request 0 only
    b.logits[0, 17] = float("nan")
    res = emulate_verify(b.logits, 2, *b.sampled_args(), **b.sampling_kwargs(), topp=config)
    req, _ = flagged_requests(res)
    rows, gather, draw = resolution_rows(res, b.cu_num_logits.numpy(), req)
    assert req.tolist() == [0] and bool(gather.all()) and not draw.any()
    assert rows.tolist() == [0, 1, 2, 3, 4]


def _draft_tie(seed: int) -> TrafficBatch:
    """One T = 1 / top-p 0.01 request, K = 1 (found by an adversarial review): row 0's draft ties
    another id at the row's maximum -- which of the two vLLM keeps is not known from the shards
    (TOPP_TIE) -- row 1 (the bonus row) one peaked id. vLLM keeps and accepts the draft when it
    keeps it, then draws from row 1: no sure stop at row 0."""
    vocab, d, other = 512, 222, 300
    logits = torch.zeros(2, vocab)
    logits[0, d] = logits[0, other] = logits[1, 77] = 10.0
    return TrafficBatch(
        logits=logits.to(torch.bfloat16),
        draft_sampled=torch.tensor([5, d], dtype=torch.int32),
        cu_num_logits=torch.tensor([0, 2], dtype=torch.int32),
        pos=torch.tensor([1000, 1001]),
        idx_mapping=torch.tensor([0], dtype=torch.int32),
        expanded_local_pos=torch.tensor([0, 1], dtype=torch.int32),
        seed=torch.tensor([seed], dtype=torch.int64),
        num_speculative_steps=1,
        temperature=torch.tensor([1.0]),
        top_p=torch.tensor([0.01]),
    )


def _tie_step(b: TrafficBatch, version: str, device: str = "cpu") -> VerifyResult:
    """The step verified with the top-p pipeline vLLM ``version`` runs on ``device`` (the CPU's
    monolithic kernel needs vLLM's sigma table: e2e only)."""
    from shardmax.reference.nucleus_replay import pipeline_for
    from shardmax.testing.emulate_sampled import emulate_verify

    return emulate_verify(
        b.logits, 2, *b.sampled_args(), top_p=b.top_p, topp=pipeline_for(2, device, version)
    )


def test_need_an_unsure_draft_tie_is_no_sure_stop() -> None:
    """The sure-stop test reads the draft's own value, not the kept-set-masked one."""
    res = _tie_step(_draft_tie(0), "0.33", "cuda")  # the split pipeline: no sigma table
    req, why = flagged_requests(res)
    assert req.tolist() == [0] and why.tolist() == [FallbackReason.TOPP_TIE]
    rows, gather, _ = resolution_rows(res, np.array([0, 2]), req)
    assert rows[gather].tolist() == [0, 1]


def _bonus_tie(seed: int) -> TrafficBatch:
    """:func:`_draft_tie`'s request with a NaN in row 0 (the finish flags it NON_FINITE and
    accepts its draft, 10 above the rest, provisionally) and the tie moved to the bonus row: the
    step draws there from a kept set whose boundary ties vLLM keeps one of (``sampled_pick``
    cannot certify the draw)."""
    b = _draft_tie(seed)
    logits = torch.zeros(2, 512)
    logits[0, 222] = logits[1, 77] = logits[1, 300] = 10.0
    logits[0, 17] = float("nan")
    b.logits = logits.to(torch.bfloat16)
    return b


def test_need_an_uncertified_draw_is_gathered() -> None:
    """The finish marks the bonus row a synthetic draw row (need 2: past the flagged row, a
    certified kept set); the pick's draw there is an unsure boundary tie, so it sets 1 back --
    also on a request the finish already flagged (a synthetic row of that draw would be a
    token vLLM may not draw)."""
    for seed in range(3):
        res = _tie_step(_bonus_tie(seed), "0.33", "cuda")
        req, why = flagged_requests(res)
        assert req.tolist() == [0] and why.tolist() == [FallbackReason.NON_FINITE]
        rows, gather, draw = resolution_rows(res, np.array([0, 2]), req)
        assert rows[gather].tolist() == [0, 1] and not draw.any(), seed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_resolution_logits_synthetic_rows(dtype) -> None:
    vocab, width, tp = 300, 160, 2  # vLLM's layout: [m, tp * W] viewed as [m, V]
    cu = np.array([0, 3, 5, 8])
    idx_np = np.array([4, 0, 2])
    draft = torch.tensor([9, 11, 12, 99, 21, 22, 31, 32, 299, 5], dtype=torch.int32)
    temp = torch.tensor([0.0, 0.0, 0.5, 0.0, 3.0])  # slots 4, 0, 2 -> T 3, 0, 0.5
    req = np.array([0, 2])  # rows 0 1 2 | 5 6 7
    gather = np.array([False, True, False, False, False, True])
    real = torch.arange(2 * tp * width, dtype=dtype).view(2, tp * width)[:, :vocab]
    out = resolution_logits(real, gather, req, cu, idx_np, draft, temp)
    assert out.shape == (6, vocab) and out.stride(0) == tp * width and out.dtype == dtype
    assert torch.equal(out[1], real[0]) and torch.equal(out[5], real[1])
    for i, (row, t) in enumerate([(0, 3.0), (2, 3.0), (5, 0.5), (6, 0.5)]):
        at = [0, 2, 3, 4][i]
        tok = int(draft[min(row + 1, 9)])
        want = torch.full((vocab,), -SYNTHETIC_GAP * max(1.0, t), dtype=dtype)
        want[tok] = 0
        assert torch.equal(out[at], want), (row, out[at])
    # every row gathered: the gathered tensor itself
    assert (
        resolution_logits(real, np.array([True, True]), np.array([1]), cu, idx_np, draft, temp)
        is real
    )
    # synthetic draw rows: the step's token at the row's column on top (rows 2 and 6: request
    # 0's column 2, request 2's column 1), the draft among the others
    sampled = torch.tensor([[9, 11, 250, -1], [0, 0, 0, 0], [21, 7, -1, -1]])
    draw = np.array([False, False, True, False, True, False])
    out = resolution_logits(real, gather, req, cu, idx_np, draft, temp, draw, sampled)
    for at, tok, t in [(2, 250, 3.0), (4, 7, 0.5), (0, int(draft[1]), 3.0)]:
        want = torch.full((vocab,), -SYNTHETIC_GAP * max(1.0, t), dtype=dtype)
        want[tok] = 0
        assert torch.equal(out[at], want), (at, out[at])
    assert torch.equal(out[1], real[0]) and torch.equal(out[5], real[1])
    with pytest.raises(ValueError, match="sampled"):
        resolution_logits(real, gather, req, cu, idx_np, draft, temp, draw, None)
    with pytest.raises(ValueError, match="sampled"):
        resolution_logits(real, gather, req, cu, idx_np, draft, temp, draw, sampled[:2])
    with pytest.raises(ValueError, match="draw"):  # a row both gathered and drawn
        resolution_logits(real, gather, req, cu, idx_np, draft, temp, gather, sampled)
    with pytest.raises(ValueError, match="gather"):
        resolution_logits(real, gather[:5], req, cu, idx_np, draft, temp)
    with pytest.raises(ValueError, match="gathered"):
        resolution_logits(real[:1], gather, req, cu, idx_np, draft, temp)


# --------------------------------------------------------------------------------------------
# CPU, vLLM's kernels (interpreter)
# --------------------------------------------------------------------------------------------


def _assert_same(got, want, what: str) -> int:
    """``==`` on the counts and on the tokens < num_sampled; returns the number of tokens."""
    sampled, num_sampled, num_rejected = (t.cpu() for t in got[:3])
    w_sampled, w_num, w_rej = (t.cpu() for t in want[:3])
    assert torch.equal(num_sampled, w_num.to(num_sampled.dtype)), (what, num_sampled, w_num)
    assert torch.equal(num_rejected, w_rej.to(num_rejected.dtype)), (what, num_rejected, w_rej)
    cols = torch.arange(sampled.shape[1])[None, :] < num_sampled[:, None]
    assert torch.equal(sampled[cols], w_sampled.to(sampled.dtype)[cols]), what
    return int(cols.sum())


def _subset(out, req: np.ndarray):
    idx = torch.from_numpy(req)
    return tuple(t.cpu()[idx] for t in out[:3])


def _mixed_batch(seed: int, num_reqs: int, vocab: int, device="cpu"):
    """Realistic rows; per request T 0 / 0.8 / 1.0 with top-p 0.95 on some, a T = 1 request
    without top-p among them (verified on vLLM's fp32 copy because its chunk needs one)."""
    b = realistic_batch(num_reqs, 3, vocab, seed=seed, mix="top_p", device=device)
    gen = torch.Generator().manual_seed(seed)
    slots = b.idx_mapping.long()
    temp = b.temperature.clone()
    top_p = b.top_p.clone()
    kind = torch.randint(0, 4, (num_reqs,), generator=gen)
    kind[0], kind[1] = 3, 1  # a plain T = 1 request and a top-p one are always present
    temp[slots] = torch.tensor([0.0, 1.0, 0.8, 1.0])[kind]
    top_p[slots] = torch.tensor([1.0, 0.95, 0.9, 1.0])[kind]
    return b, temp, top_p


@pytest.mark.e2e
@by_version
def test_verify_requests_equals_the_whole_step(chain: NativeChain) -> None:
    vocab, num_reqs = 512, 8
    b, temp, top_p = _mixed_batch(3, num_reqs, vocab)
    for max_chunk in (None, 9):  # one chunk; several (requests never split)
        ch = chain.with_options(max_chunk_rows=max_chunk)
        kw = verify_inputs(b, temperature=temp, top_p=top_p)
        whole = ch.verify(b.logits, **kw)
        whole_pipes = list(ch.last_pipelines)
        assert "monolithic" in whole_pipes  # top-p ran (CPU: vLLM's monolithic kernel)
        gen = np.random.default_rng(max_chunk or 0)
        subsets = [np.array([0]), np.array([num_reqs - 1]), np.arange(num_reqs)]
        subsets += [np.sort(gen.choice(num_reqs, size=s, replace=False)) for s in (2, 5)]
        for req in subsets:
            rows = request_rows(kw["cu_num_logits_np"], req)
            got = ch.verify_requests(b.logits[torch.from_numpy(rows)], req, **kw)
            _assert_same(got, _subset(whole, req), f"vLLM {chain.version} chunk {max_chunk} {req}")
            if max_chunk is None:  # the subset's chunk takes the whole chunk's gates
                assert ch.last_pipelines == whole_pipes, (req, ch.last_pipelines, whole_pipes)
        # request 0 alone (plain T = 1) would be verified raw; inside its step it is processed
        alone = verify_inputs(b, temperature=temp, top_p=top_p)
        ch.verify(b.logits[:4], **{**alone, **_only_first(alone, 4)})
        assert ch.last_pipelines == ["none"]


@pytest.mark.e2e
@by_version
def test_captured_resolution_equals_the_whole_step(chain: NativeChain) -> None:
    """The padded fixed-capacity sub-batch (eager here: no CUDA graph on the CPU) gives every
    subset's requests the whole step's answer; subsets that fit no capacity, or span chunks, take
    the eager chain."""
    vocab, num_reqs = 512, 8
    b, temp, top_p = _mixed_batch(5, num_reqs, vocab)
    kw = verify_inputs(b, temperature=temp, top_p=top_p)
    whole = chain.verify(b.logits, **kw)
    res = CapturedResolution(chain, capacities=(1, 2, 4), padded=True)
    subsets = [np.array([0]), np.array([num_reqs - 1]), np.array([2, 5]), np.array([1, 3, 4, 6])]
    for req in subsets:
        rows = request_rows(kw["cu_num_logits_np"], req)
        for checks in (True, False):
            got = res.verify_requests(
                b.logits[torch.from_numpy(rows)], req, **{**kw, "checks": checks}
            )
            _assert_same(got, _subset(whole, req), f"vLLM {chain.version} captured {req}")
    assert res.stats["padded_eager"] == 2 * len(subsets) and res.stats["eager"] == 0
    # 5 requests: over the largest capacity -> the eager chain, same answer
    req = np.array([0, 1, 2, 3, 4])
    rows = request_rows(kw["cu_num_logits_np"], req)
    got = res.verify_requests(b.logits[torch.from_numpy(rows)], req, **kw)
    _assert_same(got, _subset(whole, req), "over capacity")
    assert res.stats["eager"] == 1
    # requests in two chunks -> the eager chain
    small = CapturedResolution(chain.with_options(max_chunk_rows=9), padded=True)
    whole9 = chain.with_options(max_chunk_rows=9).verify(b.logits, **kw)
    req = np.array([0, num_reqs - 1])
    rows = request_rows(kw["cu_num_logits_np"], req)
    got = small.verify_requests(b.logits[torch.from_numpy(rows)], req, **kw)
    _assert_same(got, _subset(whole9, req), "two chunks")
    assert small.stats["eager"] == 1
    with pytest.raises(ValueError, match="rows_logits"):
        res.verify_requests(b.logits[:3], np.array([0]), **kw)
    with pytest.raises(ValueError, match="requests"):
        res.verify_requests(b.logits[:8], np.array([1, 0]), **kw)
    with pytest.raises(ValueError, match="capacities"):
        CapturedResolution(chain, capacities=(2, 2))
    # what the chain refuses is refused here too, also without checks
    rows = b.logits[:4]
    off = {**kw, "checks": False}
    for method in ("block", "fly"):
        with pytest.raises(NotImplementedError, match=method):
            res.verify_requests(rows, np.array([0]), **{**off, "rejection_sample_method": method})
    with pytest.raises(ValueError, match="synthetic_conditional_rates"):
        res.verify_requests(rows, np.array([0]), **{**off, "rejection_sample_method": "synthetic"})
    with pytest.raises(TypeError, match="unexpected arguments"):
        res.verify_requests(rows, np.array([0]), **{**off, "temprature_gpu": None})
    with pytest.raises(TypeError, match="rows_logits"):
        res.verify_requests(rows.tolist(), np.array([0]), **off)


def _sub_state(res: CapturedResolution) -> list[torch.Tensor]:
    """The input buffers of a resolver's capacities (logits, indices), in order."""
    return [
        t.clone()
        for sub in res._subs.values()
        for t in (sub.logits, *sub.row_index.values(), sub.idx_mapping, sub.seq_lens, sub.cu)
    ]


@pytest.mark.e2e
@by_version
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_verify_resolution_equals_the_rows_built_apart(chain: NativeChain, dtype) -> None:
    """``CapturedResolution.verify_resolution`` (one ``resolve_fill`` launch builds the gathered,
    synthetic accept, synthetic draw and padding rows and the sub-batch's indices in the
    capacity's buffers) leaves every buffer and output bit-identical to ``resolution_logits`` +
    ``verify_requests``, over steps of 3, 1 and 2 requests (stale rows back to padding), T 0 to
    2 * SYNTHETIC_MAX_TEMPERATURE (the kernel's clamp), greedy, top-p; a last step with every
    row gathered takes the rows as they are (no fill kernel), same answer. ``resolve`` writes
    the same answers into the step's outputs (``resolve_apply``) as ``apply_resolved``, and a
    later resolution of other requests on the same capacity leaves them alone."""
    from shardmax.integrations.vllm.resolution import FILL_WORDS
    from shardmax.runtime.kernels import load

    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    assert load(f"resolve_fill_{name}").WORDS.value == FILL_WORDS
    vocab, num_reqs, k = 512, 8, 3
    b, temp, top_p = _mixed_batch(9, num_reqs, vocab)
    b.logits = b.logits.to(dtype)
    temp[b.idx_mapping.long()[2]] = 0.5
    temp[b.idx_mapping.long()[4]] = 2 * SYNTHETIC_MAX_TEMPERATURE
    kw = verify_inputs(b, temperature=temp, top_p=top_p)
    cu = kw["cu_num_logits_np"]
    gen = torch.Generator().manual_seed(4)
    sampled = torch.randint(0, vocab, (num_reqs, k + 1), generator=gen)
    apart = CapturedResolution(chain, capacities=(1, 4), padded=True)
    fused = CapturedResolution(chain, capacities=(1, 4), padded=True)
    into = CapturedResolution(chain, capacities=(1, 4), padded=True)  # resolve(): in-kernel apply
    written: list[tuple[VerifyResult, VerifyResult]] = []
    steps = [([1, 2, 4], [0, 7]), ([6], [3]), ([0, 7], [1, 6]), ([3, 5], [2, 4])]
    for req, other in ((np.array(r), np.array(o)) for r, o in steps):
        rows = request_rows(cu, req)
        gather = torch.rand(rows.size, generator=gen).numpy() < 0.4
        if req[0] == 3:  # every row gathered
            gather[:] = True
        draw = ~gather & (torch.rand(rows.size, generator=gen).numpy() < 0.3)
        plan = ResolutionRows(rows, gather, draw)
        gathered = b.logits[torch.from_numpy(rows[gather])]
        want = apart.verify_requests(
            resolution_logits(
                gathered, gather, req, cu, kw["idx_mapping_np"], kw["draft_sampled"],
                kw["temperature_gpu"], draw, sampled,
            ), req, **kw,
        )  # fmt: skip
        got = fused.verify_resolution(gathered, plan, req, sampled, **kw)
        _assert_same(got, tuple(t.cpu() for t in want), f"fused {req}")
        for a, w in zip(_sub_state(fused), _sub_state(apart), strict=True):
            assert torch.equal(a, w), req
        # resolve(): the same answers written into the step's outputs by resolve_apply (or by
        # apply_resolved where the fill kernel is not used), bit-identical to apply_resolved's
        result = _flagged_result(sampled, req, gen)
        expect = VerifyResult(*(t.clone() for t in result[:5]))
        apply_resolved(expect, req, *want)
        into.resolve(result, gathered, plan, req, **kw)
        for g, w in zip(result[:5], expect[:5], strict=True):
            assert g.dtype == w.dtype and torch.equal(g, w), req
        written.append((result, VerifyResult(*(t.clone() for t in result[:5]))))
        # a later resolution of other requests through verify_requests (rows given) on the same
        # capacity writes nothing into an earlier step's outputs (the table's n is reset there)
        other_rows = torch.from_numpy(request_rows(cu, other))
        into.verify_requests(b.logits[other_rows], other, **kw)
        for old, copy in written:
            assert all(torch.equal(g, w) for g, w in zip(old[:5], copy[:5], strict=True)), req
    assert fused.stats == apart.stats
    req = np.array([2])
    rows = request_rows(cu, req)
    plan = ResolutionRows(rows, np.array([True, False, False, False]), np.array([0, 0, 1, 0]) > 0)
    gathered = b.logits[torch.from_numpy(rows[:1])]
    with pytest.raises(ValueError, match="gathered"):
        fused.verify_resolution(gathered[:0], plan, req, sampled, **kw)
    with pytest.raises(ValueError, match="sampled"):
        fused.verify_resolution(gathered, plan, req, sampled[:2], **kw)
    with pytest.raises(TypeError, match="unexpected"):
        fused.verify_resolution(gathered, plan, req, sampled, **kw, temprature_gpu=None)
    # outputs that are not the step's shape are refused, never written through (resolve_apply
    # would index them with the step's request numbers and K + 1)
    for shape in ((3, k + 1), (num_reqs, k + 2), (num_reqs, k)):
        bad = _flagged_result(torch.zeros(shape, dtype=torch.int64), np.array([2]), gen)
        with pytest.raises(ValueError, match="result: expected sampled"):
            into.resolve(bad, gathered, plan, req, **kw)


def _flagged_result(sampled: torch.Tensor, req: np.ndarray, gen: torch.Generator) -> VerifyResult:
    """A step's outputs with ``req`` flagged and every other request's answer arbitrary: the
    tokens ``sampled`` (the synthetic draw rows read them), random counts, reasons 1-14."""
    num_reqs, width = sampled.shape
    fallback = torch.zeros(num_reqs, dtype=torch.bool)
    fallback[torch.from_numpy(req)] = True
    reason = torch.randint(1, 15, (num_reqs,), generator=gen, dtype=torch.int8) * fallback
    return VerifyResult(
        sampled.clone(),
        torch.randint(1, width + 1, (num_reqs,), generator=gen, dtype=torch.int32),
        torch.randint(0, width, (num_reqs,), generator=gen, dtype=torch.int32),
        fallback,
        reason.to(torch.int8),
    )


def _every_rule(seed: int, dtype: torch.dtype) -> tuple[TrafficBatch, dict]:
    """8 realistic requests, K = 3, V = 512: greedy, T 0.01 / 0.7 / 1 / 1 / 2 / 50 /
    SYNTHETIC_MAX_TEMPERATURE, top-k 1 and 2 on two of them, min-p 0.1 on one, top-p on the
    realistic mix's; with vLLM's step arguments."""
    vocab = 512
    b = realistic_batch(8, 3, vocab, seed=seed, mix="top_p", dtype=dtype)
    slots = b.idx_mapping.long()
    temp = b.temperature.clone()
    temp[slots] = torch.tensor([0.0, 0.01, 0.7, 1.0, 1.0, 2.0, 50.0, SYNTHETIC_MAX_TEMPERATURE])
    top_k = torch.full((temp.numel(),), vocab, dtype=torch.int32)
    top_k[slots[2:4]] = torch.tensor([1, 2], dtype=torch.int32)
    min_p = torch.zeros_like(temp)
    min_p[slots[5]] = 0.1
    return b, verify_inputs(b, temperature=temp, top_k=top_k, min_p=min_p)


@pytest.mark.e2e
@by_version
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_vllm_accepts_every_synthetic_row(chain: NativeChain, dtype) -> None:
    """The premise of synthetic rows (shardmax.ops.resolve): on rows that are all synthetic --
    each draft SYNTHETIC_GAP max(1, T) above every other id -- vLLM's chain accepts every
    draft, for every uniform draw (8 requests x 3 drafts x 3 seeds), greedy and T from 0.01 to
    SYNTHETIC_MAX_TEMPERATURE, with top-k 1 / 2, top-p and min-p on, on the fp32 copy."""
    num_reqs = 8
    for seed in range(3):
        b, kw = _every_rule(seed, dtype)
        req = np.arange(num_reqs)
        m = int(kw["cu_num_logits_np"][-1])
        synthetic = resolution_logits(
            b.logits[:0], np.zeros(m, dtype=bool), req, kw["cu_num_logits_np"],
            kw["idx_mapping_np"], kw["draft_sampled"], kw["temperature_gpu"],
        )  # fmt: skip
        out = chain.verify(synthetic, **kw)
        assert out.num_rejected.tolist() == [0] * num_reqs, (seed, out.num_rejected)
        drafts = b.draft_sampled.long().view(num_reqs, 4)[:, 1:]
        assert torch.equal(out.sampled[:, :3].long().cpu(), drafts), seed


@pytest.mark.e2e
@by_version
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_vllm_draws_the_token_of_every_synthetic_draw_row(chain: NativeChain, dtype) -> None:
    """The premise of synthetic draw rows (``VerifyResult.need == 2``): request ``r``'s rows
    before ``j_r`` synthetic accepts, row ``j_r`` (a draft row or the bonus row) a synthetic draw
    row of a token ``t_r`` other than its draft -- vLLM's chain accepts the ``j_r`` drafts, then
    rejects (or, at the bonus row, samples) and draws ``t_r``, whatever its keyed noise (fp32 and
    fp64 Gumbel): 8 requests x 3 seeds, greedy and T from 0.01 to SYNTHETIC_MAX_TEMPERATURE,
    top-k 1 / 2, top-p and min-p on."""
    import inspect

    # the argument's two bounds, pinned to the carried vLLM's source: its acceptance uniform is
    # clamped away from 0 (tl_rand32(..., includes_zero=False): u >= _TL_RAND_MIN, log u > -22)
    # and its Gumbel uniforms are open intervals (murmur3_uniform32 / 64)
    gumbel, rejection = chain.modules.gumbel, chain.modules.rejection
    assert "includes_zero=False" in inspect.getsource(rejection._rejection_kernel.fn)
    assert math.log(float(getattr(gumbel._TL_RAND_MIN, "value", gumbel._TL_RAND_MIN))) > -22.0
    vocab, num_reqs, k = 512, 8, 3
    for seed in range(3):
        b, kw = _every_rule(seed, dtype)
        cu = kw["cu_num_logits_np"]
        gen = torch.Generator().manual_seed(100 + seed)
        j = torch.randint(0, k + 1, (num_reqs,), generator=gen)  # each request's draw row
        drafts = b.draft_sampled.long()
        sampled = torch.full((num_reqs, k + 1), -1, dtype=torch.int64)
        draw = np.zeros(int(cu[-1]), dtype=bool)
        for r in range(num_reqs):
            row = int(cu[r]) + int(j[r])
            d = int(drafts[row + 1]) if int(j[r]) < k else -1
            t = int(torch.randint(0, vocab, (1,), generator=gen))
            sampled[r, int(j[r])] = t if t != d else (t + 1) % vocab
            draw[row] = True
        synthetic = resolution_logits(
            b.logits[:0], np.zeros(draw.size, dtype=bool), np.arange(num_reqs), cu,
            kw["idx_mapping_np"], kw["draft_sampled"], kw["temperature_gpu"], draw, sampled,
        )  # fmt: skip
        for fp64 in (False, True):
            out = chain.verify(synthetic, **kw, use_fp64_gumbel=fp64)
            assert out.num_sampled.tolist() == (j + 1).tolist(), (seed, fp64, out.num_sampled)
            got = out.sampled.long().cpu()
            for r in range(num_reqs):
                jr = int(j[r])
                want = [*drafts.view(num_reqs, k + 1)[r, 1 : jr + 1].tolist(), int(sampled[r, jr])]
                assert got[r, : jr + 1].tolist() == want, (seed, fp64, r)


@pytest.mark.e2e
@by_version
@pytest.mark.parametrize("case", ["draft_tie", "bonus_tie"])
def test_unsure_tie_resolved_equals_vllm(chain: NativeChain, case: str) -> None:
    """12 seeds, vLLM keeping either tie: the adversarial review's draft tie (:func:`_draft_tie`)
    and an uncertified draw at the bonus row of a request the finish flagged
    (:func:`_bonus_tie`): resolved == vLLM."""
    build = _draft_tie if case == "draft_tie" else _bonus_tie
    for seed in range(12):
        b = build(seed)
        kw = verify_inputs(b)
        whole = chain.verify(b.logits, **kw)
        res = _tie_step(b, chain.version)
        req, _ = flagged_requests(res)
        resolve_requests(res, req, full_rows(b.logits), chain, kw)
        _assert_same(res, whole, f"vLLM {chain.version} seed {seed}")


def _margin_then_draw(seed: int) -> TrafficBatch:
    """5 fp32 requests, K = 3, V = 512 (after an adversarial review's construction): request
    ``r``'s rows before ``f_r`` certified accepts (draft 40 above the rest), row ``f_r`` an
    acceptance within ``1e-5`` of its uniform (``LSE_MARGIN``: vLLM may go either way), rows up
    to ``a_r`` certified accepts again, row ``a_r`` a certified rejection (draft 40 below the
    maximum) or the bonus row -- the step's draw row past the flagged one (``need == 2``),
    which vLLM reaches whenever it accepts row ``f_r``."""
    from shardmax.runtime.gumbel import acceptance_uniform_triton

    num_reqs, k, vocab = 5, 3, 512
    b = realistic_batch(num_reqs, k, vocab, seed=seed, mix="temperature", dtype=torch.float32)
    gen = np.random.default_rng(seed)
    temps = torch.tensor([0.7, 1.0, 1.7, 40.0, 1.0])
    b.temperature[b.idx_mapping.long()] = temps
    seeds = b.seed[b.idx_mapping.long()].repeat_interleave(k + 1)
    u, _ = acceptance_uniform_triton(seeds, b.pos)
    logits = torch.empty(num_reqs * (k + 1), vocab)
    for r in range(num_reqs):
        f = int(gen.integers(0, k))
        a = int(gen.integers(f + 1, k + 1))
        for i in range(k + 1):
            row = r * (k + 1) + i
            d = int(b.draft_sampled[row + 1]) if i < k else -1
            z = torch.from_numpy(gen.normal(0, 2, vocab)).float()  # the processed row
            if i < a and i != f:
                z[d] = z.max() + 40.0
            elif i == f:  # x[d] - logsumexp(row) = log u, to 1e-5 (relative)
                rest = z.double().clone()
                rest[d] = -1e30
                uu = float(u[row])
                xd = math.log(uu) + torch.logsumexp(rest, 0).item() - math.log1p(-uu)
                z[d] = xd + float(gen.uniform(-1e-5, 1e-5)) * (1 + abs(xd))
            elif i == a and d >= 0:
                z[d] = z.max() - 40.0
            logits[row] = z * float(temps[r])
    b.logits = logits
    return b


@pytest.mark.e2e
@by_version
def test_certified_draw_rows_reached_resolved_equals_vllm(chain: NativeChain) -> None:
    """Synthetic draw rows that vLLM reaches (:func:`_margin_then_draw`, 4 seeds, fp32 and fp64
    Gumbel): the finish marks each request's draw row 2, vLLM reaches some of them on the real
    rows, and the resolved step == vLLM's chain on the full logits."""
    from shardmax.testing.emulate_sampled import emulate_verify

    drawn = reached = 0
    for seed in range(4):
        b = _margin_then_draw(seed)
        for fp64 in (False, True):
            kw = {**verify_inputs(b), "use_fp64_gumbel": fp64}
            cu = kw["cu_num_logits_np"]
            whole = chain.verify(b.logits, **kw)
            res = emulate_verify(
                b.logits, 2, *b.sampled_args(), use_fp64_gumbel=fp64, **b.sampling_kwargs()
            )
            req, _ = flagged_requests(res)
            rows, _, draw = resolution_rows(res, cu, req)
            for row in rows[draw]:
                r = int(np.searchsorted(cu, row, side="right") - 1)
                drawn += 1
                reached += int(whole.num_sampled[r]) == row - cu[r] + 1
            resolve_requests(res, req, full_rows(b.logits), chain, kw)
            _assert_same(res, whole, f"vLLM {chain.version} seed {seed} fp64 {fp64}")
    assert drawn >= 8 and reached >= 2, (drawn, reached)


def _only_first(kw, rows: int):
    """The step's arguments restricted to request 0 (its own step)."""
    return {
        "draft_sampled": kw["draft_sampled"][:rows],
        "cu_num_logits": kw["cu_num_logits"][:2],
        "pos": kw["pos"][:rows],
        "idx_mapping": kw["idx_mapping"][:1],
        "expanded_idx_mapping": kw["expanded_idx_mapping"][:rows],
        "expanded_local_pos": kw["expanded_local_pos"][:rows],
        "idx_mapping_np": kw["idx_mapping_np"][:1],
        "cu_num_logits_np": kw["cu_num_logits_np"][:2],
        "seq_lens": kw["seq_lens"][:1],
    }


@pytest.mark.e2e
@by_version
def test_verify_requests_bad_input(chain: NativeChain) -> None:
    b, temp, top_p = _mixed_batch(1, 4, 256)
    kw = verify_inputs(b, temperature=temp, top_p=top_p)
    with pytest.raises(ValueError, match="requests"):
        chain.verify_requests(b.logits[:8], np.array([1, 0]), **kw)
    with pytest.raises(ValueError, match="requests"):
        chain.verify_requests(b.logits[:4], np.array([4]), **kw)
    with pytest.raises(ValueError, match="rows_logits"):
        chain.verify_requests(b.logits[:5], np.array([0]), **kw)
    with pytest.raises(TypeError, match="requests"):
        chain.verify_requests(b.logits[:4], np.array([0.0]), **kw)
    # the whole step's arguments are checked as verify checks them
    with pytest.raises(ValueError, match="seed_gpu"):
        chain.verify_requests(
            b.logits[:4], np.array([0]), **{**kw, "seed_gpu": kw["seed_gpu"].int()}
        )
    with pytest.raises(ValueError, match="cu_num_logits_np"):
        chain.verify_requests(b.logits[:4], np.array([0]), **{**kw, "num_speculative_steps": 2})
    out = chain.verify_requests(b.logits[:0], np.array([], dtype=np.int64), **kw)
    assert out.sampled.shape == (0, 4) and out.num_sampled.shape == (0,)


def resolve_step(chain, b, kw, tp: int, mode: str, device="cpu", resolver=None):
    """Emulated TP sharded verification of a realistic step, flagged requests resolved from their
    rows (the rows the step could not certify, here from the full tensor -- gather_rows' layout
    is tested above; synthetic rows for the others).
    Returns (result, flagged requests)."""
    from shardmax.testing.emulate_sampled import emulate_verify

    res = emulate_verify(
        b.logits, tp, b.draft_sampled, b.cu_num_logits, b.pos, b.idx_mapping,
        b.expanded_local_pos, b.temperature, b.seed, b.num_speculative_steps,
        top_p=b.top_p, seq_lens=kw["seq_lens"], prefill_len=kw["prefill_len"], mode=mode,
    )  # fmt: skip
    req, _ = flagged_requests(res)
    gathered = resolve_requests(res, req, full_rows(b.logits), resolver or chain, kw)
    _GATHERED.append((int(gathered.size), int(request_rows(kw["cu_num_logits_np"], req).size)))
    return res, req


_GATHERED: list[tuple[int, int]] = []
"""(rows gathered, rows of the flagged requests) of every resolve_step call."""


@pytest.mark.e2e
@by_version
@pytest.mark.parametrize("tp,mode", [(2, "fast"), (4, "strict")])
def test_realistic_top_p_step_resolved_equals_vllm(chain: NativeChain, tp: int, mode: str) -> None:
    flagged = total = 0
    _GATHERED.clear()
    for seed in (0, 1):
        b = realistic_batch(8, 3, 1024, seed=seed, mix="top_p")
        kw = verify_inputs(b)
        whole = chain.verify(b.logits, **kw)
        res, req = resolve_step(chain, b, kw, tp, mode)
        assert not bool(res.fallback.any())
        _assert_same(res, whole, f"vLLM {chain.version} TP{tp} {mode} seed {seed}")
        flagged += int(req.size)
        total += int(b.cu_num_logits.numel() - 1)
    gathered, rows = (sum(g[i] for g in _GATHERED) for i in (0, 1))
    print(
        f"[resolve] vLLM {chain.version} TP{tp} {mode}: {flagged}/{total} requests resolved, "
        f"{gathered} of their {rows} rows gathered"
    )
    assert flagged > 0  # realistic top-p traffic: the resolution really ran
    assert gathered < rows  # and some rows were certified (synthetic rows in the resolution)


# --------------------------------------------------------------------------------------------
# GPU (H200)
# --------------------------------------------------------------------------------------------

_GPU_CASES = [  # (requests, vocab, tp): 32 and 160 logits rows = split / monolithic pipelines
    (8, 151936, 2),
    (8, 200064, 8),
    (40, 151936, 4),
    (40, 200064, 2),
]


def _gpu_seeds() -> int:
    import os

    return int(os.environ.get("SHARDMAX_RESOLVE_GPU_SEEDS", "12"))


@pytest.mark.gpu
@pytest.mark.parametrize("case", _GPU_CASES, ids=[f"{r}req-V{v}-tp{t}" for r, v, t in _GPU_CASES])
def test_realistic_top_p_resolved_equals_vllm_on_gpu(case) -> None:
    """``$SHARDMAX_RESOLVE_GPU_SEEDS`` steps (default 12) per case, each verified by every
    carried vLLM version's chain and by shardmax in fast and strict mode, resolved twice."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if not CHAINS:
        pytest.skip("no vLLM chain tree (scripts/vllm_kernels.sh)")
    num_reqs, vocab, tp = case
    expect = "split" if num_reqs * 4 <= 64 else "monolithic"
    flagged: dict[tuple[str, str], int] = {}
    for seed in range(_gpu_seeds()):
        b = realistic_batch(num_reqs, 3, vocab, seed=seed, mix="top_p", device="cuda")
        kw = verify_inputs(b)
        for chain in CHAINS:
            whole = chain.verify(b.logits, **kw)
            assert chain.last_pipelines == [expect], chain.last_pipelines
            for mode in ("fast", "strict"):
                first, req = resolve_step(chain, b, kw, tp, mode, "cuda")
                again, req2 = resolve_step(chain, b, kw, tp, mode, "cuda")
                assert np.array_equal(req, req2)
                _assert_same(again, first, f"determinism seed {seed}")
                assert not bool(first.fallback.any())
                _assert_same(first, whole, f"vLLM {chain.version} {case} {mode} seed {seed}")
                key = (chain.version, mode)
                flagged[key] = flagged.get(key, 0) + int(req.size)
    total = num_reqs * _gpu_seeds()
    for (version, mode), n in sorted(flagged.items()):
        print(f"[resolve gpu] vLLM {version} {case} {expect} {mode}: {n}/{total} requests "
              f"resolved, 0 of {total} differ")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("case", _GPU_CASES, ids=[f"{r}req-V{v}-tp{t}" for r, v, t in _GPU_CASES])
def test_captured_resolution_on_gpu(case) -> None:
    """The plug-in's resolver on the H200: each step's flagged requests resolved three times by
    one :class:`CapturedResolution` (padded eager, then captured, then replayed) and once by the
    eager chain -- all `==` vLLM's chain on the whole step, the replays bit-identical."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if not CHAINS:
        pytest.skip("no vLLM chain tree (scripts/vllm_kernels.sh)")
    num_reqs, vocab, tp = case
    resolvers = {c.version: CapturedResolution(c) for c in CHAINS}
    resolved = 0
    kept: list[tuple[VerifyResult, list[torch.Tensor]]] = []  # every step's outputs, and a copy
    for seed in range(_gpu_seeds()):
        b = realistic_batch(num_reqs, 3, vocab, seed=seed, mix="top_p", device="cuda")
        kw = verify_inputs(b)
        for chain in CHAINS:
            whole = chain.verify(b.logits, **kw)
            runs = [resolve_step(chain, b, kw, tp, "fast", "cuda", resolvers[chain.version])
                    for _ in range(3)]  # fmt: skip
            for res, req in runs:
                assert not bool(res.fallback.any())
                _assert_same(res, whole, f"vLLM {chain.version} {case} captured seed {seed}")
                assert np.array_equal(req, runs[0][1])
                kept.append((res, [t.clone() for t in res[:5]]))
            a, b2 = runs[1][0], runs[2][0]
            assert torch.equal(a.sampled, b2.sampled) and torch.equal(a.num_sampled, b2.num_sampled)
            resolved += int(runs[0][1].size)
    # the replayed resolve_apply writes only into the step it resolves: no later step (other
    # requests, other answers, the same captured graphs) changed an earlier step's outputs
    for i, (res, copy) in enumerate(kept):
        assert all(torch.equal(t, c) for t, c in zip(res[:5], copy, strict=True)), i
    for version, r in resolvers.items():
        print(f"[captured resolution] vLLM {version} {case}: {r.stats}, {resolved} requests")
        if resolved:
            assert r.stats["replayed"] > 0, r.stats
