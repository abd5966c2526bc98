"""Built-in portable launch rules: what runs where no tuned table row exists.

These are the only launch numbers outside the tuned tables (``generated/<arch>/<op>.json``): the
fallback of :func:`shardmax.runtime.dispatch.select` for an arch without a table, a CPU, or a
table's portable rows. They are pure functions of the problem's shape (identical on every rank).
The constants an op's launchers and the dispatcher's table validation share live here too, so
the dispatcher never imports an op.
"""

from __future__ import annotations

from typing import Any

import triton

TARGET_PROGRAMS = 264
"""Aim for about 2 programs per SM of a 132-SM GPU in the local stage."""
MAX_SPLITS = 32
"""Most programs per row of the greedy local stage (``shard_keys_*``)."""

DEFAULT_RECORD_BLOCK = 2048
"""Tile of the sampled record kernel (``sampled_record_*``) in the built-in rule; any block gives
the same keys."""
RECORD_BLOCKS = (1024, 2048, 4096)
"""Blocks of the generated ``sampled_record_*`` / ``sampled_draw_*`` variants (the generator's
space renders exactly these)."""
MAX_RECORD_SPLITS = 32
"""Most programs per row of the sampled record kernel."""
TOPK_CANDIDATES = 64
"""C of the built-in rule: candidates per row and record split (a power of two). Requests with
top-k ``k < C`` run sharded, larger ``k`` come back in ``fallback``. A table row's
``launch["candidates"]`` (one of :data:`CANDIDATE_CHOICES`) sets the C of a step; it depends only
on the step's shape, so a captured CUDA graph never reallocates."""
PHASE_CHOICES = (1, 2)
"""A sampled step without candidates runs one pass (1: every row's record carries its Gumbel
key) or two phases (2: records without noise, then only the one drawing row per request is
noised); a table row's ``launch["phases"]`` chooses."""
BUILTIN_PHASES = 2
"""Phases of the built-in rule (two-phase draws ``K + 1`` times less noise)."""
DRAW_WARPS = 8
"""Warps of the two-phase step's draw kernel (``sampled_draw_*``), built-in."""
MAX_DRAW_SPLITS = 128
"""Most programs per drawing request of the draw kernel: a step of a few requests still fills
the GPU (one request's row spread over up to 128 programs, one tile each at least). Measured
(H200, ``benchmarks/results/sm90/SAMPLED.md``, "Draw programs per request"): at 1-2 drawing
requests 32-64 programs per request beat the old cap of 16-32 by 2-5 us; from 64 requests on
the count follows ``DRAW_TARGET_PROGRAMS``."""
DRAW_TARGET_PROGRAMS = 1056
"""Programs of the draw kernel over a step's drawing requests (about 8 per SM of a 132-SM
GPU): each element carries a hash and two logs, so the draw wants more programs in flight than
the memory-bound record pass."""
TOPP_HIST_TARGET_PROGRAMS = 528
"""Programs of the top-p histogram kernel over a step's rows (about 4 per SM of a 132-SM GPU):
in a splits sweep on one H200 (benchmarks/topp_kernels.py, bf16, 32 and 160 rows, shards of
19k-100k columns) 4 splits per row at 160 rows and 4-8 at 32 rows were fastest, 2 (the record
kernel's target) 10-30 % slower; at 4-32 rows on an H100 its 16 splits at block 4096 were the
fastest of 8-64 with the merge counted (``benchmarks/results/sm90/topp_hist_splits_small``).
Untuned default until the tuner covers the family."""
TOPP_MERGE_PARTS = 8
"""Most split records ``topp_combine`` merges at once (its ``PARTS``: the next power of two of
the row's splits, at most this; more in turn). On one H200 in the engine loop (V = 200064, TP
1, 16 splits per row) 8 at 8 warps took 8.8 us at 4 rows against 16.6 for one at a time at 2
warps, 9.1-16.2 against 20.4-24.0 at 32 rows (benchmarks/results/sm90/topp_merge_ab); on an
H100 (benchmarks/topp_kernels.py traffic) 8 at 8 warps was the fastest of PARTS 1-16 x warps
2-8 at 16 splits (8.9 against 17.2-24.8 us one at a time), and at 160 rows' 4 splits all 4 at
once at 8 warps took 4.7 us against 7.5. Untuned default until the tuner covers the family."""
TOPP_SPLIT_REPLAY_THREADS = 256
"""Threads per program of ``topp_replay`` on vLLM's split pipelines (the monolithic search keeps
the variant's ``NUM_WARPS``): 8 warps on NVIDIA, 4 wavefronts of 64 on AMD CDNA
(:func:`topp_split_replay_warps`). In the engine loop on an H100 (V = 200064, TP 1, `--kernels`,
four machine sessions) 8 warps took the split search from 77.4-79.6 to 59.0-60.4 us at 4 and 32
rows (benchmarks/results/sm90/topp_replay_warps), and the folded top-p call's kernel sum at 4
rows from 240.4-242.8 to 202.7-203.7 us -- PDL-on sums, which count each kernel's device wait
on the one ahead: 113.1 us with PDL off (benchmarks/results/sm90/topp_kernels_pdl_off). With a
round's pivots decided four at a time (the variant's ``CONFIGS``, ``PIVOTS`` 4) neither warps
spill on sm90, nor 4 wavefronts on gfx950 (``generator/spills.py``); gfx950 is untimed. Untuned
default until the tuner covers the family."""

CANDIDATE_CHOICES = (32, 64, 128)
"""The C a table row may select (the tuner's ``candidates`` axis)."""
SPLIT_PIPELINE_MAX_ROWS = 64
"""vLLM's top-p pipeline choice (``apply_top_k_top_p_triton``, research §1.1): a step of at most
this many logits rows without an active top-k runs the split pipeline, a larger one the
monolithic kernel. The nucleus guard models the one vLLM would run."""


RECORD_ELEMS_PER_THREAD = 16
"""Most elements of a record / draw tile per thread in the built-in warps: each element carries
a hash, two logs and the online ``(max, sum exp)`` state, and on sm90 the one-pass record kernel
at 32 elements per thread (block 4096, 4 warps) spills 2.6-2.8 KB per thread (AOT report)."""


def default_num_warps(family: str, block: int) -> int:
    """Warps of a local-stage variant where nothing names them -- the built-in launch rule
    (:func:`builtin_launch`, :func:`shardmax.ops.sampled.draw_launch`) -- and the warps the AOT
    report (``generated/<arch>/resources.json``) compiles it at: ``shard_keys`` 4 below block
    4096, 8 from 4096 on; ``sampled_record`` 4 up to block 2048, then ``block / (32 *``
    :data:`RECORD_ELEMS_PER_THREAD` ``)`` (8 at 4096); ``sampled_draw`` :data:`DRAW_WARPS`. A
    table row names its own warps (the tuner keeps only points that do not spill, per warps).

    Raises:
        ValueError: another family, or a block that is not a positive power of two.
    """
    if block < 1 or block & (block - 1):
        raise ValueError(f"block: expected a positive power of two, got {block}")
    if family == "shard_keys":
        return 8 if block >= 4096 else 4
    if family == "sampled_record":
        return max(4, block // (32 * RECORD_ELEMS_PER_THREAD))
    if family == "sampled_draw":
        return DRAW_WARPS
    raise ValueError(
        f"family: {family!r} has no built-in warps rule (shard_keys, sampled_record, sampled_draw)"
    )


def topp_split_replay_warps(arch: str) -> int:
    """Warps of ``topp_replay`` on vLLM's split pipelines on ``arch`` (``"sm90"``-style or
    ``"gfx950"``-style; any ``gfx`` arch counts 64 lanes per wavefront):
    :data:`TOPP_SPLIT_REPLAY_THREADS` over the arch's warp width."""
    return TOPP_SPLIT_REPLAY_THREADS // (64 if arch.startswith("gfx") else 32)


TOPP_COMBINE_PARTS4_WARPS = 4
"""Warps of ``topp_combine``'s merge of 3-4 split records per row (``PARTS`` 4) on NVIDIA; its
other launches, and every launch on AMD, keep the module's ``NUM_WARPS`` (8). At 8 warps ptxas
gives that set 128 registers and spills 8 B per thread on sm90 (4 warps: 189 registers, no
spill; gfx950 spills at neither). On one H100 (``benchmarks/results/sm90/topp_combine_warps``,
V = 200064 bf16 records, graph replay, PDL off) 4 warps took 4.60 / 4.67 us at 160 / 256 rows of
4 splits against 4.53 / 4.64 at 8, 8.07 against 8.25 at 512 rows of 4 splits, and 5.11 against
4.81 at 160 rows of 3 splits; every launch's records == the default launch's. Untuned default
until the tuner covers the family."""


def topp_combine_warps(parts: int, arch: str) -> int | None:
    """Warps of ``topp_combine`` merging ``parts`` split records at once on ``arch``
    (``"sm90"``-style or ``"gfx950"``-style): :data:`TOPP_COMBINE_PARTS4_WARPS` for ``PARTS``
    4 on NVIDIA, else None (the module's own ``NUM_WARPS``)."""
    return TOPP_COMBINE_PARTS4_WARPS if parts == 4 and not arch.startswith("gfx") else None


def default_record_splits(
    rows: int,
    width: int,
    block: int,
    target_programs: int,
    most: int = MAX_RECORD_SPLITS,
    min_tiles: int = 2,
) -> int:
    """Programs per row of the record kernel (a power of two): about ``target_programs``
    programs in all, at most ``most`` (:data:`MAX_RECORD_SPLITS`; the draw kernel's
    :data:`MAX_DRAW_SPLITS`), and at least ``min_tiles`` tiles of ``block`` columns per split
    (the draw: 1). ``width`` is the padded shard width, the same on every rank (so is the
    result, as the all_gather needs)."""
    if rows <= 0:
        return 1
    cap = min(triton.cdiv(target_programs, rows), max(1, width // (min_tiles * block)))
    s = 1
    while s * 2 <= min(cap, most):
        s *= 2
    return s


def builtin_launch(
    op: str, dtype: str, rows: int, width: int, align: int, target_programs: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(variant axes, launch)`` of the portable rule for one problem.

    Greedy local stage (ops ``argmax`` / ``verify``): block 4096 (1024 for narrow shards), about
    ``target_programs`` programs, 8 warps (4 at block 1024), all_gather. Op ``sampled``: the record
    kernel at block :data:`DEFAULT_RECORD_BLOCK`, 4 warps, C = :data:`TOPK_CANDIDATES`,
    :func:`default_record_splits` programs per row and :data:`BUILTIN_PHASES` phases. ``target_programs`` is 1 on a CPU (the
    interpreter runs programs one after another; more splits only cost time).
    """
    if op == "sampled":
        splits = default_record_splits(rows, width, DEFAULT_RECORD_BLOCK, target_programs)
        axes = {"family": "sampled_record", "dtype": dtype, "block": DEFAULT_RECORD_BLOCK}
        launch = {
            "splits": splits,
            "num_warps": default_num_warps("sampled_record", DEFAULT_RECORD_BLOCK),
            "candidates": TOPK_CANDIDATES,
            "transport": "allgather",
            "phases": BUILTIN_PHASES,
        }
        return axes, launch
    block = 4096 if width >= 4096 else 1024
    max_splits = max(1, triton.cdiv(width, block))
    want = triton.cdiv(target_programs, max(rows, 1))
    splits = 1
    while splits * 2 <= min(want, max_splits, MAX_SPLITS):
        splits *= 2
    axes = {"family": "shard_keys", "dtype": dtype, "align": align, "block": block}
    launch = {
        "splits": splits,
        "num_warps": default_num_warps("shard_keys", block),
        "num_stages": 2,
        "transport": "allgather",
    }
    return axes, launch
