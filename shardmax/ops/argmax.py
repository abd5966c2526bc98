"""Vocab-parallel argmax (draft side), planned once per row count, run every step.

Data flow of one run on one TP rank (design §3)::

    local logits [rows, W] --shard_keys_<dtype>_va<align>_b<block>--> keys [rows, S] int64
    keys --all_gather(dim=0)--> [tp*rows, S]  or  --all_reduce(MAX)--> [rows, S]   (8*S B/row)
    keys --argmax_pick_tp<N>_allgather | argmax_pick_allreduce--> ids [rows] int64

The variant, ``S`` (splits per row), warps and transport come from the dispatcher's ``argmax``
table (:func:`shardmax.runtime.dispatch.select`); where a table row says ``plain`` the plan
gathers the full logits instead (:mod:`shardmax.ops.plain`), with the same ids.
"""

from __future__ import annotations

import torch
import triton

from shardmax.runtime import kernels
from shardmax.runtime.dispatch import PLAIN, Problem, Selection, alignment_of_stride, select
from shardmax.runtime.indirect import logits_arg
from shardmax.runtime.shard import ShardContext
from shardmax.runtime.variants import parse_name

PICK_ROWS = 16
"""Rows per program of the argmax finish."""


def chunk_for(num_valid: int, splits: int, block: int) -> int:
    """Columns per split: a multiple of ``block`` covering ``num_valid`` in ``splits`` parts."""
    per = triton.cdiv(max(num_valid, 1), splits)
    return triton.cdiv(per, block) * block


def shard_keys(
    local_logits: torch.Tensor,
    vocab_start: int,
    num_valid: int,
    sel: Selection,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Local stage: ``[rows, W]`` logits -> ``[rows, S]`` int64 packed keys (the selection's
    ``shard_keys_*`` variant, ``S = sel.splits``); each split's first maximum in the total order
    of design §2, ``EMPTY_KEY`` for an empty split."""
    rows = local_logits.shape[0]
    keys = out if out is not None else torch.empty(
        (rows, sel.splits), dtype=torch.int64, device=local_logits.device
    )  # fmt: skip
    if rows == 0:
        return keys
    k = kernels.kernel(sel.variant)
    kernels.check_device(local_logits)
    arg, indirect = logits_arg(local_logits)
    k(
        (rows, sel.splits),
        arg,
        keys,
        local_logits.stride(0),
        vocab_start,
        num_valid,
        chunk_for(num_valid, sel.splits, k.module.BLOCK),
        BLOCK=k.module.BLOCK,
        INDIRECT=indirect,
        num_warps=int(sel.launch.get("num_warps", 4)),
        num_stages=int(sel.launch.get("num_stages", 2)),
    )
    return keys


def argmax_pick(
    keys: torch.Tensor, num_rows: int, tp: int, variant: str, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Finish of the argmax: gathered (``[tp*rows, S]``) or all-reduced (``[rows, S]``) keys ->
    int64 global ids ``[num_rows]``."""
    ids = out if out is not None else torch.empty(num_rows, dtype=torch.int64, device=keys.device)
    if num_rows == 0:
        return ids
    splits = keys.shape[1]
    kernels.kernel(variant)(
        (triton.cdiv(num_rows, PICK_ROWS),),
        keys,
        ids,
        num_rows,
        splits,
        tp,
        ROWS=PICK_ROWS,
        SPLITS_P2=triton.next_power_of_2(splits),
    )
    return ids


def check_local_selection(sel: Selection, op: str, dtype: str, align: int) -> None:
    """A selection for a greedy op names ``plain`` or a ``shard_keys_*`` variant of the logits'
    dtype (either alignment: a ``va16`` variant launched on a row stride that is not a multiple
    of 16 is compiled without that divisibility, as Triton specialises on the actual stride).

    Raises:
        ValueError: naming the variant and what the op expected.
    """
    if sel.variant == PLAIN:
        return
    key = parse_name(sel.variant)
    if key.family != "shard_keys" or key.dtype != dtype:
        raise ValueError(
            f"variant: {sel.variant!r} cannot run op {op} on {dtype} logits: expected plain or "
            f"shard_keys_{dtype}_va<{align} or 1>_b<block>; check dispatch.override(variant=...) "
            "or the selection passed in"
        )


def exchange_keys(ctx: ShardContext, keys: torch.Tensor, transport: str) -> torch.Tensor:
    """The keys' collective: ``all_gather(dim=0)`` or in-place ``all_reduce(MAX)``."""
    if transport == "allreduce":
        return ctx.coll.all_reduce_max(keys)
    return ctx.coll.all_gather_dim0(keys)


class ArgmaxPlan:
    """``torch.argmax`` over the concatenated unpadded logits of every rank, for ``rows`` rows
    of ``[rows, W]`` local logits with row stride ``row_stride`` (vLLM
    ``LogitsProcessor.get_top_tokens``, spec §3.3). Stages, for callers that move the bytes
    themselves (the emulator, the tuner): :meth:`local` -> the group's collective -> :meth:`finish`.
    """

    op = "argmax"

    def __init__(
        self, ctx: ShardContext, rows: int, row_stride: int, selection: Selection | None = None
    ) -> None:
        from shardmax.ops.plain import PlainPlan

        self.ctx = ctx
        self.rows = rows
        self.row_stride = row_stride
        align = alignment_of_stride(row_stride)
        problem = Problem("argmax", ctx.dtype_name, ctx.tp, rows, ctx.width, align)
        self.selection = selection if selection is not None else select(problem)
        check_local_selection(self.selection, "argmax", ctx.dtype_name, align)
        self.plain = PlainPlan(ctx, rows) if self.selection.variant == PLAIN else None
        if self.plain is None:
            self.finish_variant = self.selection.finish_variant("argmax", ctx.tp)

    @property
    def transport(self) -> str:
        """How :meth:`local`'s output crosses ranks: ``allgather`` or ``allreduce`` (MAX)."""
        return "allgather" if self.plain is not None else self.selection.transport

    def local(self, local_logits: torch.Tensor) -> torch.Tensor:
        """This rank's contribution to the collective (keys, or the logits on the plain path)."""
        logits = self.ctx.check_logits(local_logits, self.rows, self.row_stride)
        if self.plain is not None:
            return self.plain.local(logits)
        return shard_keys(logits, self.ctx.vocab_start, self.ctx.num_valid, self.selection)

    def exchange(self, sent: torch.Tensor) -> torch.Tensor:
        if self.plain is not None:
            return self.plain.exchange(sent)
        return exchange_keys(self.ctx, sent, self.selection.transport)

    def finish(self, gathered: torch.Tensor) -> torch.Tensor:
        """Every rank, the same bytes: int64 ``[rows]`` global ids."""
        if self.plain is not None:
            return argmax_pick(self.plain.keys(gathered), self.rows, self.ctx.tp, self.plain.pick)
        return argmax_pick(gathered, self.rows, self.ctx.tp, self.finish_variant)

    def run(self, local_logits: torch.Tensor) -> torch.Tensor:
        """int64 ``[rows]`` global token ids, identical on every rank. No host sync; CUDA-graph
        capturable (the collective included, on NCCL)."""
        if self.rows == 0:
            self.ctx.check_logits(local_logits, 0, self.row_stride)
            return torch.empty(0, dtype=torch.int64, device=self.ctx.device)
        return self.finish(self.exchange(self.local(local_logits)))
