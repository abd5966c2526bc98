"""What a non-editable install (``pip install /path/to/shardmax``, the README's vLLM install)
and the tuner need from the checked-in tree."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest
import tomllib

from generator.__main__ import resource_drift, stale_resources
from generator.render import generated_dir

ROOT = Path(__file__).resolve().parent.parent


def test_every_runtime_subpackage_is_packaged() -> None:
    """Every folder under ``shardmax/`` with an ``__init__.py`` ships in the wheel (a missing
    ``shardmax.testing`` once broke the tuner and the demo outside an editable install)."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packaged = set(cfg["packages"])
    found = {
        "shardmax." + ".".join(p.parent.relative_to(ROOT / "shardmax").parts)
        for p in (ROOT / "shardmax").rglob("__init__.py")
        if p.parent != ROOT / "shardmax" and "__pycache__" not in p.parts
    }
    assert found <= packaged, f"not packaged: {sorted(found - packaged)}"


def test_aot_resources_cover_exactly_the_generated_variants() -> None:
    """``generated/<arch>/resources.json`` (registers / spills the tuner prunes with) lists
    every variant of the MANIFEST and nothing else."""
    manifest = json.loads((generated_dir() / "MANIFEST.json").read_text())
    names = [v["name"] if isinstance(v, dict) else v for v in manifest["variants"]]
    assert stale_resources(generated_dir(), names) == []


def test_every_generated_kernel_is_named_after_its_variant() -> None:
    """Profilers (torch.profiler, Nsight) show the jitted function's name: each generated
    module's kernel is the function named after its variant, and ``kernel`` is its alias."""
    manifest = json.loads((generated_dir() / "MANIFEST.json").read_text())
    names = [v["name"] for v in manifest["variants"]]
    assert len(names) > 50
    for name in names:
        mod = importlib.import_module(f"shardmax.generated.{name}")
        fn = getattr(mod.kernel, "fn", mod.kernel)  # JITFunction / InterpretedFunction
        assert fn.__name__ == name == mod.NAME, (name, fn.__name__)
        assert getattr(mod, name) is mod.kernel


def test_readme_cpu_example_is_the_script_ci_runs() -> None:
    """The README's CPU example is scripts/cpu_example.py verbatim (scripts/wheel_smoke.sh runs
    it against the installed wheel), and it runs here."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Using it after set-up", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    script = (ROOT / "scripts" / "cpu_example.py").read_text()
    assert script in blocks, "README 'Using it after set-up' must show scripts/cpu_example.py"
    exec(compile(script, "cpu_example.py", "exec"), {"__name__": "__example__"})


def test_console_scripts_and_packages() -> None:
    """Each tool is a console script whose module ships in the wheel."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    scripts = cfg["project"]["scripts"]
    assert set(scripts) == {"shardmax-generate", "shardmax-tune", "shardmax-bench"}
    packaged = set(cfg["tool"]["setuptools"]["packages"])
    for target in scripts.values():
        module = target.split(":")[0]
        assert module.rsplit(".", 1)[0] in packaged
        importlib.import_module(module)


def test_resource_drift_compares_reports_of_one_triton_version() -> None:
    old = {"triton_version": "3.9.0", "variants": {"k": {"registers": 46, "spill_bytes": 0}}}
    new = {"triton_version": "3.9.0", "variants": {"k": {"registers": 44, "spill_bytes": 0}}}
    assert resource_drift(old, new) == ["k: registers 46 -> 44"]
    assert resource_drift(old, old) == []
    assert resource_drift(old, {**new, "triton_version": "3.10.0"}) == []  # another compiler


def test_spill_report_names_new_spills_of_selectable_variants(tmp_path) -> None:
    """A spill counts only in a variant the arch's tables (or the runtime) can launch, and only
    when generator/spills.py does not list it; known entries that stopped spilling are named."""
    import json

    from generator.spills import KNOWN_SPILLS, spill_report

    (tmp_path / "sm90").mkdir()
    row = {"match": {}, "variant": "sampled_record_bf16_b2048", "launch": {}}
    (tmp_path / "sm90" / "sampled.json").write_text(json.dumps({"rows": [row]}))
    rec = {"variants": {
        "sampled_record_fp32_b2048": {"spill_bytes": 8},  # a table row's block, adapted dtype
        "sampled_record_bf16_b4096": {"spill_bytes": 2260},  # no row selects b4096
        "sampled_finish_tp2_allgather": {"spill_bytes": 4},  # finishes: always selectable
        "shard_keys_bf16_va1_b8192": {"spill_bytes": 12},  # no table: not selectable
    }}  # fmt: skip
    new, gone = spill_report(tmp_path, "sm90", rec)
    assert new == ["sampled_finish_tp2_allgather: 4 bytes", "sampled_record_fp32_b2048: 8 bytes"]
    assert gone == []
    # a row at other warps than the report entry's: that launch is what counts, under launches
    rec["variants"]["sampled_record_bf16_b2048"] = {"spill_bytes": 0, "num_warps": 4}
    row["launch"] = {"num_warps": 8}
    (tmp_path / "sm90" / "sampled.json").write_text(json.dumps({"rows": [row]}))
    new, _ = spill_report(tmp_path, "sm90", rec)
    assert "sampled_record_bf16_b2048@w8: not in the report" in new  # a stale report, named
    rec["launches"] = {"sampled_record_bf16_b2048@w8": {"spill_bytes": 12}}
    new, _ = spill_report(tmp_path, "sm90", rec)
    assert "sampled_record_bf16_b2048@w8: 12 bytes" in new
    del rec["launches"], rec["variants"]["sampled_record_bf16_b2048"]
    # a phase1 launch selects its block's phase-1 constexpr set (reported under "configs")
    row["launch"] = {"phase1": {"block": 4096, "splits": 2, "num_warps": 4}}
    (tmp_path / "sm90" / "sampled.json").write_text(json.dumps({"rows": [row]}))
    p1 = {"spill_bytes": 0, "configs": {"phase1": {"spill_bytes": 6},
                                         "phase1_topp": {"spill_bytes": 10}}}  # fmt: skip
    rec["variants"]["sampled_record_fp16_b4096"] = p1
    new, _ = spill_report(tmp_path, "sm90", rec)
    assert "sampled_record_fp16_b4096[phase1]: 6 bytes" in new
    assert "sampled_record_fp16_b4096[phase1_topp]: 10 bytes" in new  # top-p steps' phase 1
    assert "sampled_record_bf16_b4096: 2260 bytes" not in new  # its default set: not selected
    known = "sampled_finish_tp4_allgather"
    (tmp_path / "gfx950").mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(KNOWN_SPILLS, "gfx950", {known: "a known spill"})
        new, gone = spill_report(tmp_path, "gfx950", {"variants": {known: {"spill_bytes": 0}}})
    assert new == [] and gone == [known]


def test_selected_launches_cover_every_constexpr_set_a_launch_runs(tmp_path) -> None:
    """A ``sampled`` row's record launch also runs phase 1 of the two-phase and top-p steps
    (its ``[phase1]`` / ``[phase1_topp]`` sets at the row's block and warps); a row's ``phase1``
    entry runs only the phase-1 sets; the draw kernel, finishes and picks every set they have."""
    import json

    from generator.spills import Launch, selected_launches

    cfg = {"phase1": {"spill_bytes": 0}, "phase1_topp": {"spill_bytes": 0}}
    variants = {
        f"sampled_record_{d}_b{b}": {"spill_bytes": 0, "num_warps": 4, "configs": cfg}
        for d in ("bf16", "fp16", "fp32") for b in (1024, 2048, 4096)
    }  # fmt: skip
    variants["sampled_draw_bf16_b2048"] = {"num_warps": 8, "configs": {"topp": {}}}
    variants["sampled_finish_tp2_allgather"] = {"num_warps": 2, "configs": {"topp": {}}}
    (tmp_path / "sm90").mkdir()
    row = {"match": {}, "variant": "sampled_record_bf16_b1024",
           "launch": {"num_warps": 8, "phase1": {"block": 4096, "splits": 4, "num_warps": 4}}}  # fmt: skip
    (tmp_path / "sm90" / "sampled.json").write_text(json.dumps({"rows": [row]}))
    got = selected_launches(tmp_path, "sm90", variants)
    for d in ("bf16", "fp16", "fp32"):
        for c in (None, "phase1", "phase1_topp"):
            assert Launch(f"sampled_record_{d}_b1024", 8, c) in got
        assert Launch(f"sampled_record_{d}_b4096", 4, "phase1") in got
        assert Launch(f"sampled_record_{d}_b4096", 4, "phase1_topp") in got
        assert Launch(f"sampled_record_{d}_b4096", 4) not in got  # phase 1 only there
        assert Launch(f"sampled_record_{d}_b2048", 4, "phase1_topp") in got  # the built-in rule
    assert Launch("sampled_draw_bf16_b2048", 8, "topp") in got
    assert Launch("sampled_finish_tp2_allgather", 2, "topp") in got


def test_no_launch_a_table_can_select_spills_on_either_arch() -> None:
    """Issue 22's AMD readiness, on the committed AOT reports: every launch the sm90 and
    gfx950 tables (and the built-in rule) can select -- the variant at the warps named, every
    constexpr set -- is in the report and spills nothing to memory unless ``KNOWN_SPILLS`` lists
    it with its reason (:func:`spill_report`); and no variant spills at its nominal warps with
    its default constexprs."""
    from generator.spills import config_warps, extra_launches, selected_launches, spill_report
    from shardmax.runtime.variants import parse_name

    for arch in ("sm90", "gfx950"):
        report = json.loads((generated_dir() / arch / "resources.json").read_text())
        assert spill_report(generated_dir(), arch, report) == ([], []), arch
        spilling = [n for n, r in report["variants"].items() if r["spill_bytes"] > 0]
        assert spilling == [], (arch, spilling)
        launches = selected_launches(generated_dir(), arch, report["variants"])
        assert len(launches) > len(report["variants"]) // 2
        if arch == "sm90":  # tuned tables name warps the nominal entries do not have
            own = config_warps(arch)
            tabled = [
                x
                for x in extra_launches(generated_dir(), arch, report["variants"])
                if (parse_name(x.variant).family, x.config) not in own
            ]
            assert tabled


def test_split_topp_searches_launch_at_their_own_warps_on_each_arch() -> None:
    """The split top-p searches (``topp_replay``'s ``CONFIGS`` of a pipeline other than the
    monolithic one) are exactly the sets :func:`config_warps` names, at 256 threads per program
    -- 8 warps of 32 lanes on sm90, 4 wavefronts of 64 on gfx950 -- and the AOT report holds
    each at those warps (on gfx950 they are the variant's own, so no extra launch)."""
    from generator.spills import SPLIT_SEARCHES, config_warps, extra_launches, launch_name
    from shardmax.reference.nucleus_replay import Pipeline
    from shardmax.runtime.defaults import topp_split_replay_warps

    for d in ("bf16", "fp16"):
        mod = importlib.import_module(f"shardmax.generated.topp_replay_{d}")
        split = {
            c for c, over in mod.CONFIGS.items() if over.get("PIPELINE") != Pipeline.MONOLITHIC
        }
        assert split == set(SPLIT_SEARCHES), (d, mod.CONFIGS)
        assert mod.CONSTEXPRS["PIPELINE"] == Pipeline.MONOLITHIC
    assert (topp_split_replay_warps("sm90"), topp_split_replay_warps("gfx950")) == (8, 4)
    for arch in ("sm90", "gfx950"):
        report = json.loads((generated_dir() / arch / "resources.json").read_text())
        per = report["variants"]
        warps = topp_split_replay_warps(arch)
        combine = {("topp_combine", "parts4"): 4} if arch == "sm90" else {}
        assert config_warps(arch) == {
            **{("topp_replay", c): warps for c in SPLIT_SEARCHES},
            **combine,
        }
        extra = {
            launch_name(x, int(per[x.variant]["num_warps"]))
            for x in extra_launches(generated_dir(), arch, per)
            if x.variant.startswith("topp_replay_")
        }
        nominal = {int(per[f"topp_replay_{d}"]["num_warps"]) for d in ("bf16", "fp16")}
        want = (
            set()
            if nominal == {warps}
            else {
                f"topp_replay_{d}@w{warps}[{c}]" for d in ("bf16", "fp16") for c in SPLIT_SEARCHES
            }
        )
        assert extra == want, (arch, extra)
        assert want <= set(report.get("launches", {})), arch


def test_nominal_warps_follow_the_builtin_rule() -> None:
    """A local-stage variant's report entry is compiled at the warps the runtime launches it
    with where no table names any (``default_num_warps``); a kernel that declares
    ``NUM_WARPS`` at those; everything else at 4."""
    from generator.aot import LOCAL_FAMILIES, nominal_warps
    from shardmax.runtime.defaults import builtin_launch, default_num_warps
    from shardmax.runtime.variants import parse_name

    assert nominal_warps("shard_keys_bf16_va16_b4096") == 8
    assert nominal_warps("shard_keys_bf16_va1_b1024") == 4
    assert nominal_warps("sampled_record_bf16_b2048") == 4
    assert nominal_warps("sampled_record_fp32_b4096") == 8  # 16 elements per thread, no spill
    assert nominal_warps("sampled_draw_fp16_b2048") == 8
    pick = importlib.import_module("shardmax.generated.sampled_pick")
    assert nominal_warps("sampled_pick") == pick.NUM_WARPS == 1  # the packaged module's
    manifest = json.loads((generated_dir() / "MANIFEST.json").read_text())
    for name in (v["name"] for v in manifest["variants"]):  # every other kernel fixes its warps
        key = parse_name(name)
        if key.family not in LOCAL_FAMILIES:
            mod = importlib.import_module(f"shardmax.generated.{name}")
            assert nominal_warps(name) == mod.NUM_WARPS, name
        else:
            assert nominal_warps(name) == default_num_warps(key.family, key.block), name
    with pytest.raises(ValueError, match="variant name"):
        nominal_warps("no_such_variant_b2048")
    fin = importlib.import_module("shardmax.generated.sampled_finish_tp2_allgather")
    assert nominal_warps("sampled_finish_tp2_allgather", fin) == fin.NUM_WARPS
    for op, block in (("argmax", 4096), ("verify", 1024), ("sampled", 2048)):
        axes, launch = builtin_launch(op, "bf16", 32, 50016 if block > 1024 else 900, 16, 264)
        assert axes["block"] == block, (op, axes)
        assert launch["num_warps"] == default_num_warps(axes["family"], block)
    for bad in (("shard_keys", 3000), ("sampled_finish", 2048)):
        with pytest.raises(ValueError, match=r"block|family"):
            default_num_warps(*bad)


def test_hip_report_counts_memory_spills_not_sgpr_lane_spills() -> None:
    """A register spilled into another register file (an SGPR into a VGPR lane, a VGPR into an
    AGPR) moves no memory: counted in ``sgpr_spills`` / ``vgpr_spills``, not ``spill_bytes``;
    a spill that lands in memory shows in the scratch size (or the private segment)."""
    from generator.aot import _hip_resources

    def asm(vgpr_spills: int, sgpr_spills: int, scratch: int) -> str:
        return (f"; ScratchSize: {scratch}\n.vgpr_count: 96\n.vgpr_spill_count: {vgpr_spills}\n"
                f".sgpr_count: 106\n.sgpr_spill_count: {sgpr_spills}\n")  # fmt: skip

    lanes = _hip_resources(asm(0, 34, 0))
    assert lanes["spill_bytes"] == 0 and lanes["sgpr_spills"] == 34 and lanes["registers"] == 96
    assert _hip_resources(asm(3, 0, 12))["spill_bytes"] == 12
    agpr = _hip_resources(asm(84, 0, 0))  # VGPRs into AGPRs (sampled_record b4096, 2 warps)
    assert agpr["spill_bytes"] == 0 and agpr["vgpr_spills"] == 84
    seg = asm(5, 0, 0).replace("; ScratchSize: 0\n", "") + ".private_segment_fixed_size: 20\n"
    assert _hip_resources(seg)["spill_bytes"] == 20
    assert _hip_resources(asm(0, 40, 160))["spill_bytes"] == 160
    assert _hip_resources(asm(0, 0, 64))["spill_bytes"] == 0  # a private array, no spill


def _record_topp_launches(monkeypatch) -> list[dict[str, object]]:
    """``shardmax.ops.topp``'s kernel launches recorded (name and keywords), not made."""
    import shardmax.ops.topp as topp

    seen: list[dict[str, object]] = []

    def fake_kernel(name: str):
        def launch(grid, *args, **kwargs):
            seen.append({"name": name, **kwargs})

        launch.module = importlib.import_module(f"shardmax.generated.{name}")  # type: ignore[attr-defined]
        return launch

    monkeypatch.setattr(topp, "kernel", fake_kernel)
    return seen


def test_topp_combine_launch_uses_the_reports_warps(monkeypatch) -> None:
    """The runtime's ``topp_combine`` launch gives the merge of 3-4 splits (``PARTS`` 4) the
    warps the AOT report compiles that set at on this platform (:func:`config_warps`: 4 on
    sm90, where 8 spilled) and leaves the merges of 2 and of 5+ splits at the module's own; the
    report holds the sm90 set at 4 warps, spill-free."""
    import torch

    import shardmax.ops.topp as topp
    from generator.spills import config_warps

    seen = _record_topp_launches(monkeypatch)
    arch = "gfx950" if torch.version.hip else "sm90"
    x = torch.zeros(2, 4096 * 16, dtype=torch.bfloat16)
    t = torch.ones(2)
    out = torch.zeros(2, topp.RECORD_WORDS, dtype=torch.int32)
    for splits in (2, 3, 4, 16):
        scratch = torch.zeros(2 * splits, topp.RECORD_WORDS, dtype=torch.int32)
        counts = torch.zeros(2 * splits, topp.HIST_LEVELS, dtype=torch.int32)
        topp.topp_histograms(x, t, num_valid=x.shape[1], vocab_start=0, block=4096,
                             splits=splits, out=out, scratch=scratch, counts=counts)  # fmt: skip
    combines = [s for s in seen if str(s["name"]).startswith("topp_combine")]
    assert [s["PARTS"] for s in combines] == [2, 4, 4, 8]
    own = config_warps(arch)
    want = [own.get(("topp_combine", f"parts{p}")) for p in (2, 4, 4)] + [None]
    assert [s.get("num_warps") for s in combines] == want
    report = json.loads((generated_dir() / "sm90" / "resources.json").read_text())
    for d in ("bf16", "fp16"):
        entry = report["launches"][f"topp_combine_{d}@w4[parts4]"]
        assert entry["num_warps"] == 4 and entry["spill_bytes"] == 0, entry


def test_split_topp_search_launch_uses_the_reports_warps(monkeypatch) -> None:
    """The runtime's ``topp_replay`` launch (:func:`shardmax.ops.topp._launch_replay`) gives the
    split pipelines the warps the AOT report compiles them at (:func:`config_warps` of this
    platform's arch family) and leaves the monolithic search at the variant's own."""
    import torch

    import shardmax.ops.topp as topp
    from generator.spills import config_warps
    from shardmax.reference.nucleus_replay import Pipeline

    seen = _record_topp_launches(monkeypatch)
    records = torch.zeros(1, 2, topp.RECORD_WORDS, dtype=torch.int32)
    rest = [torch.zeros(2) for _ in range(5)]
    arch = "gfx950" if torch.version.hip else "sm90"
    for pipeline in (Pipeline.MONOLITHIC, Pipeline.SPLIT, Pipeline.SPLIT_V032):
        topp._launch_replay(records, *rest, dtype_name="bf16", pipeline=pipeline, tile0=1)
    assert [s.get("num_warps") for s in seen] == [
        None,
        config_warps(arch)[("topp_replay", "split")],
        config_warps(arch)[("topp_replay", "split_v032")],
    ]
    assert [s["PIPELINE"] for s in seen] == [0, 1, 2]
    configs = importlib.import_module("shardmax.generated.topp_replay_bf16").CONFIGS
    # the split searches' constexpr sets are the module's CONFIGS, which the report compiles
    assert [s["PIVOTS"] for s in seen[1:]] == [configs["split"]["PIVOTS"], 4]
    assert configs["split_v032"]["PIVOTS"] == 4
    seen.clear()  # ``pivots`` is the split searches' alone: the monolithic launch keeps its own
    for pipeline in (Pipeline.MONOLITHIC, Pipeline.SPLIT):
        topp._launch_replay(records, *rest, dtype_name="bf16", pipeline=pipeline, tile0=1, pivots=2)
    assert [s["PIVOTS"] for s in seen] == [
        topp.kernel("topp_replay_bf16").module.CONSTEXPRS["PIVOTS"],
        2,
    ]
