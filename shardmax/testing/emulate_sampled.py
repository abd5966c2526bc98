"""In-process emulation of :func:`shardmax.sharded_verify` over ``tp_size`` ranks.

Every emulated rank runs its :class:`~shardmax.ops.sampled.SampledVerifyPlan`'s ``local`` stage
(row parameters, the ``sampled_record`` kernel, strict extras) on its :func:`shard_like_vllm`
shard; the buffers are concatenated in rank order exactly as ``all_gather(dim=0)`` returns them,
and rank 0's ``finish`` (merge, strict LSE, finish kernel) reduces them -- the code a real rank
runs. Nothing else is shared between "ranks" (:mod:`shardmax.testing.emulate`).
"""

from __future__ import annotations

import torch

from shardmax.ops.sampled import (
    MODES,
    TOPK_CANDIDATES,
    RecordLaunch,
    SampledVerifyPlan,
    VerifyResult,
    check_logits_processed,
    check_record_selection,
    record_variant,
    resolve_chunk_gate,
)
from shardmax.reference.nucleus_replay import PipelineConfig
from shardmax.runtime.defaults import BUILTIN_PHASES
from shardmax.runtime.dispatch import Selection
from shardmax.runtime.validation import (
    SUPPORTED_DTYPES,
    check_batch_values,
    check_step_batch,
    value_checks_enabled,
)
from shardmax.testing.emulate import _check_full, _stride, emulated_exchange, emulated_ranks

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
    phases: int = BUILTIN_PHASES,
    draw_splits: int | None = None,
    topp: PipelineConfig | None = None,
) -> VerifyResult:
    """``sharded_verify`` of ``tp_size`` emulated ranks over ``full_logits [num_logits, V]``.

    Same arguments and outputs as :func:`shardmax.sharded_verify` after ``tp_size`` (the batch is
    validated as the public op validates it, against the full vocabulary). The record launch is
    this function's, not the dispatcher's: ``record_block`` (default the built-in 2048),
    ``record_splits`` (1..32 programs per row and rank), ``candidates`` (C, one of
    :data:`shardmax.runtime.defaults.CANDIDATE_CHOICES`), ``num_warps`` and ``phases`` (1 | 2,
    steps without candidates; default the built-in rule's); or ``selection``, a ``sampled``
    :class:`shardmax.runtime.dispatch.Selection` (the tuner's), which sets all five. A two-phase
    step runs every rank's draw stage on rank 0's draw rows and a second emulated exchange;
    ``draw_splits`` fixes its programs per request (default the built-in rule: 1 on a CPU).
    The finish variant follows ``tp_size * record_splits`` (``2/4/8`` unrolled, ``n``
    otherwise). ``topp``: verify the step's top-p rows from level histograms with this vLLM
    pipeline (:class:`~shardmax.ops.sampled.SampledVerifyPlan`'s ``topp``) instead of
    candidates.

    Raises:
        TypeError / ValueError as :func:`shardmax.sharded_verify`, and for a ``selection`` or
        record launch that is not a record kernel of the logits' dtype.
    """
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    if not isinstance(use_fp64_gumbel, bool):
        raise TypeError(f"use_fp64_gumbel: expected a bool, got {type(use_fp64_gumbel).__name__}")
    check_logits_processed(logits_processed)
    full_logits = _check_full(full_logits)
    if selection is not None:
        check_record_selection(selection.variant, SUPPORTED_DTYPES[full_logits.dtype])
        plain = topp is not None or (top_k is None and top_p is None and min_p is None)
        launch = RecordLaunch.of(selection, two_phase=plain)
    else:
        variant = record_variant(full_logits.dtype, record_block or 2048)
        if record_block is not None:
            from shardmax.runtime.kernels import load

            load(variant)  # a block that was never generated: ValueError naming it
        launch = RecordLaunch(variant, record_splits, num_warps, candidates, "emulator", phases)
    batch = check_step_batch(
        full_logits.shape[0], full_logits.device, draft_sampled, cu_num_logits, pos,
        idx_mapping, expanded_local_pos, seed, num_speculative_steps,
        synthetic_conditional_rates, seq_lens, prefill_len, temperature=temperature,
        top_k=top_k, top_p=top_p, min_p=min_p,
    )  # fmt: skip
    vocab = full_logits.shape[1]
    if vocab == 0:
        raise ValueError("full_logits: an empty vocabulary (0 columns)")
    checks = value_checks_enabled(full_logits.device)
    if checks:
        check_batch_values(batch, vocab, temperature=temperature)
    processed = False
    if mode == "strict":
        processed = resolve_chunk_gate(batch, vocab, logits_processed, checks)
    shards, ctxs = emulated_ranks(full_logits, tp_size, pad_to)
    with_candidates = topp is None and (top_k is not None or top_p is not None or min_p is not None)
    plans = [
        SampledVerifyPlan(
            c,
            full_logits.shape[0],
            _stride(s.local_logits),
            mode=mode,
            use_fp64_gumbel=use_fp64_gumbel,
            with_candidates=with_candidates,
            processed=processed,
            launch=launch,
            draw_splits=draw_splits,
            topp=topp,
        )
        for c, s in zip(ctxs, shards, strict=True)
    ]
    if batch.num_reqs == 0:
        return plans[0].run(shards[0].local_logits, batch)
    sent = [p.local(s.local_logits, batch) for p, s in zip(plans, shards, strict=True)]
    res = plans[0].finish(emulated_exchange(sent), batch)
    if not plans[0].two_phase:
        return res
    draw = plans[0].draw_rows(batch.num_reqs)
    kept = plans[0].kept_sets() if topp is not None else None  # every rank computes the same
    keys = [p.draw(s.local_logits, batch, draw, kept) for p, s in zip(plans, shards, strict=True)]
    return plans[0].pick(emulated_exchange(keys), res)
