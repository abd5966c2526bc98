"""Once-per-setup check that every TP rank agrees on the shard geometry.

Before the first sharded call of a group with a given local geometry, every rank all-gathers
``(W, dtype, vocab_start, num_valid)`` and checks that widths and dtypes agree and that the
vocab ranges are in rank order and do not overlap. A mismatch raises the same ValueError on
every rank (they all see the same gathered bytes) instead of hanging in a later collective or
returning a silently wrong id. The result is cached; the check never runs during CUDA-graph
capture (call the op once eagerly first, as vLLM's warm-up does).

Not checked per call: the row count B, which must be equal on all ranks (vLLM pads the batch
identically on every rank).
"""

from __future__ import annotations

from typing import Any

import torch

from shardmax.collectives import Collective

_DTYPE_CODE = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
_cache: dict[tuple[Any, ...], list[tuple[int, int]]] = {}


def _group_id(coll: Collective) -> Any:
    inner = getattr(coll, "group", None) or getattr(coll, "coordinator", None)
    return id(inner) if inner is not None else id(coll)


def check_geometry(
    coll: Collective, logits: torch.Tensor | None, vocab_start: int, num_valid: int
) -> list[tuple[int, int]]:
    """``[(vocab_start, num_valid)]`` of every rank, in rank order (cached per geometry).

    With ``logits=None`` only a cached geometry is looked up (ValueError if there is none).
    """
    if coll.world_size == 1:
        return [(vocab_start, num_valid)]
    gid = _group_id(coll)
    if logits is None:
        for key, geo in _cache.items():
            if key[0] == gid and key[3:] == (vocab_start, num_valid):
                return geo
        raise ValueError("geometry: no checked geometry for this group; call an op first")
    key = (gid, logits.shape[1], logits.dtype, vocab_start, num_valid)
    if key in _cache:
        return _cache[key]
    if logits.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "shardmax: first call for this shard geometry happened during CUDA-graph capture; "
            "run the op once eagerly (warm-up) before capturing"
        )
    mine = torch.tensor(
        [[logits.shape[1], _DTYPE_CODE[logits.dtype], vocab_start, num_valid]],
        dtype=torch.int64,
        device=logits.device,
    )
    table = coll.all_gather_dim0(mine).tolist()
    widths = {row[0] for row in table}
    dtypes = {row[1] for row in table}
    problems = []
    if len(widths) != 1:
        problems.append(f"local widths differ across ranks: {[row[0] for row in table]}")
    if len(dtypes) != 1:
        problems.append(f"logits dtypes differ across ranks (codes {[row[1] for row in table]})")
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
            "shard geometry mismatch across TP ranks (W, dtype, vocab_start, num_valid per "
            f"rank: {table}): " + "; ".join(problems)
        )
    geo = [(int(row[2]), int(row[3])) for row in table]
    _cache[key] = geo
    return geo
