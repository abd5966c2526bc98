"""shardmax benchmarks: local kernel (1 GPU) and whole TP2 step (2 GPUs, NCCL), CSV + PNG + SUMMARY.

From any directory once shardmax is installed (``pip install -e .`` or the wheel; this folder
ships as ``shardmax.benchmarks``)::

    shardmax-bench [--part local|step|all] [--quick] [--out DIR]      # = python -m shardmax.benchmarks
    python -m benchmarks ...                                          # the same, from the repo root
    python -m benchmarks.report --in benchmarks/results/sm90     # CSV -> PNG + SUMMARY.md (CPU)

Results go to ``benchmarks/results/<arch>/`` (a GPU run), or to the git-ignored
``benchmarks/results/interpreter/`` for a CPU run under the Triton interpreter (``--interpreter``
or ``--smoke``), and only from a complete run (see :mod:`benchmarks.__main__`).

Works from a plain checkout too: the GPU parts call :func:`ensure_shardmax_layout`, which maps
the repository's ``generated/`` and ``generator/`` folders to ``shardmax.generated`` and
``shardmax.generator`` when those are not importable (no ``pip install -e .``), as
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
    """Make ``shardmax.generated`` / ``shardmax.generator`` importable from a checkout that
    was not pip-installed (no-op when they are)."""
    for sub in ("generated", "generator"):
        name = f"shardmax.{sub}"
        try:
            importlib.import_module(name)
            continue
        except ModuleNotFoundError:
            pass
        init = ROOT / sub / "__init__.py"
        if not init.exists():
            continue
        import shardmax

        spec = importlib.util.spec_from_file_location(
            name, init, submodule_search_locations=[str(init.parent)]
        )
        if spec is None or spec.loader is None:
            continue
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        setattr(shardmax, sub, mod)
