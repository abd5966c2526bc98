"""The two collectives shardmax needs, behind one small protocol.

Only packed int64 keys cross ranks (design §3):

* ``all_gather_dim0(t)``: ``[rows, S]`` on every rank -> ``[tp * rows, S]``, rank-major, exactly
  the layout of ``torch.distributed.all_gather_into_tensor`` / vLLM's ``all_gather(x, dim=0)``.
* ``all_reduce_max(t)``: elementwise signed int64 MAX across ranks, in place.

Optionally, ``all_gather_dim0_into(t, out)`` writes the same bytes into a given contiguous
``[tp * rows, S]`` buffer: a step replayed from CUDA graphs at TP > 1 gathers straight into the
static buffer its next graph reads (:func:`gather_into`), where a collective without it costs an
output allocation and a device copy per exchange. The built-in collectives have it.

Implementations:

* :class:`SingleRank` - ``group=None``: no communication.
* :class:`TorchDistributed` - a ``torch.distributed`` ProcessGroup (NCCL/RCCL on GPUs, gloo on CPU).
* :class:`VllmCoordinator` - vLLM's TP ``GroupCoordinator``, duck-typed (no vLLM import): on GPUs
  the gather goes through ``coordinator.all_gather(t, dim=0)`` (vLLM's own, custom-op and
  CUDA-graph aware; the gather into a given buffer by the route vLLM's own gather takes --
  its PyNccl communicator or ``all_gather_into_tensor`` on its ``device_group`` -- and through
  vLLM's own gather plus a copy where that uses symmetric memory:
  :meth:`VllmCoordinator.gather_route`) and MAX through
  ``torch.distributed.all_reduce`` on its ``device_group`` (vLLM's ``all_reduce`` is a SUM); CPU
  tensors use its gloo ``cpu_group`` for both, because vLLM-CPU's shared-memory all_gather has
  no int64 kernel.

The in-process emulator used by the tests lives in :mod:`shardmax.testing.emulate`: it runs
every rank's local stage and concatenates keys in rank order, which is what these do.

All calls are CUDA-graph capturable for NCCL (no host sync, output shapes fixed by the input).
"""

from __future__ import annotations

import os
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist


@runtime_checkable
class Collective(Protocol):
    """What the ops need from a TP group. ``rank`` is the rank inside the TP group."""

    @property
    def world_size(self) -> int: ...

    @property
    def rank(self) -> int: ...

    def all_gather_dim0(self, t: torch.Tensor) -> torch.Tensor: ...

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor: ...


class SingleRank:
    """A group of one: both collectives return their input."""

    world_size = 1
    rank = 0

    def all_gather_dim0(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_gather_dim0_into(self, t: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(t)

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def __repr__(self) -> str:
        return "SingleRank()"


class TorchDistributed:
    """A ``torch.distributed`` ProcessGroup (NCCL, RCCL or gloo)."""

    def __init__(self, group: Any = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "group: torch.distributed is not initialized; call "
                "torch.distributed.init_process_group first or pass group=None for one rank"
            )
        self.group = group
        self._world_size = dist.get_world_size(group)
        self._rank = dist.get_rank(group)

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def rank(self) -> int:
        return self._rank

    def all_gather_dim0(self, t: torch.Tensor) -> torch.Tensor:
        out = t.new_empty((self._world_size * t.shape[0], *t.shape[1:]))
        self.all_gather_dim0_into(t, out)
        return out

    def all_gather_dim0_into(self, t: torch.Tensor, out: torch.Tensor) -> None:
        """``all_gather_dim0(t)`` written into ``out`` (contiguous ``[world_size * rows, ...]``,
        ``t``'s dtype and device)."""
        t = t.contiguous()
        if dist.get_backend(self.group) == "gloo":
            # gloo has no all_gather_into_tensor: gather into views of the output.
            dist.all_gather(list(out.chunk(self._world_size)), t, group=self.group)
        else:
            dist.all_gather_into_tensor(out, t, group=self.group)

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t

    def __repr__(self) -> str:
        return f"TorchDistributed(rank={self._rank}, world_size={self._world_size})"


class VllmCoordinator:
    """vLLM's TP ``GroupCoordinator`` (duck-typed; vLLM is never imported here)."""

    def __init__(self, coordinator: Any) -> None:
        self.coordinator = coordinator

    @property
    def world_size(self) -> int:
        return int(self.coordinator.world_size)

    @property
    def rank(self) -> int:
        return int(self.coordinator.rank_in_group)

    def all_gather_dim0(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return t
        if not t.is_cuda:
            return TorchDistributed(self.coordinator.cpu_group).all_gather_dim0(t)
        return self.coordinator.all_gather(t.contiguous(), dim=0)

    def all_gather_dim0_into(self, t: torch.Tensor, out: torch.Tensor) -> None:
        """``all_gather_dim0(t)`` written into ``out`` (contiguous ``[world_size * rows, ...]``,
        ``t``'s dtype and device), by :meth:`gather_route`: the same bytes as
        :meth:`all_gather_dim0` without vLLM's output allocation where vLLM's own CUDA gather is a
        plain NCCL all_gather."""
        if self.world_size == 1:
            out.copy_(t)
            return
        route = self.gather_route(t)
        if route == "cpu":
            TorchDistributed(self.coordinator.cpu_group).all_gather_dim0_into(t, out)
        elif route == "vllm":
            out.copy_(self.coordinator.all_gather(t.contiguous(), dim=0))
        elif route == "pynccl":
            self.coordinator.device_communicator.pynccl_comm.all_gather(out, t.contiguous())
        else:
            dist.all_gather_into_tensor(out, t.contiguous(), group=self.coordinator.device_group)

    def gather_route(self, t: Any) -> str:
        """How :meth:`all_gather_dim0_into` gathers ``t``, mirroring vLLM's CUDA all_gather
        (``CudaCommunicator.all_gather``, 0.32 / 0.33): ``"cpu"`` (a CPU tensor: the gloo
        ``cpu_group``); ``"vllm"`` (``VLLM_USE_NCCL_SYMM_MEM`` on: vLLM gathers through a
        symmetric-memory buffer whose growth every rank registers collectively, so its own
        gather runs, then a copy); ``"pynccl"`` (its PyNccl communicator, present and enabled,
        not on ROCm: vLLM's own route); ``"device_group"`` (``all_gather_into_tensor`` on the
        coordinator's NCCL group: vLLM's base-class route)."""
        if not t.is_cuda:
            return "cpu"
        symm = os.environ.get("VLLM_USE_NCCL_SYMM_MEM", "0").strip() or "0"
        if symm != "0":  # vLLM reads bool(int(...)); anything but 0 counts as on here
            return "vllm"
        comm = getattr(getattr(self.coordinator, "device_communicator", None), "pynccl_comm", None)
        if comm is not None and not getattr(comm, "disabled", True) and torch.version.hip is None:
            return "pynccl"
        return "device_group"

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return t
        group = self.coordinator.device_group if t.is_cuda else self.coordinator.cpu_group
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t

    def __repr__(self) -> str:
        return f"VllmCoordinator(rank={self.rank}, world_size={self.world_size})"


def gather_into(coll: Collective, t: torch.Tensor, out: torch.Tensor) -> None:
    """``coll.all_gather_dim0(t)`` into ``out`` (contiguous, of the gathered shape and ``t``'s
    dtype): the collective's own ``all_gather_dim0_into`` where it has one (no output buffer, no
    copy), else its gather then one device copy."""
    into = getattr(coll, "all_gather_dim0_into", None)
    if into is not None:
        into(t, out)
    else:
        out.copy_(coll.all_gather_dim0(t))


def reduce_max_in_place(coll: Collective, t: torch.Tensor) -> None:
    """``coll.all_reduce_max(t)`` left in ``t``: the protocol's MAX is in place (the built-in
    collectives' is); a collective that returns another tensor has it copied back."""
    r = coll.all_reduce_max(t)
    if r.data_ptr() != t.data_ptr():
        t.copy_(r)


def _looks_like_vllm_coordinator(group: Any) -> bool:
    return all(hasattr(group, a) for a in ("rank_in_group", "world_size", "device_group"))


def resolve(group: Any) -> Collective:
    """Turn the ``group`` argument of the public ops into a :class:`Collective`.

    Accepts ``None`` (one rank), a :class:`Collective`, a vLLM ``GroupCoordinator`` or a
    ``torch.distributed`` ProcessGroup. Raises TypeError for anything else.
    """
    if group is None:
        return SingleRank()
    if isinstance(group, (SingleRank, TorchDistributed, VllmCoordinator)):
        return group
    if _looks_like_vllm_coordinator(group):
        return VllmCoordinator(group)
    if dist.is_available() and isinstance(group, dist.ProcessGroup):
        return TorchDistributed(group)
    if isinstance(group, Collective):
        return group
    raise TypeError(
        "group: expected None, a torch.distributed ProcessGroup, a vLLM GroupCoordinator or a "
        f"shardmax.runtime.collectives.Collective, got {type(group).__name__}"
    )
