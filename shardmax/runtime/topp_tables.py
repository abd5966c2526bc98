"""vLLM's top-p lookup table, found at run time (never copied into shardmax).

vLLM's monolithic top-p kernel starts its search from an outlier pivot ``mean + std * sigma(p)``
of the row's first tile, ``sigma`` read from its ``_NORMAL_CDF_TO_SIGMA_TABLE`` (200 fp32 entries,
``v1/sample/ops/topk_topp_triton.py``; identical in 0.32 and 0.33). The replay of that search
(:mod:`shardmax.reference.nucleus_replay`) needs the same entry, so it takes the table of the
vLLM it reproduces:

1. a table set with :func:`set_sigma_table` (e.g. the one of an extracted tree:
   ``load_chain(tree).topk_topp._NORMAL_CDF_TO_SIGMA_TABLE``);
2. else the installed vLLM's (imported on first use);
3. else none: :func:`sigma_table` returns None and the monolithic replay refuses
   (:func:`shardmax.reference.nucleus_replay.replay` raises, naming :func:`set_sigma_table`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

__all__ = ["SIGMA_ENTRIES", "set_sigma_table", "sigma_table"]

SIGMA_ENTRIES = 200

_lock = threading.Lock()
_table: list[float] | None = None
_looked_up = False


def set_sigma_table(values: Sequence[float] | None) -> None:
    """Use ``values`` (vLLM's 200 entries) from now on; ``None`` forgets any table (the next
    :func:`sigma_table` looks for an installed vLLM again).

    Raises:
        ValueError: not 200 finite numbers.
    """
    global _table, _looked_up
    with _lock:
        if values is None:
            _table, _looked_up = None, False
        else:
            vals = [float(v) for v in values]
            if len(vals) != SIGMA_ENTRIES or not all(abs(v) < 1e3 for v in vals):
                raise ValueError(
                    f"values: expected {SIGMA_ENTRIES} finite numbers (vLLM's "
                    f"_NORMAL_CDF_TO_SIGMA_TABLE), got {len(vals)}"
                )
            _table, _looked_up = vals, True


def sigma_table() -> list[float] | None:
    """The table in use (module docstring), or None when no vLLM provides one."""
    global _table, _looked_up
    with _lock:
        if not _looked_up:
            _looked_up = True
            try:
                from vllm.v1.sample.ops import topk_topp_triton as mod

                _table = [float(v) for v in mod._NORMAL_CDF_TO_SIGMA_TABLE]
            except Exception:
                _table = None
        return _table
