"""Input checks of the public ops: clear ValueError/TypeError naming the argument.

Shape, dtype and device checks are host-only and always run. Checks that must read tensor
*values* (draft ids in range, ``cu_num_logits`` consistent with the rows) need a device->host
copy; they run only when :func:`value_checks` is enabled (the default) and no CUDA graph is
being captured. Hot paths that have already validated their batch (the vLLM integration)
turn them off with ``with value_checks(False):``. Kernels never read out of bounds even with
value checks off: every index they load is masked or clamped, so a malformed batch (more than
K + 1 rows in a request, request-state slots or ``cu_num_logits`` out of range) gives
unspecified outputs, never a crash. Index tensors need not be contiguous (the launchers copy
strided views).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from shardmax.keys import MAX_VOCAB

SUPPORTED_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
INDEX_DTYPES = (torch.int32, torch.int64)

_value_checks = True


@contextlib.contextmanager
def value_checks(enabled: bool) -> Iterator[None]:
    """Enable or disable the value checks (those that synchronise) inside the block."""
    global _value_checks
    old, _value_checks = _value_checks, enabled
    try:
        yield
    finally:
        _value_checks = old


def value_checks_enabled(device: torch.device) -> bool:
    if not _value_checks:
        return False
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def check_local_logits(
    local_logits: object, vocab_start: object, num_valid: object
) -> tuple[torch.Tensor, int, int]:
    """Validate the local shard; returns (logits, vocab_start, num_valid)."""
    if not isinstance(local_logits, torch.Tensor):
        raise TypeError(f"local_logits: expected a torch.Tensor, got {type(local_logits).__name__}")
    if local_logits.dim() != 2:
        raise ValueError(
            f"local_logits: expected 2 dims [rows, W], got shape {tuple(local_logits.shape)}"
        )
    if local_logits.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"local_logits: dtype {local_logits.dtype} not supported; expected one of "
            "torch.bfloat16, torch.float16, torch.float32"
        )
    if local_logits.shape[1] > 1 and local_logits.stride(1) != 1:
        raise ValueError(
            f"local_logits: last dim must be contiguous (stride(1) == 1), got strides "
            f"{tuple(local_logits.stride())}"
        )
    width = local_logits.shape[1]
    if isinstance(vocab_start, bool) or not isinstance(vocab_start, int):
        raise TypeError(f"vocab_start: expected an int, got {type(vocab_start).__name__}")
    if num_valid is None:
        num_valid = width
    if isinstance(num_valid, bool) or not isinstance(num_valid, int):
        raise TypeError(f"num_valid: expected an int or None, got {type(num_valid).__name__}")
    if not 0 <= num_valid <= width:
        raise ValueError(
            f"num_valid: {num_valid} out of range [0, {width}] for local_logits of shape "
            f"{tuple(local_logits.shape)}"
        )
    if vocab_start < 0:
        raise ValueError(f"vocab_start: must be >= 0, got {vocab_start}")
    if vocab_start + num_valid > MAX_VOCAB:
        raise ValueError(
            f"vocab_start + num_valid = {vocab_start + num_valid} exceeds the largest supported "
            f"vocabulary {MAX_VOCAB} (2**31 - 1 ids: ids never travel as floats)"
        )
    if local_logits.shape[0] > 0 and local_logits.stride(0) > MAX_VOCAB:
        raise ValueError(f"local_logits: row stride {local_logits.stride(0)} exceeds 2**31 - 1")
    return local_logits, vocab_start, num_valid


def check_index_tensor(
    name: str,
    t: object,
    device: torch.device,
    dims: int = 1,
    length: int | None = None,
    dtypes: tuple[torch.dtype, ...] = INDEX_DTYPES,
) -> torch.Tensor:
    """Validate one integer batch tensor (dtype, rank, length, device)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: dtype {t.dtype} not supported; expected one of {dtypes}")
    if t.dim() != dims:
        raise ValueError(f"{name}: expected {dims} dim(s), got shape {tuple(t.shape)}")
    if length is not None and t.shape[0] < length:
        raise ValueError(f"{name}: expected at least {length} entries, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}, expected the logits' device {device}")
    return t
