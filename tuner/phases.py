"""One-pass or two-phase per ``sampled`` table row, and phase 1's launch, from a measured step
benchmark (issue 22).

The ``sampled`` buckets are tuned on candidate steps (top-k / top-p), which always run one pass;
whether a step WITHOUT candidates runs two-phase, and with which phase-1 launch, is a separate
measurement: ``python -m benchmarks.sampled_local --phase1-sweep ...`` times, per (TP, rows) on
one rank's shard in the same run, the one-pass step, the two-phase step and the two-phase step
with every phase-1 launch of the sweep (block, programs per row, warps; each run's outputs
compared with the two-phase step's).

The benchmark emulates the exchanges in-process (a tile of rank 0's bytes), so it does not see
the latency of the second all_gather a two-phase step adds on real GPUs. ``--exchange-from``
adds it: the graph-replay p50 of the smallest collective (``collective/
floor_allreduce_int64``) of a 2-GPU ``benchmarks`` step run at the nearest row count, charged to
every TP > 1 (TP 4 / 8 collectives are no faster, so this is a lower bound there). Without it
the choice is the emulated one.

:func:`apply_phases` writes, into every row of the table: ``launch["phases"]`` = 2 where the
best two-phase time plus that exchange was below the one-pass time at the measured row count
that stands for the row's bucket (the largest measured count ``<= rows_le``, else the smallest
measured), else 1; ``launch["phase1"]`` = the fastest phase-1 launch of the sweep there (only
on two-phase rows, only when the CSV has a sweep; its splits are capped to each row's width by
the dispatcher; a launch that spills on the arch is never chosen, :func:`phase1_usable`); the
measured times next to it. Rows of a TP that was not measured, and the
catch-all, take TP 1's answer at the bucket (the catch-all: at the largest measured count). The
table's provenance records the sources.

    python -m tuner --phases-from benchmarks/results/sm90/sampled_sweep/sampled_local.csv \\
        --exchange-from benchmarks/results/sm90/step_tp2.csv --arch sm90
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from shardmax.runtime.dispatch import validate_table

from .export import dump_table, table_path

_SWEEP = re.compile(r"^two_phase_p1_b(\d+)_s(\d+)_w(\d+)$")


class Measured(NamedTuple):
    """One (TP, rows) of the benchmark: graph p50 us of each way to run the step."""

    one_pass: float
    two_phase: float  # the fastest two-phase run (the table's launch or a sweep's)
    phase1: dict[str, int] | None  # the sweep's fastest phase-1 launch, None without a sweep
    exchange: float  # the second exchange's latency charged to two-phase (0 at TP 1)

    @property
    def phases(self) -> int:
        return 2 if self.two_phase + self.exchange < self.one_pass else 1


def exchange_latency(csv_path: Path) -> dict[int, float]:
    """``rows -> p50 us`` of the smallest collective in a 2-GPU step CSV
    (``benchmarks/results/<arch>/step_tp2.csv``: op ``collective``, path
    ``floor_allreduce_int64``).

    Raises:
        ValueError: the CSV has no such rows.
    """
    out: dict[int, float] = {}
    for r in _rows(csv_path, ("op", "path", "rows", "p50_us")):
        if r["op"] == "collective" and r["path"] == "floor_allreduce_int64":
            us = _number(csv_path, r, "p50_us", float)
            if us is not None:
                out[_number(csv_path, r, "rows", int, required=True)] = us
    if not out:
        raise ValueError(f"{csv_path}: no collective/floor_allreduce_int64 measurements")
    return out


def _rows(csv_path: Path, need: tuple[str, ...]) -> list[dict[str, str]]:
    """The CSV's rows (missing trailing fields read as ""); ValueError naming the file when a
    column of ``need`` is absent."""
    with csv_path.open() as f:
        reader = csv.DictReader(f)
        missing = [c for c in need if c not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(f"{csv_path}: no {', '.join(missing)} column (a benchmarks CSV?)")
        return [{k: v or "" for k, v in r.items() if k is not None} for r in reader]


def _number(
    csv_path: Path, r: dict[str, str], field: str, kind: Any, *, required: bool = False
) -> Any:
    """``kind(r[field])``; None for an empty or non-finite value (a measurement that did not
    happen) unless ``required``. ValueError naming the file, field and value otherwise."""
    raw = r.get(field, "")
    if raw == "" and not required:
        return None
    try:
        v = kind(raw)
    except ValueError:
        raise ValueError(f"{csv_path}: {field}={raw!r} is not a number") from None
    if kind is float and not math.isfinite(v):
        if required:
            raise ValueError(f"{csv_path}: {field}={raw!r} is not finite")
        return None
    return v


def _nearest(by_rows: dict[int, float], rows: int) -> float:
    return by_rows[min(by_rows, key=lambda n: (abs(n - rows), n))]


def measured_phases(
    csv_path: Path,
    exchange: dict[int, float] | None = None,
    usable: Callable[[dict[str, int]], bool] | None = None,
) -> dict[tuple[int, int], Measured]:
    """``(tp, rows) -> Measured`` of a ``sampled_local`` CSV; ``exchange``: rows -> us of the
    second exchange (:func:`exchange_latency`), charged at TP > 1. Sweep runs whose outputs did
    not agree with the two-phase step's are ignored, and so are phase-1 launches ``usable``
    rejects (:func:`phase1_usable`: those that spill on the arch).

    Raises:
        ValueError: the CSV has no one_pass / two_phase pair.
    """
    p50: dict[tuple[int, int, str], float] = {}
    sweep: dict[tuple[int, int], list[tuple[float, dict[str, int]]]] = {}
    for r in _rows(csv_path, ("tp", "rows", "method", "p50_us")):
        us = _number(csv_path, r, "p50_us", float)
        if r.get("kernel") or us is None:
            continue
        tp = _number(csv_path, r, "tp", int, required=True)
        key, method = (tp, _number(csv_path, r, "rows", int, required=True)), r["method"]
        if method in ("one_pass", "two_phase"):
            p50[(*key, method)] = us
        hit = _SWEEP.match(method)
        if hit and (r.get("note") or "").startswith("agrees"):
            b, s, w = (int(g) for g in hit.groups())
            launch = {"block": b, "splits": s, "num_warps": w}
            if usable is None or usable(launch):
                sweep.setdefault(key, []).append((us, launch))
    out = {}
    for (tp, rows, m), one in p50.items():
        if m != "one_pass" or (tp, rows, "two_phase") not in p50:
            continue
        two, p1 = p50[(tp, rows, "two_phase")], None
        if (tp, rows) in sweep:
            best, p1 = min(sweep[(tp, rows)], key=lambda t: t[0])
            two = min(two, best)
        extra = _nearest(exchange, rows) if exchange and tp > 1 else 0.0
        out[(tp, rows)] = Measured(one, two, p1, extra)
    if not out:
        raise ValueError(f"{csv_path}: no one_pass / two_phase measurements")
    return out


def _pick(measured: dict[tuple[int, int], Measured], tp: int, rows_le: int | None) -> Measured:
    tps = {t for t, _ in measured}
    t = tp if tp in tps else (1 if 1 in tps else min(tps))
    counts = sorted(r for tt, r in measured if tt == t)
    if rows_le is None:
        n = counts[-1]
    else:
        below = [r for r in counts if r <= rows_le]
        n = below[-1] if below else counts[0]
    return measured[(t, n)]


def apply_phases(
    table: dict[str, Any],
    measured: dict[tuple[int, int], Measured],
    source: str,
    exchange_source: str | None = None,
) -> dict[str, Any]:
    """``table`` (a ``sampled`` table) with ``launch["phases"]`` (and ``launch["phase1"]``) on
    every row (see the module docstring), the times next to it and the sources in the
    provenance. Raises ValueError for a table of another op."""
    if table.get("op") != "sampled":
        raise ValueError(f"phases: a sampled table is needed, got op {table.get('op')!r}")
    for row in table["rows"]:
        match = row["match"]
        got = _pick(measured, int(match.get("tp", 1)), match.get("rows_le"))
        row["launch"]["phases"] = got.phases
        row["launch"].pop("phase1", None)
        if got.phases == 2 and got.phase1 is not None:
            row["launch"]["phase1"] = dict(got.phase1)
        row["phases_one_pass_us"] = round(got.one_pass, 2)
        row["phases_two_phase_us"] = round(got.two_phase, 2)
        row["phases_exchange_us"] = round(got.exchange, 2)
    table["provenance"]["phases"] = {
        "source": source,
        "exchange_source": exchange_source,
        "rule": "2 where the fastest two-phase run (graph p50) plus the second exchange's "
        "latency was below one pass at the bucket's measured row count; phase1 = the fastest "
        "phase-1 launch of the sweep there; measured with the benchmark's V, dtype and K, "
        "applied to every width and dtype",
    }
    return table


def phase1_usable(arch: str, launch: dict[str, int], *, compile_check: bool | None = None) -> bool:
    """Whether a phase-1 launch (block, warps) runs on ``arch`` without spilling: every phase-1
    constexpr set of ``sampled_record_<dtype>_b<block>`` in every dtype (a row's phase 1 serves
    them all) at its warps (:func:`tuner.space.launch_ok`; ``compile_check`` default: compile
    what the AOT report does not hold unless Triton's interpreter is on, which cannot)."""
    from shardmax.generator.spills import PHASE1

    from shardmax.runtime.variants import DTYPES, VariantKey

    from .space import arch_resources, launch_ok

    if compile_check is None:
        compile_check = os.environ.get("TRITON_INTERPRET") != "1"
    for d in DTYPES:
        name = VariantKey("sampled_record", dtype=d, block=int(launch["block"])).name
        configs = [
            c for c in arch_resources(arch).get(name, {}).get("configs", {}) if c.startswith(PHASE1)
        ]
        for config in configs:
            ok, _ = launch_ok(
                name, arch, int(launch["num_warps"]), config, compile_check=compile_check
            )
            if not ok:
                return False
    return True


def write_phases(
    csv_path: Path, out_dir: Path, arch: str, exchange_csv: Path | None = None
) -> Path:
    """Apply :func:`apply_phases` to ``<out_dir>/<arch>/sampled.json`` in place; returns it.

    Raises:
        ValueError: no table there, a CSV without the measurements, or a result that does not
            validate.
    """
    path = table_path(out_dir, arch, "sampled")
    if not path.exists():
        raise ValueError(f"{path}: no sampled table to annotate (tune --op sampled first)")
    exchange = exchange_latency(exchange_csv) if exchange_csv is not None else None
    measured = measured_phases(csv_path, exchange, lambda launch: phase1_usable(arch, launch))
    table = apply_phases(
        json.loads(path.read_text()),
        measured,
        str(csv_path),
        None if exchange_csv is None else str(exchange_csv),
    )
    validate_table(table, str(path))
    path.write_text(dump_table(table))
    return path
