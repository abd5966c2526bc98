"""Search space of one bucket: local-stage variant x launch x transport, plus the plain path.

A point is a :class:`Config`; its canonical string (``b4096_w8_s2_x4_allgather`` or ``plain``;
op ``sampled``: ``rec_b2048_w4_x8_c64``) is the single categorical Optuna parameter ``config`` of
the bucket's study, so the sampler only ever sees statically valid points (design §5 rule 1):

* block <= next_pow2(width) (the smallest block if the shard is narrower than it);
* the generated variant exists and, at the point's warps, does not spill on this arch: the AOT
  report (``generated/<arch>/resources.json``) holds each variant at its nominal warps and the
  launches the tables select at others; with ``compile_check`` (a tuning run on the GPU) a point
  at other warps is compiled for the arch (:func:`launch_ok`) -- the record kernel at block 4096
  spills 2.6 KB per thread on sm90 at 4 warps and nothing at 8;
* num_warps within the arch limit (``ArchLimits.num_warps``: wave64 on gfx950) and at least
  :data:`MIN_ELEMS_PER_THREAD` elements of the block per thread;
* num_stages in 1..3; splits a power of two, ``splits * block <= 2 * width``, ``<= 32``;
* transport ``allgather`` | ``allreduce`` and ``plain`` only where they can be timed: with a
  real group (``--distributed``); on one GPU the transport is fixed to ``allgather`` and
  ``plain`` is offered only for tp == 1 (no collective involved).

Op ``sampled`` (the sampled-verification record kernel, :func:`shardmax.sharded_verify`): block
in ``SAMPLED_BLOCKS`` (``sampled_record_<dtype>_b<block>`` at warps where it does not spill), warps, splits as
above, and ``candidates`` C in :data:`shardmax.ops.sampled.CANDIDATE_CHOICES` with ``C > top_k_max``
(the admission constraint: every top-k request with ``k <= top_k_max`` keeps running sharded,
whatever C the table picks; the default 63 keeps the built-in contract ``k < 64``). Transport is
the all_gather (the only one of sampled verification); no plain path.
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
from shardmax.generator.aot import launch_resources
from shardmax.generator.render import generated_dir
from shardmax.generator.space import ARCHES, BLOCKS, SAMPLED_BLOCKS, ArchLimits
from shardmax.generator.spills import Launch, launch_name, launch_records

from shardmax.runtime.defaults import CANDIDATE_CHOICES, MAX_RECORD_SPLITS, MAX_SPLITS
from shardmax.runtime.dispatch import PLAIN, Problem, Selection, builtin_default
from shardmax.runtime.variants import TRANSPORTS, VariantKey, parse_name

from .problems import Bucket

STAGES = (1, 2, 3)
QUICK_WARPS = (4, 8, 16)
QUICK_STAGES = (2,)
QUICK_SAMPLED_WARPS = (4, 8)
DEFAULT_TOP_K_MAX = 63
"""Op ``sampled``: the largest top-k that must keep running sharded (C > it)."""
MIN_ELEMS_PER_THREAD = 4
"""num_warps * warp_size * 4 <= block: each thread loads at least one 8-byte bf16 vector."""

_CFG_RE = re.compile(r"^b(\d+)_w(\d+)_s(\d+)_x(\d+)_(allgather|allreduce)$")
_REC_RE = re.compile(r"^rec_b(\d+)_w(\d+)_x(\d+)_c(\d+)$")


@dataclass(frozen=True, order=True)
class Config:
    """One point of a bucket's space. ``block == 0`` is the plain path; ``candidates > 0``
    marks a point of op ``sampled`` (record kernel; no stages, transport all_gather)."""

    block: int
    num_warps: int = 0
    num_stages: int = 0
    splits: int = 0
    transport: str = "allgather"
    candidates: int = 0

    @property
    def is_plain(self) -> bool:
        return self.block == 0

    @property
    def is_sampled(self) -> bool:
        return self.candidates > 0

    @property
    def name(self) -> str:
        if self.is_plain:
            return PLAIN
        if self.is_sampled:
            return f"rec_b{self.block}_w{self.num_warps}_x{self.splits}_c{self.candidates}"
        return f"b{self.block}_w{self.num_warps}_s{self.num_stages}_x{self.splits}_{self.transport}"

    @classmethod
    def parse(cls, name: str) -> Config:
        if name == PLAIN:
            return cls(0)
        r = _REC_RE.match(name)
        if r is not None:
            rb, rw, rx, rc = (int(g) for g in r.groups())
            if rb < 1 or rc not in CANDIDATE_CHOICES:
                raise ValueError(f"config: {name!r}: block >= 1 and C in {CANDIDATE_CHOICES}")
            return cls(rb, rw, 0, rx, "allgather", rc)
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
        if key.family == "sampled_record":
            w = int(sel.launch.get("num_warps", 4))
            return cls(int(key.block or 0), w, 0, sel.splits, "allgather", sel.candidates)
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
        if self.is_sampled:
            return VariantKey("sampled_record", dtype=dtype, block=self.block).name
        return VariantKey("shard_keys", dtype=dtype, align=align, block=self.block).name

    def launch(self) -> dict[str, Any]:
        if self.is_plain:
            return {"transport": "allgather"}
        if self.is_sampled:
            return {
                "splits": self.splits,
                "num_warps": self.num_warps,
                "candidates": self.candidates,
                "transport": "allgather",
            }
        return {
            "splits": self.splits,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
            "transport": self.transport,
        }

    def selection(self, dtype: str, align: int, source: str = "tuner") -> Selection:
        return Selection(self.variant(dtype, align), self.launch(), False, source)

    def tie_key(self) -> tuple[int, int, int, int, str]:
        """Deterministic tie-break: fewer warps, smaller block, fewer splits, more candidates
        (a larger C admits more requests at the same time), name."""
        return (self.num_warps, self.block, self.splits, -self.candidates, self.name)


@cache
def _report(arch: str) -> dict[str, Any]:
    """``generated/<arch>/resources.json`` of the installed package (empty if not recorded)."""
    try:
        path = resources.files("shardmax.generated") / arch / "resources.json"
        return dict(json.loads(path.read_text()))
    except (FileNotFoundError, ModuleNotFoundError, OSError):
        return {}


def arch_resources(arch: str) -> dict[str, dict[str, Any]]:
    """AOT registers/spills per variant at its nominal warps for ``arch`` (empty if not
    recorded)."""
    return dict(_report(arch).get("variants", {}))


def arch_launches(arch: str) -> dict[str, dict[str, Any]]:
    """The AOT report's compiled launches for ``arch`` (:func:`generator.spills.launch_records`:
    variants at their nominal warps, their configs, the tables' launches at other warps)."""
    return launch_records({"variants": {}, **_report(arch)})


def launch_ok(
    name: str,
    arch: str,
    num_warps: int | None = None,
    config: str | None = None,
    *,
    compile_check: bool = False,
) -> tuple[bool, str]:
    """``(ok, why not)``: variant ``name`` is compiled for ``arch`` and does not spill at
    ``num_warps`` (None: at its nominal warps) with its constexpr set ``config`` (a name of the
    module's ``CONFIGS``; None: its defaults). A launch the report does not hold (other warps)
    is compiled with ``compile_check`` (:func:`generator.aot.launch_resources`, once per
    process; ``arch`` one of the generator's ``ARCHES``; not under the interpreter), else judged
    by the variant's entry at its nominal warps -- a proxy, good enough for a run that writes no
    table (the tuner's CPU mode); ``generator --check`` compiles whatever a table selects."""
    res = arch_resources(arch)
    info = res.get(name)
    if res and info is None:
        return False, "not compiled for this arch"
    if info is None:
        return True, ""
    nominal = int(info.get("num_warps", 4))
    warps = nominal if num_warps is None else int(num_warps)
    launches = arch_launches(arch)
    rec = launches.get(launch_name(Launch(name, warps, config), nominal))
    if rec is None and compile_check and arch in ARCHES:
        try:
            rec = launch_resources(str(generated_dir()), arch, name, warps, config)
        except RuntimeError as e:  # cannot run here either
            return False, f"does not compile at {warps} warps: {str(e).splitlines()[0][:200]}"
    at = f" at {warps} warps"
    if rec is None:  # judged by the nominal entry: a verdict for these warps only by proxy
        rec = launches.get(launch_name(Launch(name, nominal, config), nominal), info)
        at = f" at its nominal {nominal} warps (not compiled at {warps})"
    if int(rec.get("spill_bytes", 0)) > 0:
        return False, f"spills {rec['spill_bytes']} B{at}"
    return True, ""


def limits_of(arch: str) -> ArchLimits:
    if arch in ARCHES:
        return ARCHES[arch]
    if arch.startswith("gfx"):
        return ArchLimits(arch, "hip", arch, 64)
    return ArchLimits(arch, "cuda", 0, 32)


def _splits(block: int, width: int, cap: int) -> list[int]:
    return [
        s for s in (1 << i for i in range(6)) if s <= cap and (s == 1 or s * block <= 2 * width)
    ]


def _local_name(bucket: Bucket, block: int) -> str:
    if bucket.op == "sampled":
        return VariantKey("sampled_record", dtype=bucket.dtype, block=block).name
    return VariantKey("shard_keys", dtype=bucket.dtype, align=bucket.align, block=block).name


def local_points(
    bucket: Bucket, arch: str, *, quick: bool = False, compile_check: bool = False
) -> tuple[list[tuple[int, int]], list[str]]:
    """``(points, notes)``: the ``(block, warps)`` pairs of the bucket's local-stage variant
    that fit the block (see the module docstring) and do not spill on ``arch``
    (:func:`launch_ok`) with any of its constexpr sets (the record kernel's phase-1 sets run at
    the row's block and warps too), in a fixed order, and why the others were pruned. Op ``sampled``: where
    every pair spills (an arch whose report says so), all are kept -- a timing can still rank
    them -- and the note says so."""
    lim = limits_of(arch)
    sampled = bucket.op == "sampled"
    if sampled:
        blocks = list(SAMPLED_BLOCKS)
        warps_all = QUICK_SAMPLED_WARPS if quick else lim.num_warps
    else:
        cap = triton.next_power_of_2(bucket.width)
        blocks = [b for b in BLOCKS if b <= cap] or [min(BLOCKS)]
        warps_all = QUICK_WARPS if quick else lim.num_warps
    fits: list[tuple[int, int]] = []
    for block in blocks:
        warps = [
            w
            for w in warps_all
            if w in lim.num_warps and w * lim.warp_size * MIN_ELEMS_PER_THREAD <= block
        ] or [min(lim.num_warps)]
        fits.extend((block, w) for w in warps)
    points, notes = [], []
    for block, w in fits:
        name = _local_name(bucket, block)
        # a sampled row's record launch also runs phase 1 of its two-phase and top-p steps
        configs = [None, *arch_resources(arch).get(name, {}).get("configs", {})]
        for config in configs:
            ok, why = launch_ok(name, arch, w, config, compile_check=compile_check)
            if not ok:
                notes.append(f"{name}{'' if config is None else f'[{config}]'} at {w} warps: {why}")
                break
        else:
            points.append((block, w))
    if sampled and not points:
        kept = [(b, w) for b, w in fits if _local_name(bucket, b) in arch_resources(arch)]
        return kept, [f"every sampled_record_{bucket.dtype} point spills on {arch}: all kept"]
    return points, notes


def candidates(
    bucket: Bucket,
    arch: str,
    *,
    quick: bool = False,
    distributed: bool = False,
    top_k_max: int = DEFAULT_TOP_K_MAX,
    compile_check: bool = False,
) -> list[Config]:
    """Statically valid configs of ``bucket`` on ``arch``, in a fixed order (``top_k_max``: op
    ``sampled`` only; ``compile_check``: compile points the AOT report does not hold; see the
    module docstring)."""
    if bucket.op == "sampled":
        return sampled_candidates(
            bucket, arch, quick=quick, top_k_max=top_k_max, compile_check=compile_check
        )
    width = bucket.width
    stages = QUICK_STAGES if quick else STAGES
    transports: tuple[str, ...] = TRANSPORTS if distributed and bucket.tp > 1 else ("allgather",)
    out: list[Config] = []
    if distributed or bucket.tp == 1:
        out.append(Config(0))
    points, _ = local_points(bucket, arch, quick=quick, compile_check=compile_check)
    for block in dict.fromkeys(b for b, _ in points):  # the order of old: block, transport, warps
        for t in transports:
            for w in (w for b, w in points if b == block):
                for st in stages:
                    for s in _splits(block, width, MAX_SPLITS):
                        out.append(Config(block, w, st, s, t))
    return out


def sampled_candidates(
    bucket: Bucket,
    arch: str,
    *,
    quick: bool = False,
    top_k_max: int = DEFAULT_TOP_K_MAX,
    compile_check: bool = False,
) -> list[Config]:
    """Op ``sampled``: record block x warps x splits x C (see the module docstring), the
    ``(block, warps)`` pairs of :func:`local_points`.

    Raises:
        ValueError: no C of :data:`shardmax.ops.sampled.CANDIDATE_CHOICES` exceeds ``top_k_max``.
    """
    cs = [c for c in CANDIDATE_CHOICES if c > top_k_max]
    if not cs:
        raise ValueError(
            f"top_k_max: {top_k_max} leaves no candidates C > it (choices {CANDIDATE_CHOICES})"
        )
    points, _ = local_points(bucket, arch, quick=quick, compile_check=compile_check)
    out: list[Config] = []
    for block, w in points:
        for s in _splits(block, bucket.width, MAX_RECORD_SPLITS):
            for c in cs:
                out.append(Config(block, w, 0, s, "allgather", c))
    return out


def pruned_report(
    bucket: Bucket, arch: str, *, quick: bool = False, compile_check: bool = False
) -> list[str]:
    """Why ``(block, warps)`` points were pruned statically (for the log)."""
    return local_points(bucket, arch, quick=quick, compile_check=compile_check)[1]


def default_config(bucket: Bucket) -> Config:
    """The built-in portable default for this bucket's problem (``builtin_default``)."""
    sel = builtin_default(
        Problem(bucket.op, bucket.dtype, bucket.tp, bucket.rows, bucket.width, bucket.align)
    )
    return Config.from_selection(sel)


def space_hash(configs: list[Config]) -> str:
    return hashlib.sha1("\n".join(c.name for c in configs).encode()).hexdigest()[:8]
