"""shardmax.runtime.host: the hot path's small host <-> device copies."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardmax.runtime.host import stage, stage_into, to_host
from shardmax.testing.syncs import host_syncs

CASES = [
    torch.tensor([0, 3, 0, -1], dtype=torch.int8),
    torch.zeros(0, dtype=torch.int8),
    torch.arange(10, dtype=torch.int64)[::2],  # strided
    torch.tensor([True, False, True]),
    torch.tensor([[1.5, -0.0], [float("inf"), float("nan")]], dtype=torch.float32),
]


@pytest.mark.parametrize("t", CASES, ids=lambda t: f"{t.dtype}-{tuple(t.shape)}")
def test_to_host_is_a_private_copy(t: torch.Tensor) -> None:
    a = to_host(t)
    want = t.numpy()
    assert a.dtype == want.dtype and a.shape == want.shape
    assert np.array_equal(a, want, equal_nan=True)
    if a.size:  # the caller owns it: writing it leaves the tensor alone
        a[...] = 0
        assert np.array_equal(t.numpy(), want, equal_nan=True)


def test_stage_round_trip() -> None:
    a = np.arange(7, dtype=np.int64)[::2]
    assert to_host(stage(a, torch.device("cpu"))).tolist() == [0, 2, 4, 6]
    dst = torch.full((6,), -1, dtype=torch.int64)
    stage_into(dst, a)
    assert dst.tolist() == [0, 2, 4, 6, -1, -1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_to_host_waits_for_queued_work_and_reuses_its_buffer() -> None:
    """The read sees the value a kernel queued behind milliseconds of work wrote (it waits for
    that work), every dtype and shape comes back whole, and two reads of one buffer do not
    alias (the second read leaves the first's array alone)."""
    a = torch.randn(4096, 4096, device="cuda")
    codes = torch.zeros(300, dtype=torch.int8, device="cuda")
    for step in range(5):
        for _ in range(8):
            a = a @ a / 64.0  # keeps the stream busy for a few ms
        codes.fill_(step + 1)
        got = to_host(codes)
        assert got.tolist() == [step + 1] * 300
    first = to_host(torch.arange(5, device="cuda"))
    second = to_host(torch.full((5,), 9, device="cuda"))
    assert first.tolist() == [0, 1, 2, 3, 4] and second.tolist() == [9] * 5
    for t in CASES:
        assert np.array_equal(to_host(t.cuda()), t.numpy(), equal_nan=True)
    big = torch.arange(100_000, dtype=torch.int32, device="cuda")  # grows the staging buffer
    assert np.array_equal(to_host(big), np.arange(100_000, dtype=np.int32))
    # a wait torch's sync debug mode does not report: the detector sees it all the same
    assert host_syncs(lambda: to_host(codes)) == "wait: Event.synchronize"
    assert host_syncs(lambda: codes.to("cpu")).startswith("sync: ")
    assert host_syncs(lambda: codes.add_(1)) == "none"
