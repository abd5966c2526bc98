"""shardmax benchmarks: local kernel (1 GPU) and whole TP2 step (2 GPUs, NCCL), CSV + PNG + SUMMARY.

Run from the repository root::

    python -m benchmarks [--part local|step|all] [--quick] [--out DIR]
    python -m benchmarks.report --in benchmarks/results/sm90     # CSV -> PNG + SUMMARY.md (CPU)

Not part of the installed package. Works from a plain checkout too: the GPU parts call
:func:`ensure_shardmax_layout`, which maps the repository's ``generated/`` folder to
``shardmax.generated`` when that is not importable (no ``pip install -e .``), as
``pyproject.toml``'s ``package-dir`` does for an install. Importing this package imports nothing
heavy (the report runs without torch).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def ensure_shardmax_layout() -> None:
    """Make ``shardmax.generated`` importable from a checkout that was not pip-installed."""
    try:
        importlib.import_module("shardmax.generated")
        return
    except ModuleNotFoundError:
        pass
    init = ROOT / "generated" / "__init__.py"
    if not init.exists():
        return
    import shardmax

    spec = importlib.util.spec_from_file_location(
        "shardmax.generated", init, submodule_search_locations=[str(init.parent)]
    )
    if spec is None or spec.loader is None:
        return
    mod = importlib.util.module_from_spec(spec)
    sys.modules["shardmax.generated"] = mod
    spec.loader.exec_module(mod)
    shardmax.generated = mod  # type: ignore[attr-defined]
