"""Search space of one bucket: local-stage variant x launch x transport, plus the plain path.

A point is a :class:`Config`; its canonical string (``b4096_w8_s2_x4_allgather`` or ``plain``)
is the single categorical Optuna parameter ``config`` of the bucket's study, so the sampler only
ever sees statically valid points (design §5 rule 1):

* block <= next_pow2(width) (the smallest block if the shard is narrower than it);
* the generated variant exists and does not spill on this arch (``generated/<arch>/resources.json``);
* num_warps within the arch limit (``ArchLimits.num_warps``: wave64 on gfx950) and at least
  :data:`MIN_ELEMS_PER_THREAD` elements of the block per thread;
* num_stages in 1..3; splits a power of two, ``splits * block <= 2 * width``, ``<= 32``;
* transport ``allgather`` | ``allreduce`` and ``plain`` only where they can be timed: with a
  real group (``--distributed``); on one GPU the transport is fixed to ``allgather`` and
  ``plain`` is offered only for tp == 1 (no collective involved).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import triton
from shardmax.generator.space import ARCHES, BLOCKS, ArchLimits

from shardmax.dispatch import MAX_SPLITS, PLAIN, Problem, Selection, builtin_default
from shardmax.variants import TRANSPORTS, VariantKey, parse_name

from .problems import Bucket

STAGES = (1, 2, 3)
QUICK_WARPS = (4, 8, 16)
QUICK_STAGES = (2,)
MIN_ELEMS_PER_THREAD = 4
"""num_warps * warp_size * 4 <= block: each thread loads at least one 8-byte bf16 vector."""

_CFG_RE = re.compile(r"^b(\d+)_w(\d+)_s(\d+)_x(\d+)_(allgather|allreduce)$")


@dataclass(frozen=True, order=True)
class Config:
    """One point of a bucket's space. ``block == 0`` is the plain path."""

    block: int
    num_warps: int = 0
    num_stages: int = 0
    splits: int = 0
    transport: str = "allgather"

    @property
    def is_plain(self) -> bool:
        return self.block == 0

    @property
    def name(self) -> str:
        if self.is_plain:
            return PLAIN
        return f"b{self.block}_w{self.num_warps}_s{self.num_stages}_x{self.splits}_{self.transport}"

    @classmethod
    def parse(cls, name: str) -> Config:
        if name == PLAIN:
            return cls(0)
        m = _CFG_RE.match(name)
        if m is None:
            raise ValueError(f"config: {name!r} is not a tuner config name")
        b, w, s, x, t = m.groups()
        return cls(int(b), int(w), int(s), int(x), t)

    @classmethod
    def from_selection(cls, sel: Selection) -> Config:
        if sel.variant == PLAIN:
            return cls(0)
        key = parse_name(sel.variant)
        return cls(
            int(key.block or 0),
            int(sel.launch.get("num_warps", 4)),
            int(sel.launch.get("num_stages", 2)),
            sel.splits,
            sel.transport,
        )

    def variant(self, dtype: str, align: int) -> str:
        if self.is_plain:
            return PLAIN
        return VariantKey("shard_keys", dtype=dtype, align=align, block=self.block).name

    def launch(self) -> dict[str, Any]:
        if self.is_plain:
            return {"transport": "allgather"}
        return {
            "splits": self.splits,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
            "transport": self.transport,
        }

    def selection(self, dtype: str, align: int, source: str = "tuner") -> Selection:
        return Selection(self.variant(dtype, align), self.launch(), False, source)

    def tie_key(self) -> tuple[int, int, int, str]:
        """Deterministic tie-break: fewer warps, smaller block, fewer splits, name."""
        return (self.num_warps, self.block, self.splits, self.name)


@cache
def arch_resources(arch: str) -> dict[str, dict[str, Any]]:
    """AOT registers/spills per variant for ``arch`` (empty if not recorded)."""
    try:
        path = resources.files("shardmax.generated") / arch / "resources.json"
        data = json.loads(path.read_text())
    except (FileNotFoundError, ModuleNotFoundError, OSError):
        return {}
    return dict(data.get("variants", {}))


def _variant_ok(name: str, arch: str) -> tuple[bool, str]:
    res = arch_resources(arch)
    info = res.get(name)
    if res and info is None:
        return False, "not compiled for this arch"
    if info is not None and int(info.get("spill_bytes", 0)) > 0:
        return False, f"spills {info['spill_bytes']} B"
    return True, ""


def limits_of(arch: str) -> ArchLimits:
    if arch in ARCHES:
        return ARCHES[arch]
    if arch.startswith("gfx"):
        return ArchLimits(arch, "hip", arch, 64)
    return ArchLimits(arch, "cuda", 0, 32)


def candidates(
    bucket: Bucket,
    arch: str,
    *,
    quick: bool = False,
    distributed: bool = False,
) -> list[Config]:
    """Statically valid configs of ``bucket`` on ``arch``, in a fixed order."""
    lim = limits_of(arch)
    width = bucket.width
    cap = triton.next_power_of_2(width)
    blocks = [b for b in BLOCKS if b <= cap] or [min(BLOCKS)]
    warps_all = QUICK_WARPS if quick else lim.num_warps
    stages = QUICK_STAGES if quick else STAGES
    transports: tuple[str, ...] = TRANSPORTS if distributed and bucket.tp > 1 else ("allgather",)
    out: list[Config] = []
    if distributed or bucket.tp == 1:
        out.append(Config(0))
    for block in blocks:
        ok, _ = _variant_ok(
            VariantKey("shard_keys", dtype=bucket.dtype, align=bucket.align, block=block).name, arch
        )
        if not ok:
            continue
        warps = [
            w
            for w in warps_all
            if w in lim.num_warps and w * lim.warp_size * MIN_ELEMS_PER_THREAD <= block
        ] or [min(lim.num_warps)]
        splits = [
            s
            for s in (1 << i for i in range(6))
            if s <= MAX_SPLITS and (s == 1 or s * block <= 2 * width)
        ]
        for t in transports:
            for w in warps:
                for st in stages:
                    for s in splits:
                        out.append(Config(block, w, st, s, t))
    return out


def pruned_report(bucket: Bucket, arch: str) -> list[str]:
    """Why blocks were pruned statically (for the log)."""
    notes = []
    for block in BLOCKS:
        name = VariantKey("shard_keys", dtype=bucket.dtype, align=bucket.align, block=block).name
        ok, why = _variant_ok(name, arch)
        if not ok:
            notes.append(f"{name}: {why}")
    return notes


def default_config(bucket: Bucket) -> Config:
    """The built-in portable default for this bucket's problem (``builtin_default``)."""
    sel = builtin_default(
        Problem(bucket.op, bucket.dtype, bucket.tp, bucket.rows, bucket.width, bucket.align)
    )
    return Config.from_selection(sel)


def space_hash(configs: list[Config]) -> str:
    return hashlib.sha1("\n".join(c.name for c in configs).encode()).hexdigest()[:8]
