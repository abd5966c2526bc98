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
outlive each other. :class:`GraphPool` keeps a ``torch.cuda.MemPool`` per device instead: the
allocator counts it as a user of its pool for as long as it lives, so the count never reaches
zero between captures, and the pool's memory goes back when the holder and its graphs are gone.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["GraphPool"]


class GraphPool:
    """A pool id per CUDA device for ``torch.cuda.graph(..., pool=...)``, kept valid for the
    life of this object whatever graphs of it are released in between.

    Where this torch's ``torch.cuda.MemPool`` does not count itself as a user of its pool (or
    has no ``MemPool``), :meth:`handle` returns None: each capture then gets a pool of its own
    (no sharing, nothing to go stale).
    """

    __slots__ = ("_lock", "_pools")

    def __init__(self) -> None:
        self._pools: dict[int, Any] = {}
        self._lock = threading.Lock()

    def handle(self, device: torch.device) -> Any:
        """The pool id for captures on ``device`` (a CUDA device; made on first use), or None.

        Raises:
            ValueError: ``device`` is not a CUDA device.
        """
        if device.type != "cuda":
            raise ValueError(f"device: expected a CUDA device, got {device}")
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            if index not in self._pools:
                self._pools[index] = _made(index)
            pool = self._pools[index]
        return None if pool is None else pool.id


def _made(index: int) -> Any:
    """A ``MemPool`` on CUDA device ``index`` that holds a use of its pool, or None."""
    make = getattr(torch.cuda, "MemPool", None)
    if make is None:
        return None
    with torch.cuda.device(index):
        pool = make()
    count = getattr(pool, "use_count", None)
    return pool if count is not None and count() >= 1 else None
