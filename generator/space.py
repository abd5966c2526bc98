"""The variant space: every structural kernel variant the generator emits.

Only structure is generated (design §4): the dtype load path, the aligned/unmasked fast path,
the register-tile width (BLOCK), the unrolled rank loop and the transport. Numbers that do not
change the code (num_warps, num_stages, splits per row, rows per program) are launch parameters
chosen by the tuner and stored in the tables; their per-arch static limits live here too so the
tuner never proposes an invalid point (design §5 rule 1).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from shardmax.runtime.defaults import RECORD_BLOCKS
from shardmax.runtime.variants import DTYPES, TOPP_DTYPES, TRANSPORTS, UNROLLED_TP, VariantKey

BLOCKS = (1024, 2048, 4096, 8192)
"""Register-tile widths of the local stage (elements per program and loop step)."""

ALIGNMENTS = (1, 16)
"""Row-stride/chunk alignment in elements. 16 elements are >= 16 bytes for every supported
dtype, the widest vector load on sm90 and gfx950, so a larger alignment gives the compiler
nothing more; 1 is the generic, fully masked, unspecialised variant."""

TL_DTYPE = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}


@dataclass(frozen=True)
class ArchLimits:
    """Static launch limits of one GPU architecture (design §5 rule 1)."""

    arch: str  # "sm90" | "gfx950": arch ids, never product names
    backend: str  # Triton backend: "cuda" | "hip"
    target_arch: int | str  # what triton.backends.compiler.GPUTarget takes
    warp_size: int
    max_threads_per_program: int = 1024

    @property
    def num_warps(self) -> tuple[int, ...]:
        """num_warps values with num_warps * warp_size <= max threads (AMD wave64 -> <= 16)."""
        return tuple(
            w for w in (1, 2, 4, 8, 16, 32) if w * self.warp_size <= self.max_threads_per_program
        )


ARCHES = {
    "sm90": ArchLimits("sm90", "cuda", 90, 32),
    "gfx950": ArchLimits("gfx950", "hip", "gfx950", 64),
}


def local_variants() -> Iterator[VariantKey]:
    for dtype in DTYPES:
        for align in ALIGNMENTS:
            for block in BLOCKS:
                yield VariantKey("shard_keys", dtype=dtype, align=align, block=block)


def finish_variants() -> Iterator[VariantKey]:
    for family in ("argmax_pick", "verify_finish"):
        for transport in TRANSPORTS:
            if transport == "allreduce":
                yield VariantKey(family, transport=transport)
            else:
                for tp in (*(str(t) for t in UNROLLED_TP), "n"):
                    yield VariantKey(family, tp=tp, transport=transport)


SAMPLED_BLOCKS = RECORD_BLOCKS
"""Register-tile widths of the sampled-verification record kernel. Narrower than the greedy
local stage's: every element carries a MurmurHash3 + two logs (Gumbel key) and the online
(max, sumexp) state, so 8192-wide tiles would spill."""


def sampled_variants() -> Iterator[VariantKey]:
    """Sampled verification (compact mode): record kernel per (dtype, block), the two-phase
    step's draw kernel per (dtype, block) and its pick, one candidate merge, finish per TP."""
    for dtype in DTYPES:
        for block in SAMPLED_BLOCKS:
            yield VariantKey("sampled_record", dtype=dtype, block=block)
    for dtype in DTYPES:
        for block in SAMPLED_BLOCKS:
            yield VariantKey("sampled_draw", dtype=dtype, block=block)
    yield VariantKey("sampled_pick")
    yield VariantKey("sampled_merge")
    yield VariantKey("row_params")
    for tp in (*(str(t) for t in UNROLLED_TP), "n"):
        yield VariantKey("sampled_finish", tp=tp, transport="allgather")


def strict_variants() -> Iterator[VariantKey]:
    """Strict mode of sampled verification: vLLM's block statistics per (dtype of the tensor
    vLLM reads, whether its row stride is a multiple of 16) on a rank's whole blocks, on the cut
    blocks rebuilt from raw pieces, on replayed kept sets (fp32 only), and vLLM's LSE combine."""
    for family in ("block_stats", "strict_rebuild"):
        for dtype in DTYPES:
            for align in ALIGNMENTS:
                yield VariantKey(family, dtype=dtype, align=align)
    for align in ALIGNMENTS:
        yield VariantKey("strict_replay", align=align)
    yield VariantKey("strict_lse")


TOPP_HIST_BLOCKS = (2048, 4096)
"""Register-tile widths of the top-p histogram kernel (a key, a value and a bin per element)."""


def topp_variants() -> Iterator[VariantKey]:
    """Top-p replay (:mod:`shardmax.reference.nucleus_replay` in kernels): the per-rank level
    histogram per (dtype, block), the merge of its column splits and the merge + replay per dtype
    (the pipeline is a constexpr)."""
    for dtype in TOPP_DTYPES:
        for block in TOPP_HIST_BLOCKS:
            yield VariantKey("topp_hist", dtype=dtype, block=block)
    for family in ("topp_combine", "topp_replay"):
        for dtype in TOPP_DTYPES:
            yield VariantKey(family, dtype=dtype)


def graph_variants() -> Iterator[VariantKey]:
    """A step replayed from a CUDA graph (:mod:`shardmax.runtime.graphs`): the byte copies
    between the addresses of the step's argument table; the fetch of an output slot's table
    from host memory; the padded sub-batch of a per-request
    resolution replayed from one (``CapturedResolution``), per logits dtype, and the write of its
    answers into the step's outputs; a folded fallback's flagged requests picked on the device
    (``resolve_select``)."""
    yield VariantKey("table_copy")
    yield VariantKey("table_fetch")
    for dtype in DTYPES:
        yield VariantKey("resolve_fill", dtype=dtype)
    yield VariantKey("resolve_apply")
    yield VariantKey("resolve_select")


def all_variants() -> list[VariantKey]:
    """Every variant, in a fixed order (the MANIFEST order)."""
    return [
        *local_variants(), *finish_variants(), *sampled_variants(), *strict_variants(),
        *topp_variants(), *graph_variants(),
    ]  # fmt: skip


TEMPLATE_OF_FAMILY = {
    "shard_keys": "shard_keys.py.j2",
    "argmax_pick": "argmax_pick.py.j2",
    "verify_finish": "verify_finish.py.j2",
    "sampled_record": "sampled_record.py.j2",
    "sampled_finish": "sampled_finish.py.j2",
    "sampled_draw": "sampled_draw.py.j2",
    "sampled_pick": "sampled_pick.py.j2",
    "sampled_merge": "sampled_merge.py.j2",
    "row_params": "row_params.py.j2",
    "block_stats": "block_stats.py.j2",
    "strict_rebuild": "strict_rebuild.py.j2",
    "strict_replay": "strict_replay.py.j2",
    "strict_lse": "strict_lse.py.j2",
    "table_copy": "table_copy.py.j2",
    "table_fetch": "table_fetch.py.j2",
    "resolve_fill": "resolve_fill.py.j2",
    "resolve_apply": "resolve_apply.py.j2",
    "resolve_select": "resolve_select.py.j2",
    "topp_hist": "topp_hist.py.j2",
    "topp_combine": "topp_combine.py.j2",
    "topp_replay": "topp_replay.py.j2",
}


def template_context(key: VariantKey) -> dict[str, object]:
    """The Jinja context of one variant: its axes, nothing else."""
    ctx: dict[str, object] = {"name": key.name, "family": key.family}
    if key.family == "shard_keys":
        ctx.update(
            dtype=key.dtype, tl_dtype=TL_DTYPE[str(key.dtype)], align=key.align, block=key.block
        )
    elif key.family in (
        "sampled_record",
        "sampled_draw",
        "topp_hist",
        "topp_combine",
        "topp_replay",
    ):
        ctx.update(dtype=key.dtype, tl_dtype=TL_DTYPE[str(key.dtype)], block=key.block)
    elif key.family == "resolve_fill":
        ctx.update(dtype=key.dtype, tl_dtype=TL_DTYPE[str(key.dtype)])
    elif key.family in ("block_stats", "strict_rebuild"):
        ctx.update(dtype=key.dtype, tl_dtype=TL_DTYPE[str(key.dtype)], align=key.align)
    elif key.family == "strict_replay":
        ctx.update(align=key.align)
    elif key.family not in (
        "sampled_pick",
        "sampled_merge",
        "row_params",
        "strict_lse",
        "table_copy",
        "table_fetch",
        "resolve_apply",
        "resolve_select",
    ):
        ctx.update(
            transport=key.transport,
            tp=key.tp,
            tp_literal=repr(key.unrolled_tp) if key.unrolled_tp else "None",
        )
    return ctx
