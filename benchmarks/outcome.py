"""What one benchmark part measured in this run: cases measured, failed and skipped.

``python -m benchmarks`` publishes a part's files into the results folder only when the part
is complete (at least one case measured, none failed, none skipped by the time budget); the
exit code is non-zero when no case ran or a case failed. A case is one CSV row:

* measured: no ``error`` and a positive, finite ``p50_us``;
* failed: an ``error`` (a measurement, a shape or a worker that raised), or ``correct`` false
  on a row that is checked ``==`` (every ``local.csv`` row of shardmax's own methods, every
  ``step_tp2.csv`` row); ``vllm_unfused*`` rows of ``local.csv`` are informative only (torch's
  ``max(dim)`` may break bf16 ties differently, see ``local.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .report import read_csv


@dataclass
class PartOutcome:
    """One part's result in this run. ``unavailable`` says why the part could not run on
    this machine (for example the step part with fewer than 2 GPUs); such a part neither
    blocks publishing the others nor counts as a failure."""

    part: str
    csv: Path | None
    measured: int = 0
    failed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    unavailable: str = ""

    @property
    def complete(self) -> bool:
        return not self.unavailable and self.measured > 0 and not self.failed and not self.skipped

    def describe(self) -> str:
        if self.unavailable:
            return f"[{self.part}] not run: {self.unavailable}"
        text = (
            f"[{self.part}] {self.measured} cases measured, {len(self.failed)} failed, "
            f"{len(self.skipped)} skipped by the time budget"
        )
        if self.failed:
            text += "\n    failed: " + "; ".join(self.failed[:5])
            if len(self.failed) > 5:
                text += f" (+{len(self.failed) - 5} more)"
        return text


def _checked(part: str, row: dict[str, Any]) -> bool:
    """Is this row's ``correct`` a pass/fail check (see the module docstring)?"""
    if part == "step":
        return True
    return str(row.get("method", "")).startswith("shardmax")


def _case(row: dict[str, Any]) -> str:
    what = row.get("method") or f"{row.get('op')}/{row.get('path')}"
    return (
        f"{what} {row.get('dtype')} V={row.get('vocab')} TP{row.get('tp')} rows={row.get('rows')}"
    )


def analyze(
    part: str,
    csv_path: Path | None,
    *,
    skipped: list[str] | None = None,
    failed: list[str] | None = None,
    unavailable: str = "",
) -> PartOutcome:
    """Count the cases of ``csv_path`` (a CSV this run wrote) into a :class:`PartOutcome`.

    ``failed`` adds failures that left no row (a worker that died); ``skipped`` lists the
    shapes the time budget cut.
    """
    out = PartOutcome(part, csv_path, skipped=list(skipped or []), failed=list(failed or []))
    out.unavailable = unavailable
    for row in read_csv(csv_path) if csv_path is not None else []:
        err = row.get("error")
        if err:
            out.failed.append(f"{_case(row)}: {err}")
            continue
        if _checked(part, row) and not row.get("correct"):
            out.failed.append(f"{_case(row)}: result differs from the reference")
        p50 = row.get("p50_us")
        if isinstance(p50, (int, float)) and math.isfinite(p50) and p50 > 0:
            out.measured += 1
    return out
