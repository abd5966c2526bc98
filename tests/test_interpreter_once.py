"""conftest's interpreter shim: ``triton.language`` is patched once per launch, not once per
device-function call, and a launch still leaves the language as it found it."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the shim is for Triton's interpreter"
)


@triton.jit
def _add_one(x):
    return x + 1


@triton.jit
def _loop_kernel(out_ptr, N: tl.constexpr, CALLS: tl.constexpr):
    offs = tl.arange(0, N)
    acc = tl.zeros([N], dtype=tl.int32)
    for _ in range(CALLS):
        acc = _add_one(acc)
    tl.store(out_ptr + offs, acc)


@pytest.fixture
def walks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the interpreter's walks over the language (``_patch_builtin`` calls)."""
    from triton.runtime import interpreter

    real = interpreter._patch_builtin
    seen = [0]

    def counted(*args, **kwargs):
        seen[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(interpreter, "_patch_builtin", counted)
    return seen


def _launch(calls: int) -> torch.Tensor:
    out = torch.empty(16, dtype=torch.int32)
    _loop_kernel[(2,)](out, N=16, CALLS=calls)
    return out


def test_device_function_calls_do_not_patch_the_language_again(walks: list[int]) -> None:
    """A launch whose programs make 50 device-function calls walks the language as often as
    one whose programs make 2 (a device function of a module that sees a language module its
    kernel's does not, such as ``tl.zeros``, still patches, once per launch)."""
    from triton.runtime import interpreter

    assert getattr(interpreter._patch_lang, "_shardmax_once", False), "conftest's shim is off"
    _launch(1)  # the first launch may import and touch the language's modules differently
    counts = []
    for calls in (1, 25):
        walks[0] = 0
        assert torch.equal(_launch(calls), torch.full((16,), calls, dtype=torch.int32))
        counts.append(walks[0])
    assert counts[0] > 0 and counts[1] == counts[0], f"walks for 2 and 50 calls: {counts}"


def test_a_launch_leaves_the_language_as_it_found_it() -> None:
    before = (tl.max, tl.core.tensor.__add__, tl.arange, tl.math.exp)
    _launch(3)
    _launch(1)
    assert (tl.max, tl.core.tensor.__add__, tl.arange, tl.math.exp) == before


def test_a_failing_launch_ends_it(walks: list[int]) -> None:
    """A launch that raises inside its programs (after it patched the language) still restores
    the language, and the next launch patches afresh."""
    before = (tl.max, tl.core.tensor.__add__)
    walks[0] = 0
    with pytest.raises(Exception):  # noqa: B017 -- the interpreter wraps the error its own way
        _loop_kernel[(1,)](None, N=16, CALLS=2)  # the store through a null pointer fails
    assert walks[0] > 0, "the launch failed before it patched the language"
    assert (tl.max, tl.core.tensor.__add__) == before
    walks[0] = 0
    assert torch.equal(_launch(2), torch.full((16,), 2, dtype=torch.int32))
    assert walks[0] > 0
