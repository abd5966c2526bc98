"""The sampled record kernel's launch: dispatcher op ``sampled``, C per step, its tuner op.

CPU only (Triton interpreter, small vocabularies). Sections: 1. dispatch (built-in default,
tables, validation, overrides, warmup); 2. the public op runs the selected C (top-k capacity
moves with it, outputs == the reference); 3. the tuner's space, gate (including a planted fault
it must reject) and a tiny CLI sweep.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from shardmax.tuner import export
from shardmax.tuner.__main__ import main as tuner_main
from shardmax.tuner.problems import Bucket, buckets, shard_width
from shardmax.tuner.sampled import REQUEST_KINDS, SampledRunner
from shardmax.tuner.space import DEFAULT_TOP_K_MAX, Config, candidates, default_config

import shardmax
import shardmax.runtime.dispatch as dispatch
import shardmax.testing.emulate_sampled as emulate_sampled
from shardmax.ops.sampled import (
    CANDIDATE_CHOICES,
    TOPK_CANDIDATES,
    FallbackReason,
    candidate_capacity,
    record_launch,
    selection_groups,
)
from shardmax.ops.warmup import warmup
from shardmax.reference.sampled import verify_sampled
from shardmax.runtime.dispatch import Problem, validate_table
from shardmax.testing import random_verify_batch

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU tests run the kernels under TRITON_INTERPRET=1",
)


@pytest.fixture(autouse=True)
def _fresh_dispatch():
    dispatch.select.cache_clear()
    dispatch.load_table.cache_clear()
    yield
    dispatch.select.cache_clear()
    dispatch.load_table.cache_clear()


def _sampled_table(rows: list[dict]) -> dict:
    return {"schema": 1, "arch": "sm90", "op": "sampled", "tuned": True,
            "provenance": {"manifest_hash": "x"}, "rows": rows}  # fmt: skip


def _row(match: dict, variant: str = "sampled_record_bf16_b1024", **launch) -> dict:
    base = {"splits": 4, "num_warps": 8, "candidates": 128, "transport": "allgather"}
    return {"match": match, "variant": variant, "launch": {**base, **launch}}


# ------------------------------------------------------------------------------ 1. dispatch
def test_builtin_default_and_cpu_selection():
    sel = dispatch.select(Problem("sampled", "fp16", 2, 1, 100032, 16))
    assert sel.variant == "sampled_record_fp16_b2048" and sel.source == "builtin"
    assert (sel.splits, sel.candidates, sel.launch["num_warps"]) == (1, 64, 4)  # CPU: 1 split
    gpu = dispatch.builtin_default(Problem("sampled", "bf16", 2, 1, 100032, 16))
    assert (gpu.splits, gpu.candidates) == (16, TOPK_CANDIDATES)  # >= 2 tiles per split
    assert dispatch.builtin_default(Problem("sampled", "bf16", 2, 512, 100032, 16)).splits == 1
    launch = record_launch(torch.bfloat16, 2, 3, 1504)
    assert launch.variant == "sampled_record_bf16_b2048" and launch.candidates == 64
    assert (candidate_capacity(64), selection_groups(64)) == (256, 128)


def test_sampled_table_rows_resolve(tmp_path, monkeypatch):
    table = _sampled_table([
        _row({"dtype": "bf16", "tp": 2, "align": 16, "rows_le": 4, "width_le": 75968}),
        _row({}, "sampled_record_bf16_b2048", splits=1, num_warps=4, candidates=64),
    ])  # fmt: skip
    validate_table(table)
    (tmp_path / "sm90").mkdir()
    (tmp_path / "sm90" / "sampled.json").write_text(json.dumps(table))
    monkeypatch.setenv("SHARDMAX_TABLES_DIR", str(tmp_path))
    sel = dispatch.select(Problem("sampled", "bf16", 2, 3, 75968, 16, arch="sm90"))
    assert sel.variant == "sampled_record_bf16_b1024" and sel.is_tuned
    assert (sel.splits, sel.candidates, sel.launch["num_warps"]) == (4, 128, 8)
    # another dtype lands on the catch-all, adapted to that dtype's variant, not a tuned claim
    fp32 = dispatch.select(Problem("sampled", "fp32", 2, 3, 75968, 16, arch="sm90"))
    assert fp32.variant == "sampled_record_fp32_b2048" and not fp32.is_tuned
    # a narrow shard clamps the splits to its tiles
    narrow = dispatch.select(Problem("sampled", "bf16", 2, 3, 2048, 16, arch="sm90"))
    assert narrow.splits == 2
    tail = dispatch.select(Problem("sampled", "bf16", 2, 64, 75968, 16, arch="sm90"))
    assert tail.candidates == 64 and not tail.is_tuned  # the catch-all


@pytest.mark.parametrize(
    ("row", "msg"),
    [
        (_row({}, candidates=48), "candidates must be one of"),
        (_row({}, candidates=True), "candidates must be one of"),
        (_row({}, "shard_keys_bf16_va16_b4096"), r"is not a sampled_record_\* variant"),
        ({"match": {}, "variant": "sampled_record_bf16_b1024",
          "launch": {"splits": 1, "num_warps": 4, "transport": "allgather"}}, "launch lacks"),
        ({"match": {}, "variant": "plain", "launch": {}}, "no plain path"),
    ],
)  # fmt: skip
def test_sampled_table_validation(row, msg):
    with pytest.raises(ValueError, match=msg):
        validate_table(_sampled_table([row]))
    with (
        pytest.raises(ValueError, match="candidates must be one of"),
        dispatch.override(candidates=100),
    ):
        pass


def test_warmup_launches_the_record_kernel():
    names = warmup(
        [Problem("sampled", "bf16", 2, 2, 1504, 16)], num_speculative_steps=(3,), device="cpu"
    )
    v = "sampled_record_bf16_b2048"
    assert names == [f"{v}[K=3]", f"{v}[K=3,C]", f"{v}[K=3,fp64]", f"{v}[K=3,fp64,C]"]


# ------------------------------------------------------------------------------ 2. public op
def _topk_batch(vocab: int, ks: list[int], seed: int):
    gen = torch.Generator().manual_seed(seed)
    n = len(ks)
    logits = torch.randn(n * 4, vocab, generator=gen) * 3.0
    batch = random_verify_batch(n, 3, vocab, seed=seed, logits=logits, prefill_prob=0.0)
    temp = torch.ones(batch.max_num_reqs)
    top_k = torch.zeros(batch.max_num_reqs, dtype=torch.int64)
    for i, k in enumerate(ks):
        top_k[int(batch.idx_mapping[i])] = k
    return batch, temp, top_k


@pytest.mark.parametrize("c", CANDIDATE_CHOICES)
def test_public_op_runs_the_selected_candidates(c):
    """``sharded_verify`` takes C from the dispatcher: top-k ``C - 1`` runs sharded (== the
    reference unless flagged for another reason), top-k ``C`` comes back TOPK_CAPACITY."""
    vocab = 1500
    ks = [c - 1, c, 20, c - 1]
    batch, temp, top_k = _topk_batch(vocab, ks, seed=c)
    a = batch.args()
    kw = dict(batch.kwargs(), top_k=top_k)
    with dispatch.override(candidates=c):
        got = shardmax.sharded_verify(batch.logits, *a[:5], temp, *a[5:], vocab_start=0, **kw)
    want = verify_sampled(batch.logits, *a[:5], temp, *a[5:], **kw)
    reason = got.reason.tolist()
    assert reason[1] == FallbackReason.TOPK_CAPACITY
    assert FallbackReason.TOPK_CAPACITY not in (reason[0], reason[2], reason[3])
    ok = ~got.fallback
    assert int(ok.sum()) >= 2
    for g, w in zip(got[:3], want, strict=True):
        assert torch.equal(g[ok], w[ok])
    dec = shardmax.can_shard_verify(
        temperatures=[1.0] * 4, top_k=ks, vocab_size=vocab, allow_temperature=True,
        allow_top_k=True, candidates=c,
    )  # fmt: skip
    assert not dec.ok and f"top_k[1]={c} >= {c}" in str(dec.reason)


def test_candidates_do_not_change_unflagged_outputs():
    """The same top-k / top-p batch under C = 32 / 64 / 128: requests no C flags give the same
    tokens and counts under every C."""
    batch, temp, top_k = _topk_batch(2003, [20, 0, 5, 20, 0, 30], seed=5)
    top_p = torch.full((batch.max_num_reqs,), 0.9)
    a = batch.args()
    kw = dict(batch.kwargs(), top_k=top_k, top_p=top_p)
    outs = []
    for c in CANDIDATE_CHOICES:
        with dispatch.override(candidates=c):
            outs.append(shardmax.sharded_verify(batch.logits, *a[:5], temp, *a[5:], vocab_start=0,
                                                **kw))  # fmt: skip
    ok = ~(outs[0].fallback | outs[1].fallback | outs[2].fallback)
    assert int(ok.sum()) >= 3
    for o in outs[1:]:
        for g, w in zip(o[:3], outs[0][:3], strict=True):
            assert torch.equal(g[ok], w[ok])


# ------------------------------------------------------------------------------ 3. tuner
def test_sampled_space():
    quick = buckets("sampled", quick=True)
    assert len(quick) == 12 and {x.vocab for x in quick} == {151936}  # one vocabulary
    b = next(x for x in quick if x.tp == 8 and x.rows_le == 1)
    cs = candidates(b, "sm90", quick=True)
    assert cs and all(c.is_sampled and c.candidates > DEFAULT_TOP_K_MAX for c in cs)
    assert {c.candidates for c in cs} == {64, 128}
    assert {c.num_warps for c in cs} == {4, 8}
    assert all(c.splits == 1 or c.splits * c.block <= 2 * b.width for c in cs)
    assert {c.candidates for c in candidates(b, "sm90", quick=True, top_k_max=31)} == {32, 64, 128}
    with pytest.raises(ValueError, match="top_k_max"):
        candidates(b, "sm90", top_k_max=128)
    # gfx950: no record tile spills in the AOT report at the quick warps; all are kept
    assert {c.block for c in candidates(b, "gfx950", quick=True)} == {1024, 2048, 4096}
    for bad in ("rec_b2048_w4_x8_c0", "rec_b2048_w4_x8_c48", "rec_b0_w4_x1_c64"):
        with pytest.raises(ValueError, match="config"):
            Config.parse(bad)
    for c in cs[:5]:
        assert Config.parse(c.name) == c
        sel = c.selection(b.dtype, b.align)
        assert Config.from_selection(sel) == c
        assert sel.variant.startswith("sampled_record_bf16_b")
    d = default_config(b)
    assert d.is_sampled and d.candidates == 64 and d.name.startswith("rec_b2048_w4_x")
    rows = export.portable_rows("gfx950", "sampled")
    validate_table(_sampled_table(rows))


def _tiny_bucket(rows: int = 4) -> Bucket:
    return Bucket("sampled", "bf16", 2, 16, shard_width(3000, 2), rows, 3000)


def test_sampled_gate_accepts_and_rejects(monkeypatch):
    runner = SampledRunner(_tiny_bucket(), torch.device("cpu"))
    assert len(REQUEST_KINDS) == 10
    assert runner.gate(Config(1024, 4, 0, 2, "allgather", 32), seed=3) is None
    assert runner.gate(Config(2048, 4, 0, 1, "allgather", 128), seed=4) is None
    import shardmax.ops.sampled as sm

    real = sm.merge_candidates

    def stale_c(*args, **kwargs):  # the merge reads as if C were 64, whatever the records hold
        return real(*args, **{**kwargs, "candidates": 64})

    monkeypatch.setattr(sm, "merge_candidates", stale_c)
    # The stale merge reads records laid out for C = 128 as if they held 64, so what it picks up
    # past the written candidates is whatever that memory holds: the rejection may be a differing
    # token, a missing TOPK_CAPACITY flag or a request it should decide coming back flagged.
    # Which one varies from run to run (CI saw the third); that the config is rejected does not.
    why = runner.gate(Config(1024, 4, 0, 1, "allgather", 128), seed=3)
    assert why is not None
    assert any(s in why for s in ("differ", "TOPK_CAPACITY", "came back flagged", "error")), why
    with pytest.raises(ValueError, match="one GPU"):
        SampledRunner(_tiny_bucket(), torch.device("cpu"), dist=object())  # type: ignore[arg-type]


def test_sampled_cli_sweep(tmp_path, capsys):
    pytest.importorskip("optuna")
    out = tmp_path / "out"
    argv = ["--op", "sampled", "--tp", "2", "--rows", "1", "--n-trials", "1", "--no-progress",
            "--no-plot", "--studies-dir", str(tmp_path / "s"), "--out", str(out), "--write-table",
            "--top-k-max", "64"]  # fmt: skip
    assert tuner_main(argv) == 0
    table = json.loads((out / "sm90" / "sampled.json").read_text())
    validate_table(table)
    assert table["tuned"] is False and table["op"] == "sampled"
    row = table["rows"][0]
    assert row["variant"].startswith("sampled_record_bf16_b")
    # the packaged table's row for this bucket (C = 64) is outside --top-k-max 64: never kept
    assert row["launch"]["candidates"] == 128 and not row["kept_incumbent"]
    assert tuner_main(["--op", "sampled", "--distributed", "--no-progress"]) == 2
    assert "one GPU" in capsys.readouterr().err
    for bad in ("128", "-1"):
        assert tuner_main(["--op", "sampled", "--top-k-max", bad, "--no-progress"]) == 2
        assert "--top-k-max must be in [0, 127]" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kw", "msg"),
    [({"align": 8}, "align"), ({"dtype": "int8"}, "dtype"), ({"tp": 0}, "tp=0"),
     ({"width": 0}, "width=0"), ({"rows": -1}, "rows=-1"), ({"op": "topk"}, "op")],
)  # fmt: skip
def test_problem_rejects_bad_fields(kw, msg):
    base = {"op": "sampled", "dtype": "bf16", "tp": 2, "rows": 4, "width": 1504, "align": 16}
    with pytest.raises(ValueError, match=msg):
        Problem(**{**base, **kw})


def _write(tmp_path, arch: str, op: str, table: dict) -> None:
    (tmp_path / arch).mkdir(exist_ok=True)
    (tmp_path / arch / f"{op}.json").write_text(json.dumps(table))


def test_table_must_hold_the_op_and_arch_its_path_names(tmp_path):
    _write(tmp_path, "sm90", "verify", _sampled_table([_row({})]))
    with pytest.raises(ValueError, match=r"holds op 'sampled' .* path says op 'verify'"):
        dispatch.load_table(tmp_path / "sm90" / "verify.json")
    _write(tmp_path, "gfx950", "sampled", _sampled_table([_row({})]))
    with pytest.raises(ValueError, match=r"for arch 'sm90', but its path says .* 'gfx950'"):
        dispatch.load_table(tmp_path / "gfx950" / "sampled.json")


@pytest.mark.parametrize(
    ("change", "msg"),
    [
        (lambda t: t["rows"][0]["launch"].update(transport="allreduce"), "only one"),
        (lambda t: t["rows"][0]["launch"].update(candidates=64.0), "candidates must be one of"),
        (lambda t: t["rows"][0]["match"].update(rows_le=0), "rows_le=0"),
        (lambda t: t["rows"][0]["match"].update(tp=0), "tp=0"),
        (lambda t: t.update(tuned="yes"), "tuned must be"),
        (lambda t: t["rows"][0].update(tuned="no"), "row 0: tuned must be"),
        (lambda t: t.update(provenance=[]), "provenance"),
        (lambda t: t["rows"][0].pop("variant"), "row 0: variant must be"),
        (lambda t: t["rows"][0].update(variant="sampled_record_bf16_b512"), "row 0: variant"),
    ],
)
def test_table_validation_loopholes_closed(change, msg):
    table = _sampled_table([_row({"tp": 2, "rows_le": 4}), _row({})])
    change(table)
    with pytest.raises(ValueError, match=msg):
        validate_table(table)


def test_launch_is_keyed_by_width_not_row_stride(tmp_path, monkeypatch):
    """Ranks whose logits have the same shape but different row strides pick the same launch
    (the all_gather needs the same words from every rank)."""
    table = _sampled_table([
        _row({"dtype": "bf16", "tp": 2, "align": 16, "rows_le": 4, "width_le": 2048}),
        _row({}, "sampled_record_bf16_b2048", splits=1, num_warps=4, candidates=64),
    ])  # fmt: skip
    _write(tmp_path, "sm90", "sampled", table)
    monkeypatch.setenv("SHARDMAX_TABLES_DIR", str(tmp_path))
    monkeypatch.setattr(dispatch, "detect_arch", lambda: "sm90")
    from shardmax.ops.sampled import SampledVerifyPlan
    from shardmax.runtime.geometry import Geometry
    from shardmax.runtime.shard import ShardContext
    from shardmax.testing.emulate import EmulatedRank

    geo = Geometry(((0, 2048), (2048, 2000)), 2048, torch.bfloat16)
    ctx = ShardContext(EmulatedRank(0, 2), geo, 0, torch.device("cpu"))
    dense, strided = SampledVerifyPlan(ctx, 3, 2048), SampledVerifyPlan(ctx, 3, 2049)
    assert dense.launch == strided.launch and dense.n_words == strided.n_words
    assert strided.launch.candidates == 128


def test_wrong_variant_for_sampled_verification_is_refused():
    batch, temp, top_k = _topk_batch(1500, [20, 0], seed=1)
    a = batch.args()
    kw = dict(batch.kwargs(), top_k=top_k)
    for variant in ("shard_keys_fp32_va1_b1024", "sampled_record_bf16_b1024"):
        with (
            pytest.raises(ValueError, match="not a sampled_record_fp32"),
            dispatch.override(variant=variant),
        ):
            shardmax.sharded_verify(batch.logits, *a[:5], temp, *a[5:], vocab_start=0, **kw)
    sel = dispatch.Selection("sampled_record_bf16_b1024", {"splits": 1}, False, "test")
    with pytest.raises(ValueError, match="not a sampled_record_fp32"):
        emulate_sampled.emulate_verify(batch.logits, 2, *a[:5], temp, *a[5:], selection=sel, **kw)


def test_can_shard_verify_candidates_and_large_k():
    ok = {"temperatures": [0.7], "vocab_size": 100, "allow_temperature": True, "allow_top_k": True}
    assert shardmax.can_shard_verify(top_k=[200], **ok)  # k >= V keeps every token: off
    assert not shardmax.can_shard_verify(top_k=[64], candidates=64, **ok)
    for bad, err in ((50, ValueError), (True, TypeError), ("64", TypeError), (64.0, TypeError)):
        with pytest.raises(err, match="candidates"):
            shardmax.can_shard_verify(top_k=[5], candidates=bad, **ok)
