"""A body of GPU work the device decides to run: a CUDA graph with a conditional IF node.

A sampled step sometimes needs more work after its kernels -- a request it could not certify
must be verified the native way -- and only the device knows whether it does. Reading that on
the host costs a sync per step, which stalls an engine that prepares the next step while the
GPU runs this one. CUDA 12.4's *conditional nodes* move the decision to the device: a graph
whose IF node runs its body only when a kernel before it set the node's condition.

:class:`IfGraph` builds such a graph from two pieces captured with PyTorch (so their kernels,
torch ops and allocations are what an ordinary ``torch.cuda.graph`` capture records):

* the **prologue**: whatever computes the predicate, ending with one launch of
  ``shardmax_set_conditional`` that reads the predicate (a byte or an array of bytes, one warp;
  any nonzero = run) and sets the IF node's condition (``cudaGraphSetConditional``);
* the **body**: the work to run when the predicate is set;

then puts them together with the CUDA driver API (ctypes; PyTorch 2.11, the H200 image's, has
no conditional-node API of its own)::

    child graph (prologue) -> IF node { child graph (body) }

A body may decide again (:class:`Branch`: its first piece computes a second predicate, its
rare case runs behind it), which nests the same two nodes inside the IF node's body graph
(conditional bodies may hold conditionals: CUDA 12.4's rules)::

    child graph (prologue) -> IF node { child graph (first) -> IF node { child graph (then) } }

and instantiates it. :meth:`IfGraph.launch` is one ``cuGraphLaunch`` on the current stream: no
host sync, whatever the predicate. ``shardmax_set_conditional`` is a one-warp kernel
written in PTX (:data:`SET_CONDITIONAL_PTX`; Triton cannot call the device runtime), JIT-compiled
by the driver once per process and device.

Requirements (:func:`unavailable` says which one is missing): a CUDA device, a driver with
conditional nodes (CUDA 12.4+), and a PyTorch whose ``CUDAGraph`` keeps its captured graph
(``keep_graph=True``, ``raw_cuda_graph()``). A conditional body may only hold kernels, memsets,
memcopies, child graphs and conditionals (no event or host nodes, no NCCL): the bodies here are
captured without programmatic dependent launch (:func:`shardmax.runtime.kernels.set_pdl`), whose
edges the driver does not document for conditional bodies; the prologue, a child graph before
the IF node, keeps the caller's setting (a folded step's kernels overlap their launches as in
its plain graph).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["SET_CONDITIONAL_PTX", "Branch", "IfGraph", "Later", "run_eagerly", "unavailable"]

SET_CONDITIONAL_PTX = b"""
.version 8.3
.target sm_80
.address_size 64

.extern .func cudaGraphSetConditional
(
    .param .b64 handle,
    .param .b32 value
)
;

.visible .entry shardmax_set_conditional(
    .param .u64 handle_param,
    .param .u64 predicate_param,
    .param .u32 n_param
)
{
    .reg .pred %p<4>;
    .reg .b16 %h<2>;
    .reg .b32 %r<8>;
    .reg .b64 %rd<6>;

    ld.param.u64 %rd1, [handle_param];
    ld.param.u64 %rd2, [predicate_param];
    ld.param.u32 %r1, [n_param];
    cvta.to.global.u64 %rd3, %rd2;
    mov.u32 %r2, %tid.x;
    mov.u32 %r3, 0;
$L_next:
    setp.ge.u32 %p1, %r2, %r1;
    @%p1 bra $L_vote;
    cvt.u64.u32 %rd4, %r2;
    add.s64 %rd5, %rd3, %rd4;
    ld.global.u8 %h1, [%rd5];
    cvt.u32.u16 %r4, %h1;
    or.b32 %r3, %r3, %r4;
    add.s32 %r2, %r2, 32;
    bra.uni $L_next;
$L_vote:
    setp.ne.u32 %p2, %r3, 0;
    vote.sync.any.pred %p3, %p2, 0xffffffff;
    mov.u32 %r5, %tid.x;
    setp.ne.u32 %p1, %r5, 0;
    @%p1 bra $L_done;
    selp.u32 %r6, 1, 0, %p3;
    {
    .param .b64 param0;
    st.param.b64 [param0+0], %rd1;
    .param .b32 param1;
    st.param.b32 [param1+0], %r6;
    call cudaGraphSetConditional, (param0, param1);
    }
$L_done:
    ret;
}
"""
"""``shardmax_set_conditional(handle, predicate, n)``, launched as one warp: its 32 lanes read
the ``n`` bytes at ``predicate`` (lane ``i`` bytes ``i, i + 32, ...``), vote, and lane 0 sets
the conditional ``handle`` to 1 when any byte is nonzero, else 0 -- so a prologue's predicate
may be a whole array of flags, with no reduction kernel of its own before this one (PTX ISA
8.3, CUDA 12.3's, the first with ``cudaGraphSetConditional``; JIT-compiled for the device by
the driver)."""

# cuda.h (CUDA 12.4+): CU_GRAPH_NODE_TYPE_CONDITIONAL, CU_GRAPH_COND_TYPE_IF,
# CU_GRAPH_COND_ASSIGN_DEFAULT; CUgraphNodeParams is 256 bytes, its union at byte 16;
# CUDA_CONDITIONAL_NODE_PARAMS: handle u64 @0, type i32 @8, size u32 @12, phGraph_out @16, ctx @24
_NODE_CONDITIONAL = 13
_COND_IF = 0
_ASSIGN_DEFAULT = 1


class _ConditionalParams(ctypes.Structure):
    _fields_ = [
        ("handle", ctypes.c_uint64),
        ("type", ctypes.c_int),
        ("size", ctypes.c_uint),
        ("phGraph_out", ctypes.POINTER(ctypes.c_void_p)),
        ("ctx", ctypes.c_void_p),
    ]


class _NodeParams(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("reserved0", ctypes.c_int * 3),
        ("conditional", _ConditionalParams),
        ("pad", ctypes.c_byte * (232 - ctypes.sizeof(_ConditionalParams))),
        ("reserved2", ctypes.c_int64),
    ]


class _Driver:
    """The few CUDA driver entry points used here (``libcuda``), each checked."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.modules: dict[int, tuple[ctypes.c_void_p, ctypes.c_void_p]] = {}
        self.lock = threading.Lock()

    def __call__(self, name: str, *args: Any) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            self.check(name, rc)

    def check(self, name: str, rc: int) -> None:
        """Raises for a driver call ``name`` that returned ``rc`` (0: nothing)."""
        if rc != 0:
            msg = ctypes.c_char_p()
            self.lib.cuGetErrorString(rc, ctypes.byref(msg))
            text = msg.value.decode() if msg.value else "unknown error"
            raise RuntimeError(f"{name} failed: CUDA driver error {rc} ({text})")

    def graph_launch(self) -> Any:
        """``cuGraphLaunch(exec, stream)`` with its argument types bound (a handle and a raw
        stream, both plain integers): returns the driver's result code."""
        fn = self.lib.cuGraphLaunch
        fn.argtypes = (ctypes.c_void_p, ctypes.c_void_p)
        fn.restype = ctypes.c_int
        return fn

    def context(self) -> ctypes.c_void_p:
        ctx = ctypes.c_void_p()
        self("cuCtxGetCurrent", ctypes.byref(ctx))
        if not ctx.value:
            raise RuntimeError("no current CUDA context (initialise CUDA on the device first)")
        return ctx

    def set_conditional_kernel(self, device: int) -> ctypes.c_void_p:
        """``shardmax_set_conditional`` loaded into the current context (once per device)."""
        with self.lock:
            got = self.modules.get(device)
            if got is None:
                mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
                self("cuModuleLoadData", ctypes.byref(mod), ctypes.c_char_p(SET_CONDITIONAL_PTX))
                self("cuModuleGetFunction", ctypes.byref(fn), mod, b"shardmax_set_conditional")
                got = self.modules[device] = (mod, fn)
            return got[1]


@functools.cache
def _driver() -> _Driver:
    return _Driver()


def _keeps_graph() -> bool:
    try:
        g = torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:
        return False
    return hasattr(g, "raw_cuda_graph")


def unavailable(device: torch.device) -> str | None:
    """Why :class:`IfGraph` cannot run on ``device``, or None when it can: not a CUDA device,
    a PyTorch whose ``CUDAGraph`` cannot keep its graph, a driver older than CUDA 12.4 (no
    conditional nodes), or the set-conditional kernel failing to load (the driver's error)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"conditional CUDA graphs need a CUDA device, got {device}"
    if torch.version.hip is not None:
        return "conditional graph nodes are a CUDA driver feature (not HIP)"
    if not _keeps_graph():
        return "this PyTorch's CUDAGraph cannot keep its captured graph (keep_graph)"
    try:
        drv = _driver()
        version = ctypes.c_int()
        drv("cuDriverGetVersion", ctypes.byref(version))
        if version.value < 12040:
            return f"the CUDA driver ({version.value}) predates conditional nodes (12040)"
        torch.cuda.init()
        device = _indexed(device)
        with torch.cuda.device(device):
            torch.zeros(1, device=device)  # the primary context current on this thread
            drv.set_conditional_kernel(device.index)
        if not _self_check(device):
            return "a conditional CUDA graph did not skip / run its body as its predicate said"
    except (OSError, RuntimeError, AttributeError) as e:
        return f"conditional CUDA graphs unavailable: {e}"
    return None


def _indexed(device: torch.device) -> torch.device:
    """``device`` with its index (``cuda`` -> ``cuda:<current>``)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


_CHECKED: dict[int, bool] = {}


def _self_check(device: torch.device) -> bool:
    """Once per device: a tiny :class:`IfGraph` must skip its body on predicate 0 and run it on
    1 (two launches and a sync, at set-up only): the path is used only where the driver does
    what this module relies on."""
    got = _CHECKED.get(device.index)
    if got is None:
        flag = torch.zeros((), dtype=torch.bool, device=device)
        hits = torch.zeros((), dtype=torch.int32, device=device)
        g = IfGraph(lambda: flag.clone(), lambda: hits.add_(1), device, checked=True)
        hits.zero_()
        g.launch()
        flag.fill_(True)
        g.launch()
        g.launch()
        torch.cuda.synchronize(device)
        got = _CHECKED[device.index] = int(hits.item()) == 2
    return got


def _check_predicate(pred: Any, device: torch.device) -> None:
    """A prologue's predicate is a contiguous bool / uint8 tensor on ``device`` of one dimension
    at most and 1 to 2**31 - 1 elements (what ``shardmax_set_conditional`` reads)."""
    if (
        not isinstance(pred, torch.Tensor)
        or not 1 <= pred.numel() < 2**31
        or pred.dim() > 1
        or not pred.is_contiguous()
        or pred.device != device
        or pred.dtype not in (torch.bool, torch.uint8)
    ):
        raise ValueError(
            "prologue: expected a contiguous bool / uint8 tensor of one dimension at most and "
            f"at least one element on {device}, got "
            f"{getattr(pred, 'dtype', type(pred).__name__)} {list(getattr(pred, 'shape', []))} "
            f"on {getattr(pred, 'device', '-')}"
        )


class Branch:
    """A body that decides again on the device: ``first`` runs (captured like a prologue: it
    launches its work and returns a predicate, a bool / uint8 tensor), then ``then`` -- a
    callable body or another :class:`Branch` -- runs only where that predicate is set. Inside an
    :class:`IfGraph` it is a nested IF node: a body whose common case is cheap can keep its
    rare, expensive case out of the common path without a host read."""

    __slots__ = ("first", "then")

    def __init__(self, first: Callable[[], torch.Tensor], then: Callable[[], Any] | Branch):
        self.first, self.then = first, then


class Later:
    """A body known only once the prologue has been captured (``get()`` then returns the callable
    or :class:`Branch`): a prologue that builds what its body reads -- a folded step's epilogue,
    :class:`shardmax.runtime.graphs.Epilogue` -- names the body there."""

    __slots__ = ("get",)

    def __init__(self, get: Callable[[], Any]) -> None:
        self.get = get


def run_eagerly(body: Any) -> Any:
    """Run a body as an :class:`IfGraph` would, each :class:`Branch`'s predicate read on the host
    (a sync: off-CUDA emulation and tests only). Returns what the last piece run returned (None
    where a branch's predicate was clear)."""
    if isinstance(body, Later):
        body = body.get()
    if isinstance(body, Branch):
        if bool(body.first().any()):
            return run_eagerly(body.then)
        return None
    return body()


class IfGraph:
    """``prologue`` then, when the predicate it returns is nonzero, ``body``: one CUDA graph
    (module docstring) launched without a host sync.

    Args:
        prologue: called once, under a CUDA-graph capture; launches what computes the predicate
            and returns it: a contiguous CUDA tensor of bool or uint8 of one dimension at most
            and at least one element (a flag, or an array of flags: the body runs when any
            of them is nonzero; ``shardmax_set_conditional`` reads them all, one warp).
        body: called once, under another capture; launches the work of the body. Its outputs
            and the predicate are kept alive with this object. A :class:`Branch` nests: its
            ``first`` is captured as a prologue inside the body, its ``then`` as the body of an
            IF node there (and so on); a :class:`Later` is resolved once the prologue is
            captured.
        device: the CUDA device.
        pool: a ``torch.cuda.graph_pool_handle()`` the captures allocate from (default: a new
            one).
        checked: skip :func:`unavailable` (its own self-check builds one).

    The captures run each callable once on a side stream first (warm-up, as
    ``torch.cuda.make_graphed_callables`` does) with the real buffers: both callables must be
    safe to run eagerly on the current inputs. Programmatic dependent launch
    (:func:`shardmax.runtime.kernels.set_pdl`) stays as the caller has it while the prologue is
    captured (its programmatic edges sit in a child graph outside the conditional node) and is
    off while the body is. A launch does not advance torch's RNG (``CUDAGraph.replay`` would): the pieces
    must not draw random numbers from torch.

    Raises:
        RuntimeError: :func:`unavailable` names a reason, or a driver call failed (named, with
            the driver's error).
        ValueError: the prologue's predicate is not such a tensor.
    """

    def __init__(
        self,
        prologue: Callable[[], torch.Tensor],
        body: Callable[[], Any] | Branch | Later,
        device: torch.device,
        pool: Any = None,
        checked: bool = False,
    ) -> None:
        device = _indexed(device)
        why = None if checked else unavailable(device)
        if why is not None:
            raise RuntimeError(why)
        from shardmax.runtime.kernels import set_pdl

        drv = _driver()
        self.device = device
        self._launch = drv.graph_launch()
        self._pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self._exec = ctypes.c_void_p()
        self._graph = ctypes.c_void_p()
        pdl = set_pdl(False)  # the caller's setting: the prologue's (the body never has it)
        try:
            with torch.cuda.device(device):
                ctx = drv.context()
                drv("cuGraphCreate", ctypes.byref(self._graph), ctypes.c_uint(0))
                self._fn = drv.set_conditional_kernel(device.index)
                self._ctx = ctx
                self._pieces: list[Any] = []  # every captured piece, kept with the graph
                outs = self._add(self._graph, prologue, body, pdl)
                self._prologue_out, self._body_out = outs
                # the pieces of the top level: the prologue and the body's first graph
                # (benchmarks count their nodes)
                self._prologue, self._body = self._pieces[0], self._pieces[1]
                drv(
                    "cuGraphInstantiateWithFlags", ctypes.byref(self._exec), self._graph,
                    ctypes.c_ulonglong(0),
                )  # fmt: skip
        finally:
            set_pdl(pdl)

    def _add(
        self, graph: ctypes.c_void_p, prologue: Callable[[], torch.Tensor], body: Any, pdl: bool
    ) -> tuple[Any, Any]:
        """Into ``graph``: a child graph of ``prologue`` (ending with the set-conditional warp
        on a new handle of ``graph``), then an IF node behind it whose body graph holds
        ``body`` -- one captured child graph, or for a :class:`Branch` the same two nodes again
        (nested). Returns what the prologue and the body returned when captured."""
        drv = _driver()
        device = self.device
        handle = ctypes.c_uint64()
        drv(
            "cuGraphConditionalHandleCreate", ctypes.byref(handle), graph, self._ctx,
            ctypes.c_uint(0), ctypes.c_uint(_ASSIGN_DEFAULT),
        )  # fmt: skip
        fn = self._fn

        def prologue_and_set() -> torch.Tensor:
            pred = prologue()
            _check_predicate(pred, device)
            stream = torch.cuda.current_stream(device).cuda_stream
            if torch.cuda.is_current_stream_capturing():  # one warp reads every byte
                args = (
                    ctypes.c_uint64(handle.value), ctypes.c_uint64(pred.data_ptr()),
                    ctypes.c_uint32(pred.numel()),
                )  # fmt: skip
                ptrs = (ctypes.c_void_p * 3)(
                    *(ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args)
                )
                drv(
                    "cuLaunchKernel", fn, 1, 1, 1, 32, 1, 1, 0, ctypes.c_void_p(stream),
                    ptrs, None,
                )  # fmt: skip
            return pred

        captured, pred = self._capture(prologue_and_set, pdl)
        self._pieces.append(captured)
        first = ctypes.c_void_p()
        drv(
            "cuGraphAddChildGraphNode", ctypes.byref(first), graph, None, ctypes.c_size_t(0),
            ctypes.c_void_p(captured.raw_cuda_graph()),
        )  # fmt: skip
        params = _NodeParams()
        params.type = _NODE_CONDITIONAL
        params.conditional.handle = handle.value
        params.conditional.type = _COND_IF
        params.conditional.size = 1
        params.conditional.ctx = self._ctx
        node = ctypes.c_void_p()
        deps = (ctypes.c_void_p * 1)(first.value)
        drv(
            "cuGraphAddNode", ctypes.byref(node), graph, deps, ctypes.c_size_t(1),
            ctypes.byref(params),
        )  # fmt: skip
        body_graph = ctypes.c_void_p(params.conditional.phGraph_out[0])
        if graph is self._graph:
            # the nodes that run the top level's clones (owned by self._graph; tests read
            # their edges): the prologue's child-graph node, the IF node's body graph
            self._nodes = (first.value, body_graph.value)
        if isinstance(body, Later):  # decided by the prologue's capture
            body = body.get()
        if isinstance(body, Branch):
            return pred, self._add(body_graph, body.first, body.then, False)
        piece, out = self._capture(body, False)
        self._pieces.append(piece)
        child = ctypes.c_void_p()
        drv(
            "cuGraphAddChildGraphNode", ctypes.byref(child), body_graph, None,
            ctypes.c_size_t(0), ctypes.c_void_p(piece.raw_cuda_graph()),
        )  # fmt: skip
        return pred, out

    def _capture(self, fn: Callable[[], Any], pdl: bool) -> tuple[Any, Any]:
        """``fn`` run once on a side stream, then captured (keeping its graph), with
        programmatic dependent launch ``pdl`` for shardmax's kernels in both."""
        from shardmax.runtime.kernels import set_pdl

        was = set_pdl(pdl)
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(  # on this device's side stream, not torch's default one
                graph, pool=self._pool, stream=side, capture_error_mode="thread_local"
            ):
                out = fn()
        finally:
            set_pdl(was)
        return graph, out

    @property
    def outputs(self) -> tuple[Any, Any]:
        """What the prologue (its predicate) and the body returned when captured: the tensors
        a launch writes (a :class:`Branch` body: the pair of its ``first``'s predicate and its
        ``then``'s outputs, nested likewise)."""
        return self._prologue_out, self._body_out

    def launch(self) -> None:
        """Run the graph on the current stream: the prologue, then the body where the predicate
        is set. No host sync. (The raw stream handle and the bound driver entry point: about
        as much host time as ``CUDAGraph.replay``'s own launch.)"""
        rc = self._launch(self._exec, torch._C._cuda_getCurrentRawStream(self.device.index))
        if rc != 0:
            _driver().check("cuGraphLaunch", rc)

    def __del__(self) -> None:
        try:
            lib = _driver().lib
            exe, graph = getattr(self, "_exec", None), getattr(self, "_graph", None)
            if exe is not None and exe.value:
                lib.cuGraphExecDestroy(exe)
            if graph is not None and graph.value:
                lib.cuGraphDestroy(graph)
        except Exception:  # interpreter shutdown: the driver may be gone
            pass
