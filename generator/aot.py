"""Ahead-of-time compile of generated variants for sm90 / gfx950 on a machine without a GPU.

``triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget(...))`` lowers a kernel
to PTX + cubin (cuda) or AMDGCN + hsaco (hip) without a device. The resource report (registers,
spills, scratch, shared memory) goes to ``generated/<arch>/resources.json`` so that the tuner
can prune spilling points before timing (design §4) and CI proves every variant compiles for
both targets. A module that declares ``NUM_WARPS`` (a kernel always launched with those warps)
is compiled at them, the others at 4 warps.

``spill_bytes`` is memory: local-memory spill stores + loads per thread (ptxas, cuda); on hip
the scratch bytes per lane of a kernel that spills. On gfx950 a spilled VGPR first goes to an
AGPR (``v_accvgpr_write``) and an SGPR into a VGPR lane (``v_writelane``), neither in memory;
only what does not fit there lands in scratch, which the scratch size shows. ``vgpr_spills`` /
``sgpr_spills`` (hip) count the registers spilled, wherever they went.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from .space import ARCHES, ArchLimits


def load_module(path: Path) -> ModuleType:
    """Import a generated module from its file (Triton needs real source files)."""
    spec = importlib.util.spec_from_file_location(f"_shardmax_aot_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cuda_resources(ptx: str) -> dict[str, int]:
    from triton.backends.nvidia.compiler import get_ptxas

    getter: Any = get_ptxas
    try:
        ptxas = getter(90)  # Triton >= 3.5 picks the ptxas build per arch
    except TypeError:
        ptxas = getter()
    path = getattr(ptxas, "path", ptxas)
    m = re.search(r"^\.target\s+(sm_\w+)", ptx, re.MULTILINE)
    target = m.group(1) if m else "sm_90a"
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        Path(src).write_text(ptx)
        out = subprocess.run(
            [str(path), "-v", f"--gpu-name={target}", src, "-o", os.path.join(tmp, "k.cubin")],
            capture_output=True,
            text=True,
            check=False,
        )
    log = out.stderr + out.stdout
    if out.returncode != 0:
        raise RuntimeError(f"ptxas failed for {target}: {log.strip()[:2000]}")
    regs = re.search(r"Used (\d+) registers", log)
    spill_st = re.search(r"(\d+) bytes spill stores", log)
    spill_ld = re.search(r"(\d+) bytes spill loads", log)
    stack = re.search(r"(\d+) bytes stack frame", log)
    return {
        "registers": int(regs.group(1)) if regs else -1,
        "spill_bytes": (int(spill_st.group(1)) if spill_st else 0)
        + (int(spill_ld.group(1)) if spill_ld else 0),
        "stack_bytes": int(stack.group(1)) if stack else 0,
    }


def _hip_resources(amdgcn: str) -> dict[str, int]:
    def field(name: str) -> int:
        m = re.search(rf"\.{name}:\s+(\d+)", amdgcn)
        return int(m.group(1)) if m else -1

    m = re.search(r"; ScratchSize: (\d+)", amdgcn)
    scratch = max(int(m.group(1)) if m else 0, field("private_segment_fixed_size"), 0)
    vgpr, sgpr = max(field("vgpr_spill_count"), 0), max(field("sgpr_spill_count"), 0)
    return {
        "registers": field("vgpr_count"),
        "spill_bytes": scratch if vgpr or sgpr else 0,
        "vgpr_spills": vgpr,
        "sgpr_spills": sgpr,
        "stack_bytes": scratch,
    }


def build(mod: ModuleType, constexprs: dict[str, Any], arch: ArchLimits, num_warps: int) -> Any:
    """Triton's compiled kernel of ``mod`` for ``arch`` at ``constexprs``, as the runtime
    launches it: a kernel that takes ``PDL`` gets it (and ``launch_pdl``) on sm90 when this
    Triton can emit it (:func:`shardmax.runtime.kernels.triton_has_pdl`), never on AMD."""
    import triton
    from triton.backends.compiler import GPUTarget

    from shardmax.runtime.kernels import triton_has_pdl

    target = GPUTarget(arch.backend, arch.target_arch, arch.warp_size)
    options: dict[str, Any] = {"num_warps": num_warps}
    constexprs = dict(constexprs)
    if "PDL" in mod.SIGNATURE:
        constexprs["PDL"] = arch.backend == "cuda" and triton_has_pdl()
        if constexprs["PDL"]:
            options["launch_pdl"] = True
    src = triton.compiler.ASTSource(
        fn=mod.kernel, signature=dict(mod.SIGNATURE), constexprs=constexprs
    )
    return triton.compile(src, target=target, options=options)


def _compile(
    mod: ModuleType, constexprs: dict[str, Any], arch: ArchLimits, num_warps: int
) -> dict[str, Any]:
    compiled = build(mod, constexprs, arch, num_warps)
    if arch.backend == "cuda":
        res = _cuda_resources(compiled.asm["ptx"])
    else:
        res = _hip_resources(compiled.asm["amdgcn"])
    res["shared_bytes"] = int(compiled.metadata.shared)
    res["num_warps"] = num_warps
    return res


def compile_variant(mod: ModuleType, arch: ArchLimits, num_warps: int = 4) -> dict[str, Any]:
    """Compile one generated module for ``arch`` at its ``CONSTEXPRS``; returns its resource
    record (at the module's ``NUM_WARPS`` when it declares them). A module's ``CONFIGS`` (``{name: constexpr overrides}``: other constexpr sets the
    runtime launches, e.g. the record kernel's phase 1) are compiled too, under
    ``record["configs"][name]``."""
    num_warps = getattr(mod, "NUM_WARPS", num_warps)
    res = _compile(mod, mod.CONSTEXPRS, arch, num_warps)
    configs = getattr(mod, "CONFIGS", {})
    if configs:
        res["configs"] = {
            name: _compile(mod, {**mod.CONSTEXPRS, **over}, arch, num_warps)
            for name, over in sorted(configs.items())
        }
    return res


def compile_all(
    gen_dir: Path,
    names: list[str],
    arches: list[str],
    on_compiled: Callable[[str, str], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Compile every named variant for every arch: ``{arch: {name: record}}``.

    ``on_compiled(arch, name)`` is called after each compile (progress). Raises RuntimeError
    naming the variant and arch on the first compile failure.
    """
    import triton

    result: dict[str, dict[str, Any]] = {}
    for arch_id in arches:
        arch = ARCHES[arch_id]
        records: dict[str, Any] = {}
        for name in names:
            mod = load_module(gen_dir / f"{name}.py")
            try:
                records[name] = compile_variant(mod, arch)
            except Exception as e:  # report which variant failed, keep the cause
                raise RuntimeError(f"AOT compile of {name} for {arch_id} failed: {e}") from e
            if on_compiled is not None:
                on_compiled(arch_id, name)
        result[arch_id] = {"triton_version": triton.__version__, "variants": records}
    return result
