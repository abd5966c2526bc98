"""Shard geometry: what every TP rank must agree on, checked with one collective.

A :class:`Geometry` holds every rank's ``(vocab_start, num_valid)`` in rank order, the local
width ``W`` and the logits dtype. :func:`exchange_geometry` all-gathers five int64 words per rank
``(W, dtype, vocab_start, num_valid, rows)`` and checks that widths, dtypes (and row counts,
when given) agree and that the vocab ranges are in rank order and do not overlap. Every rank sees
the same gathered bytes, so a mismatch raises the same ValueError on every rank instead of
pairing later collectives wrongly or returning a silently wrong id.

When it runs (the rule that keeps every rank's sequence of collectives identical):

* :class:`shardmax.plan.VocabShard` runs it once, when it is constructed (every rank constructs
  its shard at the same point of the program, as vLLM builds its model runner);
* the functional ops (:func:`shardmax.vocab_parallel_argmax`, ...) run it on EVERY call while
  the value checks are on (:func:`shardmax.runtime.validation.value_checks`, the default): the
  decision depends on a process-wide setting that is the same on every rank, never on what a
  rank has seen before, so a geometry changed on one rank at a later call still raises on all;
* with the value checks off the functional ops do not communicate: they use the geometry a
  checked call of this group recorded (:func:`checked_geometry`); a rank whose local geometry
  was never checked raises a ValueError on that rank (its peers then wait in the step's own
  collective until the group's timeout: turn the value checks off only after a checked call).

It never runs during CUDA-graph capture (a host read): plan or call once eagerly first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shardmax.runtime.collectives import Collective

_DTYPE_CODE = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
_CODE_NAME = {1: "bf16", 2: "fp16", 3: "fp32"}


@dataclass(frozen=True)
class Geometry:
    """Every rank's vocab range, the common local width and the logits dtype."""

    ranges: tuple[tuple[int, int], ...]  # (vocab_start, num_valid) per rank, rank order
    width: int  # padded local width W (columns of one rank's logits)
    dtype: torch.dtype

    @property
    def tp(self) -> int:
        return len(self.ranges)

    @property
    def vocab(self) -> int:
        """Global vocabulary size: one past the largest real id of any rank."""
        return max(s + n for s, n in self.ranges)

    @property
    def tiles_from_zero(self) -> bool:
        """The ranks' ranges tile ``[0, V)`` in rank order without gaps (vLLM's layout)."""
        pos = 0
        for s, n in self.ranges:
            if n and s != pos:
                return False
            pos = s + n if n else pos
        return True


def _group_id(coll: Collective) -> Any:
    inner = getattr(coll, "group", None) or getattr(coll, "coordinator", None)
    return id(inner) if inner is not None else id(coll)


_checked: dict[tuple[Any, ...], Geometry] = {}


def exchange_device(coll: Collective, hint: torch.device | None = None) -> torch.device:
    """Where the group's collectives take tensors: the hint (the logits' device) if there is
    one, else the current CUDA device for NCCL/RCCL groups and the CPU for gloo."""
    if hint is not None and hint.type in ("cuda", "cpu"):
        return hint
    group = getattr(coll, "group", None)
    try:
        import torch.distributed as dist

        if group is not None and dist.get_backend(group) == "gloo":
            return torch.device("cpu")
    except Exception:
        pass
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def exchange_geometry(
    coll: Collective,
    width: int,
    dtype: torch.dtype | None,
    vocab_start: int,
    num_valid: int,
    device: torch.device,
    rows: int = -1,
    failed: bool = False,
) -> Geometry:
    """The group's :class:`Geometry`, checked on every rank (one all_gather of 48 bytes per rank
    and one host read). ``rows`` (>= 0) is checked equal across ranks too; -1 skips it.
    ``failed``: this rank refused its own inputs (it raises its own error afterwards); every
    other rank then raises too, so nobody goes on into the step's collective alone.

    Raises:
        ValueError: (the same on every rank) widths, dtypes or row counts differ, a rank's range
            starts inside the previous rank's, or no rank holds a real column; on the other
            ranks, a rank refused its inputs.
        RuntimeError: called during CUDA-graph capture.
    """
    if coll.world_size == 1:
        assert dtype is not None
        return Geometry(((vocab_start, num_valid),), width, dtype)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "shardmax: the shard geometry is checked with a host read, which cannot happen "
            "during CUDA-graph capture; build the VocabShard / run the op once eagerly first"
        )
    code = _DTYPE_CODE.get(dtype, 0) if dtype is not None else 0
    mine = torch.tensor(
        [[width, code, vocab_start, num_valid, rows, int(failed)]],
        dtype=torch.int64,
        device=device,
    )
    table = coll.all_gather_dim0(mine).tolist()
    refused = [r for r, row in enumerate(table) if row[5]]
    if refused:
        if failed:
            return Geometry(((vocab_start, num_valid),) * len(table), width, torch.float32)
        raise ValueError(
            f"shardmax: TP rank(s) {refused} refused their inputs (see their error); this rank "
            "stops too so that no rank goes on into the step's collective alone"
        )
    table = [row[:5] for row in table]
    assert dtype is not None
    problems = []
    if len({row[0] for row in table}) != 1:
        problems.append(f"local widths differ across ranks: {[row[0] for row in table]}")
    if len({row[1] for row in table}) != 1:
        names = [_CODE_NAME.get(row[1], str(row[1])) for row in table]
        problems.append(f"logits dtypes differ across ranks: {names}")
    if any(row[4] >= 0 for row in table) and len({row[4] for row in table}) != 1:
        problems.append(f"logits row counts differ across ranks: {[row[4] for row in table]}")
    for r in range(1, len(table)):
        prev_end = table[r - 1][2] + table[r - 1][3]
        if table[r][2] < prev_end:
            problems.append(
                f"rank {r} vocab range starts at {table[r][2]}, inside rank {r - 1}'s range "
                f"ending at {prev_end} (ranges must be in rank order, non-overlapping)"
            )
    if sum(row[3] for row in table) == 0:
        problems.append("no rank holds a real column (num_valid is 0 everywhere): empty vocabulary")
    if problems:
        raise ValueError(
            "shard geometry mismatch across TP ranks ((W, dtype, vocab_start, num_valid, rows) "
            f"per rank: {table}): " + "; ".join(problems)
        )
    geo = Geometry(tuple((int(row[2]), int(row[3])) for row in table), width, dtype)
    _checked[(_group_id(coll), width, dtype, vocab_start, num_valid)] = geo
    return geo


def checked_geometry(
    coll: Collective, width: int, dtype: torch.dtype, vocab_start: int, num_valid: int
) -> Geometry:
    """The geometry an earlier :func:`exchange_geometry` of this group recorded for this rank's
    ``(W, dtype, vocab_start, num_valid)``; no communication.

    Raises:
        ValueError: (on this rank only) no checked geometry matches.
    """
    if coll.world_size == 1:
        return Geometry(((vocab_start, num_valid),), width, dtype)
    geo = _checked.get((_group_id(coll), width, dtype, vocab_start, num_valid))
    if geo is None:
        raise ValueError(
            f"geometry: (W={width}, dtype={dtype}, vocab_start={vocab_start}, "
            f"num_valid={num_valid}) of this rank was never checked for this group: with the "
            "value checks off the ops do not communicate to check it; make one call with the "
            "value checks on first (or use shardmax.VocabShard, which checks it once)"
        )
    return geo
