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


@pytest.mark.skipif(not kernels.INTERPRET, reason="the interpreter only")
def test_the_interpreter_never_launches_with_pdl(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict] = []
    k = kernels.Kernel("row_params")

    class _Spy:
        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append(kw)

    monkeypatch.setattr(k, "fn", _Spy())
    k((1,), torch.zeros(2, dtype=torch.int32), KP1_P2=4)
    assert seen and seen[0]["PDL"] is False and "launch_pdl" not in seen[0]
    assert not kernels.pdl_supported(0)


_AOT_SCRIPT = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from generator.aot import compile_variant, load_module
from generator.render import generated_dir
from generator.space import ARCHES
out = {}
for name in json.loads(sys.argv[1]):
    mod = load_module(generated_dir() / f"{name}.py")
    for arch, asm in (("sm90", "ptx"), ("gfx950", "amdgcn")):
        a = ARCHES[arch]
        compile_variant(mod, a)  # the generator's own compile (PDL on for cuda)
        src = triton.compiler.ASTSource(
            fn=mod.kernel, signature=dict(mod.SIGNATURE),
            constexprs={**mod.CONSTEXPRS, "PDL": a.backend == "cuda"},
        )
        opts = {"num_warps": getattr(mod, "NUM_WARPS", 4)}
        if a.backend == "cuda":
            opts["launch_pdl"] = True
        c = triton.compile(src, target=GPUTarget(a.backend, a.target_arch, a.warp_size), options=opts)
        out[f"{name}/{arch}"] = "griddepcontrol.wait" in c.asm[asm]
print(json.dumps(out))
"""


def test_sm90_binaries_wait_and_gfx950_ones_do_not() -> None:
    got = run_compiled(_AOT_SCRIPT, ["row_params", "sampled_pick"])
    assert got == {
        "row_params/sm90": True,
        "row_params/gfx950": False,
        "sampled_pick/sm90": True,
        "sampled_pick/gfx950": False,
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
