"""vLLM's chain on a step's flagged requests, run by the device only when the step flagged one.

A sampled step verified by shardmax comes back with ``fallback`` set on the requests it could
not certify (``VerifyResult``; rare at temperature-only traffic: non-finite rows, acceptance
tests at the interval's margin in fast mode). Reading those flags on the host is a sync per step:
the engine's host then waits for the forward and the verification before it can prepare the
next step (issue 19 measured 7.8-12.7 % fewer tokens/s than vLLM's own chain at T = 1 for that
read alone, with nothing flagged).

:class:`DeviceFallback` makes the decision on the device instead. Per step signature it captures
:data:`SLOTS` :class:`~shardmax.runtime.conditional.IfGraph` s, one per argument table:

* prologue: ``table_fetch`` brings the slot's page-locked argument table to the device (and
  acknowledges it), ``table_copy`` the step's ``fallback`` flags into a static buffer (their
  address travels in the table), ``any`` of them is the predicate;
* body (only when a request is flagged): vLLM's chain on the flagged requests (the compact
  body, below), or on the whole step
  (:meth:`~shardmax.integrations.vllm.chain.NativeChain.verify`, the kernels vLLM itself runs on
  these logits) when more are flagged than the bucket's capacity, then ``resolve_apply``
  writes its answers into the step's outputs (their addresses in the table too) and clears
  the flags.

So every request ends with vLLM's answer -- shardmax's where nothing was flagged (identical by
construction, the parity tests' claim), vLLM's own where something was -- and a step's host work
is writing ~30 int64 into a page-locked table the GPU reads in place and one graph launch,
whatever the flags say: no copy call. Measured (H100, stage FP at 81b043f,
``benchmarks/results/sm90/host_costs_fallback``), that second call after the replayed step cost
95-190 us of host time (checks, signature and table in Python, then 22-42 us for the
conditional graph's launch with the GPU busy, before 08bdc8a bound the launch: ~7.5 us since)
and 20-24 us of GPU time: its step got 1-7 % fewer tokens/s than vLLM's chain at T = 1
(though more than the host-read path at most row counts).

**Folded into the replayed step** (:meth:`DeviceFallback.fold`): the same prologue and body as
an epilogue of the step's own replayed graph (:class:`shardmax.runtime.graphs.Epilogue`): the
output slot's graph runs ``table_fetch`` -> shardmax's kernels -> the set-conditional warp
reading the slot's own flags -> IF { the body }, the fallback's words fetched with the step's
(the body first merges them with its bucket's static addresses, on the device). No second
call, no second table, no flag copy: what the fold adds to a replayed step is its signature and
table words on the host (17-20 us on the CI machine's host, 2-3x that on the GPU machines')
and the one-warp set-conditional kernel and a conditional node on the GPU; its launch costs
the host about what a plain graph replay does (7.5 against 6 us, ``benchmarks/results/sm90/
host_costs_fold``). The
plug-in offers it first (on by default at TP 1 on CUDA: ``$SHARDMAX_VLLM_DEVICE_FALLBACK``)
and calls :meth:`run` only on steps that did not replay from a slot (a new signature's eager
steps, copy-out steps). Measured in the engine loop (H100, ``benchmarks/results/sm90/
engine_fold``): above the second call, the host read and vLLM's chain in tokens/s at every row
count at T = 1; 13-18 us of GPU time and 104-152 us of host p50 over the bare replay (since the
leaner launch and words, ``engine_fold_launch``: 12-15 us and 60-83 us, within 1 % of vLLM's
chain in tokens/s at every row count). Behind
level-histogram top-p (T = 1, top-p 0.95, ``engine_topp_fold``, two runs) it beat the host read
and per-request resolution by 11-49 % in tokens/s at 4-256 rows but trailed vLLM's chain by
19-20 % at 96 rows (one of 24 requests flagged on every step) and the host read at 512 rows
(four of 128), while its body ran vLLM's chain on the whole step.

**The compact body.** A flagged step rarely needs the whole step re-verified: its body first
picks the flagged requests on the device (``resolve_select``: the first ``capacity`` of them
in step order, :func:`default_capacity` -- about twice what realistic top-p traffic flags),
copies their logits rows into a padded sub-batch (``table_copy`` entries the same kernel
writes) and runs vLLM's chain on that sub-batch with the whole step's host decisions
(:func:`~shardmax.integrations.vllm.resolution.sub_chain`, exactly as
:class:`~shardmax.integrations.vllm.resolution.CapturedResolution` does after a host read);
only when more requests are flagged than the capacity holds does a nested IF node
(:class:`~shardmax.runtime.conditional.Branch`) run vLLM's chain on the whole step, whose
answers then replace every request's. Measured (H200, ``engine_compact``, T = 1 / top-p
0.95): the fold's GPU time at 96 rows 592 us against 927 with the whole-step body (H100) and
vLLM's 569, level with vLLM in tokens/s (-1.7 %); at 512 rows +57 % over the host read and
+20 % over vLLM's chain; so the plug-in folds level-histogram top-p steps of every size
(:func:`shardmax.integrations.vllm.step.uses_device_fallback`). The
graphs of one fallback share a :class:`~shardmax.runtime.pools.GraphPool`, which stays valid as
signatures come and go (and keeps what released graphs freed reserved for later captures). As
in :mod:`shardmax.runtime.graphs`, a table is rewritten only once the GPU has acknowledged its
last step; a step that finds none of its signature's tables acknowledged (the host ran
:data:`SLOTS` steps ahead) returns False, and the
caller reads the flags.

**Signatures are buckets, not addresses.** vLLM allocates a step's logits and batch tensors
anew (and its batch grows and shrinks as requests come and go), so the body never reads them
where they are: its first launch copies them (``table_copy``, their addresses and byte counts in
the step's table) into static buffers of a bucket -- ``R`` requests (the power of two at or above
the step's), ``N = R (K + 1)`` logits rows (at most vLLM's chunk limit, which must hold the step's
rows plus one per padding request) --, then fills the padding: each padding
request has one row, on the first request's slot; rows past the last request's belong to no
request (vLLM's per-row kernels read their slot from ``expanded_idx_mapping``, its per-request
kernels their rows from ``cu_num_logits``). vLLM's chain then runs on the ``N`` rows (its
per-row and per-request work is independent, so the real requests get the answers vLLM gives on
the step itself; tested ``==`` on steps of every size of a bucket) and ``resolve_apply`` writes
the first ``num_reqs`` answers. A step's signature is then its bucket, K, the vocabulary, the
dtypes and logits row stride, which of vLLM's per-slot tensors the step has (``_PERSISTENT``:
temperatures, seeds, top-k / top-p / min-p, prefill lengths; copied whole too: vLLM
double-buffers them, their address alternates from step to step) and the chain's host decisions
(vLLM's gates, which read the requests' slots: a padding request repeats a real one's, so the
gates are the step's). Steps with top-p rows run at their exact size (vLLM picks its top-p
pipeline by the row count). A signature runs the host-read path (the caller's) until it repeats
``capture_after`` times, then is captured (at most :data:`MAX_GRAPHS` per fallback, least
recently used out; a folded signature -- :meth:`DeviceFallback.fold` -- is captured when the
replayed step's graph is, and its graphs keep its bucket alive while they live). The static logits buffer is shared by the signatures of one vocabulary,
dtype and row width (the largest a live signature holds; the graphs replay in stream order: one
fallback serves one CUDA stream). The first launch of a signature captures its graphs; each
capture runs prologue and body once eagerly (``IfGraph`` 's warm-up) on a table that copies no
flag and writes no answer, so the step's outputs are untouched by it.

Where it does not apply, :meth:`DeviceFallback.run` returns False and the caller reads the flags
as before: off CUDA (unless ``emulate``), where :func:`shardmax.runtime.conditional.unavailable`
names a reason, for steps with a synthetic rejection method, for outputs the kernel cannot write
(not contiguous or not the dtypes of :class:`~shardmax.ops.sampled.VerifyResult`), for step
tensors it cannot copy as bytes (batch tensors not contiguous, logits whose last stride is not 1)
and for steps whose bucket would exceed vLLM's chunk (``2**30 / (4 V)`` rows: 1341 at
V = 200064). At TP > 1
the chain needs the full logits, which no rank holds, and their all-gather cannot run inside the
conditional node (NCCL's graph-mixing event-wait nodes are refused there at instantiation:
NVIDIA/nccl#1986, pytorch/pytorch#180960): callers use it at TP 1.
"""

from __future__ import annotations

import inspect
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from shardmax.integrations.vllm.chain import NativeChain, max_chunk_logits
from shardmax.integrations.vllm.resolution import (
    _APPLY_DTYPES,
    _INDEXED,
    _PERSISTENT,
    _WORKSPACES,
    APPLY_WORDS,
    _check_result,
    _state,
    _Sub,
    apply_answers,
    fitting_capacity,
    gates_rows,
    sub_chain,
)
from shardmax.ops.sampled import VerifyResult
from shardmax.runtime import kernels
from shardmax.runtime.conditional import Branch, IfGraph, run_eagerly, unavailable
from shardmax.runtime.graphs import FetchedTable, _release_fetched
from shardmax.runtime.pools import GraphPool

__all__ = ["MAX_CAPACITY", "MAX_GRAPHS", "SLOTS", "DeviceFallback", "default_capacity"]

MAX_GRAPHS = 16
"""Captured step signatures kept per fallback (least recently used out)."""
SLOTS = 3
"""Page-locked argument tables per signature, each with its own graph (all captured together,
on the signature's first launch): a step takes one whose last step the GPU has fetched, so the
host may run up to ``SLOTS`` steps ahead of the GPU (vLLM's asynchronous scheduling: two)."""
_VERIFY_ARGS = frozenset(inspect.signature(NativeChain.verify).parameters) - {"self", "logits"}
"""The step arguments :meth:`NativeChain.verify` takes."""
_ROWS = ("draft_sampled", "pos", "expanded_idx_mapping", "expanded_local_pos")
"""The step's ``[num_logits]`` tensors, copied into the bucket's static buffers."""
_REQS = ("idx_mapping", "seq_lens")
"""The step's ``[num_reqs]`` tensors, copied likewise (and ``cu_num_logits``, ``[num_reqs + 1]``)."""
_STEP_COPIED = (*_ROWS, "cu_num_logits", *_REQS)
"""The step's own tensors the body copies (every one required)."""
_COPIED = ("logits", *_STEP_COPIED, *_PERSISTENT)
"""The body's copy entries, in table order (vLLM's per-slot tensors last; an absent one copies
nothing)."""
# the step's table (int64 words): the prologue's copy entry (fallback flags -> static flags),
# resolve_apply's words (num_reqs, then the five output addresses), the step's rows and
# requests, then the body's copy entries [source, destination, bytes] in _COPIED order
_FLAGS = 0
_APPLY = 3
_NUM_LOGITS = _APPLY + APPLY_WORDS
_NUM_REQS = _NUM_LOGITS + 1  # the padding's (resolve_apply's count is 0 in a capture's table)
_BODY = _NUM_REQS + 1
_WORDS = _BODY + 3 * len(_COPIED)
_COPY_PROGRAMS = 2048
"""The most programs that share the logits' copy (``table_copy``'s second grid axis)."""


def _pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


MAX_CAPACITY = 8
"""The most flagged requests :func:`default_capacity` resolves apart from the whole step."""


def default_capacity(reqs: int) -> int:
    """Flagged requests of a bucket of ``reqs`` request slots that the body resolves on a padded
    sub-batch (more: vLLM's chain on the whole step too): one per 16 slots rounded up to a power
    of two, at most :data:`MAX_CAPACITY`; 0 (the whole step always) where that would be the
    whole bucket. Realistic top-p steps flag 2-5 % of their requests (README), so the capacity
    holds about twice the expected count; the sub-batch's chain costs what vLLM's costs on
    ``capacity * (K + 1)`` rows."""
    cap = min(MAX_CAPACITY, _pow2(-(-reqs // 16)))
    return cap if cap < reqs else 0


class _Eager:
    """:class:`IfGraph`'s contract off CUDA (tests): made, each callable runs once (the
    captures' warm-up); launched, the prologue, a host read of its predicate, the body."""

    def __init__(self, prologue: Any, body: Any) -> None:
        self.prologue, self.body = prologue, body
        prologue()
        while isinstance(body, Branch):  # every piece once, as IfGraph's captures do
            body.first()
            body = body.then
        body()

    def launch(self) -> None:
        if bool(self.prologue().any()):
            run_eagerly(self.body)


class _Slot(FetchedTable):
    """One page-locked argument table of a signature and the graph that fetches it."""

    __slots__ = ("graph",)

    def __init__(self, words: np.ndarray, device: torch.device) -> None:
        n = len(words)
        buf = torch.empty(n + 2, dtype=torch.int64, pin_memory=device.type == "cuda")
        host = buf.numpy()
        host[:n] = words
        host[n:] = (0, 0)  # nothing queued: free
        super().__init__(buf)
        self.graph: Any = None


class _Bucket:
    """One signature's static buffers, its device table and its slots (page-locked host tables,
    each with its graph)."""

    def __init__(
        self,
        reqs: int,
        rows: int,
        logits_base: torch.Tensor,
        vocab: int,
        tensors: dict[str, torch.Tensor],
    ) -> None:
        dev = logits_base.device
        self.reqs, self.rows = reqs, rows
        self.logits_base = logits_base  # [>= rows, width], shared by the buckets that fit in it
        logits = self.logits = logits_base[:rows, :vocab]  # what the chain reads
        dtype = {name: t.dtype for name, t in tensors.items()}
        self.static = {
            **{name: torch.zeros(rows, dtype=dtype[name], device=dev) for name in _ROWS},
            **{name: torch.zeros(reqs, dtype=dtype[name], device=dev) for name in _REQS},
            "cu_num_logits": torch.zeros(reqs + 1, dtype=dtype["cu_num_logits"], device=dev),
            # vLLM's per-slot state, whole (double-buffered by vLLM: its address alternates)
            **{name: torch.zeros_like(tensors[name]) for name in _PERSISTENT if name in tensors},
        }
        self.req_iota = torch.arange(reqs, dtype=torch.int64, device=dev)
        self.row_iota = torch.arange(rows, dtype=torch.int64, device=dev)
        self.cu_iota = torch.arange(reqs + 1, dtype=torch.int64, device=dev)
        self.flags = torch.zeros(reqs, dtype=torch.bool, device=dev)
        self.table = torch.zeros(_WORDS, dtype=torch.int64, device=dev)
        words = np.zeros(_WORDS, dtype=np.int64)  # the static addresses, in every slot
        words[_FLAGS + 1] = self.flags.data_ptr()
        dst = {"logits": logits, **self.static}
        for i, name in enumerate(_COPIED):
            words[_BODY + 3 * i + 1] = dst[name].data_ptr() if name in dst else 0
        # the static words on the device: a folded step's table (fetched with the replayed
        # step's, without them) is merged with them into ``table`` before the body reads it
        self.static_words = torch.from_numpy(words).to(dev)
        self.static_mask = self.static_words != 0
        _release_fetched()
        self.slots = [_Slot(words, dev) for _ in range(SLOTS)]
        self.next = 0
        self.keep: list[Any] = []
        self.failed = False
        self.compact: _Compact | None = None  # its padded sub-batch (_compact), once decided
        self.decided = False

    def slot(self) -> _Slot | None:
        """The next free slot (round robin), or None when the GPU has fetched none of them."""
        for i in range(SLOTS):
            s = self.slots[(self.next + i) % SLOTS]
            if s.fetched():
                self.next = (self.next + i + 1) % SLOTS
                return s
        return None


class _Compact:
    """A bucket's padded sub-batch of flagged requests (:meth:`DeviceFallback._compact`): the
    static buffers ``resolve_select`` fills and vLLM's chain reads, the rows' ``table_copy``
    entries, the overflow flag, the padding row and the sub-batch's gates."""

    __slots__ = ("entries", "gates", "over", "pad", "programs", "sub")

    def __init__(self, sub: _Sub, gates: Any) -> None:
        dev = sub.logits.device
        self.sub, self.gates = sub, gates
        self.entries = torch.zeros(3 * sub.rows, dtype=torch.int64, device=dev)
        self.over = torch.zeros(1, dtype=torch.uint8, device=dev)
        self.pad = sub.pad_row  # one token far above the rest: the chain's cheapest row
        row = sub.logits.shape[1] * sub.logits.element_size()
        block = int(kernels.kernel("table_copy").module.BLOCK)
        self.programs = max(1, min(64, -(-row // (16 * block))))  # programs sharing a row


class _StepTensors:
    """The step's tensors the body copies, seen once per step: what a signature keys on (the
    copied tensors' dtypes; vLLM's per-slot tensors by name, dtype and length) and their table
    entries in :data:`_COPIED` order (addresses and byte counts, 0 for an absent one) -- one
    pass that both the signature (:meth:`DeviceFallback._key`) and the step's words
    (:func:`_words`) read; ``by_name`` (a new bucket's buffers) only when asked."""

    __slots__ = ("dtypes", "logits", "num_logits", "ptrs", "sizes", "slot_state", "step")

    def __init__(
        self,
        logits: torch.Tensor,
        step: dict[str, Any],
        dtypes: tuple[torch.dtype, ...],
        slot_state: tuple[tuple[str, torch.dtype, int], ...],
        ptrs: list[int],
        sizes: list[int],
    ) -> None:
        self.logits, self.step, self.dtypes, self.slot_state = logits, step, dtypes, slot_state
        self.ptrs, self.sizes = ptrs, sizes
        self.num_logits = int(logits.shape[0])

    @property
    def by_name(self) -> dict[str, torch.Tensor]:
        """The copied tensors by name (``logits`` first, then :data:`_COPIED`'s order; an absent
        per-slot tensor left out)."""
        got = {name: self.step.get(name) for name in _COPIED[1:]}
        return {"logits": self.logits, **{k: t for k, t in got.items() if t is not None}}

    @classmethod
    def of(cls, logits: torch.Tensor, step: dict[str, Any]) -> _StepTensors | None:
        """The step's tensors (``step``: :meth:`NativeChain.verify`'s arguments), or None where
        the body cannot copy them as bytes: logits not 2-D, with a last stride other than 1 or
        overlapping rows; another tensor not contiguous, or a step tensor not 1-D or shorter
        than what the chain reads of it. A step tensor's entry copies exactly what the chain
        reads -- ``[num_logits]`` rows, ``[num_reqs]`` requests, ``[num_reqs + 1]``
        ``cu_num_logits`` -- whatever vLLM padded it to (its ``seq_lens`` under full CUDA
        graphs). (Host time every folded step: two loops without a branch on the name.)

        Raises:
            KeyError: a tensor argument the chain requires is missing from ``step``."""
        if logits.dim() != 2:
            return None
        num_logits, vocab = logits.shape
        row, col = logits.stride()
        if col != 1 or (num_logits > 1 and row < vocab):  # broadcast or overlapping rows
            return None
        span = ((num_logits - 1) * row + vocab) * logits.element_size() if num_logits else 0
        ptrs, sizes, dtypes = [logits.data_ptr()], [span], []
        num_reqs = step["idx_mapping"].shape[0]
        # the entries the chain reads -- no more: vLLM pads ``seq_lens`` (and may pad other
        # tensors) past them under full CUDA graphs, and the bucket's buffers hold these alone
        count = {"cu_num_logits": num_reqs + 1, "idx_mapping": num_reqs, "seq_lens": num_reqs}
        for name in _STEP_COPIED:
            t = step[name]
            n = count.get(name, num_logits)
            if t.dim() != 1 or t.shape[0] < n or not t.is_contiguous():
                return None  # (a shorter one would be read past its end)
            dtypes.append(t.dtype)
            ptrs.append(t.data_ptr())
            sizes.append(n * t.element_size())
        slot_state = []
        for name in _PERSISTENT:
            t = step.get(name)
            if t is None:
                ptrs.append(0)
                sizes.append(0)
                continue
            if not t.is_contiguous():
                return None
            slot_state.append((name, t.dtype, t.shape[0]))
            ptrs.append(t.data_ptr())
            sizes.append(t.nbytes)
        return cls(logits, step, tuple(dtypes), tuple(slot_state), ptrs, sizes)


def _words(
    w: np.ndarray,
    result: VerifyResult,
    tensors: _StepTensors,
    num_reqs: int,
    capture: bool = False,
) -> None:
    """The step's table (:data:`_WORDS` int64) into ``w``: its flags, outputs, rows and the
    body's copy entries (the static addresses between them left as they are). ``capture``: the
    table of a capture's warm-up, which runs prologue and body once eagerly whatever the flags
    -- no flag copied, no answer written (the step's outputs untouched). Every step writes it
    (host time: four slice assignments)."""
    answered = 0 if capture else num_reqs
    flags = result.fallback.data_ptr()
    w[_FLAGS] = flags
    w[_FLAGS + 2 : _BODY] = (  # the flags' count, then _APPLY (== _FLAGS + 3) .. _NUM_REQS
        answered, answered, result.sampled.data_ptr(), result.num_sampled.data_ptr(),
        result.num_rejected.data_ptr(), flags, result.reason.data_ptr(), tensors.num_logits,
        num_reqs,
    )  # fmt: skip
    w[_BODY:_WORDS:3] = tensors.ptrs
    w[_BODY + 2 : _WORDS : 3] = tensors.sizes


class _Fold:
    """One step's device fallback as an epilogue of its replayed graph
    (:class:`shardmax.runtime.graphs.Epilogue`; made by :meth:`DeviceFallback.fold`)."""

    __slots__ = ("bucket", "fallback", "key", "num_reqs", "queued", "step", "tensors")
    words = _WORDS

    def __init__(
        self,
        fallback: DeviceFallback,
        key: tuple[Any, ...],
        tensors: _StepTensors,
        num_reqs: int,
        step: dict[str, Any],
    ) -> None:
        self.fallback, self.bucket, self.tensors = fallback, key, tensors
        self.key = (id(fallback), key)  # another fallback's graphs are not this one's
        self.num_reqs, self.step = num_reqs, step
        self.queued = False

    def pool(self, device: torch.device) -> Any:
        """The fallback's graph pool on ``device`` (every graph of one fallback replays in
        stream order)."""
        return self.fallback._pool.handle(device)

    def write(self, host: np.ndarray, result: VerifyResult, capture: bool = False) -> None:
        _words(host, result, self.tensors, self.num_reqs, capture)

    def capture(
        self, table: torch.Tensor, result: VerifyResult
    ) -> tuple[Callable[[], torch.Tensor], Callable[[], Any] | Branch]:
        return self.fallback._folded(self, table, result)


class DeviceFallback:
    """The step's flagged requests answered by vLLM's chain on the device, without a host read.

    Args:
        chain: vLLM's chain (the installed vLLM's, or an extracted tree's).
        capture_after: a signature is captured on its ``capture_after``-th step (the earlier
            ones return False: the caller's host-read path).
        emulate: off CUDA, run the same prologue and body eagerly with a host read of the
            predicates (the CPU tests of the tables, the padding and the kernels).
        capacity: flagged requests a step's body resolves on a padded sub-batch before it
            would run vLLM's chain on the whole step (more flagged: the whole step too); None
            (default): :func:`default_capacity` of each bucket; 0: the whole step always.

    Raises:
        ValueError: ``capture_after < 1``; ``capacity`` negative.
    """

    def __init__(
        self,
        chain: NativeChain,
        *,
        capture_after: int = 2,
        emulate: bool = False,
        capacity: int | None = None,
    ):
        if capture_after < 1:
            raise ValueError(f"capture_after: expected >= 1, got {capture_after}")
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity: expected None or >= 0, got {capacity}")
        self.capacity = capacity
        self.chain = chain
        self.capture_after = capture_after
        self.emulate = emulate
        self._buckets: OrderedDict[tuple[Any, ...], _Bucket] = OrderedDict()
        self._seen: OrderedDict[tuple[Any, ...], int] = OrderedDict()
        self._pool = GraphPool()
        self._lock = threading.Lock()
        self._why: dict[torch.device, str | None] = {}
        self._gates_memo: dict[tuple[Any, ...], Any] = {}
        self._subs: dict[tuple[Any, ...], _Sub] = {}  # the compact bodies' sub-batches
        self.stats = {"launched": 0, "host_read": 0, "no_free_slot": 0, "signatures": 0,
                      "captured": 0, "capture_failed": 0}  # fmt: skip
        """Steps launched on the device; steps returned to the caller's host read (new or
        unsupported signatures, failed captures); steps returned to it because the GPU had not
        yet fetched any of their signature's :data:`SLOTS` tables (the host ran that far ahead);
        signatures given buffers (captured or being captured); graphs captured (one per slot used); captures that failed (their signature then reads
        the flags on the host). Steps run as :meth:`fold` epilogues are counted by their
        callers (``queued``)."""

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
            logits: ``[num_logits, V]`` the step's full logits (TP 1: the local logits; any row
                stride, last stride 1).
            step: :meth:`NativeChain.verify`'s other arguments (``checks`` honoured: with it,
                the chain's own argument checks run first).

        Returns:
            True when queued on the device (no host sync), or the step has no request; False
            when the caller must read the flags itself: a signature not captured yet, or not
            supported (module docstring).

        Raises:
            ValueError / TypeError / NotImplementedError: as :meth:`NativeChain.verify`'s
                checks (with ``checks``), and ``result`` not shaped for the step.
        """
        device = logits.device
        if self.unavailable(device) is not None:
            self.stats["host_read"] += 1
            return False
        self._refuse(step, "run")
        num_reqs = int(result.fallback.shape[0])
        if num_reqs == 0:  # nothing to flag (and nothing vLLM's checks could check)
            _check_result(result, step)
            return True
        if step.get("checks", True):
            self.chain._check_logits(logits)
            self._checks(logits, step)
        _check_result(result, step)
        outs = (result.sampled, result.num_sampled, result.num_rejected, result.fallback,
                result.reason)  # fmt: skip
        tensors = _StepTensors.of(logits, step)
        key = None
        if (
            tensors is not None
            and step.get("synthetic_conditional_rates") is None
            and all(
                t.dtype == d and t.device == device and t.is_contiguous()
                for t, d in zip(outs, _APPLY_DTYPES, strict=True)
            )
        ):
            key = self._key(logits, tensors, step, num_reqs)
        if tensors is None or key is None:
            self.stats["host_read"] += 1
            return False
        with self._lock:
            b = self._buckets.get(key)
            if b is None:
                # a signature not captured yet: counted apart, so new signatures never push
                # captured graphs out before they are captured themselves
                seen = self._seen.pop(key, 0) + 1
                if seen < self.capture_after:
                    self._seen[key] = seen
                    if len(self._seen) > 4 * MAX_GRAPHS:
                        self._seen.popitem(last=False)
                    self.stats["host_read"] += 1
                    return False
                b = self._new_bucket(key, tensors)
            self._buckets.move_to_end(key)
            if b.failed:
                self.stats["host_read"] += 1
                return False
            slot = b.slot()
            if slot is None:  # the GPU has not fetched any of its tables yet
                self.stats["no_free_slot"] += 1
                return False
            if slot.graph is None:  # every slot at once: later steps never capture (a sync)
                for each in b.slots:
                    _words(each.host, result, tensors, num_reqs, capture=True)
                    each.request()
                    self._capture(b, each, step, num_reqs)
                    if b.failed:
                        self.stats["host_read"] += 1
                        return False
            _words(slot.host, result, tensors, num_reqs)
            slot.request()
            slot.graph.launch()
            self.stats["launched"] += 1
            return True

    def fold(self, logits: torch.Tensor, **step: Any) -> _Fold | None:
        """The same decision as :meth:`run`, as an epilogue of the step's own replayed graph
        (:meth:`shardmax.runtime.graphs.GraphedStep.run`'s ``epilogue``): the step's output
        slot then runs the prologue's predicate (any request flagged) and the body (vLLM's
        chain on the step, its answers written into the slot's outputs) inside its own graph,
        behind the step's kernels -- one launch and one table for the whole step, no second
        call. Made before the step runs; after it, ``queued`` says whether the step ran it
        (False: a step that did not replay from a slot; the caller then calls :meth:`run` or
        reads the flags).

        Args:
            logits: ``[num_logits, V]`` the step's full logits (TP 1: the local logits).
            step: :meth:`NativeChain.verify`'s other arguments, as for :meth:`run`.

        Returns:
            The step's epilogue, or None where :meth:`run` would not queue the step either
            (module docstring) or the step has no request.

        Raises:
            as :meth:`run`'s checks.
        """
        device = logits.device
        if self.unavailable(device) is not None:
            return None
        self._refuse(step, "fold")
        num_reqs = int(step["idx_mapping"].shape[0])
        if num_reqs == 0 or step.get("synthetic_conditional_rates") is not None:
            return None
        if step.get("checks", True):
            self.chain._check_logits(logits)
            self._checks(logits, step)
        tensors = _StepTensors.of(logits, step)
        if tensors is None:
            return None
        key = self._key(logits, tensors, step, num_reqs)
        if key is None:
            return None
        with self._lock:  # a bucket in use stays at the recent end (its graphs hold it anyway)
            if key in self._buckets:
                self._buckets.move_to_end(key)
        return _Fold(self, key, tensors, num_reqs, step)

    def _folded(
        self, fold: _Fold, table: torch.Tensor, result: VerifyResult
    ) -> tuple[Callable[[], torch.Tensor], Callable[[], Any] | Branch]:
        """A slot's ``(predicate, body)`` of ``fold`` (:meth:`fold`): its bucket's body reading
        ``table``, run when one of ``result``'s flags is set."""
        _check_result(result, fold.step)
        for t, d in zip(result[:5], _APPLY_DTYPES, strict=True):
            if t.dtype != d or not t.is_contiguous():
                raise TypeError(
                    f"result: expected contiguous outputs of dtypes {_APPLY_DTYPES}, got "
                    f"{t.dtype} of strides {t.stride()}"
                )
        with self._lock:
            b = self._buckets.get(fold.bucket)
            if b is None:
                b = self._new_bucket(fold.bucket, fold.tensors)
            self._buckets.move_to_end(fold.bucket)
        flags = result.fallback

        def merge() -> None:
            # the step's words (read from the replayed step's table) and the bucket's own
            torch.where(b.static_mask, b.static_words, table, out=b.table)

        body = self._body(b, b.table, fold.step, fold.num_reqs, flags, merge)
        return (lambda: flags), body  # the set-conditional kernel reads every flag

    # ---- signature, buffers and table --------------------------------------------------------

    def _refuse(self, step: dict[str, Any], caller: str) -> None:
        """Unknown step arguments, and what vLLM's chain refuses, raise."""
        if not _VERIFY_ARGS.issuperset(step):
            unknown = sorted(set(step) - _VERIFY_ARGS)
            raise TypeError(f"{caller}: unexpected step arguments {unknown}")
        self.chain._refuse_unsupported(
            step.get("draft_logits"), step.get("rejection_sample_method", "standard"),
            step.get("synthetic_conditional_rates"), step.get("logits_processing", False),
            step.get("num_logprobs"), step.get("watermark_key"),
        )  # fmt: skip

    def _new_bucket(self, key: tuple[Any, ...], tensors: _StepTensors) -> _Bucket:
        """A new signature's bucket, least recently used out (under the lock)."""
        if len(self._buckets) >= MAX_GRAPHS:
            self._buckets.popitem(last=False)
        b = self._buckets[key] = self._bucket(key, tensors.by_name)
        self.stats["signatures"] += 1
        return b

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

    def _key(
        self,
        logits: torch.Tensor,
        tensors: _StepTensors,
        step: dict[str, Any],
        num_reqs: int,
    ) -> tuple[Any, ...] | None:
        """The step's signature (module docstring) from its tensors (:meth:`_StepTensors.of`),
        or None when its bucket exceeds vLLM's chunk."""
        num_logits, vocab = logits.shape
        k = int(step["num_speculative_steps"])
        limit = self.chain.max_chunk_rows or max_chunk_logits(vocab)
        reqs = _pow2(num_reqs)
        rows = min(reqs * (k + 1), limit)
        slots, values = self._values(step, num_reqs, vocab)
        gates = self._gates(slots, values, step, rows)
        if gates.do_p:  # vLLM's top-p pipeline depends on the rows: the step's exact size
            reqs, rows = num_reqs, num_logits
            gates = self._gates(slots, values, step, rows)
        if num_logits + reqs - num_reqs > rows or rows > limit:
            return None
        return (reqs, rows, k, vocab, logits.dtype, max(logits.stride(0), vocab),  # width
                tensors.slot_state, tensors.dtypes, gates,
                bool(step.get("use_fp64_gumbel", False)))  # fmt: skip

    @staticmethod
    def _values(
        step: dict[str, Any], num_reqs: int, vocab: int
    ) -> tuple[np.ndarray, tuple[Any, ...]]:
        """The requests' slots, and what :meth:`NativeChain._gates` reads besides the rows --
        the vocabulary, the slots and their sampling values (as bytes: the gates' memo key)."""
        slots = np.asarray(step["idx_mapping_np"])[:num_reqs]
        t = step["temperature_np"]
        k, p, m = step.get("top_k_np"), step.get("top_p_np"), step.get("min_p_np")
        # (``take``: the same values as ``t[slots]``, a third less host time every step)
        return slots, (vocab, slots.tobytes(), t.take(slots).tobytes(),
                       None if k is None else k.take(slots).tobytes(),
                       None if p is None else p.take(slots).tobytes(),
                       None if m is None else m.take(slots).tobytes())  # fmt: skip

    def _gates(
        self, slots: np.ndarray, values: tuple[Any, ...], step: dict[str, Any], rows: int
    ) -> Any:
        """:meth:`NativeChain._gates` of a chunk of ``rows`` rows holding the step's requests
        (``slots``, ``values``: :meth:`_values`), memoised on what it reads: ~2 us of host time
        instead of ~10."""
        memo_key = (rows, values)
        got = self._gates_memo.get(memo_key)
        if got is None:
            if len(self._gates_memo) >= 256:
                self._gates_memo.clear()
            got = self._gates_memo[memo_key] = NativeChain._gates(
                slots, _state(step), values[0], rows
            )
        return got

    def _bucket(self, key: tuple[Any, ...], tensors: dict[str, torch.Tensor]) -> _Bucket:
        """A signature's static buffers; its logits a view of the shared buffer of its
        vocabulary, dtype and row stride (grown, never shrunk, to the largest bucket)."""
        reqs, rows, _, vocab, dtype, width = key[:6]
        logits = tensors["logits"]
        # the largest buffer a live bucket of this vocabulary, dtype and width holds (evicted
        # buckets free theirs once no folded graph holds them; a larger bucket gets a new one,
        # the older ones keep theirs)
        shared = max(
            (
                b.logits_base
                for k, b in self._buckets.items()
                if k[3:6] == key[3:6] and b.logits_base.device == logits.device
            ),
            key=lambda t: t.shape[0],
            default=None,
        )
        if shared is None or shared.shape[0] < rows:
            shared = torch.zeros((rows, width), dtype=dtype, device=logits.device)
        return _Bucket(reqs, rows, shared, vocab, tensors)

    # ---- capture -------------------------------------------------------------------------------

    def _body(
        self,
        b: _Bucket,
        table: torch.Tensor,
        step: dict[str, Any],
        num_reqs: int,
        flags: torch.Tensor,
        prelude: Callable[[], Any] | None = None,
    ) -> Callable[[], Any] | Branch:
        """The body of a bucket's graph, reading the step's words in ``table`` (the device copy
        of :func:`_words`' layout; ``prelude`` first builds it, where given) and the step's
        fallback ``flags`` (``[>= num_reqs]`` bool).

        The whole step: the step's tensors into the bucket's buffers, the padding, vLLM's
        chain on the bucket, then its answers into the step's outputs (``resolve_apply``).
        Where the bucket has a capacity (:meth:`_compact`), a :class:`Branch` before it: the
        flagged requests picked on the device (``resolve_select``), their rows copied into a
        padded sub-batch, vLLM's chain on it (:func:`~shardmax.integrations.vllm.resolution.
        sub_chain`) and its answers into the step's outputs; the whole step runs only when more
        requests are flagged than the capacity holds (its answers then replace every
        request's)."""
        copy = kernels.kernel("table_copy")
        chain = self.chain
        s = b.static
        # the host arrays as they are now (a graph keeps the decisions it was captured with;
        # the eager stand-in keeps them too). The chain reads its host copies of the slots and
        # of cu_num_logits for its gates and chunks only: the bucket's slots (padding requests
        # on the first one's, which leaves vLLM's gates as they are) and a single chunk of
        # b.rows rows.
        slots = np.asarray(step["idx_mapping_np"])[:num_reqs]
        idx_np = np.concatenate([slots, np.full(b.reqs - num_reqs, slots[0], dtype=slots.dtype)])
        cu_np = np.arange(b.reqs + 1, dtype=np.int64)
        cu_np[-1] = b.rows
        kw: dict[str, Any] = {
            k: v.copy() if isinstance(v, np.ndarray) else v
            for k, v in step.items()
            if k not in _COPIED
        }
        kw.update(s, idx_mapping_np=idx_np, cu_num_logits_np=cu_np, checks=False)
        n, m = table[_NUM_REQS], table[_NUM_LOGITS]
        block = copy.module.BLOCK
        programs = max(
            1, min(_COPY_PROGRAMS, -(-b.logits.numel() * b.logits.element_size() // (16 * block)))
        )

        def body() -> Any:
            # the step's tensors into the bucket's buffers, then the padding
            copy((1, programs), table[_BODY:], BLOCK=block, SPREAD=True)
            copy((len(_COPIED) - 1,), table[_BODY + 3 :], BLOCK=block, SPREAD=False)
            real_req, real_row = b.req_iota < n, b.row_iota < m
            slot0 = s["idx_mapping"][0]
            s["idx_mapping"].copy_(torch.where(real_req, s["idx_mapping"], slot0))
            s["seq_lens"].copy_(torch.where(real_req, s["seq_lens"], s["seq_lens"][0]))
            cu = s["cu_num_logits"]
            cu.copy_(torch.where(b.cu_iota <= n, cu, b.cu_iota - n + m))
            s["expanded_idx_mapping"].copy_(torch.where(real_row, s["expanded_idx_mapping"], slot0))
            for name in ("expanded_local_pos", "pos", "draft_sampled"):
                s[name].masked_fill_(~real_row, 0)
            out = chain.verify(b.logits, **kw)
            apply_answers(out, table[_APPLY:], b.req_iota, b.reqs)
            b.flags.zero_()  # the next step's copy writes num_reqs flags: the rest stay clear
            self._keep_workspaces(b, out.sampled)
            return out

        compact = self._compact(b, kw, idx_np)
        if compact is None:
            if prelude is None:
                return body

            def whole() -> Any:
                prelude()
                return body()

            return whole
        select = kernels.kernel("resolve_select")
        sub = compact.sub
        req_sel = sub.table[sub.req_off : sub.req_off + sub.reqs]
        apply_words = sub.table[sub.apply_off :]
        esize = b.logits.element_size()
        vocab = int(b.logits.shape[1])
        row_bytes = int(b.logits_base.stride(0)) * esize  # the step's row stride (its key's)
        k = int(step["num_speculative_steps"])
        consts = {
            "NUM_REQS_AT": _NUM_REQS, "APPLY_AT": _APPLY, "LOGITS_AT": _BODY,
            "BLOCK_R": int(select.module.CONSTEXPRS["BLOCK_R"]), "CAP_P": _pow2(sub.reqs),
            "ROWS_P": _pow2(k + 1),
        }  # fmt: skip

        def first() -> torch.Tensor:
            if prelude is not None:
                prelude()
            # the step's small tensors into the bucket (the whole step's logits stay where
            # they are), then the flagged requests and their rows picked on the device
            copy((len(_COPIED) - 1,), table[_BODY + 3 :], BLOCK=block, SPREAD=False)
            select(  # (a view made here: a slot's outputs own their storage alone)
                (1,), table, flags.view(torch.uint8), s["cu_num_logits"], s["draft_sampled"], s["pos"],
                s["expanded_idx_mapping"], s["expanded_local_pos"], s["idx_mapping"],
                s["seq_lens"], sub.row_index["draft_sampled"], sub.row_index["pos"],
                sub.row_index["expanded_idx_mapping"], sub.row_index["expanded_local_pos"],
                sub.idx_mapping, sub.seq_lens, sub.cu, req_sel, apply_words, compact.entries,
                compact.over, sub.logits.data_ptr(), sub.logits.stride(0) * esize,
                compact.pad.data_ptr(), row_bytes, vocab * esize, sub.reqs, sub.rows, **consts,
            )  # fmt: skip
            copy((sub.rows, compact.programs), compact.entries, BLOCK=block, SPREAD=True)
            out = sub_chain(chain, sub, compact.gates, k, kw)
            if flags is b.flags:  # the second call's copy: clear for the next step's
                b.flags.zero_()
            self._keep_workspaces(b, out.sampled)
            return compact.over

        return Branch(first, body)

    def _keep_workspaces(self, b: _Bucket, like: torch.Tensor) -> None:
        """Under a capture: vLLM's top-k / top-p workspaces as the graph holds them, kept alive
        with the bucket."""
        if like.is_cuda and torch.cuda.is_current_stream_capturing():
            mod = self.chain.modules.topk_topp
            b.keep.append([dict(getattr(mod, name, {})) for name in _WORKSPACES])

    def _compact(self, b: _Bucket, kw: dict[str, Any], idx_np: np.ndarray) -> _Compact | None:
        """The bucket's padded sub-batch of flagged requests (decided once per bucket; the
        sub-batch's buffers shared by the buckets of one capacity and layout), or None
        where it has none: a capacity of 0 (``capacity``, :func:`default_capacity`) or of the
        whole bucket, or one whose padded rows would make vLLM pick another top-p pipeline or
        split count than the bucket's (:func:`~shardmax.integrations.vllm.resolution.
        fitting_capacity`)."""
        if b.decided:
            return b.compact
        b.decided = True
        cap = default_capacity(b.reqs) if self.capacity is None else self.capacity
        if not 0 < cap < b.reqs:
            return None
        chain = self.chain
        k = int(kw["num_speculative_steps"])
        vocab = int(b.logits.shape[1])
        gates = NativeChain._gates(idx_np, _state(kw), vocab, b.rows)
        pipeline = chain.topp_pipeline_for(
            b.rows, top_k_active=gates.do_k, top_p_active=gates.do_p,
            has_topp_only_rows=gates.only_p, device_type=b.logits.device.type,
        )  # fmt: skip
        if (
            fitting_capacity(chain, (cap,), cap, k, b.rows, vocab, pipeline, b.logits.device)
            is None
        ):
            return None
        rows = cap * (k + 1)
        like = {"logits": b.logits, **b.static}
        # one sub-batch per capacity and layout, shared by every bucket (their graphs replay in
        # stream order, and each body's resolve_select rewrites every row and index it reads)
        sub_key = (cap, k, vocab, b.logits.dtype, b.logits.device,
                   tuple(like[name].dtype for name in _INDEXED))  # fmt: skip
        sub = self._subs.get(sub_key)
        if sub is None:
            sub = self._subs[sub_key] = _Sub(rows, cap, like)
        b.compact = _Compact(sub, replace(gates, rows=gates_rows(chain, pipeline, rows, b.rows)))
        return b.compact

    def _capture(self, b: _Bucket, slot: _Slot, step: dict[str, Any], num_reqs: int) -> None:
        """Build a slot's graph (or its eager stand-in), the step's table already in the slot
        (the capture's warm-up runs the step once: the same answers, the flags then clear)."""
        copy = kernels.kernel("table_copy")
        fetch = kernels.kernel("table_fetch")
        table = b.table

        def prologue() -> torch.Tensor:
            # the slot's page-locked table into the device table (acknowledged), then the flags
            fetch((1,), table, slot.buf, _WORDS, BLOCK=fetch.module.BLOCK)
            copy((1,), table[_FLAGS:], BLOCK=copy.module.BLOCK, SPREAD=False)
            return b.flags  # (the padding's flags stay clear)

        body = self._body(b, table, step, num_reqs, b.flags)
        if b.table.device.type != "cuda":
            slot.graph = _Eager(prologue, body)  # the emulated capture (counted as one)
            self.stats["captured"] += 1
            return
        try:
            slot.graph = IfGraph(
                prologue, body, b.table.device, pool=self._pool.handle(b.table.device)
            )
        except Exception as e:  # a launch that cannot be captured: this signature reads flags
            b.failed = True
            self.stats["capture_failed"] += 1
            warnings.warn(
                f"shardmax: the device fallback's capture failed ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:200] if str(e) else ''}); its steps read the flags "
                "on the host",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        self.stats["captured"] += 1
