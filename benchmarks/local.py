"""Part 1: the local stage on one GPU, side by side with the baselines.

For every (dtype, V, TP, rows) the shard is one rank's padded vLLM shard ``[rows, W]``
(``W = ceil(V/64)*64/TP``; the last rank, the one that holds vocab padding if there is any),
random normal logits (never zeros), zero padding columns as vLLM's weight loader leaves them.
Methods (``method`` column of ``local.csv``):

``shardmax_keys``        the dispatched ``shard_keys`` variant alone (``select(...)``'s launch),
                         L2-cold (``cache=cold``, input copies round-robin) and L2-warm
                         (``cache=warm``, one input)
``shardmax_local``       ``shard_keys`` + its finish (``argmax_pick_*``) on the gathered layout
                         (a static ``[tp*rows, S]`` buffer of keys stands in for the all_gather;
                         ``[rows, S]`` for all_reduce); no collective
``torch_argmax_full``    ``torch.argmax`` on the full ``[rows, V]`` logits (TP-independent:
                         stored once per (dtype, V, rows) with ``tp=1``)
``vllm_unfused``         vLLM ``LogitsProcessor.get_top_tokens`` local part, spec §3.3 steps 4-8:
                         padding mask ``-inf`` in place (only when there is padding; idempotent,
                         so replays stay valid), ``logits.max(dim=-1)`` in the model dtype,
                         ``+ vocab_start``, ``stack([vals.float(), gid.float()])`` when TP > 1
``vllm_unfused_float``   the same with ``.float()`` before the max (how anchors.md measured it)

``floor_us`` = bytes read once / copy bandwidth (D2D copy measured in this run, read + write
counted); ``empty_us`` = one empty Triton launch under graph replay, same run.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import timing
from .outcome import PartOutcome, analyze
from .report import LOCAL_FIELDS, CsvAppender

LOG = functools.partial(print, flush=True)
PAD_TO = 64
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def padded_vocab(vocab: int, pad_to: int = PAD_TO) -> int:
    return -(-vocab // pad_to) * pad_to


def shard_width(vocab: int, tp: int) -> int:
    """vLLM's per-rank width ``ceil(V/64)*64 / tp`` (ValueError if it does not divide)."""
    padded = padded_vocab(vocab)
    if padded % tp:
        raise ValueError(f"padded vocab {padded} is not divisible by tp={tp}")
    return padded // tp


def hbm_floor_us(nbytes: int, copy_bw_gbps: float) -> float:
    """Microseconds to read ``nbytes`` once at the measured copy bandwidth (GB/s)."""
    if not copy_bw_gbps or math.isnan(copy_bw_gbps) or copy_bw_gbps <= 0:
        return float("nan")
    return nbytes / (copy_bw_gbps * 1e3)


@dataclass(frozen=True)
class LocalPlan:
    dtypes: tuple[str, ...]
    vocabs: tuple[int, ...]
    tps: tuple[int, ...]
    rows: tuple[int, ...]


def vllm_unfused_local(x: Any, num_pad: int, vocab_start: int, tp: int, upcast: bool) -> Any:
    """Spec §3.3 steps 4-8 on the padded local shard (no collective)."""
    import torch

    if num_pad > 0:
        x[..., -num_pad:] = float("-inf")
    y = x.float() if upcast else x
    vals, idx = y.max(dim=-1)
    gid = idx + vocab_start
    if tp == 1:
        return gid
    return torch.stack([vals.float(), gid.float()], dim=-1)


def dispatched_selection(op: str, dtype: str, tp: int, rows: int, width: int, align: int) -> Any:
    """``select(...)``'s answer; the built-in default if the table says ``plain`` (noted)."""
    from shardmax.runtime.dispatch import PLAIN, Problem, Selection, builtin_default, select

    problem = Problem(op=op, dtype=dtype, tp=tp, rows=rows, width=width, align=align)
    sel = select(problem)
    if sel.variant == PLAIN:
        d = builtin_default(problem)
        return Selection(d.variant, d.launch, False, f"{sel.source} says plain; timed builtin")
    return sel


def _row(**kw: Any) -> dict[str, Any]:
    base = dict.fromkeys(LOCAL_FIELDS, "")
    base.update(kw)
    return base


def run_local(
    plan: LocalPlan,
    out_dir: Path,
    deadline: float,
    log: Callable[[str], None] = LOG,
    device: str | None = None,
    show_progress: bool = True,
) -> PartOutcome:
    """Measure every configuration of ``plan``; write the rows to ``out_dir/local.csv``.

    Returns the part's :class:`PartOutcome` (cases measured / failed, shapes the ``deadline``
    (``time.monotonic()``) cut). A failing shape or TP size writes its row with the error and
    the run goes on.
    """
    from . import ensure_shardmax_layout

    ensure_shardmax_layout()
    import torch
    from shardmax.generator.console import progress

    dev = torch.device(device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    out = out_dir / "local.csv"
    writer = CsvAppender(out, LOCAL_FIELDS)

    copy_bw = float("nan")
    empty_us = float("nan")
    try:
        copy_bw = timing.copy_bandwidth_gbps(dev)
        log(f"[local] copy bandwidth (D2D, read+write): {copy_bw:.0f} GB/s")
    except Exception as e:
        log(f"[local] copy bandwidth probe FAILED: {type(e).__name__}: {e}")
        writer.write(_row(method="copy_bandwidth", error=f"{type(e).__name__}: {e}"[:300]))
    try:
        st = timing.empty_launch_us(dev)
        empty_us = st.p50
        writer.write(
            _row(method="empty_launch", p20_us=st.p20, p50_us=st.p50, p80_us=st.p80,
                 launches=st.launches, copies=1, cache="warm", copy_bw_GBps=copy_bw,
                 empty_us=empty_us, correct=True, metric=st.metric)
        )  # fmt: skip
        log(f"[local] empty Triton launch under graph replay: {empty_us:.2f} us")
    except Exception as e:
        log(f"[local] empty-launch probe FAILED: {type(e).__name__}: {e}")
        writer.write(_row(method="empty_launch", error=f"{type(e).__name__}: {e}"[:300]))

    common = {"copy_bw_GBps": copy_bw, "empty_us": empty_us}
    shapes = [(d, v, r) for d in plan.dtypes for v in plan.vocabs for r in plan.rows]
    skipped: list[str] = []
    with progress(len(shapes), "[local] shapes", enabled=show_progress, every=1) as bar:
        for dtype, vocab, rows in shapes:
            tag = f"{dtype} V={vocab} rows={rows}"
            bar.set_postfix_str(tag)
            if time.monotonic() > deadline:
                log(f"[local] time budget spent: skipping {tag}")
                skipped.append(tag)
                bar.update(1)
                continue
            try:
                _one_shape(dev, dtype, vocab, rows, plan.tps, writer, common, log)
            except Exception as e:  # one shape failing never stops the run
                msg = f"{type(e).__name__}: {e}"
                log(f"[local] {tag} FAILED: {msg}")
                writer.write(_row(method="shape", dtype=dtype, vocab=vocab, rows=rows,
                                  error=msg[:300]))  # fmt: skip
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            bar.update(1)
    return analyze("local", out, skipped=skipped)


def _timed(
    writer: CsvAppender,
    log: Callable[[str], None],
    what: str,
    fn: Callable[[], timing.Stat],
    **row: Any,
) -> timing.Stat | None:
    """Run one measurement; write its row (with the error if it failed); never raises."""
    try:
        st = fn()
    except Exception as e:
        msg = f"{type(e).__name__}: {e}"
        log(f"[local] {what} FAILED: {msg}")
        writer.write(_row(error=msg[:300], **row))
        return None
    writer.write(
        _row(p20_us=st.p20, p50_us=st.p50, p80_us=st.p80, launches=st.launches,
             copies=st.copies, metric=st.metric, **row)
    )  # fmt: skip
    return st


def _randn(rows: int, width: int, dtype: Any, dev: Any, seed: int) -> Any:
    import torch

    gen = torch.Generator(device=dev).manual_seed(seed)
    return torch.randn(rows, width, generator=gen, device=dev, dtype=torch.float32).to(dtype)


def _one_shape(
    dev: Any,
    dtype_name: str,
    vocab: int,
    rows: int,
    tps: tuple[int, ...],
    writer: CsvAppender,
    common: dict[str, Any],
    log: Callable[[str], None],
) -> None:
    import torch

    from shardmax.runtime.validation import SUPPORTED_DTYPES
    from shardmax.testing.shards import vllm_shard_ranges

    torch_dtype = {v: k for k, v in SUPPORTED_DTYPES.items()}[dtype_name]
    base = {"dtype": dtype_name, "vocab": vocab, "rows": rows, **common}
    _argmax_full(dev, torch_dtype, DTYPE_BYTES[dtype_name], vocab, rows, writer, base, log)
    for tp in tps:
        try:
            ranges = vllm_shard_ranges(vocab, tp, PAD_TO)
        except ValueError as e:
            log(f"[local] V={vocab} tp={tp}: {e}")
            continue
        real = [r for r in ranges if r[1] > 0]
        vocab_start, num_valid, width = real[-1]  # the last rank: it holds any padding
        try:
            _one_tp(
                dev, dtype_name, torch_dtype, tp, vocab_start, num_valid, width, writer, base, log
            )
        except Exception as e:  # the next TP size still runs
            msg = f"{type(e).__name__}: {e}"
            log(f"[local] {dtype_name} V={vocab} tp={tp} rows={rows} FAILED: {msg}")
            writer.write(_row(method="shape", tp=tp, error=msg[:300], **base))
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def _argmax_full(
    dev: Any,
    torch_dtype: Any,
    es: int,
    vocab: int,
    rows: int,
    writer: CsvAppender,
    base: dict[str, Any],
    log: Callable[[str], None],
) -> None:
    """``torch.argmax`` on the full ``[rows, V]`` logits (TP-independent; stored with tp=1)."""
    import torch

    full_bytes = rows * vocab * es
    n_full = timing.copies_for_cold(full_bytes, dev)
    fulls = [_randn(rows, vocab, torch_dtype, dev, 1000 + c) for c in range(n_full)]
    _timed(
        writer, log, f"torch_argmax_full {base['dtype']} V={vocab} rows={rows}",
        lambda: timing.measure(lambda i: torch.argmax(fulls[i], dim=-1), n_full, dev),
        method="torch_argmax_full", tp=1, width=vocab, shard_bytes=full_bytes, cache="cold",
        floor_us=hbm_floor_us(full_bytes, base["copy_bw_GBps"]), correct=True, **base,
    )  # fmt: skip


def _one_tp(
    dev: Any,
    dtype_name: str,
    torch_dtype: Any,
    tp: int,
    vocab_start: int,
    num_valid: int,
    width: int,
    writer: CsvAppender,
    base: dict[str, Any],
    log: Callable[[str], None],
) -> None:
    """Every method on one rank's shard ``[rows, width]`` at this TP size."""
    import torch

    from shardmax.ops.argmax import argmax_pick, shard_keys
    from shardmax.runtime.dispatch import alignment_of

    rows = base["rows"]
    num_pad = width - num_valid
    nbytes = rows * width * DTYPE_BYTES[dtype_name]
    copies = timing.copies_for_cold(nbytes, dev)
    xs = []
    for c in range(copies):
        x = _randn(rows, width, torch_dtype, dev, 2000 + 97 * tp + c)
        if num_pad:
            x[:, num_valid:] = 0  # vLLM zero-fills the padding rows of the LM head
        xs.append(x)
    sel = dispatched_selection("argmax", dtype_name, tp, rows, width, alignment_of(xs[0]))
    warps = int(sel.launch.get("num_warps", 4))
    finish = sel.finish_variant("argmax", tp)
    row = {
        **base,
        "tp": tp,
        "width": width,
        "shard_bytes": nbytes,
        "floor_us": hbm_floor_us(nbytes, base["copy_bw_GBps"]),
    }
    srow = {
        **row,
        "variant": sel.variant,
        "splits": sel.splits,
        "num_warps": warps,
        "transport": sel.transport,
        "finish": finish,
        "source": sel.source,
    }

    def keys_of(x: Any) -> Any:
        return shard_keys(x, vocab_start, num_valid, sel)

    # correctness first: never time a wrong kernel without saying so (correct=0 in the row)
    want = torch.argmax(xs[0][:, :num_valid], dim=-1) + vocab_start
    keys0 = keys_of(xs[0])
    # the gathered layout: all_gather gives [tp*rows, S] (here tp copies of this rank's keys),
    # all_reduce gives [rows, S]
    gathered = keys0.repeat(tp, 1) if (tp > 1 and sel.transport == "allgather") else None
    ids = argmax_pick(gathered if gathered is not None else keys0, rows, tp, finish)
    ok = bool(torch.equal(ids, want))
    if not ok:
        log(f"[local] MISMATCH shardmax {dtype_name} V={base['vocab']} tp={tp} rows={rows}")

    def local_step(i: int) -> Any:
        k = keys_of(xs[i])
        return argmax_pick(gathered if gathered is not None else k, rows, tp, finish)

    def vllm_step(i: int, upcast: bool) -> Any:
        return vllm_unfused_local(xs[i], num_pad, vocab_start, tp, upcast)

    tag = f"{dtype_name} V={base['vocab']} tp={tp} rows={rows}"
    _timed(
        writer, log, f"shardmax_keys cold {tag}",
        lambda: timing.measure(lambda i: keys_of(xs[i]), copies, dev),
        method="shardmax_keys", cache="cold", correct=ok, **srow,
    )  # fmt: skip
    _timed(
        writer, log, f"shardmax_keys warm {tag}",
        lambda: timing.measure(lambda i: keys_of(xs[0]), 1, dev, cold=False),
        method="shardmax_keys", cache="warm", correct=ok, **srow,
    )  # fmt: skip
    _timed(
        writer, log, f"shardmax_local {tag}",
        lambda: timing.measure(local_step, copies, dev),
        method="shardmax_local", cache="cold", correct=ok, **srow,
    )  # fmt: skip
    for method, upcast in (("vllm_unfused", False), ("vllm_unfused_float", True)):
        got = vllm_unfused_local(xs[0], num_pad, vocab_start, tp, upcast)
        got_ids = got if tp == 1 else got[:, 1].long()
        # informative only: bf16 ties may resolve differently in torch's max(dim)
        vok = bool(torch.equal(got_ids, want))
        _timed(
            writer, log, f"{method} {tag}",
            lambda u=upcast: timing.measure(lambda i: vllm_step(i, u), copies, dev),
            method=method, cache="cold", correct=vok, **row,
        )  # fmt: skip
    log(f"[local] {tag} done ({sel.variant} S={sel.splits} {sel.transport})")
