"""Register spills of the launches a GPU's tables can select (issue 22: AMD readiness).

A spill depends on the warps as much as on the variant: the one-pass record kernel at block
4096 spills 2.6 KB per thread on sm90 at 4 warps and nothing at 8. So the unit here is a
:class:`Launch` -- variant, warps, constexpr set. The AOT report
(``generated/<arch>/resources.json``) holds every variant at its nominal warps
(:func:`generator.aot.nominal_warps`) under ``variants`` and, under ``launches``, every selected
launch at other warps (:func:`launch_name`: ``<variant>@w<warps>[<config>]``).

:func:`selected_launches` is what the runtime can launch on that arch: every local-stage row of
the arch's tables at the row's warps, adapted to every dtype (and, for the greedy local stage,
both alignments) as the dispatcher adapts it; the record kernel's phase-1 constexpr sets at the
block and warps of every ``sampled`` row's ``launch["phase1"]``; the built-in rule's launches
(:func:`shardmax.runtime.defaults.builtin_launch`, the two-phase draw kernel); and every finish /
merge / strict kernel at its own warps (the runtime picks those by TP and mode, never by
table) -- each of them with its default constexprs and with every constexpr set of its
module's ``CONFIGS``. ``generator --check --arch ...`` fails on a spill in that set that :data:`KNOWN_SPILLS`
does not list -- a new one -- and says which known ones went away.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

from shardmax.runtime.defaults import (
    DEFAULT_RECORD_BLOCK,
    DRAW_WARPS,
    topp_combine_warps,
    topp_split_replay_warps,
)
from shardmax.runtime.variants import DTYPES, VariantKey, parse_name

from .aot import LOCAL_FAMILIES

TABLE_OPS = ("argmax", "verify", "sampled")

SPLIT_SEARCHES = ("split", "split_v032")
"""``topp_replay``'s constexpr sets of vLLM's split pipelines (``CONFIGS`` whose ``PIPELINE`` is not
the monolithic one's): the runtime launches them at :func:`config_warps`' warps."""

KNOWN_SPILLS: dict[str, dict[str, str]] = {"sm90": {}, "gfx950": {}}
"""Spills of selectable launches that are known and accepted for now, per arch, with why (keys:
:func:`launch_name`, values: why). None today. (The split top-p searches at 8 warps on sm90,
which decided a round's eight pivots on ``[8, LEVELS]`` fp64 tiles and spilled 56 B per thread,
decide them four at a time since: ``topp_replay``'s ``PIVOTS``, no spill. The top-p combine's
merge of 4 splits, which spilled 8 B at 8 warps on sm90, launches at 4 warps there:
``shardmax.runtime.defaults.TOPP_COMBINE_PARTS4_WARPS``. The gfx950 entries this once held --
every ``sampled_record_*_b2048`` and ``sampled_finish_tp{2,4,8}`` -- were SGPR spills into VGPR
lanes, no memory traffic, which the report counted as bytes; they are ``sgpr_spills`` now, see
:mod:`generator.aot`.)"""


def config_warps(arch: str) -> dict[tuple[str, str], int]:
    """``(family, config)`` a launch on ``arch`` makes at warps of its own rather than its
    variant's: the split top-p searches (:func:`shardmax.ops.topp.topp_kept_sets`' launch, at
    :func:`shardmax.runtime.defaults.topp_split_replay_warps`) and, where
    :func:`shardmax.runtime.defaults.topp_combine_warps` names warps, the top-p combine's
    constexpr sets (``parts<N>``)."""
    own = {("topp_replay", c): topp_split_replay_warps(arch) for c in SPLIT_SEARCHES}
    for parts in (2, 4):
        warps = topp_combine_warps(parts, arch)
        if warps is not None:
            own[("topp_combine", f"parts{parts}")] = warps
    return own


PHASE1 = "phase1"
"""Prefix of the record kernel's phase-1 constexpr sets (``CONFIGS`` of ``sampled_record_*``:
a plain and a level-histogram top-p step's): a table row's ``launch["phase1"]`` launches them."""


class Launch(NamedTuple):
    """One way the runtime launches a generated variant."""

    variant: str
    num_warps: int
    config: str | None = None  # a name of the module's CONFIGS; None: its CONSTEXPRS


def launch_name(launch: Launch, nominal: int) -> str:
    """``<variant>[@w<warps>][<config>]``: the warps only where they differ from the variant's
    report entry's (``nominal``)."""
    warps = "" if launch.num_warps == nominal else f"@w{launch.num_warps}"
    config = "" if launch.config is None else f"[{launch.config}]"
    return f"{launch.variant}{warps}{config}"


def _rows(out: Path, arch: str, op: str) -> list[dict[str, Any]]:
    path = out / arch / f"{op}.json"
    if not path.exists():
        return []
    return list(json.loads(path.read_text())["rows"])


def _adapted(key: VariantKey) -> list[str]:
    """The variant in every dtype (and, for ``shard_keys``, both alignments) the dispatcher
    adapts a row to."""
    aligns = (1, 16) if key.family == "shard_keys" else (None,)
    return [
        VariantKey(key.family, dtype=d, align=a, block=key.block).name
        for d in DTYPES
        for a in aligns
    ]


def selected_launches(out: Path, arch: str, variants: dict[str, dict[str, Any]]) -> set[Launch]:
    """The launches (of the report's ``variants``: ``{name: record}``) the runtime can make on
    ``arch`` given the tables in ``out/<arch>/`` (see the module docstring): every (variant,
    warps) below with its default constexprs and with every constexpr set of its module's
    ``CONFIGS`` (the report's ``configs``; at :func:`config_warps` where that names the set)
    -- a ``sampled`` row's own record launch also runs phase 1 of every two-phase step without
    a ``phase1`` entry and of every top-p step (``[phase1]``, ``[phase1_topp]``); the draw kernel
    and the finishes have top-p and two-phase sets -- except a row's ``phase1`` launch, which
    runs only the phase-1 sets."""
    from shardmax.runtime.defaults import default_num_warps

    base: set[tuple[str, int]] = set()  # every constexpr set
    phase1: set[tuple[str, int]] = set()  # the phase-1 sets only
    for op in TABLE_OPS:
        for row in _rows(out, arch, op):
            name = row.get("variant")
            if not isinstance(name, str) or name == "plain":
                continue
            key = parse_name(name)
            launch = row.get("launch", {})
            for n in _adapted(key):  # the dispatcher's default warps: 4
                base.add((n, int(launch.get("num_warps", 4))))
            p1 = launch.get(PHASE1)
            if op == "sampled" and isinstance(p1, dict) and isinstance(p1.get("block"), int):
                for d in DTYPES:
                    n = VariantKey("sampled_record", dtype=d, block=p1["block"]).name
                    phase1.add((n, int(p1["num_warps"])))
    # the built-in rule (no table row, a CPU, an arch without tables)
    for block in (1024, 4096):
        for n in _adapted(VariantKey("shard_keys", dtype="bf16", align=16, block=block)):
            base.add((n, default_num_warps("shard_keys", block)))
    for d in DTYPES:
        record = VariantKey("sampled_record", dtype=d, block=DEFAULT_RECORD_BLOCK).name
        base.add((record, default_num_warps("sampled_record", DEFAULT_RECORD_BLOCK)))
        draw = VariantKey("sampled_draw", dtype=d, block=DEFAULT_RECORD_BLOCK).name
        base.add((draw, DRAW_WARPS))
    for name, entry in variants.items():
        if parse_name(name).family not in LOCAL_FAMILIES:
            base.add((name, int(entry.get("num_warps", 4))))
    own = config_warps(arch)
    chosen: set[Launch] = set()
    for name, warps in base | phase1:
        if name not in variants:
            continue
        whole = (name, warps) in base
        if whole:
            chosen.add(Launch(name, warps))
        family = parse_name(name).family
        for c in variants[name].get("configs", {}):
            if whole or c.startswith(PHASE1):
                chosen.add(Launch(name, own.get((family, c), warps), c))
    return chosen


def launches_lag(out: Path, arch: str) -> tuple[list[str], list[str]]:
    """``(missing, extra)``: the launches the tables in ``out/<arch>/`` select at other warps
    that the AOT report there does not hold, and those it holds that no table selects (both
    empty without a report)."""
    path = out / arch / "resources.json"
    if not path.exists():
        return [], []
    report = json.loads(path.read_text())
    per = report.get("variants", {})
    want = {
        launch_name(x, int(per[x.variant]["num_warps"])) for x in extra_launches(out, arch, per)
    }
    got = set(report.get("launches", {}))
    return sorted(want - got), sorted(got - want)


def extra_launches(out: Path, arch: str, variants: dict[str, dict[str, Any]]) -> list[Launch]:
    """The selected launches at warps other than their variant's report entry's: what the report
    compiles apart, under ``launches`` (sorted)."""
    return sorted(
        (
            launch
            for launch in selected_launches(out, arch, variants)
            if launch.num_warps != int(variants[launch.variant].get("num_warps", 4))
        ),
        key=lambda x: (x.variant, x.num_warps, x.config or ""),
    )


def launch_records(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every compiled launch of an AOT report by :func:`launch_name`: the variants and their
    configs at their nominal warps, then the report's ``launches``."""
    out: dict[str, dict[str, Any]] = {}
    for n, r in record["variants"].items():
        out[n] = r
        for cname, c in r.get("configs", {}).items():
            out[f"{n}[{cname}]"] = c
    out.update(record.get("launches", {}))
    return out


def spill_report(out: Path, arch: str, record: dict[str, Any]) -> tuple[list[str], list[str]]:
    """``(new, gone)`` of an AOT ``record`` (``variants`` and ``launches``): selected launches
    that spill, or that the record does not hold (named so: a stale report), and are not in
    :data:`KNOWN_SPILLS` (``"name: N bytes"``); known entries that no longer spill."""
    variants = record["variants"]
    known = KNOWN_SPILLS.get(arch, {})
    compiled = launch_records(record)
    problems: dict[str, str] = {}
    for launch in selected_launches(out, arch, variants):
        name = launch_name(launch, int(variants[launch.variant].get("num_warps", 4)))
        if name not in compiled:
            problems[name] = "not in the report"
        elif int(compiled[name]["spill_bytes"]) > 0:
            problems[name] = f"{int(compiled[name]['spill_bytes'])} bytes"
    new = [f"{n}: {why}" for n, why in sorted(problems.items()) if n not in known]
    gone = sorted(n for n in known if n in compiled and int(compiled[n]["spill_bytes"]) == 0)
    return new, gone
