"""The shared CUDA-graph pool (:mod:`shardmax.runtime.pools`).

CPU: the argument checks. GPU: the hazard it exists for -- every graph of a bare
``graph_pool_handle()`` released while a block of the pool is still held, then one more capture
on it -- fails with the allocator's assert, and passes with :class:`GraphPool` (plain captures
and conditional graphs), the graphs captured after the release replaying the right values; the
pool's memory goes back once the ``GraphPool``, its graphs and their tensors are gone.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any

import pytest
import torch

from shardmax.runtime.pools import GraphPool


@pytest.mark.parametrize("device", [torch.device("cpu"), "cpu"])
def test_handle_refuses_a_cpu_device(device: torch.device | str) -> None:
    with pytest.raises(ValueError, match="expected a CUDA device, got cpu"):
        GraphPool().handle(device)


def test_handle_refuses_inside_a_capture(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    with pytest.raises(RuntimeError, match="current stream of cuda:0 is capturing"):
        GraphPool().handle(torch.device("cuda", 0))


def _capture(
    dev: torch.device, pool: Any, held: list[torch.Tensor]
) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]:
    """A graph doubling a static input into an output of ``pool``; the capture also leaves a
    block of ``pool`` in ``held`` (as vLLM's module-level workspaces made during a capture)."""
    x = torch.arange(8, dtype=torch.float32, device=dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        y = x * 2
        held.append(torch.empty(1 << 16, device=dev))
    return graph, (x, y)


def _gpu() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda", torch.cuda.current_device())


@pytest.mark.gpu
def test_gpu_bare_pool_handle_fails_after_its_graphs_are_released() -> None:
    """The hazard :class:`GraphPool` exists for, on this torch (torch 2.11: the allocator's
    ``use_count > 0`` assert). A failed ``torch.cuda.graph`` leaves its capture stream current
    (its ``__exit__`` never runs): the test restores the caller's."""
    dev = _gpu()
    held: list[torch.Tensor] = []
    bare = torch.cuda.graph_pool_handle()
    graph, _ = _capture(dev, bare, held)
    del graph
    gc.collect()
    stream = torch.cuda.current_stream(dev)
    try:
        with pytest.raises(RuntimeError, match="use_count"):
            _capture(dev, bare, held)
    finally:
        torch.cuda.set_stream(stream)


@pytest.mark.gpu
def test_gpu_graph_pool_outlives_released_graphs() -> None:
    dev = _gpu()
    held: list[torch.Tensor] = []
    shared = GraphPool()
    handle = shared.handle(str(dev))
    assert shared.handle(dev) == handle  # one pool per device, whatever names it
    for _ in range(3):  # released, captured again, more than once
        graph, (x, y) = _capture(dev, handle, held)
        x.add_(1)
        graph.replay()
        torch.cuda.synchronize(dev)
        assert torch.equal(y, (torch.arange(8, device=dev) + 1) * 2)
        del graph
        gc.collect()


@pytest.mark.gpu
def test_gpu_if_graphs_of_a_graph_pool_come_and_go() -> None:
    from shardmax.runtime.conditional import IfGraph, unavailable

    dev = _gpu()
    why = unavailable(dev)
    if why is not None:
        pytest.skip(why)
    shared = GraphPool()
    flag = torch.zeros(1, dtype=torch.bool, device=dev)
    x = torch.arange(8, dtype=torch.float32, device=dev)
    held: list[torch.Tensor] = []
    for step in range(3):

        def body(scale: int = step + 2) -> torch.Tensor:
            held.append(torch.empty(1 << 16, device=dev))
            return x * scale

        graph = IfGraph(lambda: flag.clone(), body, dev, pool=shared.handle(dev))
        out = graph.outputs[1]
        out.zero_()
        flag.fill_(True)
        graph.launch()
        torch.cuda.synchronize(dev)
        assert torch.equal(out, x * (step + 2))
        del graph, out
        gc.collect()


@pytest.mark.gpu
def test_gpu_graph_pool_memory_goes_back_with_its_holder() -> None:
    """The keeper holds the pool only while its ``GraphPool`` lives: once the holder, its
    graphs and their tensors are gone, the allocator returns every byte the pool reserved."""
    dev = _gpu()
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(dev)
    held: list[torch.Tensor] = []
    shared = GraphPool()
    graphs = [_capture(dev, shared.handle(dev), held) for _ in range(2)]
    assert torch.cuda.memory_reserved(dev) > before
    del shared, graphs
    held.clear()
    gc.collect()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved(dev) == before
