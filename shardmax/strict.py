"""Strict mode of sampled verification: vLLM's acceptance LSE rebuilt bit for bit from shards.

Research ``sampled-verification.md`` §2.2 (strict exchange), §2.3 step 1 and §2.5 (layout-faithful
reduction). vLLM's non-greedy acceptance test compares ``x[d] - LSE`` with ``log u`` in fp32, where
``LSE`` combines per-8192-block ``(max_b, sumexp_b)`` of the processed row. ``sumexp_b`` is a
Triton reduction whose addition order depends on the load layout, so compact mode (fp64 LSE +
interval test) cannot reproduce its bits and flags rows at the margin. Strict mode rebuilds the
exact bits:

* every 8192-block lying wholly inside one rank's shard is reduced **on that rank** by the
  ``block_stats`` kernel with vLLM's load layout (same dtype, same 16-element divisibility of the
  address, 4 warps) -- 8 bytes per block and row travel;
* a block cut by a shard edge is rebuilt on every rank from the **raw values** of its pieces
  (each rank sends its part of the ``<= 2`` blocks its edges cut; the processing is re-applied by
  the reader with the same operator) and reduced by the same kernel;
* top-k / top-p / min-p rows (whose processed row is ``-inf`` outside the kept set): the kept
  values, known on every rank from the merged candidates, are written into an fp32 ``[rows, V]``
  scratch row at their ids and reduced like vLLM's fp32 chunk (the "replay");
* ``strict_lse`` combines the blocks exactly as vLLM's one-warp rejection kernel.

Which layout vLLM uses is decided by its *chunk gate* (research §1.1, §1.5): when no request of
the verification chunk needs logits processing, vLLM verifies the **raw** model-dtype tensor (the
gathered LM-head output sliced to ``V``: row stride ``tp * W``); otherwise an **fp32 copy** with
temperature (and top-k / top-p / min-p masks) applied in place (row stride ``V``). The row stride's
divisibility by 16 picks the ``block_stats`` variant (``va16`` / ``va1``); see
:func:`vllm_row_stride`.

One collective per step still: the strict extras ride in the same all_gather as the compact
records (:func:`extras_words` int64 words per rank).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from shardmax import kernels
from shardmax.keys import EMPTY_KEY, unpack_ids
from shardmax.validation import SUPPORTED_DTYPES
from shardmax.variants import VariantKey, build_name

__all__ = [
    "VOCAB_BLOCK",
    "StrictPlan",
    "block_stats",
    "extras_words",
    "plan",
    "rank_extras",
    "rebuild_block_stats",
    "replay_kept",
    "strict_lse",
    "vllm_row_stride",
]

VOCAB_BLOCK = 8192
"""vLLM's ``VOCAB_BLOCK_SIZE`` of the acceptance statistics (research §1.2)."""


@dataclass(frozen=True)
class Segment:
    """One rank's piece of a cut block: global ids ``[lo, hi)`` of cut block ``cut`` (index into
    :attr:`StrictPlan.cut_blocks`), carried in piece slot ``slot``."""

    cut: int
    lo: int
    hi: int
    slot: int


@dataclass(frozen=True)
class StrictPlan:
    """Where each 8192-block of the vocabulary is reduced (static per shard geometry)."""

    vocab: int
    num_blocks: int  # ceil(V / 8192)
    starts: tuple[int, ...]  # vocab_start of every rank
    full: tuple[tuple[int, int], ...]  # per rank: (first block, count) reduced locally
    max_full: int  # stats slots per rank and row (the largest count)
    cut_blocks: tuple[int, ...]  # blocks no single rank holds whole
    segments: tuple[tuple[Segment, ...], ...]  # per rank: its pieces of cut blocks
    slots: int  # piece slots per rank and row
    piece_width: int  # elements per piece slot (the longest piece)


def plan(geometry: list[tuple[int, int]]) -> StrictPlan:
    """The strict layout of a shard geometry ``[(vocab_start, num_valid)]`` in rank order.

    Raises:
        ValueError: the ranks' ranges do not tile ``[0, V)`` without gaps (vLLM's row has every
            id; a gap would have no value to reduce).
    """
    pos = 0
    for r, (s, n) in enumerate(geometry):
        if n and s != pos:
            raise ValueError(
                f"mode='strict': rank {r} starts at vocab id {s}, expected {pos}: the ranks' "
                f"(vocab_start, num_valid) {geometry} must tile [0, V) without gaps"
            )
        pos = s + n if n else pos
    vocab = pos
    nb = triton.cdiv(vocab, VOCAB_BLOCK)
    full: list[tuple[int, int]] = []
    owned: set[int] = set()
    for s, n in geometry:
        e = s + n
        fb = triton.cdiv(s, VOCAB_BLOCK)
        fe = fb
        while fe < nb and min((fe + 1) * VOCAB_BLOCK, vocab) <= e:
            fe += 1
        full.append((fb, fe - fb) if n else (0, 0))
        owned.update(range(fb, fe) if n else ())
    cut = tuple(b for b in range(nb) if b not in owned)
    segments: list[tuple[Segment, ...]] = []
    width = 0
    for s, n in geometry:
        segs: list[Segment] = []
        for ci, b in enumerate(cut):
            lo, hi = max(s, b * VOCAB_BLOCK), min(s + n, (b + 1) * VOCAB_BLOCK, vocab)
            if hi > lo:
                segs.append(Segment(ci, lo, hi, len(segs)))
                width = max(width, hi - lo)
        segments.append(tuple(segs))
    return StrictPlan(
        vocab=vocab,
        num_blocks=nb,
        starts=tuple(s for s, _ in geometry),
        full=tuple(full),
        max_full=max((c for _, c in full), default=0),
        cut_blocks=cut,
        segments=tuple(segments),
        slots=max((len(s) for s in segments), default=0),
        piece_width=width,
    )


def vllm_row_stride(processed: bool, tp: int, width: int, vocab: int) -> int:
    """Row stride (elements) of the logits tensor vLLM's ``rejection_sample`` reads.

    Raw chunk (``processed=False``): the all-gathered LM-head output ``[rows, tp * W]`` sliced to
    ``V`` columns, a view with row stride ``tp * W``. Processed chunk: ``apply_sampling_params``
    copies the chunk into ``torch.empty_like(logits, dtype=float32)``; the sliced view is not
    dense, so the copy is contiguous: row stride ``V`` (vLLM 0.32 ``Sampler.apply_sampling_params``,
    ``LogitsProcessor._get_logits``).
    """
    return vocab if processed else tp * width


def _pieces_bytes(p: StrictPlan, rows: int, dtype: torch.dtype) -> int:
    return rows * p.slots * p.piece_width * torch.empty((), dtype=dtype).element_size()


def extras_words(p: StrictPlan, rows: int, dtype: torch.dtype) -> int:
    """int64 words one rank adds to the step's all_gather: ``rows * max_full`` (fp32 max and
    sumexp per local block) + the raw pieces of cut blocks (padded to whole words)."""
    return rows * p.max_full + triton.cdiv(_pieces_bytes(p, rows, dtype), 8)


def _variant(dtype: torch.dtype, aligned: bool) -> str:
    return build_name(
        VariantKey("block_stats", dtype=SUPPORTED_DTYPES[dtype], align=16 if aligned else 1)
    )


def block_stats(
    src: torch.Tensor,
    out_max: torch.Tensor,
    out_sumexp: torch.Tensor,
    *,
    vocab: int,
    nblocks: int,
    aligned: bool,
    base: int = 0,
    first_block: int = 0,
    out_block0: int = 0,
    blocks: torch.Tensor | None = None,
    temperature: torch.Tensor | None = None,
) -> None:
    """Launch ``block_stats``: vLLM's ``(max_b, sumexp_b)`` of ``nblocks`` blocks per row of
    ``src`` (``[rows, *]``, last dim contiguous), program column ``j`` reading
    ``src[:, base + j * 8192 : base + (j + 1) * 8192]`` as global block ``first_block + j`` (or
    ``blocks[j]``, int32), storing column ``block - out_block0`` of ``out_max`` / ``out_sumexp``
    (fp32, same row stride). ``aligned`` = vLLM's row stride is a multiple of 16 (``va16``);
    ``temperature`` (fp32 ``[rows]``) divides first, as vLLM's temperature kernel."""
    rows = src.shape[0]
    if rows == 0 or nblocks == 0:
        return
    mod = kernels.load(_variant(src.dtype, aligned))
    dummy = out_max
    mod.kernel[(rows, nblocks)](
        src,
        out_max,
        out_sumexp,
        blocks if blocks is not None else dummy,
        temperature if temperature is not None else dummy,
        src.stride(0),
        base,
        first_block,
        out_block0,
        out_max.stride(0),
        vocab,
        BLOCK=VOCAB_BLOCK,
        TABLE=blocks is not None,
        TEMP=temperature is not None,
        num_warps=4,  # vLLM's stats kernel launches with Triton's default, 4 warps
    )


def _aligned_source(t: torch.Tensor, base: int) -> bool:
    """Whether a load at ``t[row, base + l]`` has the address divisibility of a 16-aligned row."""
    return t.stride(0) % 16 == 0 and base % 16 == 0 and t.data_ptr() % 16 == 0


def rank_extras(
    p: StrictPlan,
    rank: int,
    logits: torch.Tensor,
    processed: bool,
    temp_row: torch.Tensor,
    tp: int,
) -> torch.Tensor:
    """One rank's strict extras, int64 ``[extras_words]``: the vLLM-layout ``(max, sumexp)`` of its
    whole blocks (fp32 ``[2, rows, max_full]``) then its raw pieces of cut blocks
    (``[rows, slots, piece_width]`` in the logits dtype). ``temp_row``: fp32 temperature per row."""
    rows, width = logits.shape
    dev = logits.device
    out = torch.zeros(extras_words(p, rows, logits.dtype), dtype=torch.int64, device=dev)
    n_stats = rows * p.max_full
    stats = out[:n_stats].view(torch.float32).view(2, rows, p.max_full)
    s = p.starts[rank]
    fb, nf = p.full[rank]
    if nf and rows:
        stride = vllm_row_stride(processed, tp, width, p.vocab)
        aligned = stride % 16 == 0
        lo = fb * VOCAB_BLOCK - s
        hi = min((fb + nf) * VOCAB_BLOCK, p.vocab) - s
        if processed or (aligned and not _aligned_source(logits, lo)):
            # vLLM reads an fp32 copy (or an aligned raw row): reduce a copy with that layout
            src = torch.empty(
                (rows, nf * VOCAB_BLOCK),
                dtype=torch.float32 if processed else logits.dtype,
                device=dev,
            )
            src[:, : hi - lo].copy_(logits[:, lo:hi])
            base = 0
        else:
            src, base = logits, lo
        block_stats(
            src,
            stats[0],
            stats[1],
            vocab=p.vocab,
            nblocks=nf,
            aligned=aligned,
            base=base,
            first_block=fb,
            out_block0=fb,
            temperature=temp_row if processed else None,
        )
    if p.slots and rows:
        nbytes = _pieces_bytes(p, rows, logits.dtype)
        pieces = out[n_stats:].view(torch.uint8)[:nbytes].view(logits.dtype)
        pieces = pieces.view(rows, p.slots, p.piece_width)
        for seg in p.segments[rank]:
            pieces[:, seg.slot, : seg.hi - seg.lo].copy_(logits[:, seg.lo - s : seg.hi - s])
    return out


@functools.lru_cache(maxsize=64)
def _cut_blocks_tensor(cut_blocks: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The cut blocks as an int32 device tensor, made once per geometry (a CUDA graph captured
    after the first call never copies from the host)."""
    return torch.tensor(cut_blocks, dtype=torch.int32, device=device)


def _key_values(keys: torch.Tensor) -> torch.Tensor:
    """fp32 values of packed keys (NaN keys never reach here: those rows are flagged), without
    boolean-mask indexing (no host sync; CUDA-graph capturable)."""
    order = keys >> 32
    bits = torch.where(order < 0, order ^ 0x7FFFFFFF, order).to(torch.int32)
    return bits.view(torch.float32)


def rebuild_block_stats(
    p: StrictPlan,
    extras: torch.Tensor,
    rows: int,
    dtype: torch.dtype,
    processed: bool,
    temp_row: torch.Tensor,
    tp: int,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank: the gathered extras (int64 ``[tp, extras_words]``) -> vLLM's block statistics
    of every row, fp32 ``(max, sumexp)`` ``[rows, num_blocks]`` each (contiguous: the row stride
    vLLM's rejection kernel sees). Cut blocks are reassembled from the ranks' raw pieces into an
    ``[rows, cuts, 8192]`` scratch (the chunk's dtype) and reduced with vLLM's layout."""
    dev = extras.device
    nb = p.num_blocks
    g_max = torch.empty((rows, nb), dtype=torch.float32, device=dev)
    g_sum = torch.empty((rows, nb), dtype=torch.float32, device=dev)
    if rows == 0:
        return g_max, g_sum
    n_stats = rows * p.max_full
    for r, (fb, nf) in enumerate(p.full):
        if nf:
            st = extras[r, :n_stats].view(torch.float32).view(2, rows, p.max_full)
            g_max[:, fb : fb + nf] = st[0, :, :nf]
            g_sum[:, fb : fb + nf] = st[1, :, :nf]
    if p.cut_blocks:
        scratch_dtype = torch.float32 if processed else dtype
        scratch = torch.full(
            (rows, len(p.cut_blocks), VOCAB_BLOCK), float("-inf"), dtype=scratch_dtype, device=dev
        )
        nbytes = _pieces_bytes(p, rows, dtype)
        for r, segs in enumerate(p.segments):
            pieces = extras[r, n_stats:].view(torch.uint8)[:nbytes].view(dtype)
            pieces = pieces.view(rows, p.slots, p.piece_width)
            for seg in segs:
                b0 = p.cut_blocks[seg.cut] * VOCAB_BLOCK
                scratch[:, seg.cut, seg.lo - b0 : seg.hi - b0] = pieces[
                    :, seg.slot, : seg.hi - seg.lo
                ]
        stride = vllm_row_stride(processed, tp, width, p.vocab)
        block_stats(
            scratch.view(rows, -1),
            g_max,
            g_sum,
            vocab=p.vocab,
            nblocks=len(p.cut_blocks),
            aligned=stride % 16 == 0,
            blocks=_cut_blocks_tensor(p.cut_blocks, dev),
            temperature=temp_row if processed else None,
        )
    return g_max, g_sum


def replay_kept(
    candidates: torch.Tensor,
    kept: torch.Tensor,
    vocab: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's block statistics of rows whose processed values are ``-inf`` outside a kept set.

    ``candidates``: int64 ``[rows, C]`` merged packed keys (value desc, id asc); ``kept``: int
    ``[rows]``, the row keeps its first ``kept`` candidates (0: none). The kept values go to their
    ids in an fp32 ``[rows, V]`` scratch (``-inf`` elsewhere: vLLM's processed row) reduced like
    vLLM's fp32 chunk (row stride ``V``). Returns fp32 ``(max, sumexp)`` ``[rows, num_blocks]``.
    """
    rows, c = candidates.shape
    dev = candidates.device
    nb = triton.cdiv(vocab, VOCAB_BLOCK)
    g_max = torch.empty((rows, nb), dtype=torch.float32, device=dev)
    g_sum = torch.empty((rows, nb), dtype=torch.float32, device=dev)
    if rows == 0:
        return g_max, g_sum
    ids = unpack_ids(candidates)
    take = torch.arange(c, device=dev)[None, :] < kept.to(torch.int64)[:, None]
    take &= (candidates != EMPTY_KEY) & (ids >= 0) & (ids < vocab)
    vals = torch.where(take, _key_values(candidates), float("-inf"))
    scratch = torch.full((rows, vocab), float("-inf"), dtype=torch.float32, device=dev)
    scratch.scatter_reduce_(1, torch.where(take, ids, 0), vals, reduce="amax")
    block_stats(scratch, g_max, g_sum, vocab=vocab, nblocks=nb, aligned=vocab % 16 == 0)
    return g_max, g_sum


def strict_lse(g_max: torch.Tensor, g_sum: torch.Tensor) -> torch.Tensor:
    """vLLM's fp32 row LSE from ``[rows, num_blocks]`` block statistics (``strict_lse`` kernel,
    one warp, the same padded vector as vLLM's rejection kernel)."""
    rows, nb = g_max.shape
    lse = torch.empty(rows, dtype=torch.float32, device=g_max.device)
    if rows == 0:
        return lse
    mod = kernels.load(build_name(VariantKey("strict_lse")))
    mod.kernel[(rows,)](
        g_max,
        g_max.stride(0),
        g_sum,
        g_sum.stride(0),
        lse,
        nb,
        PADDED_NUM_BLOCKS=triton.next_power_of_2(nb),
        num_warps=1,
    )
    return lse
