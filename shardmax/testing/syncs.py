"""Detecting host syncs in a call: torch's sync debug mode plus the waits it does not see.

``torch.cuda.set_sync_debug_mode("error")`` raises on the synchronising *tensor* operations
(``.item()``, ``.to("cpu")`` of a CUDA tensor, ``nonzero`` ...), but not on explicit waits:
``torch.cuda.Event.synchronize``, ``torch.cuda.Stream.synchronize`` and
``torch.cuda.synchronize`` -- the waits :func:`shardmax.runtime.host.to_host` (the plug-in's
flag read) makes. :func:`host_syncs` checks both, so a benchmark or test that claims "no host
sync" cannot be fooled by a wait that torch does not report.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["host_syncs"]


def host_syncs(call: Callable[[], Any]) -> str:
    """Run ``call()`` once and say how it synchronised with the device: ``"none"``, or the
    first synchronising operation (``"sync: <torch's message>"`` or ``"wait: Event.synchronize"``
    etc.). Needs CUDA; the device is synchronised before and after."""
    waits: list[str] = []
    patched = [
        (torch.cuda.Event, "synchronize"),
        (torch.cuda.Stream, "synchronize"),
        (torch.cuda, "synchronize"),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name in patched]

    def counting(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            waits.append(label)
            return fn(*args, **kwargs)

        return wrapper

    torch.cuda.synchronize()
    for obj, name, fn in saved:
        label = f"{getattr(obj, '__name__', 'torch.cuda')}.{name}"
        setattr(obj, name, counting(label, fn))
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
        return f"wait: {waits[0]}" if waits else "none"
    except RuntimeError as e:
        return "sync: " + str(e).splitlines()[0][:80]
    finally:
        torch.cuda.set_sync_debug_mode(0)
        for obj, name, fn in saved:
            setattr(obj, name, fn)
        torch.cuda.synchronize()
