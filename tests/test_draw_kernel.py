"""The draw kernel's lean fp32 loop against its generic loop, key for key.

``sampled_draw_*`` draws fp32 Gumbel keys without a kept set through ``draw_f32`` (each lane
tracks its best value and id, mapped to a packed key once); every other configuration runs the
generic loop (``lane_best`` on the ordered bits of every element). A kept set that keeps every
token (reason != 0: not masked) sends the same draw through the generic loop, so the two must
give identical keys -- on rows with NaN, ``+inf``, all ``-inf``, signed zeros, a draft at a
split's first column and at a tile's tail, partial tails, several splits, greedy and
non-drawing requests, combined by atomic max or stored per split.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton

from shardmax.ops.sampled import DrawLaunch, RowParams, draw_keys
from shardmax.runtime.keys import EMPTY_KEY

BLOCK = 1024


def _rows(width: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(7, width, generator=gen) * 3.0
    x[1, 777 % width] = float("nan")  # a NaN row
    x[1, 3000 % width] = float("nan")  # ... with a second NaN (the first one wins)
    x[2, 1500 % width] = float("inf")  # a +inf row
    x[3] = float("-inf")  # no finite value: every lane keeps its first column
    x[4, ::2] = 0.0  # signed zeros everywhere
    x[4, 1::2] = -0.0
    x[5, width - 3 :] = 40.0  # the best values in the last tile's tail
    return x.to(dtype)


def _params(rows: int, width: int) -> RowParams:
    # row 0 at T = +inf (-inf / T is NaN: the tail's masked lanes must stay -inf), row 6 greedy
    temp = torch.tensor([math.inf, 0.7, 1.0, 1.3, 1.0, 0.9, 0.0])[:rows]
    draft = torch.tensor([5, BLOCK, -1, 10, 2 * BLOCK, width - 1, 3])[:rows]  # edges, a bonus row
    draft = torch.where(draft < 0, draft, draft % width)
    return RowParams(
        temperature=temp.float(),
        seed=torch.arange(rows, dtype=torch.int64) * 7919 - 3,
        draft=draft.long(),
        slot=torch.arange(rows, dtype=torch.int64),
        pos=torch.arange(rows, dtype=torch.int64) + 100,
    )


def _keys(logits, params, draw, launch, combine: bool, kept_all: bool) -> torch.Tensor:
    reqs = draw.numel() // 2
    slot = 2 if kept_all else 1
    parts = 1 if combine else launch.splits
    keys = torch.full((parts * reqs, slot), EMPTY_KEY, dtype=torch.int64, device=logits.device)
    kept = None
    if kept_all:  # reason 1: no mask, every token drawn (the generic loop)
        kept = torch.zeros((logits.shape[0], 10), dtype=torch.int32, device=logits.device)
        kept[:, 0] = 1
    draw_keys(logits, 0, logits.shape[1], params, draw, launch, False, keys.view(-1), kept, combine)
    return keys[:, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("width", "splits"), [(5000, 1), (5000, 3), (2048, 2), (700, 1)])
@pytest.mark.parametrize("combine", [False, True])
def test_lean_fp32_draw_equals_the_generic_loop(dtype, width, splits, combine, device) -> None:
    logits = _rows(width, dtype).to(device)
    rows = logits.shape[0]
    params = RowParams(*(t.to(device) for t in _params(rows, width)))
    # every row drawn once, plus a request that draws nothing (-1) and one out of range
    draw = torch.tensor([*range(rows), -1, rows + 5], dtype=torch.int32, device=device)
    draw = torch.cat([draw, torch.zeros_like(draw)])  # the second half: the finish's own use
    chunk = triton.cdiv(triton.cdiv(width, splits), BLOCK) * BLOCK  # as draw_launch
    name = "sampled_draw_" + {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype] + "_b1024"
    launch = DrawLaunch(name, splits, 4, chunk)
    lean = _keys(logits, params, draw, launch, combine, kept_all=False)
    generic = _keys(logits, params, draw, launch, combine, kept_all=True)
    assert torch.equal(lean, generic), (lean, generic)
    reqs = draw.numel() // 2
    per_req = lean.view(-1, reqs) if not combine else lean.view(1, reqs)
    # the greedy row and the non-drawing requests draw nothing; every other request draws
    assert (per_req[:, rows - 1 :] == EMPTY_KEY).all()
    assert (per_req[:, : rows - 1] != EMPTY_KEY).any(dim=0).all()
