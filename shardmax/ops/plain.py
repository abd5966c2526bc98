"""The unsharded path: all-gather the full padded logits, then reduce them on every rank.

What a tuned table row selects (``"variant": "plain"``) where sharding does not pay, and what
``dispatch.override(variant="plain")`` forces (tests, benchmarks). Its ids are the sharded path's
for every geometry: each rank's gathered part is reduced with that rank's own ``vocab_start`` /
``num_valid`` (padding never read, ranges with gaps or not starting at 0 handled), and the keys
go through the same finish kernels as an all_gather of keys.
"""

from __future__ import annotations

import torch

from shardmax.ops.argmax import shard_keys
from shardmax.runtime.defaults import TARGET_PROGRAMS
from shardmax.runtime.dispatch import Problem, alignment_of_stride, builtin_default
from shardmax.runtime.shard import ShardContext
from shardmax.runtime.variants import finish_variant


class PlainPlan:
    """Gather ``[rows, W]`` from every rank, reduce each rank's part to keys, finish."""

    def __init__(self, ctx: ShardContext, rows: int) -> None:
        self.ctx = ctx
        self.rows = rows
        target = 1 if ctx.device.type == "cpu" else TARGET_PROGRAMS
        align = alignment_of_stride(ctx.width)  # the gathered parts are contiguous [rows, W]
        self.selection = builtin_default(
            Problem("argmax", ctx.dtype_name, 1, rows, ctx.width, align), target
        )
        self.pick = finish_variant("argmax", ctx.tp, "allgather")
        self.verify = finish_variant("verify", ctx.tp, "allgather")

    def local(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.contiguous()

    def exchange(self, sent: torch.Tensor) -> torch.Tensor:
        return self.ctx.coll.all_gather_dim0(sent)

    def keys(self, gathered: torch.Tensor) -> torch.Tensor:
        """``[tp*rows, W]`` gathered logits -> ``[tp*rows, S]`` keys in all_gather layout."""
        rows, tp = self.rows, self.ctx.tp
        keys = torch.empty(
            (tp * rows, self.selection.splits), dtype=torch.int64, device=gathered.device
        )
        for r, (start, n) in enumerate(self.ctx.geometry.ranges):
            part = slice(r * rows, (r + 1) * rows)
            shard_keys(gathered[part], start, n, self.selection, out=keys[part])
        return keys
