"""Canonical kernel-variant names: one function builds them, one parses them.

A variant name is at the same time the generated module name (``shardmax.generated.<name>``),
the value stored in tuned tables, the pytest id and the Optuna user attribute. Fields come in a
fixed order and are present only when the family has that axis::

    <family>[_<dtype>][_va<align>][_b<block>][_tp<tp>][_<transport>]

    shard_keys_bf16_va16_b4096      local stage: padded local logits -> packed keys
    argmax_pick_tp4_allgather       draft finish after all_gather(dim=0) of 4 ranks' keys
    argmax_pick_allreduce           draft finish after all_reduce(MAX) of the keys
    verify_finish_tpn_allgather     target finish, any TP size (runtime loop over ranks)
    sampled_record_bf16_b2048       sampled verification, local stage: shard -> fixed-size records
    sampled_finish_tp4_allgather    sampled verification finish after all_gather(dim=0) of records
    sampled_draw_bf16_b2048         two-phase sampled step, phase 2: the drawn row's Gumbel keys
    sampled_pick                    two-phase sampled step: each request's drawn token
    sampled_merge                   candidate steps: merge of the ranks' candidates + nucleus
    row_params                      sampled verification: each logits row's slot, T, seed, draft
    block_stats_fp32_va1            strict mode: vLLM's 8192-block (max, sumexp), vLLM's layout
    strict_rebuild_bf16_va16        strict mode: the blocks cut by shard edges, from raw pieces
    strict_replay_va1               strict mode: the blocks of top-k/top-p/min-p kept sets
    strict_lse                      strict mode: vLLM's cross-block LSE combine
    topp_hist_bf16_b2048            top-p replay, local stage: shard -> level-histogram record
    topp_combine_bf16               top-p replay, local stage: a row's split records -> its record
    topp_replay_bf16                top-p replay: the ranks' records -> each row's kept set
    table_copy                      a replayed step's byte copies between table-held addresses
    table_fetch                     a replayed step's argument table, host buffer -> device
    resolve_fill_bf16               a resolution's padded sub-batch (synthetic rows, indices)
    resolve_apply                   a resolution's answers written into the step's outputs
    resolve_select                  a folded fallback's flagged requests picked on the device

``tp`` is ``2``, ``4`` or ``8`` (the loop over ranks is unrolled) or ``n`` (any TP size,
non-powers of two included). Names are valid Python module names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DTYPES = ("bf16", "fp16", "fp32")
FAMILIES = (
    "shard_keys",
    "argmax_pick",
    "verify_finish",
    "sampled_record",
    "sampled_finish",
    "sampled_draw",
    "sampled_pick",
    "sampled_merge",
    "row_params",
    "block_stats",
    "strict_rebuild",
    "strict_replay",
    "strict_lse",
    "table_copy",
    "table_fetch",
    "resolve_fill",
    "resolve_apply",
    "resolve_select",
    "topp_hist",
    "topp_combine",
    "topp_replay",
)
TOPP_DTYPES = ("bf16", "fp16")
"""Dtypes with 16-bit level keys (the top-p replay's histograms)."""
TRANSPORTS = ("allgather", "allreduce")
UNROLLED_TP = (2, 4, 8)

_NAME_RE = re.compile(
    r"^(?P<family>shard_keys|argmax_pick|verify_finish|sampled_record|sampled_finish"
    r"|sampled_draw|sampled_pick|sampled_merge|row_params|block_stats|strict_rebuild|strict_replay|strict_lse|table_copy"
    r"|table_fetch"
    r"|resolve_fill|resolve_apply|resolve_select"
    r"|topp_hist|topp_combine|topp_replay)"
    r"(?:_(?P<dtype>bf16|fp16|fp32))?"
    r"(?:_va(?P<align>\d+))?"
    r"(?:_b(?P<block>\d+))?"
    r"(?:_tp(?P<tp>\d+|n))?"
    r"(?:_(?P<transport>allgather|allreduce))?$"
)


@dataclass(frozen=True, order=True)
class VariantKey:
    """The structural axes of one generated kernel variant."""

    family: str
    dtype: str | None = None
    align: int | None = None
    block: int | None = None
    tp: str | None = None  # "2" | "4" | "8" | "n"
    transport: str | None = None

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family: unknown {self.family!r}, expected one of {FAMILIES}")
        if self.family == "shard_keys":
            if self.dtype not in DTYPES or self.align is None or self.block is None:
                raise ValueError(f"shard_keys needs dtype, align and block: {self}")
            if self.tp is not None or self.transport is not None:
                raise ValueError(f"shard_keys has no tp/transport axis: {self}")
        elif self.family in ("sampled_record", "sampled_draw"):
            if self.dtype not in DTYPES or self.block is None or self.align is not None:
                raise ValueError(f"{self.family} needs dtype and block (no align): {self}")
            if self.tp is not None or self.transport is not None:
                raise ValueError(f"{self.family} has no tp/transport axis: {self}")
        elif self.family in (
            "sampled_pick",
            "sampled_merge",
            "row_params",
            "strict_lse",
            "table_copy",
            "table_fetch",
            "resolve_apply",
            "resolve_select",
        ):
            if (self.dtype, self.align, self.block, self.tp, self.transport) != (None,) * 5:
                raise ValueError(f"{self.family} has no axis: {self}")
        elif self.family in ("block_stats", "strict_rebuild"):
            if self.dtype not in DTYPES or self.align not in (1, 16):
                raise ValueError(f"{self.family} needs dtype and align 1 or 16: {self}")
            if (self.block, self.tp, self.transport) != (None,) * 3:
                raise ValueError(f"{self.family} has no block/tp/transport axis: {self}")
        elif self.family == "resolve_fill":
            if (
                self.dtype not in DTYPES
                or (self.align, self.block, self.tp, self.transport) != (None,) * 4
            ):
                raise ValueError(f"resolve_fill has only the dtype axis: {self}")
        elif self.family == "strict_replay":
            if (
                self.align not in (1, 16)
                or (self.dtype, self.block, self.tp, self.transport) != (None,) * 4
            ):
                raise ValueError(f"strict_replay has only the align axis (1 or 16): {self}")
        elif self.family in ("topp_hist", "topp_combine", "topp_replay"):
            if (
                self.dtype not in TOPP_DTYPES
                or (self.align, self.tp, self.transport) != (None,) * 3
            ):
                raise ValueError(f"{self.family} needs dtype bf16 or fp16 (no align/tp): {self}")
            if (self.block is None) != (self.family != "topp_hist"):
                raise ValueError(f"topp_hist needs a block, {self.family} has none: {self}")
        elif self.family == "sampled_finish":
            if self.dtype is not None or self.align is not None or self.block is not None:
                raise ValueError(f"sampled_finish has no dtype/align/block axis: {self}")
            if self.transport != "allgather" or self.tp not in ("2", "4", "8", "n"):
                raise ValueError(f"sampled_finish needs tp in 2/4/8/n and allgather: {self}")
        else:
            if self.dtype is not None or self.align is not None or self.block is not None:
                raise ValueError(f"{self.family} has no dtype/align/block axis: {self}")
            if self.transport not in TRANSPORTS:
                raise ValueError(f"{self.family} needs transport in {TRANSPORTS}: {self}")
            if self.transport == "allgather" and self.tp not in ("2", "4", "8", "n"):
                raise ValueError(f"{self.family} allgather needs tp in 2/4/8/n: {self}")
            if self.transport == "allreduce" and self.tp is not None:
                raise ValueError(f"{self.family} allreduce is TP-independent: {self}")

    @property
    def name(self) -> str:
        return build_name(self)

    @property
    def unrolled_tp(self) -> int | None:
        """The TP size the rank loop is unrolled for, or None (generic / all-reduce)."""
        return int(self.tp) if self.tp not in (None, "n") else None


def build_name(key: VariantKey) -> str:
    """The canonical name of a variant (see the module docstring)."""
    parts = [key.family]
    if key.dtype is not None:
        parts.append(key.dtype)
    if key.align is not None:
        parts.append(f"va{key.align}")
    if key.block is not None:
        parts.append(f"b{key.block}")
    if key.tp is not None:
        parts.append(f"tp{key.tp}")
    if key.transport is not None:
        parts.append(key.transport)
    return "_".join(parts)


def parse_name(name: str) -> VariantKey:
    """Inverse of :func:`build_name`; raises ValueError for a malformed name."""
    m = _NAME_RE.match(name)
    if m is None:
        raise ValueError(f"variant name: {name!r} is not a shardmax variant name")
    g = m.groupdict()
    key = VariantKey(
        family=g["family"],
        dtype=g["dtype"],
        align=int(g["align"]) if g["align"] else None,
        block=int(g["block"]) if g["block"] else None,
        tp=g["tp"],
        transport=g["transport"],
    )
    if key.name != name:
        raise ValueError(f"variant name: {name!r} is not canonical (expected {key.name!r})")
    return key


def finish_variant(op: str, tp_size: int, transport: str) -> str:
    """Name of the finish kernel for ``op`` ("argmax" | "verify" | "sampled") at this TP
    size/transport (``sampled`` exists for ``allgather`` only)."""
    family = {"argmax": "argmax_pick", "verify": "verify_finish", "sampled": "sampled_finish"}[op]
    if op == "sampled" and transport != "allgather":
        raise ValueError(f"sampled verification moves records with allgather, got {transport!r}")
    if transport == "allreduce":
        return build_name(VariantKey(family, transport="allreduce"))
    tp = str(tp_size) if tp_size in UNROLLED_TP else "n"
    return build_name(VariantKey(family, tp=tp, transport="allgather"))
