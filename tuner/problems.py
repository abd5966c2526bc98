"""Problem space from real deployments: model vocabularies, TP sizes, K, row buckets.

A table row is keyed by a :class:`Bucket` ``(op, dtype, tp, align, rows_le, width_le)``; the
tuner times each bucket at its upper edge (``rows = rows_le``, ``width = width_le``), so the
row is right for every smaller problem that the dispatcher sends to it.

The local shard width of a rank is vLLM's: ``ceil(V / 64) * 64 / tp`` (``VocabParallelEmbedding``
pads the vocabulary to a multiple of 64, then splits it evenly).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

OPS = ("argmax", "verify", "sampled")
"""Tuned ops: the greedy local stage (``argmax``, ``verify``) and the sampled record kernel."""


@dataclass(frozen=True)
class Model:
    name: str
    vocab: int


MODELS: tuple[Model, ...] = (
    Model("gpt2", 50257),
    Model("llama3", 128256),
    Model("qwen2/qwen3", 151936),
    Model("qwen2.5-7b/72b", 152064),
    Model("kimi-k2", 163840),
    Model("phi4-mini", 200064),
    Model("gemma3", 262144),
)
"""Real LM-head vocabularies (checked in: the default sweep iterates them)."""

TPS = (1, 2, 4, 8)
KS = (1, 3, 5)
"""Speculative steps K seen in deployments; verify buckets are timed with :data:`VERIFY_K`."""
VERIFY_K = 3
ROW_BUCKETS = (1, 4, 16, 32, 64, 96, 128, 256, 512, 1024, 2048)
"""Tokens per step (draft: rows of the argmax; target: num_logits = sum of K+1 per request)."""

QUICK_VOCABS = (200064, 151936)
QUICK_TPS = (1, 4, 8)
QUICK_ROWS = (1, 32, 96, 512)
QUICK_SAMPLED_VOCABS = (151936,)
"""``--quick`` for op ``sampled``: one vocabulary (its points cost a gate of nine sampled requests
and a candidate step each), so the quick sweep of all three ops stays within ~10 minutes."""
QUICK_SAMPLED_TRIALS = 12
"""``--quick`` for op ``sampled``: trials per bucket (the grid has up to ~50 points)."""

TINY_MODELS = (Model("tiny-cpu", 3000),)
"""CPU / interpreter mode: a tiny vocabulary so the sweep runs end to end in seconds."""
TINY_TPS = (1, 2)
TINY_ROWS = (1, 4)

PAD_TO = 64


def shard_width(vocab: int, tp: int) -> int:
    """Local padded shard width of one rank (vLLM's layout)."""
    padded = -(-vocab // PAD_TO) * PAD_TO
    if padded % tp:
        raise ValueError(f"padded vocab {padded} is not divisible by tp={tp}")
    return padded // tp


def alignment_of_width(width: int) -> int:
    """Alignment of a contiguous ``[rows, width]`` tensor (see ``shardmax.runtime.dispatch``)."""
    return 16 if width % 16 == 0 else 1


@dataclass(frozen=True, order=True)
class Bucket:
    """One table row to tune: its match key plus the geometry it is timed at."""

    op: str
    dtype: str
    tp: int
    align: int
    width_le: int
    rows_le: int
    vocab: int = field(compare=False)
    models: tuple[str, ...] = field(default=(), compare=False)
    k: int = field(default=VERIFY_K, compare=False)

    @property
    def match(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "tp": self.tp,
            "align": self.align,
            "rows_le": self.rows_le,
            "width_le": self.width_le,
        }

    @property
    def key(self) -> tuple[Any, ...]:
        return (self.op, self.dtype, self.tp, self.align, self.rows_le, self.width_le)

    @property
    def slug(self) -> str:
        return f"{self.op}-{self.dtype}-tp{self.tp}-va{self.align}-r{self.rows_le}-w{self.width_le}"

    @property
    def rows(self) -> int:
        return self.rows_le

    @property
    def width(self) -> int:
        return self.width_le


def buckets(
    op: str,
    *,
    quick: bool = False,
    tiny: bool = False,
    dtypes: Iterable[str] = ("bf16",),
    tps: Iterable[int] | None = None,
    vocabs: Iterable[int] | None = None,
    rows: Iterable[int] | None = None,
) -> list[Bucket]:
    """The buckets of one sweep, sorted (dtype, tp, align, width, rows).

    ``quick``: V in :data:`QUICK_VOCABS` (op ``sampled``: :data:`QUICK_SAMPLED_VOCABS`), TP in
    :data:`QUICK_TPS`, rows in :data:`QUICK_ROWS`.
    ``tiny``: the CPU/interpreter set. Explicit ``tps``/``vocabs``/``rows`` override either.
    """
    if op not in OPS:
        raise ValueError(f"op: {op!r}, expected one of {OPS}")
    models: tuple[Model, ...] = MODELS
    tp_list: tuple[int, ...] = TPS
    row_list: tuple[int, ...] = ROW_BUCKETS
    if quick:
        vocabs_q = QUICK_SAMPLED_VOCABS if op == "sampled" else QUICK_VOCABS
        models = tuple(m for m in MODELS if m.vocab in vocabs_q)
        tp_list, row_list = QUICK_TPS, QUICK_ROWS
    if tiny:
        models, tp_list, row_list = TINY_MODELS, TINY_TPS, TINY_ROWS
    if vocabs is not None:
        known = {m.vocab: m for m in (*MODELS, *TINY_MODELS)}
        models = tuple(known.get(v, Model(f"v{v}", v)) for v in vocabs)
    if tps is not None:
        tp_list = tuple(tps)
    if rows is not None:
        row_list = tuple(sorted(set(rows)))
    by_key: dict[tuple[Any, ...], Bucket] = {}
    for dtype in dtypes:
        for tp in tp_list:
            for m in models:
                width = shard_width(m.vocab, tp)
                for r in row_list:
                    b = Bucket(
                        op, dtype, tp, alignment_of_width(width), width, r, m.vocab, (m.name,)
                    )
                    if b.key in by_key:  # two models with one shard width: one bucket
                        old = by_key[b.key]
                        b = Bucket(
                            op,
                            dtype,
                            tp,
                            b.align,
                            width,
                            r,
                            max(old.vocab, m.vocab),
                            (*old.models, m.name),
                        )
                    by_key[b.key] = b
    return sorted(by_key.values())


def step_cu_num_logits(rows: int, k: int) -> list[int]:
    """``cu_num_logits`` of a timed verify step: ``rows`` logits rows as requests of ``k + 1``
    rows each (the last one shorter when ``k + 1`` does not divide ``rows``)."""
    counts = [k + 1] * (rows // (k + 1)) + ([rows % (k + 1)] if rows % (k + 1) else [])
    cu = [0]
    for c in counts:
        cu.append(cu[-1] + c)
    return cu
