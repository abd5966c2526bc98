"""A plan's run replayed from a CUDA graph: a few host writes and one replay per step.

vLLM's model runner V2 calls verification eagerly, so every launch of a plan's ``run`` costs its
host time (20-30 us per Triton launch on the H200's host, ~100-330 us per step). A captured
graph replays all of them for ~6 us, but a graph's kernel arguments are fixed at capture while
the engine hands over new tensors every step. The step's addresses therefore travel through an
**argument table**, an int64 device tensor the graph reads at replay::

    table[0]                    the local logits' address (the kernels that read the logits
                                take it from here: their INDIRECT launches)
    table[1 : 1 + 3 * n_in]     per batch tensor: (its address, the static buffer's, bytes)
    table[1 + 3 * n_in :]       per output: (the static output's, the caller's tensor's, bytes)

and a captured step is::

    table_copy (batch tensors -> static buffers) -> the plan's launches + collectives on the
    static buffers, the logits read through table[0] -> table_copy (static outputs -> the
    tensors the caller gets)

Per step the host writes the table's input entries and replays a graph. The logits are never
copied: the kernels load their address (16-byte aligned, checked here; otherwise the step runs
eagerly). The batch tensors are copied byte for byte, so the kernels see exactly what the eager
``run`` would.

**Outputs without an allocation.** Besides the graph above (the *copy-out* graph) a captured
signature keeps :data:`SLOTS` *output slots*: graphs of the same step without the final copy,
each writing its own static outputs. A step replays the next slot (round robin) whose memory
nothing outside it refers to -- its storages' use counts (every tensor on them, whoever holds
it: a tensor, a view, an autograd saved tensor, a collective's handle) and the reference counts
of their Python storage objects, both as they were when the slot was made -- and returns new
aliases of the slot's outputs (``detach()``: new tensor objects on the same memory, so what a
caller does to its tensors' shapes or storage stays with them). Only when every slot is held
does it allocate new outputs and replay the copy-out graph (its table written into a numpy
array, then one host->device copy). So a caller that keeps outputs (vLLM keeps a step's until
its asynchronous copy to the host is done) never sees them overwritten, and a steady state
that drops them costs no output allocation (3 to 6 ``torch.empty`` of ~3.5 us host each on the
H200's host) and no copy kernel. A slot whose memory moved (a caller's ``resize_`` that grew
the storage), or whose replay raised, is retired. As with the caching allocator, a caller that
drops its outputs while work on another stream still reads them must synchronise that stream
first (or keep a reference, as vLLM does), and a raw address (``data_ptr()``) keeps nothing
alive.

**No copy call either.** Each slot has its own argument table in page-locked host memory, which
the GPU reads in place (unified addressing): the slot's graph starts with ``table_fetch``, one
small kernel copying it into the device table, so a replayed step's host work is writing a few
int64 into that buffer and one graph launch (a ``cudaMemcpyAsync`` through torch cost ~10-15 us
of host time on the H200's host). The host must not rewrite a table the GPU has not read yet
(the host may run steps ahead of the GPU): each step writes a request number after the
entries, the fetch writes it back as an acknowledgement once its loads are done, and a slot
whose last request is not acknowledged is not free (the step takes another slot, or copies
out, whose upload is stream-ordered). No step ever waits for the GPU. A dropped slot whose last
request is not acknowledged yet keeps its table alive (torch's page-locked allocator would hand
the memory out again at once while the queued fetch still reads it); such tables are let go
once acknowledged, checked whenever a slot is made or dropped.

One :class:`GraphedStep` per plan keeps its graphs per *batch signature* (requests, K, each
batch tensor's presence, dtype and length): a new signature runs eagerly the first time and is
captured the second (an engine's steady state repeats its shapes), at most
:data:`MAX_GRAPHS` per plan, least recently used out. Capturing (the copy-out graph and the
slots, all at once) synchronises the device; later steps of the signature never do.
On the CPU (the Triton interpreter) there is no graph: the same tables, fetches, copies and
indirect launches run eagerly (a slot's outputs are written by the copy), so the CPU tests
exercise everything except the capture itself.

At TP > 1 the capture is split at the step's collectives (:class:`_Segments`): graph, eager
collective, graph, ... -- each collective runs on its recorded input between the replays,
gathering straight into the static buffer the next graph reads (a collective without
``all_gather_dim0_into``: its result copied there; MAX reduces that input in place), so no NCCL
call is ever captured and every rank runs the same collectives in the same order as the eager
step. Plans whose
kernels read the logits directly (strict mode's block statistics: :func:`reads_logits_directly`)
replay on a static copy of the logits, copied in before each replay; every other logits-reading
kernel (the greedy keys, the sampled records and draws, top-p's level histograms) takes them
INDIRECT.

**Epilogues.** A caller may hand a step an :class:`Epilogue`: work the device runs behind the
step's kernels only when a predicate it computes from the step's outputs says so (the vLLM
plug-in's device fallback: vLLM's chain on the step where a request was flagged). At TP 1 the
signature's output slots are then captured as one conditional graph each
(:class:`~shardmax.runtime.conditional.IfGraph`: ``table_fetch`` -> the plan's launches -> the
predicate -> IF { the epilogue's body }), the epilogue's words appended to the slot's table and
fetched with it: still one table write and one launch per step, no host read. Steps that do not
replay from a slot (eager, copy-out, TP > 1) leave the epilogue unqueued for the caller.

Every captured step is bit-identical to the eager ``run`` on the same inputs (the GPU checks
compare them); the plain path is not replayed (:meth:`GraphedStep.supported`).
"""

from __future__ import annotations

import sys
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from contextlib import nullcontext as _nullcontext
from typing import Any, Protocol

import numpy as np
import torch

from shardmax.runtime import kernels
from shardmax.runtime.collectives import gather_into, reduce_max_in_place
from shardmax.runtime.conditional import run_eagerly
from shardmax.runtime.indirect import IndirectLogits

MAX_GRAPHS = 32
"""Captured batch signatures kept per plan (least recently used out)."""
CAPTURE_AFTER = 2
"""A batch signature is captured on its ``CAPTURE_AFTER``-th step (the earlier ones run eagerly)."""
SLOTS = 3
"""Output slots per captured batch signature (module docstring): the outputs a caller may hold
while the next steps run without allocating (vLLM holds a step's while the next one runs)."""

_UNFETCHED: list[tuple[torch.Tensor, np.ndarray, int, int]] = []
"""Host tables of dropped slots whose last request the GPU had not fetched yet: (buffer, its
numpy view, ack index, request), kept alive until acknowledged -- torch's page-locked allocator
hands a freed buffer out again at once, while a queued fetch would still read it and write its
acknowledgement into it. Checked (:func:`_release_fetched`) whenever a slot is made or
dropped."""


def _release_fetched() -> None:
    """Lets go of the kept host tables the GPU has fetched since."""
    _UNFETCHED[:] = [e for e in _UNFETCHED if e[1][e[2]] != e[3]]


_use_count = getattr(torch._C, "_storage_Use_Count", None)
"""References to a storage (torch's own liveness test of CUDA-graph outputs, in
``torch._inductor.cudagraph_trees``); without it no slot is used and every step copies out."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def batch_signature(batch: Any) -> tuple[Any, ...]:
    """What a captured graph depends on besides the plan: the batch's device index
    (``get_device()`` of its first tensor: -1 on the CPU; every tensor of a checked batch is on
    the one device) and each field of the :class:`~shardmax.runtime.validation.StepBatch` -- a
    tensor by its dtype and length (``numel()``: every tensor of a checked batch is 1-D and
    contiguous; half the host time of ``shape[0]``), K and absent tensors (None) as they are."""
    T = torch.Tensor
    return (
        batch[0].get_device(),
        *[t if type(t) is not T else (t.dtype, t.numel()) for t in batch],
    )


class FetchedTable:
    """A page-locked host table a graph fetches (``table_fetch``): ``host`` is ``[entries,
    request, acknowledgement]``; the host rewrites it only once the GPU has fetched it for its
    last request (:meth:`fetched`), then marks the new one (:meth:`request`). Dropped while a
    fetch is still queued, its memory is kept (:data:`_UNFETCHED`) until acknowledged."""

    __slots__ = ("_ack", "buf", "host", "seq")

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf, self.host = buf, buf.numpy()  # entries, request, acknowledgement
        self._ack = len(self.host) - 1
        self.seq = int(self.host[self._ack - 1])  # the last request written

    def fetched(self) -> bool:
        """Whether the GPU has fetched the table for its last request."""
        return bool(self.host[self._ack] == self.seq)

    def request(self) -> None:
        """Marks the table just written as a new request: the fetch acknowledges it."""
        self.seq += 1
        self.host[self._ack - 1] = self.seq

    def __del__(self) -> None:
        # a fetch still queued reads this table and writes its acknowledgement into it: the
        # buffer must outlive it (module-level _UNFETCHED)
        try:
            if self.host[self._ack] != self.seq:
                _UNFETCHED.append((self.buf, self.host, self._ack, self.seq))
            _release_fetched()
        except Exception:  # interpreter shutdown: nothing runs any more
            pass


class _Slot(FetchedTable):
    """Static outputs of one replay (and, on a GPU, the graph that writes them), and the slot's
    own argument table in page-locked host memory that the graph fetches (``table_fetch``) at
    its start.

    The static tensors never leave the slot: a step gets new aliases of them (``detach()``: new
    tensor objects on the same memory), so whatever a caller does to its tensors' shape, strides
    or storage (``unsqueeze_``, ``set_``, ...) stays with that step's tensors, and any holder of
    an alias -- a tensor, a view, the storage object, a C++ reference such as an autograd saved
    tensor or an asynchronous collective's handle -- holds the storage.

    The host table (``host``: ``[entries, request, acknowledgement]``) is rewritten only once
    the GPU has fetched it for the slot's previous step: each step writes its request number,
    the fetch writes it back as the acknowledgement, and until it has, the slot is not free."""

    __slots__ = ("_cdata", "_idle", "_ptrs", "_storages", "fold", "graph", "made", "retired",
                 "static")  # fmt: skip

    def __init__(
        self,
        outputs: list[torch.Tensor],
        graph: Any,
        buf: torch.Tensor,
        fold: tuple[Callable[[], torch.Tensor], Callable[[], Any]] | None = None,
    ) -> None:
        # the static outputs (the graph's, or on the CPU the copy's destinations)
        self.static, self.graph = outputs, graph
        # off CUDA, an epilogue's (predicate, body), run eagerly after the step
        self.fold = fold
        self.made: Any = None  # the static outputs as the plan returns them (epilogue words)
        super().__init__(buf)  # the slot's table
        # held, not only counted: their Python objects are what a caller's untyped_storage()
        # returns (one per storage), so their reference counts are holders too
        self._storages = [t.untyped_storage() for t in outputs]
        self._cdata = [st._cdata for st in self._storages]  # stable: the storages are held
        self._ptrs = [t.data_ptr() for t in outputs]
        self.retired = False
        self._idle = self._holders()  # the slot's own references only
        _release_fetched()

    def _holders(self) -> list[int]:
        """References to each storage's Python object, then the storage's use count (every
        tensor on it, whoever holds that tensor). One code path for the baseline and every
        test: what the comprehensions themselves hold counts the same both times."""
        assert _use_count is not None
        refs = [sys.getrefcount(st) for st in self._storages]
        return refs + [_use_count(cd) for cd in self._cdata]

    def free(self) -> bool:
        """Whether the GPU has fetched the slot's table for its last step and nothing outside
        the slot refers to its memory (no more references than at the slot's making). A slot
        whose memory moved (a caller's ``resize_`` that had to grow the storage) is retired: its
        graph would write where the memory was (so is a slot whose replay raised, in
        :meth:`_Captured.run`)."""
        if self.retired or not self.fetched():
            return False
        if [st.data_ptr() for st in self._storages] != self._ptrs:
            self.retired = True
            return False
        return all(map(int.__le__, self._holders(), self._idle))

    def take(self) -> list[torch.Tensor]:
        """This step's tensors: new aliases of the static outputs."""
        return [t.detach() for t in self.static]

    def exclusive(self) -> bool:
        """Whether every output owns its memory alone (no view of a larger buffer, e.g. a
        workspace, that would be rewritten by other steps): as many references to its storage
        as to a new tensor's."""
        assert _use_count is not None
        probe = torch.empty(1, device=self.static[0].device)  # alive while counted
        lone = _use_count(probe.untyped_storage()._cdata)
        return all(
            st.nbytes() == _nbytes(t) and _use_count(st._cdata) <= lone
            for t, st in zip(self.static, self._storages, strict=True)
        )


class _Captured:
    """One batch signature of one plan: the table, the static buffers and (on a GPU) the graph."""

    def __init__(
        self,
        plan: Any,
        logits: torch.Tensor,
        batch: Any,
        static_logits: torch.Tensor | None = None,
        epilogue: Any = None,
    ) -> None:
        dev = logits.device
        self.plan, self.device = plan, dev
        # the signature's epilogue (its slots' conditional node; the copy-out graph has none)
        self.epilogue = epilogue
        self.folded = False  # whether the slots run it (set by _setup)
        self.fold_at = 0  # where its words start in the tables (after the outputs' entries)
        # the batch's tensors, by position in the StepBatch: the table's input entries
        self.fields = [i for i, t in enumerate(batch) if type(t) is torch.Tensor]
        self.n_in = len(self.fields)
        # static copies of the batch tensors, holding this step's values (the warm-up and the
        # capture run on them; every index the kernels load is clamped anyway)
        static = [batch[i].clone() for i in self.fields]
        self.static_batch = type(batch)(
            *(static[self.fields.index(i)] if i in self.fields else v for i, v in enumerate(batch))
        )
        self.host = np.zeros(1 + 3 * self.n_in, dtype=np.int64)
        self._host_t = torch.from_numpy(self.host)
        for j, t in enumerate(static):
            self.host[2 + 3 * j] = t.data_ptr()
            self.host[3 + 3 * j] = _nbytes(t)
        self._static = static  # kept alive: the table points at them
        self.graph: _Segments | None = None
        self.outputs: list[torch.Tensor] = []
        self.slots: list[_Slot] = []
        self._next = 0  # the slot after the one handed out last: tried first
        # plans whose kernels read the logits directly (strict mode) run
        # on a static copy of them (the caller's logits copied in before each replay), one per
        # plan (GraphedStep.static_logits), shared by its batch signatures
        self.static_logits = static_logits
        if static_logits is not None:
            static_logits.copy_(logits)
        self._set_table(len(self.host))
        side = torch.cuda.Stream(device=dev) if dev.type == "cuda" else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(dev))
        try:
            with torch.cuda.stream(side) if side is not None else _nullcontext():
                self._setup(logits, batch)
        finally:
            if side is not None:  # the caller's stream waits for the warm-up and the capture
                torch.cuda.current_stream(dev).wait_stream(side)

    def _setup(self, logits: torch.Tensor, batch: Any) -> None:
        """Warm-up runs (compile, size the outputs), the full table, the capture on a GPU."""
        self._fill(self.host, logits, batch, ())
        self._upload()
        res = self._body(copy_out=False)  # compiles; sizes the outputs
        self.make: Callable[[list[Any]], Any] = getattr(type(res), "_make", tuple)
        first = list(res)
        if not all(type(t) is torch.Tensor and t.is_contiguous() for t in first):
            raise TypeError(f"{type(self.plan).__name__}.run: outputs are not contiguous tensors")
        self.outputs = [torch.empty_like(t) for t in first]
        n = len(self.host)
        self.fold_at = n + 3 * len(first)
        extra = self.epilogue.words if self.epilogue is not None else 0
        self.host = np.concatenate([self.host, np.zeros(3 * len(first) + extra, dtype=np.int64)])
        self._host_t = torch.from_numpy(self.host)
        for j, t in enumerate(first):
            self.host[n + 3 * j] = t.data_ptr()
            self.host[n + 3 * j + 2] = _nbytes(t)
        if self.epilogue is not None:  # a capture's words: its warm-up writes no answer
            self.epilogue.write(self.host[self.fold_at :], self.make(first), capture=True)
        self._set_table(len(self.host))
        if self.device.type == "cuda":
            self._fill(self.host, logits, batch, self.outputs)
            self._upload()
            self._body(copy_out=True)  # warm-up of the whole step (table_copy compiled)
            graph = _Segments(self.plan.ctx)
            outs = list(graph.capture(lambda: self._body(copy_out=True)))
            for j, t in enumerate(outs):  # the graph's own outputs: the copies' sources
                self.host[n + 3 * j] = t.data_ptr()
            self._graph_outputs = outs  # kept alive: the graph writes them
            self.graph = graph
            self.plan.ctx.workspace.captured = True  # its buffers outlive a later growth
        self._first = first  # the interpreter's table points at them until a run
        del res, first
        if _use_count is not None and self.outputs:
            slots = self._slots()
            if not slots and self.epilogue is not None:  # slots without it, rather than none
                self.epilogue = None
                slots = self._slots()
            if all(slot.exclusive() for slot in slots):  # else every step copies out
                self.slots = slots
        # whether the slots run the epilogue; the capture step's epilogue itself (its tensors:
        # the step's logits among them) is not kept
        self.folded = self.epilogue is not None and bool(self.slots)
        self.epilogue = None

    def _slots(self) -> list[_Slot]:
        """:data:`SLOTS` new output slots (with the epilogue, if any), or none where one
        cannot be made (warned)."""
        try:
            return [self._slot() for _ in range(SLOTS)]
        except Exception as e:  # e.g. out of memory, or an epilogue that cannot be captured
            what = " with their epilogue" if self.epilogue is not None else ""
            then = "they run without it" if self.epilogue is not None else "its steps copy out"
            warnings.warn(
                f"shardmax: output slots of {type(self.plan).__name__} not captured{what} "
                f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); {then}",
                RuntimeWarning,
                stacklevel=3,
            )
            return []

    def _slot(self) -> _Slot:
        """A new output slot: its host table (page-locked on a GPU, so the GPU reads it in
        place), fetched once eagerly (which compiles the fetch and acknowledges request 0); on a
        GPU the step without the copy-out captured behind the fetch (its graph's own outputs are
        the slot's), on the CPU tensors the eager copy writes."""
        n = len(self.host)
        buf = torch.empty(n + 2, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        host = buf.numpy()
        host[:n] = self.host
        host[n:] = (0, -1)  # request 0, not acknowledged yet
        self._fetch(buf)
        ep = self.epilogue
        if self.device.type != "cuda":
            outs = [torch.empty_like(t) for t in self.outputs]
            fold = None if ep is None else ep.capture(self.table[self.fold_at :], self.make(outs))
            return _Slot(outs, None, buf, fold)

        def body() -> Any:
            self._fetch(buf)
            return self._body(copy_out=False)

        try:
            if ep is None:
                graph: Any = _Segments(self.plan.ctx)
                outs = list(graph.capture(body))
            else:
                graph = _FoldedGraph(self, body, ep)
                outs = graph.outputs
        except BaseException:  # the eager fetch may still be queued: keep its table until read
            _UNFETCHED.append((buf, host, n + 1, 0))
            raise
        return _Slot(outs, graph, buf)

    def _fetch(self, buf: torch.Tensor) -> None:
        """``table_fetch``: a slot's host table into the device table, then its acknowledgement."""
        fetch = kernels.kernel("table_fetch")
        fetch((1,), self.table, buf, len(self.host), BLOCK=fetch.module.BLOCK)

    def _set_table(self, n: int) -> None:
        self.table = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.indirect = IndirectLogits(
            self.table, 0, (self.plan.num_logits, self.plan.ctx.width), self.plan.row_stride,
            self.plan.ctx.dtype,
        )  # fmt: skip

    def _upload(self) -> None:
        """The host table to the device, from pageable memory: the driver stages a pageable
        source into its own pinned buffer before ``cudaMemcpyAsync`` returns and does not wait
        for the device, so the host table may be rewritten at once (a GPU check enqueues the
        copy behind milliseconds of work, rewrites the source and reads the copy). About 10 us
        of host time on the H200's host (the write and the copy: 12.3-20.3 us p50 against
        2.5-9.3 for writing a slot's page-locked table). On the CPU the table is written in
        place."""
        if self._host_t.device.type == self.table.device.type:
            self.table.copy_(self._host_t)
        else:
            self.table.copy_(self._host_t, non_blocking=True)

    def _body(self, copy_out: bool) -> Any:
        copy = kernels.kernel("table_copy")
        if self.n_in:
            copy((self.n_in,), self.table[1:], BLOCK=copy.module.BLOCK, SPREAD=False)
        res = self.plan.run(
            self.static_logits if self.static_logits is not None else self.indirect,
            self.static_batch,
        )
        if copy_out:
            outs = list(res)
            n = 1 + 3 * self.n_in
            if self.graph is None and self.device.type != "cuda":
                # the interpreter runs the body every step: this run's outputs are the sources
                tab = self.table.numpy()
                for j, t in enumerate(outs):
                    tab[n + 3 * j] = t.data_ptr()
            copy((len(outs),), self.table[n:], BLOCK=copy.module.BLOCK, SPREAD=False)
        return res

    def _fill(
        self, h: np.ndarray, logits: torch.Tensor, batch: Any, outs: Sequence[torch.Tensor]
    ) -> None:
        h[0] = logits.data_ptr()
        for j, i in enumerate(self.fields):
            h[1 + 3 * j] = batch[i].data_ptr()
        base = 2 + 3 * self.n_in
        for j, t in enumerate(outs):
            h[base + 3 * j] = t.data_ptr()

    def run(self, logits: torch.Tensor, batch: Any, epilogue: Any = None) -> Any:
        # round robin from the slot after the last one handed out: a caller that keeps its
        # last outputs or two (vLLM, until their copy to the host is done) finds it free at once
        slot, n = None, len(self.slots)
        for k in range(n):
            i = (self._next + k) % n
            if self.slots[i].free():
                slot, self._next = self.slots[i], (i + 1) % n
                break
        if slot is None:  # every slot held (or none): new outputs, the copy-out graph
            outs = [torch.empty_like(t) for t in self.outputs]
            self._fill(self.host, logits, batch, outs)
            self._upload()
            if self.static_logits is not None:
                self.static_logits.copy_(logits)
            if self.graph is not None:
                self.graph.replay()
            else:
                self._body(copy_out=True)
            return self.make(outs)
        # the slot's own table, read by its graph in place: no copy call
        self._fill(slot.host, logits, batch, () if slot.graph is not None else slot.static)
        if not self.folded:
            epilogue = None  # (its capture failed: the slots run the step alone)
        if epilogue is not None:  # this step's words (its own tensors, the slot's outputs)
            if slot.made is None:  # made once per slot: the same tensor objects every step
                slot.made = self.make(slot.static)
            epilogue.write(slot.host[self.fold_at :], slot.made)
        if self.static_logits is not None:
            self.static_logits.copy_(logits)
        slot.request()
        try:
            if slot.graph is not None:
                slot.graph.replay()
            else:
                self._fetch(slot.buf)
                self._body(copy_out=True)
                if slot.fold is not None:  # off CUDA: the predicates read on the host
                    predicate, fold_body = slot.fold
                    if bool(predicate().any()):
                        run_eagerly(fold_body)
        except BaseException:  # the request may never be fetched: never wait for it
            slot.retired = True
            raise
        if epilogue is not None:
            epilogue.queued = True
        return self.make(slot.take())


class Epilogue(Protocol):
    """Work a replayed step runs behind its kernels only when the device says so: a
    conditional node in the output slot's graph (:class:`~shardmax.runtime.conditional.IfGraph`),
    so the step stays one graph launch with one table and no host read. A new object per step.

    The graph of a batch signature is captured per ``key`` too; its argument tables get
    ``words`` more int64 entries after the outputs' (fetched with the rest), which the step
    writes (:meth:`write`) and the epilogue's body reads on the device (:meth:`capture`)."""

    key: Hashable
    """What the epilogue's capture depends on besides the batch signature."""
    words: int
    """Its int64 words in the step's table."""

    def pool(self, device: torch.device) -> Any:
        """The CUDA-graph memory pool its captures on ``device`` allocate from (None: a new
        one per graph; a shared one must outlive the graphs' releases:
        :class:`shardmax.runtime.pools.GraphPool`)."""

    queued: bool
    """Set True by the step that ran it (queued on the device); False otherwise."""

    def write(self, host: np.ndarray, result: Any, capture: bool = False) -> None:
        """This step's words into ``host`` (``words`` entries of a page-locked table):
        ``result`` is the step's outputs (the slot's static ones, as ``plan.run`` returns them);
        ``capture``: a capture's table, whose eager warm-up must leave every output as it is."""

    def capture(self, table: torch.Tensor, result: Any) -> tuple[Callable[[], torch.Tensor], Any]:
        """``(predicate, body)`` of one slot: ``table`` is the device view of its words,
        ``result`` the slot's outputs. ``predicate()`` launches what decides and returns it (a
        contiguous bool / uint8 tensor of one dimension at most: run when any element is
        nonzero), ``body()`` the work -- or ``body`` a
        :class:`~shardmax.runtime.conditional.Branch`, which decides again on the device
        (nested IF nodes). On CUDA both are captured and run
        once eagerly before (``IfGraph`` 's warm-up; ``capture`` is called for the warm-up and
        again for the capture, the second pair kept), so they must be capturable; off CUDA
        they run eagerly on each step of the slot (the predicate read on the host). Raising
        here makes the signature's slots without the epilogue (warned)."""


class _FoldedGraph:
    """An output slot's step and its epilogue: ``table_fetch`` -> the plan's launches ->
    ``epilogue``'s predicate -> IF { its body }, one CUDA graph (TP 1: no collective)."""

    __slots__ = ("_keep", "graph", "outputs")

    def __init__(self, captured: _Captured, step: Callable[[], Any], epilogue: Any) -> None:
        from shardmax.runtime.conditional import IfGraph, Later

        table = captured.table[captured.fold_at :]
        box: dict[str, Any] = {}

        def prologue() -> torch.Tensor:
            outs = list(step())
            # the capture (the second call, after the warm-up) binds the body to its outputs
            box["outs"], box["fold"] = outs, epilogue.capture(table, captured.make(outs))
            return box["fold"][0]()

        # the body the capture's epilogue named (a callable, or a Branch: nested IF nodes)
        body = Later(lambda: box["fold"][1])
        self.graph = IfGraph(prologue, body, captured.device, pool=epilogue.pool(captured.device))
        self.outputs: list[torch.Tensor] = box["outs"]  # the captured step's own outputs
        self._keep = box  # the body's buffers (and the epilogue's state) live with the graph

    def replay(self) -> None:
        self.graph.launch()


def reads_logits_directly(plan: Any) -> bool:
    """Whether ``plan``'s kernels read the logits outside the INDIRECT launches (strict mode's
    block statistics): its captured step then copies the caller's logits into a static buffer
    before each replay (one device copy of the shard). Level-histogram top-p's histogram kernel
    reads them INDIRECT like the record and draw kernels."""
    return getattr(plan, "strict", None) is not None


class _Segments:
    """A step's launches captured as CUDA graphs split at its collectives.

    A collective of a TP group of more than one rank is never captured: the capture ends at
    each one, the collective's input (a tensor of the graph's pool, kept alive) and a static
    output buffer are recorded, and the next graph begins; at replay each graph is replayed and
    each collective is called eagerly between them on the recorded input, gathering into the
    static output the next graph reads (:func:`~shardmax.runtime.collectives.gather_into`: no
    output allocation and no copy for a collective with ``all_gather_dim0_into``, as the
    built-in ones; MAX stays in place, its static output being its input). So a captured step
    runs exactly the collectives of the eager step, in order, on every rank (each rank
    captures at the same step, as every rank sees the same batch shapes), and no NCCL call
    sits inside a graph. A group of one rank returns its input: nothing to split.
    """

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.calls: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        self._pool: Any = None

    def _begin(self) -> None:
        g = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g.capture_begin(pool=self._pool, capture_error_mode="thread_local")
        self.graphs.append(g)

    def _end(self) -> None:
        self.graphs[-1].capture_end()

    def _split(self, name: str, t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        self._end()
        self.calls.append((name, t, out))
        self._begin()
        return out

    def capture(self, body: Callable[[], Any]) -> Any:
        """``body()`` captured (its collectives recorded, not run); returns its result."""
        real = self.ctx.coll
        splitting = real.world_size > 1
        if splitting:
            self.ctx.coll = _SplittingCollective(real, self)
        self._begin()
        try:
            res = body()
        finally:
            self.ctx.coll = real  # first: ending an invalidated capture raises
            self._end()
        return res

    def replay(self) -> None:
        coll = self.ctx.coll
        for i, g in enumerate(self.graphs):
            g.replay()
            if i < len(self.calls):
                name, t, out = self.calls[i]
                if name == "all_gather_dim0":  # straight into the next graph's buffer
                    gather_into(coll, t, out)
                else:  # MAX in place: the next graph reads its input (``out is t``)
                    reduce_max_in_place(coll, t)


class _SplittingCollective:
    """The collective a step sees while :class:`_Segments` captures it (TP > 1)."""

    def __init__(self, real: Any, segments: _Segments) -> None:
        self.real, self.segments = real, segments

    @property
    def world_size(self) -> int:
        return int(self.real.world_size)

    @property
    def rank(self) -> int:
        return int(self.real.rank)

    def all_gather_dim0(self, t: torch.Tensor) -> torch.Tensor:
        out = torch.empty((self.world_size * t.shape[0], *t.shape[1:]), dtype=t.dtype,
                          device=t.device)  # fmt: skip
        return self.segments._split("all_gather_dim0", t, out)

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        # in place, as the protocol's MAX: the next graph reads the reduced input itself
        return self.segments._split("all_reduce_max", t, t)


class GraphedStep:
    """A plan's ``run(local_logits, batch)`` replayed from CUDA graphs (module docstring).

    Args:
        plan: a greedy-verification or sampled-verification plan of :mod:`shardmax.ops` whose
            ``run(local_logits, batch)`` returns a tuple (or NamedTuple) of tensors
            (:meth:`supported`).

    Raises:
        ValueError: a plan that cannot be replayed (:meth:`unsupported` says why).

    ``run`` returns what the plan's ``run`` returns, bit for bit, without a host sync after the
    capture. Its outputs are new tensor objects, but on a replayed step their memory is one of a
    few output slots, handed out again once nothing refers to it any more (module docstring):
    the caller may keep them for as long as it likes. Runs of one shard's plans and
    graphs must be ordered on one stream.
    """

    def __init__(self, plan: Any) -> None:
        reason = self.unsupported(plan)
        if reason:
            raise ValueError(f"plan: {reason}")
        self.plan = plan
        self._graphs: OrderedDict[tuple[Any, ...], _Captured] = OrderedDict()
        self._static: torch.Tensor | None = None
        self._seen: dict[tuple[Any, ...], int] = {}
        self._failed: set[tuple[Any, ...]] = set()

    @staticmethod
    def unsupported(plan: Any) -> str:
        """Why ``plan`` cannot be replayed from a graph ("" when it can): the plain path reads
        the logits with torch ops and gathers them whole."""
        if getattr(plan, "plain", None) is not None:
            return "the plain path (full-logits gather) reads the logits with torch ops"
        if not hasattr(plan, "num_logits"):
            return f"{type(plan).__name__} is not a verification plan (run(local_logits, batch))"
        if not hasattr(plan, "run"):
            return f"{type(plan).__name__} has no run()"
        return ""

    @classmethod
    def supported(cls, plan: Any) -> bool:
        return not cls.unsupported(plan)

    def run(self, local_logits: torch.Tensor, batch: Any, epilogue: Any = None) -> Any:
        """The plan's ``run``: eagerly for a new batch signature, from its graph afterwards.

        Args:
            local_logits: the rank's logits, as ``plan.run`` takes them.
            batch: a :class:`~shardmax.runtime.validation.StepBatch` from ``check_step_batch``
                (its tensors unit-stride, as every plan's kernels assume; the replay copies
                them byte for byte).
            epilogue: an :class:`Epilogue` of this step (TP 1 only; ignored in a TP group of
                more ranks): where the step replays from an output slot, the slot's graph runs
                it behind the step's kernels (a conditional node) and ``epilogue.queued`` is set
                True; on every other step (eager, copy-out, TP > 1) it is not run and stays
                False -- the caller then does its work itself.

        Raises what ``plan.run`` raises for bad logits or a batch of another shape."""
        plan = self.plan
        if epilogue is not None and plan.ctx.coll.world_size > 1:
            epilogue = None  # a conditional body cannot hold the step's collectives
        if (
            batch.num_reqs == 0
            or type(local_logits) is not torch.Tensor
            or (local_logits.is_cuda and torch.cuda.is_current_stream_capturing())
        ):  # nothing to launch, or inside the caller's own capture: the plan's launches
            return plan.run(local_logits, batch)
        plan.ctx.check_logits(local_logits, plan.num_logits, plan.row_stride)
        if local_logits.data_ptr() % 16:  # the INDIRECT kernels assume 16-byte alignment
            return plan.run(local_logits, batch)
        key = batch_signature(batch)
        if epilogue is not None:
            key = (key, epilogue.key)
        got = self._graphs.get(key)
        if got is not None:
            self._graphs.move_to_end(key)
            return got.run(local_logits, batch, epilogue)
        seen = self._seen.get(key, 0) + 1
        if seen < CAPTURE_AFTER:
            res = plan.run(local_logits, batch)  # raises on a batch the plan refuses
            if len(self._seen) >= 4 * MAX_GRAPHS:  # shapes seen once each: forget them
                self._seen.clear()
            self._seen[key] = seen  # counted once the plan took it: only those are captured
            return res
        self._seen.pop(key, None)
        if key in self._failed:
            return plan.run(local_logits, batch)
        try:
            got = _Captured(plan, local_logits, batch, self._static_logits(local_logits), epilogue)
        except Exception as e:  # a launch or collective that cannot be captured: stay eager
            self._failed.add(key)
            warnings.warn(
                f"shardmax: CUDA-graph capture of {type(plan).__name__} failed "
                f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); this batch shape runs "
                "eagerly",
                RuntimeWarning,
                stacklevel=2,
            )
            return plan.run(local_logits, batch)
        self._graphs[key] = got
        if len(self._graphs) > MAX_GRAPHS:
            self._graphs.popitem(last=False)
        return got.run(local_logits, batch, epilogue)

    def _static_logits(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The plan's static copy of the logits (plans that read them directly), allocated once
        with the plan's row stride: every captured signature of the plan replays on it."""
        if not reads_logits_directly(self.plan):
            return None
        if self._static is None:
            rows, width = logits.shape
            stride = max(int(self.plan.row_stride), width) if rows else width
            self._static = torch.empty((rows, stride), dtype=logits.dtype, device=logits.device)[
                :, :width
            ]
        return self._static

    @property
    def num_graphs(self) -> int:
        """Batch signatures captured (or, on the CPU, set up) so far."""
        return len(self._graphs)
