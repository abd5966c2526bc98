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
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton

from shardmax.runtime import kernels
from shardmax.runtime.validation import SUPPORTED_DTYPES
from shardmax.runtime.variants import VariantKey, build_name

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
COPY_LANES = 1024
"""Vector width of the scratch fills and piece copies (must differ from ``VOCAB_BLOCK``)."""


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


def plan(geometry: Sequence[tuple[int, int]]) -> StrictPlan:
    """The strict layout of a shard geometry ``[(vocab_start, num_valid)]`` in rank order
    (computed once per geometry: every strict step asks for it).

    Raises:
        ValueError: the ranks' ranges do not tile ``[0, V)`` without gaps (vLLM's row has every
            id; a gap would have no value to reduce).
    """
    return _plan(tuple((int(s), int(n)) for s, n in geometry))


@functools.lru_cache(maxsize=64)
def _plan(geometry: tuple[tuple[int, int], ...]) -> StrictPlan:
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
    ``V`` columns, a view with row stride ``tp * W`` (``width`` = the row stride of a rank's
    local LM-head output, W for a contiguous shard; at TP 1 the output itself, sliced). Processed chunk: ``apply_sampling_params``
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
    temperature: torch.Tensor | None = None,
) -> None:
    """Launch ``block_stats``: vLLM's ``(max_b, sumexp_b)`` of ``nblocks`` blocks per row of
    ``src`` (``[rows, *]``, last dim contiguous), program column ``j`` reading
    ``src[:, base + j * 8192 : base + (j + 1) * 8192]`` as global block ``first_block + j``,
    storing column ``first_block + j - out_block0`` of ``out_max`` / ``out_sumexp`` (fp32, same
    row stride). ``aligned`` = vLLM's row stride is a multiple of 16 (``va16``, else ``va1``);
    ``temperature`` (fp32 ``[rows]``) divides first, as vLLM's temperature kernel."""
    rows = src.shape[0]
    if rows == 0 or nblocks == 0:
        return
    kernels.kernel(_variant(src.dtype, aligned))(
        (rows, nblocks),
        src,
        out_max,
        out_sumexp,
        temperature if temperature is not None else out_max,
        src.stride(0),
        base,
        first_block,
        out_block0,
        out_max.stride(0),
        vocab,
        BLOCK=VOCAB_BLOCK,
        TEMP=temperature is not None,
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
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One rank's strict extras, int64 ``[extras_words]`` (written into ``out`` when given, e.g.
    the tail of the rank's send buffer): the vLLM-layout ``(max, sumexp)`` of its whole blocks
    (fp32 ``[2, rows, max_full]``) then its raw pieces of cut blocks (``[rows, slots,
    piece_width]`` in the logits dtype). ``temp_row``: fp32 temperature per row. Slots past a
    rank's own blocks / piece lengths are left unwritten (never read)."""
    rows = logits.shape[0]
    dev = logits.device
    if out is None:
        out = torch.empty(extras_words(p, rows, logits.dtype), dtype=torch.int64, device=dev)
    n_stats = rows * p.max_full
    stats = out[:n_stats].view(torch.float32).view(2, rows, p.max_full)
    s = p.starts[rank]
    fb, nf = p.full[rank]
    if nf and rows:
        stride = vllm_row_stride(processed, tp, logits.stride(0), p.vocab)
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
def _tables(p: StrictPlan, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(cut, seg, full)`` int32 device tables of ``strict_rebuild``, made once per geometry (a
    CUDA graph captured after the first call never copies from the host)."""
    seg = [(g.cut, r, g.slot, g.lo, g.hi) for r, segs in enumerate(p.segments) for g in segs]
    return (
        torch.tensor(p.cut_blocks or (0,), dtype=torch.int32, device=device),
        torch.tensor(seg or [(0,) * 5], dtype=torch.int32, device=device).view(-1),
        torch.tensor(p.full, dtype=torch.int32, device=device).view(-1),
    )


def rebuild_block_stats(
    p: StrictPlan,
    gathered: torch.Tensor,
    extras_offset: int,
    rows: int,
    dtype: torch.dtype,
    processed: bool,
    temp_row: torch.Tensor,
    tp: int,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank: the gathered buffers (int64 ``[tp, n]``, each rank's strict extras at word
    ``extras_offset``) -> vLLM's block statistics of every row, fp32 ``(max, sumexp)``
    ``[rows, num_blocks]`` each (contiguous: the row stride vLLM's rejection kernel sees). One
    ``strict_rebuild`` launch: the whole blocks' statistics are copied, the cut blocks
    reassembled from the ranks' raw pieces into an ``[rows, cuts, 8192]`` scratch of the
    chunk's dtype (raw, or fp32 when processed) and reduced with vLLM's layout."""
    dev = gathered.device
    nb = p.num_blocks
    g_max = torch.empty((rows, nb), dtype=torch.float32, device=dev)
    g_sum = torch.empty((rows, nb), dtype=torch.float32, device=dev)
    ncut = len(p.cut_blocks)
    if rows == 0:
        return g_max, g_sum
    scratch = torch.empty(
        (rows, max(ncut, 1) * VOCAB_BLOCK),
        dtype=torch.float32 if processed else dtype,
        device=dev,
    )
    cut, seg, full = _tables(p, dev)
    aligned = vllm_row_stride(processed, tp, width, p.vocab) % 16 == 0
    name = build_name(
        VariantKey("strict_rebuild", dtype=SUPPORTED_DTYPES[dtype], align=16 if aligned else 1)
    )
    kernels.kernel(name)(
        (rows, ncut + tp),
        scratch,
        gathered,
        g_max,
        g_sum,
        cut,
        seg,
        full,
        temp_row,
        scratch.stride(0),
        rows,
        ncut,
        sum(len(s) for s in p.segments),
        gathered.stride(0),
        extras_offset,
        p.max_full,
        extras_offset + rows * p.max_full,
        p.slots,
        p.piece_width,
        nb,
        p.vocab,
        BLOCK=VOCAB_BLOCK,
        COPY=COPY_LANES,
        FULL_LANES=triton.next_power_of_2(max(p.max_full, 1)),
        TEMP=processed,
    )
    return g_max, g_sum


def replay_kept(
    g_max: torch.Tensor,
    g_sum: torch.Tensor,
    candidates: torch.Tensor,
    temp_row: torch.Tensor,
    vocab: int,
    *,
    slot_row: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
    cand_per_row: int,
) -> None:
    """Overwrite, in place, the block statistics of rows that keep a top-k / top-p / min-p set
    with vLLM's statistics of their processed rows (``-inf`` outside the kept set): one
    ``strict_replay`` launch over ``[rows, num_blocks]`` programs. A row keeps its first ``k``
    merged ``candidates`` (int64 ``[rows, C]``, value desc / id asc) when ``T != 0`` and ``0 < k
    < min(V, C)`` with ``k = top_k[slot_row]``, or its first ``keep[row]`` when that is > 0.
    Blocks are reduced like vLLM's fp32 chunk (row stride ``V``)."""
    rows, nb = g_max.shape
    if rows == 0:
        return
    dev = g_max.device
    scratch = torch.empty((rows, nb * VOCAB_BLOCK), dtype=torch.float32, device=dev)
    name = build_name(VariantKey("strict_replay", align=16 if vocab % 16 == 0 else 1))
    dummy = g_max
    kernels.kernel(name)(
        (rows, nb),
        scratch,
        candidates,
        g_max,
        g_sum,
        temp_row,
        slot_row if slot_row is not None else dummy,
        top_k if top_k is not None else dummy,
        keep if keep is not None else dummy,
        scratch.stride(0),
        max(1, top_k.shape[0]) if top_k is not None else 1,
        nb,
        vocab,
        BLOCK=VOCAB_BLOCK,
        COPY=COPY_LANES,
        CAND=cand_per_row,
        HAS_TOPK=top_k is not None,
        HAS_KEEP=keep is not None,
    )


def strict_lse(g_max: torch.Tensor, g_sum: torch.Tensor) -> torch.Tensor:
    """vLLM's fp32 row LSE from ``[rows, num_blocks]`` block statistics (``strict_lse`` kernel,
    one warp, the same padded vector as vLLM's rejection kernel)."""
    rows, nb = g_max.shape
    lse = torch.empty(rows, dtype=torch.float32, device=g_max.device)
    if rows == 0:
        return lse
    kernels.kernel("strict_lse")(
        (rows,),
        g_max,
        g_max.stride(0),
        g_sum,
        g_sum.stride(0),
        lse,
        nb,
        PADDED_NUM_BLOCKS=triton.next_power_of_2(nb),
    )
    return lse


class StrictLayout:
    """Strict mode of one planned step: the geometry's :class:`StrictPlan`, vLLM's chunk gate
    (``processed``), the logits dtype and row stride, the row count -- fixed at plan time, with
    the device tables of ``strict_rebuild`` made here (never during a captured run)."""

    def __init__(
        self,
        p: StrictPlan,
        processed: bool,
        dtype: torch.dtype,
        row_stride: int,
        rows: int,
        device: torch.device,
    ) -> None:
        self.plan = p
        _tables(p, device)
        self.processed = processed
        self.dtype = dtype
        self.row_stride = row_stride
        self.rows = rows
        self.extras_words = extras_words(p, rows, dtype)

    def rank_extras(
        self,
        rank: int,
        logits: torch.Tensor,
        temp_row: torch.Tensor,
        tp: int,
        out: torch.Tensor,
    ) -> None:
        """This rank's extras into ``out`` (the tail of its send buffer): :func:`rank_extras`."""
        rank_extras(self.plan, rank, logits, self.processed, temp_row, tp, out=out)

    def lse(
        self,
        gathered: torch.Tensor,
        offset: int,
        temp_row: torch.Tensor,
        slot_row: torch.Tensor,
        vocab: int,
        candidates: torch.Tensor | None,
        top_k: torch.Tensor | None,
        keep: torch.Tensor | None,
    ) -> torch.Tensor:
        """Every rank: vLLM's fp32 LSE of every row from the gathered extras (at word
        ``offset`` of each rank's buffer); rows that keep a top-k / top-p / min-p set replay it
        from the merged ``candidates``. ``strict_rebuild``, ``strict_replay`` (candidate steps),
        ``strict_lse``."""
        tp = len(self.plan.starts)
        g_max, g_sum = rebuild_block_stats(
            self.plan, gathered, offset, self.rows, self.dtype, self.processed, temp_row, tp,
            self.row_stride,
        )  # fmt: skip
        if candidates is not None:
            replay_kept(
                g_max, g_sum, candidates, temp_row, vocab, slot_row=slot_row, top_k=top_k,
                keep=keep, cand_per_row=candidates.shape[1],
            )  # fmt: skip
        return strict_lse(g_max, g_sum)
