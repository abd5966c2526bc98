"""Ahead-of-time compile of generated variants for sm90 / gfx950 on a machine without a GPU.

``triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget(...))`` lowers a kernel
to PTX + cubin (cuda) or AMDGCN + hsaco (hip) without a device. The resource report (registers,
spills, scratch, shared memory) goes to ``generated/<arch>/resources.json`` so that the tuner
can prune spilling points before timing (design §4) and CI proves every variant compiles for
both targets. A module that declares ``NUM_WARPS`` (a kernel always launched with those warps)
is compiled at them, a local-stage variant at its built-in warps (:func:`nominal_warps`), the
others at 4; the launches the arch's tables select at other warps are compiled apart
(:func:`compile_launch`; ``generator/spills.py`` names them).

``spill_bytes`` is memory: local-memory spill stores + loads per thread (ptxas, cuda); on hip
the scratch bytes per lane of a kernel that spills. On gfx950 a spilled VGPR first goes to an
AGPR (``v_accvgpr_write``) and an SGPR into a VGPR lane (``v_writelane``), neither in memory;
only what does not fit there lands in scratch, which the scratch size shows. ``vgpr_spills`` /
``sgpr_spills`` (hip) count the registers spilled, wherever they went.
"""

from __future__ import annotations

import functools
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


LOCAL_FAMILIES = ("shard_keys", "sampled_record", "sampled_draw")
"""Families whose warps a table row (or the built-in rule) chooses per launch."""


def nominal_warps(name: str, mod: ModuleType | None = None) -> int:
    """The warps a variant's report entry is compiled at: the module's ``NUM_WARPS`` (a kernel
    always launched with them; ``mod``, else the packaged ``shardmax.generated.<name>``); a local-stage variant's built-in warps
    (:func:`shardmax.runtime.defaults.default_num_warps`: what the runtime launches where no
    table row names warps); 4 otherwise. The warps a table row names may differ: those launches
    are compiled apart (:func:`compile_launch`, ``resources.json``'s ``launches``)."""
    from shardmax.runtime.defaults import default_num_warps
    from shardmax.runtime.variants import parse_name

    if mod is None:  # the packaged module (its NUM_WARPS)
        try:
            mod = importlib.import_module(f"shardmax.generated.{name}")
        except ModuleNotFoundError:
            mod = None
    if mod is not None and hasattr(mod, "NUM_WARPS"):
        return int(mod.NUM_WARPS)
    key = parse_name(name)
    if key.family in LOCAL_FAMILIES and key.block is not None:
        return default_num_warps(key.family, key.block)
    return 4


def compile_variant(mod: ModuleType, arch: ArchLimits, num_warps: int = 4) -> dict[str, Any]:
    """Compile one generated module for ``arch`` at its ``CONSTEXPRS``; returns its resource
    record (at the module's ``NUM_WARPS`` when it declares them, else ``num_warps``). A module's
    ``CONFIGS`` (``{name: constexpr overrides}``: other constexpr sets the runtime launches,
    e.g. the record kernel's phase 1) are compiled too, under ``record["configs"][name]``."""
    num_warps = getattr(mod, "NUM_WARPS", num_warps)
    res = _compile(mod, mod.CONSTEXPRS, arch, num_warps)
    configs = getattr(mod, "CONFIGS", {})
    if configs:
        res["configs"] = {
            name: _compile(mod, {**mod.CONSTEXPRS, **over}, arch, num_warps)
            for name, over in sorted(configs.items())
        }
    return res


def compile_launch(
    mod: ModuleType, arch: ArchLimits, num_warps: int, config: str | None = None
) -> dict[str, Any]:
    """The resource record of one launch of a generated module: ``num_warps`` warps, its
    ``CONSTEXPRS`` with the ``CONFIGS[config]`` overrides (none: the defaults).

    Raises:
        ValueError: ``config`` not one of the module's ``CONFIGS``.
    """
    configs = getattr(mod, "CONFIGS", {})
    if config is not None and config not in configs:
        raise ValueError(f"config: {config!r} is not one of the module's CONFIGS {sorted(configs)}")
    over = configs[config] if config is not None else {}
    return _compile(mod, {**mod.CONSTEXPRS, **over}, arch, num_warps)


@functools.cache
def launch_resources(
    gen_dir: str, arch: str, name: str, num_warps: int, config: str | None = None
) -> dict[str, Any]:
    """:func:`compile_launch` of variant ``name`` in ``gen_dir`` for ``arch`` (an id of
    :data:`~generator.space.ARCHES`), cached per process (the tuner asks once per point). Needs
    real Triton kernels: not under ``TRITON_INTERPRET=1``.

    Raises:
        KeyError: an unknown arch. RuntimeError: the compile failed (named).
    """
    mod = load_module(Path(gen_dir) / f"{name}.py")
    try:
        return compile_launch(mod, ARCHES[arch], num_warps, config)
    except ValueError:
        raise
    except Exception as e:  # name the launch, keep the cause
        raise RuntimeError(
            f"AOT compile of {name} at {num_warps} warps"
            f"{'' if config is None else f' [{config}]'} for {arch} failed: {e}"
        ) from e


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
                records[name] = compile_variant(mod, arch, nominal_warps(name, mod))
            except Exception as e:  # report which variant failed, keep the cause
                raise RuntimeError(f"AOT compile of {name} for {arch_id} failed: {e}") from e
            if on_compiled is not None:
                on_compiled(arch_id, name)
        result[arch_id] = {"triton_version": triton.__version__, "variants": records}
    return result
