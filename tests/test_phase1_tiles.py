"""Phase 1 of a two-phase step over several tiles per program (its software-pipelined loop).

``tile_stats`` loads the next tile before it reduces the current one, and ends with the masked
tail. The two-phase tests elsewhere use shards of under two tiles per record program; here each
program covers several whole tiles (and a tail, or none), with temperature-1 rows (no division)
next to scaled ones, a NaN and a ``+inf`` in a middle tile: the step must equal the one-pass step
and the reference exactly as ``tests/test_two_phase.py`` requires, and flag both rows. On a GPU
machine these run the compiled kernels (``device`` fixture), elsewhere the interpreter.
"""

from __future__ import annotations

import math

import pytest

from shardmax.ops.sampled import FallbackReason
from tests.test_two_phase import _assert_same, _batch, _both


@pytest.mark.parametrize(
    ("tp", "vocab", "splits"),
    [
        (1, 9001, 1),  # 4 whole tiles + a tail of 809 columns
        (1, 8192, 2),  # 2 whole tiles per program, no tail
        (2, 9001, 1),  # shards of 4501 columns: 2 whole tiles + a tail
    ],
)
def test_multi_tile_phase1_equals_one_pass_and_reference(tp, vocab, splits, device) -> None:
    batch, temps = _batch(5, 3, vocab, seed=vocab + splits, device=device, placeholder_prob=0.0)
    first = batch.cu_num_logits.long()  # every request's first row is always used
    batch.logits[first[1], 2048 * 2 + 17] = math.nan  # in the third tile
    batch.logits[first[2], 2048 + 5] = math.inf  # in the second tile
    temps[batch.idx_mapping.long()[1:3]] = 1.0  # the flagged requests sampled (T = 1: no division)
    one, two, want = _both(batch, temps, tp, record_splits=splits, draw_splits=2)
    _assert_same(one, two, want)
    assert int((two.reason == FallbackReason.NON_FINITE).sum()) == 2


@pytest.mark.parametrize("tp", [1, 2])
def test_infinite_temperature_rows_with_a_tail(tp, device) -> None:
    """T = +inf (the value checks take it; ``x = raw / T`` is 0 or NaN): the masked lanes of a
    tail load ``-inf``, and ``-inf / inf`` is NaN -- phase 1 and the draw keep them ``-inf``, so
    the two-phase step equals the one-pass step and the reference (before, every drafted row
    with a tail was flagged NON_FINITE, and a bonus row drew a padding column)."""
    batch, temps = _batch(5, 3, 1500, seed=tp, device=device, placeholder_prob=0.3)  # tails
    temps[batch.idx_mapping.long()] = math.inf
    one, two, want = _both(batch, temps, tp, record_splits=1, draw_splits=1)
    _assert_same(one, two, want)
    assert not bool(two.fallback.any())
    assert int(two.sampled.max()) < 1500
