"""Sampled verification of top-p steps from level histograms (``SampledVerifyPlan(topp=...)``).

Each emulated rank sends its records and its top-p level-histogram records in one exchange; every
rank replays vLLM's top-p search, decides each request over the certified kept set and draws
from it. The oracle: per row, the plain-torch replay (:func:`replay` on the full row's
:func:`level_histogram`) gives the kept set, the masked processed row is built with the fewest
and with the most boundary ties kept (:func:`kept_masks`), and the reference
:func:`verify_sampled` runs on each. Every request the step does not flag must equal both, ``==``.
Rows: realistic LM-like traffic at T = 1 / top-p 0.95 (drafts mostly the top token), plus
T = 0.7 rows, greedy rows, rows without top-p, hot (high-entropy) rows, planted boundary ties,
NaN rows; TP 1-4, bf16 / fp16, the three pipelines.
"""

from __future__ import annotations

import pytest
import torch

from shardmax.ops.sampled import FallbackReason, SampledVerifyPlan
from shardmax.reference.nucleus_replay import (
    Pipeline,
    PipelineConfig,
)
from shardmax.reference.sampled import verify_sampled
from shardmax.runtime.topp_tables import set_sigma_table
from shardmax.testing.emulate_sampled import emulate_verify
from shardmax.testing.topp_replay import kept_set_reference
from shardmax.testing.traffic import EntropyProfile, realistic_batch

SIGMA = torch.special.ndtri((torch.arange(200, dtype=torch.float64) + 0.5) / 200).float()
"""A stand-in for vLLM's sigma table (kernels and reference read the same one)."""
HOT = EntropyProfile(((0.5, 2.0, 0.5), (2.0, 4.5, 0.5)))
TILE0 = 1024


@pytest.fixture(autouse=True)
def _sigma():
    set_sigma_table(SIGMA.tolist())
    yield
    set_sigma_table(None)


def _batch(vocab: int, dtype: torch.dtype, seed: int, hot: bool, device: str = "cpu"):
    kw = {"profile": HOT} if hot else {}
    b = realistic_batch(8, 3, vocab, seed=seed, dtype=dtype, draft_top_prob=0.6, **kw)
    slots = b.idx_mapping.long()
    b.temperature[slots[1]] = 0.7  # a lower temperature with top-p
    b.temperature[slots[2]] = 0.0  # greedy
    b.top_p[slots[3]] = 1.0  # temperature only
    b.top_p[slots[4]] = 0.8
    b.top_p[slots[5]] = 0.7  # narrow nuclei: drafts and draws outside them
    b.top_p[slots[6]] = 0.6
    b.top_p[slots[7]] = 0.5
    x = b.logits
    row = 4 * 5 + 1  # a tie group of the row's second level across every shard
    second = torch.topk(x[row].float().unique(), 2).values[-1]
    x[row, :: max(1, vocab // 9)] = second.to(dtype)
    if seed % 2:
        x[4 * 5, 17] = float("nan")  # request 5's first row: always used
    if device != "cpu":
        for name in ("logits", "draft_sampled", "cu_num_logits", "pos", "idx_mapping",
                     "expanded_local_pos", "seed", "temperature", "top_p"):  # fmt: skip
            setattr(b, name, getattr(b, name).to(device))
    return b


def _row_slots(b) -> torch.Tensor:
    """The request-state slot of every logits row (rows per request from ``cu_num_logits``)."""
    lens = torch.diff(b.cu_num_logits.cpu().long())
    return torch.repeat_interleave(b.idx_mapping.cpu().long(), lens)


def _oracle(b, config: PipelineConfig, fp64: bool = False) -> list[tuple[torch.Tensor, ...]]:
    """The reference outputs on the masked rows, with the fewest and the most boundary ties."""
    return kept_set_reference(b, config, SIGMA.tolist(), use_fp64_gumbel=fp64)


def _masking_matters(b, outs) -> int:
    """Requests whose reference answer changes when the rows are not masked (the case's power)."""
    x = b.logits.detach().cpu().float()
    slots = _row_slots(b)
    t = b.temperature.cpu()[slots]
    proc = torch.where(t[:, None] == 1.0, x, x / torch.where(t > 0, t, 1.0)[:, None])
    unit = torch.where(b.temperature.cpu() > 0, 1.0, 0.0)
    plain = verify_sampled(
        proc, b.draft_sampled.cpu(), b.cu_num_logits.cpu(), b.pos.cpu(), b.idx_mapping.cpu(),
        b.expanded_local_pos.cpu(), unit, b.seed.cpu(), b.num_speculative_steps,
    )  # fmt: skip
    return int((plain[0] != outs[0][0]).any(dim=1).sum())


def _run(b, tp: int, config: PipelineConfig, fp64: bool = False):
    return emulate_verify(
        b.logits, tp, *b.sampled_args(), top_p=b.top_p, topp=config, use_fp64_gumbel=fp64,
    )  # fmt: skip


def _check(res, outs) -> int:
    """Every unflagged request == both oracles; returns the number of unflagged requests."""
    ok = ~res.fallback.cpu()
    for sampled, num_sampled, num_rejected in outs:
        assert torch.equal(res.sampled.cpu()[ok], sampled[ok])
        assert torch.equal(res.num_sampled.cpu()[ok], num_sampled[ok])
        assert torch.equal(res.num_rejected.cpu()[ok], num_rejected[ok])
    flagged = res.reason.cpu()[~ok]
    assert bool((flagged > 0).all()) and bool((res.reason.cpu()[ok] == 0).all())
    return int(ok.sum())


@pytest.mark.parametrize(
    ("tp", "dtype", "pipeline", "hot", "seed"),
    [
        (2, torch.bfloat16, Pipeline.SPLIT, False, 3),
        (3, torch.bfloat16, Pipeline.MONOLITHIC, True, 2),
        (4, torch.float16, Pipeline.SPLIT_V032, True, 1),
        (1, torch.bfloat16, Pipeline.MONOLITHIC, False, 2),
    ],
)
def test_unflagged_requests_equal_the_reference_on_the_kept_set(tp, dtype, pipeline, hot, seed):
    b = _batch(5003, dtype, seed, hot)
    config = PipelineConfig(pipeline, TILE0)
    res = _run(b, tp, config)
    outs = _oracle(b, config)
    assert _check(res, outs) >= 5  # most requests are answered, not flagged
    assert _masking_matters(b, outs) >= 1  # the kept sets change answers: the case has power
    if seed % 2:  # request 5's first row holds a NaN
        assert res.reason[5] == FallbackReason.NON_FINITE
    assert not bool(res.fallback[3])  # no top-p: nothing to certify
    assert not bool(res.fallback[2])  # the greedy request never needs the kept set


@pytest.mark.parametrize(("k", "lens"), [(1, [1, 2, 2, 1, 2]), (5, [6, 1, 3, 6, 2])])
def test_requests_of_every_length_and_placeholder_drafts(k, lens):
    """K = 1 / 5, requests with fewer drafts (a bonus row alone), -1 placeholder drafts, mixed
    temperatures and top-p per request: unflagged requests == the reference."""
    gen = torch.Generator().manual_seed(k)
    b = realistic_batch(len(lens), k, 1500, seed=20 + k, draft_top_prob=0.7, profile=HOT)
    rows = sum(lens)
    b.logits = b.logits[:rows].contiguous()
    cu = torch.cumsum(torch.tensor([0, *lens]), 0)
    b.cu_num_logits = cu.to(torch.int32)
    b.expanded_local_pos = torch.cat([torch.arange(n) for n in lens]).to(torch.int32)
    b.pos = torch.cat([torch.randint(0, 10**5, (1,), generator=gen) + torch.arange(n)
                       for n in lens]).long()  # fmt: skip
    top = b.logits.float().argmax(1).to(torch.int32)
    d = torch.randint(0, 1500, (rows,), generator=gen, dtype=torch.int32)
    for r, n in enumerate(lens):
        for i in range(n - 1):
            row = int(cu[r]) + i
            d[row + 1] = top[row] if (row % 3) else -1 if (row % 5 == 0) else d[row + 1]
    b.draft_sampled = d
    for j, s in enumerate(b.idx_mapping.long().tolist()):
        b.temperature[s] = (1.0, 0.7, 0.0, 1.3)[j % 4]
        b.top_p[s] = (0.9, 0.5, 0.3, 1.0, 0.6)[j % 5]
    for pipeline in (Pipeline.SPLIT, Pipeline.MONOLITHIC):
        config = PipelineConfig(pipeline, 256)
        res = _run(b, 2, config)
        assert res.sampled.shape == (len(lens), k + 1)
        _check(res, _oracle(b, config))


def test_fp64_gumbel_draws_over_the_kept_set():
    """fp64 Gumbel keys draw the same way over the kept set (vs the fp64 reference)."""
    b = _batch(4099, torch.bfloat16, 6, False)
    config = PipelineConfig(Pipeline.SPLIT, TILE0)
    _check(_run(b, 2, config, fp64=True), _oracle(b, config, fp64=True))


def _planted(rows_values, top_p: float, drafts: int | None, reqs: int = 8, vocab: int = 512):
    """``reqs`` requests (K = 3) whose rows are all ``rows_values`` (a bf16 row), top-p
    ``top_p``; every draft ``drafts`` (else the batch's)."""
    b = realistic_batch(reqs, 3, vocab, seed=11)
    b.logits = rows_values.to(torch.bfloat16).expand(b.logits.shape[0], vocab).contiguous()
    b.top_p[:] = top_p
    if drafts is not None:
        b.draft_sampled[:] = drafts
    return b


def test_a_draft_outside_the_kept_set_is_rejected():
    """Token 1 holds 42 % of the row but top-p 0.4 keeps only token 0 (44 %): unmasked, the
    draft would be accepted about as often as not; over the kept set never."""
    row = torch.full((512,), 0.55)
    row[0], row[1] = 8.0, 7.9375
    b = _planted(row, 0.4, drafts=1, reqs=4)
    config = PipelineConfig(Pipeline.SPLIT, TILE0)
    res = _run(b, 2, config)
    outs = _oracle(b, config)
    assert _check(res, outs) == 4
    assert _masking_matters(b, outs) >= 2
    assert bool((res.num_sampled == 1).all()) and bool((res.sampled[:, 0] == 0).all())


@pytest.mark.parametrize("pipeline", [Pipeline.SPLIT, Pipeline.MONOLITHIC])
def test_boundary_ties_are_flagged_not_guessed(pipeline):
    """Top-p ends inside a level of 100 tied tokens (29 of them needed): a draw whose best key
    is one of those ties flags TOPP_TIE (which ties vLLM keeps is not known here); unflagged
    requests drew the top token or a tie below ... never a guess."""
    row = torch.full((512,), 0.55)
    row[0] = 8.0
    row[100:200] = 4.0
    b = _planted(row, 0.5, drafts=None, reqs=4)
    config = PipelineConfig(pipeline, TILE0)
    res = _run(b, 2, config)
    assert _check(res, _oracle(b, config)) >= 1  # flagged and unflagged requests both
    assert int((res.reason == FallbackReason.TOPP_TIE).sum()) >= 2


def test_plan_refuses_what_it_does_not_reproduce():
    from shardmax.testing.emulate import emulated_ranks

    x = torch.zeros(8, 64, dtype=torch.float32)
    _, ctxs = emulated_ranks(x, 2, None)
    config = PipelineConfig(Pipeline.SPLIT, TILE0)
    with pytest.raises(ValueError, match="bf16 / fp16"):
        SampledVerifyPlan(ctxs[0], 8, 32, topp=config)
    xb = x.to(torch.bfloat16)
    _, ctxs = emulated_ranks(xb, 2, None)
    with pytest.raises(ValueError, match="fast mode only"):
        SampledVerifyPlan(ctxs[0], 8, 32, mode="strict", topp=config)
    with pytest.raises(ValueError, match="no candidates"):
        SampledVerifyPlan(ctxs[0], 8, 32, with_candidates=True, topp=config)
    with pytest.raises(TypeError, match="PipelineConfig"):
        SampledVerifyPlan(ctxs[0], 8, 32, topp=Pipeline.SPLIT)  # type: ignore[arg-type]
    set_sigma_table(None)
    import shardmax.runtime.topp_tables as tables

    tables._looked_up = True  # no vLLM importable here: the lookup would find none
    try:
        with pytest.raises(ValueError, match="sigma table"):
            SampledVerifyPlan(ctxs[0], 8, 32, topp=PipelineConfig(Pipeline.MONOLITHIC, TILE0))
    finally:
        tables._looked_up = False
    b = realistic_batch(2, 3, 64, seed=1)
    b.logits = xb
    plan = SampledVerifyPlan(ctxs[0], 8, 32, topp=config)
    with pytest.raises(ValueError, match="level histograms"):
        plan.run(xb[:, :32], _step(b, top_k=torch.ones(5, dtype=torch.int32)))


def _step(b, **kw):
    from shardmax.runtime.validation import check_step_batch

    args = dict(temperature=b.temperature, top_p=b.top_p)
    args.update(kw)
    return check_step_batch(
        b.logits.shape[0], b.logits.device, b.draft_sampled, b.cu_num_logits, b.pos,
        b.idx_mapping, b.expanded_local_pos, b.seed, b.num_speculative_steps, None, None, None,
        **args,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# GPU (H200): vLLM's own chain as the oracle
# --------------------------------------------------------------------------------------------

_GPU_CASES = [  # (requests, vocab, tp): 32 and 160 logits rows = split / monolithic pipelines
    (8, 151936, 2),
    (8, 200064, 8),
    (40, 151936, 4),
    (40, 200064, 2),
]


def _same_as_vllm(res, whole, reqs: torch.Tensor, what) -> None:
    """``==`` on the counts and the defined tokens (columns < num_sampled) of ``reqs``."""
    num = res.num_sampled.cpu()[reqs]
    assert torch.equal(num, whole[1].cpu().to(num.dtype)[reqs]), what
    assert torch.equal(res.num_rejected.cpu()[reqs], whole[2].cpu().to(num.dtype)[reqs]), what
    cols = torch.arange(res.sampled.shape[1])[None, :] < num[:, None]
    got, want = res.sampled.cpu()[reqs], whole[0].cpu().to(torch.int64)[reqs]
    assert torch.equal(got[cols], want[cols]), what


@pytest.mark.gpu
@pytest.mark.parametrize("case", _GPU_CASES, ids=[f"{r}req-V{v}-tp{t}" for r, v, t in _GPU_CASES])
def test_topp_steps_equal_vllm_on_gpu(case) -> None:
    """``$SHARDMAX_TOPP_GPU_SEEDS`` realistic T = 1 / top-p 0.95 steps per case (default 6):
    every carried vLLM chain verifies the whole step; shardmax verifies it from level histograms
    with that version's pipeline for the step's row count, twice (bit-compared); every unflagged
    request equals vLLM's, and with the flagged ones resolved from their own rows
    (:meth:`NativeChain.verify_requests`) the whole step does."""
    import os

    from shardmax.ops.resolve import flagged_requests, resolve_requests
    from shardmax.reference.nucleus_replay import pipeline_for
    from shardmax.testing.replayed import full_rows
    from shardmax.testing.vllm_chain import NativeChain, verify_inputs
    from tests._twice import twice

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    chains = NativeChain.discover()
    if not chains:
        pytest.skip("no vLLM chain tree (scripts/vllm_sources.sh)")
    num_reqs, vocab, tp = case
    seeds = int(os.environ.get("SHARDMAX_TOPP_GPU_SEEDS", "6"))
    flagged: dict[str, int] = {}
    reasons: dict[str, int] = {}
    for seed in range(seeds):
        b = realistic_batch(num_reqs, 3, vocab, seed=seed, mix="top_p", device="cuda")
        kw = verify_inputs(b)
        rows = b.logits.shape[0]
        for chain in chains:
            set_sigma_table(list(chain.modules.topk_topp._NORMAL_CDF_TO_SIGMA_TABLE))
            whole = chain.verify(b.logits, **kw)
            config = pipeline_for(rows, "cuda", chain.version)
            res = twice(_run, b, tp, config)
            what = (chain.version, case, seed)
            _same_as_vllm(res, whole, ~res.fallback.cpu(), what)  # unflagged: vLLM's answers
            req, codes = flagged_requests(res)
            resolve_requests(res, req, full_rows(b.logits), chain, kw)
            _same_as_vllm(res, whole, torch.ones(num_reqs, dtype=torch.bool), what)
            flagged[chain.version] = flagged.get(chain.version, 0) + int(req.size)
            for c in codes:
                name = FallbackReason(int(c)).name
                reasons[name] = reasons.get(name, 0) + 1
    total = num_reqs * seeds
    for version, n in sorted(flagged.items()):
        print(f"[topp gpu] vLLM {version} {case}: {n}/{total} requests flagged (resolved), "
              f"0 of {total} differ; reasons {reasons}")  # fmt: skip
