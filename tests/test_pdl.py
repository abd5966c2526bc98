"""Programmatic dependent launch (PDL; ``templates/_pdl.j2``, ``shardmax.runtime.kernels``).

The one rule that makes PDL safe: a kernel launched with it waits for the previous kernel
(``gdc_wait``) before it touches memory, so it reads and writes what a plain launch would. The
structural test checks that rule on every generated kernel that takes ``PDL``; the AOT test that
the wait is in the sm90 binary and not in the gfx950 one; the GPU tests that a verification step
gives the same bits with PDL on and off, eagerly and replayed, and that PDL is really on.
"""

from __future__ import annotations

import inspect
import json
import textwrap

import pytest
import torch

from generator.render import generated_dir
from shardmax.runtime import kernels
from tests._aot import run_compiled
from tests.test_graphs import (
    _batch,
    _equal,
    _plan,
    _shard,
    _sigma_table,  # noqa: F401  (autouse: top_p_hist's sigma table)
    _steps,
)


def _variants() -> list[str]:
    manifest = json.loads((generated_dir() / "MANIFEST.json").read_text())
    return sorted(v["name"] for v in manifest["variants"])


def _pdl_modules():
    return [m for m in map(kernels.load, _variants()) if "PDL" in m.SIGNATURE]


def test_every_kernel_takes_pdl_off_by_default() -> None:
    """Every generated kernel (every family of the manifest) takes PDL, off unless launched."""
    mods = _pdl_modules()
    assert len(mods) == len(_variants()) and {m.FAMILY for m in mods} >= {
        "shard_keys", "sampled_record", "sampled_draw", "topp_hist", "resolve_apply", "table_fetch"
    }  # fmt: skip
    for m in mods:
        assert m.SIGNATURE["PDL"] == "constexpr" and m.CONSTEXPRS["PDL"] is False, m.NAME


def test_the_wait_comes_before_any_memory_access() -> None:
    """The kernel's first statement is the PDL block: nothing (no load, no store, no atomic,
    not the indirect logits' address) runs before ``gdc_wait``."""
    for m in _pdl_modules():
        src = textwrap.dedent(inspect.getsource(m.kernel.fn))
        body = src[src.index("\n):") + 3 :].lstrip("\n").splitlines()
        code = [ln.strip() for ln in body if ln.strip() and not ln.strip().startswith("#")]
        assert code[0].startswith("if PDL:"), (m.NAME, code[:3])
        assert code[1] == "tl.extra.cuda.gdc_wait()", (m.NAME, code[:3])
        assert code[2] == "tl.extra.cuda.gdc_launch_dependents()", (m.NAME, code[:3])


def test_set_pdl_returns_the_previous_setting_and_checks_its_argument() -> None:
    before = kernels.set_pdl(False)
    try:
        assert kernels.set_pdl(True) is False
        assert kernels.set_pdl(False) is True
        with pytest.raises(TypeError, match="enabled: expected a bool"):
            kernels.set_pdl(1)  # type: ignore[arg-type]
    finally:
        kernels.set_pdl(before)


class _Spy:
    """Stands in for a jitted function: records the keywords of each launch."""

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def __getitem__(self, grid):
        return lambda *a, **kw: self.seen.append(kw)


@pytest.mark.skipif(not kernels.INTERPRET, reason="the interpreter only")
def test_the_interpreter_never_launches_with_pdl(monkeypatch: pytest.MonkeyPatch) -> None:
    k = kernels.Kernel("row_params")
    spy = _Spy()
    monkeypatch.setattr(k, "fn", spy)
    k((1,), torch.zeros(2, dtype=torch.int32), KP1_P2=4)
    assert spy.seen and spy.seen[0]["PDL"] is False and "launch_pdl" not in spy.seen[0]
    assert not kernels.pdl_supported(0) and not kernels.launch_pdl(None)


@pytest.mark.skipif(not kernels.INTERPRET, reason="the interpreter only")
@pytest.mark.parametrize("on", [True, False])
def test_the_constexpr_and_the_launch_option_always_agree(
    monkeypatch: pytest.MonkeyPatch, on: bool
) -> None:
    """A kernel launched with ``launch_pdl`` that did not wait could read what its predecessor
    has not written yet: the launcher sets both from the one decision."""
    monkeypatch.setattr(kernels, "launch_pdl", lambda device: on)
    k = kernels.Kernel("sampled_pick")
    spy = _Spy()
    monkeypatch.setattr(k, "fn", spy)
    k((1,), torch.zeros(2, dtype=torch.int64), K=3)
    assert spy.seen[0]["PDL"] is on and spy.seen[0].get("launch_pdl", False) is on


@pytest.mark.parametrize(
    ("interpret", "hip", "triton_pdl", "major", "want"),
    [
        (False, None, True, 9, True),  # H100 / H200
        (False, None, True, 10, True),  # Blackwell
        (False, None, True, 8, False),  # A100: no PDL
        (False, "6.4", True, 9, False),  # ROCm: MI300-class devices report 9.x
        (False, None, False, 9, False),  # a Triton without gdc_wait / launch_pdl
        (True, None, True, 9, False),  # the interpreter
    ],
)
def test_pdl_support_needs_nvidia_sm90_and_a_triton_that_emits_it(
    monkeypatch: pytest.MonkeyPatch, interpret, hip, triton_pdl, major, want
) -> None:
    monkeypatch.setattr(kernels, "_PDL_DEVICES", {})
    monkeypatch.setattr(kernels, "INTERPRET", interpret)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(kernels, "triton_has_pdl", lambda: triton_pdl)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (major, 0))
    assert kernels.pdl_supported(0) is want


def test_this_triton_can_emit_pdl() -> None:
    """The newest Triton (CI) and Triton 3.6 (the H200 image) both can: PDL is not silently off."""
    assert kernels.triton_has_pdl()


_AOT_SCRIPT = """
import json, sys
from generator.aot import build, load_module
from generator.render import generated_dir
from generator.space import ARCHES
out = {}
for name in json.loads(sys.argv[1]):
    mod = load_module(generated_dir() / f"{name}.py")
    for arch, asm in (("sm90", "ptx"), ("gfx950", "amdgcn")):
        c = build(mod, mod.CONSTEXPRS, ARCHES[arch], getattr(mod, "NUM_WARPS", 4))
        out[f"{name}/{arch}"] = ["griddepcontrol.wait" in c.asm[asm], bool(getattr(c.metadata, "launch_pdl", False))]
print(json.dumps(out))
"""


def test_the_generator_compiles_sm90_with_pdl_and_gfx950_without() -> None:
    """The AOT compile (the generator's own ``build``, at the module's CONSTEXPRS, where PDL is
    off): on sm90 the binary waits and is marked for launch_pdl, on gfx950 neither."""
    got = run_compiled(_AOT_SCRIPT, ["row_params", "sampled_pick"])
    assert got == {
        "row_params/sm90": [True, True],
        "row_params/gfx950": [False, False],
        "sampled_pick/sm90": [True, True],
        "sampled_pick/gfx950": [False, False],
    }


@pytest.mark.gpu
@pytest.mark.parametrize("mix", ["greedy", "temperature", "top_p", "top_p_hist"])
@pytest.mark.parametrize("reqs", [1, 96])
def test_gpu_pdl_on_and_off_give_the_same_bits(mix: str, reqs: int) -> None:
    """The same steps with PDL on and off, each eagerly and replayed from a CUDA graph twice:
    every output equal bit for bit; with PDL on the kernels were really compiled for it."""
    if not kernels.pdl_supported(torch.cuda.current_device()):
        pytest.skip("PDL needs compute capability 9.0")
    vocab = 200064
    steps = _steps(mix, vocab, reqs, 4, "cuda")
    rows = steps[0].logits.shape[0]
    outs = {}
    before = kernels.set_pdl(True)
    try:
        for on in (True, False):
            kernels.set_pdl(on)
            shard = _shard(vocab, torch.bfloat16, "cuda")
            plan = _plan(shard, rows, mix)
            step = shard.graphed(plan)
            got = []
            for t in steps:
                batch = _batch(t, mix)
                got.append(plan.run(t.logits, batch))
                got.append(step.run(t.logits.clone(), batch))
                got.append(step.run(t.logits.clone(), batch))
            torch.cuda.synchronize()
            outs[on] = got
    finally:
        kernels.set_pdl(before)
    for i, (a, b) in enumerate(zip(outs[True], outs[False], strict=True)):
        assert _equal(a, b), f"call {i}: PDL on != off"
    # the step's first kernel, compiled for PDL when on and without it when off
    fam = "shard_keys" if mix == "greedy" else "row_params"
    launched = {
        c.metadata.launch_pdl
        for name in _variants()
        if name.startswith(fam)
        for c in kernels.kernel(name)._compiled.values()
    }
    assert launched == {True, False}, launched
    # every binary this process launched: it waits exactly when it was launched with PDL
    for name in _variants():
        for c in kernels.kernel(name)._compiled.values():
            assert ("griddepcontrol.wait" in c.asm["ptx"]) == bool(c.metadata.launch_pdl), name
