"""In-process emulation of a TP group: every rank's local stage, then the finish.

The emulator runs each rank's ``shard_keys`` kernel on the shards that
:func:`shardmax.testing.shard_like_vllm` cuts, concatenates the keys in rank order exactly as
``all_gather(dim=0)`` returns them (or takes their elementwise max, as ``all_reduce(MAX)``
does), and runs the same finish kernel a real rank would. Nothing is shared between "ranks"
except those keys, so an emulated result equal to the reference proves the sharded algorithm;
the real collectives are tested separately on GPUs.
"""

from __future__ import annotations

import torch

from shardmax import kernels
from shardmax.dispatch import Problem, Selection, alignment_of, select
from shardmax.testing.shards import Shard, default_pad_to, shard_like_vllm
from shardmax.validation import SUPPORTED_DTYPES


def _selection(op: str, shard: Shard, tp: int, selection: Selection | None) -> Selection:
    if selection is not None:
        return selection
    logits = shard.local_logits
    return select(
        Problem(
            op,
            SUPPORTED_DTYPES[logits.dtype],
            tp,
            logits.shape[0],
            logits.shape[1],
            alignment_of(logits),
        )
    )


def emulated_keys(shards: list[Shard], sel: Selection) -> torch.Tensor:
    """Keys after the collective: ``[tp*rows, S]`` (all_gather) or ``[rows, S]`` (all_reduce)."""
    per_rank = [
        kernels.shard_keys(
            s.local_logits,
            s.vocab_start,
            s.num_valid,
            sel.variant,
            splits=sel.splits,
            num_warps=int(sel.launch.get("num_warps", 4)),
            num_stages=int(sel.launch.get("num_stages", 2)),
        )
        for s in shards
    ]
    if sel.transport == "allreduce":
        return torch.stack(per_rank).amax(dim=0)
    return torch.cat(per_rank, dim=0)


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
    """
    shards = shard_like_vllm(
        full_logits, tp_size, pad_to=pad_to or default_pad_to(full_logits.shape[1], tp_size)
    )
    rows = full_logits.shape[0]
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=full_logits.device)
    sel = _selection("argmax", shards[0], tp_size, selection)
    keys = emulated_keys(shards, sel)
    return kernels.argmax_pick(keys, rows, tp_size, sel.finish_variant("argmax", tp_size))


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
    from shardmax.collectives import SingleRank
    from shardmax.ops import validate_verify_inputs

    validate_verify_inputs(
        full_logits,
        draft_sampled,
        cu_num_logits,
        pos,
        idx_mapping,
        expanded_local_pos,
        seed,
        num_speculative_steps,
        0,
        None,
        synthetic_conditional_rates,
        seq_lens,
        prefill_len,
        SingleRank(),
    )
    shards = shard_like_vllm(
        full_logits, tp_size, pad_to=pad_to or default_pad_to(full_logits.shape[1], tp_size)
    )
    num_reqs = idx_mapping.shape[0]
    if num_reqs == 0:
        k, dev = num_speculative_steps, full_logits.device
        return (
            torch.empty((0, k + 1), dtype=torch.int64, device=dev),
            torch.empty(0, dtype=torch.int32, device=dev),
            torch.empty(0, dtype=torch.int32, device=dev),
        )
    sel = _selection("verify", shards[0], tp_size, selection)
    keys = emulated_keys(shards, sel)
    return kernels.verify_finish(
        keys,
        tp_size,
        sel.finish_variant("verify", tp_size),
        draft_sampled,
        cu_num_logits,
        pos,
        idx_mapping,
        seed,
        num_speculative_steps,
        synthetic_conditional_rates,
        seq_lens,
        prefill_len,
    )
