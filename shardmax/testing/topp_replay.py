"""One decode step's top-p rows through the level-histogram replay, request by request.

The oracle-side harness of :mod:`shardmax.reference.nucleus_replay`: cut every top-p row of a
step into vLLM's vocab shards, build each rank's :class:`~shardmax.reference.nucleus_shards.
ShardHistogram`, merge, replay vLLM's top-p search for the pipeline the step runs, then decide
per request whether the certified kept sets settle its outcome:

* every row the request's outcome reads (its verified rows up to the first rejection and the row
  that draws) is certified (``ReplayReason.OK``), and
* where a kept set leaves the boundary ties as a range, the outcome is the same with the fewest
  and the most ties kept (at most one such row per request; with more, the request is counted
  as ``TIES``: mixed choices are not enumerated); where vLLM keeps an unknown subset of them
  (its split pipelines), moreover no boundary tie is the row's draft or its token -- the LSE
  then moves monotonically between the two extremes and the Gumbel winner is never a tie.

The outcome of a certified request is vLLM's rejection sampling on the logits with the kept sets
applied (:func:`shardmax.reference.verify_sampled` on masked logits, temperature only): the
tests check it against vLLM's own chain; the benchmarks count coverage and bytes with it. The
sharded kernels decide the same from the merged histograms (the acceptance LSE of a kept set is a
sum over its levels); their own LSE rounding margin (fast mode's interval test) is not modelled
here.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from shardmax.reference.nucleus_replay import (
    HIST_LEVELS,
    KeptSet,
    PipelineConfig,
    ReplayReason,
    kept_masks,
    level_histogram,
    level_keys,
    replay,
)
from shardmax.reference.nucleus_shards import (
    ShardHistogram,
    merge_shard_histograms,
    record_bytes,
    shard_histogram,
)
from shardmax.reference.sampled import verify_sampled
from shardmax.testing.shards import vllm_shard_ranges

__all__ = [
    "KERNEL_NONFINITE",
    "ReplayedStep",
    "RowReplay",
    "kept_set_reference",
    "kept_set_violation",
    "kernel_row",
    "replay_rows",
    "replay_step",
    "replayed_row",
    "row_params",
]

NON_FINITE = "NON_FINITE"
TIES = "TIES"


@dataclass
class RowReplay:
    """The replay of a step's rows (:func:`replay_rows`): per logits row its :class:`KeptSet`
    (``None``: no top-p there, or a non-finite row), the merged histogram's top key, and
    ``"OK"`` / a :class:`ReplayReason` name / ``"NON_FINITE"``; ``hist_rows``: rows whose
    histograms were exchanged; ``branches``: rows per number of branch points met."""

    kept: list[KeptSet | None]
    top_keys: list[int]
    reason: list[str]
    hist_rows: int
    branches: Counter[int] = field(default_factory=Counter)


@dataclass
class ReplayedStep:
    """:func:`replay_step`'s answer: ``rows`` (:class:`RowReplay`); ``request_ok`` bool
    ``[num_reqs]``; ``request_reason``: ``"OK"`` or the reason of the first row that stops the
    request (``"TIES"``: the boundary-tie range changes the outcome); ``outputs``: ``(sampled,
    num_sampled, num_rejected)`` (CPU) with the fewest ties kept -- vLLM's outcome on every
    certified request; ``hist_bytes``: bytes one rank sends for the step's histograms."""

    rows: RowReplay
    request_ok: torch.Tensor
    request_reason: list[str]
    outputs: tuple[torch.Tensor, ...]
    hist_bytes: int


def kept_set_violation(
    raw_row: torch.Tensor, vllm_kept: torch.Tensor, kept: KeptSet, top_key: int
) -> str | None:
    """How vLLM's mask of one row breaks a certified :class:`KeptSet`, or None when it obeys it:
    every finite token kept for ``nomask``; else every token above the boundary level kept,
    none below it, between ``ties_lo`` and ``ties_hi`` of the boundary level kept, and those the
    first in id order when ``ties_ordered``. ``raw_row`` bf16 / fp16 ``[V]``, ``vllm_kept`` bool
    ``[V]`` (vLLM's output ``!= -inf``), ``top_key`` the merged histogram's."""
    raw_row, m = raw_row.detach().cpu(), vllm_kept.detach().cpu()
    if kept.nomask:  # -inf tokens stay -inf either way
        fin = torch.isfinite(raw_row.float())
        return None if bool(m[fin].all()) else "vLLM masks, the replay says no mask"
    keys = level_keys(raw_row)
    kb = top_key - kept.boundary
    above, tie = keys > kb, keys == kb
    if not bool(m[above].all()):
        return f"{int((~m[above]).sum())} tokens above the boundary dropped"
    if bool(m[~(above | tie)].any()):
        return f"{int(m[~(above | tie)].sum())} tokens below the boundary kept"
    n = int(m[tie].sum())
    if not kept.ties_lo <= n <= kept.ties_hi:
        return f"{n} boundary ties kept, not in [{kept.ties_lo}, {kept.ties_hi}]"
    rank = torch.cumsum(tie.to(torch.int64), 0)
    if kept.ties_ordered and not bool((m[tie] == (rank[tie] <= n)).all()):
        return "the kept boundary ties are not the first in id order"
    return None


def row_params(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(temperature, top_p)`` fp32 ``[num_logits]`` (CPU) of a vLLM-layout step's rows."""
    cu = batch.cu_num_logits.cpu().long()
    counts = cu[1:] - cu[:-1]
    req_of_row = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    slot = batch.idx_mapping.cpu().long()[req_of_row]
    temp = batch.temperature.cpu().float()[slot]
    top_p = batch.top_p.cpu().float()[slot] if batch.top_p is not None else torch.ones_like(temp)
    return temp, top_p


def replay_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    tp: int,
    config: PipelineConfig,
    *,
    levels: int = HIST_LEVELS,
    sigma_table: list[float] | None = None,
) -> RowReplay:
    """Shard, merge and replay every top-p row (``T > 0``, ``top_p < 1``) of ``logits``
    (bf16 / fp16 ``[rows, V]``, any device; the work is on the CPU) for ``tp`` vLLM vocab shards.

    Raises:
        ValueError: logits that are not 2-D bf16 / fp16, or parameters of another row count.
    """
    if logits.dim() != 2 or logits.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"logits: expected 2-D bf16 / fp16, got {logits.dtype} {tuple(logits.shape)}"
        )
    rows, vocab = logits.shape
    if temperature.shape != (rows,) or top_p.shape != (rows,):
        raise ValueError(f"temperature / top_p: expected [{rows}] each")
    logits = logits.detach().cpu()
    ranges = vllm_shard_ranges(vocab, tp)
    out = RowReplay([], [], [], 0)
    for i in range(rows):
        t, p = float(temperature[i]), float(top_p[i])
        if t == 0.0 or p >= 1.0:
            out.kept.append(None)
            out.top_keys.append(0)
            out.reason.append("OK")
            continue
        out.hist_rows += 1
        parts = [
            shard_histogram(logits[i, s : s + n], s, t, levels=levels, tile0=config.tile0)
            for s, n, _w in ranges
        ]
        h = merge_shard_histograms(parts, logits.dtype, t)
        if h is None:
            out.kept.append(None)
            out.top_keys.append(0)
            out.reason.append(NON_FINITE)
            continue
        k = replay(h, p, config, sigma_table)
        out.kept.append(k)
        out.top_keys.append(h.top_key)
        out.branches[k.branches] += 1
        out.reason.append(k.reason.name)
    return out


def replay_step(
    batch: Any,
    tp: int,
    config: PipelineConfig,
    *,
    levels: int = HIST_LEVELS,
    sigma_table: list[float] | None = None,
    rows: RowReplay | None = None,
) -> ReplayedStep:
    """Replay the top-p rows of one step and decide its requests (module docstring).

    Args:
        batch: a vLLM-layout step (:class:`shardmax.testing.traffic.TrafficBatch` or alike) with
            bf16 / fp16 ``logits`` ``[num_logits, V]``, temperatures and top-p per slot; top-k and
            min-p must be off. The requests are decided on the logits' device.
        tp: TP size (vLLM's vocab shards of ``V``, padded to 64).
        config: the pipeline vLLM runs for the step
            (:func:`shardmax.reference.nucleus_replay.pipeline_for`).
        rows: :func:`replay_rows` of this batch, when already computed (e.g. in worker processes).

    Raises:
        ValueError: top-k or min-p set, or logits that are not bf16 / fp16.
    """
    if getattr(batch, "top_k", None) is not None or getattr(batch, "min_p", None) is not None:
        raise ValueError("batch: top-k / min-p rows are not replayed (top-p only)")
    if rows is None:
        temp, top_p = row_params(batch)
        rows = replay_rows(batch.logits, temp, top_p, tp, config, levels=levels,
                           sigma_table=sigma_table)  # fmt: skip
    logits = batch.logits.detach().cpu()
    lo = logits.clone()
    hi = logits.clone()
    ranged = torch.zeros(logits.shape[0], dtype=torch.bool)
    loose: dict[int, torch.Tensor] = {}  # row -> its boundary ties, kept as an unknown subset
    for i, k in enumerate(rows.kept):
        if k is None or k.reason != ReplayReason.OK:
            continue
        masks = kept_masks(logits[i], k, rows.top_keys[i])
        lo[i] = logits[i].masked_fill(~masks[0], float("-inf"))
        hi[i] = logits[i].masked_fill(~masks[-1], float("-inf"))
        ranged[i] = len(masks) > 1
        if len(masks) > 1 and not k.ties_ordered:
            loose[i] = masks[-1] & ~masks[0]
    device = batch.logits.device
    args = (batch.draft_sampled, batch.cu_num_logits, batch.pos, batch.idx_mapping,
            batch.expanded_local_pos, batch.temperature, batch.seed,
            batch.num_speculative_steps)  # fmt: skip
    out_lo = tuple(t.cpu() for t in verify_sampled(lo.to(device), *args))
    out_hi = out_lo
    if bool(ranged.any()):
        out_hi = tuple(t.cpu() for t in verify_sampled(hi.to(device), *args))
    cu = batch.cu_num_logits.cpu().long()
    num_reqs = cu.numel() - 1
    ok = torch.zeros(num_reqs, dtype=torch.bool)
    req_reason: list[str] = []
    draft = batch.draft_sampled.cpu().long()
    for r in range(num_reqs):
        used = range(int(cu[r]), int(cu[r]) + int(out_lo[1][r]))
        why = next((rows.reason[i] for i in used if rows.reason[i] != "OK"), None)
        if why is None:
            same = all(bool((a[r] == b[r]).all()) for a, b in zip(out_lo, out_hi, strict=True))
            if not same or sum(bool(ranged[i]) for i in used) > 1:
                why = TIES
            for j, i in enumerate(used):
                ties = loose.get(i)
                if ties is None:
                    continue
                # with an unknown subset of ties kept, no boundary tie may be the row's token
                # or its draft: the outcome is then the same whichever ties vLLM keeps
                d = int(draft[i + 1]) if i + 1 < int(cu[r + 1]) else -1
                if bool(ties[int(out_hi[0][r, j])]) or (d >= 0 and bool(ties[d])):
                    why = TIES
        ok[r] = why is None
        req_reason.append(why or "OK")
    return ReplayedStep(rows, ok, req_reason, out_lo, rows.hist_rows * record_bytes(levels))


KERNEL_NONFINITE = 7
"""``topp_replay_*``'s reason for a row with NaN / ``+inf`` or no finite value (the reference's
merge answers ``None`` there)."""


def replayed_row(
    parts: list[ShardHistogram],
    dtype: torch.dtype,
    temperature: float,
    top_p: float,
    config: PipelineConfig,
    sigma_table: list[float] | None = None,
) -> tuple[int, ...]:
    """The plain-torch answer for one row, in the terms of ``topp_replay_*``'s output
    (:func:`kernel_row`): ``(7,)`` non-finite, ``(reason,)`` flagged, ``(0, 1)`` no mask (also
    ``top_p >= 1``), else ``(0, 0, boundary, ties_lo, ties_hi, count, ordered, branches)``.
    ``parts``: every rank's record of the row (``decode_record``)."""
    h = merge_shard_histograms(parts, dtype, temperature)
    if h is None:
        return (KERNEL_NONFINITE,)
    if top_p >= 1.0:
        return (0, 1)
    k = replay(h, top_p, config, sigma_table)
    if k.reason != ReplayReason.OK:
        return (int(k.reason),)
    if k.nomask:
        return (0, 1)
    return (0, 0, k.boundary, k.ties_lo, k.ties_hi, k.count, int(k.ties_ordered), k.branches)


def kernel_row(words: list[int]) -> tuple[int, ...]:
    """One row of ``topp_kept_sets``' kept output (int32 ``[KEPT_WORDS]`` as a list) in the
    terms of :func:`replayed_row` (a no-mask row whose boundary key is not -1 keeps it, so that
    the comparison fails)."""
    if words[0] != 0:
        return (words[0],)
    if words[1]:
        return (0, 1) if words[9] == -1 else (0, 1, words[9])
    return tuple(words[:8])


def kept_set_reference(
    batch: Any,
    config: PipelineConfig,
    sigma_table: list[float] | None = None,
    *,
    use_fp64_gumbel: bool = False,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """vLLM's answer for a top-p step, from the plain-torch replay: per row the kept set
    (:func:`replay` on the full row's :func:`level_histogram`), the processed row masked to it
    with the fewest and with the most boundary ties kept (:func:`kept_masks`), and
    :func:`verify_sampled` on each -- ``[(sampled, num_sampled, num_rejected)] * 2``, on the CPU.

    A request the sharded step does not flag must equal both (its outcome cannot depend on which
    ties vLLM keeps). Rows without top-p (``T == 0``, ``top_p >= 1``), with NaN or without a
    finite value, or whose kept set is not certified are left unmasked: a request whose outcome
    reads such a top-p row must come back flagged.

    ``batch``: a :class:`shardmax.testing.traffic.TrafficBatch`-like object (``logits`` bf16 /
    fp16 ``[num_logits, V]``, vLLM's layout tensors, per-slot ``temperature`` and ``top_p``).
    """
    x = batch.logits.detach().cpu()
    lens = torch.diff(batch.cu_num_logits.cpu().long())
    slots = torch.repeat_interleave(batch.idx_mapping.cpu().long(), lens)
    temps = batch.temperature.cpu()[slots]
    tops = batch.top_p.cpu()[slots]
    masks: list[list[torch.Tensor]] = [[], []]
    for r in range(x.shape[0]):
        t, p = float(temps[r]), float(tops[r])
        full = torch.ones(x.shape[1], dtype=torch.bool)
        got = [full, full]
        row = x[r].float()
        if t > 0 and p < 1 and bool(torch.isfinite(row).any()) and not bool(row.isnan().any()):
            h = level_histogram(x[r], t, tile0=config.tile0)
            kept = replay(h, p, config, sigma_table)
            if kept.reason == ReplayReason.OK:
                ms = kept_masks(x[r], kept, h.top_key)
                got = [ms[0], ms[-1]]
        masks[0].append(got[0])
        masks[1].append(got[1])
    proc = x.float() / torch.where(temps > 0, temps, 1.0)[:, None]
    proc = torch.where(temps[:, None] == 1.0, x.float(), proc)  # vLLM: T = 1 rows untouched
    unit = torch.where(batch.temperature.cpu() > 0, 1.0, 0.0)  # temperature already applied
    outs = []
    for m in masks:
        masked = torch.where(torch.stack(m), proc, float("-inf"))
        masked = torch.where(torch.isnan(proc), proc, masked)
        out = verify_sampled(
            masked, batch.draft_sampled.cpu(), batch.cu_num_logits.cpu(), batch.pos.cpu(),
            batch.idx_mapping.cpu(), batch.expanded_local_pos.cpu(), unit, batch.seed.cpu(),
            batch.num_speculative_steps, use_fp64_gumbel=use_fp64_gumbel,
        )  # fmt: skip
        outs.append(out)
    return outs
