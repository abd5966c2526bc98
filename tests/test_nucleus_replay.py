"""The top-p replay (:mod:`shardmax.reference.nucleus_replay`) and its sharded histograms
(:mod:`shardmax.reference.nucleus_shards`).

Default suite: level keys, the exact merge of per-rank histograms (real vocabularies, TP
1/2/3/4/8, ties across shard edges, empty and non-finite shards), saturation, errors.
``e2e`` (vLLM's own top-p kernels from the extracted trees, under the interpreter): every kept set
the replay certifies contains vLLM's mask -- the monolithic kernel (vLLM-CPU's launch: 256-wide
first tile), and the split pipeline of 0.33 and 0.32 called directly -- and on realistic steps,
every certified request's tokens and counts ``==`` vLLM's chain. The CUDA launches (8192-wide
tiles, the split pipeline chosen by vLLM itself) are checked by ``benchmarks.topp_replay`` on the
H200.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from shardmax.reference import nucleus_replay as nr
from shardmax.reference.nucleus_shards import (
    RECORD_BYTES,
    merge_shard_histograms,
    shard_histogram,
)
from shardmax.runtime import topp_tables
from shardmax.testing.shards import vllm_shard_ranges
from shardmax.testing.topp_replay import kept_set_violation
from shardmax.testing.traffic import lm_logits, realistic_batch
from shardmax.testing.vllm_chain import NativeChain, _interpreter_loop_tensors, verify_inputs

CHAINS = NativeChain.discover()
by_version = pytest.mark.parametrize("chain", CHAINS, ids=[c.id for c in CHAINS])


# --------------------------------------------------------------------------------------------
# level keys and the merge
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_level_keys_order_and_inverse(dtype: torch.dtype) -> None:
    v = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    keys = nr.level_keys(v)
    x = v.float()
    fin = torch.isfinite(x)
    assert bool((torch.from_numpy(nr.level_values(dtype))[keys[fin].long()] == x[fin]).all())
    order = torch.argsort(x[fin], stable=True)
    k = keys[fin][order]
    xs = x[fin][order]
    assert bool((k[1:] >= k[:-1]).all())
    assert bool(((k[1:] == k[:-1]) == (xs[1:] == xs[:-1])).all())  # equal keys <=> equal values
    z = torch.tensor([0.0, -0.0], dtype=dtype)
    assert int(nr.level_keys(z)[0]) == int(nr.level_keys(z)[1])
    with pytest.raises(TypeError, match="bf16 / fp16"):
        nr.level_keys(torch.zeros(3))


def _tps(vocab: int) -> list[int]:
    """TP sizes vLLM accepts for ``vocab`` (its padded vocabulary divisible by TP)."""
    padded = -(-vocab // 64) * 64
    return [tp for tp in (1, 2, 3, 4, 8) if padded % tp == 0]


def _planted_rows(vocab: int, tp: int, dtype: torch.dtype) -> torch.Tensor:
    rows = lm_logits(6, vocab, seed=vocab + tp, dtype=dtype).clone()
    edges = [s for s, _n, _w in vllm_shard_ranges(vocab, tp)][1:] or [vocab // 2]
    e = edges[0]
    top = rows[0].float().max()
    rows[0, e - 1] = top  # a tie at the row max across a shard edge
    rows[0, e] = top
    rows[1, : min(vocab, 300)] = rows[1].max()  # a block of ties at the top
    rows[2, e:] = float("-inf")  # whole shards without a finite value
    rows[3, 7] = -0.0
    rows[3, 8] = 0.0
    return rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [50257, 128256, 151936, 200064, 262144])
def test_shard_histograms_merge_to_the_full_row(vocab: int, dtype: torch.dtype) -> None:
    rows = _planted_rows(vocab, _tps(vocab)[-1], dtype)
    # the full row's histogram does not depend on TP: computed once per row and temperature
    full = {(t, i): nr.level_histogram(rows[i], t) for t in (1.0, 0.7) for i in range(len(rows))}
    for tp in _tps(vocab):
        for t in (1.0, 0.7):
            for i in range(rows.shape[0]):
                parts = [
                    shard_histogram(rows[i, s : s + n], s, t)
                    for s, n, _w in vllm_shard_ranges(vocab, tp)
                ]
                got = merge_shard_histograms(parts, dtype, t)
                want = full[t, i]
                assert got is not None
                assert got.top_key == want.top_key
                assert np.array_equal(got.counts, want.counts)
                assert np.array_equal(got.values, want.values)
                assert got.m == want.m and got.min_value == want.min_value
                assert math.isclose(got.z, want.z, rel_tol=1e-12)
                assert math.isclose(got.tail, want.tail, rel_tol=1e-9, abs_tol=1e-15)
                assert math.isclose(got.tile0_mean, want.tile0_mean, rel_tol=1e-9, abs_tol=1e-12)
                assert math.isclose(got.tile0_std, want.tile0_std, rel_tol=1e-6, abs_tol=1e-9)


def test_non_finite_rows_are_not_histograms() -> None:
    row = lm_logits(1, 4096, seed=0)[0].clone()
    row[5] = float("nan")
    parts = [shard_histogram(row[s : s + n], s) for s, n, _w in vllm_shard_ranges(4096, 2)]
    assert merge_shard_histograms(parts, row.dtype) is None
    row[5] = float("inf")
    parts = [shard_histogram(row[s : s + n], s) for s, n, _w in vllm_shard_ranges(4096, 2)]
    assert merge_shard_histograms(parts, row.dtype) is None
    dead = torch.full((4096,), float("-inf"), dtype=torch.bfloat16)
    parts = [shard_histogram(dead[s : s + n], s) for s, n, _w in vllm_shard_ranges(4096, 2)]
    assert merge_shard_histograms(parts, dead.dtype) is None
    with pytest.raises(ValueError, match="no finite value"):
        nr.level_histogram(dead)
    with pytest.raises(ValueError, match="none"):
        merge_shard_histograms([], torch.bfloat16)


def test_saturated_counts_are_flagged() -> None:
    row = torch.ones(70_000, dtype=torch.bfloat16)
    row[:2] = torch.tensor([1.015625, 1.0078125])  # the next bf16 levels above 1
    h = nr.level_histogram(row)
    assert h.saturated
    cfg = nr.PipelineConfig(nr.Pipeline.SPLIT)
    assert nr.replay(h, 0.95, cfg).reason == nr.ReplayReason.SATURATED
    parts = [shard_histogram(row, 0)]
    merged = merge_shard_histograms(parts, row.dtype)
    assert merged is not None and merged.saturated
    assert RECORD_BYTES == 1056


def test_errors() -> None:
    h = nr.level_histogram(lm_logits(1, 1024, seed=1)[0])
    split = nr.PipelineConfig(nr.Pipeline.SPLIT)
    for p in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="top_p"):
            nr.replay(h, p, split)
    with pytest.raises(ValueError, match="device_type"):
        nr.pipeline_for(8, "xpu")
    with pytest.raises(ValueError, match="vllm_version"):
        nr.pipeline_for(8, "cuda", "0.31")
    assert nr.pipeline_for(64, "cuda").pipeline == nr.Pipeline.SPLIT
    assert nr.pipeline_for(64, "cuda", "0.32.0").pipeline == nr.Pipeline.SPLIT_V032
    assert nr.pipeline_for(65, "cuda").pipeline == nr.Pipeline.MONOLITHIC
    assert nr.pipeline_for(8, "cpu") == nr.PipelineConfig(nr.Pipeline.MONOLITHIC, 256)
    assert nr.pipeline_for(8, "cuda", topp_only=False).pipeline == nr.Pipeline.MONOLITHIC
    with pytest.raises(ValueError, match="levels"):
        nr.level_histogram(lm_logits(1, 64, seed=0)[0], levels=100)
    with pytest.raises(ValueError, match="not certified"):
        nr.kept_masks(torch.zeros(4), nr.KeptSet(nr.ReplayReason.MASS_MARGIN), 0)


def test_monolithic_replay_needs_vllms_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(topp_tables, "_table", None)
    monkeypatch.setattr(topp_tables, "_looked_up", True)
    h = nr.level_histogram(lm_logits(1, 1024, seed=1)[0])
    with pytest.raises(ValueError, match="_NORMAL_CDF_TO_SIGMA_TABLE"):
        nr.replay(h, 0.9, nr.PipelineConfig(nr.Pipeline.MONOLITHIC, 256))
    with pytest.raises(ValueError, match="200 finite"):
        topp_tables.set_sigma_table([1.0] * 3)


def test_kept_set_violation_catches_each_rule() -> None:
    """The oracle comparison itself: each way a mask can break a kept set is reported."""
    row = torch.tensor([3.0, 2.0, 2.0, 2.0, 1.0, float("-inf")], dtype=torch.bfloat16)
    top = int(nr.level_keys(row).max())
    two = top - int(nr.level_keys(torch.tensor([2.0], dtype=torch.bfloat16))[0])
    k = nr.KeptSet(nr.ReplayReason.OK, False, two, 1, 2, 3)
    mask = torch.tensor([True, True, True, False, False, False])
    assert kept_set_violation(row, mask, k, top) is None
    bad = {
        "above the boundary dropped": [False, True, True, False, False, False],
        "below the boundary kept": [True, True, True, False, True, False],
        "not in [1, 2]": [True, True, True, True, False, False],
        "id order": [True, False, True, False, False, False],
    }
    for why, m in bad.items():
        got = kept_set_violation(row, torch.tensor(m), k, top)
        assert got is not None and why in got, (why, got)
    unordered = nr.KeptSet(nr.ReplayReason.OK, False, two, 1, 2, 3, ties_ordered=False)
    assert kept_set_violation(row, torch.tensor(bad["id order"]), unordered, top) is None
    nomask = nr.KeptSet(nr.ReplayReason.OK, nomask=True)
    assert kept_set_violation(row, torch.tensor([True] * 5 + [False]), nomask, top) is None
    assert kept_set_violation(row, torch.tensor([True] * 4 + [False] * 2), nomask, top)


# --------------------------------------------------------------------------------------------
# against vLLM's kernels (interpreter)
# --------------------------------------------------------------------------------------------


def _tie_rows(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Rows of few distinct values: wide tie groups at every boundary."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 12, (rows, vocab), generator=g) * 0.5).to(torch.bfloat16)


def _vllm_kept(chain: NativeChain, x: torch.Tensor, p: torch.Tensor, split: bool) -> torch.Tensor:
    mod = chain.modules.topk_topp
    x = x.clone()
    with _interpreter_loop_tensors():
        if split:
            mod._apply_topp_split(x, None, p, float("-inf"), 132)
            out = x
        else:
            old = mod._SPLIT_MAX_BATCH
            mod._SPLIT_MAX_BATCH = 0
            try:
                out = mod.apply_top_k_top_p_triton(x, None, p)
            finally:
                mod._SPLIT_MAX_BATCH = old
    return out != float("-inf")


def _check_contains(raw: torch.Tensor, vllm_kept: torch.Tensor, p: float, temp: float,
                    cfg: nr.PipelineConfig, table: list[float]) -> tuple[int, int]:  # fmt: skip
    """Every certified row: vLLM's mask is above-boundary + a tie prefix within the range."""
    certified = ranged = 0
    for i in range(raw.shape[0]):
        h = nr.level_histogram(raw[i], temp, tile0=cfg.tile0)
        k = nr.replay(h, p, cfg, table)
        if k.reason != nr.ReplayReason.OK:
            continue
        certified += 1
        ranged += not k.certain_ties
        why = kept_set_violation(raw[i], vllm_kept[i], k, h.top_key)
        assert why is None, f"row {i}: {why}; replay {k}"
    return certified, ranged


@pytest.mark.e2e
@by_version
def test_replay_contains_vllm_monolithic(chain: NativeChain) -> None:
    table = [float(v) for v in chain.modules.topk_topp._NORMAL_CDF_TO_SIGMA_TABLE]
    cfg = nr.PipelineConfig(nr.Pipeline.MONOLITHIC, 256)  # vLLM-CPU's launch
    biased = torch.full((512,), -20.0)  # a -100 bias on half the first tile: std 40
    biased[:128] = -100.0
    biased[300:310] = torch.linspace(6.0, 3.0, 10)
    masked0 = lm_logits(1, 512, seed=8)[0].float()
    masked0[:256] = float("-inf")  # first tile all -inf: vLLM's max_sample is 0
    normalizer = torch.stack([biased, lm_logits(1, 512, seed=3)[0].float(), masked0])
    cases = [
        (lm_logits(40, 2048, seed=11), 0.95, 1.0),
        # vLLM's exp(x - max_sample) overflows / underflows: no mask in vLLM, flagged here
        (normalizer[:1].to(torch.bfloat16), 0.9, 1.0),
        (normalizer[1:2].to(torch.bfloat16), 0.9, 0.1),
        (normalizer[2:].to(torch.bfloat16), 0.9, 0.2),
        (lm_logits(12, 2048, seed=12, dtype=torch.float16), 0.9, 1.0),
        (lm_logits(12, 2048, seed=13), 0.8, 0.7),
        (_tie_rows(16, 1024, 14), 0.95, 1.0),
    ]
    certified = ranged = total = 0
    for raw, p, t in cases:
        x = raw.float() if t == 1.0 else raw.float() / torch.tensor(t)
        kept = _vllm_kept(chain, x, torch.full((raw.shape[0],), p), split=False)
        c, r = _check_contains(raw, kept, p, t, cfg, table)
        certified, ranged, total = certified + c, ranged + r, total + raw.shape[0]
    # a coverage floor (correctness is the containment above): the 256-wide CPU tile bounds the
    # fp32 error of the outlier threshold loosely, so fewer rows certify than with 8192
    assert certified >= 0.7 * (total - 3) and ranged > 0, (certified, ranged, total)


@pytest.mark.e2e
@by_version
def test_replay_contains_vllm_split(chain: NativeChain) -> None:
    cfg = nr.pipeline_for(8, "cuda", chain.version)
    raw = torch.cat([lm_logits(6, 16384, seed=21), _tie_rows(2, 16384, 22)])
    kept = _vllm_kept(chain, raw.float(), torch.full((8,), 0.95), split=True)
    certified, _ = _check_contains(raw, kept, 0.95, 1.0, cfg, [])
    assert certified >= 6


@pytest.mark.e2e
@by_version
def test_certified_requests_equal_vllms_chain(chain: NativeChain) -> None:
    from shardmax.testing.topp_replay import replay_step

    table = [float(v) for v in chain.modules.topk_topp._NORMAL_CDF_TO_SIGMA_TABLE]
    cfg = nr.PipelineConfig(nr.Pipeline.MONOLITHIC, 256)
    b = realistic_batch(20, 3, 3000, seed=5)
    want = chain.verify(b.logits, **verify_inputs(b))
    step = replay_step(b, 2, cfg, sigma_table=table)
    assert int(step.request_ok.sum()) >= 16
    for r in np.flatnonzero(step.request_ok.numpy()):
        n = int(want.num_sampled[r])
        assert n == int(step.outputs[1][r]) and int(want.num_rejected[r]) == int(step.outputs[2][r])
        assert torch.equal(want.sampled[r, :n].cpu(), step.outputs[0][r, :n]), f"request {r}"
    # the mask matters on this traffic: without it some request would differ
    free = realistic_batch(20, 3, 3000, seed=5)
    free.top_p = None
    unmasked = chain.verify(free.logits, **verify_inputs(free))
    assert not torch.equal(unmasked.num_sampled.cpu(), want.num_sampled.cpu()) or not all(
        torch.equal(
            unmasked.sampled[r, : int(want.num_sampled[r])],
            want.sampled[r, : int(want.num_sampled[r])],
        )
        for r in range(20)
    )


@pytest.mark.e2e
def test_topp_replay_benchmark_writes_its_files(tmp_path) -> None:
    """``benchmarks.topp_replay`` end to end on a tiny CPU case (no oracle off CUDA)."""
    if not any(c.version.startswith("0.33") for c in CHAINS):
        pytest.skip("needs vLLM 0.33's extracted tree (its sigma table)")
    pytest.importorskip("matplotlib")
    from benchmarks import topp_replay

    topp_replay.main(["--out", str(tmp_path), "--steps", "1", "--vocab", "4096", "--reqs", "4",
                      "--tp", "2", "4", "--workers", "1"])  # fmt: skip
    rows = (tmp_path / "topp_replay.csv").read_text().splitlines()
    assert len(rows) == 3 and rows[0].startswith("vocab,tp,rows")
    assert (tmp_path / "topp_replay.png").stat().st_size > 0
    assert "| 4096 | 4 | 16 | split |" in (tmp_path / "TOPP_REPLAY.md").read_text()
