"""The logits of a step replayed from a CUDA graph: read through an address in a device table.

A captured graph's kernel arguments are fixed, the engine's logits tensor is not. The kernels
that read the local logits (``shard_keys_*``, ``sampled_record_*``, ``sampled_draw_*``) therefore
take an INDIRECT launch inside a replayed step (:mod:`shardmax.runtime.graphs`): their logits
argument points at one int64 of the step's argument table, which holds the logits' address.
:class:`IndirectLogits` stands in for the logits tensor in the plans meanwhile, so the plans'
shape and stride checks and launch code are the eager ones.
"""

from __future__ import annotations

from typing import Any

import torch


class IndirectLogits:
    """Stands for a plan's ``[rows, W]`` local logits inside a replayed step: it has their
    shape, row stride, dtype and device; the kernels that read logits get :attr:`arg`, the
    table slot holding the logits' address viewed as the logits' dtype, and an INDIRECT launch
    (:func:`logits_arg`)."""

    __slots__ = ("_stride", "arg", "device", "dtype", "shape")

    def __init__(
        self, table: torch.Tensor, slot: int, shape: tuple[int, int], row_stride: int,
        dtype: torch.dtype,
    ) -> None:  # fmt: skip
        self.arg = table[slot:].view(dtype)
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.device = table.device
        self._stride = (row_stride, 1)

    def stride(self, dim: int | None = None) -> Any:
        return self._stride if dim is None else self._stride[dim]

    def __repr__(self) -> str:
        return f"IndirectLogits(shape={tuple(self.shape)}, dtype={self.dtype})"


def logits_arg(logits: Any) -> tuple[torch.Tensor, bool]:
    """What a logits-reading kernel gets: ``(tensor argument, INDIRECT)``."""
    if type(logits) is IndirectLogits:
        return logits.arg, True
    return logits, False
