"""vLLM's chain on a whole step, run by the device only when the step flagged a request.

A sampled step verified by shardmax comes back with ``fallback`` set on the requests it could
not certify (``VerifyResult``; rare at temperature-only traffic: non-finite rows, acceptance
tests at the interval's margin in fast mode). Reading those flags on the host is a sync per step:
the engine's host then waits for the forward and the verification before it can prepare the
next step (issue 19 measured 7.8-12.7 % fewer tokens/s than vLLM's own chain at T = 1 for that
read alone, with nothing flagged).

:class:`DeviceFallback` makes the decision on the device instead. Per step signature it captures
one :class:`~shardmax.runtime.conditional.IfGraph`:

* prologue: ``table_copy`` brings the step's ``fallback`` flags into a static buffer (their
  address travels in the argument table), ``any`` of them is the predicate;
* body (only when a request is flagged): vLLM's chain on the whole step
  (:meth:`~shardmax.integrations.vllm.chain.NativeChain.verify`, the kernels vLLM itself runs on
  these logits), then ``resolve_apply`` writes its answers for every request into the step's
  outputs (their addresses in the table too) and clears the flags.

So every request ends with vLLM's answer -- shardmax's where nothing was flagged (identical by
construction, the parity tests' claim), vLLM's own where something was -- and a step's host work
is one small host->device copy of the table and one graph launch, whatever the flags say.

What the captured chain reads by address -- the logits, every batch tensor and vLLM's per-slot
sampling state -- is part of the signature (address, dtype, shape, strides), as are the chain's
host decisions (its chunks, and per chunk vLLM's gates: fp32 copy, temperature, min-p, top-k /
top-p and the row count that picks the top-p pipeline). A step whose tensors moved is a new
signature: it runs the host-read path (the caller's) until it repeats ``capture_after`` times,
then is captured (at most :data:`MAX_GRAPHS` per fallback, least recently used out). An engine
whose buffers are persistent (vLLM's input buffers, its captured LM head's output) repeats its
signatures.

Where it does not apply, :meth:`DeviceFallback.run` returns False and the caller reads the flags
as before: off CUDA (unless ``emulate``), where :func:`shardmax.runtime.conditional.unavailable`
names a reason, for steps with a synthetic rejection method, and for outputs the kernel cannot
write (not contiguous or not the dtypes of :class:`~shardmax.ops.sampled.VerifyResult`). At TP > 1
the chain needs the full logits, which no rank holds: callers use it at TP 1.
"""

from __future__ import annotations

import inspect
import threading
import warnings
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from shardmax.integrations.vllm.chain import NativeChain, max_chunk_logits, request_chunks
from shardmax.integrations.vllm.resolution import (
    _APPLY_DTYPES,
    _PERSISTENT,
    _WORKSPACES,
    APPLY_WORDS,
    _check_result,
)
from shardmax.ops.sampled import VerifyResult
from shardmax.runtime import kernels
from shardmax.runtime.conditional import IfGraph, unavailable
from shardmax.runtime.host import stage_into

__all__ = ["MAX_GRAPHS", "DeviceFallback"]

MAX_GRAPHS = 16
"""Captured step signatures kept per fallback (least recently used out)."""
_READ = ("logits", "draft_sampled", "cu_num_logits", "pos", "idx_mapping", "expanded_idx_mapping",
         "expanded_local_pos", "seq_lens", *_PERSISTENT)  # fmt: skip
"""The tensors the captured chain reads by address."""
_VERIFY_ARGS = frozenset(inspect.signature(NativeChain.verify).parameters) - {"self", "logits"}
"""The step arguments :meth:`NativeChain.verify` takes."""
_COPY_WORDS = 3
"""The prologue's ``table_copy`` entry: the step's fallback address, the static buffer's, bytes."""


class _Eager:
    """:class:`IfGraph`'s contract off CUDA (tests): the prologue, a host read, the body."""

    def __init__(self, prologue: Any, body: Any) -> None:
        self.prologue, self.body = prologue, body

    def launch(self) -> None:
        if bool(self.prologue().item()):
            self.body()


class _Step:
    """One signature's static buffers and its graph."""

    def __init__(self, num_reqs: int, device: torch.device) -> None:
        self.table = torch.zeros(_COPY_WORDS + APPLY_WORDS, dtype=torch.int64, device=device)
        self.flags = torch.zeros(num_reqs, dtype=torch.bool, device=device)
        self.req_sel = torch.arange(num_reqs, dtype=torch.int64, device=device)
        self.graph: Any = None
        self.keep: list[Any] = []
        self.failed = False


class DeviceFallback:
    """The step's flagged requests answered by vLLM's chain on the device, without a host read.

    Args:
        chain: vLLM's chain (the installed vLLM's, or an extracted tree's).
        capture_after: a signature is captured on its ``capture_after``-th step (the earlier
            ones return False: the caller's host-read path).
        emulate: off CUDA, run the same prologue and body eagerly with a host read of the
            predicate (the CPU tests of the tables and kernels).

    Raises:
        ValueError: ``capture_after < 1``.
    """

    def __init__(self, chain: NativeChain, *, capture_after: int = 2, emulate: bool = False):
        if capture_after < 1:
            raise ValueError(f"capture_after: expected >= 1, got {capture_after}")
        self.chain = chain
        self.capture_after = capture_after
        self.emulate = emulate
        self._steps: OrderedDict[tuple[Any, ...], _Step] = OrderedDict()
        self._seen: OrderedDict[tuple[Any, ...], int] = OrderedDict()
        self._pool: Any = None
        self._lock = threading.Lock()
        self._why: dict[torch.device, str | None] = {}
        self._gates_memo: dict[tuple[Any, ...], Any] = {}
        self.stats = {"launched": 0, "host_read": 0, "captured": 0, "capture_failed": 0}
        """Steps launched on the device; steps returned to the caller's host read (new or
        unsupported signatures); graphs captured; captures that failed (their signature then
        reads the flags on the host)."""

    def unavailable(self, device: torch.device) -> str | None:
        """Why no step on ``device`` can run here (None: steps can)."""
        if device.type != "cuda":
            return None if self.emulate else f"device fallback needs CUDA, got {device}"
        if device not in self._why:
            self._why[device] = unavailable(device)
        return self._why[device]

    def run(self, result: VerifyResult, logits: torch.Tensor, **step: Any) -> bool:
        """Queue the device-decided fallback of one verified step: afterwards (in stream order)
        every request of ``result`` holds vLLM's answer and no ``fallback`` flag.

        Args:
            result: the step's outputs (written in place where a request was flagged).
            logits: ``[num_logits, V]`` the step's full logits (TP 1: the local logits).
            step: :meth:`NativeChain.verify`'s other arguments (``checks`` honoured: with it,
                the chain's own argument checks run first).

        Returns:
            True when queued on the device (no host sync); False when the caller must read the
            flags itself: a signature not captured yet, or not supported (module docstring).

        Raises:
            ValueError / TypeError / NotImplementedError: as :meth:`NativeChain.verify`'s
                checks (with ``checks``), and ``result`` not shaped for the step.
        """
        device = logits.device
        if self.unavailable(device) is not None:
            self.stats["host_read"] += 1
            return False
        unknown = sorted(set(step) - _VERIFY_ARGS)
        if unknown:
            raise TypeError(f"run: unexpected step arguments {unknown}")
        self.chain._refuse_unsupported(
            step.get("draft_logits"), step.get("rejection_sample_method", "standard"),
            step.get("synthetic_conditional_rates"), step.get("logits_processing", False),
            step.get("num_logprobs"), step.get("watermark_key"),
        )  # fmt: skip
        if step.get("synthetic_conditional_rates") is not None:
            self.stats["host_read"] += 1
            return False
        if step.get("checks", True):
            self.chain._check_logits(logits)
            self._checks(logits, step)
        _check_result(result, step)
        outs = (result.sampled, result.num_sampled, result.num_rejected, result.fallback,
                result.reason)  # fmt: skip
        if any(
            t.dtype != d or t.device != device or not t.is_contiguous()
            for t, d in zip(outs, _APPLY_DTYPES, strict=True)
        ):
            self.stats["host_read"] += 1
            return False
        key = self._key(logits, step)
        num_reqs = int(result.fallback.shape[0])
        words = np.array(
            [result.fallback.data_ptr(), 0, num_reqs, num_reqs, *(t.data_ptr() for t in outs)],
            dtype=np.int64,
        )
        with self._lock:
            st = self._steps.get(key)
            if st is None:
                # a signature not captured yet: counted apart, so new signatures never push
                # captured graphs out before they are captured themselves
                seen = self._seen.pop(key, 0) + 1
                if seen < self.capture_after:
                    self._seen[key] = seen
                    if len(self._seen) > 4 * MAX_GRAPHS:
                        self._seen.popitem(last=False)
                    self.stats["host_read"] += 1
                    return False
                if len(self._steps) >= MAX_GRAPHS:
                    self._steps.popitem(last=False)
                st = self._steps[key] = _Step(num_reqs, device)
            self._steps.move_to_end(key)
            if st.failed:
                self.stats["host_read"] += 1
                return False
            words[1] = st.flags.data_ptr()
            stage_into(st.table, words)
            if st.graph is None:
                self._capture(st, logits, step)
                if st.graph is None:
                    self.stats["host_read"] += 1
                    return False
            st.graph.launch()
            self.stats["launched"] += 1
            return True

    # ---- signature and capture ---------------------------------------------------------------

    def _checks(self, logits: torch.Tensor, step: dict[str, Any]) -> None:
        """The chain's argument checks of the step (its ``verify(checks=True)`` ones)."""
        self.chain._check_step(
            logits.device, int(logits.shape[1]), int(logits.shape[0]),
            step["num_speculative_steps"], step["draft_sampled"], step["cu_num_logits"],
            step["pos"], step["idx_mapping"], step["expanded_idx_mapping"],
            step["expanded_local_pos"], step["temperature_gpu"], step["seed_gpu"],
            step["idx_mapping_np"], step["cu_num_logits_np"], step["temperature_np"],
            step["seq_lens"], step["prefill_len"], step.get("top_k_gpu"), step.get("top_k_np"),
            step.get("top_p_gpu"), step.get("top_p_np"), step.get("min_p_gpu"),
            step.get("min_p_np"), step.get("synthetic_conditional_rates"),
        )  # fmt: skip

    def _key(self, logits: torch.Tensor, step: dict[str, Any]) -> tuple[Any, ...]:
        """The step's signature: what the captured chain reads by address, and its host
        decisions (chunks, and vLLM's gates per chunk)."""
        tensors = {"logits": logits, **step}
        read = tuple(
            (name, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
            for name in _READ
            if (t := tensors.get(name)) is not None
        )
        vocab = int(logits.shape[1])
        cu_np = np.asarray(step["cu_num_logits_np"])
        slots = np.asarray(step["idx_mapping_np"])
        limit = self.chain.max_chunk_rows or max_chunk_logits(vocab)
        state = NativeChain._State(
            step["temperature_gpu"], step["temperature_np"], step.get("top_k_gpu"),
            step.get("top_k_np"), step.get("top_p_gpu"), step.get("top_p_np"),
            step.get("min_p_gpu"), step.get("min_p_np"),
        )  # fmt: skip
        chunks = tuple(
            (s, e, self._gates(slots[s:e], state, vocab, int(cu_np[e] - cu_np[s])))
            for s, e in request_chunks(cu_np, limit)
        )
        return (read, chunks, int(step["num_speculative_steps"]),
                bool(step.get("use_fp64_gumbel", False)))  # fmt: skip

    def _gates(self, slots: np.ndarray, state: Any, vocab: int, rows: int) -> Any:
        """:meth:`NativeChain._gates`, memoised on what it reads (the chunk's slots and their
        sampling values, the vocabulary, the rows): ~3 us of host time instead of ~10."""
        arrays = (state.temperature_np, state.top_k_np, state.top_p_np, state.min_p_np)
        memo_key = (vocab, rows, slots.tobytes(),
                    *(a[slots].tobytes() if a is not None else None for a in arrays))  # fmt: skip
        got = self._gates_memo.get(memo_key)
        if got is None:
            if len(self._gates_memo) >= 256:
                self._gates_memo.clear()
            got = self._gates_memo[memo_key] = NativeChain._gates(slots, state, vocab, rows)
        return got

    def _capture(self, st: _Step, logits: torch.Tensor, step: dict[str, Any]) -> None:
        """Build the signature's graph (or its eager stand-in), the table already uploaded."""
        copy = kernels.kernel("table_copy")
        apply = kernels.kernel("resolve_apply")
        chain = self.chain
        # the host arrays as they are now: a graph keeps the decisions it was captured with,
        # and so does the eager stand-in (a later in-place change is a new signature, never
        # a silently re-decided body)
        kw: dict[str, Any] = {
            k: v.copy() if isinstance(v, np.ndarray) else v for k, v in step.items()
        }
        kw["checks"] = False

        def prologue() -> torch.Tensor:
            copy((1,), st.table, BLOCK=copy.module.BLOCK)
            return st.flags.any()

        def body() -> Any:
            out = chain.verify(logits, **kw)
            width = int(out.sampled.shape[1])
            if out.sampled.dim() != 2 or out.sampled.stride(1) != 1:
                raise RuntimeError(
                    f"vLLM's chain returned tokens of shape {tuple(out.sampled.shape)} and "
                    f"strides {out.sampled.stride()}; resolve_apply reads rows of unit stride"
                )
            apply(
                (st.req_sel.shape[0],), st.table[_COPY_WORDS:], st.req_sel, out.sampled,
                out.num_sampled, out.num_rejected, width, out.sampled.stride(0),
                out.num_sampled.stride(0), out.num_rejected.stride(0),
                BLOCK_K=max(int(apply.module.CONSTEXPRS["BLOCK_K"]), 1 << (width - 1).bit_length()),
            )  # fmt: skip
            return out

        if logits.device.type != "cuda":
            st.graph = _Eager(prologue, body)
            return
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        try:
            st.graph = IfGraph(prologue, body, logits.device, pool=self._pool)
        except Exception as e:  # a launch that cannot be captured: this signature reads flags
            st.failed = True
            self.stats["capture_failed"] += 1
            warnings.warn(
                f"shardmax: the device fallback's capture failed ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:200] if str(e) else ''}); its steps read the flags "
                "on the host",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        mod = chain.modules.topk_topp
        st.keep = [dict(getattr(mod, name, {})) for name in _WORKSPACES]
        self.stats["captured"] += 1
