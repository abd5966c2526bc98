"""CPU tests of the benchmark harness (benchmarks/): CLI parsing, bytes-on-the-wire arithmetic,
batch layout, report generation from small synthetic CSVs written to a tmp dir, and a smoke run
of the whole harness on CPU (Triton interpreter + gloo). No measured data is committed: every
CSV here is synthetic and lives in ``tmp_path``.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

import benchmarks.__main__ as bench_main
from benchmarks import local as local_mod
from benchmarks import outcome, report
from benchmarks import step as step_mod
from benchmarks.__main__ import (
    ROWS_FULL,
    ROWS_QUICK,
    copy_to_env_out,
    parse_args,
    plans,
)
from benchmarks.local import hbm_floor_us, shard_width, vllm_unfused_local
from benchmarks.step import make_verify_batch, request_counts, wire_bytes_per_rank

# ------------------------------------------------------------------------------- CLI


def test_cli_defaults() -> None:
    a = parse_args([])
    assert a.part == "all" and not a.quick and not a.smoke and not a.interpreter
    assert a.out is None  # resolved to benchmarks/results/<arch> once the device is known
    assert a.budget_s == 480.0
    assert parse_args(["--smoke"]).interpreter  # --smoke implies the interpreter
    root = bench_main.results_root()  # the checkout's folder when run from the repository
    assert root == Path(bench_main.__file__).resolve().parent / "results"


def test_cli_options() -> None:
    a = parse_args(["--part", "step", "--quick", "--out", "/tmp/x", "--budget-s", "100"])
    assert (a.part, a.quick, a.out, a.budget_s) == ("step", True, Path("/tmp/x"), 100.0)
    assert parse_args(["--part", "local"]).part == "local"


@pytest.mark.parametrize(
    "argv", [["--part", "bogus"], ["--budget-s", "0"], ["--local-share", "1.5"]]
)
def test_cli_rejects(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_plans_quick_and_full() -> None:
    local, step = plans(parse_args([]))
    assert local.rows == ROWS_FULL == (1, 4, 16, 32, 96, 256, 512, 1024)
    assert local.vocabs == (151936, 200064, 262144)
    assert local.tps == (1, 2, 4, 8) and local.dtypes == ("bf16", "fp32")
    assert step.rows == ROWS_FULL and step.vocab == 200064
    qlocal, qstep = plans(parse_args(["--quick"]))
    assert qlocal.rows == qstep.rows == ROWS_QUICK == (4, 32, 96, 512)
    assert qlocal.vocabs == (200064,)


# ------------------------------------------------------------------------------- arithmetic


def test_wire_bytes() -> None:
    # sharded: 8 bytes per key, splits keys per row, per rank (all_gather or all_reduce alike)
    assert wire_bytes_per_rank("sharded_allgather", 96, splits=2) == 8 * 2 * 96
    assert wire_bytes_per_rank("sharded_allreduce", 96, splits=1) == 768
    # plain: the padded shard in the logits dtype
    w = shard_width(200064, 2)
    assert w == 100032
    assert wire_bytes_per_rank("plain", 96, width=w, elem_size=2) == 96 * 100032 * 2
    assert wire_bytes_per_rank("plain", 96, width=w, elem_size=4) == 38_412_288
    assert wire_bytes_per_rank("vllm_unfused", 32) == 256
    assert wire_bytes_per_rank("floor_allreduce_int64", 4) == 32
    assert wire_bytes_per_rank("sharded_fast", 4, splits=2) == 24 * 2 * 4
    assert wire_bytes_per_rank("sharded_nucleus", 4, splits=2) == (32 + 8 * 64) * 2 * 4
    assert wire_bytes_per_rank("sharded_nucleus", 1, candidates=128) == 32 + 8 * 128
    with pytest.raises(ValueError):
        wire_bytes_per_rank("plain", 4)
    with pytest.raises(ValueError):
        wire_bytes_per_rank("nope", 4)


def test_shard_width_and_floor() -> None:
    assert shard_width(151936, 8) == 18992
    assert shard_width(262144, 4) == 65536
    assert shard_width(32001, 2) == 16032  # padded to 32064
    with pytest.raises(ValueError):
        shard_width(64, 3)
    # 4.3 TB/s: 4.3e12 B/s = 4.3e6 B/us
    assert hbm_floor_us(4_300_000, 4300.0) == pytest.approx(1.0)
    assert math.isnan(hbm_floor_us(100, float("nan")))


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 96, 97])
def test_request_counts(rows: int) -> None:
    counts = request_counts(rows, 3)
    assert sum(counts) == rows
    assert all(1 <= c <= 4 for c in counts)


def test_verify_batch_matches_reference_shapes() -> None:
    from shardmax import reference

    full = torch.randn(10, 50, generator=torch.Generator().manual_seed(0))
    target = torch.argmax(full, dim=-1)
    b = make_verify_batch(target, 3, 50, seed=1)
    sampled, ns, nr = reference.greedy_verify(full, *b.args(), **b.kwargs())
    assert sampled.shape == (3, 4) and ns.shape == nr.shape == (3,)
    assert int(b.cu_num_logits[-1]) == 10
    assert int(ns.sum() + nr.sum()) == 10  # every row is either sampled or rejected


def test_vllm_unfused_local_matches_argmax() -> None:
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(2))
    x[:, 120:] = 100.0  # padding that would win if it were not masked
    want = torch.argmax(x[:, :120], dim=-1) + 1000
    assert torch.equal(vllm_unfused_local(x.clone(), 8, 1000, 1, upcast=False), want)
    pair = vllm_unfused_local(x.clone(), 8, 1000, 2, upcast=True)
    assert pair.shape == (4, 2) and pair.dtype == torch.float32
    assert torch.equal(pair[:, 1].long(), want)


# ------------------------------------------------------------------------------- report


def _local_rows(frac: float, empty_ratio: float) -> list[dict[str, object]]:
    rows = []
    empty, bw = 2.0, 4300.0
    for dtype, es in (("bf16", 2), ("fp32", 4)):
        for tp in (1, 2):
            for n in (32, 512):
                width = 200064 // tp
                nbytes = n * width * es
                floor = hbm_floor_us(nbytes, bw)
                keys = max(floor / frac, empty * empty_ratio) if n <= 32 else floor / frac
                common = {"dtype": dtype, "vocab": 200064, "tp": tp, "width": width, "rows": n,
                          "shard_bytes": nbytes, "floor_us": floor, "copy_bw_GBps": bw,
                          "empty_us": empty, "correct": True}  # fmt: skip
                for method, cache, t in (
                    ("shardmax_keys", "cold", keys),
                    ("shardmax_keys", "warm", keys * 0.9),
                    ("shardmax_local", "cold", keys + 2.0),
                    ("vllm_unfused", "cold", 5 * keys),
                    ("vllm_unfused_float", "cold", 8 * keys),
                ):
                    rows.append({**common, "method": method, "cache": cache, "p20_us": t * 0.98,
                                 "p50_us": t, "p80_us": t * 1.02,
                                 "variant": "shard_keys_bf16_va16_b4096", "splits": 2})  # fmt: skip
                if tp == 1:
                    rows.append({**common, "method": "torch_argmax_full", "cache": "cold",
                                 "p50_us": 3 * keys})  # fmt: skip
    return rows


def _step_rows(verify_speedup: dict[str, float]) -> list[dict[str, object]]:
    rows = []
    for dtype, es in (("bf16", 2), ("fp32", 4)):
        for n in (4, 96):
            base = {"dtype": dtype, "vocab": 200064, "tp": 2, "width": 100032, "rows": n,
                    "correct": True}  # fmt: skip
            sharded = 12.0
            plain = sharded * (verify_speedup[dtype] if n == 96 else 0.8)
            for op in ("argmax", "verify"):
                rows.append(
                    {
                        **base,
                        "op": op,
                        "path": "sharded_allgather",
                        "dispatched": True,
                        "transport": "allgather",
                        "p50_us": sharded,
                        "wire_bytes_per_rank": wire_bytes_per_rank("sharded_allgather", n),
                    }
                )
                rows.append(
                    {
                        **base,
                        "op": op,
                        "path": "sharded_allreduce",
                        "dispatched": False,
                        "transport": "allreduce",
                        "p50_us": sharded + 1,
                    }
                )
                rows.append({**base, "op": op, "path": "plain", "dispatched": False,
                             "p50_us": plain, "wire_bytes_per_rank": wire_bytes_per_rank(
                                 "plain", n, width=100032, elem_size=es)})  # fmt: skip
            rows.append({**base, "op": "argmax", "path": "vllm_unfused", "p50_us": 40.0})
            rows.append({**base, "op": "collective", "path": "floor_allreduce_int64",
                         "p50_us": 9.0})  # fmt: skip
    # a failed measurement is reported, never silently dropped
    rows.append({"dtype": "bf16", "vocab": 200064, "tp": 2, "rows": 512, "op": "verify",
                 "path": "plain", "error": "RuntimeError: boom"})  # fmt: skip
    return rows


def _write(path: Path, fields: list[str], rows: list[dict[str, object]]) -> None:
    w = report.CsvAppender(path, fields)
    for r in rows:
        w.write(r)


def test_csv_appender_rejects_unknown_columns(tmp_path: Path) -> None:
    w = report.CsvAppender(tmp_path / "x.csv", ["a", "b"])
    w.write({"a": 1.23456, "b": True})
    with pytest.raises(KeyError):
        w.write({"c": 1})
    assert report.read_csv(tmp_path / "x.csv") == [{"a": 1.235, "b": 1}]


def test_report_from_synthetic_csv(tmp_path: Path) -> None:
    _write(tmp_path / "local.csv", report.LOCAL_FIELDS, _local_rows(frac=0.9, empty_ratio=1.2))
    _write(tmp_path / "step_tp2.csv", report.STEP_FIELDS, _step_rows({"fp32": 10.0, "bf16": 4.0}))
    written = report.generate(tmp_path)
    for name in ("local.png", "step_tp2.png", "SUMMARY.md"):
        assert written[name].exists() and written[name].stat().st_size > 0

    local = report.local_view(report.read_csv(tmp_path / "local.csv"))
    step = report.step_view(report.read_csv(tmp_path / "step_tp2.csv"))
    t = {x["target"].split(",")[0][:40]: x for x in report.evaluate_targets(local, step)}
    verdicts = [x["verdict"] for x in report.evaluate_targets(local, step)]
    # 1: floor fraction 0.9 >= 0.85 at TP1 512 rows, both dtypes
    assert verdicts[0] == "PASS"
    # 2: 32 rows: keys = max(floor/0.9, 2.4 us) vs empty 2 us -> ratio > 1.5 where the floor
    # itself is large (TP1 fp32: 25.6 MB / 4.3 TB/s ~ 6 us): partial, and the floor is named
    assert verdicts[1] == "PARTIAL"
    assert "HBM floor alone" in report.evaluate_targets(local, step)[1]["short"]
    # 3: verify fp32 10x >= 8x PASS, bf16 4x < 5x FAIL
    assert verdicts[2] == "PASS" and verdicts[3] == "FAIL"
    # 4: vLLM 40 us / sharded 12 us = 3.33x >= 3x at every row count
    assert verdicts[4] == "PASS"
    # 5: plain 0.8x of sharded at 4 rows -> slower than plain there
    assert verdicts[5] == "PARTIAL"
    assert "rows=4" in report.evaluate_targets(local, step)[5]["short"]
    assert t  # keys built

    md = (tmp_path / "SUMMARY.md").read_text()
    assert "## Targets" in md and "Where it falls short" in md
    assert "RuntimeError: boom" in md  # failures are listed
    rec96 = next(r for r in step if r["dtype"] == "fp32" and r["rows"] == 96)
    assert rec96["verify_speedup"] == pytest.approx(10.0)
    assert rec96["speedup_vs_vllm"] == pytest.approx(40 / 12)
    assert rec96["verify_wire"] == 8 * 96
    lrec = next(r for r in local if r["dtype"] == "bf16" and r["tp"] == 1 and r["rows"] == 512)
    assert lrec["floor_fraction"] == pytest.approx(0.9, rel=1e-3)
    # torch_argmax_full is stored once (tp=1) and used for every TP
    lrec2 = next(r for r in local if r["dtype"] == "bf16" and r["tp"] == 2 and r["rows"] == 512)
    assert not math.isnan(lrec2["speedup_vs_argmax"])


def test_report_plain_dispatch_counts_as_plain(tmp_path: Path) -> None:
    rows = _step_rows({"fp32": 10.0, "bf16": 10.0})
    for r in rows:  # the dispatcher picks plain at 4 rows
        if r.get("rows") == 4 and r.get("path") == "sharded_allgather":
            r["dispatched"] = False
        if r.get("rows") == 4 and r.get("path") == "plain":
            r["dispatched"] = True
    _write(tmp_path / "step_tp2.csv", report.STEP_FIELDS, rows)
    step = report.step_view(report.read_csv(tmp_path / "step_tp2.csv"))
    rec = next(r for r in step if r["rows"] == 4 and r["dtype"] == "fp32")
    assert rec["verify_speedup"] == pytest.approx(1.0)


def test_report_cli_and_missing_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert report.main(["--in", str(tmp_path)]) == 0  # no CSVs at all: still a summary
    assert "NOT MEASURED" in (tmp_path / "SUMMARY.md").read_text()
    assert "== targets ==" in capsys.readouterr().out


def test_copy_to_env_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, dest = tmp_path / "res", tmp_path / "out"
    src.mkdir()
    (src / "local.csv").write_text("a\n")
    (src / "SUMMARY.md").write_text("x\n")
    monkeypatch.delenv("OUT", raising=False)
    assert copy_to_env_out(src) is None
    monkeypatch.setenv("OUT", str(dest))
    assert copy_to_env_out(src) == dest
    assert sorted(p.name for p in dest.iterdir()) == ["SUMMARY.md", "local.csv"]


# ------------------------------------------------------------------------------- run rules


def _fake_local(rows: list[dict[str, object]], skipped: list[str] | None = None) -> object:
    """A stand-in for ``run_local`` that writes ``rows`` as this run's local.csv."""

    def fake(
        plan: object, out_dir: Path, deadline: float, device: str | None = None,
        show_progress: bool = True,
    ) -> outcome.PartOutcome:  # fmt: skip
        _write(out_dir / "local.csv", report.LOCAL_FIELDS, rows)
        return outcome.analyze("local", out_dir / "local.csv", skipped=skipped)

    return fake


def _old_results(folder: Path) -> dict[str, bytes]:
    """A results folder as an earlier (complete, all targets met) run left it."""
    folder.mkdir(parents=True)
    _write(folder / "local.csv", report.LOCAL_FIELDS, _local_rows(frac=0.9, empty_ratio=1.2))
    _write(folder / "step_tp2.csv", report.STEP_FIELDS, _step_rows({"fp32": 10.0, "bf16": 10.0}))
    (folder / "SUMMARY.md").write_text("old summary\n")
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_refuses_without_gpu_unless_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bench_main, "results_root", lambda: tmp_path)
    assert bench_main.main([]) == bench_main.EXIT_REFUSED == 2
    assert bench_main.main(["--quick", "--part", "local"]) == 2
    err = capsys.readouterr().err
    assert "no GPU" in err and "--interpreter" in err and "--smoke" in err
    assert list(tmp_path.iterdir()) == []  # nothing written anywhere


def test_failed_case_exits_nonzero_and_keeps_old_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sm90"
    before = _old_results(out)
    rows = _local_rows(frac=0.9, empty_ratio=1.2)
    rows.append({"dtype": "bf16", "vocab": 200064, "tp": 1, "rows": 32, "method": "shardmax_keys",
                 "error": "RuntimeError: Triton interpreter is off"})  # fmt: skip
    monkeypatch.setattr(local_mod, "run_local", _fake_local(rows))
    monkeypatch.delenv("OUT", raising=False)
    assert bench_main.main(["--interpreter", "--part", "local", "--out", str(out)]) == 1
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # untouched
    text = capsys.readouterr().out
    assert "NOT written to" in text and "a case failed" in text and "1 failed" in text


def test_mismatch_counts_as_failure_but_baseline_ties_do_not(tmp_path: Path) -> None:
    assert not outcome.PartOutcome("local", None).complete  # nothing measured
    rows = [{"method": "shardmax_keys", "p50_us": 3.0, "correct": 0},
            {"method": "vllm_unfused", "p50_us": 3.0, "correct": 0}]  # fmt: skip
    csv_path = tmp_path / "local.csv"
    _write(csv_path, report.LOCAL_FIELDS, rows)
    o = outcome.analyze("local", csv_path)
    assert o.measured == 2 and len(o.failed) == 1 and "shardmax_keys" in o.failed[0]
    _write(csv_path, report.STEP_FIELDS, [{"op": "argmax", "path": "vllm_unfused",
                                           "p50_us": 3.0, "correct": 0}])  # fmt: skip
    assert len(outcome.analyze("step", csv_path).failed) == 1  # every step path is checked
    o = outcome.analyze("step", None, unavailable="needs 2 GPUs")
    assert o.unavailable and not o.failed and not o.complete


def test_budget_cut_or_nothing_measured_is_not_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sm90"
    before = _old_results(out)
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setattr(
        local_mod, "run_local", _fake_local(_local_rows(0.9, 1.2), skipped=["fp32 V=1 rows=2"])
    )
    assert bench_main.main(["--interpreter", "--part", "local", "--out", str(out)]) == 1
    assert "the time budget cut the plan" in capsys.readouterr().out
    monkeypatch.setattr(local_mod, "run_local", _fake_local([]))
    assert bench_main.main(["--interpreter", "--part", "local", "--out", str(out)]) == 1
    assert "no case ran" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_complete_run_publishes_only_its_own_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A complete local-only run replaces local.csv/local.png/SUMMARY.md; the older
    step_tp2.csv stays but is never evaluated: the step targets read NOT MEASURED."""
    out = tmp_path / "sm90"
    before = _old_results(out)
    monkeypatch.delenv("OUT", raising=False)
    # this run misses the floor target (old one met it): the digest must say so
    monkeypatch.setattr(local_mod, "run_local", _fake_local(_local_rows(0.5, 1.2)))
    assert bench_main.main(["--interpreter", "--part", "local", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "[FAIL] local kernel >= 85% of HBM floor" in text
    assert "[NOT MEASURED] sharded verification step TP2" in text
    assert "== step TP2" not in text  # no step table from the old CSV
    assert (out / "step_tp2.csv").read_bytes() == before["step_tp2.csv"]
    assert (out / "local.csv").read_bytes() != before["local.csv"]
    assert (out / "local.png").exists()
    summary = (out / "SUMMARY.md").read_text()
    assert "Not measured in this run: step_tp2.csv" in summary
    step_targets = [ln for ln in summary.splitlines() if "TP2" in ln and ln.startswith("| ")]
    assert len(step_targets) >= 3 and all(ln.endswith("| NOT MEASURED |") for ln in step_targets)


def test_step_part_without_gpus_is_unavailable_not_failed(tmp_path: Path) -> None:
    from benchmarks.step import StepPlan, run_step

    o = run_step(StepPlan(dtypes=("bf16",), rows=(4,)), tmp_path, deadline=0.0, backend="nccl")
    assert o.unavailable.startswith("needs 2 GPUs") and not o.failed and not o.complete
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------- smoke


def test_smoke_run_local_part_on_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The local part of the harness for real (interpreter), published because complete."""
    from benchmarks.__main__ import main

    monkeypatch.delenv("OUT", raising=False)
    assert main(["--smoke", "--part", "local", "--no-progress", "--out", str(tmp_path)]) == 0
    local = report.read_csv(tmp_path / "local.csv")
    assert {r["method"] for r in local} >= {"empty_launch", "shardmax_keys", "shardmax_local"}
    assert not [r for r in local if r.get("error")]
    assert all(r["correct"] == 1 for r in local if str(r["method"]).startswith("shardmax"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["SUMMARY.md", "local.csv", "local.png"]
    assert "[local] " in capsys.readouterr().out


@pytest.mark.slow
def test_smoke_run_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole harness (local part, 2-process gloo step, report) on tiny CPU shapes (slow:
    85 CPU-s; the local part runs by default above, the run rules with stand-in parts)."""
    from benchmarks.__main__ import main

    monkeypatch.delenv("OUT", raising=False)
    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    local = report.read_csv(tmp_path / "local.csv")
    step = report.read_csv(tmp_path / "step_tp2.csv")
    assert {r["method"] for r in local} >= {
        "empty_launch", "torch_argmax_full", "shardmax_keys", "shardmax_local", "vllm_unfused",
    }  # fmt: skip
    assert not [r for r in local + step if r.get("error")]
    assert all(r["correct"] == 1 for r in local if str(r["method"]).startswith("shardmax"))
    paths = {(r["op"], r["path"]) for r in step}
    assert paths == {
        ("argmax", "sharded_allgather"), ("argmax", "sharded_allreduce"),
        ("verify", "sharded_allgather"), ("verify", "sharded_allreduce"),
        ("argmax", "plain"), ("verify", "plain"), ("argmax", "vllm_unfused"),
        ("collective", "floor_allreduce_int64"), ("sampled", "sharded_fast"),
        ("sampled", "plain"), ("sampled_nucleus", "sharded_fast"), ("sampled_nucleus", "plain"),
        ("sampled", "sharded_strict"), ("sampled_nucleus", "sharded_strict"),
        ("sampled", "sharded_strict_eager"), ("sampled", "sharded_strict_eager_hostread"),
        ("sampled", "plain_eager"),
    }  # fmt: skip
    assert all(r["correct"] == 1 for r in step)
    strict_rows = [r for r in step if r["path"] == "sharded_strict"]
    assert all(r["flag_rate"] == 0.0 for r in strict_rows)  # finite rows: nothing flagged
    assert {
        r["wire_bytes_per_rank"] - step_mod.strict_extra_bytes(4, r["vocab"], 2, 4)
        for r in strict_rows
        if r["op"] == "sampled"
    } == {24 * 4}
    summary = (tmp_path / "SUMMARY.md").read_text()
    assert "## Sampled verification step, strict mode" in summary
    assert "### Eager calls and the host read" in summary
    sampled = [r for r in step if r["op"] == "sampled" and "eager" not in r["path"]]
    assert all(0.0 <= r["flag_rate"] <= 1.0 for r in sampled)
    eager = [r for r in step if "eager" in r["path"]]
    assert len(eager) == 3 and all(r["p50_us"] > 0 for r in eager)
    assert {r["wire_bytes_per_rank"] for r in sampled if r["path"] == "sharded_fast"} == {24 * 4}
    assert "## Sampled verification step" in (tmp_path / "SUMMARY.md").read_text()


def test_report_flags_sampled_mismatch(tmp_path: Path) -> None:
    """A sampled-step row that failed its correctness check is called out in SUMMARY.md."""
    rows = _step_rows({"fp32": 10.0, "bf16": 10.0})
    base = {"dtype": "bf16", "vocab": 200064, "tp": 2, "width": 100032, "rows": 96}
    rows.append({**base, "op": "sampled", "path": "sharded_fast", "dispatched": True,
                 "p50_us": 50.0, "flag_rate": 0.0, "correct": False})  # fmt: skip
    rows.append({**base, "op": "sampled", "path": "plain", "p50_us": 90.0, "correct": True})
    _write(tmp_path / "step_tp2.csv", report.STEP_FIELDS, rows)
    md = report.summary_markdown([], report.read_csv(tmp_path / "step_tp2.csv"))
    assert "Correctness mismatches were recorded" in md
    assert "## Sampled verification step" in md
    rows[-2]["correct"] = True
    _write(tmp_path / "ok.csv", report.STEP_FIELDS, rows)
    assert "Correctness mismatches" not in report.summary_markdown(
        [], report.read_csv(tmp_path / "ok.csv")
    )


def test_nucleus_study_smoke(tmp_path: Path) -> None:
    """The top-p pass-rate study end to end on a small vocabulary (CPU, plain torch)."""
    from benchmarks import nucleus_study as ns

    row = ns.zipf_row(4096, 1.5, torch.Generator().manual_seed(0))
    lp = torch.log_softmax(row.double(), 0)
    assert abs(float(-(lp.exp() * lp).sum()) - 1.5) < 1e-3  # the entropy it was solved for
    assert math.isclose(sum(ns.entropy_weights().values()), 1.0)
    cells = ns.run(vocab=2048, tp=2, rows=1)
    n = len(ns.ENTROPIES) * len(ns.TEMPS) * len(ns.TOP_PS) * len(ns.CS) * len(ns.PIPELINES)
    assert len(cells) == n and all(0.0 <= c["pass_rate"] <= 1.0 for c in cells)
    # the sharpest rows always pass, the most diffuse at p=0.99/T=1 never fit 16 candidates
    assert all(c["pass_rate"] == 1.0 for c in cells if c["entropy_target"] == 0.01)
    assert all(
        c["pass_rate"] == 0.0
        for c in cells
        if c["entropy_target"] == 5.0 and c["top_p"] == 0.99 and c["temperature"] == 1.0
        and c["c"] == 16
    )  # fmt: skip
    assert ns.recommend_c(cells) in ns.CS
    split = [c for c in cells if c["pipeline"] == "split"]
    assert all(c["passed_model_differs"] == 0 for c in split)  # the guard's convergence rule
    assert all(c["model_differs"] == "" for c in cells if c["pipeline"] == "monolithic")
    paths = ns.write(cells, tmp_path)
    assert all(p.exists() and p.stat().st_size > 0 for p in paths.values())
    assert "Recommended C for the pass rate" in paths["md"].read_text()
    assert "- sm90: bf16: C=" in paths["md"].read_text()  # read from the committed table
    assert "split top-p pipeline (modelled)" in paths["md"].read_text()
    assert ns.read_cells(paths["csv"]) == cells  # --from-csv re-renders the same numbers


@pytest.mark.parametrize(("vocab", "tp"), [(1031, 2), (1031, 3), (200064, 8), (50257, 4)])
def test_engine_tp_layout_rebuilds_vllm_full_logits(vocab: int, tp: int) -> None:
    """The engine loop at TP > 1: each rank's padded shard (vLLM's layout), all-gathered along
    dim 0, gives back exactly the full logits vLLM's LM head returns (padding dropped, ids in
    place), and the shard the loop verifies is that rank's slice of the same logits."""
    from benchmarks.engine import vllm_full_logits
    from shardmax.testing.shards import default_pad_to, vllm_shard_ranges

    full = torch.randn(3, vocab).to(torch.bfloat16)
    full[1, -1] = 50.0  # the last id (next to the last rank's padding) and a first-shard id
    full[2, 0] = 50.0
    ranges = vllm_shard_ranges(vocab, tp, default_pad_to(vocab, tp))
    shards = []
    for start, num_valid, width in ranges:
        local = torch.full((3, width), 99.0, dtype=full.dtype)  # padding that would win
        local[:, :num_valid] = full[:, start : start + num_valid]
        shards.append(local)
    got = vllm_full_logits(torch.cat(shards, dim=0), tp, vocab)
    assert got.shape == full.shape and torch.equal(got, full)
    assert torch.equal(
        got.argmax(dim=-1), torch.tensor([int(full[0].float().argmax()), vocab - 1, 0])
    )


def test_write_rows_writes_the_header_and_two_decimal_floats(tmp_path: Path) -> None:
    """The benchmarks' whole-file CSV writer: header, rows in order, floats with two decimals."""
    from benchmarks.report import read_csv, write_rows

    path = tmp_path / "x.csv"
    write_rows(path, ["a", "b"], [{"a": 1, "b": 2.345}, {"a": "x", "b": 0.5}])
    assert path.read_text().splitlines() == ["a,b", "1,2.35", "x,0.50"]
    assert read_csv(path)[0]["b"] == 2.35


def test_engine_targets_follow_the_plugins_call() -> None:
    """The engine summary's issue-19 targets judge the path the plug-in takes at each row count
    (the folded fallback behind top-p and at T = 1 at TP 1, the host read and resolution at
    TP > 1), not the bare replay."""
    from benchmarks.engine import plugin_path, summary

    top = {"shardmax", "shardmax-hist+fold", "shardmax-hist+resolve", "vllm"}
    assert plugin_path("top_p", 4, 1, top) == "shardmax-hist+fold"
    assert plugin_path("top_p", 1024, 1, top) == "shardmax-hist+fold"
    assert plugin_path("top_p", 4, 2, top) == "shardmax-hist+resolve"
    assert plugin_path("temperature", 512, 1, {"shardmax+fold"}) == "shardmax+fold"
    assert plugin_path("temperature", 4, 2, {"shardmax+resolve"}) == "shardmax+resolve"
    assert plugin_path("temperature", 4, 1, {"shardmax+resolve"}) is None  # not run
    assert plugin_path("greedy", 4, 8, {"shardmax"}) == "shardmax"

    def row(rows: int, path: str, host: float, tps: float, sync: str = "none") -> dict:
        return {"mix": "top_p", "rows": rows, "path": path, "tp": 1, "host_us_mean": host,
                "host_us_p50": host, "gpu_us_loop": 1.0, "gpu_us_graph": 1.0, "step_us": 1.0,
                "tokens_per_s": tps, "host_sync": sync, "note": ""}  # fmt: skip

    big = 512
    text = summary([
        row(4, "shardmax", 50.0, 900.0), row(4, "shardmax-hist+fold", 150.0, 1100.0),
        row(4, "vllm", 800.0, 1000.0), row(big, "shardmax", 60.0, 9e4),
        row(big, "shardmax-hist+resolve", 30.0, 9e5),  # not the plug-in's call: not judged
        row(big, "shardmax-hist+fold", 3000.0, 7e4, "wait"), row(big, "vllm", 900.0, 8e4),
    ])  # fmt: skip
    plugin = text.split("## Targets (issue 19): the plug-in's call")[1].split("\n## ")[0]
    assert "- top_p rows 4, `shardmax-hist+fold`: host 150.0 us <= 100: FAIL" in plugin
    assert "tokens/s 1100 vs 1000 (PASS)" in plugin
    assert f"- top_p rows {big}, `shardmax-hist+fold`" in plugin
    assert "shardmax-hist+resolve" not in plugin
    assert "sync-free: FAIL" in plugin and "tokens/s 70000 vs 80000 (FAIL)" in plugin
    assert "`shardmax`:" not in plugin  # the bare replay has its own section
    assert "## The sampled steps' bare replay" in text


def test_engine_churn_cycles_shapes_on_shared_shards() -> None:
    """``benchmarks.engine --churn``: the request counts cycled at a row count (its own first,
    never below one request), and each path's calls on every shape sharing one VocabShard (the
    plug-in's one shard per runner: its plans and graphs per shape), a new shape per call."""
    from benchmarks.engine import _Cycle, _paths, churn_reqs
    from shardmax.testing.traffic import realistic_batch

    assert churn_reqs(24, 4) == [24, 23, 22, 21]
    assert churn_reqs(2, 4) == [2, 1] and churn_reqs(5, 0) == [5] == churn_reqs(5, 1)
    shards: dict = {}
    made = []
    for n in churn_reqs(3, 2):
        t = realistic_batch(n, 3, 256, seed=n, mix="temperature")
        made.append(_paths(t, "temperature", None, None, None, None, None, shards)[0])
    assert set(made[0]) == {"shardmax", "shardmax-eager"} == set(shards)
    for name in made[0]:
        assert made[0][name].shard is made[1][name].shard is shards[name]
    cycle = _Cycle([made[0]["shardmax-eager"], made[1]["shardmax-eager"]])
    widths = [int(cycle()[0].shape[0]) for _ in range(4)]
    assert widths == [3, 2, 3, 2], widths
    walk = _Cycle(cycle.steps, [1, 1, 0])
    assert [int(walk()[0].shape[0]) for _ in range(4)] == [2, 2, 3, 2]
    ms = walk.warm(calls=2)  # every shape's first calls, timed apart
    assert len(ms) == 2 and all(len(m) == 2 and min(m) > 0 for m in ms)


def test_engine_fresh_batches_take_turns_per_shape() -> None:
    """``benchmarks.engine --fresh``: each shape's batches (the same shape, other logits) are
    taken in turn on that shape's own calls, whatever the shapes' order; seeds stay distinct
    across variants, shapes and row counts, and the row count's own batch keeps its seed."""
    from benchmarks.engine import FRESH_STRIDE, _Cycle, _paths, fresh_seed
    from shardmax.testing.traffic import realistic_batch

    assert fresh_seed(96, 24, 24, 0) == 96 and fresh_seed(96, 24, 23, 0) == 96 + 23
    seeds = {fresh_seed(r, r // 4, n, j) for r in (4, 32, 96, 256, 512)
             for n in range(max(1, r // 4 - 3), r // 4 + 1) for j in range(8)}  # fmt: skip
    assert len(seeds) == 5 * 8 * 4 - 8 * 3  # 4 rows: one shape; the others: 4 shapes
    assert fresh_seed(4, 1, 1, 1) == 4 + FRESH_STRIDE
    shards: dict = {}
    batches = {}
    for n, j in ((3, 0), (3, 1), (2, 0), (2, 1)):
        t = realistic_batch(n, 3, 256, seed=fresh_seed(12, 3, n, j), mix="temperature")
        batches[n, j] = t
        step = _paths(t, "temperature", None, None, None, None, None, shards)[0]["shardmax-eager"]
        batches[n, j, "step"] = step
    assert not torch.equal(batches[3, 0].logits, batches[3, 1].logits)
    cycle = _Cycle(
        [
            [batches[3, 0, "step"], batches[3, 1, "step"]],
            [batches[2, 0, "step"], batches[2, 1, "step"]],
        ],
        [0, 0, 1],
    )
    got = [cycle() for _ in range(6)]
    # shape order 0, 0, 1, 0, 0, 1; shape 0 alternates its batches, shape 1 likewise
    want = [(3, 0), (3, 1), (2, 0), (3, 0), (3, 1), (2, 1)]
    for res, (n, j) in zip(got, want, strict=True):
        alone = batches[n, j, "step"]()
        assert all(torch.equal(a, b) for a, b in zip(res, alone, strict=True)), (n, j)
    assert [int(r[0].shape[0]) for r in got] == [3, 3, 2, 3, 3, 2]
    ms = cycle.warm(calls=3)  # each shape's first calls go through its batches
    assert len(ms) == 2 and all(len(m) == 3 for m in ms)
    # one call on every batch (the sync check's turn), leaving the loop's place as it was
    turn = cycle.turn()
    for res, key in zip(turn, [(3, 0), (3, 1), (2, 0), (2, 1)], strict=True):
        alone = batches[(*key, "step")]()
        assert all(torch.equal(a, b) for a, b in zip(res, alone, strict=True)), key
    res, alone = cycle(), batches[3, 0, "step"]()  # the order resumes where it was
    assert all(torch.equal(a, b) for a, b in zip(res, alone, strict=True))


def test_engine_sync_check_holds_what_the_engine_holds() -> None:
    """The sync check calls a cycle's batches one by one through its checker, holding the
    ``ENGINE_HELD`` results before each call and releasing older ones (vLLM holds two steps'
    outputs; holding every result would push a replayed plan past its output slots into a path
    no engine step takes), and returns the checker's verdict per call; ``turn`` holds them
    all."""
    import gc
    import weakref

    from benchmarks.engine import ENGINE_HELD, _Cycle

    class Out:
        pass

    made: list[weakref.ref] = []
    alive_at_call: list[int] = []

    def step() -> Out:
        gc.collect()
        alive_at_call.append(sum(r() is not None for r in made))
        out = Out()
        made.append(weakref.ref(out))
        return out

    def checker(call) -> str:
        call()
        return f"call {len(alive_at_call)}"

    cycle = _Cycle([[step, step, step], [step, step]])
    got = cycle.held_calls(checker, ENGINE_HELD)
    assert ENGINE_HELD == 2 and alive_at_call == [0, 1, 2, 2, 2]
    assert got == [f"call {i}" for i in range(1, 6)]
    gc.collect()
    assert sum(r() is not None for r in made) == 0  # nothing kept past the check
    made.clear()
    alive_at_call.clear()
    every = cycle.turn()
    assert alive_at_call == [0, 1, 2, 3, 4] and len(every) == 5


def test_engine_churn_walk_drifts_one_request_at_a_time() -> None:
    """``--churn-order walk``: a seeded random walk over the shapes that stays inside them and
    moves at most one request per step, also where the order repeats (and reaches beyond a few
    neighbours); ``cycle`` and a single shape go through the shapes in turn."""
    from benchmarks.engine import churn_order

    walk = churn_order(24, 400, walk=True, seed=96)
    assert len(walk) == 800 and min(walk) >= 0 and max(walk) <= 23
    # repeated, it never jumps (the walk, then the walk backwards)
    assert all(abs(a - b) <= 1 for a, b in itertools.pairwise(walk + walk))
    assert len(set(walk)) > 8 and walk == churn_order(24, 400, walk=True, seed=96)
    assert churn_order(4, 400, walk=False) == [0, 1, 2, 3]
    assert churn_order(1, 400, walk=True) == [0]
