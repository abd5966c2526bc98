"""In-process emulation of a TP group: every rank's plan, the bytes moved in rank order.

The emulator cuts the full logits the way vLLM's LM head is sharded
(:func:`shardmax.testing.shard_like_vllm`), builds one :class:`~shardmax.runtime.shard.
ShardContext` per emulated rank (the geometry given, no communication), runs each rank's plan's
``local`` stage on its own shard, concatenates the results in rank order exactly as
``all_gather(dim=0)`` returns them (or takes their elementwise max, as ``all_reduce(MAX)``
does), and runs rank 0's ``finish`` on those bytes -- the same plan code a real rank runs.
Nothing is shared between "ranks" except those bytes, so an emulated result equal to the
reference proves the sharded algorithm; the real collectives are tested separately.
"""

from __future__ import annotations

from typing import Any

import torch

from shardmax.ops.argmax import ArgmaxPlan
from shardmax.ops.greedy import GreedyVerifyPlan
from shardmax.runtime.dispatch import Selection
from shardmax.runtime.geometry import Geometry
from shardmax.runtime.shard import ShardContext
from shardmax.runtime.validation import (
    check_batch_values,
    check_local_logits,
    check_step_batch,
    value_checks_enabled,
)
from shardmax.testing.shards import Shard, default_pad_to, shard_like_vllm

__all__ = [
    "EmulatedRank",
    "RepeatedRank",
    "emulate_greedy_verify",
    "emulate_vocab_parallel_argmax",
    "emulated_exchange",
    "emulated_ranks",
]


class EmulatedRank:
    """The collective of one emulated rank: the emulator moves the bytes itself, so calling a
    collective here is a bug (it raises)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self._rank, self._world = rank, world_size

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def rank(self) -> int:
        return self._rank

    def all_gather_dim0(self, t: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("EmulatedRank: the emulator exchanges the bytes, not the plan")

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("EmulatedRank: the emulator exchanges the bytes, not the plan")


class RepeatedRank:
    """A rank-0 stand-in group for single-GPU timing: every collective returns what ``tp``
    ranks would if the other ranks' bytes were rank 0's (``all_gather`` tiles, ``all_reduce``
    is the identity). Results are meaningless tokens of a real step; the work and the bytes
    moved per rank are the real ones. A group of one returns its input, as the runtime's own
    group of one does (:class:`shardmax.runtime.collectives.SingleRank`): no copy that a TP 1
    step would not make."""

    def __init__(self, tp: int) -> None:
        self.world_size, self.rank = tp, 0

    def all_gather_dim0(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.world_size == 1 else t.repeat(self.world_size, 1)

    def all_gather_dim0_into(self, t: torch.Tensor, out: torch.Tensor) -> None:
        out.view(self.world_size, *t.shape).copy_(t.unsqueeze(0).expand(self.world_size, *t.shape))

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        return t


def emulated_ranks(
    full_logits: torch.Tensor, tp_size: int, pad_to: int | None = None
) -> tuple[list[Shard], list[ShardContext]]:
    """vLLM-layout shards of ``full_logits [rows, V]`` and one context per emulated rank."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tp_size: expected an int >= 1, got {tp_size!r}")
    shards = shard_like_vllm(
        full_logits, tp_size, pad_to=pad_to or default_pad_to(full_logits.shape[1], tp_size)
    )
    width = shards[0].local_logits.shape[1]
    geo = Geometry(tuple((s.vocab_start, s.num_valid) for s in shards), width, full_logits.dtype)
    ctxs = [
        ShardContext(EmulatedRank(r, tp_size), geo, r, full_logits.device) for r in range(tp_size)
    ]
    return shards, ctxs


def emulated_exchange(sent: list[torch.Tensor], transport: str = "allgather") -> torch.Tensor:
    """What the group's collective returns from every rank's ``sent`` (rank order)."""
    if transport == "allreduce":
        return torch.stack(sent).amax(dim=0)
    return torch.cat(sent, dim=0)


def _stride(t: torch.Tensor) -> int:
    return t.stride(0) if t.shape[0] > 1 else t.shape[1]


def _check_full(full_logits: Any) -> torch.Tensor:
    logits, _, _ = check_local_logits(full_logits, 0, None)
    return logits


def emulate_vocab_parallel_argmax(
    full_logits: torch.Tensor,
    tp_size: int,
    *,
    selection: Selection | None = None,
    pad_to: int | None = None,
) -> torch.Tensor:
    """``vocab_parallel_argmax`` of ``tp_size`` emulated ranks over ``full_logits [B, V]``.

    ``selection`` forces a variant/launch/transport (the tests sweep every variant); by default
    the dispatcher chooses, as on a real rank. Returns int64 ``[B]``.

    Raises:
        TypeError / ValueError: ``full_logits`` is not a 2-D bf16/fp16/fp32 tensor with a
            contiguous last dim on a compute device, or ``tp_size < 1``.
    """
    full_logits = _check_full(full_logits)
    shards, ctxs = emulated_ranks(full_logits, tp_size, pad_to)
    rows = full_logits.shape[0]
    plans = [
        ArgmaxPlan(c, rows, _stride(s.local_logits), selection)
        for c, s in zip(ctxs, shards, strict=True)
    ]
    if rows == 0:
        return plans[0].run(shards[0].local_logits)
    sent = [p.local(s.local_logits) for p, s in zip(plans, shards, strict=True)]
    return plans[0].finish(emulated_exchange(sent, plans[0].transport))


def emulate_greedy_verify(
    full_logits: torch.Tensor,
    tp_size: int,
    draft_sampled: torch.Tensor,
    cu_num_logits: torch.Tensor,
    pos: torch.Tensor,
    idx_mapping: torch.Tensor,
    expanded_local_pos: torch.Tensor,
    seed: torch.Tensor,
    num_speculative_steps: int,
    *,
    synthetic_conditional_rates: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    prefill_len: torch.Tensor | None = None,
    selection: Selection | None = None,
    pad_to: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sharded_greedy_verify`` of ``tp_size`` emulated ranks over ``full_logits``.

    Same arguments and outputs as :func:`shardmax.sharded_greedy_verify` after ``tp_size``;
    the shards come from :func:`shard_like_vllm`. The batch is validated exactly as the public
    op validates it (against the full vocabulary); ``selection`` forces a variant as in
    :func:`emulate_vocab_parallel_argmax`.
    """
    full_logits = _check_full(full_logits)
    batch = check_step_batch(
        full_logits.shape[0], full_logits.device, draft_sampled, cu_num_logits, pos,
        idx_mapping, expanded_local_pos, seed, num_speculative_steps,
        synthetic_conditional_rates, seq_lens, prefill_len,
    )  # fmt: skip
    if full_logits.shape[1] == 0:
        raise ValueError("full_logits: an empty vocabulary (0 columns)")
    if value_checks_enabled(full_logits.device):
        check_batch_values(batch, full_logits.shape[1])
    shards, ctxs = emulated_ranks(full_logits, tp_size, pad_to)
    rows = full_logits.shape[0]
    plans = [
        GreedyVerifyPlan(c, rows, _stride(s.local_logits), selection)
        for c, s in zip(ctxs, shards, strict=True)
    ]
    if batch.num_reqs == 0:
        return plans[0].run(shards[0].local_logits, batch)
    sent = [p.local(s.local_logits) for p, s in zip(plans, shards, strict=True)]
    return plans[0].finish(emulated_exchange(sent, plans[0].transport), batch)
