"""``resolve_select``: a folded fallback's flagged requests picked on the device
(:meth:`shardmax.integrations.vllm.fallback.DeviceFallback._body`'s padded sub-batch).

CPU (Triton interpreter) against a plain-Python model of the captured resolution's layout
(:meth:`shardmax.integrations.vllm.resolution.CapturedResolution._plan`): which requests take the
slots, the sub-batch's ``cu``, each row's step indices and ``table_copy`` entry, the padding,
``resolve_apply``'s words and the overflow flag -- for no request flagged, fewer than the
capacity, exactly it, more (the overflow), every request, requests with fewer rows than
``K + 1``, flags spread over several scan blocks, and a capture's table (nothing answered).
The kernel on the GPU runs inside the folded fallback's GPU tests (``tests/test_fallback.py``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardmax.integrations.vllm import fallback as fb
from shardmax.runtime import kernels

ADDR_LOGITS = 1 << 40
"""A made-up address of the step's logits (the kernel only computes addresses from it)."""
SUB, PAD = 1 << 41, 1 << 42
ROW_BYTES, SUB_ROW_BYTES, COPY_BYTES = 4096, 2048, 2000
OUTS = (11, 12, 13, 14, 15)
"""The step's five output addresses in its table (copied into resolve_apply's words)."""


def _model(flags, sizes, cap, k1, answered):
    """What the kernel must write: (req_sel, cu, rows [(source address, step row)], taken,
    over)."""
    n = len(flags)
    cu = np.concatenate([[0], np.cumsum(sizes)])
    flagged = [r for r in range(n) if flags[r]]
    taken = min(len(flagged), cap)
    first = flagged[0] if flagged else 0
    sel = flagged[:taken] + [first] * (cap - taken)
    sub_sizes = [int(sizes[r]) for r in sel[:taken]] + [1] * (cap - taken)
    sub_cu = np.concatenate([[0], np.cumsum(sub_sizes)])
    rows = [(PAD, int(cu[first]))] * (cap * k1)  # padding: the first request's first row
    for j, r in enumerate(sel[:taken]):
        for t in range(int(sizes[r])):
            rows[int(sub_cu[j]) + t] = (ADDR_LOGITS + (int(cu[r]) + t) * ROW_BYTES, int(cu[r]) + t)
    return sel, sub_cu, rows, taken if answered else 0, len(flagged) > cap


def _run(flags, sizes, cap, k1, answered=True, block_r=None, wide=False):
    """The kernel on one case; ``wide``: the step's index tensors int64 (the outputs keep their
    dtypes: every store casts)."""
    n, m = len(flags), int(sum(sizes))
    gen = np.random.default_rng(n * 31 + cap)
    i32 = torch.int64 if wide else torch.int32
    table = torch.zeros(fb._WORDS, dtype=torch.int64)
    table[fb._NUM_REQS] = n
    table[fb._APPLY] = n if answered else 0
    table[fb._APPLY + 1 : fb._APPLY + 6] = torch.tensor(OUTS)
    table[fb._BODY] = ADDR_LOGITS
    step = {
        "cu": torch.tensor(np.concatenate([[0], np.cumsum(sizes)]), dtype=i32),
        "draft": torch.tensor(gen.integers(0, 1000, m), dtype=i32),
        "pos": torch.tensor(gen.integers(0, 10**6, m), dtype=torch.int64),
        "eim": torch.tensor(gen.integers(0, 64, m), dtype=i32),
        "elp": torch.tensor(gen.integers(0, 8, m), dtype=i32),
        "idx": torch.tensor(gen.permutation(max(64, n))[:n], dtype=i32),
        "seq": torch.tensor(gen.integers(1, 5000, n), dtype=i32),
    }
    rows = cap * k1
    out = {
        "draft": torch.full((rows,), -7, dtype=torch.int32),
        "pos": torch.full((rows,), -7, dtype=torch.int64),
        "eim": torch.full((rows,), -7, dtype=torch.int32),
        "elp": torch.full((rows,), -7, dtype=torch.int32),
        "idx": torch.full((cap,), -7, dtype=torch.int32),
        "seq": torch.full((cap,), -7, dtype=torch.int32),
        "cu": torch.full((cap + 1,), -7, dtype=torch.int32),
        "req_sel": torch.full((cap,), -7, dtype=torch.int64),
        "apply": torch.full((6,), -7, dtype=torch.int64),
        "entries": torch.full((3 * rows,), -7, dtype=torch.int64),
        "over": torch.full((1,), 7, dtype=torch.uint8),
    }
    select = kernels.kernel("resolve_select")
    consts = dict(select.module.CONSTEXPRS)
    consts.pop("PDL")
    consts.update(NUM_REQS_AT=fb._NUM_REQS, APPLY_AT=fb._APPLY, LOGITS_AT=fb._BODY,
                  CAP_P=fb._pow2(cap), ROWS_P=fb._pow2(k1))  # fmt: skip
    if block_r is not None:
        consts["BLOCK_R"] = block_r
    select(
        (1,), table, torch.tensor(flags, dtype=torch.uint8), step["cu"], step["draft"],
        step["pos"], step["eim"], step["elp"], step["idx"], step["seq"], out["draft"],
        out["pos"], out["eim"], out["elp"], out["idx"], out["seq"], out["cu"], out["req_sel"],
        out["apply"], out["entries"], out["over"], SUB, SUB_ROW_BYTES, PAD, ROW_BYTES,
        COPY_BYTES, cap, rows, **consts,
    )  # fmt: skip
    return step, out


CASES = [
    # (flags, rows per request, capacity, K + 1)
    ([0, 0, 0, 0, 0], [4, 4, 4, 4, 4], 2, 4),  # nothing flagged (a capture's warm-up)
    ([0, 1, 0, 0, 0], [4, 4, 4, 4, 4], 2, 4),  # fewer than the capacity
    ([1, 0, 0, 0, 1], [4, 2, 4, 1, 3], 2, 4),  # exactly the capacity, requests of 3 and 4 rows
    ([1, 1, 0, 1, 1], [4, 4, 4, 4, 4], 2, 4),  # more: the overflow
    ([1] * 7, [2, 1, 4, 4, 3, 4, 1], 8, 4),  # every request, a capacity above the step's
    ([0, 0, 1, 0, 0, 0, 1, 0, 1], [1] * 9, 4, 1),  # K = 0
    ([0] * 40 + [1] + [0] * 30 + [1, 1] + [0] * 29, [6] * 102, 4, 6),  # K = 5, flags far apart
    ([0, 0, 1, 0, 1, 0, 0, 0], [4, 4, 3, 4, 2, 4, 4, 4], 1, 4),  # capacity 1 (buckets of 2-16)
    ([0, 0, 0, 1, 0, 0, 0, 0], [4, 4, 3, 2, 2, 4, 4, 4], 1, 4),
]


@pytest.mark.parametrize("answered", [True, False])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_resolve_select_matches_the_resolution_layout(case: int, answered: bool) -> None:
    flags, sizes, cap, k1 = CASES[case]
    # one scan block, flags over many (a 4-lane scan), the step's indices int64
    for block_r, wide in ((None, False), (4, False), (None, True)):
        step, out = _run(flags, sizes, cap, k1, answered, block_r, wide)
        sel, sub_cu, rows, n_apply, over = _model(flags, sizes, cap, k1, answered)
        assert out["req_sel"].tolist() == sel, (case, block_r)
        assert out["cu"].tolist() == sub_cu.tolist()
        assert out["idx"].tolist() == step["idx"][sel].tolist()
        assert out["seq"].tolist() == step["seq"][sel].tolist()
        entries = out["entries"].view(-1, 3)
        step_rows = [r for _, r in rows]
        assert entries[:, 0].tolist() == [src for src, _ in rows], (case, block_r)
        assert entries[:, 1].tolist() == [SUB + i * SUB_ROW_BYTES for i in range(len(rows))]
        assert entries[:, 2].tolist() == [COPY_BYTES] * len(rows)
        for name in ("draft", "pos", "eim", "elp"):
            assert out[name].tolist() == step[name][step_rows].tolist(), (case, name)
        assert out["apply"].tolist() == [n_apply, *OUTS]
        assert int(out["over"][0]) == int(over)
