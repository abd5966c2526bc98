"""Runtime dispatcher: which generated variant, launch parameters and transport to use.

``select(problem) -> Selection`` is pure and cached: no GPU work, and the same answer on every
TP rank (it reads only the problem, the tables and the arch id, which all ranks share).
Resolution order (design §4):

1. ``$SHARDMAX_TABLES_DIR/<arch>/<op>.json`` (env override: a freshly tuned table);
2. the packaged table ``shardmax/generated/<arch>/<op>.json`` for the detected arch;
3. that table's catch-all row (``"match": {}``, mandatory);
4. the built-in portable default (:func:`builtin_default`), also used for unknown archs.

A table row's variant fixes the block size; the input's dtype and the alignment actually
available always win (a bf16 row never launches an fp32 load path), so the catch-all row serves
every dtype. Rows are matched in order; a row matches when every key of its ``match`` holds
(``dtype``/``tp``/``align`` equal, ``rows <= rows_le``, ``width <= width_le``). A selection is
tuned when the table is, the row does not say ``"tuned": false`` (portable rows kept for
geometries that were never measured) and it is not the catch-all.
Misses are logged once per key with the command that tunes them.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import triton

from shardmax.runtime.defaults import (
    CANDIDATE_CHOICES,
    MAX_RECORD_SPLITS,
    PHASE_CHOICES,
    RECORD_BLOCKS,
    TARGET_PROGRAMS,
    builtin_launch,
)
from shardmax.runtime.variants import TRANSPORTS, VariantKey, finish_variant, parse_name

log = logging.getLogger("shardmax.runtime.dispatch")

OPS = ("argmax", "verify", "sampled")
"""``argmax`` / ``verify``: the greedy local stage (``shard_keys_*``); ``sampled``: the sampled
verification record kernel (``sampled_record_*``, :func:`shardmax.sharded_verify`)."""
PLAIN = "plain"
"""Selection.variant of the unsharded path: all-gather the full logits, then reduce."""


@dataclass(frozen=True)
class Problem:
    """What the dispatcher keys on.

    ``rows`` = logits rows of the step, ``width`` = the local padded shard width W (columns of
    one rank's logits, the same on every rank), ``align`` = 16 when the logits' row stride is a
    multiple of 16 elements, else 1 (:func:`alignment_of`; tuned rows are keyed ``align=16``),
    ``arch`` = the arch id whose table answers (None: the current device's, :func:`detect_arch`).

    Raises:
        ValueError: an unknown ``op`` or ``dtype``, ``tp < 1``, ``rows < 0``, ``width < 1`` or
            ``align`` not 1 / 16.
    """

    op: str  # "argmax" | "verify" | "sampled"
    dtype: str  # "bf16" | "fp16" | "fp32"
    tp: int
    rows: int
    width: int
    align: int = 1  # 16 if the row stride is a multiple of 16 elements, else 1
    arch: str | None = None  # None: detected from the current device

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"op: {self.op!r}, expected one of {OPS}")
        if self.dtype not in ("bf16", "fp16", "fp32"):
            raise ValueError(f"dtype: {self.dtype!r}, expected 'bf16', 'fp16' or 'fp32'")
        if self.tp < 1 or self.rows < 0 or self.width < 1:
            raise ValueError(
                f"tp={self.tp}, rows={self.rows}, width={self.width}: expected tp >= 1, "
                "rows >= 0, width >= 1"
            )
        if self.align not in (1, 16):
            raise ValueError(f"align: {self.align!r}, expected 1 or 16 (see alignment_of)")
        if self.arch is not None:
            check_arch(self.arch)


@dataclass(frozen=True)
class Selection:
    """The dispatcher's answer. ``variant`` is a ``shard_keys_*`` name or ``"plain"`` (ops
    ``argmax`` / ``verify``), or a ``sampled_record_*`` name (op ``sampled``, whose launch also
    holds ``candidates``, the C of a candidate step)."""

    variant: str
    launch: dict[str, Any] = field(hash=False, compare=True)
    is_tuned: bool
    source: str  # table path + row index, or "builtin"

    @property
    def transport(self) -> str:
        return str(self.launch.get("transport", "allgather"))

    @property
    def splits(self) -> int:
        return int(self.launch.get("splits", 1))

    @property
    def candidates(self) -> int:
        """C of a sampled step's candidate selection (op ``sampled``; 64 when not given)."""
        return int(self.launch.get("candidates", 64))

    @property
    def phases(self) -> int:
        """Op ``sampled``: 1 = one-pass record, 2 = two-phase on steps without candidates (1 when
        not given: a table measured before the two-phase step existed)."""
        return int(self.launch.get("phases", 1))

    @property
    def phase1(self) -> dict[str, int] | None:
        """Op ``sampled``: phase 1's own launch on a two-phase step (``{"block", "splits",
        "num_warps"}``, measured on noise-free records, which want more programs than the
        candidate steps the record launch was tuned on), or None: phase 1 runs the record
        launch. Splits already capped to the problem's width (:func:`_adapt`)."""
        p1 = self.launch.get("phase1")
        return None if p1 is None else {k: int(v) for k, v in p1.items()}

    def finish_variant(self, op: str, tp: int) -> str:
        return finish_variant(op, tp, self.transport)


_ARCH_RE = re.compile(r"^[A-Za-z0-9_]{1,32}$")


def check_arch(arch: object) -> str:
    """An arch id names a table folder (``generated/<arch>/``): ``sm90``, ``gfx950``, ... --
    letters, digits and ``_`` only, at most 32, so that no arch string can reach another folder.

    Raises:
        TypeError: not a str. ValueError: anything else (a path, a long or empty string).
    """
    if not isinstance(arch, str):
        raise TypeError(f"arch: expected an arch id string such as 'sm90', got {arch!r}")
    if not _ARCH_RE.match(arch):
        shown = arch if len(arch) <= 40 else arch[:40] + "..."
        raise ValueError(
            f"arch: {shown!r} is not an arch id (letters, digits and '_', at most 32; e.g. "
            "'sm90', 'gfx950')"
        )
    return arch


def detect_arch() -> str | None:
    """Arch id of the current device: ``sm90``-style for CUDA, ``gfx950``-style for ROCm."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    gcn = getattr(props, "gcnArchName", None)
    if torch.version.hip and gcn:
        return str(gcn).split(":")[0]
    return f"sm{props.major}{props.minor}"


def alignment_of(t: torch.Tensor) -> int:
    """16 if the row stride (elements) is a multiple of 16, else 1."""
    stride = t.stride(0) if t.dim() == 2 and t.shape[0] > 1 else t.shape[-1]
    return alignment_of_stride(stride)


def alignment_of_stride(row_stride: int) -> int:
    """The ``align`` of a problem whose logits have this row stride (elements): 16 or 1."""
    return 16 if row_stride % 16 == 0 else 1


def builtin_default(problem: Problem, target_programs: int = TARGET_PROGRAMS) -> Selection:
    """The portable rule of :func:`shardmax.runtime.defaults.builtin_launch` as a
    :class:`Selection` (``is_tuned=False``, ``source="builtin"``)."""
    axes, launch = builtin_launch(
        problem.op, problem.dtype, problem.rows, problem.width, problem.align, target_programs
    )
    return Selection(VariantKey(**axes).name, launch, is_tuned=False, source="builtin")


def _table_paths(arch: str, op: str) -> list[Path]:
    paths = []
    override = os.environ.get("SHARDMAX_TABLES_DIR")
    if override:
        paths.append(Path(override) / arch / f"{op}.json")
    from importlib import resources

    paths.append(Path(str(resources.files("shardmax.generated"))) / arch / f"{op}.json")
    return paths


@functools.cache
def load_table(path: Path) -> dict[str, Any] | None:
    """A tuned table (cached, negative results too); None if the file does not exist.

    Raises:
        ValueError: not valid JSON, a schema error (:func:`validate_table`), or a table whose
            ``op`` / ``arch`` is not the one its path ``<arch>/<op>.json`` says (a sampled table
            in ``verify.json`` would hand a greedy op a record kernel).
    """
    if not path.exists():
        return None
    if not path.is_file():
        raise ValueError(f"{path}: a table path must be a JSON file, this is not a regular file")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e}); a table is a JSON file") from e
    try:
        table = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from e
    except RecursionError as e:
        raise ValueError(f"{path}: JSON nested too deeply to be a table") from e
    validate_table(table, str(path))
    if table["op"] != path.stem or table["arch"] != path.parent.name:
        raise ValueError(
            f"{path}: holds op {table['op']!r} for arch {table['arch']!r}, but its path says op "
            f"{path.stem!r} for arch {path.parent.name!r}"
        )
    return table


_MATCH_TYPES: dict[str, Any] = {
    "dtype": ("bf16", "fp16", "fp32"),
    "tp": int,
    "align": (1, 16),
    "rows_le": int,
    "width_le": int,
}
_MATCH_MIN = {"tp": 1, "rows_le": 1, "width_le": 1}


def validate_launch(launch: dict[str, Any], where: str) -> None:
    """Launch parameters must be usable: splits >= 1, num_warps a power of two in [1, 32],
    num_stages >= 1, transport one of the transports, candidates (when given) one of
    :data:`shardmax.runtime.defaults.CANDIDATE_CHOICES`, phases (when given) one of
    :data:`~shardmax.runtime.defaults.PHASE_CHOICES`. Raises ValueError naming the field."""
    splits = launch.get("splits", 1)
    if isinstance(splits, bool) or not isinstance(splits, int) or splits < 1:
        raise ValueError(f"{where}: splits must be an int >= 1, got {splits!r}")
    warps = launch.get("num_warps", 4)
    if isinstance(warps, bool) or warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"{where}: num_warps must be a power of two in [1, 32], got {warps!r}")
    stages = launch.get("num_stages", 2)
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"{where}: num_stages must be an int >= 1, got {stages!r}")
    if launch.get("transport", "allgather") not in TRANSPORTS:
        raise ValueError(
            f"{where}: transport must be one of {TRANSPORTS}, got {launch.get('transport')!r}"
        )
    if "phases" in launch and (
        isinstance(launch["phases"], bool) or launch["phases"] not in PHASE_CHOICES
    ):
        raise ValueError(
            f"{where}: phases must be one of {PHASE_CHOICES}, got {launch['phases']!r}"
        )
    if "phase1" in launch:
        _validate_phase1(launch["phase1"], where)
    if "candidates" in launch:
        c = launch["candidates"]
        if not isinstance(c, int) or isinstance(c, bool) or c not in CANDIDATE_CHOICES:
            raise ValueError(f"{where}: candidates must be one of {CANDIDATE_CHOICES}, got {c!r}")


def _validate_phase1(p1: Any, where: str) -> None:
    """A ``phase1`` launch: ``{"block": <a generated record block>, "splits": 1..32,
    "num_warps": power of two}`` and nothing else."""
    if not isinstance(p1, dict) or set(p1) != {"block", "splits", "num_warps"}:
        raise ValueError(
            f"{where}: phase1 must be an object with exactly block, splits and num_warps, "
            f"got {p1!r}"
        )
    for k, v in p1.items():
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{where}: phase1 {k} must be an int, got {v!r}")
    if p1["block"] not in RECORD_BLOCKS:
        raise ValueError(f"{where}: phase1 block must be one of {RECORD_BLOCKS}, got {p1['block']}")
    if not 1 <= p1["splits"] <= MAX_RECORD_SPLITS:
        raise ValueError(
            f"{where}: phase1 splits must be in [1, {MAX_RECORD_SPLITS}], got {p1['splits']}"
        )
    if p1["num_warps"] not in (1, 2, 4, 8, 16, 32):
        raise ValueError(
            f"{where}: phase1 num_warps must be a power of two in [1, 32], got {p1['num_warps']}"
        )


def validate_table(table: Any, where: str = "table") -> None:
    """Schema check of a tuned table; raises ValueError naming the file, row and field.

    Required keys with their types, ``op``/``arch`` values, every row's ``match`` (known keys,
    typed values), variant (``plain`` or a generated ``shard_keys_*`` module; op ``sampled``: a
    generated ``sampled_record_*`` module, with ``candidates`` in its launch), launch
    parameters (:func:`validate_launch`) and a catch-all row (``"match": {}``) last.
    """
    if not isinstance(table, dict):
        raise ValueError(f"{where}: a table is a JSON object, got {type(table).__name__}")
    for k in ("schema", "arch", "op", "tuned", "provenance", "rows"):
        if k not in table:
            raise ValueError(f"{where}: missing key {k!r}")
    if table["schema"] != 1:
        raise ValueError(f"{where}: schema {table['schema']!r} not supported (expected 1)")
    if table["op"] not in OPS:
        raise ValueError(f"{where}: op {table['op']!r}, expected one of {OPS}")
    if not isinstance(table["arch"], str) or not _ARCH_RE.match(table["arch"]):
        raise ValueError(f"{where}: arch must be an arch id such as 'sm90' or 'gfx950'")
    if not isinstance(table["tuned"], bool):
        raise ValueError(f"{where}: tuned must be true or false, got {table['tuned']!r}")
    if not isinstance(table["provenance"], dict):
        raise ValueError(f"{where}: provenance must be an object")
    rows = table["rows"]
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{where}: rows must be a non-empty list")
    from shardmax.runtime.kernels import load

    for i, row in enumerate(rows):
        at = f"{where}: row {i}"
        if not isinstance(row, dict) or not isinstance(row.get("match"), dict):
            raise ValueError(f'{at}: every row needs a "match" object')
        for k, v in row["match"].items():
            allowed = _MATCH_TYPES.get(k)
            if allowed is None:
                raise ValueError(f"{at}: unknown match key {k!r} (known: {sorted(_MATCH_TYPES)})")
            ok = isinstance(v, allowed) if isinstance(allowed, type) else v in allowed
            if not ok or isinstance(v, bool) or v < _MATCH_MIN.get(k, v):
                raise ValueError(f"{at}: match {k}={v!r} has the wrong type or value")
        if not isinstance(row.get("tuned", True), bool):
            raise ValueError(f"{at}: tuned must be true or false, got {row['tuned']!r}")
        variant = row.get("variant")
        sampled = table["op"] == "sampled"
        if variant == PLAIN and sampled:
            raise ValueError(
                f"{at}: op sampled has no plain path; variant must be sampled_record_*"
            )
        if not isinstance(variant, str):
            raise ValueError(f"{at}: variant must be a variant name, got {variant!r}")
        if variant != PLAIN:
            try:
                key = parse_name(variant)
                load(variant)  # not a generated module, e.g. a block that is never generated
            except ValueError as e:
                raise ValueError(f"{at}: {e}") from e
            family = "sampled_record" if sampled else "shard_keys"
            if key.family != family:
                raise ValueError(f"{at}: variant {variant!r} is not a {family}_* variant")
            launch = row.get("launch")
            need = {"splits", "num_warps", "transport"} | ({"candidates"} if sampled else set())
            if not isinstance(launch, dict) or not need <= set(launch):
                raise ValueError(f"{at}: launch lacks {'/'.join(sorted(need))}")
            validate_launch(launch, at)
            if sampled and launch["transport"] != "allgather":
                raise ValueError(f"{at}: op sampled's transport is 'allgather' (its only one)")
    if rows[-1]["match"] != {}:
        raise ValueError(f'{where}: the last row must be the catch-all ("match": {{}})')


def _row_matches(match: dict[str, Any], p: Problem) -> bool:
    for k, v in match.items():
        if k == "rows_le" and p.rows > v:
            return False
        if k == "width_le" and p.width > v:
            return False
        if k in ("dtype", "tp", "align") and getattr(p, k) != v:
            return False
    return True


def _adapt(row: dict[str, Any], p: Problem, tuned: bool, source: str) -> Selection:
    launch = dict(row.get("launch", {}))
    variant = row["variant"]
    if variant == PLAIN:
        return Selection(PLAIN, launch, tuned, source)
    key = parse_name(variant)
    if key.family == "sampled_record":
        if key.dtype != p.dtype:
            key = VariantKey("sampled_record", dtype=p.dtype, block=key.block)
            tuned = False
        cap = min(MAX_RECORD_SPLITS, max(1, triton.cdiv(p.width, int(key.block or 1))))
        launch["splits"] = max(1, min(int(launch["splits"]), cap))
        p1 = launch.get("phase1")
        if p1 is not None:
            cap1 = min(MAX_RECORD_SPLITS, max(1, triton.cdiv(p.width, int(p1["block"]))))
            launch["phase1"] = dict(p1, splits=max(1, min(int(p1["splits"]), cap1)))
        return Selection(key.name, launch, tuned, source)
    if key.dtype != p.dtype or key.align != p.align:
        key = VariantKey("shard_keys", dtype=p.dtype, align=p.align, block=key.block)
        tuned = False  # adapted to another dtype/alignment: not what was measured
    splits = min(int(launch["splits"]), max(1, triton.cdiv(p.width, int(key.block or 1))))
    launch["splits"] = max(1, splits)
    return Selection(key.name, launch, tuned, source)


_logged: set[tuple[Any, ...]] = set()


_override: dict[str, Any] | None = None
_OVERRIDE_FIELDS = (
    "variant",
    "transport",
    "splits",
    "num_warps",
    "num_stages",
    "candidates",
    "phases",
)


@contextlib.contextmanager
def override(**fields: Any) -> Iterator[None]:
    """Force parts of every selection inside the block (tests, benchmarks, the tuner).

    ``variant`` replaces the variant name (``"plain"`` forces the unsharded path); any other
    keyword (``transport``, ``splits``, ``num_warps``, ``num_stages``, ``candidates``,
    ``phases``) replaces
    that launch parameter; forcing ``variant``, ``splits`` or ``num_warps`` also drops a table
    row's ``phase1`` launch (the forced launch runs phase 1 as well). The override applies to
    every op's selection, so force a variant of one op only inside calls of that op. Forced
    selections report ``is_tuned=False`` and ``source="override"``. Not thread-safe; every rank
    must enter the same override.
    """
    global _override
    unknown = set(fields) - set(_OVERRIDE_FIELDS)
    if unknown:
        raise TypeError(f"override: unknown fields {sorted(unknown)}")
    if "variant" in fields and fields["variant"] != PLAIN:
        variant = fields["variant"]
        if not isinstance(variant, str):
            raise TypeError(f"override: variant must be a variant name, got {variant!r}")
        key = parse_name(variant)
        if key.family not in ("shard_keys", "sampled_record"):
            raise ValueError(
                f"override: variant {variant!r} is a {key.family} kernel; a selection names a "
                "local stage: shard_keys_* (ops argmax / verify), sampled_record_* (op sampled) "
                "or 'plain'"
            )
        from shardmax.runtime.kernels import load

        load(variant)  # a block that was never generated fails here, not at the call
    validate_launch({k: v for k, v in fields.items() if k != "variant"}, "override")
    old, _override = _override, dict(fields)
    try:
        yield
    finally:
        _override = old


def override_key() -> tuple[tuple[str, Any], ...] | None:
    """A hashable of the override in force (None without one): plans cached across calls key on
    it, so a selection made under an override is never reused outside it (or vice versa)."""
    return None if _override is None else tuple(sorted(_override.items()))


def select(problem: Problem) -> Selection:
    """Choose variant + launch parameters for ``problem`` (pure, cached, rank-identical)."""
    sel = _select_cached(problem)
    if _override is None:
        return sel
    launch = {**sel.launch, **{k: v for k, v in _override.items() if k != "variant"}}
    if {"variant", "splits", "num_warps"} & set(_override):
        launch.pop("phase1", None)  # a forced record launch is phase 1's launch too
    return Selection(str(_override.get("variant", sel.variant)), launch, False, "override")


@functools.cache
def _select_cached(problem: Problem) -> Selection:
    arch = problem.arch if problem.arch is not None else detect_arch()
    if arch is None:  # CPU / interpreter: nothing was tuned for it
        return builtin_default(problem, target_programs=1)
    for path in _table_paths(arch, problem.op):
        table = load_table(path)
        if table is None:
            continue
        for i, row in enumerate(table["rows"]):
            if _row_matches(row["match"], problem):
                catch_all = row["match"] == {}
                tuned = bool(table["tuned"]) and bool(row.get("tuned", True)) and not catch_all
                sel = _adapt(row, problem, tuned, f"{path}#{i}")
                key = (arch, problem.op, problem.dtype, problem.tp, catch_all)
                if catch_all and key not in _logged:
                    _logged.add(key)
                    log.warning(
                        "shardmax: no tuned row for %s on %s (dtype=%s tp=%d rows=%d); using "
                        "the table default. Tune it: shardmax-tune --arch %s --op %s",
                        problem.op,
                        arch,
                        problem.dtype,
                        problem.tp,
                        problem.rows,
                        arch,
                        problem.op,
                    )
                return sel
    key2 = (arch, problem.op)
    if key2 not in _logged:
        _logged.add(key2)
        log.warning(
            "shardmax: no table for arch %s op %s; using the built-in default. "
            "Tune it: shardmax-tune --arch %s --op %s",
            arch,
            problem.op,
            arch,
            problem.op,
        )
    return builtin_default(problem)


select.cache_clear = _select_cached.cache_clear  # type: ignore[attr-defined]
