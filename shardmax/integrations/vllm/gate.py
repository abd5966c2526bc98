"""The step decision of the vLLM plug-in: an ALLOW-LIST of what shardmax reproduces.

A verification step takes the sharded path only when everything that can change its result is
known to shardmax and in a state the sharded path reproduces bit for bit; anything else sends the
step to vLLM's own ``sample`` with a reason that names it (counted and logged once by the hook).
What is checked, in this order (:func:`step_decision`):

1. the step verifies drafts (``num_draft_tokens > 0``, a rejection sampler) and is not batch-sharded
   (``runner.batch_sharder``, ``--enable-batch-sharded-sampling``);
2. the rejection sampler and its sampler are vLLM's stock ``RejectionSampler`` / ``Sampler``
   classes (a watermark sampler, or a model state's ``custom_sampler()``, is not), and those
   classes define only the methods of the version's table, each still vLLM's own (not patched by
   someone else);
3. the verification method, read from ``runner.speculative_config.rejection_sample_method``
   and from the sampler's fields (``fly_window_size > 0`` = FLy, ``use_block_verification`` =
   block, ``synthetic_conditional_rates`` = synthetic), is known to the version and in
   :data:`REPRODUCED_METHODS` (``standard``, ``synthetic``); the draft sampling method is
   ``greedy`` (``probabilistic`` keeps draft logits: full rejection sampling against q);
4. every instance field of the ``RejectionSampler``, the ``Sampler``, its ``SamplingStates`` and
   the ``InputBatch`` is in the version's table (:data:`FIELD_TABLES`) with a harmless value;
   a field the table does not know passes only when its value is "off" (``None``, ``False``,
   ``0``, an empty string or container), else the step falls back naming it;
5. no adaptive-verification manager (``runner.adaptive_verification``), the model has
   ``compute_logits_local`` and an ``lm_head`` shard without added (LoRA) vocabulary;
6. the per-request rules of :func:`shardmax.can_shard_verify` (greedy or temperature-only rows,
   no top-k / top-p / min-p, no logits processing, no logprobs, no grammar, no draft logits).

Versions: the tables are keyed by release series (``"0.32"``, ``"0.33"``:
:func:`shardmax.integrations.vllm.version.table_series`); an unverified vLLM (admitted by
``SHARDMAX_VLLM_ALLOW_UNVERIFIED=1``) is checked against the newest tables. Why each field is
harmless or what it switches on is written in the tables themselves.

InputBatch fields new in 0.33 (read from 0.33.0's model runner): ``pcp`` is set only on a
prefill-context-parallel rank-local batch; ``sample`` always receives the global batch
(``PCPManager.restore_for_sampling``), so a set ``pcp`` means a partial batch and falls back.
``num_admitted_draft_tokens`` is set only under adaptive verification (whose per-request draft
counts live on the device only and are not what ``cu_num_logits_np`` says): falls back, like
adaptive verification itself.

This module imports vLLM only inside :func:`vllm_classes`; tests pass their own
:class:`VllmClasses`.
"""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from shardmax.integrations.vllm import step, version

__all__ = [
    "CLASS_METHODS",
    "FIELD_TABLES",
    "REPRODUCED_METHODS",
    "VERIFICATION_METHODS",
    "Rule",
    "StepGate",
    "VllmClasses",
    "check_fields",
    "check_methods",
    "is_off",
    "step_decision",
    "verification_method",
    "vllm_classes",
]


# --------------------------------------------------------------------------------------------
# rules
# --------------------------------------------------------------------------------------------


def is_off(value: Any) -> bool:
    """The "feature off" values an unknown field may hold: ``None``, ``False``, a number equal
    to 0 (not NaN), an empty string / bytes / tuple / list / dict / set. A tensor, an object or
    any other value is "on"."""
    if value is None:
        return True
    if isinstance(value, (str, bytes, tuple, list, dict, set, frozenset)):
        return len(value) == 0
    if isinstance(value, (bool, int, float)):
        return value == 0
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():
        try:
            return bool(value == 0)
        except Exception:
            return False
    return False


@dataclass(frozen=True)
class Rule:
    """What a known field may hold. ``harmless`` is ``None`` when every value is fine (``why``
    says why), else a predicate of the value; a value failing it refuses the step with
    ``why`` (what the value switches on)."""

    why: str
    harmless: Callable[[Any], bool] | None = None


def _any(why: str) -> Rule:
    return Rule(why)


def _off(why: str) -> Rule:
    return Rule(why, is_off)


def _is_none(value: Any) -> bool:
    return value is None


def _none(why: str) -> Rule:
    return Rule(why, _is_none)


_RS_032: dict[str, Rule] = {
    "sampler": _any("checked on its own: stock class, methods, fields, per-request state"),
    "num_speculative_steps": _any("K, read by the sharded path"),
    "synthetic_conditional_rates": _any("synthetic acceptance, reproduced by the sharded path"),
    "enable_adaptive_verification": _off("adaptive verification enabled"),
    "use_block_verification": _off("block verification enabled"),
    "watermark_key": _none("watermarking enabled"),  # key 0 is a key
}
_RS_033: dict[str, Rule] = {
    **_RS_032,
    "fly_window_size": _off("FLy verification enabled (lossy, not reproduced)"),
    "fly_entropy_threshold": _any("read by vLLM only when fly_window_size > 0"),
    "fly_entropy_top_k": _any("read by vLLM only when fly_window_size > 0"),
}
_SAMPLER: dict[str, Rule] = {
    "logprobs_mode": _any("read only when logprobs are returned (those steps fall back)"),
    "compute_nans": _off("NaN counting enabled (VLLM_COMPUTE_NANS_IN_LOGITS)"),
    "use_fp64_gumbel": _any("read by the sharded sampled path"),
    "req_states": _any("prefill_len read by the sharded path"),
    "sampling_states": _any("its own table; per-request values checked each step"),
    "penalties_state": _any("one of logits_processors, checked per request each step"),
    "logits_processors": _any("checked per request each step (custom ones count as processing)"),
    "logprob_token_ids_state": _any(
        "plain Sampler only: verification returns no token-id logprobs"
    ),
    "thinking_budget_state": _any("checked per request each step (needs_logits_processing)"),
    "trace_replay_state": _any("applied by the plain Sampler only, never in verification"),
    "needs_logits_processing": _any("checked per request each step"),
    "num_speculative_tokens": _any("not read by verification"),
    "return_sampling_mask": _off("return_sampling_mask enabled"),
    "use_flashinfer": _any("plain Sampler only (fused top-k/top-p sampling)"),
    "use_xpu_sampler": _any("plain Sampler only (fused top-k/top-p sampling)"),
}
_SAMPLING_STATES: dict[str, Rule] = {
    "max_num_reqs": _any("a size"),
    "vocab_size": _any("the top-k rule's vocabulary"),
    "temperature": _any("checked per request each step; read by the sharded path"),
    "top_k": _any("checked per request each step"),
    "top_p": _any("checked per request each step"),
    "min_p": _any("checked per request each step"),
    "seeds": _any("read by the sharded path"),
    "seeds_set": _any("plain Sampler only (fused-sampler eligibility)"),
    "num_logprobs": _any("checked per step (max_num_logprobs)"),
}
_BATCH_ANY = [
    "req_ids",
    "num_reqs",
    "num_reqs_after_padding",
    "idx_mapping",
    "idx_mapping_np",
    "expanded_idx_mapping",
    "expanded_local_pos",
    "num_scheduled_tokens",
    "num_tokens",
    "num_tokens_after_padding",
    "num_draft_tokens",
    "num_draft_tokens_per_req",
    "query_start_loc",
    "query_start_loc_np",
    "seq_lens",
    "seq_lens_cpu_upper_bound",
    "dcp_local_seq_lens",
    "num_computed_tokens_np",
    "prefill_len_np",
    "num_computed_prefill_tokens_np",
    "is_prefilling_np",
    "has_prefill",
    "decode_graph_eligible",
    "input_ids",
    "positions",
    "is_padding",
    "logits_indices",
    "cu_num_logits",
    "cu_num_logits_np",
    "has_structured_output_reqs",
    "prompt_lens",
    "max_seq_len_np",
    "max_query_len",
    "fast_prefill",
    "prefill_runs_as_decode_np",
]
_BATCH_032: dict[str, Rule] = {
    **{
        f: _any("batch layout / attention metadata (read as vLLM reads it, or not at all)")
        for f in _BATCH_ANY
    },
    "dcp_local_seq_lens_cpu_upper_bound": _any("attention metadata (DCP)"),
}
_BATCH_033: dict[str, Rule] = {
    **{k: v for k, v in _BATCH_032.items() if k != "dcp_local_seq_lens_cpu_upper_bound"},
    "pcp": _none("PCP rank-local batch (input_batch.pcp set)"),
    "num_admitted_draft_tokens": _none(
        "adaptive verification draft counts in flight (input_batch.num_admitted_draft_tokens)"
    ),
}

FIELD_TABLES: dict[str, dict[str, Mapping[str, Rule]]] = {
    "0.32": {
        "RejectionSampler": _RS_032,
        "Sampler": _SAMPLER,
        "SamplingStates": _SAMPLING_STATES,
        "InputBatch": _BATCH_032,
    },
    "0.33": {
        "RejectionSampler": _RS_033,
        "Sampler": _SAMPLER,
        "SamplingStates": _SAMPLING_STATES,
        "InputBatch": _BATCH_033,
    },
}
"""Per series, per vLLM class: every instance field of 0.32.0 / 0.33.0 and its rule."""

_RS_METHODS = [
    "__init__",
    "_get_logprobs_tensors",
    "_watermarking_kwargs",
    "_verify",
    "_verify_in_chunks",
    "__call__",
]
_SAMPLER_METHODS = [
    "__init__",
    "add_request",
    "apply_staged_writes",
    "get_logprobs_dims",
    "__call__",
    "apply_sampling_params",
    "sample",
    "_sample_random",
]
CLASS_METHODS: dict[str, dict[str, tuple[str, ...]]] = {
    s: {"RejectionSampler": tuple(_RS_METHODS), "Sampler": tuple(_SAMPLER_METHODS)}
    for s in ("0.32", "0.33")
}
"""Per series: the methods vLLM's ``RejectionSampler`` / ``Sampler`` classes define."""

VERIFICATION_METHODS: dict[str, tuple[str, ...]] = {
    "0.32": ("standard", "synthetic", "block"),
    "0.33": ("standard", "synthetic", "block", "fly"),
}
"""Per series: the values of ``SpeculativeConfig.rejection_sample_method``."""

REPRODUCED_METHODS = ("standard", "synthetic")
"""The verification methods the sharded path reproduces (greedy / temperature rows)."""

DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
"""``SpeculativeConfig.draft_sample_method`` in 0.32 and 0.33; only ``greedy`` is sharded."""


# --------------------------------------------------------------------------------------------
# vLLM's classes
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VllmClasses:
    """The vLLM the gate checks against: its version, the series of its tables, and the stock
    classes a step's rejection sampler / sampler must be."""

    version: str
    series: str
    rejection_sampler: type
    sampler: type


@functools.lru_cache(maxsize=1)
def _installed_classes() -> VllmClasses:
    from vllm.v1.worker.gpu.sample.sampler import Sampler
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler

    v = version.installed_vllm_version()
    return VllmClasses(v, version.table_series(v), RejectionSampler, Sampler)


def vllm_classes() -> VllmClasses | str:
    """:class:`VllmClasses` of the installed vLLM (cached), or the reason it is unavailable."""
    try:
        return _installed_classes()
    except Exception as e:
        return f"vLLM V2 rejection sampler unavailable: {e!r}"


# --------------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------------


def _short(value: Any) -> str:
    r = repr(value)
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        r = f"<{type(value).__name__} {tuple(value.shape)} {value.dtype}>"
    return r if len(r) <= 60 else r[:57] + "..."


_TABLE_INFO: dict[int, tuple[Mapping[str, Rule], frozenset[str], tuple[tuple[str, Rule], ...]]] = {}
_METHODS_OK: dict[tuple[type, tuple[str, ...]], tuple[Any, ...]] = {}


def _table_info(table: Mapping[str, Rule]) -> tuple[frozenset[str], tuple[tuple[str, Rule], ...]]:
    info = _TABLE_INFO.get(id(table))
    if info is None or info[0] is not table:
        checked = tuple((n, r) for n, r in table.items() if r.harmless is not None)
        info = _TABLE_INFO[id(table)] = (table, frozenset(table), checked)
    return info[1], info[2]


def check_fields(obj: Any, cls_name: str, table: Mapping[str, Rule], series: str) -> str | None:
    """The refusal reason of ``obj``'s instance fields against ``table``, or ``None``.

    A known field failing its rule: ``"<why> (<cls>.<field>=<value>)"``; a field the table does
    not know, with a value that is not :func:`is_off`: ``"unknown <cls> field <field>=<value>
    (not in shardmax's table for vLLM <series>)"``. Per step this costs a key-set comparison and
    the tables' checked rules (every field is looked at only when an unknown one is present)."""
    fields = _instance_fields(obj)
    if fields is None:
        return (
            f"{cls_name} fields unreadable ({type(obj).__name__} has neither __dict__ nor "
            f"__slots__; shardmax's table for vLLM {series} cannot be checked)"
        )
    known, checked = _table_info(table)
    if not fields.keys() <= known:
        for name, value in fields.items():
            if name not in known and not is_off(value):
                return (
                    f"unknown {cls_name} field {name}={_short(value)} (not in shardmax's table "
                    f"for vLLM {series})"
                )
    for name, rule in checked:
        if name in fields:
            value = fields[name]
            assert rule.harmless is not None
            if not rule.harmless(value):
                return f"{rule.why} ({cls_name}.{name}={_short(value)})"
    return None


def _slot_names(cls: type) -> tuple[str, ...]:
    """The attribute names of the ``__slots__`` declared along ``cls``'s MRO (private ones
    mangled, as Python stores them), memoised per class."""
    got = _SLOT_NAMES.get(cls)
    if got is None:
        names = []
        for klass in cls.__mro__:
            declared = vars(klass).get("__slots__", ())
            for name in (declared,) if isinstance(declared, str) else declared:
                if name in ("__dict__", "__weakref__"):
                    continue
                if name.startswith("__") and not name.endswith("__"):
                    name = f"_{klass.__name__.lstrip('_')}{name}"
                names.append(name)
        got = _SLOT_NAMES[cls] = tuple(names)
    return got


_SLOT_NAMES: dict[type, tuple[str, ...]] = {}
_UNSET = object()


def _instance_fields(obj: Any) -> Mapping[str, Any] | None:
    """``obj``'s instance fields: its ``__dict__``, and the set ``__slots__`` of its classes
    (a ``slots=True`` dataclass has no ``__dict__``); ``None`` where it has neither (nothing
    could be checked against the allow-list)."""
    slots = _slot_names(type(obj))
    try:
        fields: Mapping[str, Any] = vars(obj)  # (no copy: the common case, every step)
    except TypeError:
        if not slots:
            return None
        fields = {}
    if slots:
        fields = dict(fields)
        for name in slots:
            value = getattr(obj, name, _UNSET)
            if value is not _UNSET:  # (a slot declared, never set: nothing in effect)
                fields[name] = value
    return fields


def check_methods(cls: type, cls_name: str, known: tuple[str, ...], series: str) -> str | None:
    """The refusal reason of ``cls``'s methods, or ``None``: a base class other than ``object``
    (its methods would be outside the table), a method not in ``known``, or one whose
    ``__module__`` is not the class's (patched from outside vLLM). A class whose attributes are
    the very objects of its last passing check is not walked again."""
    if cls.__mro__[1:] != (object,):
        bases = ", ".join(b.__qualname__ for b in cls.__mro__[1:-1])
        return (
            f"{cls_name} inherits from {bases} (not in shardmax's table for vLLM {series}: "
            "only its own methods are checked)"
        )
    current = tuple(vars(cls).values())
    last = _METHODS_OK.get((cls, known))
    if last is not None and len(last) == len(current) and all(map(operator.is_, last, current)):
        return None
    for name, attr in vars(cls).items():
        fn = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
        if isinstance(fn, property):
            fn = fn.fget
        if not inspect.isfunction(fn):
            continue
        if name not in known:
            return f"unknown {cls_name} method {name} (not in shardmax's table for vLLM {series})"
        if getattr(fn, "__module__", None) != cls.__module__:
            return f"{cls_name}.{name} is patched (defined in {getattr(fn, '__module__', None)})"
    _METHODS_OK[(cls, known)] = current
    return None


def verification_method(rs: Any, spec_config: Any, series: str) -> tuple[str | None, str | None]:
    """``(method, refusal_reason)`` of a rejection sampler and its speculative config.

    The method the sampler's fields implement (``fly_window_size > 0`` -> ``fly``,
    ``use_block_verification`` -> ``block``, ``synthetic_conditional_rates`` set ->
    ``synthetic``, else ``standard``) must agree with ``spec_config.rejection_sample_method``
    (when there is one), be in :data:`VERIFICATION_METHODS` for ``series`` and in
    :data:`REPRODUCED_METHODS`."""
    if not is_off(getattr(rs, "fly_window_size", 0)):
        fields = "fly"
    elif not is_off(getattr(rs, "use_block_verification", False)):
        fields = "block"
    elif getattr(rs, "synthetic_conditional_rates", None) is not None:
        fields = "synthetic"
    else:
        fields = "standard"
    known = VERIFICATION_METHODS.get(
        series, VERIFICATION_METHODS[version.SUPPORTED_VLLM_SERIES[-1]]
    )
    cfg = getattr(spec_config, "rejection_sample_method", None) if spec_config is not None else None
    if cfg is not None and cfg not in known:
        return cfg, (
            f"rejection_sample_method={cfg!r} unknown to shardmax for vLLM {series} "
            f"(known: {', '.join(known)})"
        )
    method = cfg if cfg is not None else fields
    if method not in REPRODUCED_METHODS:
        return method, f"rejection_sample_method={method!r} not reproduced by shardmax"
    if cfg is not None and fields != cfg:
        return method, (
            f"rejection_sample_method={cfg!r} but the rejection sampler's fields implement "
            f"{fields!r}"
        )
    dsm = getattr(spec_config, "draft_sample_method", None) if spec_config is not None else None
    if dsm is not None and dsm != "greedy":
        if dsm not in DRAFT_SAMPLE_METHODS:
            return method, f"draft_sample_method={dsm!r} unknown to shardmax for vLLM {series}"
        return method, f"draft_sample_method={dsm!r} (rejection sampling against draft logits)"
    return method, None


def _exactly(obj: Any, cls: type) -> bool:
    """``type(obj) is cls`` (a subclass is another sampler)."""
    return type(obj) is cls


def step_decision(
    runner: Any,
    input_batch: Any,
    grammar_output: Any,
    *,
    allow_temperature: bool = False,
    allow_nucleus: bool = False,
    classes: VllmClasses | None = None,
) -> Any:
    """``ShardDecision`` for one V2 ``GPUModelRunner.sample`` step (module docstring; spec
    ``vllm-semantics.md`` §5 table): ``StepGate(runner, input_batch, grammar_output,
    classes).decide(allow_temperature, allow_nucleus)``.

    Args:
        runner: vLLM's ``GPUModelRunner`` (fields ``rejection_sampler``, ``batch_sharder``,
            ``speculative_config``, ``adaptive_verification``, ``speculator``, ``model``).
        input_batch: the step's ``InputBatch``; per-request state is read through
            ``idx_mapping_np``.
        grammar_output: ``GrammarOutput`` or ``None``.
        allow_temperature: accept temperature > 0 requests (the ``sharded_verify`` path); vLLM's
            own temperature scaling then does not count as logits processing
            (:func:`_other_logits_processing`).
        allow_nucleus: with ``allow_temperature``, also accept top-k / top-p / min-p requests
            (the plug-in resolves the requests the sharded step flags with vLLM's own kernels).
        classes: the vLLM to check against; default the installed one (:func:`vllm_classes`).

    Returns:
        :class:`shardmax.ShardDecision` (``reason`` names the first failing rule).
    """
    return StepGate(runner, input_batch, grammar_output, classes).decide(
        allow_temperature=allow_temperature, allow_nucleus=allow_nucleus
    )


class StepGate:
    """The allow-list of one V2 step (module docstring), checked once per step: rules 1-5 and the
    per-request values when made, then :meth:`decide` per way of verifying the step (greedy,
    sampled). The hook asks twice for a sampled step -- greedy first, then sampled -- and the
    step's classes, fields and model are walked once for both.

    Args: as :func:`step_decision`'s first four; ``requests``: the step's
    :class:`~shardmax.integrations.vllm.step.StepRequests` where the caller has read them. Reads
    the objects when made: a change to them afterwards is not seen (make one per step)."""

    __slots__ = ("_flags", "_input_batch", "_refusal", "_sampler", "_values")

    def __init__(
        self,
        runner: Any,
        input_batch: Any,
        grammar_output: Any,
        classes: VllmClasses | None = None,
        *,
        requests: Any = None,
    ) -> None:
        self._input_batch, self._sampler = input_batch, None
        self._values: dict[str, Any] = {}
        self._flags: dict[str, Any] = {}
        self._refusal = self._structure(runner, input_batch, grammar_output, classes, requests)

    def _structure(
        self,
        runner: Any,
        input_batch: Any,
        grammar_output: Any,
        classes: VllmClasses | None,
        requests: Any,
    ) -> str | None:
        """Rules 1-5 (the first failing one's reason), then the step's per-request values."""
        if getattr(input_batch, "num_reqs", 0) == 0:
            return "empty batch"
        rs = getattr(runner, "rejection_sampler", None)
        if rs is None or getattr(input_batch, "num_draft_tokens", 0) == 0:
            return "no draft tokens in step"
        if getattr(runner, "batch_sharder", None) is not None:
            return "batch-sharded sampling enabled"
        if classes is None:
            got = vllm_classes()
            if isinstance(got, str):
                return got
            classes = got
        series = classes.series
        if not _exactly(rs, classes.rejection_sampler):
            return f"custom rejection sampler {type(rs).__name__}"
        sampler: Any = getattr(rs, "sampler", None)
        if not _exactly(sampler, classes.sampler):
            return f"custom sampler {type(sampler).__name__}"
        methods = CLASS_METHODS.get(series, CLASS_METHODS[version.SUPPORTED_VLLM_SERIES[-1]])
        for cls, name in (
            (classes.rejection_sampler, "RejectionSampler"),
            (classes.sampler, "Sampler"),
        ):
            reason = check_methods(cls, name, methods[name], series)
            if reason is not None:
                return reason
        _, reason = verification_method(rs, getattr(runner, "speculative_config", None), series)
        if reason is not None:
            return reason
        tables = FIELD_TABLES.get(series, FIELD_TABLES[version.SUPPORTED_VLLM_SERIES[-1]])
        st = sampler.sampling_states
        for obj, name in (
            (rs, "RejectionSampler"),
            (sampler, "Sampler"),
            (st, "SamplingStates"),
            (input_batch, "InputBatch"),
        ):
            reason = check_fields(obj, name, tables[name], series)
            if reason is not None:
                return reason
        if getattr(runner, "adaptive_verification", None) is not None:
            return "adaptive verification enabled (runner.adaptive_verification)"
        model = runner.model
        if not hasattr(model, "compute_logits_local"):
            return f"{type(model).__name__} has no compute_logits_local"
        lm_head = step.find_lm_head(model)
        if lm_head is None:
            return f"{type(model).__name__} has no lm_head"
        _, _, refusal = step.shard_geometry(lm_head)
        if refusal is not None:
            return str(refusal)
        # the requests' values (the rows of ``idx_mapping_np``, a NumPy array each), as the
        # hook read them for its routing or read here
        idx = input_batch.idx_mapping_np
        self._sampler = sampler
        if requests is None:
            requests = step.StepRequests(runner, input_batch)
        self._values = requests.arrays
        speculator = getattr(runner, "speculator", None)
        self._flags = {
            "returns_logprobs": st.max_num_logprobs(idx) != -1,
            "has_structured_output": grammar_output is not None,
            "has_draft_logits": getattr(speculator, "draft_logits", None) is not None,
            "adaptive_verification": bool(rs.enable_adaptive_verification),
            "block_verification": bool(rs.use_block_verification),
            "watermark": rs.watermark_key is not None,
            "compute_nans": bool(sampler.compute_nans),
            "return_sampling_mask": bool(sampler.return_sampling_mask),
            "num_draft_tokens": int(input_batch.num_draft_tokens),
        }
        return None

    def decide(self, *, allow_temperature: bool = False, allow_nucleus: bool = False) -> Any:
        """The step's :class:`shardmax.ShardDecision` for verifying it greedily (default) or
        sampled (``allow_temperature``; ``allow_nucleus``: with top-k / top-p / min-p rows):
        the structural refusal, else rule 6 (:func:`shardmax.can_shard_verify` on the step's
        values)."""
        from shardmax import ShardDecision, can_shard_verify

        if self._refusal is not None:
            return ShardDecision(False, self._refusal)
        idx = self._input_batch.idx_mapping_np
        sampler: Any = self._sampler
        if allow_temperature:
            has_lp = _other_logits_processing(sampler, idx, self._values)
        else:
            has_lp = _any_at(sampler.needs_logits_processing, idx)
        return can_shard_verify(
            **self._values,
            **self._flags,
            has_logits_processors=has_lp,
            allow_temperature=allow_temperature,
            allow_nucleus=allow_nucleus and allow_temperature,
        )


_KNOWN_LOGITS_PROCESSORS = ("LogitBiasState", "PenaltiesState", "BadWordsState")


def _any_at(values: Any, idx: Any) -> bool:
    """Whether any of ``values[idx]`` is set (``take`` on a NumPy array: a third of the host time
    of fancy indexing and ``np.any``)."""
    import numpy as np

    if isinstance(values, np.ndarray):
        return bool(values.take(idx).any())
    return bool(np.any(values[idx]))


def _other_logits_processing(sampler: Any, idx: Any, values: Mapping[str, Any]) -> bool:
    """Whether any request of the step needs logits processing OTHER than vLLM's temperature.

    vLLM 0.32 / 0.33's ``Sampler.needs_logits_processing[req]`` ORs ``SamplingStates.add_request``
    (``T != 0 and (T != 1 or top-k/top-p/min-p active)``) with the thinking budget and every
    logits processor, so a plain ``T = 0.8`` request has it set. This re-derives the
    sampling-states term from the state arrays (``values``: the step's ``temperatures``,
    ``top_k``, ``top_p``, ``min_p`` and ``vocab_size``, as :class:`StepGate` took them) and, for
    requests where it alone could explain the flag, checks the other contributors' own
    per-request state (logit bias / allowed ids / min_tokens, penalties, bad words, thinking
    budget). Unknown (custom) processors or missing fields count as processing (conservative).
    """
    import numpy as np

    needs = np.asarray(sampler.needs_logits_processing[idx], dtype=bool)
    if not needs.any():
        return False
    temp = values["temperatures"]
    sampling_term = (temp != 0.0) & (
        (temp != 1.0)
        | (values["min_p"] != 0.0)
        | (values["top_k"] != values["vocab_size"])
        | (values["top_p"] != 1.0)
    )
    if bool((needs & ~sampling_term).any()):
        return True  # flagged by something other than the sampling states
    try:
        procs = list(sampler.logits_processors)
        if sorted(type(p).__name__ for p in procs) != sorted(_KNOWN_LOGITS_PROCESSORS):
            return True  # custom logits processors: cannot tell per request
        for p in procs:
            name = type(p).__name__
            if name == "LogitBiasState" and _any_at(p.use_logit_bias, idx):
                return True
            if name == "PenaltiesState" and _any_at(p.use_penalty, idx):
                return True
            if name == "BadWordsState" and _any_at(p.num_bad_words.np > 0, idx):
                return True
        tb = sampler.thinking_budget_state
        if getattr(tb, "enabled", False) and _any_at(tb.use_thinking_budget, idx):
            return True
    except Exception:
        return True
    return False
