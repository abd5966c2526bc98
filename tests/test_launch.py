"""The direct launch path's specialisation key (shardmax.runtime.kernels).

On a GPU, :class:`shardmax.runtime.kernels.Kernel` reuses a compiled binary for every launch whose
key matches the one it was compiled for. The key must be at least as fine as Triton's own: a
launch with ``CAND=32`` must never reuse the ``CAND=64`` binary (found on the H200: a key that
kept only an int's ``% 16`` facts for constexprs did exactly that).
"""

from __future__ import annotations

import pytest
import torch
import triton

from generator.space import all_variants
from shardmax.runtime.kernels import launch_key, load


def test_constexpr_values_are_keyed_by_value() -> None:
    x = torch.zeros(8)
    dns, const = (False, False, True), (False, False, True)
    assert launch_key([x, 5, 32], dns, const) != launch_key([x, 5, 64], dns, const)
    assert launch_key([x, 5, 64], dns, const) == launch_key([x, 5, 64], dns, const)
    assert launch_key([x, 5, True], dns, const) != launch_key([x, 5, False], dns, const)


def test_tensors_and_ints_are_keyed_by_their_specialisation() -> None:
    a = torch.zeros(16)
    dns, const = (False, False), (False, False)
    assert launch_key([a, 32], dns, const) == launch_key([torch.zeros(16), 48], dns, const)
    assert launch_key([a, 32], dns, const) != launch_key([a, 33], dns, const)  # % 16
    assert launch_key([a, 1], dns, const) != launch_key([a, 17], dns, const)  # == 1
    assert launch_key([a, 2**40], dns, const) != launch_key([a, 16], dns, const)  # 64-bit
    assert launch_key([a[1:], 32], dns, const) != launch_key([a, 32], dns, const)  # alignment
    assert launch_key([a.int(), 32], dns, const) != launch_key([a, 32], dns, const)  # dtype
    assert launch_key([a, 32], (False, True), const) == launch_key([a, 33], (False, True), const)
    assert launch_key([a, [1]], dns, const) is None  # unhashable: Triton's own path


@pytest.mark.parametrize("name", [k.name for k in all_variants()][::7])
def test_generated_constexprs_are_triton_constexprs(name: str) -> None:
    """The parameters the direct path keys by value are exactly each module's CONSTEXPRS."""
    mod = load(name)
    fn = getattr(mod.kernel, "fn", mod.kernel)
    fn = getattr(fn, "fn", fn)
    params = triton.runtime.jit.JITFunction(fn).params
    assert {p.name for p in params if p.is_constexpr} == set(mod.CONSTEXPRS)
