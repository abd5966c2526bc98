"""Deterministic, seeded adversarial inputs for the exactness tests and the tuner's gate.

* :func:`adversarial_logits` -- logits whose rows cycle through :data:`ADVERSARIAL_CASES`.
* :func:`random_verify_batch` -- a vLLM-shaped greedy-verification batch (:class:`VerifyBatch`).
* :func:`assert_same_ids` -- exact id comparison with a useful failure message.

Everything is generated on the CPU with a private ``torch.Generator`` (same seed -> same tensors,
on every machine and device) and moved to ``device`` at the end.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shardmax.reference import argmax, greedy_verify, unconditional_to_conditional_rates
from shardmax.testing.shards import default_pad_to, vllm_shard_ranges

__all__ = [
    "ADVERSARIAL_CASES",
    "VerifyBatch",
    "adversarial_logits",
    "assert_same_ids",
    "random_verify_batch",
]

_TOP = 8.0
"""Planted maximum: above every clamped normal sample, exact in bf16/fp16/fp32."""

_DEFAULT_BLOCK = 1024
"""Block grid used when ``block`` is None: vLLM's bonus-row block (every 8192 edge is one too)."""

ADVERSARIAL_CASES: tuple[str, ...] = (
    "random_normal",
    "tie_in_block",
    "tie_block_edge",
    "tie_shard_edge",
    "tie_across_shards",
    "posinf_single",
    "posinf_tied",
    "all_neginf",
    "neginf_one_finite",
    "signed_zero_max",
    "signed_zero_max_rev",
    "nan_single",
    "nan_several",
    "nan_last_id",
    "nan_with_posinf",
    "all_nan",
    "all_equal",
    "max_at_first",
    "max_at_last",
    "coarse_values",
)
"""Case of row ``b`` is ``ADVERSARIAL_CASES[b % len(ADVERSARIAL_CASES)]`` (see
:func:`adversarial_logits`)."""


@dataclass(frozen=True)
class _Ctx:
    vocab: int
    block: int
    shard_ranges: tuple[tuple[int, int], ...]  # (start, num_valid) of non-empty ranks
    gen: torch.Generator


def _rid(ctx: _Ctx, lo: int, hi: int) -> int:
    """Random int in ``[lo, hi)`` (``hi > lo``)."""
    return int(torch.randint(lo, hi, (1,), generator=ctx.gen).item())


def _distinct(ctx: _Ctx, lo: int, hi: int, k: int) -> list[int]:
    perm = torch.randperm(hi - lo, generator=ctx.gen)[:k]
    return sorted(int(p) + lo for p in perm)


def _edge_pair(ctx: _Ctx, edges: list[int]) -> list[int]:
    """``[e - 1, e]`` for a random interior edge, else the middle pair (or ``[0]`` if V == 1)."""
    v = ctx.vocab
    if edges:
        e = edges[_rid(ctx, 0, len(edges))]
    elif v >= 2:
        e = v // 2
    else:
        return [0]
    return [e - 1, e]


def _tie_in_block(row: torch.Tensor, ctx: _Ctx) -> None:
    nblocks = -(-ctx.vocab // ctx.block)
    b = _rid(ctx, 0, nblocks)
    lo, hi = b * ctx.block, min(ctx.vocab, (b + 1) * ctx.block)
    row[_distinct(ctx, lo, hi, 3)] = _TOP


def _tie_block_edge(row: torch.Tensor, ctx: _Ctx) -> None:
    edges = list(range(ctx.block, ctx.vocab, ctx.block))
    row[_edge_pair(ctx, edges)] = _TOP


def _tie_shard_edge(row: torch.Tensor, ctx: _Ctx) -> None:
    edges = [s for s, _ in ctx.shard_ranges if 0 < s < ctx.vocab]
    row[_edge_pair(ctx, edges)] = _TOP


def _tie_across_shards(row: torch.Tensor, ctx: _Ctx) -> None:
    v = ctx.vocab
    first, last = ctx.shard_ranges[0], ctx.shard_ranges[-1]
    if len(ctx.shard_ranges) >= 2:
        a = _rid(ctx, first[0], first[0] + first[1])
        c = _rid(ctx, last[0], last[0] + last[1])
    else:
        a = _rid(ctx, 0, max(1, v // 4))
        c = _rid(ctx, min(v - 1, (3 * v) // 4), v)
    row[[a, c]] = _TOP


def _posinf_single(row: torch.Tensor, ctx: _Ctx) -> None:
    row[0] = _TOP
    row[_rid(ctx, 0, ctx.vocab)] = math.inf


def _posinf_tied(row: torch.Tensor, ctx: _Ctx) -> None:
    row[_distinct(ctx, 0, ctx.vocab, 3)] = math.inf


def _all_neginf(row: torch.Tensor, ctx: _Ctx) -> None:
    row[:] = -math.inf


def _neginf_one_finite(row: torch.Tensor, ctx: _Ctx) -> None:
    row[:] = -math.inf
    row[_rid(ctx, 0, ctx.vocab)] = -5.0


def _negative_row(row: torch.Tensor) -> None:
    row.copy_(-(row.abs()) - 1.0)


def _signed_zero_max(row: torch.Tensor, ctx: _Ctx) -> None:
    _negative_row(row)
    ids = _distinct(ctx, 0, ctx.vocab, 2)
    row[ids[0]] = -0.0
    if len(ids) > 1:
        row[ids[1]] = 0.0


def _signed_zero_max_rev(row: torch.Tensor, ctx: _Ctx) -> None:
    _negative_row(row)
    ids = _distinct(ctx, 0, ctx.vocab, 2)
    row[ids[0]] = 0.0
    if len(ids) > 1:
        row[ids[1]] = -0.0


def _nan_single(row: torch.Tensor, ctx: _Ctx) -> None:
    row[_rid(ctx, 0, ctx.vocab)] = math.inf
    row[_rid(ctx, 0, ctx.vocab)] = math.nan


def _nan_several(row: torch.Tensor, ctx: _Ctx) -> None:
    row[_rid(ctx, 0, ctx.vocab)] = _TOP
    row[_distinct(ctx, 0, ctx.vocab, 3)] = math.nan


def _nan_last_id(row: torch.Tensor, ctx: _Ctx) -> None:
    row[_rid(ctx, 0, ctx.vocab)] = _TOP
    row[ctx.vocab - 1] = math.nan


def _nan_with_posinf(row: torch.Tensor, ctx: _Ctx) -> None:
    ids = _distinct(ctx, 0, ctx.vocab, 3)
    row[ids[0]] = math.inf
    row[ids[-1]] = math.inf
    row[ids[len(ids) // 2]] = math.nan


def _all_nan(row: torch.Tensor, ctx: _Ctx) -> None:
    row[:] = math.nan


def _all_equal(row: torch.Tensor, ctx: _Ctx) -> None:
    row[:] = 1.5


def _max_at_first(row: torch.Tensor, ctx: _Ctx) -> None:
    row[0] = _TOP


def _max_at_last(row: torch.Tensor, ctx: _Ctx) -> None:
    row[ctx.vocab - 1] = _TOP


def _coarse_values(row: torch.Tensor, ctx: _Ctx) -> None:
    vals = torch.randint(-4, 5, (ctx.vocab,), generator=ctx.gen).to(torch.float32) / 2
    row.copy_(vals)


def _random_normal(row: torch.Tensor, ctx: _Ctx) -> None:
    return None


_PLANTERS: dict[str, Callable[[torch.Tensor, _Ctx], None]] = {
    "random_normal": _random_normal,
    "tie_in_block": _tie_in_block,
    "tie_block_edge": _tie_block_edge,
    "tie_shard_edge": _tie_shard_edge,
    "tie_across_shards": _tie_across_shards,
    "posinf_single": _posinf_single,
    "posinf_tied": _posinf_tied,
    "all_neginf": _all_neginf,
    "neginf_one_finite": _neginf_one_finite,
    "signed_zero_max": _signed_zero_max,
    "signed_zero_max_rev": _signed_zero_max_rev,
    "nan_single": _nan_single,
    "nan_several": _nan_several,
    "nan_last_id": _nan_last_id,
    "nan_with_posinf": _nan_with_posinf,
    "all_nan": _all_nan,
    "all_equal": _all_equal,
    "max_at_first": _max_at_first,
    "max_at_last": _max_at_last,
    "coarse_values": _coarse_values,
}
assert tuple(_PLANTERS) == ADVERSARIAL_CASES


def adversarial_logits(
    rows: int,
    vocab: int,
    *,
    dtype: torch.dtype,
    seed: int,
    tp_size: int = 1,
    block: int | None = None,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """Seeded logits ``[rows, vocab]`` whose row ``b`` is case ``ADVERSARIAL_CASES[b % 20]``.

    Background: standard normal clamped to ``[-6, 6]``, cast to ``dtype``; planted maxima are
    ``8.0`` (exact in every dtype). Cases, in row order:

    ``random_normal``        the background only.
    ``tie_in_block``         three exact ties of the max inside one ``block``-aligned block.
    ``tie_block_edge``       tie at ids ``e - 1`` and ``e`` for a block edge ``e = k * block``.
    ``tie_shard_edge``       tie at the last id of one rank and the first id of the next
                             (:func:`shardmax.testing.shard_like_vllm` layout for ``tp_size``).
    ``tie_across_shards``    tie between an id of the first and an id of the last non-empty rank
                             (far apart; with one rank: first and last quarter of the vocab).
    ``posinf_single``        one ``+inf`` (and a planted max at id 0).
    ``posinf_tied``          ``+inf`` at three ids.
    ``all_neginf``           every value ``-inf`` (answer: id 0).
    ``neginf_one_finite``    ``-inf`` everywhere but one finite ``-5.0``.
    ``signed_zero_max``      all values ``<= -1`` except ``-0.0`` at id a and ``+0.0`` at b > a.
    ``signed_zero_max_rev``  the same with ``+0.0`` at a and ``-0.0`` at b (answer: a both times).
    ``nan_single``           one NaN and one ``+inf`` elsewhere.
    ``nan_several``          NaN at three ids (answer: the lowest).
    ``nan_last_id``          NaN at ``vocab - 1`` (and a planted max).
    ``nan_with_posinf``      ``+inf`` at a and c, NaN at b with a < b < c.
    ``all_nan``              every value NaN (answer: id 0).
    ``all_equal``            every value ``1.5`` (answer: id 0).
    ``max_at_first``         planted max at id 0.
    ``max_at_last``          planted max at ``vocab - 1``.
    ``coarse_values``        values in ``{-2, -1.5, ..., 2}``: many natural ties of the max.

    Where ``vocab`` is too small for a case (e.g. no interior block or shard edge) the case falls
    back to a tie at the middle pair ``(V//2 - 1, V//2)`` and planted ids may coincide.

    Args:
        rows: number of rows (>= 0).
        vocab: vocabulary (>= 1).
        dtype: bf16/fp16/fp32 (any float dtype).
        seed: generator seed; same arguments -> same tensor.
        tp_size: TP size whose shard edges the shard cases target (vLLM layout with
            ``shards.default_pad_to(vocab, tp_size)``: 64, or ``64 * tp_size`` where 64 does
            not split evenly).
        block: block width whose edges ``tie_in_block``/``tie_block_edge`` target; ``None`` ->
            1024 (vLLM's bonus block; every 8192 edge is also a 1024 edge).
        device: where the result goes.

    Raises:
        ValueError: ``rows < 0``, ``vocab < 1``, ``block < 1``, non-float dtype, or a
            ``tp_size < 1``.
    """
    if rows < 0:
        raise ValueError(f"rows={rows} < 0")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a float dtype, got {dtype}")
    if block is not None and block < 1:
        raise ValueError(f"block={block} < 1")
    ranges = vllm_shard_ranges(vocab, tp_size, default_pad_to(vocab, tp_size))  # validates
    gen = torch.Generator().manual_seed(seed)
    ctx = _Ctx(
        vocab=vocab,
        block=block if block is not None else _DEFAULT_BLOCK,
        shard_ranges=tuple((s, n) for s, n, _ in ranges if n > 0),
        gen=gen,
    )
    out = torch.randn(rows, vocab, generator=gen).clamp_(-6.0, 6.0).to(dtype)
    for b in range(rows):
        _PLANTERS[ADVERSARIAL_CASES[b % len(ADVERSARIAL_CASES)]](out[b], ctx)
    return out.to(device)


# --------------------------------------------------------------------------------------------
# verification batches
# --------------------------------------------------------------------------------------------


@dataclass
class VerifyBatch:
    """A vLLM-shaped greedy-verification batch (spec §1.2-§1.4).

    Fields follow ``shardmax.sharded_greedy_verify``; ``logits`` is the full unpadded
    ``[num_logits, vocab]`` target logits (shard it with
    :func:`shardmax.testing.shard_like_vllm`).
    """

    logits: torch.Tensor
    draft_sampled: torch.Tensor  # int32 [num_logits]
    cu_num_logits: torch.Tensor  # int32 [num_reqs + 1]
    pos: torch.Tensor  # int64 [num_logits]
    idx_mapping: torch.Tensor  # int32 [num_reqs]
    expanded_local_pos: torch.Tensor  # int32 [num_logits]
    seed: torch.Tensor  # int64 [max_num_reqs]
    num_speculative_steps: int
    synthetic_conditional_rates: torch.Tensor | None  # fp32 [K] or None
    seq_lens: torch.Tensor  # int32 [num_reqs]
    prefill_len: torch.Tensor  # int32 [max_num_reqs]

    @property
    def num_reqs(self) -> int:
        return self.cu_num_logits.numel() - 1

    @property
    def num_logits(self) -> int:
        return self.logits.shape[0]

    @property
    def max_num_reqs(self) -> int:
        return self.seed.numel()

    def args(self) -> tuple[Any, ...]:
        """Positional args of ``sharded_greedy_verify`` after ``local_logits``."""
        return (
            self.draft_sampled,
            self.cu_num_logits,
            self.pos,
            self.idx_mapping,
            self.expanded_local_pos,
            self.seed,
            self.num_speculative_steps,
        )

    def kwargs(self) -> dict[str, Any]:
        """Keyword args of ``sharded_greedy_verify`` (except ``vocab_start``/``num_valid``/group)."""
        return {
            "synthetic_conditional_rates": self.synthetic_conditional_rates,
            "seq_lens": self.seq_lens,
            "prefill_len": self.prefill_len,
        }

    def reference(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`shardmax.reference.greedy_verify` on the full logits."""
        return greedy_verify(self.logits, *self.args(), **self.kwargs())


def random_verify_batch(
    num_reqs: int,
    num_speculative_steps: int,
    vocab: int,
    *,
    seed: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    accept_prob: float = 0.6,
    placeholder_prob: float = 0.1,
    prefill_prob: float = 0.1,
    synthetic: bool = False,
    logits: torch.Tensor | None = None,
) -> VerifyBatch:
    """Build a seeded vLLM-shaped verification batch.

    Per request: with ``prefill_prob`` a chunked-prefill request (0 drafts, one logits row,
    ``seq_len < prefill_len``); otherwise ``n_r`` uniform in ``0..K`` drafts (``n_r + 1`` rows;
    ``prefill_len <= seq_len``, sometimes equal: the step that finishes the prompt samples).
    ``draft_sampled[start]`` is a random "last sampled token"; ``draft_sampled[start + 1 + i]`` is
    ``-1`` with ``placeholder_prob``, else the target argmax of row ``start + i`` with
    ``accept_prob``, else a different id -- so verification accepts a random prefix.
    ``idx_mapping`` is a random injection into ``max_num_reqs = 2 * num_reqs + 1`` slots;
    ``pos`` increases by one per row from a random base; seeds cover the whole int64 range;
    ``synthetic`` adds random non-increasing unconditional rates converted to conditional fp32.

    Args:
        logits: optional ``[R, vocab]`` target logits. If ``R == num_logits`` it is used as is,
            otherwise its rows are cycled (row ``j`` = ``logits[j % R]``); e.g. pass
            :func:`adversarial_logits`. Default: seeded standard normal of ``dtype``.

    Returns:
        :class:`VerifyBatch` on ``device`` (int32 ``cu_num_logits``/``idx_mapping``/
        ``expanded_local_pos``/``draft_sampled``/``seq_lens``/``prefill_len``, int64
        ``pos``/``seed``). ``num_reqs == 0`` gives an empty batch (``cu_num_logits == [0]``).

    Raises:
        ValueError: negative sizes, ``vocab < 1``, or ``logits`` of the wrong width / no rows.
    """
    k = num_speculative_steps
    if num_reqs < 0 or k < 0 or vocab < 1:
        raise ValueError(f"bad sizes: num_reqs={num_reqs}, K={k}, vocab={vocab}")
    gen = torch.Generator().manual_seed(seed)

    def coin(p: float) -> bool:
        return bool(torch.rand((), generator=gen).item() < p)

    def rint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi, (1,), generator=gen).item())

    max_num_reqs = 2 * num_reqs + 1
    idx_mapping = torch.randperm(max_num_reqs, generator=gen)[:num_reqs]
    if num_reqs > 1 and bool((idx_mapping == torch.arange(num_reqs)).all()):
        idx_mapping = idx_mapping.roll(1)
    seeds = torch.randint(-(2**63), 2**63 - 1, (max_num_reqs,), dtype=torch.int64, generator=gen)
    prefill_len = torch.randint(1, 1 << 16, (max_num_reqs,), generator=gen)

    num_drafts: list[int] = []
    seq_lens: list[int] = []
    pos: list[int] = []
    for r in range(num_reqs):
        chunked = coin(prefill_prob)
        n = 0 if chunked or k == 0 else rint(0, k + 1)
        p0 = rint(0, 100_000)
        seq_len = p0 + n + 1
        slot = int(idx_mapping[r])
        if chunked:
            prefill_len[slot] = seq_len + rint(1, 1000)
        elif coin(0.3):
            prefill_len[slot] = seq_len
        else:
            prefill_len[slot] = rint(1, seq_len + 1)
        num_drafts.append(n)
        seq_lens.append(seq_len)
        pos.extend(range(p0, p0 + n + 1))
    counts = [n + 1 for n in num_drafts]
    num_logits = sum(counts)
    cu = [0]
    for c in counts:
        cu.append(cu[-1] + c)

    if logits is None:
        full = torch.randn(num_logits, vocab, generator=gen).to(dtype)
    else:
        if logits.dim() != 2 or logits.shape[1] != vocab:
            raise ValueError(f"logits must be [R, vocab={vocab}], got {tuple(logits.shape)}")
        if logits.shape[0] == num_logits:
            full = logits.detach().cpu().clone()
        elif logits.shape[0] == 0:
            raise ValueError("logits has no rows to cycle")
        else:
            full = logits.detach().cpu()[torch.arange(num_logits) % logits.shape[0]].clone()
    target = argmax(full).tolist() if num_logits else []

    draft_sampled: list[int] = []
    for r in range(num_reqs):
        start = cu[r]
        draft_sampled.append(rint(0, vocab))  # the last sampled token (not a draft)
        for i in range(num_drafts[r]):
            t = target[start + i]
            if coin(placeholder_prob):
                d = -1
            elif coin(accept_prob) or vocab == 1:
                d = t
            else:
                d = rint(0, vocab)
                d = (d + 1) % vocab if d == t else d
            draft_sampled.append(d)

    rates: torch.Tensor | None = None
    if synthetic:
        uncond = torch.rand(k, generator=gen).sort(descending=True).values
        rates = unconditional_to_conditional_rates(uncond).to(device)

    i32 = torch.int32
    return VerifyBatch(
        logits=full.to(device),
        draft_sampled=torch.tensor(draft_sampled, dtype=i32, device=device),
        cu_num_logits=torch.tensor(cu, dtype=i32, device=device),
        pos=torch.tensor(pos, dtype=torch.int64, device=device),
        idx_mapping=idx_mapping.to(device=device, dtype=i32),
        expanded_local_pos=torch.tensor(
            [j for c in counts for j in range(c)], dtype=i32, device=device
        ),
        seed=seeds.to(device),
        num_speculative_steps=k,
        synthetic_conditional_rates=rates,
        seq_lens=torch.tensor(seq_lens, dtype=i32, device=device),
        prefill_len=prefill_len.to(device=device, dtype=i32),
    )


# --------------------------------------------------------------------------------------------
# comparison
# --------------------------------------------------------------------------------------------


def _tie_set(row: torch.Tensor, limit: int = 8) -> str:
    x = row.float()
    nan = torch.isnan(x)
    winners = nan if bool(nan.any()) else x == x.max()
    ids = winners.nonzero().flatten()
    shown = ids[:limit].tolist()
    more = f" (+{ids.numel() - limit} more)" if ids.numel() > limit else ""
    return f"{shown}{more}"


def _value(row: torch.Tensor, i: int) -> str:
    if 0 <= i < row.numel():
        return repr(float(row[i]))
    return "<out of range>"


def assert_same_ids(
    actual: torch.Tensor,
    expected: torch.Tensor,
    logits: torch.Tensor | None = None,
    *,
    max_report: int = 5,
) -> None:
    """Assert two integer id tensors are exactly equal (``==``, shape and values).

    On mismatch raises ``AssertionError`` listing the first ``max_report`` mismatching positions
    with both ids; if ``logits [B, V]`` is given and the ids are 1-D ``[B]``, also both values and
    the tie set of the row (the ids of the winning value class: all NaN ids if the row has NaN,
    else the ids equal to the maximum). Integer dtypes may differ (int32 vs int64).
    """
    if actual.dtype.is_floating_point or expected.dtype.is_floating_point:
        raise AssertionError(f"ids must be integer tensors, got {actual.dtype}, {expected.dtype}")
    if actual.shape != expected.shape:
        raise AssertionError(
            f"shape mismatch: actual {tuple(actual.shape)}, expected {tuple(expected.shape)}"
        )
    a = actual.detach().cpu().to(torch.int64)
    e = expected.detach().cpu().to(torch.int64)
    bad = (a != e).nonzero()
    if bad.numel() == 0:
        return
    lines = [f"{bad.shape[0]} of {a.numel()} ids differ:"]
    with_values = logits is not None and a.dim() == 1 and logits.dim() == 2
    lg = logits.detach().cpu() if logits is not None else None
    for idx in bad[:max_report].tolist():
        pos = tuple(idx)
        ai, ei = int(a[pos]), int(e[pos])
        where = f"row {pos[0]}" if len(pos) == 1 else f"at {pos}"
        line = f"  {where}: actual {ai}, expected {ei}"
        if with_values and lg is not None:
            row = lg[pos[0]]
            line += (
                f"; values actual {_value(row, ai)}, expected {_value(row, ei)}; "
                f"tie set {_tie_set(row)}"
            )
        lines.append(line)
    raise AssertionError("\n".join(lines))
