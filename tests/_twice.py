"""The GPU determinism rule: every sampled call of a GPU test runs twice, bit-compared.

A write-write race inside a program (found once in strict mode's replay: a block's -inf fill
and the scatter of its kept values) is invisible to the interpreter, which runs lanes in order;
on the GPU it shows as two calls on the same inputs giving different bits. :func:`twice` runs
the call a second time when its outputs live on a GPU and asserts every output tensor is
bit-identical (floats compared as their bits, so NaN == NaN and -0.0 != +0.0).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return t.contiguous().view(
            {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        )
    return t


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


def twice(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``; on a GPU called again and every output tensor compared bit for
    bit with the first call's (AssertionError naming the output)."""
    first = fn(*args, **kwargs)
    a = _tensors(first)
    if not a or a[0].device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return first  # a CPU call (the interpreter is sequential), or inside a graph capture
    a = [t.clone() for t in a]
    b = _tensors(fn(*args, **kwargs))
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(_bits(x), _bits(y)), f"output {i} differs between two identical calls"
    return first
