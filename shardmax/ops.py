"""Public operations: vocab-parallel argmax (draft side) and sharded greedy verification.

Data flow of one call on one TP rank (design §3)::

    local logits [rows, W] --shard_keys kernel--> keys [rows, S] int64   (HBM read once)
    keys --all_gather(dim=0)--> [tp*rows, S]  or  --all_reduce(MAX)--> [rows, S]   (8*S B/row)
    keys --finish kernel--> argmax ids [rows] | sampled, num_sampled, num_rejected

The variant, launch parameters and transport come from :func:`shardmax.dispatch.select`.
"""

from __future__ import annotations

from typing import Any

import torch

from shardmax import kernels
from shardmax.collectives import Collective, resolve
from shardmax.dispatch import (
    PLAIN,
    TARGET_PROGRAMS,
    Problem,
    Selection,
    alignment_of,
    builtin_default,
    select,
)
from shardmax.geometry import check_geometry
from shardmax.validation import (
    SUPPORTED_DTYPES,
    check_index_tensor,
    check_local_logits,
    value_checks_enabled,
)
from shardmax.variants import finish_variant


def _selection(op: str, logits: torch.Tensor, tp: int) -> Selection:
    problem = Problem(
        op=op,
        dtype=SUPPORTED_DTYPES[logits.dtype],
        tp=tp,
        rows=logits.shape[0],
        width=logits.shape[1],
        align=alignment_of(logits),
    )
    return select(problem)


def _global_keys(
    logits: torch.Tensor, vocab_start: int, num_valid: int, coll: Collective, sel: Selection
) -> torch.Tensor:
    """Local stage + collective: keys every rank holds identically afterwards."""
    keys = kernels.shard_keys(
        logits,
        vocab_start,
        num_valid,
        sel.variant,
        splits=sel.splits,
        num_warps=int(sel.launch.get("num_warps", 4)),
        num_stages=int(sel.launch.get("num_stages", 2)),
    )
    if sel.transport == "allreduce":
        return coll.all_reduce_max(keys)
    return coll.all_gather_dim0(keys)


def _plain_full_logits(
    logits: torch.Tensor, vocab_start: int, num_valid: int, coll: Collective
) -> torch.Tensor:
    """The unsharded path: all-gather the padded shards and drop the padding -> [rows, V]."""
    geometry = check_geometry(coll, logits, vocab_start, num_valid)
    gathered = coll.all_gather_dim0(logits.contiguous())
    parts = gathered.chunk(coll.world_size)
    return torch.cat([p[:, :n] for p, (_, n) in zip(parts, geometry, strict=True)], dim=1)


def vocab_parallel_argmax(
    local_logits: torch.Tensor,
    *,
    vocab_start: int,
    num_valid: int | None = None,
    group: Any = None,
) -> torch.Tensor:
    """Global argmax over vocab-parallel logits without gathering them.

    Reproduces ``torch.argmax`` over the concatenation of every rank's unpadded logits, which
    is what vLLM's ``LogitsProcessor.get_top_tokens`` returns with
    ``use_local_argmax_reduction`` (spec §3.3): larger value first, -0.0 == +0.0, ties -> lowest
    global id, NaN beats every number (lowest id among NaNs), an all -inf row -> its lowest id.

    Args:
        local_logits: ``[B, W]`` bf16/fp16/fp32 on this rank, last dim contiguous (row stride
            may exceed W); columns ``>= num_valid`` are padding and are never read.
        vocab_start: global token id of local column 0 (vLLM ``org_vocab_start_index``).
        num_valid: real columns of the shard (default ``W``).
        group: None (one rank), a ``torch.distributed`` ProcessGroup, a vLLM
            ``GroupCoordinator`` or a :class:`shardmax.collectives.Collective`. Every rank of the
            group must call with the same B, W and dtype.

    Returns:
        int64 ``[B]`` global token ids, identical on every rank (``[0]`` for B = 0).

    Raises:
        TypeError: wrong tensor type/dtype or argument types.
        ValueError: wrong rank, non-contiguous last dim, ``num_valid`` out of range,
            vocabulary >= 2**31, or shard geometry inconsistent across ranks.
    """
    logits, vocab_start, num_valid = check_local_logits(local_logits, vocab_start, num_valid)
    coll = resolve(group)
    rows = logits.shape[0]
    if coll.world_size > 1:
        check_geometry(coll, logits, vocab_start, num_valid)
    elif num_valid == 0:
        raise ValueError(
            f"num_valid: 0 real columns in local_logits of shape {tuple(logits.shape)} on a "
            "single rank: the vocabulary is empty, there is no argmax"
        )
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    sel = _selection("argmax", logits, coll.world_size)
    if sel.variant == PLAIN:
        return torch.argmax(_plain_full_logits(logits, vocab_start, num_valid, coll), dim=-1)
    keys = _global_keys(logits, vocab_start, num_valid, coll, sel)
    return kernels.argmax_pick(
        keys, rows, coll.world_size, sel.finish_variant("argmax", coll.world_size)
    )


def validate_verify_inputs(
    local_logits: torch.Tensor,
    draft_sampled: torch.Tensor,
    cu_num_logits: torch.Tensor,
    pos: torch.Tensor,
    idx_mapping: torch.Tensor,
    expanded_local_pos: torch.Tensor,
    seed: torch.Tensor,
    num_speculative_steps: int,
    vocab_start: int,
    num_valid: int | None,
    synthetic_conditional_rates: torch.Tensor | None,
    seq_lens: torch.Tensor | None,
    prefill_len: torch.Tensor | None,
    coll: Collective,
) -> tuple[torch.Tensor, int, int]:
    """All checks of :func:`sharded_greedy_verify`; returns (logits, vocab_start, num_valid)."""
    logits, vocab_start, num_valid = check_local_logits(local_logits, vocab_start, num_valid)
    dev = logits.device
    num_logits = logits.shape[0]
    if isinstance(num_speculative_steps, bool) or not isinstance(num_speculative_steps, int):
        raise TypeError(
            f"num_speculative_steps: expected an int, got {type(num_speculative_steps).__name__}"
        )
    if num_speculative_steps < 1:
        raise ValueError(f"num_speculative_steps: must be >= 1, got {num_speculative_steps}")
    k = num_speculative_steps
    draft_sampled = check_index_tensor("draft_sampled", draft_sampled, dev)
    if draft_sampled.shape[0] != num_logits:
        raise ValueError(
            f"draft_sampled: shape {tuple(draft_sampled.shape)} does not match the "
            f"{num_logits} logits rows"
        )
    idx_mapping = check_index_tensor("idx_mapping", idx_mapping, dev)
    num_reqs = idx_mapping.shape[0]
    cu_num_logits = check_index_tensor("cu_num_logits", cu_num_logits, dev)
    if cu_num_logits.shape[0] != num_reqs + 1:
        raise ValueError(
            f"cu_num_logits: expected {num_reqs + 1} entries (num_reqs + 1 for idx_mapping of "
            f"shape {tuple(idx_mapping.shape)}), got shape {tuple(cu_num_logits.shape)}"
        )
    pos = check_index_tensor("pos", pos, dev, dtypes=(torch.int64,))
    expanded_local_pos = check_index_tensor("expanded_local_pos", expanded_local_pos, dev)
    for name, t in (("pos", pos), ("expanded_local_pos", expanded_local_pos)):
        if t.shape[0] != num_logits:
            raise ValueError(f"{name}: shape {tuple(t.shape)} does not match {num_logits} rows")
    seed = check_index_tensor("seed", seed, dev, dtypes=(torch.int64,))
    if synthetic_conditional_rates is not None:
        r = synthetic_conditional_rates
        if not isinstance(r, torch.Tensor) or r.dtype != torch.float32 or r.dim() != 1:
            raise TypeError("synthetic_conditional_rates: expected a 1-D float32 tensor or None")
        if r.shape[0] != k:
            raise ValueError(
                f"synthetic_conditional_rates: shape {tuple(r.shape)}, expected [{k}] "
                "(one conditional rate per draft step)"
            )
        if r.device != dev:
            raise ValueError(f"synthetic_conditional_rates: on {r.device}, expected {dev}")
    if (seq_lens is None) != (prefill_len is None):
        raise ValueError("seq_lens and prefill_len: pass both or neither")
    if seq_lens is not None:
        seq_lens = check_index_tensor("seq_lens", seq_lens, dev, length=num_reqs)
        prefill_len = check_index_tensor("prefill_len", prefill_len, dev)
    if coll.world_size > 1:
        check_geometry(coll, logits, vocab_start, num_valid)
    elif num_valid == 0:
        raise ValueError(
            f"num_valid: 0 real columns in local_logits of shape {tuple(logits.shape)} on a "
            "single rank: the vocabulary is empty"
        )
    if value_checks_enabled(dev):
        _check_batch_values(
            draft_sampled,
            cu_num_logits,
            idx_mapping,
            seed,
            prefill_len,
            num_logits,
            k,
            vocab_start,
            num_valid,
            coll,
        )
    return logits, vocab_start, num_valid


def sharded_greedy_verify(
    local_logits: torch.Tensor,
    draft_sampled: torch.Tensor,
    cu_num_logits: torch.Tensor,
    pos: torch.Tensor,
    idx_mapping: torch.Tensor,
    expanded_local_pos: torch.Tensor,
    seed: torch.Tensor,
    num_speculative_steps: int,
    *,
    vocab_start: int,
    num_valid: int | None = None,
    synthetic_conditional_rates: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    prefill_len: torch.Tensor | None = None,
    group: Any = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy speculative verification from vocab shards, bit-identical to vLLM.

    Reproduces vLLM model runner V2 ``rejection_sample`` on greedy (temperature 0) requests,
    followed by ``get_num_sampled_and_rejected`` (spec §1.2-§1.6), on the full logits that the
    ranks never gather. Request ``r`` owns logits rows ``[cu[r], cu[r+1])``; the draft verified
    by row ``cu[r]+i`` is ``draft_sampled[cu[r]+i+1]``; a ``-1`` draft is never accepted;
    synthetic acceptance draws ``tl.rand(seed[idx_mapping[r]], pos[row])`` (clamped at
    4.6566127342e-10) and accepts iff it is ``< synthetic_conditional_rates[i]``; the first
    rejected row, or the bonus row, contributes its target argmax; a request with
    ``seq_lens[r] < prefill_len[idx_mapping[r]]`` (chunked prefill) gets 0 sampled and 0
    rejected.

    Args:
        local_logits: ``[num_logits, W]`` this rank's padded target logits shard.
        draft_sampled: ``[num_logits]`` int32/int64 (vLLM: ``input_ids[logits_indices]``).
        cu_num_logits: ``[num_reqs + 1]`` int32/int64, non-decreasing, ``cu[0] == 0``,
            ``cu[-1] == num_logits``, at most ``K + 1`` rows per request.
        pos: ``[num_logits]`` int64 positions.
        idx_mapping: ``[num_reqs]`` int32/int64 request-state slot of each request.
        expanded_local_pos: ``[num_logits]`` int32/int64 row index inside its request
            (accepted for vLLM signature parity; only its shape is checked).
        seed: ``[max_num_reqs]`` int64 per-request-state seeds (used by synthetic acceptance).
        num_speculative_steps: K >= 1.
        vocab_start, num_valid, group: as in :func:`vocab_parallel_argmax`.
        synthetic_conditional_rates: ``[K]`` fp32 conditional acceptance rates, or None.
        seq_lens: ``[num_reqs]`` int32/int64; prefill_len: ``[max_num_reqs]`` int32/int64.
            Without both, no request is treated as prefilling.

    Returns:
        ``sampled`` int64 ``[num_reqs, K+1]`` (-1 at columns ``>= num_sampled``),
        ``num_sampled`` int32 ``[num_reqs]``, ``num_rejected`` int32 ``[num_reqs]``.

    Raises:
        TypeError / ValueError naming the argument: wrong dtypes, devices or shapes,
        inconsistent ``cu_num_logits``, draft ids >= vocabulary (value checks, see
        :mod:`shardmax.validation`), K < 1, inconsistent geometry across ranks.
    """
    coll = resolve(group)
    logits, vocab_start, num_valid = validate_verify_inputs(
        local_logits,
        draft_sampled,
        cu_num_logits,
        pos,
        idx_mapping,
        expanded_local_pos,
        seed,
        num_speculative_steps,
        vocab_start,
        num_valid,
        synthetic_conditional_rates,
        seq_lens,
        prefill_len,
        coll,
    )
    dev = logits.device
    num_reqs = idx_mapping.shape[0]
    k = num_speculative_steps
    if num_reqs == 0:
        return (
            torch.empty((0, k + 1), dtype=torch.int64, device=dev),
            torch.empty(0, dtype=torch.int32, device=dev),
            torch.empty(0, dtype=torch.int32, device=dev),
        )
    sel = _selection("verify", logits, coll.world_size)
    if sel.variant == PLAIN:
        # The unsharded path: gather the full logits, then the same exact finish on one
        # "rank" holding the whole vocabulary (no host sync, CUDA-graph capturable).
        full = _plain_full_logits(logits, vocab_start, num_valid, coll).contiguous()
        one = builtin_default(
            Problem(
                "verify",
                SUPPORTED_DTYPES[full.dtype],
                1,
                full.shape[0],
                full.shape[1],
                alignment_of(full),
            ),
            target_programs=1 if full.device.type == "cpu" else TARGET_PROGRAMS,
        )
        keys = kernels.shard_keys(
            full,
            0,
            full.shape[1],
            one.variant,
            splits=one.splits,
            num_warps=int(one.launch["num_warps"]),
            num_stages=int(one.launch["num_stages"]),
        )
        return kernels.verify_finish(
            keys,
            1,
            finish_variant("verify", 1, "allreduce"),
            draft_sampled,
            cu_num_logits,
            pos,
            idx_mapping,
            seed,
            k,
            synthetic_conditional_rates,
            seq_lens,
            prefill_len,
        )
    keys = _global_keys(logits, vocab_start, num_valid, coll, sel)
    return kernels.verify_finish(
        keys,
        coll.world_size,
        sel.finish_variant("verify", coll.world_size),
        draft_sampled,
        cu_num_logits,
        pos,
        idx_mapping,
        seed,
        k,
        synthetic_conditional_rates,
        seq_lens,
        prefill_len,
    )


def _check_batch_values(
    draft_sampled: torch.Tensor,
    cu: torch.Tensor,
    idx_mapping: torch.Tensor,
    seed: torch.Tensor,
    prefill_len: torch.Tensor | None,
    num_logits: int,
    k: int,
    vocab_start: int,
    num_valid: int,
    coll: Collective,
) -> None:
    """Checks that read values (one device->host copy); see :mod:`shardmax.validation`."""
    cu_h = cu.tolist()
    if cu_h[0] != 0 or cu_h[-1] != num_logits:
        raise ValueError(
            f"cu_num_logits: must start at 0 and end at the {num_logits} logits rows, got "
            f"{cu_h[0]} .. {cu_h[-1]}"
        )
    for r in range(len(cu_h) - 1):
        n = cu_h[r + 1] - cu_h[r]
        if not 1 <= n <= k + 1:
            raise ValueError(
                f"cu_num_logits: request {r} has {n} logits rows, expected 1..K+1 = 1..{k + 1} "
                f"(num_speculative_steps={k})"
            )
    if idx_mapping.numel():
        lo, hi = int(idx_mapping.min()), int(idx_mapping.max())
        bound = seed.shape[0] if prefill_len is None else min(seed.shape[0], prefill_len.shape[0])
        if lo < 0 or hi >= bound:
            raise ValueError(
                f"idx_mapping: values must be in [0, {bound}) (request-state slots of seed"
                f"{'/prefill_len' if prefill_len is not None else ''}), got [{lo}, {hi}]"
            )
    if draft_sampled.numel():
        vocab = vocab_start + num_valid if coll.world_size == 1 else None
        if vocab is None:
            geometry = check_geometry(coll, None, vocab_start, num_valid)
            vocab = max(s + n for s, n in geometry)
        lo, hi = int(draft_sampled.min()), int(draft_sampled.max())
        if lo < -1 or hi >= vocab:
            raise ValueError(
                f"draft_sampled: token ids must be in [-1, {vocab}) (-1 is a placeholder "
                f"draft), got [{lo}, {hi}]"
            )
