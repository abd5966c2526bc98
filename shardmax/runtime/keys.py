"""Packed 64-bit keys: the total order of design §2 as one signed int64.

A key packs one logit and its global token id so that a plain signed integer ``max`` is the
order "larger value first; equal values (-0.0 == +0.0) -> lower id first; NaN beats every
number, lower id among NaNs" (``torch.argmax``'s rule):

    key = (order(fp32 value) << 32) | (0xFFFFFFFF - id)

``order`` maps the fp32 bit pattern ``b`` (read as int32) to ``b`` for non-negative floats and
to ``b ^ 0x7FFFFFFF`` for negative ones, which is monotone in the float value; -0.0 is
canonicalised to +0.0 first and every NaN maps to ``0x7FFFFFFF`` (above +inf). The low word is
the id inverted, so among equal high words the lowest id has the largest key. Ids up to
2**31 - 1 fit; ids never travel as floats.

``EMPTY_KEY`` (int64 min) is below every real key, including (-inf, id): padding columns and
empty vocab shards contribute it and can never win.

These torch functions are the host-side twin of the Triton code in ``templates/`` and are used
by the emulator, the tests and the reference checks; the kernels never call them.
"""

from __future__ import annotations

import torch

EMPTY_KEY = -(2**63)
"""Key of "no element": smaller than the key of any real logit, -inf included."""

NAN_ORDER = 0x7FFFFFFF
"""High word of every NaN: above +inf (0x7F800000)."""

LOW_MASK = 0xFFFFFFFF
MAX_VOCAB = 2**31 - 1
"""Largest vocabulary (number of ids) a key can carry; ids are < MAX_VOCAB."""


def pack_keys(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Pack logits and their global ids into order-preserving int64 keys.

    Args:
        values: any float tensor (bf16/fp16/fp32; upcast to fp32 exactly).
        ids: int tensor of the same shape, global token ids in ``[0, 2**31 - 1)``.

    Returns:
        int64 tensor of the same shape; ``keys.max()`` selects the (value desc, id asc,
        NaN first) winner.
    """
    v = values.to(torch.float32)
    v = torch.where(v == 0, torch.zeros_like(v), v)  # -0.0 -> +0.0
    bits = v.view(torch.int32).to(torch.int64)
    order = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    order = torch.where(torch.isnan(v), torch.full_like(order, NAN_ORDER), order)
    low = LOW_MASK - ids.to(torch.int64)
    return (order << 32) | low


def unpack_ids(keys: torch.Tensor) -> torch.Tensor:
    """Global token ids (int64) of packed keys. ``EMPTY_KEY`` decodes to ``2**32 - 1``."""
    return LOW_MASK - (keys & LOW_MASK)


def unpack_values(keys: torch.Tensor) -> torch.Tensor:
    """fp32 values of packed keys (-0.0 comes back as +0.0, every NaN as one quiet NaN)."""
    order = keys >> 32
    bits = torch.where(order < 0, order ^ 0x7FFFFFFF, order).to(torch.int32)
    vals = bits.view(torch.float32).clone()
    vals[order == NAN_ORDER] = float("nan")
    return vals
