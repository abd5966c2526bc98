"""One emulated TP rank that runs its real step while the other ranks' bytes are replayed.

The in-process emulator (:mod:`shardmax.testing.emulate`) moves the bytes between the ranks'
stages itself; a benchmark or a CUDA-graph test instead needs ONE rank's plan to run its whole
``run(local_logits, batch)`` -- collectives included -- on one GPU. :func:`record_exchanges`
runs every rank's stages once and keeps what each of the step's all_gathers returns;
:class:`ReplayedCollective` hands those bytes back to the rank in call order. The rank's own
sends are checked for shape only (they equal what the recording sent: same plan, same shard).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = ["ReplayedCollective", "record_exchanges"]


class ReplayedCollective:
    """A rank's collective returning recorded gathered bytes: each call gets the next recorded
    gather, in call order and cyclically, whose shape and dtype fit the send (so warm-up runs and
    a CUDA-graph capture may repeat the step's calls; call :meth:`reset` before each step).

    Args:
        tp: the group's size; rank: this rank.
        gathered: what each ``all_gather_dim0`` of the step returns, in order
            (:func:`record_exchanges`).

    Raises (at a call):
        ValueError: a send that fits no recorded gather.
        RuntimeError: ``all_reduce_max`` (sampled verification does not use it).
    """

    def __init__(self, tp: int, rank: int, gathered: list[torch.Tensor]) -> None:
        self.world_size, self.rank = tp, rank
        self._gathered = gathered
        self._i = 0

    def reset(self) -> None:
        self._i = 0

    def _next(self, t: torch.Tensor) -> torch.Tensor:
        """The next recorded gather, in call order, that fits the send ``t``."""
        want = (self.world_size * t.shape[0], *t.shape[1:])
        n = len(self._gathered)
        for j in range(n):
            i = (self._i + j) % n
            g = self._gathered[i]
            if tuple(g.shape) == want and g.dtype == t.dtype:
                self._i = i + 1
                return g
        raise ValueError(
            f"t: {t.dtype} {list(t.shape)} fits no recorded gather of {self.world_size} ranks "
            f"({[list(g.shape) for g in self._gathered]})"
        )

    def all_gather_dim0(self, t: torch.Tensor) -> torch.Tensor:
        return self._next(t).clone()  # the bytes land in a fresh buffer, as NCCL's output

    def all_gather_dim0_into(self, t: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(self._next(t))  # the bytes land in the caller's buffer, as NCCL's

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ReplayedCollective: all_reduce_max is not used by sampled verification")


def record_exchanges(
    shards: list[Any], plans: list[Any], batch: Any, cu_np: np.ndarray, topp: bool
) -> tuple[list[torch.Tensor], Any]:
    """Every rank's stages of one sampled step, once: the step's gathered bytes in order (the
    records; the draw keys of a two-phase plan; the rows the resolution gathers when a request is
    flagged) and rank 0's result (before any resolution).

    Args:
        shards, plans: the emulated ranks' shards (``.local_logits``) and sampled plans
            (:func:`shardmax.testing.emulate.emulated_ranks`), in rank order.
        batch: the step's checked ``StepBatch``; cu_np: its host ``cu_num_logits``.
        topp: the plans verify top-p from level histograms (their draw takes the kept sets).
    """
    from shardmax.ops.resolve import flagged_requests, resolution_rows

    sent = [p.local(s.local_logits, batch) for p, s in zip(plans, shards, strict=True)]
    g1 = torch.cat(sent, dim=0)
    res = plans[0].finish(g1, batch)
    gathered = [g1]
    if plans[0].two_phase:
        draw = plans[0].draw_rows(batch.num_reqs)
        kept = plans[0].kept_sets() if topp else None
        keys = [
            p.draw(s.local_logits, batch, draw, kept) for p, s in zip(plans, shards, strict=True)
        ]
        g2 = torch.cat(keys, dim=0)
        res = plans[0].pick(g2, res)
        gathered.append(g2)
    req, _ = flagged_requests(res)
    if req.size:
        plan = resolution_rows(res, cu_np, req)  # the rows the resolution gathers
        rows = torch.from_numpy(plan.rows[plan.gather]).to(shards[0].local_logits.device)
        gathered.append(torch.cat([s.local_logits[rows] for s in shards], dim=0))
    return gathered, res


def full_rows(full_logits: torch.Tensor) -> Callable[[np.ndarray], torch.Tensor]:
    """``fetch_rows`` of :func:`shardmax.ops.resolve.resolve_requests` for an emulated step: the
    rows of the full ``[num_logits, V]`` logits (what :func:`~shardmax.ops.resolve.gather_rows`
    gathers from the ranks' shards)."""
    return lambda rows: full_logits[torch.from_numpy(rows).to(full_logits.device)]
