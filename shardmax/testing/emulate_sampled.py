"""In-process emulation of :func:`shardmax.sharded_verify` over ``tp_size`` ranks.

Every emulated rank runs the ``sampled_record`` kernel on its :func:`shard_like_vllm` shard; the
records are concatenated in rank order exactly as ``all_gather(dim=0)`` returns them, and the
finish kernel a real rank would run reduces them. Nothing else is shared between "ranks".
"""

from __future__ import annotations

import torch

from shardmax.collectives import SingleRank
from shardmax.dispatch import Selection
from shardmax.sampled import (
    TOPK_CANDIDATES,
    VerifyResult,
    _empty,
    check_record_selection,
    finish_gathered,
    local_buffer,
    record_variant,
    row_params,
    strict_step,
    validate_sampled_inputs,
)
from shardmax.testing.shards import default_pad_to, shard_like_vllm

__all__ = ["emulate_verify"]


def emulate_verify(
    full_logits: torch.Tensor,
    tp_size: int,
    draft_sampled: torch.Tensor,
    cu_num_logits: torch.Tensor,
    pos: torch.Tensor,
    idx_mapping: torch.Tensor,
    expanded_local_pos: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    num_speculative_steps: int,
    *,
    top_k: torch.Tensor | None = None,
    synthetic_conditional_rates: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    prefill_len: torch.Tensor | None = None,
    use_fp64_gumbel: bool = False,
    mode: str = "fast",
    record_block: int | None = None,
    pad_to: int | None = None,
    record_splits: int = 1,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    logits_processed: bool | None = None,
    candidates: int = TOPK_CANDIDATES,
    num_warps: int = 4,
    selection: Selection | None = None,
) -> VerifyResult:
    """``sharded_verify`` of ``tp_size`` emulated ranks over ``full_logits [num_logits, V]``.

    Same arguments and outputs as :func:`shardmax.sharded_verify` after ``tp_size`` (the batch is
    validated as the public op validates it, against the full vocabulary). ``record_block``
    forces the record kernel's tile (``generator.space.SAMPLED_BLOCKS``); ``record_splits``
    (1..32) the programs per row and rank (the public op picks it with
    :func:`shardmax.sampled.record_launch`); the finish variant follows ``tp_size *
    record_splits`` (``2/4/8`` unrolled, ``n`` otherwise, 1 included). ``candidates`` (C, one of
    :data:`shardmax.sampled.CANDIDATE_CHOICES`) and ``num_warps`` as the public op's selection.
    ``selection``: a ``sampled`` :class:`shardmax.dispatch.Selection` (the tuner's), which sets
    the record variant (its dtype must be the logits'), splits, warps and C instead.
    """
    if selection is not None:
        from shardmax.validation import SUPPORTED_DTYPES

        if full_logits.dtype in SUPPORTED_DTYPES:  # else validate_sampled_inputs names it
            check_record_selection(selection.variant, SUPPORTED_DTYPES[full_logits.dtype])
        record_block = None
        record_splits = selection.splits
        candidates = selection.candidates
        num_warps = int(selection.launch.get("num_warps", 4))
    chk = validate_sampled_inputs(
        full_logits,
        draft_sampled,
        cu_num_logits,
        pos,
        idx_mapping,
        expanded_local_pos,
        temperature,
        seed,
        num_speculative_steps,
        0,
        None,
        top_k,
        synthetic_conditional_rates,
        seq_lens,
        prefill_len,
        use_fp64_gumbel,
        mode,
        SingleRank(),
        top_p,
        min_p,
    )
    k = num_speculative_steps
    if idx_mapping.shape[0] == 0:
        return _empty(k, full_logits.device)
    shards = shard_like_vllm(
        full_logits, tp_size, pad_to=pad_to or default_pad_to(full_logits.shape[1], tp_size)
    )
    params = row_params(draft_sampled, cu_num_logits, pos, idx_mapping, chk.temperature, seed)
    if selection is not None:
        variant = selection.variant
    elif record_block is None:
        variant = record_variant(full_logits.dtype)
    else:
        variant = record_variant(full_logits.dtype, record_block)
    with_candidates = chk.top_k is not None or chk.top_p is not None or chk.min_p is not None
    strict = None
    if mode == "strict":
        geometry = [(sh.vocab_start, sh.num_valid) for sh in shards]
        width = shards[0].local_logits.stride(0)
        strict = strict_step(
            geometry, full_logits.dtype, width, full_logits.shape[0], idx_mapping, chk,
            logits_processed, params,
        )  # fmt: skip
    gathered = torch.cat(
        [
            local_buffer(
                sh.local_logits,
                sh.vocab_start,
                sh.num_valid,
                params,
                variant,
                use_fp64_gumbel,
                record_splits,
                with_candidates,
                strict,
                rank,
                num_warps=num_warps,
                candidates=candidates,
            )
            for rank, sh in enumerate(shards)
        ],
        dim=0,
    )
    return finish_gathered(
        gathered,
        tp_size,
        record_splits,
        with_candidates,
        chk.vocab,
        draft_sampled,
        cu_num_logits,
        pos,
        idx_mapping,
        chk.temperature,
        seed,
        k,
        chk.top_k,
        synthetic_conditional_rates,
        seq_lens,
        prefill_len,
        use_fp64_gumbel,
        chk.top_p,
        chk.min_p,
        strict,
        candidates=candidates,
    )
