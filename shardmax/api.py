"""The functional API: one call per step, everything checked, built on the plan/run runtime.

Each function validates its arguments (host checks always; the syncing value checks while
:func:`shardmax.runtime.validation.value_checks` is on, the default), checks the shard geometry
(one small collective per call while value checks are on: see
:mod:`shardmax.runtime.geometry`), takes the plan of the step from a per-process cache of
:class:`shardmax.VocabShard` objects and runs it. Engines that call every step use the plans
directly (no value checks, no geometry collective): see :mod:`shardmax.plan`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from shardmax.ops.sampled import VerifyResult, check_logits_processed, resolve_chunk_gate
from shardmax.plan import VocabShard
from shardmax.runtime.collectives import Collective, resolve
from shardmax.runtime.geometry import checked_geometry, exchange_device, exchange_geometry
from shardmax.runtime.validation import (
    check_batch_values,
    check_local_logits,
    check_step_batch,
    value_checks_enabled,
)

__all__ = ["sharded_greedy_verify", "sharded_verify", "vocab_parallel_argmax"]

T = TypeVar("T")
_shards: OrderedDict[tuple[Any, ...], VocabShard] = OrderedDict()
MAX_SHARDS = 16


def _group_key(coll: Collective) -> Any:
    inner = getattr(coll, "group", None) or getattr(coll, "coordinator", None)
    return id(inner) if inner is not None else (type(coll), coll.world_size, coll.rank)


def prepare(
    local_logits: object,
    vocab_start: object,
    num_valid: object,
    group: Any,
    host_checks: Callable[[torch.Tensor], T],
) -> tuple[torch.Tensor, VocabShard, T]:
    """The checks every functional op starts with, in an order that leaves no rank behind.

    1. On this rank: the local logits (:func:`check_local_logits`) and ``host_checks(logits)``
       (the batch's shapes, dtypes, devices; no device read).
    2. With value checks on and TP > 1: the geometry collective
       (:func:`shardmax.runtime.geometry.exchange_geometry`), which also carries whether step 1
       failed here, so a rank whose own inputs were refused makes every rank raise.
    3. The cached :class:`VocabShard` of the checked geometry; with value checks off, the
       geometry an earlier checked call recorded (no communication).

    Raises:
        TypeError / ValueError of step 1 (this rank), of the geometry check (every rank), or the
        refusal of a peer's inputs.
    """
    coll = resolve(group)
    err: BaseException | None = None
    logits: torch.Tensor | None = None
    out: Any = None
    try:
        logits, vocab_start, num_valid = check_local_logits(local_logits, vocab_start, num_valid)
        out = host_checks(logits)
    except (TypeError, ValueError) as e:
        err = e
    dev = exchange_device(coll, logits.device if logits is not None else None)
    geo = None
    if coll.world_size > 1 and value_checks_enabled(dev):
        if logits is None:
            exchange_geometry(coll, -1, None, -1, -1, dev, -1, failed=True)
        else:
            assert isinstance(vocab_start, int) and isinstance(num_valid, int)
            rows, width = logits.shape
            geo = exchange_geometry(
                coll, width, logits.dtype, vocab_start, num_valid, dev, rows, failed=err is not None
            )
    if err is not None:
        raise err
    assert logits is not None and isinstance(vocab_start, int) and isinstance(num_valid, int)
    width, dtype = logits.shape[1], logits.dtype
    if coll.world_size == 1 and num_valid == 0:
        raise ValueError(
            f"num_valid: 0 real columns in local_logits of shape {tuple(logits.shape)} on a "
            "single rank: the vocabulary is empty"
        )
    if geo is None:
        geo = checked_geometry(coll, width, dtype, vocab_start, num_valid)
    key = (_group_key(coll), logits.device, geo)
    shard = _shards.get(key)
    if shard is None:
        shard = VocabShard(
            vocab_start=vocab_start, num_valid=num_valid, width=width, dtype=dtype,
            device=logits.device, group=coll, geometry=geo,
        )  # fmt: skip
        _shards[key] = shard
        if len(_shards) > MAX_SHARDS:
            _shards.popitem(last=False)
    else:
        _shards.move_to_end(key)
    return logits, shard, out


def _row_stride(logits: torch.Tensor) -> int:
    return logits.stride(0) if logits.shape[0] > 1 else logits.shape[1]


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
            ``GroupCoordinator`` or a :class:`shardmax.runtime.collectives.Collective`. Every
            rank of the group must call with the same B, W and dtype.

    Returns:
        int64 ``[B]`` global token ids, identical on every rank.

    Raises:
        TypeError: wrong tensor type/dtype or argument types.
        ValueError: wrong rank, non-contiguous last dim, a meta (or other non-compute) device,
            ``num_valid`` out of range, vocabulary >= 2**31, or shard geometry inconsistent
            across ranks (raised on every rank).
    """
    logits, shard, _ = prepare(local_logits, vocab_start, num_valid, group, lambda _: None)
    return shard.argmax(logits.shape[0], row_stride=_row_stride(logits)).run(logits)


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
        Every tensor but ``local_logits`` may have any stride (strided views are copied).

    Returns:
        ``sampled`` int64 ``[num_reqs, K+1]`` (-1 at columns ``>= num_sampled``),
        ``num_sampled`` int32 ``[num_reqs]``, ``num_rejected`` int32 ``[num_reqs]``.

    Raises:
        TypeError / ValueError naming the argument: wrong dtypes, devices or shapes,
        inconsistent ``cu_num_logits``, draft ids >= vocabulary (value checks, see
        :mod:`shardmax.runtime.validation`), K < 1, inconsistent geometry across ranks.
    """
    logits, shard, batch = prepare(
        local_logits, vocab_start, num_valid, group,
        lambda x: check_step_batch(
            x.shape[0], x.device, draft_sampled, cu_num_logits, pos, idx_mapping,
            expanded_local_pos, seed, num_speculative_steps, synthetic_conditional_rates,
            seq_lens, prefill_len,
        ),
    )  # fmt: skip
    if value_checks_enabled(logits.device):
        check_batch_values(batch, shard.vocab)
    plan = shard.greedy_verify(logits.shape[0], row_stride=_row_stride(logits))
    return plan.run(logits, batch)


def sharded_verify(
    local_logits: torch.Tensor,
    draft_sampled: torch.Tensor,
    cu_num_logits: torch.Tensor,
    pos: torch.Tensor,
    idx_mapping: torch.Tensor,
    expanded_local_pos: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    num_speculative_steps: int,
    *,
    vocab_start: int,
    num_valid: int | None = None,
    top_k: torch.Tensor | None = None,
    synthetic_conditional_rates: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    prefill_len: torch.Tensor | None = None,
    use_fp64_gumbel: bool = False,
    mode: str = "fast",
    group: Any = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    logits_processed: bool | None = None,
) -> VerifyResult:
    """Speculative verification of greedy and sampled requests from vocab shards.

    vLLM model runner V2 ``rejection_sample`` for one-hot drafts (research §1.2-§1.3) followed by
    ``get_num_sampled_and_rejected``, computed from one all-gather of fixed-size records (24 B per
    row and rank; 32 B with fp64 Gumbel) instead of the full logits. Per request ``r`` (rows
    ``[cu[r], cu[r+1])``, slot ``idx_mapping[r]``, ``T = temperature[slot]``):

    * ``T == 0`` (greedy): exactly :func:`sharded_greedy_verify` / the greedy reference.
    * ``T > 0``: rows are processed as ``x / T`` in fp32 (``T == 1`` untouched); draft ``i``
      (``d = draft_sampled[cu[r]+i+1]``) is accepted iff ``x[d] - LSE > log u`` with
      ``u = tl.rand(seed[slot], pos[row])`` clamped (synthetic mode: ``u < rate[i]``); ``d < 0``
      ends verification; the first rejected row (draft removed) or the bonus row draws its token
      by keyed Gumbel-max; ``num_sampled = accepted + 1``.
    * chunked prefill (``seq_lens[r] < prefill_len[slot]``): 0 sampled, 0 rejected, all -1.

    Modes (the acceptance LSE; everything else is the same):

    * ``"fast"``: the LSE is rebuilt in fp64 from per-rank ``(max, sumexp)``; a decision within
      its error bound of vLLM's fp32 one sets ``fallback`` (interval test, research §2.3).
    * ``"strict"``: vLLM's fp32 LSE is rebuilt bit for bit (:mod:`shardmax.ops.strict`), so
      every acceptance decision is vLLM's and no row is flagged for the LSE. Costs 8 B per
      wholly-local block and row plus the raw pieces of at most two cut blocks per rank and row
      (``<= 16 KiB`` bf16), in the same all_gather. The batch must be one vLLM verification chunk.

    ``fallback[r]`` is True when the caller must verify request ``r`` the native way (its outputs
    here are then a valid sample but not guaranteed to be vLLM's bits): fast mode only, a row the
    decision used sits within the LSE error bound of the acceptance threshold; any mode, a used
    row holds NaN / +inf or no finite logit, a used top-k row fails the convergence guard, a
    top-p / min-p row fails the nucleus guard, or the request's top-k is ``>= C`` (the step's
    candidates per record split: 64 unless a tuned table chose 32 or 128; outputs ``-1`` / 0 / 0).

    Args:
        local_logits, draft_sampled, cu_num_logits, pos, idx_mapping, expanded_local_pos, seed,
            num_speculative_steps, vocab_start, num_valid, synthetic_conditional_rates,
            seq_lens, prefill_len, group: as :func:`sharded_greedy_verify`.
        temperature: float ``[max_num_reqs]`` per slot, read as fp32 (vLLM's storage dtype);
            0 = greedy. With value checks on, a positive fp64 temperature that is 0 in fp32 is
            refused (it would silently become greedy).
        top_k: optional int32/int64 ``[max_num_reqs]`` per slot (``k <= 0`` or ``k >= V``: off).
        use_fp64_gumbel: vLLM's ``use_fp64_gumbel`` (fp64 Gumbel keys).
        mode: ``"fast"`` or ``"strict"`` (see above).
        top_p: optional float ``[max_num_reqs]`` per slot in ``(0, 1]`` (1 = off).
        min_p: optional float ``[max_num_reqs]`` per slot in ``[0, 1]`` (0 = off). With top-k,
            top-p or min-p a request's rows keep min-p survivors, then its top-k, then the EXACT
            nucleus from the merged top-C candidates; rows the guard cannot decide set
            ``fallback``.
        logits_processed: strict mode only: vLLM's chunk gate -- True when vLLM verifies an
            fp32 processed copy of the batch's logits, False when it verifies the raw logits;
            None: computed from the sampling tensors (:func:`chunk_needs_processing`, one host
            read; logits processors are invisible here, so a caller that has them passes True).

    Returns:
        :class:`VerifyResult` ``(sampled int64 [num_reqs, K+1], num_sampled int32,
        num_rejected int32, fallback bool, reason int8)``, identical on every rank.

    Raises:
        TypeError / ValueError naming the argument (as the greedy op, plus the sampling tensors'
        shapes, dtypes and (value checks) domains, an unknown ``mode``); strict mode:
        ValueError for more rows than one vLLM chunk, ranks' ranges with a gap, or (value
        checks) ``logits_processed=False`` with a request that needs processing; TypeError for
        a non-bool ``logits_processed`` or ``use_fp64_gumbel``.
    """
    from shardmax.ops.sampled import MODES

    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    if not isinstance(use_fp64_gumbel, bool):
        raise TypeError(f"use_fp64_gumbel: expected a bool, got {type(use_fp64_gumbel).__name__}")
    check_logits_processed(logits_processed)
    if not isinstance(temperature, torch.Tensor):
        raise TypeError(f"temperature: expected a torch.Tensor, got {type(temperature).__name__}")
    logits, shard, batch = prepare(
        local_logits, vocab_start, num_valid, group,
        lambda x: check_step_batch(
            x.shape[0], x.device, draft_sampled, cu_num_logits, pos, idx_mapping,
            expanded_local_pos, seed, num_speculative_steps, synthetic_conditional_rates,
            seq_lens, prefill_len, temperature=temperature, top_k=top_k, top_p=top_p,
            min_p=min_p,
        ),
    )  # fmt: skip
    if value_checks_enabled(logits.device):
        check_batch_values(batch, shard.vocab, temperature=temperature)
    processed = False
    if mode == "strict":
        if not shard.geometry.tiles_from_zero:
            raise ValueError(
                f"mode='strict': the ranks' (vocab_start, num_valid) {shard.geometry.ranges} "
                "must tile [0, V) without gaps"
            )
        processed = resolve_chunk_gate(
            batch, shard.vocab, logits_processed, value_checks_enabled(logits.device)
        )
    plan = shard.verify(
        logits.shape[0], mode=mode, use_fp64_gumbel=use_fp64_gumbel,
        with_candidates=top_k is not None or top_p is not None or min_p is not None,
        logits_processed=processed, row_stride=_row_stride(logits),
    )  # fmt: skip
    return plan.run(logits, batch)
