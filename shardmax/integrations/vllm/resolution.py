"""Per-request resolution at a fixed capacity, replayed from CUDA graphs.

A sampled step resolves the requests it flagged with vLLM's own chain on their gathered rows
(:meth:`~shardmax.integrations.vllm.chain.NativeChain.verify_requests`). Launched eagerly, that
chain costs what vLLM's whole sampling step costs on the host -- an fp32 copy, the temperature /
top-k / top-p launches (seven for the split top-p pipeline), ``rejection_sample``'s four and
``get_num_sampled_and_rejected``, plus the small gathers of the requests' indices: ~1 ms of
Python on the H200's host for one flagged request, on 40-60 % of realistic top-p steps.

:class:`CapturedResolution` runs the same chain on a **fixed capacity**: ``R`` request slots and
``R (K + 1)`` logits rows in static buffers, the flagged requests in the first slots, the rest
padding. The chain on those buffers is captured once per capacity and per set of the chunk's
host decisions (vLLM's gates and top-p pipeline) and replayed afterwards; per step the host
writes one index table (rows and requests to take, the sub-batch's ``cu_num_logits``), copies it
to the device, fills the buffers and replays. :meth:`CapturedResolution.verify_resolution` (what
:func:`~shardmax.ops.resolve.resolve_requests` calls) fills them with one ``resolve_fill``
launch: the gathered rows, the synthetic rows of the certified ones (built there, never as a
tensor of their own) and the sub-batch's indices; :meth:`CapturedResolution.verify_requests`
takes rows already built and fills with a few small copies.

Why a padded sub-batch gives each real request exactly vLLM's answer inside its whole step:

* every kernel of the chain computes a row from that row (the fp32 copy, temperature, min-p, the
  monolithic top-k/top-p kernel, ``rejection_sample``'s statistics) or a request from its rows
  (acceptance, the keyed Gumbel of ``(seed, pos, token)``, the counts), exactly as
  :meth:`~shardmax.integrations.vllm.chain.NativeChain.verify_requests` relies on;
* the chunk's host decisions -- the fp32 copy, which launches run, which top-k/top-p rows are
  passed, ``has_topp_only_rows`` -- are taken from the WHOLE chunk (``_gates``) and are part of
  the capture's key;
* vLLM's split top-p pipeline (CUDA, at most 64 rows) masks a row as a function of the row and
  of its split count ``S(rows, V, #SMs)`` (``_topp_split_count``): a capacity is used only when
  its padded row count makes vLLM pick the chunk's own pipeline and split count (the next larger
  capacity otherwise); a chunk of more than 64 rows keeps the monolithic kernel for the fewer
  padded rows, as the eager resolution does;
* padding rows and requests point at the first real request's indices and slot (in range for
  every kernel); their outputs are never read. Their logits are one token far above the rest:
  the cheapest row for vLLM's top-p search (a flat row, e.g. zeros, is its slowest -- measured:
  ~0.7 ms of GPU time for one padded request at 96 rows).

Everything the graph reads by address and does not own -- vLLM's per-slot state (temperature,
seeds, top-k / top-p / min-p, ``prefill_len``), and vLLM's module-level workspaces the kernels
use (kept alive here) -- is part of the key, so a moved buffer is captured anew rather than read
stale. Steps that do not fit (several chunks, more flagged requests than the largest capacity,
a synthetic-method step, whose capture has not been checked on the GPU) and every step off CUDA
run :meth:`NativeChain.verify_requests` eagerly; on the CPU the padded sub-batch itself runs
eagerly (``padded=True``), so its exactness is tested by the interpreter suite.
"""

from __future__ import annotations

import inspect
import itertools
import threading
import warnings
from collections import OrderedDict
from dataclasses import replace
from typing import Any, NamedTuple

import numpy as np
import torch

from shardmax.integrations.vllm.chain import (
    ChainOutput,
    NativeChain,
    _Chunk,
    max_chunk_logits,
    request_chunks,
)
from shardmax.ops.resolve import (
    SYNTHETIC_GAP,
    SYNTHETIC_MAX_TEMPERATURE,
    ResolutionRows,
    apply_resolved,
    check_requests,
    resolution_logits,
    synthetic_sources,
)
from shardmax.ops.sampled import VerifyResult
from shardmax.runtime import kernels
from shardmax.runtime.host import stage, stage_into
from shardmax.runtime.pools import GraphPool

__all__ = [
    "CAPACITIES",
    "CapturedResolution",
    "apply_answers",
    "fitting_capacity",
    "gates_rows",
    "sub_chain",
]

CAPACITIES = (1, 2, 4, 8, 16, 32)
"""Request capacities of the captured sub-batches (flagged requests per step; more run eagerly).
Realistic top-p steps flag 2-5 % of their requests (README): one or two at 32-160 rows."""
MAX_GRAPHS = 32
"""Captured (capacity, decisions) pairs kept per resolver (least recently used out)."""
_WORKSPACES = ("_TRITON_BUFFER_CACHE", "_TRITON_TABLE_CACHE", "_TRITON_SPLIT_CACHE")
"""vLLM's top-k/top-p workspaces (module-level caches): a capture holds what they held."""


PAD_PEAK = 30.0
"""The padding rows' one logit above the rest (``exp(-30) * 262144 < 3e-8``: a nucleus of one
token at any top-p)."""
_STEP_ARGS = frozenset(inspect.signature(NativeChain.verify_requests).parameters) - {
    "self", "rows_logits", "requests",
}  # fmt: skip
"""The step's arguments :meth:`NativeChain.verify_requests` takes."""
_PERSISTENT = ("temperature_gpu", "seed_gpu", "top_k_gpu", "top_p_gpu", "min_p_gpu", "prefill_len")
"""vLLM's per-slot tensors the captured chain reads by address (part of the key)."""
_INDEXED = ("draft_sampled", "pos", "expanded_idx_mapping", "expanded_local_pos", "idx_mapping",
            "seq_lens", "cu_num_logits")  # fmt: skip
"""The step's tensors gathered into the static buffers each step (their dtypes: the key)."""


class _Key(NamedTuple):
    """What a captured chain depends on besides its buffers' contents."""

    rows: int  # padded logits rows
    reqs: int  # request slots
    k: int
    vocab: int
    dtype: torch.dtype
    device: str
    dtypes: tuple[torch.dtype, ...]  # of the step's _INDEXED tensors
    gates: Any  # NativeChain._Gates, rows set to what decides vLLM's pipeline
    pipeline: str
    fp64: bool
    persistent: tuple[Any, ...]  # (name, address, dtype, shape) of the _PERSISTENT tensors


class _Rows(NamedTuple):
    """What :meth:`CapturedResolution._plan` reads of the rows' tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
FILL_WORDS = 5
"""int64 words per row of ``resolve_fill``'s row table (its ``WORDS``)."""
APPLY_WORDS = 6
"""int64 words of ``resolve_apply``'s part of the table: n, then five output addresses."""
_APPLY_DTYPES = (torch.int64, torch.int32, torch.int32, torch.bool, torch.int8)
"""The dtypes ``resolve_apply`` writes: VerifyResult's sampled, num_sampled, num_rejected,
fallback, reason."""


def _fill_table(
    plan: tuple[Any, tuple[int, int], np.ndarray, int, int],
    rows: ResolutionRows,
    requests: np.ndarray,
    step: dict[str, Any],
    sampled: torch.Tensor,
    gathered: torch.Tensor,
) -> np.ndarray:
    """The int64 table of ``resolve_fill`` for a planned step: the rows' sources
    (:func:`~shardmax.ops.resolve.synthetic_sources`, checked there as for
    :func:`~shardmax.ops.resolve.resolution_logits`), rows past ``m`` left as they are (source
    ``-3``: :meth:`CapturedResolution._fill_kernel` marks the stale ones), then the plan's
    request table (``req_sel``, ``cu``)."""
    _, (cap_rows, _), index, _, m = plan
    src = synthetic_sources(
        rows, requests, step["cu_num_logits_np"], step["idx_mapping_np"],
        step["draft_sampled"].shape[0], gathered.shape[0], tuple(sampled.shape),
    )  # fmt: skip
    row_sel = index[:cap_rows]
    table = np.empty((cap_rows, FILL_WORDS), dtype=np.int64)
    table[:, 0] = -3
    table[:, 1] = np.minimum(row_sel + 1, step["draft_sampled"].shape[0] - 1)
    table[:, 2] = -1
    table[:, 3] = int(np.asarray(step["idx_mapping_np"])[int(np.asarray(requests)[0])])
    table[:m, :4] = np.stack([src.gathered_at, src.draft_at, src.sampled_at, src.slot], axis=1)
    table[:, 4] = row_sel
    return np.concatenate([table.reshape(-1), index[cap_rows:]])  # then req_sel, cu


def _check_result(result: VerifyResult, step: dict[str, Any]) -> None:
    """``result`` holds the step's outputs: ``sampled`` ``[num_reqs, K + 1]``, the counts and
    flags ``[num_reqs]`` (``num_reqs`` and K of the step's arguments)."""
    num_reqs = len(step["cu_num_logits_np"]) - 1
    width = int(step["num_speculative_steps"]) + 1
    got = [tuple(t.shape) for t in result[:5]]
    if got != [(num_reqs, width)] + [(num_reqs,)] * 4:
        raise ValueError(
            f"result: expected sampled [{num_reqs}, {width}] and num_sampled / num_rejected / "
            f"fallback / reason [{num_reqs}] (the step's {num_reqs} requests, K = {width - 1}), "
            f"got {[list(g) for g in got]}"
        )


def _apply_targets(into: VerifyResult | None, n: int, device: torch.device) -> np.ndarray | None:
    """``resolve_apply``'s table words for writing ``n`` answers into ``into`` (n, then its
    sampled / num_sampled / num_rejected / fallback / reason addresses), or None when ``into``
    is None or its tensors are not what the kernel writes (contiguous, on ``device``, of
    :data:`_APPLY_DTYPES`): then the caller applies the answers itself. Their shapes are the
    step's (:func:`_check_result`, which :meth:`CapturedResolution.resolve` runs first)."""
    if into is None:
        return None
    outs = (into.sampled, into.num_sampled, into.num_rejected, into.fallback, into.reason)
    for t, dtype in zip(outs, _APPLY_DTYPES, strict=True):
        if t.dtype != dtype or t.device != device or not t.is_contiguous():
            return None
    return np.array([n, *(t.data_ptr() for t in outs)], dtype=np.int64)


def _state(step: dict[str, Any]) -> Any:
    """The chain's per-slot sampling state of a step's arguments (no checks)."""
    return NativeChain._State(
        step["temperature_gpu"], step["temperature_np"], step.get("top_k_gpu"),
        step.get("top_k_np"), step.get("top_p_gpu"), step.get("top_p_np"), step.get("min_p_gpu"),
        step.get("min_p_np"),
    )  # fmt: skip


class _Sub:
    """The static buffers of one capacity and their captured chain (or none: eager)."""

    def __init__(self, rows: int, reqs: int, like: dict[str, torch.Tensor]) -> None:
        self.rows, self.reqs = rows, reqs
        dev = like["logits"].device
        vocab = like["logits"].shape[1]
        # padding rows: one token far above the rest (every kernel's cheapest row: vLLM's top-p
        # search ends at once); a row of equal logits would be its slowest (the whole vocabulary
        # kept, every pivot round run)
        self.pad_row = torch.zeros((1, vocab), dtype=like["logits"].dtype, device=dev)
        self.pad_row[0, 0] = PAD_PEAK
        self.logits = self.pad_row.expand(rows, vocab).contiguous()
        self.dirty = 0  # rows [0, dirty) may hold an earlier step's rows
        self.row_index = {
            n: torch.zeros(rows, dtype=like[n].dtype, device=dev)
            for n in ("draft_sampled", "pos", "expanded_idx_mapping", "expanded_local_pos")
        }
        self.idx_mapping = torch.zeros(reqs, dtype=like["idx_mapping"].dtype, device=dev)
        self.seq_lens = torch.zeros(reqs, dtype=like["seq_lens"].dtype, device=dev)
        self.cu = torch.zeros(reqs + 1, dtype=like["cu_num_logits"].dtype, device=dev)
        # the argument table the fill and apply kernels read (one host->device copy per step):
        # resolve_fill's rows, req_sel, cu, then resolve_apply's words (n = 0: apply nothing)
        self.req_off = rows * FILL_WORDS
        self.apply_off = self.req_off + 2 * reqs + 1
        self.table = torch.zeros(self.apply_off + APPLY_WORDS, dtype=torch.int64, device=dev)
        self.graph: Any = None
        self.out: ChainOutput | None = None
        self.keep: list[Any] = []  # what the graph reads and does not own
        self.failed = False  # a capture failed: this key runs the padded chain eagerly
        self.steps = 0


class CapturedResolution:
    """vLLM's chain on the flagged requests of a step, at a fixed capacity, from CUDA graphs.

    Drop-in for :meth:`NativeChain.verify_requests` (same arguments, same answers): the plug-in's
    resolver (:func:`shardmax.integrations.vllm.step.resolver`).

    Args:
        chain: vLLM's chain (the installed vLLM's, or an extracted tree's).
        capacities: request capacities, increasing (default :data:`CAPACITIES`).
        padded: run the padded sub-batch off CUDA too (eagerly; tests). Default: only on CUDA.
        capture_after: a (capacity, decisions) pair is captured on its ``capture_after``-th step
            (the earlier ones run the padded chain eagerly; the first also warms vLLM's caches).

    The outputs of a replayed step are the graph's static tensors: valid until the next call.

    Raises:
        ValueError: capacities not increasing positive integers; ``capture_after < 1``.
    """

    def __init__(
        self,
        chain: NativeChain,
        *,
        capacities: tuple[int, ...] = CAPACITIES,
        padded: bool = False,
        capture_after: int = 2,
    ) -> None:
        caps = tuple(int(c) for c in capacities)
        if not caps or caps[0] < 1 or any(b <= a for a, b in itertools.pairwise(caps)):
            raise ValueError(f"capacities: expected increasing positive integers, got {capacities}")
        if capture_after < 1:
            raise ValueError(f"capture_after: expected >= 1, got {capture_after}")
        self.chain = chain
        self.capacities = caps
        self.padded = padded
        self.capture_after = capture_after
        self._subs: OrderedDict[_Key, _Sub] = OrderedDict()
        self._pool = GraphPool()
        self._lock = threading.Lock()
        self.stats = {"captured": 0, "replayed": 0, "padded_eager": 0, "eager": 0}
        """Steps by path: replayed from a graph, padded but eager (before capture, or off CUDA),
        eager (did not fit a capacity); ``captured`` counts graphs."""

    # ---- the call --------------------------------------------------------------------------

    def verify_requests(
        self, rows_logits: torch.Tensor, requests: np.ndarray, **step: Any
    ) -> ChainOutput:
        """vLLM's answer for ``requests`` of a step: :meth:`NativeChain.verify_requests`'s
        arguments and result (``checks`` is honoured: with it every argument is checked first,
        by the chain's own checks; the refusals of unsupported features and the argument names
        are checked always, as by the chain).

        Raises:
            TypeError: an argument :meth:`NativeChain.verify_requests` does not take, or
                ``rows_logits`` not a tensor.
            NotImplementedError / ValueError: as :meth:`NativeChain.verify_requests`.
        """
        unknown = sorted(set(step) - _STEP_ARGS)
        if unknown:
            raise TypeError(f"verify_requests: unexpected arguments {unknown}")
        if not isinstance(rows_logits, torch.Tensor):
            raise TypeError(
                f"rows_logits: expected a torch.Tensor, got {type(rows_logits).__name__}"
            )
        self.chain._refuse_unsupported(
            None, step.get("rejection_sample_method", "standard"),
            step.get("synthetic_conditional_rates"), False, None, None,
        )  # fmt: skip
        device = rows_logits.device
        if not (self.padded or device.type == "cuda"):
            self.stats["eager"] += 1
            return self.chain.verify_requests(rows_logits, requests, **step)
        if step.get("checks", True):  # the chain's checks, on the real sub-batch; cheap path after
            self.chain.verify_requests(rows_logits[:0], np.zeros(0, np.int64), **step)
        plan = self._plan(rows_logits, requests, step)
        if plan is None:
            self.stats["eager"] += 1
            return self.chain.verify_requests(rows_logits, requests, **step)
        key, sub_args, index, n, m = plan

        def fill(sub: _Sub) -> None:
            self._fill(sub, rows_logits, index, m, step)

        return self._run(key, sub_args, n, rows_logits, step, fill)

    def verify_resolution(
        self,
        gathered: torch.Tensor,
        rows: ResolutionRows,
        requests: np.ndarray,
        sampled: torch.Tensor,
        **step: Any,
    ) -> ChainOutput:
        """:meth:`verify_requests` on the rows :func:`~shardmax.ops.resolve.resolution_logits`
        would build -- the gathered ones and synthetic rows -- without building them apart: when
        the step fits a capacity, one ``resolve_fill`` launch writes the gathered rows, the
        synthetic rows and the sub-batch's indices straight into the capacity's static buffers
        (one host->device copy of its table before it), then the captured chain replays;
        otherwise :func:`~shardmax.ops.resolve.resolution_logits` and :meth:`verify_requests`.

        Args:
            gathered: ``[m', V]`` the gathered rows (``rows.rows[rows.gather]``; model dtype,
                ``stride(-1) == 1``).
            rows: the resolution's rows (:func:`~shardmax.ops.resolve.resolution_rows`).
            requests: int ``[n]`` the resolved requests.
            sampled: the step's ``VerifyResult.sampled`` (``[num_reqs, K + 1]`` int64): the
                tokens of the synthetic draw rows.
            step: :meth:`NativeChain.verify_requests`' step arguments.

        Returns:
            As :meth:`verify_requests`.

        Raises:
            TypeError / NotImplementedError / ValueError: as :meth:`verify_requests` and
                :func:`~shardmax.ops.resolve.resolution_logits`.
        """
        return self._resolution(gathered, rows, requests, sampled, None, step)[0]

    def resolve(
        self,
        result: VerifyResult,
        gathered: torch.Tensor,
        rows: ResolutionRows,
        requests: np.ndarray,
        **step: Any,
    ) -> ChainOutput:
        """:meth:`verify_resolution` with the answers written into ``result`` (in place, flags
        of the resolved requests cleared), as :func:`~shardmax.ops.resolve.apply_resolved`
        writes them: where the step fits a capacity, by a ``resolve_apply`` launch at the end of
        the captured chain (the step's output addresses travel in the capacity's table), so a
        replayed resolution is one host->device copy, one ``resolve_fill`` launch and one graph
        replay; otherwise by :func:`~shardmax.ops.resolve.apply_resolved`.

        Args:
            result: the step's outputs (:class:`~shardmax.ops.sampled.VerifyResult`; its
                ``sampled`` holds the synthetic draw rows' tokens).
            gathered, rows, requests, step: as :meth:`verify_resolution`.

        Returns:
            The resolved requests' answers, as :meth:`verify_resolution` (already written).

        Raises:
            ValueError: ``result``'s tensors not ``[num_reqs, K + 1]`` / ``[num_reqs]`` for the
                step's requests and K (named, with the shapes); otherwise as
                :meth:`verify_resolution` and :func:`~shardmax.ops.resolve.apply_resolved`.
        """
        _check_result(result, step)
        out, applied = self._resolution(gathered, rows, requests, result.sampled, result, step)
        if not applied:
            apply_resolved(result, requests, out[0], out[1], out[2])
        return out

    def _resolution(
        self,
        gathered: torch.Tensor,
        rows: ResolutionRows,
        requests: np.ndarray,
        sampled: torch.Tensor,
        into: VerifyResult | None,
        step: dict[str, Any],
    ) -> tuple[ChainOutput, bool]:
        """:meth:`verify_resolution`; with ``into``, also its answers written into ``into``
        by the captured ``resolve_apply`` where the step fits a capacity. Returns ``(answers,
        written into `into`)``."""
        unknown = sorted(set(step) - _STEP_ARGS)
        if unknown:
            raise TypeError(f"verify_resolution: unexpected arguments {unknown}")
        if not isinstance(gathered, torch.Tensor) or not isinstance(sampled, torch.Tensor):
            raise TypeError("gathered, sampled: expected torch.Tensors")
        cu_np = step["cu_num_logits_np"]

        def built() -> torch.Tensor:  # the rows apart (and every check of them)
            return resolution_logits(
                gathered, rows.gather, requests, cu_np, step["idx_mapping_np"],
                step["draft_sampled"], step["temperature_gpu"], rows.draw, sampled,
            )  # fmt: skip

        device = gathered.device
        if (
            not (self.padded or device.type == "cuda")
            or gathered.dim() != 2
            or gathered.stride(-1) != 1
            or bool(rows.gather.all())
            or sampled.dim() != 2
            or not sampled.is_contiguous()
            or int(step["num_speculative_steps"]) < 1  # resolve_fill writes cu from rows > reqs
            or gathered.dtype not in _DTYPE_NAMES
        ):
            return self.verify_requests(built(), requests, **step), False
        if step.get("checks", True):
            self.chain.verify_requests(gathered[:0], np.zeros(0, np.int64), **step)
        m = int(rows.rows.size)
        like = _Rows((m, int(gathered.shape[1])), gathered.dtype, gathered.device)
        plan = self._plan(like, requests, step)
        if plan is None:
            return self.verify_requests(built(), requests, **step), False
        table = _fill_table(plan, rows, requests, step, sampled, gathered)
        key, sub_args, _, n, _ = plan
        outputs = _apply_targets(into, n, device)

        def fill(sub: _Sub) -> None:
            self._fill_kernel(sub, gathered, table, m, step, sampled, outputs)

        return self._run(key, sub_args, n, gathered, step, fill), outputs is not None

    def _run(
        self,
        key: _Key,
        sub_args: tuple[int, int],
        n: int,
        like: torch.Tensor,
        step: dict[str, Any],
        fill: Any,
    ) -> ChainOutput:
        """Fill the capacity's buffers (``fill(sub)``), then replay its graph (capturing it on
        the ``capture_after``-th step on CUDA) or run the padded chain eagerly."""
        device = like.device
        with self._lock:
            sub = self._sub(key, sub_args, {"logits": like, **step})
            fill(sub)
            sub.steps += 1
            if (
                sub.graph is None
                and not sub.failed
                and device.type == "cuda"
                and sub.steps >= self.capture_after
            ):
                self._capture(sub, key, step)
            if sub.graph is not None:
                sub.graph.replay()
                self.stats["replayed"] += 1
            else:
                sub.out = self._body(sub, key, step)
                self.stats["padded_eager"] += 1
            out = sub.out
            assert out is not None
            return ChainOutput(out.sampled[:n], out.num_sampled[:n], out.num_rejected[:n])

    # ---- planning (host only) ----------------------------------------------------------------

    def _plan(
        self, rows_logits: torch.Tensor | _Rows, requests: np.ndarray, step: dict[str, Any]
    ) -> tuple[_Key, tuple[int, int], np.ndarray, int, int] | None:
        """(key, (rows, reqs) capacity, the packed host index array, n, m) or None: eager.
        ``rows_logits``: the rows' tensor, or a :class:`_Rows` of its shape, dtype, device."""
        if step.get("synthetic_conditional_rates") is not None:
            return None  # not captured on the GPU checks: the eager chain
        chain = self.chain
        vocab = int(rows_logits.shape[1])
        cu_np = np.asarray(step["cu_num_logits_np"], dtype=np.int64)
        num_reqs = len(cu_np) - 1
        req = check_requests(requests, num_reqs)
        n = int(req.size)
        if n == 0 or n > self.capacities[-1]:
            return None
        k = int(step["num_speculative_steps"])
        limit = chain.max_chunk_rows or max_chunk_logits(vocab)
        chunks = request_chunks(cu_np, limit)
        home = [(s, e) for s, e in chunks if int(req[0]) >= s and int(req[0]) < e]
        start, end = home[0]
        if int(req[-1]) >= end:
            return None  # flagged requests in several chunks
        chunk_rows = int(cu_np[end] - cu_np[start])
        state = _state(step)
        slots = np.asarray(step["idx_mapping_np"])[start:end]
        gates = NativeChain._gates(slots, state, vocab, chunk_rows)
        pipeline = chain.topp_pipeline_for(
            chunk_rows, top_k_active=gates.do_k, top_p_active=gates.do_p,
            has_topp_only_rows=gates.only_p, device_type=rows_logits.device.type,
        )  # fmt: skip
        cap = self._capacity(n, k, chunk_rows, vocab, pipeline, rows_logits.device)
        if cap is None:
            return None
        reqs = cap
        rows = cap * (k + 1)
        sizes = cu_np[1:] - cu_np[:-1]
        m = int(sizes[req].sum())
        if rows_logits.shape[0] != m:
            raise ValueError(
                f"rows_logits: expected the {m} logits rows of the {n} requests, got "
                f"{list(rows_logits.shape)}"
            )
        row_of = np.concatenate([np.arange(cu_np[r], cu_np[r + 1]) for r in req])
        first = int(cu_np[req[0]])
        row_sel = np.full(rows, first, dtype=np.int64)
        row_sel[:m] = row_of
        req_sel = np.full(reqs, int(req[0]), dtype=np.int64)
        req_sel[:n] = req
        cu = np.empty(reqs + 1, dtype=np.int64)
        cu[: n + 1] = np.concatenate([[0], np.cumsum(sizes[req])])
        cu[n + 1 :] = m + np.arange(1, reqs - n + 1)  # one row per padding request
        index = np.concatenate([row_sel, req_sel, cu])
        persistent = tuple(
            (name, t.data_ptr(), t.dtype, tuple(t.shape))
            for name in _PERSISTENT
            if (t := step.get(name)) is not None
        )
        dtypes = tuple(step[name].dtype for name in _INDEXED)
        # the chunk's row count matters to vLLM only through the pipeline it picks: the split
        # pipeline runs on the padded rows (same split count), a chunk over the split threshold
        # keeps the monolithic kernel (the chain sets the threshold to 0 for the call), a
        # smaller one runs as it would
        rows_key = gates_rows(chain, pipeline, rows, chunk_rows)
        key = _Key(
            rows, reqs, k, vocab, rows_logits.dtype, str(rows_logits.device), dtypes,
            replace(gates, rows=rows_key), pipeline, bool(step.get("use_fp64_gumbel", False)),
            persistent,
        )  # fmt: skip
        return key, (rows, reqs), index, n, m

    def _capacity(
        self, n: int, k: int, chunk_rows: int, vocab: int, pipeline: str, device: torch.device
    ) -> int | None:
        """The smallest of the capacities that fits (:func:`fitting_capacity`)."""
        return fitting_capacity(self.chain, self.capacities, n, k, chunk_rows, vocab, pipeline,
                                device)  # fmt: skip

    # ---- buffers, body, capture ------------------------------------------------------------

    def _sub(self, key: _Key, cap: tuple[int, int], like: dict[str, Any]) -> _Sub:
        sub = self._subs.get(key)
        if sub is None:
            if len(self._subs) >= MAX_GRAPHS:
                self._subs.popitem(last=False)
            sub = self._subs[key] = _Sub(cap[0], cap[1], like)
        self._subs.move_to_end(key)
        return sub

    def _fill(
        self, sub: _Sub, rows_logits: torch.Tensor, index: np.ndarray, m: int, step: dict
    ) -> None:
        """The step's rows and indices into ``sub``'s buffers (one host->device copy, then
        device gathers in stream order: no host sync)."""
        idx = stage(index, rows_logits.device)
        rows, reqs = sub.rows, sub.reqs
        row_sel, req_sel, cu = idx[:rows], idx[rows : rows + reqs], idx[rows + reqs :]
        sub.logits[:m].copy_(rows_logits)
        if sub.dirty > m:  # an earlier step's rows back to padding
            sub.logits[m : sub.dirty].copy_(sub.pad_row.expand(sub.dirty - m, -1))
        sub.dirty = m
        for name, buf in sub.row_index.items():
            torch.index_select(step[name], 0, row_sel, out=buf)
        torch.index_select(step["idx_mapping"], 0, req_sel, out=sub.idx_mapping)
        torch.index_select(step["seq_lens"], 0, req_sel, out=sub.seq_lens)
        sub.cu.copy_(cu)
        sub.table[sub.apply_off].fill_(0)  # resolve_apply: nothing to write on this path

    def _fill_kernel(
        self,
        sub: _Sub,
        gathered: torch.Tensor,
        table: np.ndarray,
        m: int,
        step: dict[str, Any],
        sampled: torch.Tensor,
        outputs: np.ndarray | None = None,
    ) -> None:
        """:meth:`_fill` for :meth:`verify_resolution`: the table (:func:`_fill_table`, then
        ``resolve_apply``'s words: ``outputs``, or n = 0) into ``sub.table`` (one host->device
        copy), then one ``resolve_fill`` launch builds the gathered and synthetic rows in
        ``sub.logits`` (an earlier step's rows past ``m`` back to padding) and gathers the
        sub-batch's indices."""
        rows, reqs = sub.rows, sub.reqs
        words = table[: rows * FILL_WORDS].reshape(rows, FILL_WORDS)  # a view of the table
        words[m : sub.dirty, 0] = -2
        sub.dirty = m
        apply = outputs if outputs is not None else np.zeros(APPLY_WORDS, dtype=np.int64)
        stage_into(sub.table, np.concatenate([table, apply]))
        idx = sub.table
        vocab = int(sub.logits.shape[1])
        src = gathered if gathered.shape[0] else sub.logits
        name = f"resolve_fill_{_DTYPE_NAMES[gathered.dtype]}"
        block = int(kernels.load(name).CONSTEXPRS["BLOCK"])  # the template's (a copy kernel)
        kernels.kernel(name)(
            (rows, -(-vocab // block)), sub.logits, src, idx, step["draft_sampled"],
            sampled, step["temperature_gpu"], step["pos"], step["expanded_idx_mapping"],
            step["expanded_local_pos"], step["idx_mapping"], step["seq_lens"],
            sub.row_index["draft_sampled"], sub.row_index["pos"],
            sub.row_index["expanded_idx_mapping"], sub.row_index["expanded_local_pos"],
            sub.idx_mapping, sub.seq_lens, sub.cu, vocab, sub.logits.stride(0), src.stride(0),
            reqs, GAP=SYNTHETIC_GAP, T_MAX=SYNTHETIC_MAX_TEMPERATURE, PAD=PAD_PEAK, BLOCK=block,
        )  # fmt: skip

    def _body(self, sub: _Sub, key: _Key, step: dict[str, Any]) -> ChainOutput:
        """The chain on ``sub``'s buffers (:func:`sub_chain`)."""
        return sub_chain(self.chain, sub, key.gates, key.k, step)

    def _capture(self, sub: _Sub, key: _Key, step: dict[str, Any]) -> None:
        """Capture the chain on ``sub`` (its buffers already filled; the earlier padded eager
        run compiled vLLM's kernels and filled its caches), holding vLLM's workspaces."""
        mod = self.chain.modules.topk_topp
        pool = self._pool.handle(sub.logits.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._body(sub, key, step)  # warm-up on the capture stream (allocator, caches)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
                out = self._body(sub, key, step)
        except Exception as e:  # a launch that cannot be captured: this key stays eager
            sub.failed = True
            warnings.warn(
                f"shardmax: CUDA-graph capture of the resolution failed ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:200] if str(e) else ''}); it runs eagerly",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        sub.out = out
        sub.keep = [dict(getattr(mod, name, {})) for name in _WORKSPACES]
        sub.graph = graph
        self.stats["captured"] += 1


def fitting_capacity(
    chain: NativeChain,
    capacities: tuple[int, ...],
    n: int,
    k: int,
    chunk_rows: int,
    vocab: int,
    pipeline: str,
    device: torch.device,
) -> int | None:
    """The smallest of ``capacities`` (increasing) holding ``n`` requests whose ``capacity * (K
    + 1)`` padded rows get vLLM's top-p pipeline of the chunk (``pipeline``, of
    ``chunk_rows`` rows): any capacity for the monolithic kernel or none; for the split pipeline
    at most vLLM's split threshold and the chunk's own split count. None: no capacity fits."""
    mod = chain.modules.topk_topp
    for cap in capacities:
        if cap < n:
            continue
        rows = cap * (k + 1)
        if "split" not in pipeline:
            return cap
        if rows > mod._SPLIT_MAX_BATCH:
            return None
        mine = _split_count(mod, rows, vocab, device)
        if rows == chunk_rows or (
            mine is not None and mine == _split_count(mod, chunk_rows, vocab, device)
        ):
            return cap
    return None


def gates_rows(chain: NativeChain, pipeline: str, rows: int, chunk_rows: int) -> int:
    """The row count a padded sub-batch of ``rows`` rows gives vLLM's gates (``_Gates.rows``)
    so that its chain takes the chunk's pipeline: the chunk's row count matters to vLLM only
    through the pipeline it picks -- the split pipeline runs on the padded rows (same split
    count, :func:`fitting_capacity`), a chunk over the split threshold keeps the monolithic
    kernel (the chain sets the threshold to 0 for the call), a smaller one runs as it would."""
    if "split" in pipeline:
        return rows
    threshold = int(chain.modules.topk_topp._SPLIT_MAX_BATCH)
    return threshold + 1 if chunk_rows > threshold else chunk_rows


def sub_chain(
    chain: NativeChain, sub: _Sub, gates: Any, k: int, step: dict[str, Any]
) -> ChainOutput:
    """vLLM's chain on a padded sub-batch's buffers -- ``_verify``'s one chunk as vLLM runs it,
    with the chunk's host decisions ``gates`` (``rows`` set by :func:`gates_rows`) -- then
    ``resolve_apply`` writing its answers into the step's outputs (the addresses and ``n`` in
    ``sub.table``'s apply words: n = 0 writes nothing). ``step``: the chain's step arguments
    (the per-slot state the captured chain reads where it is)."""
    state = _state(step)
    chunk = _Chunk(
        sub.logits, sub.row_index["draft_sampled"], sub.cu, sub.row_index["pos"],
        sub.idx_mapping, sub.row_index["expanded_idx_mapping"],
        sub.row_index["expanded_local_pos"], gates,
    )  # fmt: skip
    out = chain._rejection(
        [chunk], state, int(sub.logits.shape[1]), k, step["temperature_gpu"],
        step["seed_gpu"], None, bool(step.get("use_fp64_gumbel", False)), sub.seq_lens,
        sub.cu, sub.idx_mapping, step["prefill_len"],
    )  # fmt: skip
    apply_answers(out, sub.table[sub.apply_off :], sub.table[sub.req_off :], sub.reqs)
    return out


def apply_answers(out: ChainOutput, words: torch.Tensor, req_sel: torch.Tensor, slots: int) -> None:
    """One ``resolve_apply`` launch: the answers of vLLM's chain for ``slots`` request slots
    (``out``) written into the step's outputs whose count and addresses are ``words``
    (``APPLY_WORDS`` int64 on the device: n, then the five addresses; n = 0 writes nothing),
    slot ``i`` into the step's request ``req_sel[i]``.

    Raises:
        RuntimeError: the chain's tokens are not ``[slots, K + 1]`` rows of unit stride.
    """
    width = int(out.sampled.shape[1])
    apply = kernels.kernel("resolve_apply")
    if out.sampled.dim() != 2 or out.sampled.stride(1) != 1:
        raise RuntimeError(
            f"vLLM's chain returned tokens of shape {tuple(out.sampled.shape)} and strides "
            f"{out.sampled.stride()}; resolve_apply reads [slots, K + 1] rows of unit stride"
        )
    apply(
        (slots,), words, req_sel, out.sampled, out.num_sampled, out.num_rejected, width,
        out.sampled.stride(0), out.num_sampled.stride(0), out.num_rejected.stride(0),
        BLOCK_K=max(int(apply.module.CONSTEXPRS["BLOCK_K"]), 1 << (width - 1).bit_length()),
    )  # fmt: skip


def _split_count(mod: Any, rows: int, vocab: int, device: torch.device) -> int | None:
    """vLLM's split count of its split top-p pipeline for ``rows`` rows: its own
    ``_topp_split_count`` with its own SM count (0.33 takes the vocabulary too, 0.32 does not);
    None where the version has no such function (then only the chunk's own row count is used)."""
    fn = getattr(mod, "_topp_split_count", None)
    count = getattr(mod, "num_compute_units", None)
    if fn is None or count is None:
        return None
    num_sm = count(device.index)
    if len(inspect.signature(fn).parameters) == 3:
        return int(fn(rows, vocab, num_sm))
    return int(fn(rows, num_sm))
