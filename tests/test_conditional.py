"""The device-decided body (:mod:`shardmax.runtime.conditional`): a CUDA graph whose IF node runs
its body only when the prologue's predicate is set.

CPU: the driver structures' layout (cuda.h of CUDA 12.4+), the refusal off CUDA, and the PTX of
the set-conditional kernel assembled by ``ptxas`` where a CUDA toolkit is installed. GPU: the
body skipped / taken on the predicate a kernel of the prologue computes, Triton kernels and
torch ops with allocations in both pieces, many launches without a host sync, twice with the
same bits; array predicates (any flag set, at the warp's lane edges and past its first pass)
and the predicates refused; bodies that decide again (:class:`Branch`: nested IF nodes, three
levels, every combination of the predicates) -- on the CPU through :func:`run_eagerly`.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest
import torch

from shardmax.runtime import conditional
from shardmax.runtime.conditional import (
    SET_CONDITIONAL_PTX,
    Branch,
    IfGraph,
    Later,
    run_eagerly,
    unavailable,
)


def test_driver_structures_match_cuda_h() -> None:
    """CUgraphNodeParams is 256 bytes with its union at byte 16; CUDA_CONDITIONAL_NODE_PARAMS
    holds handle / type / size / phGraph_out / ctx at 0 / 8 / 12 / 16 / 24 (CUDA 12.4-13 cuda.h)."""
    params, cond = conditional._NodeParams, conditional._ConditionalParams
    assert ctypes.sizeof(params) == 256 and ctypes.sizeof(cond) == 32
    assert params.conditional.offset == 16 and params.reserved2.offset == 248
    offsets = [getattr(cond, f).offset for f in ("handle", "type", "size", "phGraph_out", "ctx")]
    assert offsets == [0, 8, 12, 16, 24]


def test_refuses_off_cuda() -> None:
    why = unavailable(torch.device("cpu"))
    assert why is not None and "CUDA device" in why
    with pytest.raises(RuntimeError, match="CUDA device"):
        IfGraph(lambda: torch.ones((), dtype=torch.bool), lambda: None, torch.device("cpu"))


def _nested(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, Branch]:
    """Three levels: ``flags[0]`` decides the outer body (the caller's prologue), whose first
    piece adds 1 to ``hits[0]`` and returns ``flags[1]``; its ``then`` adds 1 to ``hits[1]``
    and returns ``flags[2]`` for the innermost, which adds 1 to ``hits[2]``."""
    flags = torch.zeros(3, dtype=torch.bool, device=device)
    hits = torch.zeros(3, dtype=torch.int32, device=device)

    def level(i: int) -> torch.Tensor:
        hits[i : i + 1].add_(1)
        return flags[i + 1 : i + 2].clone()  # a kernel writes the next predicate

    inner = Branch(lambda: level(1), lambda: hits[2:].add_(1))
    return flags, hits, Branch(lambda: level(0), inner)


_EVERY = [(a, b, c) for a in (0, 1) for b in (0, 1) for c in (0, 1)]
"""Every combination of the three predicates."""


def _expected(a: int, b: int, c: int) -> list[int]:
    return [a, a & b, a & b & c]


def test_run_eagerly_follows_every_branch() -> None:
    """Off CUDA a body with branches runs as the graph would: each predicate read on the host,
    the pieces behind a clear one skipped (a :class:`Later` resolved first)."""
    flags, hits, body = _nested(torch.device("cpu"))
    for a, b, c in _EVERY:
        flags.copy_(torch.tensor([a, b, c], dtype=torch.bool))
        hits.zero_()
        if a:
            run_eagerly(Later(lambda: body))
        assert hits.tolist() == _expected(a, b, c), (a, b, c)
    assert run_eagerly(lambda: 7) == 7


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="no CUDA toolkit (ptxas) here")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_set_conditional_ptx_assembles(tmp_path, arch: str) -> None:
    src = tmp_path / "set.ptx"
    src.write_bytes(SET_CONDITIONAL_PTX)
    out = subprocess.run(
        ["ptxas", f"-arch={arch}", str(src), "-o", str(tmp_path / "set.cubin")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr


def _cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dev = torch.device("cuda", torch.cuda.current_device())
    why = unavailable(dev)
    if why is not None:
        pytest.fail(f"conditional graphs should run on this GPU: {why}")
    return dev


@pytest.mark.gpu
def test_gpu_if_graph_runs_the_body_only_when_the_predicate_is_set() -> None:
    from shardmax.runtime import kernels

    dev = _cuda()
    flags = torch.zeros(64, dtype=torch.bool, device=dev)
    x = torch.zeros(1 << 16, device=dev)
    src = torch.arange(512, dtype=torch.int64, device=dev)
    dst = torch.zeros(512, dtype=torch.int64, device=dev)
    table = torch.tensor([src.data_ptr(), dst.data_ptr(), src.numel() * 8], device=dev)
    copy = kernels.kernel("table_copy")

    def prologue() -> torch.Tensor:
        return flags.any()  # a reduction kernel writes the predicate on the device

    def body() -> torch.Tensor:
        copy(
            (1,), table, BLOCK=copy.module.BLOCK, SPREAD=False
        )  # a Triton kernel reading addresses
        y = x * 2 + 1  # torch ops allocating from the graph's pool
        x.copy_(y)
        return y

    g = IfGraph(prologue, body, dev)
    for trial in range(2):  # twice: the same bits
        seen = []
        for flagged in (False, True, False, True, True):
            x.zero_()
            dst.zero_()
            flags.zero_()
            if flagged:
                flags[37 + trial] = True
            g.launch()
            torch.cuda.synchronize()
            seen.append((x[0].item(), bool(torch.equal(dst, src))))
        assert seen == [(0.0, False), (1.0, True), (0.0, False), (1.0, True), (1.0, True)], seen
    # many launches in a row, the predicate changed in stream order between them, no host sync
    x.zero_()
    for i in range(50):
        flags.fill_(i % 3 == 0)
        g.launch()
    torch.cuda.synchronize()
    expect = 0.0
    for i in range(50):
        if i % 3 == 0:
            expect = expect * 2 + 1
    assert x[0].item() == expect


@pytest.mark.gpu
def test_gpu_if_graph_nested_branches() -> None:
    """A body that decides again (:class:`Branch`, three levels: nested IF nodes, each handle
    set by its own piece): every combination of the predicates runs exactly the pieces
    behind set ones, twice (the same counts), in launches without a host sync; a
    :class:`Later` body resolved after the prologue's capture builds the same graph."""
    dev = _cuda()
    for later in (False, True):
        flags, hits, body = _nested(dev)
        g = IfGraph(
            lambda flags=flags: flags[:1].clone(),
            Later(lambda body=body: body) if later else body,
            dev,
        )
        pred, (first, (second, _)) = g.outputs
        assert pred.dtype == first.dtype == second.dtype == torch.bool
        for trial in range(2):
            for a, b, c in _EVERY:
                flags.copy_(torch.tensor([a, b, c], dtype=torch.bool))
                hits.zero_()
                g.launch()
                torch.cuda.synchronize()
                assert hits.tolist() == _expected(a, b, c), (later, trial, a, b, c)
        # many launches in stream order, no host sync in between
        hits.zero_()
        want = [0, 0, 0]
        for a, b, c in _EVERY * 4:
            flags.copy_(torch.tensor([a, b, c], dtype=torch.bool), non_blocking=True)
            g.launch()
            want = [w + e for w, e in zip(want, _expected(a, b, c), strict=True)]
        torch.cuda.synchronize()
        assert hits.tolist() == want, (later, want)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2, 31, 32, 33, 64, 97, 300, 1000])
def test_gpu_if_graph_reads_every_flag_of_an_array_predicate(n: int) -> None:
    """A predicate of ``n`` flags (bool, or uint8 holding any nonzero value): the body runs on
    a launch exactly when one of them is set, wherever it sits -- first, last, at the warp's
    lane edges (31, 32, 33), past the first pass of the warp -- and never on all-zero flags
    (twice: the same bits)."""
    dev = _cuda()
    for dtype, value in ((torch.bool, True), (torch.uint8, 2), (torch.uint8, 255)):
        flags = torch.zeros(n, dtype=dtype, device=dev)
        hits = torch.zeros((), dtype=torch.int64, device=dev)
        g = IfGraph(lambda flags=flags: flags, lambda hits=hits: hits.add_(1), dev)
        at = sorted({i for i in (0, 1, 30, 31, 32, 33, 63, 64, n // 2, n - 1) if i < n})
        for _ in range(2):
            hits.zero_()
            flags.zero_()
            g.launch()  # nothing set: skipped
            for i in at:
                flags.zero_()
                flags[i] = value
                g.launch()
            flags.zero_()
            g.launch()
            flags.fill_(value)
            g.launch()  # every flag set
            torch.cuda.synchronize()
            assert hits.item() == len(at) + 1, (dtype, n, at, hits.item())


@pytest.mark.gpu
def test_gpu_if_graph_refuses_bad_predicates() -> None:
    dev = _cuda()
    bad = {
        "2-D": torch.zeros(2, 2, dtype=torch.bool, device=dev),
        "empty": torch.zeros(0, dtype=torch.bool, device=dev),
        "float": torch.zeros(4, device=dev),
        "strided": torch.zeros(8, dtype=torch.bool, device=dev)[::2],
        "host": torch.zeros(4, dtype=torch.bool),
    }
    for name, pred in bad.items():
        with pytest.raises(ValueError, match="prologue: expected a contiguous bool"):
            IfGraph(lambda pred=pred: pred, lambda: None, dev)
            pytest.fail(f"a {name} predicate was taken")


def _edge_types(graph: int) -> list[int]:
    """The dependency type of every edge of a CUDA graph (``cuGraphGetEdges_v2``'s
    ``CUgraphEdgeData.type``: 0 default, 1 programmatic)."""
    drv = conditional._driver()
    n = ctypes.c_size_t(0)
    g = ctypes.c_void_p(graph)
    drv("cuGraphGetEdges_v2", g, None, None, None, ctypes.byref(n))
    src, dst = (ctypes.c_void_p * n.value)(), (ctypes.c_void_p * n.value)()
    data = (ctypes.c_uint8 * (8 * n.value))()  # from_port, to_port, type, reserved[5]
    drv("cuGraphGetEdges_v2", g, src, dst, data, ctypes.byref(n))
    return [data[8 * i + 2] for i in range(n.value)]


def _nodes(graph: int) -> list[int]:
    drv = conditional._driver()
    n = ctypes.c_size_t(0)
    drv("cuGraphGetNodes", ctypes.c_void_p(graph), None, ctypes.byref(n))
    nodes = (ctypes.c_void_p * n.value)()
    drv("cuGraphGetNodes", ctypes.c_void_p(graph), nodes, ctypes.byref(n))
    return [int(x or 0) for x in nodes]


def _child_graphs(g: IfGraph) -> tuple[int, int]:
    """``(prologue, body)``: the graphs an :class:`IfGraph`'s own graph runs -- its child-graph
    node's clone of the prologue, and the clone held by the child-graph node inside its IF
    node's body graph."""
    drv = conditional._driver()
    prologue_node, body_graph = g._nodes
    (inner,) = _nodes(body_graph)
    out = []
    for node in (prologue_node, inner):
        graph = ctypes.c_void_p()
        drv("cuGraphChildGraphNodeGetGraph", ctypes.c_void_p(node), ctypes.byref(graph))
        out.append(int(graph.value or 0))
    return out[0], out[1]


@pytest.mark.gpu
def test_gpu_if_graph_prologue_keeps_pdl_and_the_body_drops_it() -> None:
    """With programmatic dependent launch on, the prologue's kernels keep their programmatic
    edges (as in a plain graph) and the body's have none; the predicate the prologue's last
    PDL kernel writes still decides every launch (twice: the same bits)."""
    from shardmax.runtime import kernels

    dev = _cuda()
    if not kernels.pdl_supported(dev.index):
        pytest.skip("PDL needs compute capability 9.0")
    copy = kernels.kernel("table_copy")
    src = torch.zeros(64, dtype=torch.bool, device=dev)
    mid, pred = torch.zeros_like(src), torch.zeros_like(src)
    hits = torch.zeros((), dtype=torch.int64, device=dev)
    first = torch.tensor([src.data_ptr(), mid.data_ptr(), 64], device=dev)
    second = torch.tensor([mid.data_ptr(), pred.data_ptr(), 64], device=dev)

    def copies() -> None:
        copy((1,), first, BLOCK=copy.module.BLOCK, SPREAD=False)
        copy((1,), second, BLOCK=copy.module.BLOCK, SPREAD=False)

    def prologue() -> torch.Tensor:
        copies()  # src -> mid -> pred, the second launch programmatically after the first
        return pred

    def body() -> torch.Tensor:
        copies()
        return hits.add_(1)

    before = kernels.set_pdl(True)
    try:
        g = IfGraph(prologue, body, dev)
    finally:
        kernels.set_pdl(before)
    # the clones that run: the IF graph's child-graph node (the prologue) and the graph inside
    # its conditional node's body (a child-graph node holding the body's clone)
    prologue, body = _child_graphs(g)
    assert 1 in _edge_types(prologue)
    assert 1 not in _edge_types(body)
    assert 1 in _edge_types(g._prologue.raw_cuda_graph())  # as torch captured them
    assert 1 not in _edge_types(g._body.raw_cuda_graph())
    for _ in range(2):
        hits.zero_()
        seen = []
        for at in (None, 0, None, 63, 40, None):
            src.zero_()
            if at is not None:
                src[at] = True
            g.launch()
            torch.cuda.synchronize()
            seen.append(hits.item())
        assert seen == [0, 1, 1, 2, 3, 3], seen


@pytest.mark.gpu
def test_gpu_if_graph_launch_cost() -> None:
    """Prints the GPU and host time of a launch with the body skipped and taken (informative)."""
    import time

    dev = _cuda()
    flag = torch.zeros((), dtype=torch.bool, device=dev)
    x = torch.zeros(1 << 20, device=dev)
    g = IfGraph(lambda: flag.clone(), lambda: x.add_(1), dev)
    out = {}
    for taken in (False, True):
        flag.fill_(taken)
        for _ in range(10):
            g.launch()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        e0.record()
        for _ in range(200):
            g.launch()
        e1.record()
        host = (time.perf_counter() - t0) / 200 * 1e6
        torch.cuda.synchronize()
        out[taken] = (e0.elapsed_time(e1) * 1000 / 200, host)
    print(
        f"[if-graph] skipped: GPU {out[False][0]:.1f} us, host {out[False][1]:.1f} us; "
        f"taken: GPU {out[True][0]:.1f} us, host {out[True][1]:.1f} us"
    )
    assert x[0].item() == 211.0  # the capture's warm-up ran the body once
