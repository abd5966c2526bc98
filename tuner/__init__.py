"""shardmax tuner: Optuna sweeps that fill the per-arch tables ``generated/<arch>/<op>.json``.

Run from the repository as ``python -m tuner`` or, installed, as ``shardmax-tune``
(this folder ships as ``shardmax.tuner``). See ``tuner/README.md``.

Modules (relative imports inside the package, absolute ``shardmax.*`` for the runtime):

* :mod:`.problems`  real model geometries and row buckets (the bucket keys of the tables)
* :mod:`.space`     statically pruned search space of one bucket (:class:`.space.Config`)
* :mod:`.objective` exactness gate (``TrialPruned`` on any mismatch), then timing
* :mod:`.timing`    CUDA-graph replay timing, medians with p20/p80 (imports without optuna)
* :mod:`.study`     one Optuna study per (arch, op, bucket), journal storage, resume
* :mod:`.export`    re-verify, interleaved re-measure, hysteresis, table write/merge
* :mod:`.plot`      one PNG per table
"""

from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    from .__main__ import main as _main

    return _main(argv)
