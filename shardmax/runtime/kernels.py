"""Loading and launching the generated kernel variants (``shardmax.generated.<variant name>``).

:func:`load` imports a variant's module; :class:`Kernel` launches its jitted function. Nothing
here decides anything: the variant, grid and launch parameters come from the caller (a plan of
:mod:`shardmax.ops`, which got them from :func:`shardmax.runtime.dispatch.select`).

Host cost. vLLM calls verification eagerly every step, so the Python cost of a launch counts as
much as the GPU time. Triton's own ``kernel[grid](...)`` binds the arguments, reads its knobs,
builds a specialisation key and looks up the compiled kernel on every call. :class:`Kernel`
does that once per argument *signature* (each tensor's dtype and 16-byte alignment, each
specialised integer's ``== 1`` / ``% 16`` / 32-bit facts, the constexprs): the first launch with
a new signature goes through Triton (which compiles or finds the binary), later launches with
the same signature call the compiled kernel's launcher directly. The signature is at least as
fine as Triton's own specialisation, so the binary is always the one Triton would pick.
``SHARDMAX_DIRECT_LAUNCH=0`` turns the direct path off (every launch through Triton). Under the
Triton interpreter (CPU tensors) every launch goes through Triton, inside
``numpy.errstate`` that hides the RuntimeWarnings of lanes that are computed and then discarded
(``-inf - -inf`` in masked lanes, ``x / T`` of greedy rows): the interpreter evaluates every lane
of a ``tl.where`` in numpy, the compiled kernel never computes them.

Programmatic dependent launch (PDL). A variant whose kernel takes a ``PDL`` constexpr (the
templates that include ``_pdl.j2``: every generated kernel) is launched with
``PDL=True`` and Triton's ``launch_pdl`` on a CUDA device of compute capability 9.0 or newer:
the next kernel of the stream (or of a captured graph) is then scheduled while the previous one
finishes, and a shardmax kernel waits at its first statement for the previous kernel's writes,
so a step of several small kernels loses about 0.5-1 us less per kernel between them (the
launch latency; ``benchmarks/results/sm90/sampled_tuned`` measures it). Everywhere else -- the
interpreter, AMD, GPUs before sm90, a Triton that cannot emit it (:func:`triton_has_pdl`),
``SHARDMAX_PDL=0`` in the environment, or :func:`set_pdl` ``(False)`` -- they get ``PDL=False``,
which compiles the wait out: the same kernel a plain launch runs. The outputs are the same bits
either way (tests/test_pdl.py). The constexpr and the launch option always come from the one
decision (:func:`launch_pdl`): a kernel launched early that did not wait would race.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np
import torch
import triton

from shardmax.runtime.variants import parse_name

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
"""Whether Triton was imported with the interpreter on (it must be set before Triton loads)."""
_DIRECT = os.environ.get("SHARDMAX_DIRECT_LAUNCH", "1") != "0"
_PDL_ON = os.environ.get("SHARDMAX_PDL", "1") != "0"
_PDL_DEVICES: dict[int, bool] = {}


def set_pdl(enabled: bool) -> bool:
    """Turn programmatic dependent launch on or off for later launches in this process (module
    docstring; a CUDA graph keeps what was on when it was captured). Returns the previous
    setting. The ``SHARDMAX_PDL`` environment variable (``0``: off) sets the initial one.

    Raises:
        TypeError: ``enabled`` is not a bool.
    """
    global _PDL_ON
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected a bool, got {type(enabled).__name__}")
    previous, _PDL_ON = _PDL_ON, enabled
    return previous


@functools.cache
def triton_has_pdl() -> bool:
    """Whether this Triton can emit PDL: ``gdc_wait`` / ``gdc_launch_dependents`` in
    ``triton.language.extra.cuda`` and ``launch_pdl`` among its CUDA compile options (Triton 3.4
    and newer; the templates only reference them under ``if PDL:``, so older ones compile the
    kernels without)."""
    import dataclasses

    try:
        import triton.language.extra.cuda as cuda_lang
        from triton.backends.nvidia.compiler import CUDAOptions
    except Exception:  # a Triton without the NVIDIA backend
        return False
    return (
        hasattr(cuda_lang, "gdc_wait")
        and hasattr(cuda_lang, "gdc_launch_dependents")
        and "launch_pdl" in {f.name for f in dataclasses.fields(CUDAOptions)}
    )


def pdl_supported(device_index: int) -> bool:
    """Whether the CUDA device ``device_index`` can launch with PDL: kernels compiled (not the
    interpreter) by a Triton that can emit it (:func:`triton_has_pdl`), NVIDIA (not ROCm, whose
    devices may report a capability of 9.x too), compute capability 9.0 or newer. Cached per
    device."""
    got = _PDL_DEVICES.get(device_index)
    if got is None:
        got = _PDL_DEVICES[device_index] = (
            not INTERPRET
            and torch.version.hip is None
            and triton_has_pdl()
            and torch.cuda.get_device_capability(device_index)[0] >= 9
        )
    return got


def launch_pdl(device: int | None) -> bool:
    """Whether a launch on CUDA device ``device`` (the current device: where Triton launches;
    None: not a CUDA launch) uses PDL now: a device that supports it (:func:`pdl_supported`)
    while :func:`set_pdl` is on. The launcher passes the result as both the kernel's ``PDL``
    constexpr and Triton's ``launch_pdl``: a kernel launched early always waits."""
    return device is not None and _PDL_ON and pdl_supported(device)


def check_device(t: torch.Tensor) -> None:
    """CPU tensors run only in the Triton interpreter, which must be on before Triton loads.

    Raises:
        RuntimeError: a CPU tensor while ``TRITON_INTERPRET=1`` was not set at import.
    """
    if t.device.type == "cpu" and not INTERPRET:
        raise RuntimeError(
            "shardmax kernels got CPU tensors but the Triton interpreter is off: set "
            "TRITON_INTERPRET=1 in the environment before importing shardmax/triton (or move "
            "the tensors to a GPU)"
        )


@functools.cache
def load(name: str) -> ModuleType:
    """The generated module of a variant (validated name).

    Raises:
        ValueError: a malformed name, or a variant that is not generated.
    """
    parse_name(name)
    try:
        return importlib.import_module(f"shardmax.generated.{name}")
    except ModuleNotFoundError as e:
        raise ValueError(
            f"variant {name!r} is not in shardmax.generated; run `python -m generator`"
        ) from e


def _knobs() -> Any:
    try:
        from triton import knobs

        return knobs.runtime
    except Exception:  # a Triton without knobs: no direct path
        return None


def launch_key(
    values: Sequence[Any], dns: Sequence[bool], const: Sequence[bool]
) -> tuple[Any, ...] | None:
    """The specialisation key of one launch's arguments (in signature order), at least as fine
    as Triton's own: a constexpr by its value; a tensor by dtype and 16-byte alignment; an int by
    32-bit range and -- unless ``do_not_specialize`` -- ``== 1`` and ``% 16 == 0``; bools, None
    and floats by value; anything else hashable by (type, value). None: an unhashable argument
    (the launch then goes through Triton)."""
    key: list[Any] = []
    add = key.append
    for v, d, c in zip(values, dns, const, strict=True):
        t = type(v)
        if c:
            add((t, v))
        elif t is torch.Tensor or isinstance(v, torch.Tensor):
            add((t, v.dtype, v.data_ptr() & 15 == 0))
        elif t is int:
            add((not -2147483648 <= v < 2147483648,) if d else (
                not -2147483648 <= v < 2147483648, v == 1, v & 15 == 0))  # fmt: skip
        else:
            try:
                hash(v)
            except TypeError:
                return None
            add((t, v))
    return tuple(key)


class Kernel:
    """One generated variant's jitted function with a cheap repeated launch (module docstring).

    ``Kernel(name)(grid, *args, **constexprs)`` launches ``kernel[grid](*args, **constexprs)``;
    ``num_warps`` / ``num_stages`` among the keywords are launch options, as in Triton. A module
    that declares ``NUM_WARPS`` (a kernel launched with fixed warps; the AOT report compiles it
    at them) is launched with them unless ``num_warps`` is given.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.module = load(name)
        self.fn = self.module.kernel
        params = getattr(self.fn, "params", None)
        self._names: Sequence[str] = tuple(getattr(self.fn, "arg_names", ()))
        self._dns = tuple(bool(getattr(p, "do_not_specialize", False)) for p in params or ())
        # constexpr parameters: their VALUE selects the binary (CAND=32 and CAND=64 are two
        # kernels), so the key holds it whole, not only its specialisation facts
        self._const = tuple(bool(getattr(p, "is_constexpr", False)) for p in params or ())
        self._compiled: dict[Any, Any] = {}
        self._knobs = _knobs()
        self.num_warps: int | None = getattr(self.module, "NUM_WARPS", None)
        self._pdl = "PDL" in self._names  # a kernel that includes templates/_pdl.j2
        self._direct = (
            _DIRECT
            and not INTERPRET
            and self._knobs is not None
            and len(self._dns) == len(self._names) == len(self._const) > 0
            and any(self._const)
        )

    def __repr__(self) -> str:
        return f"Kernel({self.name!r})"

    def __call__(self, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        if self.num_warps is not None and "num_warps" not in kwargs:
            kwargs["num_warps"] = self.num_warps
        first = args[0] if args else None
        # the current device, read once per launch (PDL's decision and the compiled-launch key)
        device = (
            torch._C._cuda_getDevice() if type(first) is torch.Tensor and first.is_cuda else None
        )
        if self._pdl:
            on = launch_pdl(device)
            kwargs["PDL"] = on  # the same flag for both: a kernel launched early always waits
            if on:
                kwargs["launch_pdl"] = True
        if not self._direct or device is None:
            if isinstance(first, torch.Tensor) and first.device.type == "cpu":
                check_device(first)
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                self.fn[grid](*args, **kwargs)
            return
        values = list(args)
        n = len(values)
        for name in self._names[n:]:
            if name not in kwargs:  # a default value: bound by Triton, not part of our key
                return self._slow(grid, args, kwargs, None)
            values.append(kwargs[name])
        key = launch_key(values, self._dns, self._const)
        if key is None:
            return self._slow(grid, args, kwargs, None)
        key = (
            key,
            kwargs.get("num_warps"),
            kwargs.get("num_stages"),
            kwargs.get("launch_pdl"),
            device,
        )
        compiled = self._compiled.get(key)
        if compiled is None:
            return self._slow(grid, args, kwargs, key)
        knobs = self._knobs
        stream = torch._C._cuda_getCurrentRawStream(device)
        g = (*tuple(grid), 1, 1)[:3]
        enter, leave = knobs.launch_enter_hook, knobs.launch_exit_hook
        try:
            meta = compiled.launch_metadata(grid, stream, *values) if enter is not None else None
            compiled.run(
                g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, meta,
                enter, leave, *values,
            )  # fmt: skip
        except (TypeError, AttributeError) as e:  # a Triton whose launcher differs: use its own
            self._direct = False
            self._compiled.clear()
            warnings.warn(
                f"shardmax: direct launch of {self.name} unavailable with Triton "
                f"{triton.__version__} ({type(e).__name__}: {e}); launching through Triton",
                RuntimeWarning,
                stacklevel=2,
            )
            self._slow(grid, args, kwargs, None)

    def _slow(self, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: Any, key: Any) -> None:
        compiled = self.fn[grid](*args, **kwargs)
        if key is not None and hasattr(compiled, "packed_metadata"):
            self._compiled[key] = compiled


@functools.cache
def kernel(name: str) -> Kernel:
    """The :class:`Kernel` of a variant (one per process, so its compiled-launch cache is shared
    by every plan)."""
    return Kernel(name)
