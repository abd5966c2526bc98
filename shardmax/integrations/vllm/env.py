"""The plug-in's environment variables, read on every step at the host cost of a dict lookup.

vLLM calls verification eagerly, so the plug-in's host time counts on every step, and the
routing variables (``$SHARDMAX_VLLM_TOPP``, ``$SHARDMAX_VLLM_GRAPHS``, ...) are read several
times per step. ``os.environ.get`` of an unset variable takes about 1.2 us of host time (it
encodes the key and raises a KeyError inside ``Mapping.get``); :func:`read` looks the encoded key
up in ``os.environ``'s own mapping (CPython's ``os._Environ``: one dict lookup, ~40 ns) and
normalises each distinct value once. Every change made through ``os.environ`` (``export`` before
the start, ``os.environ[...] = ...``, ``monkeypatch.setenv``) is seen at the next read, as with
``os.environ.get``, and so is an ``os.environ`` replaced by another mapping (read through it);
neither sees ``os.putenv`` behind ``os.environ``'s back.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["read"]

_ENVIRON: Any = os.environ
_DATA: dict[Any, Any] | None = getattr(_ENVIRON, "_data", None)
"""``os.environ``'s own mapping (encoded key -> encoded value), where the interpreter has one."""
_KEYS: dict[str, Any] = {}
_SEEN: dict[tuple[str, str], tuple[object, str]] = {}


def read(name: str, default: str) -> str:
    """``os.environ.get(name)`` stripped and lower-cased, ``default`` when unset or empty.

    Args:
        name: the variable.
        default: what an unset or empty variable reads as (returned as given).

    Returns:
        The normalised value (a new value is normalised once; the same value, unchanged since,
        costs one dict lookup of the raw value and one of the last result).
    """
    data = _DATA
    if data is None or os.environ is not _ENVIRON:  # no os._Environ mapping, or os.environ
        # replaced (``mock.patch("os.environ", {...})``): the public way
        raw_value = os.environ.get(name)
        return default if raw_value is None else (raw_value.strip().lower() or default)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = _ENVIRON.encodekey(name)
    raw = data.get(key)
    seen = _SEEN.get((name, default))
    if seen is not None and seen[0] is raw:  # the same value object: unchanged since
        return seen[1]
    value = default
    if raw is not None:
        value = _ENVIRON.decodevalue(raw).strip().lower() or default
    _SEEN[(name, default)] = (raw, value)  # (holding ``raw`` keeps its identity unique)
    return value
