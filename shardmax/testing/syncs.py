"""Detecting host syncs in a call: torch's sync debug mode plus the waits it does not see.

``torch.cuda.set_sync_debug_mode("error")`` raises on the synchronising *tensor* operations
(``.item()``, ``.to("cpu")`` of a CUDA tensor, ``nonzero`` ...), but not on an event wait:
``torch.cuda.Event.synchronize`` -- the wait :func:`shardmax.runtime.host.to_host` (the
plug-in's flag read) makes passes unreported (measured on the H200: torch's mode lets it through,
:func:`host_syncs` reports it). :func:`host_syncs` checks torch's mode and counts the explicit
waits besides -- event, stream and device ``synchronize`` --, so a benchmark or test that claims
"no host sync" cannot be fooled by a wait that torch does not report.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["host_syncs"]


def host_syncs(call: Callable[[], Any]) -> str:
    """Run ``call()`` once and say how it synchronised with the device: ``"none"``, or the
    first synchronising operation torch reports (``"sync: <torch's message>"``), or else the
    first explicit wait (``"wait: Event.synchronize"``, ``Stream.synchronize``, ``synchronize``
    of ``torch.cuda`` or ``torch.accelerator``; the waits of ``torch.cuda.Event`` /
    ``torch.cuda.Stream`` and of ``torch.Event`` / ``torch.Stream`` where those types can be
    patched -- an immutable extension type cannot). Needs CUDA; the device is synchronised before
    and after, and torch's sync debug mode restored. Errors of ``call`` other than torch's sync
    error propagate."""
    waits: list[str] = []
    patched = [(torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize"),
               (torch.cuda, "synchronize")]  # fmt: skip
    for owner in ("Event", "Stream"):  # torch's device-generic classes, where they exist
        cls = getattr(torch, owner, None)
        if isinstance(cls, type) and cls not in (torch.cuda.Event, torch.cuda.Stream):
            patched.append((cls, "synchronize"))
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "synchronize"):
        patched.append((accelerator, "synchronize"))
    saved = [(obj, name, getattr(obj, name)) for obj, name in patched]

    def counting(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            waits.append(label)
            return fn(*args, **kwargs)

        return wrapper

    torch.cuda.synchronize()
    mode = torch.cuda.get_sync_debug_mode()
    applied = []
    try:
        for obj, name, fn in saved:
            label = getattr(obj, "__name__", str(obj)).rsplit(".", 1)[-1]
            try:
                setattr(obj, name, counting(f"{label}.{name}", fn))
            except TypeError:  # an immutable extension type (torch.Event): its Python
                continue  # subclasses (torch.cuda.Event) are patched above
            applied.append((obj, name, fn))
        torch.cuda.set_sync_debug_mode("error")
        call()
    except RuntimeError as e:
        if "synchroniz" not in str(e):
            raise
        return "sync: " + str(e).splitlines()[0][:80]
    finally:
        torch.cuda.set_sync_debug_mode(mode)
        for obj, name, fn in applied:
            setattr(obj, name, fn)
        torch.cuda.synchronize()
    return f"wait: {waits[0]}" if waits else "none"
