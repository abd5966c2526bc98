"""What every plan of one rank shares: its group, the checked geometry, a workspace.

A :class:`ShardContext` is built by :class:`shardmax.plan.VocabShard` (after the collective
geometry check) or by the in-process emulator (one per emulated rank, with the geometry given).
Plans of :mod:`shardmax.ops` hold one; they take their intermediate buffers from its
:class:`Workspace`, so the many batch shapes an engine sees share memory instead of each keeping
its own. Runs of the plans of one context must be ordered on one stream (as vLLM's are): two
plans never use the workspace at the same time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from shardmax.runtime.collectives import Collective
from shardmax.runtime.geometry import Geometry
from shardmax.runtime.indirect import IndirectLogits
from shardmax.runtime.validation import SUPPORTED_DTYPES


def canonical_device(device: torch.device | str) -> torch.device:
    """``cuda`` -> ``cuda:<current device>`` (a tensor's ``.device`` always has its index, and
    ``torch.device("cuda") != torch.device("cuda:0")``); other devices unchanged."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


class Workspace:
    """Named device buffers that grow to the largest request and are shared by every plan of a
    :class:`ShardContext`. ``generation`` changes whenever a buffer is reallocated, so a plan
    that keeps views re-takes them (:meth:`views`). Once a CUDA graph has been captured on the
    workspace (:attr:`captured`), a replaced buffer is kept (:attr:`retired`): the graph still
    reads and writes it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.generation = 0
        self._bufs: dict[str, torch.Tensor] = {}
        self.retired: list[torch.Tensor] = []
        self.captured = False

    def reserve(self, name: str, nbytes: int) -> None:
        """Make buffer ``name`` at least ``nbytes`` long (a new generation if it grew)."""
        cur = self._bufs.get(name)
        if cur is not None and cur.numel() >= nbytes:
            return
        if cur is not None and self.captured:
            # a graph may point at it: keep it, and grow by doubling so that the buffers kept
            # stay within twice the largest one
            self.retired.append(cur)
            nbytes = max(nbytes, 2 * cur.numel())
        self._bufs[name] = torch.empty(max(nbytes, 8), dtype=torch.uint8, device=self.device)
        self.generation += 1

    def view(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A ``shape`` / ``dtype`` view of buffer ``name`` (reserved first if needed)."""
        n = 1
        for d in shape:
            n *= d
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        self.reserve(name, nbytes)
        return self._bufs[name][:nbytes].view(dtype).view(shape)

    def nbytes(self) -> int:
        return sum(b.numel() for b in self._bufs.values())


@dataclass
class ShardContext:
    """One rank's view of a vocab-parallel group: collective, checked geometry, workspace."""

    coll: Collective
    geometry: Geometry
    rank: int
    device: torch.device
    workspace: Workspace = field(repr=False, default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.device = canonical_device(self.device)
        if self.workspace is None:
            self.workspace = Workspace(self.device)
        self._zeros = torch.zeros(0, dtype=torch.int32, device=self.device)
        self._retired: list[torch.Tensor] = []

    def zeros_int32(self, n: int) -> torch.Tensor:
        """A read-only int32 tensor of ``n`` zeros (cached, grown on demand: never written)."""
        if self._zeros.shape[0] < n:
            self._retired.append(self._zeros)  # a captured CUDA graph may still point at it
            self._zeros = torch.zeros(
                max(n, 2 * self._zeros.shape[0]), dtype=torch.int32, device=self.device
            )
        return self._zeros[:n]

    @property
    def tp(self) -> int:
        return self.geometry.tp

    @property
    def vocab_start(self) -> int:
        return self.geometry.ranges[self.rank][0]

    @property
    def num_valid(self) -> int:
        return self.geometry.ranges[self.rank][1]

    @property
    def width(self) -> int:
        return self.geometry.width

    @property
    def dtype(self) -> torch.dtype:
        return self.geometry.dtype

    @property
    def dtype_name(self) -> str:
        return SUPPORTED_DTYPES[self.geometry.dtype]

    def check_logits(self, logits: object, rows: int, row_stride: int) -> Any:
        """Host checks of a plan's input against the plan: ``[rows, W]`` of the shard's dtype on
        its device, last dim contiguous, row stride ``row_stride`` (when rows > 1). Returns
        ``logits``: a tensor, or inside a step replayed from a CUDA graph its
        :class:`~shardmax.runtime.indirect.IndirectLogits` stand-in (same shape, stride, dtype).

        Raises:
            TypeError / ValueError naming ``local_logits`` and what the plan expected.
        """
        if not isinstance(logits, (torch.Tensor, IndirectLogits)):
            raise TypeError(f"local_logits: expected a torch.Tensor, got {type(logits).__name__}")
        if (
            logits.shape != (rows, self.width)
            or logits.dtype != self.dtype
            or logits.device != self.device
            or (rows > 1 and logits.stride(0) != row_stride)
            or (self.width > 1 and rows > 0 and logits.stride(1) != 1)
        ):
            raise ValueError(
                f"local_logits: shape {tuple(logits.shape)}, dtype {logits.dtype}, device "
                f"{logits.device}, strides {tuple(logits.stride())}; this plan expects "
                f"[{rows}, {self.width}] {self.dtype} on {self.device} with row stride "
                f"{row_stride} and a contiguous last dim (plan another shape)"
            )
        return logits
