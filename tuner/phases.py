"""One-pass or two-phase per ``sampled`` table row, from a measured step benchmark (issue 22).

The ``sampled`` buckets are tuned on candidate steps (top-k / top-p), which always run one pass;
whether a step WITHOUT candidates runs two-phase is a separate measurement:
``python -m benchmarks.sampled_local`` times both on one rank's shard per (TP, rows) in the same
run. :func:`apply_phases` writes its answer into every row of the table as ``launch["phases"]``:
2 where two-phase was faster at the measured row count that stands for the row's bucket (the
largest measured count ``<= rows_le``, else the smallest measured), else 1. Rows of a TP that was
not measured, and the catch-all, take TP 1's answer at the bucket (the catch-all: at the largest
measured count). The table's provenance records the source.

    python -m tuner --phases-from benchmarks/results/sm90/sampled_local.csv --arch sm90
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from shardmax.runtime.dispatch import validate_table

from .export import dump_table, table_path


def measured_phases(csv_path: Path) -> dict[tuple[int, int], tuple[int, float, float]]:
    """``(tp, rows) -> (phases, one_pass us, two_phase us)`` of a ``sampled_local`` CSV.

    Raises:
        ValueError: the CSV has no one_pass / two_phase pair.
    """
    p50: dict[tuple[int, int, str], float] = {}
    with csv_path.open() as f:
        for r in csv.DictReader(f):
            if not r.get("kernel") and r.get("method") in ("one_pass", "two_phase"):
                p50[(int(r["tp"]), int(r["rows"]), r["method"])] = float(r["p50_us"])
    out = {}
    for (tp, rows, m), v in p50.items():
        if m == "one_pass" and (tp, rows, "two_phase") in p50:
            two = p50[(tp, rows, "two_phase")]
            out[(tp, rows)] = (2 if two < v else 1, v, two)
    if not out:
        raise ValueError(f"{csv_path}: no one_pass / two_phase measurements")
    return out


def _pick(measured: dict[tuple[int, int], tuple[int, float, float]], tp: int,
          rows_le: int | None) -> tuple[int, float, float]:  # fmt: skip
    tps = {t for t, _ in measured}
    t = tp if tp in tps else (1 if 1 in tps else min(tps))
    counts = sorted(r for tt, r in measured if tt == t)
    if rows_le is None:
        n = counts[-1]
    else:
        below = [r for r in counts if r <= rows_le]
        n = below[-1] if below else counts[0]
    return measured[(t, n)]


def apply_phases(table: dict[str, Any], measured: dict[tuple[int, int], tuple[int, float, float]],
                 source: str) -> dict[str, Any]:  # fmt: skip
    """``table`` (a ``sampled`` table) with ``launch["phases"]`` on every row (see the module
    docstring), ``phases_one_pass_us`` / ``phases_two_phase_us`` next to it and the source in
    the provenance. Raises ValueError for a table of another op."""
    if table.get("op") != "sampled":
        raise ValueError(f"phases: a sampled table is needed, got op {table.get('op')!r}")
    for row in table["rows"]:
        match = row["match"]
        phases, one, two = _pick(measured, int(match.get("tp", 1)), match.get("rows_le"))
        row["launch"]["phases"] = phases
        row["phases_one_pass_us"], row["phases_two_phase_us"] = round(one, 2), round(two, 2)
    table["provenance"]["phases"] = {
        "source": source,
        "rule": "2 where two-phase was faster (graph p50) at the bucket's measured row count; "
        "measured with the benchmark's V, dtype and K, applied to every width and dtype",
    }
    return table


def write_phases(csv_path: Path, out_dir: Path, arch: str) -> Path:
    """Apply :func:`apply_phases` to ``<out_dir>/<arch>/sampled.json`` in place; returns it.

    Raises:
        ValueError: no table there, or the result does not validate.
    """
    path = table_path(out_dir, arch, "sampled")
    if not path.exists():
        raise ValueError(f"{path}: no sampled table to annotate (tune --op sampled first)")
    table = apply_phases(json.loads(path.read_text()), measured_phases(csv_path), str(csv_path))
    validate_table(table, str(path))
    path.write_text(dump_table(table))
    return path
