"""Per-step gate: may this verification step take the sharded path? (spec ``vllm-semantics.md`` §5)

The sharded verification reproduces vLLM's ``rejection_sample`` + ``get_num_sampled_and_rejected``
only for greedy (and synthetic-acceptance) batches whose logits reach the rejection kernels
unmodified. :func:`can_shard_verify` checks that on plain Python values, one entry per request
of the step (already gathered through ``idx_mapping``), and names the first failing condition.
The vLLM integration extracts the values from the runner; this module imports nothing from vLLM.

Rules, in the order they are checked, with the vLLM field each one stands for:

==============================  ===============================================================
rule                            vLLM field (spec §5 table)
==============================  ===============================================================
every temperature ``== 0.0``    ``sampling_states.temperature.np[idx_mapping_np]`` (exact zero:
                                a "small" temperature is sampled, not greedy); with
                                ``allow_temperature=True``: ``== 0.0`` or finite ``> 0``
top_k disabled                  ``sampling_states.top_k.np == vocab_size`` (``<= 0`` also means
                                disabled at the API level)
top_p disabled                  ``sampling_states.top_p.np == 1.0``
min_p disabled                  ``sampling_states.min_p.np == 0.0``
no logits processors            ``logit_bias_state.use_logit_bias`` (logit bias, allowed ids,
                                min_tokens), ``penalties_state.use_penalty``, bad words,
                                custom samplers
no logprobs                     ``sampler.returns_logprobs(idx_mapping_np)``
no structured output            ``grammar_output is None`` / ``has_structured_output_reqs``
no draft logits                 ``speculator.draft_logits is None``
                                (``draft_sample_method != "probabilistic"``)
no adaptive verification        ``speculative_config.enable_adaptive_verification``
no block verification           ``rejection_sampler.use_block_verification``
no watermark                    ``rejection_sampler.watermark_key is None``
no NaN counting                 ``sampler.compute_nans`` (``VLLM_COMPUTE_NANS_IN_LOGITS``)
no sampling mask                ``model_config.return_sampling_mask``
``num_draft_tokens > 0``        ``input_batch.num_draft_tokens`` (else the plain Sampler runs)
==============================  ===============================================================

Synthetic acceptance (``synthetic_conditional_rates`` set) is allowed: the sharded path
implements it.

``allow_top_k=True`` (with ``allow_temperature``) also admits top-k requests with ``k`` below
:data:`shardmax.ops.sampled.TOPK_CANDIDATES` (fast mode runs them sharded and flags rows at an
unresolved top-k boundary).

``allow_nucleus=True`` (with ``allow_temperature``) admits every top-k / top-p / min-p request:
the caller resolves the requests the sharded step flags from their own gathered rows
(:mod:`shardmax.ops.resolve`; the vLLM plug-in with vLLM's own kernels), so no value is refused.

``allow_temperature=True`` is for callers that verify with :func:`shardmax.sharded_verify`
(temperature-only rows) and re-run vLLM's native verification when any request comes back with
``fallback`` set; ``has_logits_processors`` must then NOT count vLLM's temperature scaling
itself (vLLM 0.32 sets ``needs_logits_processing`` for every ``T not in (0, 1)`` request).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

__all__ = ["ShardDecision", "can_shard_verify"]


@dataclass(frozen=True)
class ShardDecision:
    """Outcome of :func:`can_shard_verify`; truthy iff ``ok``.

    ``reason`` is ``None`` when ``ok``, else a short stable string naming the first failing
    condition (and the offending request index and value for per-request conditions).
    """

    ok: bool
    reason: str | None = None

    def __bool__(self) -> bool:
        return self.ok


_OK = ShardDecision(True, None)


def _no(reason: str) -> ShardDecision:
    return ShardDecision(False, reason)


def _is_nan(v: object) -> bool:
    """Whether ``v`` is a NaN (Python / NumPy float); ints and other values are not."""
    try:
        return bool(v != v)
    except Exception:
        return False


def can_shard_verify(
    *,
    temperatures: Sequence[float],
    top_k: Sequence[int] | None = None,
    top_p: Sequence[float] | None = None,
    min_p: Sequence[float] | None = None,
    vocab_size: int | None = None,
    has_logits_processors: bool = False,
    returns_logprobs: bool = False,
    has_structured_output: bool = False,
    has_draft_logits: bool = False,
    adaptive_verification: bool = False,
    block_verification: bool = False,
    watermark: bool = False,
    compute_nans: bool = False,
    return_sampling_mask: bool = False,
    num_draft_tokens: int = 1,
    allow_temperature: bool = False,
    allow_top_k: bool = False,
    allow_nucleus: bool = False,
    candidates: int | None = None,
) -> ShardDecision:
    """Decide whether one verification step may use the sharded greedy path (spec §5).

    Args:
        temperatures: per-request temperature of the step; each must be exactly ``0.0``.
        top_k: per-request top-k or ``None``; each must be ``<= 0`` (disabled) or, when
            ``vocab_size`` is given, ``>= vocab_size`` (keeps every token: disabled too). With
            ``vocab_size`` unknown only ``<= 0`` counts as disabled.
        top_p: per-request top-p or ``None``; each must be ``1.0``.
        min_p: per-request min-p or ``None``; each must be ``0.0``.
        vocab_size: the unpadded vocabulary, used for the top-k rule.
        has_logits_processors: any logit bias / allowed ids / min_tokens / penalties / bad words
            / custom sampler in the step.
        returns_logprobs: any request wants logprobs (sampled or prompt-token ids).
        has_structured_output: a grammar bitmask applies to this step.
        has_draft_logits: the speculator keeps draft logits (probabilistic drafting).
        adaptive_verification: ``enable_adaptive_verification``.
        block_verification: ``rejection_sample_method == "block"``.
        watermark: the rejection sampler has a watermark key.
        compute_nans: ``VLLM_COMPUTE_NANS_IN_LOGITS`` (per-row NaN counts are an extra output).
        return_sampling_mask: ``model_config.return_sampling_mask`` (extra output).
        num_draft_tokens: drafts in the step; must be ``> 0``.
        allow_temperature: also accept sampled requests (finite temperature ``> 0``); every other
            rule is unchanged (top-k / top-p / min-p must still be disabled unless
            ``allow_top_k`` / ``allow_nucleus``). Default ``False``: greedy only.
        allow_top_k: with ``allow_temperature``, also accept top-k requests whose ``k`` fits the
            step's candidates (``0 < k < candidates``; a top-k on a greedy request is ignored,
            as vLLM ignores it). Larger ``k`` is refused with a reason.
        allow_nucleus: with ``allow_temperature``, accept every top-k / top-p / min-p request
            (the caller resolves flagged requests per request, :mod:`shardmax.ops.resolve`).
        candidates: the step's C, ``shardmax.ops.sampled.record_launch(local_logits, tp).candidates``
            (it depends on the step's shape and the tuned table); None: the built-in default
            :data:`shardmax.ops.sampled.TOPK_CANDIDATES` (64).

    Returns:
        :class:`ShardDecision`; e.g. ``ShardDecision(False, "temperature[3]=0.7 != 0
        (non-greedy request)")``.

    Raises:
        ValueError: ``allow_top_k`` / ``allow_nucleus`` without ``allow_temperature``; ``candidates`` not one of
            :data:`shardmax.runtime.defaults.CANDIDATE_CHOICES`; a NaN in ``top_k`` / ``top_p`` /
            ``min_p`` (named with its index: no value of these means NaN, and vLLM refuses
            them at the API, so a NaN is a caller bug, not a request to fall back on).
            TypeError: ``candidates`` not an int. Otherwise nothing for well-typed input: every
            failing rule is reported in the decision, a NaN temperature included (vLLM's API
            does not refuse one, so it must send the step to vLLM's path, not raise).
    """
    if allow_top_k and not allow_temperature:
        raise ValueError("allow_top_k=True needs allow_temperature=True (top-k rows are sampled)")
    if allow_nucleus and not allow_temperature:
        raise ValueError(
            "allow_nucleus=True needs allow_temperature=True (top-k/top-p/min-p rows are sampled)"
        )
    if candidates is not None:
        from shardmax.ops.sampled import CANDIDATE_CHOICES

        if not isinstance(candidates, int) or isinstance(candidates, bool):
            raise TypeError(f"candidates: expected an int, got {type(candidates).__name__}")
        if candidates not in CANDIDATE_CHOICES:
            raise ValueError(f"candidates: expected one of {CANDIDATE_CHOICES}, got {candidates}")
    # the common step (every rule passes) of NumPy values (the plug-in's) decided by the
    # built-ins' C loops on their Python floats / ints; any other input, and any step where a
    # rule fails, goes through the per-request loops, which name the first failing request
    plain = _plain_values(temperatures, top_k, top_p, min_p)
    temps = temperatures.tolist() if isinstance(temperatures, np.ndarray) else temperatures
    values = _Requests(temps, _as_list(top_k), _as_list(top_p), _as_list(min_p))
    if not plain or not _all_pass(values, vocab_size, allow_temperature, allow_nucleus):
        per_request = _per_request_rules(
            values, vocab_size, allow_temperature, allow_top_k, allow_nucleus, candidates
        )
        if per_request is not None:
            return per_request
    flags = (
        (has_logits_processors, "logits processors active (bias/penalties/bad words/min_tokens)"),
        (returns_logprobs, "logprobs requested"),
        (has_structured_output, "structured output (grammar bitmask)"),
        (has_draft_logits, "draft logits kept (probabilistic drafting)"),
        (adaptive_verification, "adaptive verification enabled"),
        (block_verification, "block verification enabled"),
        (watermark, "watermarking enabled"),
        (compute_nans, "NaN counting enabled (VLLM_COMPUTE_NANS_IN_LOGITS)"),
        (return_sampling_mask, "return_sampling_mask enabled"),
    )
    for on, reason in flags:
        if on:
            return _no(reason)
    if num_draft_tokens <= 0:
        return _no(f"num_draft_tokens={num_draft_tokens} <= 0 (no drafts: plain sampler)")
    return _OK


def _as_list(values: Sequence[Any] | None) -> Sequence[Any] | None:
    """NumPy arrays as Python lists (``tolist``: the reasons name Python values), else as given."""
    return values.tolist() if isinstance(values, np.ndarray) else values


def _plain_values(temperatures: Any, top_k: Any, top_p: Any, min_p: Any) -> bool:
    """Whether the values are 1-D NumPy arrays whose ``tolist`` gives plain Python numbers --
    floats of fp16 / fp32 / fp64 (temperatures, top-p, min-p), ints (top-k) -- the only input
    :func:`_all_pass` decides (a NumPy scalar, a ``longdouble``, ``None``, a huge int or a
    generator inside a sequence would compare or iterate otherwise there)."""

    def plain(a: Any, kinds: str) -> bool:
        return (
            isinstance(a, np.ndarray)
            and a.ndim == 1
            and a.dtype.kind in kinds
            and (a.dtype.kind != "f" or a.dtype.itemsize <= 8)
        )

    return (
        plain(temperatures, "f")
        and (top_k is None or plain(top_k, "iu"))
        and all(v is None or plain(v, "f") for v in (top_p, min_p))
    )


class _Requests(NamedTuple):
    """The per-request values of :func:`can_shard_verify` (NumPy arrays as Python lists)."""

    temperatures: Sequence[Any]
    top_k: Sequence[Any] | None
    top_p: Sequence[Any] | None
    min_p: Sequence[Any] | None


def _all_pass(
    values: _Requests, vocab_size: int | None, allow_temperature: bool, allow_nucleus: bool
) -> bool:
    """Whether every per-request rule of :func:`can_shard_verify` passes for plain Python
    numbers (:func:`_plain_values`' ``tolist``), decided with the built-ins' C loops (``any`` /
    ``min`` / ``max`` over the values: ~0.05 us a request, where the rules' own loop takes ~0.5
    and NumPy's operations ~1 us each on a step's few values): True only where
    :func:`_per_request_rules` would neither return a reason nor raise. False sends the step
    through those loops, which name the failing request."""
    temperatures, top_k, top_p, min_p = values
    for given in (top_k, top_p, min_p):  # a NaN raises
        if given is not None and any(map(_is_nan, given)):
            return False
    if not allow_temperature:
        if any(temperatures):  # every one 0.0 (-0.0 too; a NaN is truthy)
            return False
    elif temperatures and (
        any(map(_is_nan, temperatures)) or min(temperatures) < 0.0 or max(temperatures) == math.inf
    ):
        return False  # each 0, or finite and > 0
    if allow_nucleus:
        return True
    if top_k is not None and any(k > 0 and (vocab_size is None or k < vocab_size) for k in top_k):
        return False  # (allow_top_k's cap is the loop's to decide)
    if top_p is not None and any(p != 1.0 for p in top_p):
        return False
    return min_p is None or not any(min_p)  # every one 0.0 (NaN excluded above)


def _per_request_rules(
    values: _Requests,
    vocab_size: int | None,
    allow_temperature: bool,
    allow_top_k: bool,
    allow_nucleus: bool,
    candidates: int | None,
) -> ShardDecision | None:
    """:func:`can_shard_verify`'s per-request rules in order, one request at a time: the first
    failing one's decision (or its ValueError for a NaN top-k / top-p / min-p), None when all
    pass."""
    temperatures, top_k, top_p, min_p = values
    for name, given in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
        if given is None:
            continue
        for i, v in enumerate(given):
            if _is_nan(v):
                raise ValueError(
                    f"{name}[{i}]={v}: NaN is not a valid {name.replace('_', '-')} value "
                    "(expected a number; disabled is top_k <= 0 or >= vocab_size, top_p 1.0, "
                    "min_p 0.0)"
                )
    for i, t in enumerate(temperatures):
        if t == 0.0:
            continue
        if not allow_temperature:  # NaN also fails here
            return _no(f"temperature[{i}]={t} != 0 (non-greedy request)")
        if not (t > 0.0 and math.isfinite(t)):  # NaN, inf, negative
            return _no(f"temperature[{i}]={t} is not a finite value >= 0")
    if top_k is not None and not allow_nucleus:
        from shardmax.ops.sampled import TOPK_CANDIDATES

        cap = TOPK_CANDIDATES if candidates is None else candidates
        for i, k in enumerate(top_k):
            if k > 0 and (vocab_size is None or k < vocab_size):
                if not allow_top_k:
                    vs = "unknown" if vocab_size is None else f"{vocab_size}"
                    return _no(f"top_k[{i}]={k} < vocab_size={vs} (top-k active)")
                greedy = i < len(temperatures) and temperatures[i] == 0.0
                if not greedy and k >= cap:
                    return _no(
                        f"top_k[{i}]={k} >= {cap} (more than the fast mode's top-k candidates)"
                    )
    if top_p is not None and not allow_nucleus:
        for i, p in enumerate(top_p):
            if p != 1.0:
                return _no(f"top_p[{i}]={p} != 1 (top-p active)")
    if min_p is not None and not allow_nucleus:
        for i, m in enumerate(min_p):
            if m != 0.0:
                return _no(f"min_p[{i}]={m} != 0 (min-p active)")
    return None
