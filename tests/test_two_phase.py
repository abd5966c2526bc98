"""Two-phase sampled verification (issue 22): records without noise, one drawing row per request.

A two-phase step must give exactly what the one-pass step gives -- every output, flags and
reasons included, bit for bit, except that in fast mode a request on the interval test's edge
may be flagged LSE_MARGIN by one and not the other (the fp32 sums are summed in different
orders) -- and, on every request it does not flag, exactly the plain-torch reference
(:func:`shardmax.reference.sampled.verify_sampled`). Covered here: TP 1/2/3/4/8, the
three logits dtypes, fp32 / fp64 Gumbel, fast / strict mode, several record and draw programs per
row (the last split short or empty), placeholders, chunked prefill, synthetic acceptance, NaN and
all ``-inf`` rows, a Gumbel-key tie planted across a shard edge, empty and all-greedy batches,
and the errors of the stage API.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from shardmax.ops.sampled import FallbackReason, RecordLaunch, SampledVerifyPlan, record_variant
from shardmax.reference.sampled import verify_sampled
from shardmax.runtime import dispatch
from shardmax.runtime.gumbel import gumbel_noise_triton
from shardmax.runtime.validation import check_step_batch
from shardmax.testing import emulate_verify, random_verify_batch
from shardmax.testing.emulate import emulated_ranks

TEMPS = (0.5, 0.7, 1.0, 1.3, 0.0)


def _batch(reqs: int, k: int, vocab: int, seed: int, dtype=torch.float32, device="cpu", **kw):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(reqs * (k + 1), vocab, generator=gen) * 3.0).to(dtype)
    batch = random_verify_batch(reqs, k, vocab, seed=seed, logits=logits, device=device, **kw)
    temps = torch.tensor(TEMPS)[torch.randint(0, len(TEMPS), (batch.max_num_reqs,), generator=gen)]
    return batch, temps.to(device)


def _both(batch, temps, tp: int, **kw):
    a = batch.args()
    kw = dict(batch.kwargs(), **kw)
    one = emulate_verify(batch.logits, tp, *a[:5], temps, *a[5:], phases=1, **kw)
    two = emulate_verify(batch.logits, tp, *a[:5], temps, *a[5:], phases=2, **kw)
    kw.pop("record_splits", None), kw.pop("draw_splits", None), kw.pop("mode", None)
    want = verify_sampled(batch.logits, *a[:5], temps, *a[5:], **kw)
    return one, two, want


def _assert_equal_off_the_margin(one, two) -> None:
    """Every output of every request equal, bit for bit -- except requests either run flags
    LSE_MARGIN: phase 1 and one pass sum their fp32 exponentials in different orders (research
    §2.3: any order), so in fast mode a row on the interval test's edge may be flagged by one and
    not the other (strict mode has no such flag: there everything is equal)."""
    margin = (one.reason == FallbackReason.LSE_MARGIN) | (two.reason == FallbackReason.LSE_MARGIN)
    # per request; ``need`` (per row) may differ: a drawn row the two-phase pick flags is
    # gathered alone, the one-pass finish also gathers rows after it (tests/test_resolve.py)
    for name, a, b in zip(one._fields[:5], one[:5], two[:5], strict=True):
        assert a.dtype == b.dtype and torch.equal(a[~margin], b[~margin]), (
            f"{name}: one-pass {a} two-phase {b}"
        )


def _assert_same(one, two, want) -> None:
    _assert_equal_off_the_margin(one, two)
    for res in (one, two):  # every request a run does not flag: the reference's answer
        ok = ~res.fallback
        for a, w in zip(res[:3], want, strict=True):
            assert torch.equal(a[ok], w[ok])


CASES = [
    # tp, dtype, fp64, mode, record splits, draw splits, batch options
    (1, torch.float32, False, "fast", 1, 1, {}),
    (2, torch.bfloat16, True, "fast", 2, 3, {"placeholder_prob": 0.3}),
    (3, torch.float16, False, "strict", 1, 2, {"prefill_prob": 0.3}),
    (4, torch.float32, True, "strict", 3, 1, {"synthetic": True}),
    (8, torch.bfloat16, False, "fast", 1, 4, {"prefill_prob": 0.2, "placeholder_prob": 0.2}),
    (2, torch.float32, False, "strict", 2, 2, {"accept_prob": 0.9}),
]


@pytest.mark.parametrize(("tp", "dtype", "fp64", "mode", "splits", "draws", "opts"), CASES)
def test_two_phase_equals_one_pass_and_reference(tp, dtype, fp64, mode, splits, draws, opts):
    batch, temps = _batch(7, 3, 2011 + 97 * tp, seed=tp * 13 + splits, dtype=dtype, **opts)
    one, two, want = _both(
        batch, temps, tp, use_fp64_gumbel=fp64, mode=mode, record_splits=splits, draw_splits=draws
    )
    _assert_same(one, two, want)


def test_non_finite_rows_flag_the_same_requests() -> None:
    batch, temps = _batch(6, 3, 3001, seed=5, placeholder_prob=0.2)
    temps[:] = 1.0
    first = batch.cu_num_logits.long()  # every request's first row is always used
    batch.logits[first[1], :] = -math.inf  # no finite logit: NON_FINITE
    batch.logits[first[3], 1700] = math.nan
    batch.logits[first[4], 10] = math.inf
    one, two, want = _both(batch, temps, 3, record_splits=2, draw_splits=2)
    _assert_same(one, two, want)
    assert int((two.reason == FallbackReason.NON_FINITE).sum()) == 3


@pytest.mark.parametrize(("tp", "fp64"), [(2, False), (3, True)])
def test_non_finite_rows_without_a_draft(tp, fp64) -> None:
    """Phase 1 does not read rows without a draft (bonus rows): a drawn bonus row with NaN,
    +inf or no finite logit is flagged by the pick exactly as the one-pass finish flags it, and
    an undrawn one (an earlier draft rejected) flags nothing."""
    reqs = 6  # seed 9: requests of 2, 2, 3, 4, 1 and 2 rows (5 with drafts, 14 rows in all)
    batch, temps = _batch(reqs, 3, 1501, seed=9, prefill_prob=0.0, placeholder_prob=0.0)
    temps[:] = 1.0
    cu = batch.cu_num_logits.long().tolist()
    with_drafts = [r for r in range(reqs) if cu[r + 1] - cu[r] >= 2]
    assert len(with_drafts) >= 5
    rejecting = with_drafts[4]
    for r in with_drafts:
        for row in range(cu[r], cu[r + 1] - 1):  # rows that test a draft
            d = int(batch.draft_sampled[row + 1])
            batch.logits[row, d] = -math.inf if r == rejecting else 60.0  # rejected / accepted
    bonus = [cu[r + 1] - 1 for r in with_drafts]
    batch.logits[bonus[0], :] = -math.inf  # no finite logit
    batch.logits[bonus[1], 17] = math.nan
    batch.logits[bonus[2], 1499] = math.inf
    batch.logits[bonus[4], 5] = math.nan  # its first draft is rejected: the bonus row is unused
    one, two, want = _both(batch, temps, tp, use_fp64_gumbel=fp64, record_splits=2)
    _assert_same(one, two, want)
    flagged = [r for r in range(reqs) if bool(two.fallback[r])]
    assert flagged == sorted(with_drafts[:3])
    assert (two.reason[with_drafts[:3]] == FallbackReason.NON_FINITE).all()
    assert int(two.num_rejected[rejecting]) == cu[rejecting + 1] - cu[rejecting] - 1
    assert int(two.num_sampled[with_drafts[3]]) == cu[with_drafts[3] + 1] - cu[with_drafts[3]]


@pytest.mark.parametrize("fp64", [False, True])
def test_many_draw_splits_pack_fewer_requests_per_pick(fp64: bool) -> None:
    """Up to 128 draw programs per request (most of them empty on a narrow shard), same tokens:
    packed fp32 keys are combined on the rank (one key per request and slot is sent), fp64
    mode's (key, id) pairs are sent per split and the pick loads tp x splits keys per request
    in tiles of fewer requests."""
    from shardmax.ops.sampled import pick_requests

    assert [pick_requests(p) for p in (1, 8, 64, 100, 1024)] == [32, 32, 32, 16, 2]
    plan = _plan(2, draw_splits=40, use_fp64_gumbel=fp64)
    assert plan.sent_draw_splits(3) == (40 if fp64 else 1)
    assert plan.draw_words(3) == 3 * (40 * 2 if fp64 else 1)  # fp64: (key, id) words
    batch, temps = _batch(3, 3, 801, seed=21, dtype=torch.bfloat16)
    one, two, want = _both(batch, temps, 4, draw_splits=40, use_fp64_gumbel=fp64)  # fp64: 160
    _assert_same(one, two, want)  # parts, 8 requests per pick


def test_planted_gumbel_tie_across_a_shard_edge_takes_the_lowest_id() -> None:
    """Two tokens on two ranks (and two draw splits) whose noised fp32 values are equal: the
    drawn token is the lower id, in both pipelines, as vLLM's argmax over the full row. (fp64
    Gumbel keys cannot tie from fp32 logits but by a 2**-29 chance.)"""
    fp64 = False
    vocab, tp = 4096, 2
    batch, temps = _batch(1, 1, vocab, seed=3, prefill_prob=0.0)
    temps[:] = 1.0
    batch.draft_sampled[:] = 5  # x[5] = -inf below: the draft is rejected, row 0 draws
    seed, pos = int(batch.seed[int(batch.idx_mapping[0])]), int(batch.pos[0])
    ids = torch.arange(vocab, dtype=torch.int64)
    g = gumbel_noise_triton(seed, pos, ids, fp64=fp64)
    a = 2000  # rank 0 holds [0, 2048): a is below the edge, b above it
    hits = []
    for b in range(2048, vocab):
        # x_b = G_a - G_b in the noise's precision, from the fp32 logits the kernel reads
        xb = torch.tensor(float(g[a] - g[b]), dtype=torch.float32)
        lhs = xb.to(g.dtype) + g[b] if fp64 else xb + g[b]
        if bool(lhs == g[a]):
            hits.append((b, xb))
            break
    assert hits, "no exact tie found to plant"
    b, xb = hits[0]
    batch.logits.fill_(-30.0)
    batch.logits[:, a], batch.logits[:, b], batch.logits[:, 5] = 0.0, xb, -math.inf
    one, two, want = _both(batch, temps, tp, use_fp64_gumbel=fp64, draw_splits=2)
    _assert_same(one, two, want)
    assert int(two.sampled[0, 0]) == a == int(want[0][0, 0])


def test_empty_and_greedy_only_batches() -> None:
    batch, temps = _batch(0, 3, 1000, seed=1)
    one, two, _ = _both(batch, temps, 2)
    assert two.sampled.shape == (0, 4) and one.sampled.shape == (0, 4)
    batch, temps = _batch(5, 3, 1500, seed=2)
    temps[:] = 0.0
    one, two, want = _both(batch, temps, 2, draw_splits=2)
    _assert_same(one, two, want)
    assert not bool(two.fallback.any())


def _plan(phases: int, rows: int = 4, **kw) -> SampledVerifyPlan:
    logits = torch.randn(rows, 300)
    _, ctxs = emulated_ranks(logits, 1, None)
    launch = RecordLaunch(record_variant(torch.float32), 1, 4, 64, "test", phases)
    return SampledVerifyPlan(ctxs[0], rows, 300, launch=launch, **kw)


def test_stage_api_errors() -> None:
    assert _plan(2).two_phase and not _plan(1).two_phase
    assert not _plan(2, with_candidates=True).two_phase  # candidate steps run one pass
    batch = random_verify_batch(2, 3, 300, seed=0)
    rows = batch.num_logits
    temps = torch.ones(batch.max_num_reqs)
    step = check_step_batch(rows, batch.logits.device, *batch.args(), temperature=temps)
    with pytest.raises(ValueError, match="one pass"):
        _plan(1, rows).draw(batch.logits, step)
    for bad in (0, 129, True, 2.0):
        with pytest.raises(ValueError, match="draw_splits"):
            _plan(2, draw_splits=bad)
    with pytest.raises(ValueError, match="phases"):
        _plan(3)
    with pytest.raises(ValueError, match="phases"):
        dispatch.validate_launch({"phases": 0}, "row")
    with dispatch.override(phases=1):
        sel = dispatch.select(dispatch.Problem("sampled", "fp32", 1, 4, 300))
        assert sel.phases == 1 and RecordLaunch.of(sel).phases == 1
    assert dispatch.select(dispatch.Problem("sampled", "fp32", 1, 4, 300)).phases == 2
    # phase 1 clears one or two int64 draw slots per logits row: another size is refused (the
    # draw would combine into slots nobody cleared)
    from shardmax.ops.sampled import row_params, sampled_records

    plan = _plan(2, rows)
    buf = torch.empty(plan.n_words, dtype=torch.int64)
    for bad in (torch.empty(rows - 1, dtype=torch.int64), torch.empty(3 * rows, dtype=torch.int64),
                torch.empty(rows, dtype=torch.int32)):  # fmt: skip
        with pytest.raises(ValueError, match="best"):
            sampled_records(batch.logits, 0, 300, row_params(step), plan.launch, False, False,
                            buf, None, True, bad)  # fmt: skip


# --------------------------------------------------------------------------------------------
# GPU (H200): vLLM's own kernels as the oracle, realistic temperature traffic
# --------------------------------------------------------------------------------------------

_GPU_CASES = [(8, 151936, 2), (8, 200064, 8), (40, 151936, 4), (40, 200064, 2), (128, 200064, 4)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", _GPU_CASES, ids=[f"{r}req-V{v}-tp{t}" for r, v, t in _GPU_CASES])
def test_two_phase_equals_vllm_on_gpu(case) -> None:
    """Realistic T=1 steps (LM entropy profile, drafts the top token 80 % of the time), emulated
    TP, the GPU's draw launch: two-phase == one-pass bit for bit off the LSE margin
    (:func:`_assert_equal_off_the_margin`), each call twice bit-identical,
    and every request shardmax does not flag == every carried vLLM version's own chain
    (``rejection_sample`` on the full logits), fast and strict mode."""
    from shardmax.testing.traffic import realistic_batch
    from shardmax.testing.vllm_chain import NativeChain, verify_inputs

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    chains = NativeChain.discover()
    num_reqs, vocab, tp = case
    total = differ = flagged = 0
    for seed in range(4):
        b = realistic_batch(num_reqs, 3, vocab, seed=seed, mix="temperature", device="cuda")
        args = (b.draft_sampled, b.cu_num_logits, b.pos, b.idx_mapping, b.expanded_local_pos,
                b.temperature, b.seed, 3)  # fmt: skip
        kw = {"seq_lens": b.seq_lens, "prefill_len": b.prefill_len}
        for mode in ("fast", "strict"):
            one, two, again = (
                emulate_verify(b.logits, tp, *args, mode=mode, phases=p, record_splits=2, **kw)
                for p in (1, 2, 2)
            )
            for name, a, c in zip(two._fields, two, again, strict=True):
                assert torch.equal(a, c), f"two-phase not deterministic: {name}"
            _assert_equal_off_the_margin(one, two)
            ok = ~two.fallback
            flagged += int((~ok).sum())
            for chain in chains:
                whole = chain.verify(b.logits, **verify_inputs(b))
                n = whole[1].long()
                used = torch.arange(4, device="cuda")[None, :] < n[:, None]
                bad = ((two.sampled != whole[0]) & used).any(dim=1)
                bad |= two.num_sampled.long() != n
                differ += int((bad & ok).sum())
                total += int(ok.sum())
    print(f"[two-phase gpu] {case}: {differ} of {total} unflagged request checks differ from "
          f"vLLM ({[c.version for c in chains]}), {flagged} flagged")  # fmt: skip
    assert differ == 0


def test_phases_from_a_measured_benchmark(tmp_path) -> None:
    """tuner/phases.py: a row takes two-phase where it was faster at its bucket's measured row
    count (with the fastest agreeing phase-1 launch of the sweep, and the second exchange's
    latency charged at TP > 1); a TP that was not measured takes TP 1's answer; the catch-all
    the largest count."""
    import csv as csv_mod

    from tuner.phases import apply_phases, exchange_latency, measured_phases

    path = tmp_path / "sampled_local.csv"
    fields = ["tp", "rows", "method", "kernel", "p50_us", "note"]
    with path.open("w", newline="") as f:
        w = csv_mod.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for tp, rows, one, two in ((2, 4, 10.0, 12.0), (2, 96, 50.0, 30.0), (1, 4, 9.0, 8.0),
                                   (1, 512, 300.0, 100.0), (2, 32, 20.0, 17.0)):  # fmt: skip
            w.writerow({"tp": tp, "rows": rows, "method": "one_pass", "p50_us": one})
            w.writerow({"tp": tp, "rows": rows, "method": "two_phase", "p50_us": two})
            w.writerow({"tp": tp, "rows": rows, "method": "two_phase", "kernel": "k", "p50_us": 1})
        sweep = (
            ("two_phase_p1_b4096_s4_w8", 25.0, "agrees with two_phase (0 flagged)"),
            ("two_phase_p1_b1024_s8_w4", 20.0, "DIFFERS"),  # never taken
            ("two_phase_p1_b2048_s2_w4", 27.0, "agrees with two_phase (1 flagged)"),
        )
        for method, us, note in sweep:  # fmt: skip
            w.writerow({"tp": 2, "rows": 96, "method": method, "p50_us": us, "note": note})
    step = tmp_path / "step_tp2.csv"
    step.write_text("rows,op,path,p50_us\n4,collective,floor_allreduce_int64,10.0\n"
                    "96,collective,floor_allreduce_int64,12.0\n4,verify,plain,99\n")  # fmt: skip
    assert exchange_latency(step) == {4: 10.0, 96: 12.0}
    measured = measured_phases(path)
    assert measured[(2, 4)].phases == 1 and measured[(2, 96)].phases == 2
    assert measured[(2, 96)].two_phase == 25.0
    assert measured[(2, 96)].phase1 == {"block": 4096, "splits": 4, "num_warps": 8}
    assert measured[(1, 4)].phase1 is None and measured[(2, 32)].phases == 2
    # a phase-1 launch that spills on the arch is never taken: the next fastest agreeing one is
    no_b4096 = measured_phases(path, usable=lambda launch: launch["block"] != 4096)
    assert no_b4096[(2, 96)].phase1 == {"block": 2048, "splits": 2, "num_warps": 4}
    assert no_b4096[(2, 96)].two_phase == 27.0
    # the real second exchange makes 17 + 10 > 20 at 32 rows (nearest: 4 rows' latency)
    charged = measured_phases(path, exchange_latency(step))
    assert charged[(2, 32)].phases == 1 and charged[(2, 32)].exchange == 10.0
    assert charged[(2, 96)].phases == 2 and charged[(1, 4)].exchange == 0.0
    launch = {"splits": 1, "num_warps": 4, "candidates": 64, "transport": "allgather"}
    table = {"op": "sampled", "provenance": {}, "rows": [
        {"match": {"tp": 2, "rows_le": 1}, "launch": dict(launch)},
        {"match": {"tp": 2, "rows_le": 64}, "launch": dict(launch)},
        {"match": {"tp": 2, "rows_le": 256}, "launch": dict(launch, phase1={"block": 1024,
                                                                       "splits": 2,
                                                                       "num_warps": 4})},
        {"match": {"tp": 8, "rows_le": 4}, "launch": dict(launch)},
        {"match": {}, "launch": dict(launch)},
    ]}  # fmt: skip
    out = apply_phases(table, charged, "x.csv", "step.csv")
    assert [r["launch"]["phases"] for r in out["rows"]] == [1, 1, 2, 2, 2]
    assert out["rows"][2]["launch"]["phase1"] == {"block": 4096, "splits": 4, "num_warps": 8}
    assert ["phase1" in r["launch"] for r in out["rows"]] == [False, False, True, False, False]
    assert out["rows"][2]["phases_exchange_us"] == 12.0
    assert out["provenance"]["phases"]["source"] == "x.csv"
    assert out["provenance"]["phases"]["exchange_source"] == "step.csv"
    with pytest.raises(ValueError, match="sampled"):
        apply_phases({"op": "verify", "rows": []}, measured, "x.csv")
    with pytest.raises(ValueError, match="no op, path column"):
        exchange_latency(path)  # a sampled_local CSV, not a step CSV
    step.write_text("rows,op,path,p50_us\n4,verify,plain,9\n")
    with pytest.raises(ValueError, match="floor_allreduce"):
        exchange_latency(step)


def test_phases_csv_defects_raise_naming_the_file(tmp_path) -> None:
    """A truncated sweep row (no note) is not taken, a NaN time is no measurement, a missing
    column or a non-number raises ValueError naming the file -- never AttributeError/KeyError."""
    from tuner.phases import exchange_latency, measured_phases

    path = tmp_path / "s.csv"
    path.write_text(
        "tp,rows,method,kernel,p50_us,note\n2,96,one_pass,,50,\n2,96,two_phase,,30,\n"
        "2,96,two_phase_p1_b4096_s4_w8,,20\n2,96,two_phase_p1_b2048_s4_w8,,nan,agrees\n"
    )
    got = measured_phases(path)[(2, 96)]
    assert got.two_phase == 30.0 and got.phase1 is None
    for text, msg in (("rows,method,p50_us\n4,one_pass,1\n", "no tp column"),
                      ("tp,rows,method,p50_us\nx,4,one_pass,1\n", "tp='x'"),
                      ("tp,rows,method,p50_us\n,4,one_pass,1\n", "tp=''")):  # fmt: skip
        path.write_text(text)
        with pytest.raises(ValueError, match=msg):
            measured_phases(path)
    path.write_text("op,path,p50_us\ncollective,floor_allreduce_int64,3\n")
    with pytest.raises(ValueError, match="no rows column"):
        exchange_latency(path)


def test_phase1_launch_of_a_table_row() -> None:
    """A row's ``phase1`` launch runs phase 1 of two-phase steps only (candidate steps and
    one-pass rows keep the record launch); it is validated, capped to the width, and dropped by
    an override that forces the record launch."""
    row = {"match": {}, "variant": "sampled_record_bf16_b1024", "launch": {
        "splits": 4, "num_warps": 4, "candidates": 64, "transport": "allgather", "phases": 2,
        "phase1": {"block": 4096, "splits": 32, "num_warps": 8}}}  # fmt: skip
    table = {"schema": 1, "arch": "sm90", "op": "sampled", "tuned": True, "provenance": {},
             "rows": [row]}  # fmt: skip
    dispatch.validate_table(table)
    sel = dispatch._adapt(row, dispatch.Problem("sampled", "fp16", 2, 8, 20000, 16), True, "t")
    assert sel.phase1 == {"block": 4096, "splits": 5, "num_warps": 8}  # cdiv(20000, 4096)
    p1 = RecordLaunch.of(sel, two_phase=True)
    assert (p1.variant, p1.splits, p1.num_warps, p1.phases) == ("sampled_record_fp16_b4096", 5,
                                                                 8, 2)  # fmt: skip
    assert RecordLaunch.of(sel).variant == "sampled_record_fp16_b1024"
    one = dispatch.Selection(sel.variant, dict(sel.launch, phases=1), True, "t")
    assert RecordLaunch.of(one, two_phase=True).splits == 4
    for bad, msg in (({"block": 512, "splits": 1, "num_warps": 4}, "block"),
                     ({"block": 1024, "splits": 0, "num_warps": 4}, "splits"),
                     ({"block": 1024, "splits": 1, "num_warps": 3}, "num_warps"),
                     ({"block": 1024, "splits": 1}, "exactly"),
                     ({"block": 1024, "splits": True, "num_warps": 4}, "int")):  # fmt: skip
        broken = json.loads(json.dumps(table))
        broken["rows"][0]["launch"]["phase1"] = bad
        with pytest.raises(ValueError, match=msg):
            dispatch.validate_table(broken)


def test_sm90_table_carries_the_measured_choice() -> None:
    sel = dispatch.select(dispatch.Problem("sampled", "bf16", 2, 96, 100032, 16, arch="sm90"))
    assert sel.phases == 2 and sel.is_tuned


def test_draw_launch_builtin_rule() -> None:
    """About DRAW_TARGET_PROGRAMS programs over the drawing requests, at most MAX_DRAW_SPLITS per
    request and one tile each at least (measured: SAMPLED.md's draw table); one on a CPU."""
    from shardmax.ops.sampled import draw_launch

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    bf16 = torch.bfloat16
    assert draw_launch(bf16, 1, 200064, 200064, cuda).splits == 64  # 97 tiles
    assert draw_launch(bf16, 1, 100032, 100032, cuda).splits == 32  # 48 tiles
    assert draw_launch(bf16, 24, 100032, 100032, cuda).splits == 32  # cdiv(1056, 24) = 44
    assert draw_launch(bf16, 128, 100032, 100032, cuda).splits == 8
    assert draw_launch(bf16, 1, 1000, 1024, cuda).splits == 1
    assert draw_launch(bf16, 1, 200064, 200064, cpu).splits == 1
    launch = draw_launch(bf16, 3, 50000, 50016, cuda, splits=5)
    assert launch.splits == 5 and launch.chunk % 2048 == 0 and launch.chunk * 5 >= 50000
