"""Launchers for the generated kernel variants (``shardmax.generated.<variant name>``).

Each function launches one generated kernel with launch parameters from a
:class:`shardmax.dispatch.Selection`; nothing here decides anything. Buffers are allocated with
shapes that depend only on the input shapes and the selection, so a CUDA graph captured for one
batch size replays with any values.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

import torch
import triton

from shardmax.variants import parse_name

_INTERPRET_AT_IMPORT = os.environ.get("TRITON_INTERPRET") == "1"


def _check_device(t: torch.Tensor) -> None:
    """CPU tensors run only in the Triton interpreter, which must be on before Triton loads."""
    if t.device.type == "cpu" and not _INTERPRET_AT_IMPORT:
        raise RuntimeError(
            "shardmax kernels got CPU tensors but the Triton interpreter is off: set "
            "TRITON_INTERPRET=1 in the environment before importing shardmax/triton (or move "
            "the tensors to a GPU)"
        )


class _InterpretedLaunch:
    """``kernel[grid](...)`` of a generated kernel run by the Triton interpreter, under
    ``numpy.errstate(divide/invalid/over="ignore")``.

    The interpreter evaluates every lane of a block with numpy, masked-off lanes included
    (``log(0)``, ``-inf - -inf``, ``x / T`` of greedy rows), and numpy warns about lanes whose
    results are then discarded by ``tl.where`` / masked stores. Those warnings say nothing
    about the outputs (checked ``==`` by the tests), so they are silenced here, for the
    launch only. Other attributes are the kernel's own.
    """

    __slots__ = ("_fn",)

    def __init__(self, fn: object) -> None:
        self._fn = fn

    def __getitem__(self, grid: object) -> object:
        import numpy

        launch = self._fn[grid]  # type: ignore[index]

        def run(*args: object, **kwargs: object) -> object:
            with numpy.errstate(divide="ignore", invalid="ignore", over="ignore"):
                return launch(*args, **kwargs)

        return run

    def __getattr__(self, name: str) -> object:
        return getattr(self._fn, name)


@functools.cache
def load(name: str) -> ModuleType:
    """The generated module of a variant (validated name); raises ValueError if missing.

    Under the Triton interpreter (``TRITON_INTERPRET=1`` at import) the result is a view of
    the module whose ``kernel`` launches under :class:`_InterpretedLaunch` (no numpy warnings
    from discarded lanes); on a GPU it is the module itself (nothing added to a launch).
    """
    parse_name(name)
    try:
        mod = importlib.import_module(f"shardmax.generated.{name}")
    except ModuleNotFoundError as e:
        raise ValueError(
            f"variant {name!r} is not in shardmax.generated; run `python -m generator`"
        ) from e
    if not _INTERPRET_AT_IMPORT:
        return mod
    view = ModuleType(mod.__name__, mod.__doc__)
    view.__dict__.update(mod.__dict__)
    view.kernel = _InterpretedLaunch(mod.kernel)  # type: ignore[attr-defined]
    return view


def chunk_for(num_valid: int, splits: int, block: int) -> int:
    """Columns per split: a multiple of ``block`` covering ``num_valid`` in ``splits`` parts."""
    per = triton.cdiv(max(num_valid, 1), splits)
    return triton.cdiv(per, block) * block


def shard_keys(
    local_logits: torch.Tensor,
    vocab_start: int,
    num_valid: int,
    variant: str,
    splits: int,
    num_warps: int,
    num_stages: int,
) -> torch.Tensor:
    """Local stage: ``[rows, W]`` logits -> ``[rows, splits]`` int64 packed keys."""
    mod = load(variant)
    _check_device(local_logits)
    rows = local_logits.shape[0]
    keys = torch.empty((rows, splits), dtype=torch.int64, device=local_logits.device)
    if rows == 0:
        return keys
    chunk = chunk_for(num_valid, splits, mod.BLOCK)
    mod.kernel[(rows, splits)](
        local_logits,
        keys,
        local_logits.stride(0),
        vocab_start,
        num_valid,
        chunk,
        BLOCK=mod.BLOCK,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return keys


PICK_ROWS = 16


def argmax_pick(keys: torch.Tensor, num_rows: int, tp: int, variant: str) -> torch.Tensor:
    """Finish of the argmax: gathered or all-reduced keys -> int64 ids ``[num_rows]``."""
    mod = load(variant)
    ids = torch.empty(num_rows, dtype=torch.int64, device=keys.device)
    if num_rows == 0:
        return ids
    keys = keys.contiguous()
    splits = keys.shape[1]
    mod.kernel[(triton.cdiv(num_rows, PICK_ROWS),)](
        keys,
        ids,
        num_rows,
        splits,
        tp,
        ROWS=PICK_ROWS,
        SPLITS_P2=triton.next_power_of_2(splits),
        num_warps=1,
    )
    return ids


def verify_finish(
    keys: torch.Tensor,
    tp: int,
    variant: str,
    draft_sampled: torch.Tensor,
    cu_num_logits: torch.Tensor,
    pos: torch.Tensor,
    idx_mapping: torch.Tensor,
    seed: torch.Tensor,
    num_speculative_steps: int,
    synthetic_conditional_rates: torch.Tensor | None,
    seq_lens: torch.Tensor | None,
    prefill_len: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Finish of greedy verification: one program per request (see the generated docstring)."""
    mod = load(variant)
    num_reqs = idx_mapping.shape[0]
    k = num_speculative_steps
    dev = keys.device
    sampled = torch.empty((num_reqs, k + 1), dtype=torch.int64, device=dev)
    num_sampled = torch.empty(num_reqs, dtype=torch.int32, device=dev)
    num_rejected = torch.empty(num_reqs, dtype=torch.int32, device=dev)
    if num_reqs == 0:
        return sampled, num_sampled, num_rejected
    # Kernels index with unit stride: views with other strides are copied (no-op otherwise).
    rates = (
        synthetic_conditional_rates.contiguous()
        if synthetic_conditional_rates is not None
        else torch.empty(1, device=dev)
    )
    has_prefill = seq_lens is not None and prefill_len is not None
    lens = seq_lens.contiguous() if seq_lens is not None and has_prefill else None
    prefill = prefill_len.contiguous() if prefill_len is not None and has_prefill else None
    num_slots = max(
        1, min(seed.shape[0], prefill.shape[0]) if prefill is not None else seed.shape[0]
    )
    dummy_i32 = torch.empty(1, dtype=torch.int32, device=dev)
    mod.kernel[(num_reqs,)](
        keys.contiguous(),
        draft_sampled.contiguous(),
        cu_num_logits.contiguous(),
        pos.contiguous(),
        idx_mapping.contiguous(),
        seed.contiguous(),
        rates,
        lens if lens is not None else dummy_i32,
        prefill if prefill is not None else dummy_i32,
        sampled,
        num_sampled,
        num_rejected,
        draft_sampled.shape[0],
        num_slots,
        keys.shape[1],
        tp,
        sampled.stride(0),
        K=k,
        KP1_P2=triton.next_power_of_2(k + 1),
        SPLITS_P2=triton.next_power_of_2(keys.shape[1]),
        SYNTHETIC=synthetic_conditional_rates is not None,
        HAS_PREFILL=has_prefill,
        num_warps=1,
    )
    return sampled, num_sampled, num_rejected
