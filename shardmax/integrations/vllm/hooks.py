"""What the plug-in patches in vLLM, and :func:`install` / :func:`uninstall`.

* ``LogitsProcessor.get_top_tokens`` -> :func:`get_top_tokens` (draft argmax);
* ``GPUModelRunner.sample`` (model runner V2) -> a wrapper around :func:`maybe_verify_sharded`;
* :func:`rejection_sample_sharded`: vLLM's ``rejection_sample`` signature (0.32 and 0.33) on the
  local shard, for callers that drive verification themselves (not patched into vLLM).

Class attributes and module globals are replaced, never instances; each replacement keeps the
original and calls it whenever the sharded path does not apply. This module imports vLLM only
inside functions.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from shardmax.integrations.vllm import counters, gate, step, version

__all__ = [
    "ENV_ENABLE",
    "get_top_tokens",
    "install",
    "is_installed",
    "maybe_verify_sharded",
    "rejection_sample_sharded",
    "uninstall",
]

ENV_ENABLE = "SHARDMAX_VLLM"

_install_lock = threading.Lock()
_originals: dict[str, Callable[..., Any]] = {}
_state = {"installed": False, "atexit": False}


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

    Projects ``hidden_states`` ``[B, H]`` with the local (padded) head shard, applies the
    processor's soft cap and then its scale exactly as vLLM 0.32 / 0.33 do, and returns
    ``shardmax.vocab_parallel_argmax`` over the TP group: int64 ``[B]`` global token ids, equal
    to ``torch.argmax`` over the concatenated unpadded logits of all ranks, identical on every
    rank. A shard with added (LoRA) vocabulary runs the original method (counted, warned once).

    Raises:
        ValueError: ``logits_processor.scale <= 0`` (argmax is only invariant under positive
            scaling; same check and condition as vLLM).
        NotImplementedError: an added-vocabulary shard and no original method to fall back to.
    """
    scale = float(getattr(logits_processor, "scale", 1.0))
    if scale <= 0.0:
        raise ValueError(
            "The local argmax reduction optimization is not supported for non-positive "
            f"logit scaling factors (scale={scale})."
        )
    _vocab_start, _num_valid, refusal = step.shard_geometry(lm_head)
    if refusal is not None:
        orig = _original_get_top_tokens(logits_processor)
        if orig is None:
            raise NotImplementedError(
                f"shardmax get_top_tokens: {refusal}, and no original "
                "LogitsProcessor.get_top_tokens to fall back to"
            )
        counters.fallback("native_argmax", refusal)
        return orig(logits_processor, lm_head, hidden_states, embedding_bias)

    logits = step.apply_head(logits_processor, lm_head, hidden_states, embedding_bias)
    soft_cap = getattr(logits_processor, "soft_cap", None)
    if soft_cap is not None:
        logits = torch.tanh(logits / soft_cap) * soft_cap
    if scale != 1.0:
        logits = logits * scale
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    shard = step.vocab_shard(lm_head, logits)
    rows = logits.shape[0]
    out = shard.argmax(rows, row_stride=logits.stride(0) if rows > 1 else logits.shape[1]).run(
        logits
    )
    counters.bump("sharded_argmax")
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
    fly_window_size: int = 0,
    fly_entropy_threshold: float = 0.3,
    fly_entropy_top_k: int = 3,
    *,
    vocab_start: int,
    num_valid: int | None = None,
    group: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM V2 ``rejection_sample`` with the target logits replaced by the LOCAL shard.

    Same positional arguments and defaults as
    ``vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils.rejection_sample`` of vLLM 0.33
    (0.32's is the same without the trailing ``fly_*`` three, so 0.32 calls fit too);
    ``target_logits`` is this rank's padded local shard ``[num_logits, W]`` whose column 0 is
    global id ``vocab_start`` and whose first ``num_valid`` columns are real. Only greedy
    verification is sharded: the caller must have checked (e.g. with
    :func:`shardmax.can_shard_verify`) that every request is greedy and that the logits were not
    processed; ``temperature`` and ``use_fp64`` are accepted for signature parity and unused
    (``use_fp64`` only affects Gumbel noise, absent for greedy rows); ``fly_entropy_threshold``
    / ``fly_entropy_top_k`` are read by vLLM only when ``fly_window_size > 0``, which is refused.

    Returns:
        ``(sampled int64 [num_reqs, K+1], num_sampled int32 [num_reqs])`` as vLLM's
        ``rejection_sample`` (before ``get_num_sampled_and_rejected``); columns at or past
        ``num_sampled`` are -1.

    Raises:
        ValueError: draft logits, block verification, watermarking or FLy verification
            (``fly_window_size > 0``, vLLM 0.33's lossy method) were requested: they need the
            full distribution or are not reproduced; use vLLM's path.
    """
    del temperature, use_fp64, expanded_idx_mapping, contexts, watermarking_skip_mask
    del fly_entropy_threshold, fly_entropy_top_k
    if draft_logits is not None:
        raise ValueError(
            "rejection_sample_sharded: draft logits (probabilistic drafting) are not supported"
        )
    if use_block_verification:
        raise ValueError("rejection_sample_sharded: block verification is not supported")
    if watermark_key is not None or watermarking is not None:
        raise ValueError("rejection_sample_sharded: watermarking is not supported")
    if fly_window_size != 0:
        raise ValueError(
            f"rejection_sample_sharded: FLy verification (fly_window_size={fly_window_size}, "
            "vLLM 0.33's lossy rejection_sample_method='fly') is not supported; expected "
            "fly_window_size=0"
        )
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


def maybe_verify_sharded(
    runner: Any,
    hidden_states: torch.Tensor,
    input_batch: Any,
    grammar_output: Any,
    native: Callable[..., Any],
) -> Any:
    """Body of the patched V2 ``GPUModelRunner.sample``.

    * The step is counted as warm-up when its requests are vLLM's warm-up dummies
      (:func:`shardmax.integrations.vllm.step.is_warmup_step`; 0.33 runs a greedy spec-decode
      warm-up), else as serving.
    * All requests greedy and :func:`~shardmax.integrations.vllm.gate.step_decision` allows it:
      :func:`~shardmax.integrations.vllm.step.verify_greedy` (counter ``sharded_verify``).
    * Some request sampled (temperature > 0), sampled routing on at this TP size
      (:func:`~shardmax.integrations.vllm.step.sampled_routing`: by default at TP > 1, and at
      TP 1 top-p steps whose flags the folded device fallback decides,
      :func:`~shardmax.integrations.vllm.step.topp_fold_routing` -- other TP-1 sampled steps
      have nothing to gather and vLLM's chain is as fast) and
      ``step_decision(allow_temperature=True, allow_nucleus=<nucleus_routing(runner,
      input_batch) and a resolver loads>)`` allows it (temperature rows; with
      ``SHARDMAX_VLLM_NUCLEUS=auto``, the default, also the top-p rows of a bf16 / fp16 step
      whose only truncation is top-p -- the level-histogram path --, with
      ``SHARDMAX_VLLM_NUCLEUS=1`` every top-k, top-p, min-p row):
      :func:`~shardmax.integrations.vllm.step.verify_sampled`. Exactness rule: every request
      that comes back with ``fallback`` set (NaN / inf rows, a nucleus wider than the candidates,
      a boundary tie, an LSE at the margin, ...) is resolved from its own gathered rows by vLLM's
      own kernels with the whole step's per-chunk decisions (counters ``resolved_steps`` /
      ``resolved_requests`` / ``resolved_rows`` / ``resolved_reasons``); only without a
      resolver (``SHARDMAX_VLLM_RESOLVE=0``, or vLLM's chain does not load) is the WHOLE step
      re-run with ``native`` (counter ``sampled_fallback_reruns``). Then counter
      ``sharded_sampled_verify`` (and ``sharded_sampled_verify_strict`` in strict mode). Cost:
      one device->host read of the flags per sampled step (``sample`` runs eagerly in the V2
      runner of 0.32 and 0.33: target verification is not graph-captured).
    * Otherwise ``native(runner, hidden_states, input_batch, grammar_output)``, counting the
      reason (logged once per distinct reason; for sampled steps the reason of the
      ``allow_temperature`` gate, e.g. ``top_k ... (top-k active)``). Steps without drafts are
      vLLM's plain sampler (counter ``plain_sample``, not a fallback).

    Returns:
        ``(SamplerOutput, num_sampled int32 [num_reqs], num_rejected int32 [num_reqs])``.
    """
    counters.set_warmup(step.is_warmup_step(input_batch))
    if getattr(input_batch, "num_draft_tokens", 0) == 0 or runner.rejection_sampler is None:
        counters.bump("plain_sample")
        return native(runner, hidden_states, input_batch, grammar_output)
    # the requests' sampling values, read once for the routing's every question
    requests = step.StepRequests(runner, input_batch)
    step_gate = gate.StepGate(runner, input_batch, grammar_output, requests=requests)
    if getattr(input_batch, "num_reqs", 0) == 0 or requests.all_greedy:
        decision = step_gate.decide()  # (a step with a sampled request is never greedy's)
        if decision.ok:
            out = step.verify_greedy(runner, hidden_states, input_batch)
            counters.bump("sharded_verify")
            return out
    else:
        group = step.tp_group()
        tp = 1 if group is None else int(group.world_size)
        if not step.sampled_routing(tp) and not (
            tp == 1 and step.topp_fold_routing(runner, input_batch, hidden_states.device, requests)
        ):
            reason = (
                f"sampled step at TP {tp} without top-p on the device fallback: nothing to "
                f"gather, vLLM's own chain is as fast ({step.ENV_SAMPLED}=1 shards it anyway)"
                if tp == 1
                else f"sampled steps off ({step.ENV_SAMPLED}=0)"
            )
            counters.fallback("native_verify", reason)
            return native(runner, hidden_states, input_batch, grammar_output)
        nucleus = (
            step.nucleus_routing(runner, input_batch, requests) and step.resolver() is not None
        )
        decision = step_gate.decide(allow_temperature=True, allow_nucleus=nucleus)
        if decision.ok:
            res = step.verify_sampled(runner, hidden_states, input_batch, requests)
            if res.output is None:
                counters.fallback(
                    "sampled_fallback_reruns",
                    f"sharded_verify flagged a request ({res.flagged}); step re-run natively",
                )
                return native(runner, hidden_states, input_batch, grammar_output)
            counters.bump("sharded_sampled_verify")
            if res.mode == "strict":
                counters.bump("sharded_sampled_verify_strict")
            return res.output
    counters.fallback("native_verify", decision.reason or "unknown")
    return native(runner, hidden_states, input_batch, grammar_output)


def _make_sample_hook(orig: Callable[..., Any]) -> Callable[..., Any]:
    def sample(
        self: Any, hidden_states: torch.Tensor, input_batch: Any, grammar_output: Any
    ) -> Any:
        return maybe_verify_sharded(self, hidden_states, input_batch, grammar_output, orig)

    sample.__shardmax_hook__ = True  # type: ignore[attr-defined]
    sample.__wrapped__ = orig  # type: ignore[attr-defined]
    sample.__doc__ = "shardmax: sharded verification, else " + (orig.__doc__ or "original")
    return sample


# --------------------------------------------------------------------------------------------
# install()
# --------------------------------------------------------------------------------------------


def _supported_text() -> str:
    return (
        f"Supported vLLM versions: {', '.join(version.SUPPORTED_VLLM_VERSIONS)} (verified: "
        f"{'; '.join(version.VERIFIED_VLLM_VERSIONS)})"
    )


def _hook_error(what: str, err: BaseException | None = None) -> RuntimeError:
    try:
        have = version.installed_vllm_version()
    except Exception:
        have = "not importable"
    msg = (
        f"shardmax vLLM plug-in ({ENV_ENABLE}=1): hook {what} not found in vLLM {have}. "
        f"{_supported_text()}. Unset {ENV_ENABLE} to run without shardmax."
    )
    if err is not None:
        msg += f" ({type(err).__name__}: {err})"
    return RuntimeError(msg)


def is_installed() -> bool:
    """Whether :func:`install` patched vLLM in this process."""
    return _state["installed"]


def install() -> None:
    """vLLM general-plugin entry point; no-op unless ``SHARDMAX_VLLM=1``. Idempotent.

    Reads ``vllm.__version__``. Outside :data:`~shardmax.integrations.vllm.version.
    SUPPORTED_VLLM_SERIES` it logs a loud warning and leaves vLLM unpatched (every step runs
    vLLM's own path; ``stats()["disabled"]`` says why) unless ``SHARDMAX_VLLM_ALLOW_UNVERIFIED=1``,
    which installs the hooks anyway (with a warning; the gate then checks against the newest
    tables, so unknown fields / methods fall back).

    Raises:
        RuntimeError: ``SHARDMAX_VLLM=1`` but vLLM cannot be imported, has no version string, or
            a hook is missing on a version that is supported or admitted by the override.
    """
    if os.environ.get(ENV_ENABLE, "") != "1":
        return
    with _install_lock:
        if _state["installed"]:
            return
        try:
            have = version.installed_vllm_version()
        except Exception as e:
            raise RuntimeError(
                f"shardmax vLLM plug-in ({ENV_ENABLE}=1): cannot read vLLM's version "
                f"({type(e).__name__}: {e}). {_supported_text()}. Unset {ENV_ENABLE} to run "
                "without shardmax."
            ) from e
        if not version.is_supported(have):
            allowed = os.environ.get(version.ENV_ALLOW_UNVERIFIED, "") == "1"
            if not allowed:
                reason = (
                    f"vLLM {have} is not a supported version; shardmax's hooks are NOT installed "
                    f"and every step runs vLLM's own path. {_supported_text()}. Set "
                    f"{version.ENV_ALLOW_UNVERIFIED}=1 to install them anyway (unknown fields "
                    "and methods then fall back)."
                )
                counters.set_disabled(reason)
                counters.logger.warning("shardmax: WARNING: %s", reason)
                counters.dump_stats()
                return
            counters.logger.warning(
                "shardmax: WARNING: vLLM %s is not a verified version; %s=1: installing the "
                "hooks anyway, checked against the tables of vLLM %s. %s.",
                have,
                version.ENV_ALLOW_UNVERIFIED,
                version.table_series(have),
                _supported_text(),
            )
        _patch()
        _state["installed"] = True
        counters.set_installed(True)
        counters.set_disabled(None)
        if not _state["atexit"]:
            atexit.register(counters.dump_stats)
            _state["atexit"] = True
    counters.logger.info(
        "shardmax: vLLM %s hooks installed (LogitsProcessor.get_top_tokens, V2 "
        "GPUModelRunner.sample)",
        have,
    )
    counters.dump_stats()


def _patch() -> None:
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


def uninstall() -> None:
    """Restore the patched vLLM attributes (tests); also clears a ``disabled`` note."""
    counters.set_disabled(None)
    with _install_lock:
        if not _state["installed"]:
            return
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner

        if "get_top_tokens" in _originals:
            LogitsProcessor.get_top_tokens = _originals.pop("get_top_tokens")
        if "sample" in _originals:
            GPUModelRunner.sample = _originals.pop("sample")
        _state["installed"] = False
        counters.set_installed(False)
