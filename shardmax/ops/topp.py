"""Top-p kept sets from vocab shards: level histograms per rank, one exchange, the replay.

The kernel form of :mod:`shardmax.reference.nucleus_replay` and
:mod:`shardmax.reference.nucleus_shards` (their docstrings state the semantics: vLLM 0.32 /
0.33's top-p searches replayed on a level histogram, every decision certified). One step:

1. :func:`topp_histograms` -- each TP rank, on its own vocab shard: ``topp_hist_*`` writes one
   :data:`RECORD_WORDS`-word int32 record per row (:data:`RECORD_BYTES` bytes: 511 uint16 level
   counts below the shard's top key, the top key, max, ``sum exp``, tail mass, min, the first
   tile's sums) -- per column split of the shard when the rows are too few to fill the GPU, and
   ``topp_combine_*`` then merges the splits' records into the rank's;
2. the records cross the ranks (``all_gather`` along a new leading dim: ``[tp, rows, words]``);
3. :func:`topp_kept_sets` -- every rank, on the same gathered bytes: ``topp_replay_*`` merges
   each row's records and replays the pipeline vLLM runs for it, writing the certified kept set
   (or the reason it is not certified) per row.

Both launches are fixed-shape and allocation-free given ``out`` buffers (CUDA-graph capturable);
nothing here reads a value back on the host. :class:`ToppPlan` does the host work once per step
shape (checks, splits, buffers) so that each call only launches.
"""

from __future__ import annotations

import functools

import torch
import triton

from shardmax.reference.nucleus_replay import HIST_LEVELS, Pipeline
from shardmax.runtime.defaults import (
    TOPP_HIST_TARGET_PROGRAMS,
    TOPP_MERGE_PARTS,
    default_record_splits,
    topp_combine_warps,
    topp_split_replay_warps,
)
from shardmax.runtime.indirect import logits_arg
from shardmax.runtime.kernels import kernel
from shardmax.runtime.variants import VariantKey

__all__ = [
    "KEPT_WORDS",
    "RECORD_BYTES",
    "RECORD_WORDS",
    "STAT_WORDS",
    "TOPP_HIST_BLOCK",
    "ToppPlan",
    "topp_hist_splits",
    "topp_histograms",
    "topp_kept_sets",
]

_ARCH_FAMILY = "gfx" if torch.version.hip else "sm"
"""This platform's arch family, for the launches whose warps depend on it."""
_SPLIT_REPLAY_WARPS = topp_split_replay_warps(_ARCH_FAMILY)
"""Warps of the split top-p searches on this platform (AMD wavefronts are 64 lanes wide)."""
REPLAY_PIVOTS = (1, 2, 4, 8)
"""The ``pivots`` :func:`topp_kept_sets` takes: a split round's eight pivots in groups of this many."""

RECORD_WORDS = HIST_LEVELS // 2 + 8
"""int32 words of one rank's record of one row (the exchange's unit)."""
RECORD_BYTES = 4 * RECORD_WORDS
KEPT_WORDS = 10
"""int32 words of :func:`topp_kept_sets`' answer per row: reason, nomask, boundary, ties_lo,
ties_hi, count, ordered, branches, top_key, boundary_key."""
STAT_WORDS = 4
"""fp64 words of :func:`topp_kept_sets`' statistics per row: ``m``, ``z``, the kept set's
``sum exp(x - m)`` with the fewest and the most boundary ties."""
TOPP_HIST_BLOCK = 4096
"""Register tile of ``topp_hist_*`` until the tuner measures the family (both blocks are
generated and exact). On one H200 at 16 warps (benchmarks/topp_kernels.py), 4096 took 0.82-0.95x
the time of 2048 at 160 rows and at 32 rows on shards of 38k+ columns, 1.15x on TP 8's 19k."""

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _dtype_name(t: torch.Tensor, arg: str) -> str:
    name = _DTYPES.get(t.dtype)
    if name is None:
        raise TypeError(f"{arg}: top-p level histograms need bf16 / fp16 logits, got {t.dtype}")
    return name


def _row_vector(t: torch.Tensor, rows: int, arg: str, device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.shape != (rows,):
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{arg}: expected fp32 [{rows}], got {shape}")
    if t.dtype != torch.float32 or t.device != device:
        raise TypeError(f"{arg}: expected fp32 on {device}, got {t.dtype} on {t.device}")
    return t.contiguous()


def _check_buffer(
    t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, arg: str
) -> None:
    """An output / workspace buffer: a contiguous tensor of this shape, dtype and device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{arg}: expected a tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape or t.dtype != dtype or t.device != device or not t.is_contiguous():
        raise ValueError(
            f"{arg}: expected a contiguous {dtype} {list(shape)} on {device}, got "
            f"{t.dtype} {list(t.shape)} on {t.device}"
            f"{'' if t.is_contiguous() else ' (not contiguous)'}"
        )


def _rank_major(records: torch.Tensor) -> bool:
    """``[tp, rows, RECORD_WORDS]`` records with each rank's ``[rows, RECORD_WORDS]`` contiguous
    and the ranks apart by at least that (a view into a larger exchange buffer is fine)."""
    tp, rows, words = records.shape
    if rows == 0 or tp == 0:
        return True
    return (
        records.stride(2) == 1
        and (rows == 1 or records.stride(1) == words)
        and (tp == 1 or records.stride(0) >= rows * words)
    )


def _launch_local(
    local_logits: torch.Tensor,
    temperature: torch.Tensor,
    out: torch.Tensor,
    scratch: torch.Tensor | None,
    counts: torch.Tensor,
    *,
    dtype_name: str,
    num_valid: int,
    vocab_start: int,
    tile0: int,
    block: int,
    splits: int,
    atomic: bool,
) -> None:
    """The local stage's launches on checked arguments: ``topp_hist`` over ``(rows, splits)``
    into ``out`` (one split) or ``scratch``, then ``topp_combine`` of the splits into ``out``."""
    rows = local_logits.shape[0]
    chunk = triton.cdiv(triton.cdiv(max(num_valid, 1), splits), block) * block
    dest = out if splits == 1 else scratch
    arg, indirect = logits_arg(local_logits)  # a replayed step: the address from its table
    kernel(VariantKey("topp_hist", dtype=dtype_name, block=block).name)(
        (rows, splits), arg, temperature, dest, counts, local_logits.stride(0),
        num_valid, chunk, vocab_start, tile0, LEVELS=HIST_LEVELS, BLOCK=block, ATOMIC=atomic,
        INDIRECT=indirect,
    )  # fmt: skip
    if splits > 1:
        parts = merge_block(splits)
        warps = topp_combine_warps(parts, _ARCH_FAMILY)
        kernel(VariantKey("topp_combine", dtype=dtype_name).name)(
            (rows,), dest, temperature, out, rows, splits, LEVELS=HIST_LEVELS, PARTS=parts,
            **({} if warps is None else {"num_warps": warps}),
        )  # fmt: skip


def _launch_replay(
    records: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    sigma: torch.Tensor,
    kept: torch.Tensor,
    stat: torch.Tensor,
    *,
    dtype_name: str,
    pipeline: Pipeline,
    tile0: int,
    num_warps: int | None = None,
    pivots: int | None = None,
) -> None:
    """``topp_replay``'s launch on checked arguments (``num_warps`` None: the split pipelines
    at :data:`_SPLIT_REPLAY_WARPS`, the monolithic one at the variant's own; ``pivots`` None:
    the module's constexpr set of the pipeline, :func:`_replay_constexprs`)."""
    tp, rows = records.shape[:2]
    if num_warps is None and pipeline != Pipeline.MONOLITHIC:
        num_warps = _SPLIT_REPLAY_WARPS
    name = VariantKey("topp_replay", dtype=dtype_name).name
    const = _replay_constexprs(name, pipeline)
    if pivots is not None and pipeline != Pipeline.MONOLITHIC:  # (read by the split searches)
        const = {**const, "PIVOTS": pivots}
    kernel(name)(
        (rows,), records, temperature, top_p, sigma, kept, stat, rows, records.stride(0), tp, tile0,
        **const, **({} if num_warps is None else {"num_warps": num_warps}),
    )  # fmt: skip


_PIPELINE_CONFIG = {Pipeline.SPLIT: "split", Pipeline.SPLIT_V032: "split_v032"}
"""``topp_replay``'s ``CONFIGS`` entry of each split pipeline (the monolithic one: its
``CONSTEXPRS``)."""


@functools.cache
def _replay_constexprs(name: str, pipeline: Pipeline) -> dict[str, int]:
    """The constexprs ``topp_replay`` variant ``name`` is launched with on ``pipeline``: its
    module's ``CONSTEXPRS`` with the pipeline's ``CONFIGS`` entry (``PIPELINE`` and, on the split
    searches, ``PIVOTS``) -- the sets the AOT report compiles (``generator/spills.py``)."""
    mod = kernel(name).module
    over = mod.CONFIGS[_PIPELINE_CONFIG[pipeline]] if pipeline in _PIPELINE_CONFIG else {}
    const = {**mod.CONSTEXPRS, **over}
    const.pop("PDL", None)  # the launcher decides (shardmax.runtime.kernels)
    if const["PIPELINE"] != int(pipeline) or const["LEVELS"] != HIST_LEVELS:
        raise RuntimeError(
            f"{name}: constexprs {const} do not launch {pipeline!r} on {HIST_LEVELS} levels"
        )
    return const


def merge_block(parts: int) -> int:
    """``PARTS`` of ``topp_combine``'s merge of ``parts`` split records per row: the next power
    of two, at most :data:`~shardmax.runtime.defaults.TOPP_MERGE_PARTS`."""
    return min(TOPP_MERGE_PARTS, triton.next_power_of_2(max(int(parts), 1)))


def topp_hist_splits(rows: int, width: int, block: int, device: torch.device) -> int:
    """Column splits per row :func:`topp_histograms` uses by default: about
    ``TOPP_HIST_TARGET_PROGRAMS`` programs, at least two ``block`` tiles each (a function of the
    padded shard width, the same on every rank); 1 under the interpreter (CPU tensors)."""
    target = 1 if device.type == "cpu" else TOPP_HIST_TARGET_PROGRAMS
    return default_record_splits(rows, width, block, target)


def topp_histograms(
    local_logits: torch.Tensor,
    temperature: torch.Tensor,
    *,
    num_valid: int,
    vocab_start: int,
    tile0: int = 8192,
    block: int = TOPP_HIST_BLOCK,
    splits: int | None = None,
    out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    atomic: bool = True,
) -> torch.Tensor:
    """One rank's top-p records: ``int32 [rows, RECORD_WORDS]`` (module docstring, step 1).

    Args:
        local_logits: bf16 / fp16 ``[rows, >= num_valid]`` -- this rank's vocab shard of the
            target logits (raw, before temperature), last dim contiguous; padding columns past
            ``num_valid`` are never read.
        temperature: fp32 ``[rows]`` -- each row's request temperature (0 / 1: untouched).
        num_valid: real columns of the shard; ``vocab_start``: the global id of column 0.
        tile0: vLLM's first-tile width for the monolithic pipeline's mean / std (8192 on CUDA).
        block: ``topp_hist_*`` register tile (2048 or 4096).
        splits: programs per row (default: enough to fill the GPU, at least two tiles each, from
            the shard width -- the same on every rank; 1 under the interpreter).
        out: optional ``int32 [rows, RECORD_WORDS]`` to write into (no allocation).
        scratch: optional ``int32 [splits * rows, RECORD_WORDS]`` for the split records.
        counts: optional ``int32 [splits * rows, HIST_LEVELS]`` workspace of the atomic level
            counts (``atomic``; with ``out``, ``scratch`` and ``counts`` nothing is allocated: the
            call is CUDA-graph capturable).
        atomic: count levels with global atomics (else ``tl.histogram``; both exact).

    Raises:
        TypeError: logits not bf16 / fp16, a parameter tensor of another dtype / device.
        ValueError: shapes, ``num_valid`` / ``vocab_start`` / ``block`` out of range.
    """
    if not isinstance(local_logits, torch.Tensor) or local_logits.dim() != 2:
        raise ValueError("local_logits: expected a 2-D [rows, columns] tensor")
    dtype = _dtype_name(local_logits, "local_logits")
    rows, width = local_logits.shape
    if local_logits.stride(1) != 1 and width > 1:
        raise ValueError(
            f"local_logits: last dim must be contiguous, stride {local_logits.stride()}"
        )
    for arg, val in (("num_valid", num_valid), ("vocab_start", vocab_start), ("tile0", tile0),
                     ("block", block)):  # fmt: skip
        if type(val) is not int:
            raise TypeError(f"{arg}: expected an int, got {type(val).__name__}")
    if splits is not None and type(splits) is not int:
        raise TypeError(f"splits: expected an int or None, got {type(splits).__name__}")
    if not 0 <= num_valid <= width:
        raise ValueError(f"num_valid: {num_valid} outside [0, {width}]")
    if vocab_start < 0 or vocab_start + num_valid >= 2**31:
        raise ValueError(f"vocab_start: {vocab_start} out of range")
    if block not in (2048, 4096):
        raise ValueError(f"block: expected 2048 or 4096, got {block}")
    temperature = _row_vector(temperature, rows, "temperature", local_logits.device)
    if out is None:
        out = torch.empty((rows, RECORD_WORDS), dtype=torch.int32, device=local_logits.device)
    else:
        _check_buffer(out, (rows, RECORD_WORDS), torch.int32, local_logits.device, "out")
    if splits is None:
        splits = topp_hist_splits(rows, width, block, local_logits.device)
    if splits < 1:
        raise ValueError(f"splits: expected >= 1, got {splits}")
    if rows == 0:
        return out
    if splits > 1:
        shape = (splits * rows, RECORD_WORDS)
        if scratch is None:
            scratch = torch.empty(shape, dtype=torch.int32, device=local_logits.device)
        else:
            _check_buffer(scratch, shape, torch.int32, local_logits.device, "scratch")
    cshape = (splits * rows, HIST_LEVELS)
    if counts is None:
        counts = torch.empty(cshape if atomic else (1, 1), dtype=torch.int32, device=out.device)
    elif atomic:
        _check_buffer(counts, cshape, torch.int32, local_logits.device, "counts")
    _launch_local(
        local_logits, temperature, out, scratch, counts, dtype_name=dtype, num_valid=num_valid,
        vocab_start=vocab_start, tile0=tile0, block=block, splits=splits, atomic=atomic,
    )  # fmt: skip
    return out


def topp_kept_sets(
    records: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    sigma: torch.Tensor,
    *,
    dtype: torch.dtype,
    pipeline: Pipeline,
    tile0: int = 8192,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    num_warps: int | None = None,
    pivots: int | None = None,
    check_values: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's certified kept set from the gathered records (module docstring, step 3).

    Args:
        records: int32 ``[tp, rows, RECORD_WORDS]`` -- every rank's :func:`topp_histograms`,
            rank-major (``all_gather`` along dim 0); each rank's records contiguous, the ranks
            possibly further apart (a view of a larger gathered buffer).
        temperature / top_p: fp32 ``[rows]`` (``top_p >= 1``: no top-p, answered "no mask").
        sigma: fp32 ``[200]`` -- vLLM's ``_NORMAL_CDF_TO_SIGMA_TABLE`` (read by the monolithic
            pipeline only; :func:`shardmax.runtime.topp_tables.sigma_table`).
        dtype: the logits' dtype (bf16 / fp16: how level keys map to values).
        pipeline: the :class:`~shardmax.reference.nucleus_replay.Pipeline` vLLM runs for these
            rows (:func:`~shardmax.reference.nucleus_replay.pipeline_for`).
        tile0: the monolithic kernel's first-tile width (as given to :func:`topp_histograms`).
        out: optional ``(kept, stat)`` buffers to write into (no allocation).
        num_warps: warps per row (default: :func:`~shardmax.runtime.defaults.
            topp_split_replay_warps` of the platform on the split pipelines, the variant's
            ``NUM_WARPS`` on the monolithic one).
        pivots: on the split pipelines, how many of a round's eight pivots the search decides at
            once, one of :data:`REPLAY_PIVOTS` (default: the ``PIVOTS`` of the variant's
            ``CONFIGS`` for the pipeline); the answer is the same bits at every value, only
            registers and time differ. The monolithic pipeline ignores it.
        check_values: read ``top_p`` / ``temperature`` on the host and raise for values vLLM
            refuses (a device sync; without it such rows get reason 8).

    Returns:
        ``(kept, stat)``: int32 ``[rows, KEPT_WORDS]`` (:data:`KEPT_WORDS`; ``reason`` is a
        :class:`~shardmax.reference.nucleus_replay.ReplayReason` value, 7 for a row with NaN /
        ``+inf`` or no finite value, 8 for ``top_p <= 0`` / NaN or ``T < 0`` / NaN) and fp64
        ``[rows, STAT_WORDS]`` (:data:`STAT_WORDS`: the processed max ``m``, ``z = sum exp(x -
        m)``, the kept set's sums).

    Raises:
        TypeError / ValueError: dtypes, shapes or devices other than the above.
    """
    dname = _DTYPES.get(dtype)
    if dname is None:
        raise TypeError(f"dtype: top-p replay needs bf16 / fp16, got {dtype}")
    if not isinstance(records, torch.Tensor) or records.dim() != 3:
        raise ValueError("records: expected int32 [tp, rows, RECORD_WORDS]")
    tp, rows, words = records.shape
    if records.dtype != torch.int32 or words != RECORD_WORDS or not _rank_major(records):
        raise ValueError(
            f"records: expected int32 [tp, rows, {RECORD_WORDS}], each rank's records contiguous, "
            f"got {records.dtype} {tuple(records.shape)} strides {records.stride()}"
        )
    if tp < 1:
        raise ValueError("records: no rank")
    device = records.device
    temperature = _row_vector(temperature, rows, "temperature", device)
    top_p = _row_vector(top_p, rows, "top_p", device)
    if not isinstance(sigma, torch.Tensor):
        raise TypeError(f"sigma: expected an fp32 tensor [200], got {type(sigma).__name__}")
    _check_buffer(sigma, (200,), torch.float32, device, "sigma")
    if type(tile0) is not int:
        raise TypeError(f"tile0: expected an int, got {type(tile0).__name__}")
    pipeline = Pipeline(pipeline)
    if pivots is not None and (type(pivots) is not int or pivots not in REPLAY_PIVOTS):
        raise ValueError(f"pivots: expected one of {REPLAY_PIVOTS} or None, got {pivots!r}")
    if out is None:
        kept = torch.empty((rows, KEPT_WORDS), dtype=torch.int32, device=device)
        stat = torch.empty((rows, STAT_WORDS), dtype=torch.float64, device=device)
    else:
        kept, stat = out
        _check_buffer(kept, (rows, KEPT_WORDS), torch.int32, device, "out[0] (kept)")
        _check_buffer(stat, (rows, STAT_WORDS), torch.float64, device, "out[1] (stat)")
    if check_values and rows:  # reads the parameters on the host (a sync): explicit, off by default
        bad_p = ~(top_p > 0) | torch.isnan(top_p)
        bad_t = ~(temperature >= 0)
        if bool(bad_p.any()) or bool(bad_t.any()):
            raise ValueError(
                f"top_p / temperature: expected top_p in (0, 1] (>= 1: none) and T >= 0; rows "
                f"{torch.nonzero(bad_p | bad_t).flatten().tolist()[:8]} are not"
            )
    if rows == 0:
        return kept, stat
    _launch_replay(records, temperature, top_p, sigma, kept, stat, dtype_name=dname,
                   pipeline=pipeline, tile0=tile0, num_warps=num_warps,
                   pivots=pivots)  # fmt: skip
    return kept, stat


class ToppPlan:
    """The host work of :func:`topp_histograms` + :func:`topp_kept_sets` done once per (rows,
    shard geometry, dtype, TP, pipeline, device): arguments checked, splits chosen, every buffer
    allocated; :meth:`local` and :meth:`kept` then only launch (no allocation, no host sync, no
    argument checks beyond the shapes: CUDA-graph capturable) -- the plan/run split of the
    runtime, for the eager call an engine makes every step.

    Args:
        rows: logits rows of the step; ``width`` / ``num_valid`` / ``vocab_start``: this rank's
            padded shard width, real columns and first global id; ``tp``: ranks.
        dtype: bf16 / fp16; ``pipeline``: vLLM's top-p pipeline for these rows; ``sigma``: vLLM's
            sigma table (fp32 ``[200]`` on ``device``); ``tile0``: its first-tile width.

    Raises:
        TypeError / ValueError: as :func:`topp_histograms` / :func:`topp_kept_sets`.
    """

    def __init__(
        self,
        rows: int,
        width: int,
        *,
        num_valid: int,
        vocab_start: int,
        tp: int,
        dtype: torch.dtype,
        pipeline: Pipeline,
        sigma: torch.Tensor,
        device: torch.device,
        tile0: int = 8192,
        block: int = TOPP_HIST_BLOCK,
    ) -> None:
        name = _DTYPES.get(dtype)
        if name is None:
            raise TypeError(f"dtype: top-p level histograms need bf16 / fp16, got {dtype}")
        self.dtype_name: str = name
        for arg, val in (("rows", rows), ("width", width), ("num_valid", num_valid),
                         ("vocab_start", vocab_start), ("tp", tp), ("tile0", tile0)):  # fmt: skip
            if type(val) is not int:
                raise TypeError(f"{arg}: expected an int, got {type(val).__name__}")
        if rows < 0 or tp < 1 or not 0 <= num_valid <= width:
            raise ValueError(f"rows={rows}, tp={tp}, num_valid={num_valid}, width={width}")
        if block not in (2048, 4096):
            raise ValueError(f"block: expected 2048 or 4096, got {block}")
        self.rows, self.width, self.tp, self.dtype = rows, width, tp, dtype
        self.num_valid, self.vocab_start, self.tile0, self.block = (
            num_valid,
            vocab_start,
            tile0,
            block,
        )
        self.pipeline = Pipeline(pipeline)
        self.device = torch.device(device)
        _check_buffer(sigma, (200,), torch.float32, self.device, "sigma")
        self.sigma = sigma
        self.splits = topp_hist_splits(rows, width, block, self.device)
        dev, i32 = self.device, torch.int32
        self.records = torch.empty((rows, RECORD_WORDS), dtype=i32, device=dev)
        self.scratch = torch.empty((self.splits * rows, RECORD_WORDS), dtype=i32, device=dev)
        self.counts = torch.empty((self.splits * rows, HIST_LEVELS), dtype=i32, device=dev)
        self.kept_out = torch.empty((rows, KEPT_WORDS), dtype=i32, device=dev)
        self.stat = torch.empty((rows, STAT_WORDS), dtype=torch.float64, device=self.device)

    def local(self, local_logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
        """This rank's records ``int32 [rows, RECORD_WORDS]`` (the plan's buffer; the bytes to
        all-gather). ``local_logits`` ``[rows, width]`` of the plan's dtype, last dim contiguous;
        ``temperature`` fp32 ``[rows]`` contiguous."""
        if local_logits.shape != (self.rows, self.width) or local_logits.dtype != self.dtype:
            raise ValueError(
                f"local_logits: expected {self.dtype} [{self.rows}, {self.width}], got "
                f"{local_logits.dtype} {list(local_logits.shape)}"
            )
        if self.rows == 0:
            return self.records
        _launch_local(
            local_logits, temperature, self.records, self.scratch, self.counts,
            dtype_name=self.dtype_name, num_valid=self.num_valid, vocab_start=self.vocab_start,
            tile0=self.tile0, block=self.block, splits=self.splits, atomic=True,
        )  # fmt: skip
        return self.records

    def kept(
        self, gathered: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's kept set and statistics (:func:`topp_kept_sets`; the plan's buffers)
        from ``gathered`` int32 ``[tp, rows, RECORD_WORDS]`` (every rank's :meth:`local`,
        rank-major; each rank's records contiguous)."""
        if gathered.shape != (self.tp, self.rows, RECORD_WORDS) or not _rank_major(gathered):
            raise ValueError(
                f"gathered: expected [{self.tp}, {self.rows}, {RECORD_WORDS}], got "
                f"{list(gathered.shape)}"
            )
        if self.rows:
            _launch_replay(
                gathered, temperature, top_p, self.sigma, self.kept_out, self.stat,
                dtype_name=self.dtype_name, pipeline=self.pipeline, tile0=self.tile0,
            )  # fmt: skip
        return self.kept_out, self.stat
