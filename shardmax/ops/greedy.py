"""Sharded greedy verification (target side), planned once per batch shape, run every step.

Data flow of one run on one TP rank (design §3)::

    local logits [num_logits, W] --shard_keys_*--> keys [num_logits, S] int64   (HBM read once)
    keys --all_gather(dim=0) | all_reduce(MAX)--> global keys                   (8*S B/row)
    keys --verify_finish_tp<N>_allgather | verify_finish_allreduce-->
         sampled [num_reqs, K+1] int64, num_sampled int32, num_rejected int32

Semantics: vLLM model runner V2 ``rejection_sample`` on greedy (and synthetic-acceptance)
requests followed by ``get_num_sampled_and_rejected`` (spec §1.2-§1.6), bit for bit.
"""

from __future__ import annotations

import torch
import triton

from shardmax.ops.argmax import check_local_selection, exchange_keys, shard_keys
from shardmax.runtime import kernels
from shardmax.runtime.dispatch import PLAIN, Problem, Selection, alignment_of_stride, select
from shardmax.runtime.shard import ShardContext
from shardmax.runtime.validation import StepBatch


def verify_finish(
    keys: torch.Tensor,
    tp: int,
    variant: str,
    batch: StepBatch,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Finish of greedy verification: one program per request over the global keys (gathered
    ``[tp*num_logits, S]`` or reduced ``[num_logits, S]``). Every index the kernel loads is
    clamped (a malformed batch gives unspecified outputs, never an out-of-bounds read)."""
    num_reqs = batch.num_reqs
    k = batch.num_speculative_steps
    dev = keys.device
    sampled = torch.empty((num_reqs, k + 1), dtype=torch.int64, device=dev)
    num_sampled = torch.empty(num_reqs, dtype=torch.int32, device=dev)
    num_rejected = torch.empty(num_reqs, dtype=torch.int32, device=dev)
    if num_reqs == 0:
        return sampled, num_sampled, num_rejected
    rates = batch.synthetic_conditional_rates
    has_prefill = batch.seq_lens is not None and batch.prefill_len is not None
    kernels.kernel(variant)(
        (num_reqs,),
        keys,
        batch.draft_sampled,
        batch.cu_num_logits,
        batch.pos,
        batch.idx_mapping,
        batch.seed,
        rates if rates is not None else num_sampled,
        batch.seq_lens if has_prefill else num_sampled,
        batch.prefill_len if has_prefill else num_sampled,
        sampled,
        num_sampled,
        num_rejected,
        batch.num_logits,
        batch.num_slots,
        keys.shape[1],
        tp,
        sampled.stride(0),
        K=k,
        KP1_P2=triton.next_power_of_2(k + 1),
        SPLITS_P2=triton.next_power_of_2(keys.shape[1]),
        SYNTHETIC=rates is not None,
        HAS_PREFILL=has_prefill,
    )
    return sampled, num_sampled, num_rejected


class GreedyVerifyPlan:
    """Greedy verification of ``num_reqs`` requests over ``num_logits`` logits rows (row stride
    ``row_stride``) with K = ``num_speculative_steps``. Stages: :meth:`local` -> the group's
    collective -> :meth:`finish` (the emulator and the tuner move the bytes themselves)."""

    op = "verify"

    def __init__(
        self,
        ctx: ShardContext,
        num_logits: int,
        row_stride: int,
        selection: Selection | None = None,
    ) -> None:
        from shardmax.ops.plain import PlainPlan

        self.ctx = ctx
        self.num_logits = num_logits
        self.row_stride = row_stride
        align = alignment_of_stride(row_stride)
        problem = Problem("verify", ctx.dtype_name, ctx.tp, num_logits, ctx.width, align)
        self.selection = selection if selection is not None else select(problem)
        check_local_selection(self.selection, "verify", ctx.dtype_name, align)
        self.plain = PlainPlan(ctx, num_logits) if self.selection.variant == PLAIN else None
        if self.plain is None:
            self.finish_variant = self.selection.finish_variant("verify", ctx.tp)

    @property
    def transport(self) -> str:
        """How :meth:`local`'s output crosses ranks: ``allgather`` or ``allreduce`` (MAX)."""
        return "allgather" if self.plain is not None else self.selection.transport

    def local(self, local_logits: torch.Tensor) -> torch.Tensor:
        logits = self.ctx.check_logits(local_logits, self.num_logits, self.row_stride)
        if self.plain is not None:
            return self.plain.local(logits)
        return shard_keys(logits, self.ctx.vocab_start, self.ctx.num_valid, self.selection)

    def exchange(self, sent: torch.Tensor) -> torch.Tensor:
        if self.plain is not None:
            return self.plain.exchange(sent)
        return exchange_keys(self.ctx, sent, self.selection.transport)

    def finish(
        self, gathered: torch.Tensor, batch: StepBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every rank, the same bytes: ``(sampled int64 [num_reqs, K+1] (-1 past num_sampled),
        num_sampled int32 [num_reqs], num_rejected int32 [num_reqs])``."""
        if batch.num_logits != self.num_logits:
            raise ValueError(
                f"draft_sampled: {batch.num_logits} logits rows, this plan has {self.num_logits}"
            )
        if self.plain is not None:
            return verify_finish(self.plain.keys(gathered), self.ctx.tp, self.plain.verify, batch)
        return verify_finish(gathered, self.ctx.tp, self.finish_variant, batch)

    def run(
        self, local_logits: torch.Tensor, batch: StepBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Greedy verification of one step from this rank's shard; identical on every rank. No
        host sync; CUDA-graph capturable.

        Raises:
            ValueError: ``batch`` carries temperatures (a sampled step: :class:`~shardmax.ops.
                sampled.SampledVerifyPlan` verifies it), or another plan's row count; what
                :meth:`local` raises for the logits."""
        if batch.temperature is not None:
            raise ValueError(
                "temperature: a greedy plan verifies every request greedily; a batch with "
                "temperatures is a sampled step (VocabShard.verify / sharded_verify)"
            )
        if batch.num_reqs == 0:
            self.ctx.check_logits(local_logits, self.num_logits, self.row_stride)
            return verify_finish(
                torch.empty((0, 1), dtype=torch.int64, device=self.ctx.device), 1, "", batch
            )
        return self.finish(self.exchange(self.local(local_logits)), batch)
