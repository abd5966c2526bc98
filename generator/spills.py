"""Register spills of the variants a GPU's tables can select (issue 22: AMD readiness).

The AOT report (``generated/<arch>/resources.json``) lists every variant's spill bytes; a spill
matters where the runtime can launch the variant on that arch. :func:`selectable` is that set:
every local-stage variant a row of the arch's tables names, adapted to every dtype (and, for the
greedy local stage, both alignments) as the dispatcher adapts it, the two-phase draw kernel at
its built-in block, and every finish / merge / strict kernel (the runtime picks those by TP and
mode, never by table); and, as ``<name>[phase1]`` / ``<name>[phase1_topp]``, the record
kernel's phase-1 constexpr sets at every block a ``sampled`` row's ``launch["phase1"]`` names
(compiled by the AOT report from the module's ``CONFIGS``). ``generator --check --arch ...`` fails on a spill in that set that
:data:`KNOWN_SPILLS` does not list -- a new one -- and says which known ones went away.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardmax.runtime.defaults import DEFAULT_RECORD_BLOCK
from shardmax.runtime.variants import DTYPES, VariantKey, parse_name

TABLE_OPS = ("argmax", "verify", "sampled")
LOCAL_FAMILIES = ("shard_keys", "sampled_record", "sampled_draw")

KNOWN_SPILLS: dict[str, dict[str, str]] = {"sm90": {}, "gfx950": {}}
"""Spills of selectable variants that are known and accepted for now, per arch, with why. Empty:
no variant a table can select spills to memory on either arch. (The gfx950 entries this once
held -- every ``sampled_record_*_b2048`` and ``sampled_finish_tp{2,4,8}`` -- were SGPR spills
into VGPR lanes, no memory traffic, which the report counted as bytes; they are
``sgpr_spills`` now, see :mod:`generator.aot`.)"""


PHASE1 = "phase1"
"""The record kernel's phase-1 constexpr sets (``CONFIGS`` of ``sampled_record_*`` named
``phase1*``: a plain and a level-histogram top-p step's): a table row's ``launch["phase1"]``
block launches them; their spills are reported as ``<name>[phase1]`` / ``<name>[phase1_topp]``."""


def selectable_phase1(out: Path, arch: str, variants: list[str]) -> set[str]:
    """Record variants (of ``variants``) the ``sampled`` table's ``phase1`` launches name, in
    every dtype."""
    path = out / arch / "sampled.json"
    if not path.exists():
        return set()
    chosen = set()
    for row in json.loads(path.read_text())["rows"]:
        p1 = row.get("launch", {}).get(PHASE1)
        if isinstance(p1, dict) and isinstance(p1.get("block"), int):
            for d in DTYPES:
                chosen.add(VariantKey("sampled_record", dtype=d, block=p1["block"]).name)
    return chosen & set(variants)


def selectable(out: Path, arch: str, variants: list[str]) -> set[str]:
    """The variants (of ``variants``) the runtime can launch on ``arch`` at their default
    constexprs given the tables in ``out/<arch>/`` (see the module docstring)."""
    chosen: set[str] = set()
    for op in TABLE_OPS:
        path = out / arch / f"{op}.json"
        if not path.exists():
            continue
        for row in json.loads(path.read_text())["rows"]:
            name = row.get("variant")
            if not isinstance(name, str) or name == "plain":
                continue
            key = parse_name(name)
            aligns = (1, 16) if key.family == "shard_keys" else (None,)
            for d in DTYPES:
                for a in aligns:
                    chosen.add(VariantKey(key.family, dtype=d, align=a, block=key.block).name)
    for d in DTYPES:
        chosen.add(VariantKey("sampled_draw", dtype=d, block=DEFAULT_RECORD_BLOCK).name)
    for name in variants:
        if parse_name(name).family not in LOCAL_FAMILIES:
            chosen.add(name)
    return chosen & set(variants)


def spill_report(out: Path, arch: str, record: dict[str, Any]) -> tuple[list[str], list[str]]:
    """``(new, gone)``: selectable variants of a fresh AOT ``record`` that spill and are not in
    :data:`KNOWN_SPILLS` (``"name: N bytes"``), and known entries that no longer spill."""
    per = record["variants"]
    known = KNOWN_SPILLS.get(arch, {})
    spills = {n: int(r["spill_bytes"]) for n, r in per.items()}
    for n, r in per.items():
        for cname, c in r.get("configs", {}).items():
            spills[f"{n}[{cname}]"] = int(c["spill_bytes"])
    chosen = selectable(out, arch, list(per))
    chosen |= {
        f"{n}[{cname}]"
        for n in selectable_phase1(out, arch, list(per))
        for cname in per[n].get("configs", {})
        if cname.startswith(PHASE1)
    }
    spilling = {n for n in chosen if spills.get(n, 0) > 0}
    new = [f"{n}: {spills[n]} bytes" for n in sorted(spilling - set(known))]
    gone = sorted(n for n in known if n in spills and spills[n] == 0)
    return new, gone
