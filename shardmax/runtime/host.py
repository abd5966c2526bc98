"""Small host <-> device copies on the hot path, without needless stalls.

* :func:`stage` / :func:`stage_into`: a host array to the device (a new tensor / a given one)
  in stream order, without a host sync (pinned memory, non-blocking copy).
* :func:`to_host`: a small device tensor read on the host -- a sampled step's host sync (its
  fallback codes; on a step that resolves requests also ``VerifyResult.need``, read after the
  codes, so it waits for nothing). The copy lands in a pinned staging buffer kept per device and the
  host waits on an event recorded behind it, instead of ``tensor.to("cpu")``'s pageable copy
  and whole-stream synchronisation; ``benchmarks/host_costs.py`` measures both (the GPU idles
  from the moment the codes are ready until the host has read them, on every step).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["stage", "stage_into", "to_host"]

_STAGING: dict[torch.device, tuple[torch.Tensor, torch.cuda.Event]] = {}
"""Per CUDA device: a pinned byte buffer (grown on demand) and the event the read waits on."""


def stage(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on ``device`` without a host sync: on CUDA through pinned memory (PyTorch's
    caching host allocator) and a non-blocking copy in stream order; elsewhere a plain copy.
    (A copy from pageable memory would wait for every kernel queued before it.)"""
    t = torch.from_numpy(np.require(a, requirements=("C", "W")))  # copies only if needed
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def stage_into(dst: torch.Tensor, a: np.ndarray) -> None:
    """:func:`stage` into the first ``len(a)`` elements of the 1-D ``dst`` (a static buffer a
    CUDA graph reads; ``a`` cast to its dtype)."""
    src = torch.from_numpy(np.ascontiguousarray(a)).to(dst.dtype)
    if dst.device.type == "cuda":
        dst[: src.shape[0]].copy_(src.pin_memory(), non_blocking=True)
    else:
        dst[: src.shape[0]].copy_(src)


def _staging(device: torch.device, nbytes: int) -> tuple[torch.Tensor, torch.cuda.Event]:
    got = _STAGING.get(device)
    if got is None or got[0].numel() < nbytes:
        size = max(4096, 1 << (nbytes - 1).bit_length())
        got = (torch.empty(size, dtype=torch.uint8, pin_memory=True), torch.cuda.Event())
        _STAGING[device] = got
    return got


def to_host(t: torch.Tensor) -> np.ndarray:
    """``t`` (any dtype numpy has, contiguous or not) as a new numpy array on the host, after
    every kernel queued before it on the current stream.

    On CUDA: one non-blocking copy into the device's pinned staging buffer, an event recorded
    behind it and ``event.synchronize()`` (the host waits for that event only, not for the
    whole device), then a numpy copy out of the buffer (so the buffer is free again at once).
    Not thread-safe per device: the engine calls it from one thread. Elsewhere ``t.numpy()``'s
    copy.
    """
    t = t.detach()
    if t.device.type != "cuda":
        return t.to("cpu").numpy().copy()
    n = t.numel() * t.element_size()
    buf, done = _staging(t.device, n)
    view = buf[:n].view(t.dtype).view(t.shape)
    view.copy_(t, non_blocking=True)
    done.record(torch.cuda.current_stream(t.device))
    done.synchronize()
    return view.numpy().copy()
