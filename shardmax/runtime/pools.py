"""One CUDA-graph memory pool shared by captures whose graphs come and go on their own.

Graphs captured with the same ``pool`` share its memory: a capture reuses what earlier captures
of the pool freed (their temporaries), which is safe when the graphs replay in stream order on
one stream and each keeps its own outputs alive -- the device fallback's and the resolution's
graphs, one per step signature, least recently used out.

PyTorch's caching allocator counts the graphs that use a pool. When that count falls to zero
while a block of the pool is still allocated (a workspace that vLLM caches at module level
during a capture, an output someone still holds), the pool stays registered with a count of
zero and the next capture that names it fails on the allocator's internal assert
(``use_count > 0``, ``CUDACachingAllocator.cpp``): seen on an H100 with torch 2.11 when every
folded graph of a fallback had been released with its step signature and the next signature was
captured. So a holder cannot keep a bare ``torch.cuda.graph_pool_handle()`` for graphs that
outlive each other.

:class:`GraphPool` keeps one more user of its pool for as long as it lives: a *keeper*, a
one-node graph (a memset of a byte allocated outside the pool) captured into the pool and never
replayed. Graphs of the pool then come and go without the count reaching zero; when the holder
goes, the keeper's release is an ordinary graph release and the pool's memory goes back as the
allocator frees it. (A ``torch.cuda.MemPool`` holds a use too, but its destructor empties the
allocator's cache, which asserts that no capture is under way and aborts the process otherwise:
``captures_underway.empty()``, seen on an H100 with torch 2.11 when the engine benchmark exited
after some of its captures had failed. A keeper's release is what any graph's release is.)
"""

from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["GraphPool"]


class GraphPool:
    """A pool id per CUDA device for ``torch.cuda.graph(..., pool=...)``, valid for the life
    of this object whatever graphs of it are released in between (its keeper graph holds a
    use of the pool). Captures of one ``GraphPool`` share memory: their graphs must replay in
    stream order on one stream, each keeping its own outputs alive.

    Memory: while the keeper lives the allocator never counts the pool as unused, so blocks
    that released graphs freed stay reserved in the pool -- reused by its later captures, not
    returned to the device -- until the ``GraphPool`` goes too.
    """

    __slots__ = ("_keepers", "_lock")

    def __init__(self) -> None:
        self._keepers: dict[int, tuple[Any, torch.cuda.CUDAGraph]] = {}
        self._lock = threading.Lock()

    def handle(self, device: torch.device | str) -> Any:
        """The pool id for captures on ``device`` (a CUDA device; made on first use, with its
        keeper, which is captured on a stream of its own: call it outside any capture on that
        device's current stream).

        Raises:
            ValueError: ``device`` is not a CUDA device.
            RuntimeError: the device's current stream is capturing.
        """
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"device: expected a CUDA device, got {device}")
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            kept = self._keepers.get(index)
            if kept is None:
                kept = self._keepers[index] = _new_keeper(index)
        return kept[0]


def _new_keeper(index: int) -> tuple[Any, torch.cuda.CUDAGraph]:
    """A new pool id on CUDA device ``index`` and its keeper graph (one memset), captured
    directly (``capture_begin`` / ``capture_end``: no device synchronize or cache emptying, as
    ``torch.cuda.graph`` does first) on a new stream of that device."""
    with torch.cuda.device(index):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"GraphPool.handle: the current stream of cuda:{index} is capturing; a pool's "
                "keeper graph is captured outside any capture"
            )
        pool = torch.cuda.graph_pool_handle()
        byte = torch.empty(1, dtype=torch.uint8, device=torch.device("cuda", index))
        keeper = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(index)
        side.wait_stream(torch.cuda.current_stream(index))
        with torch.cuda.stream(side):
            keeper.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                byte.zero_()
            finally:
                keeper.capture_end()
    return pool, keeper
