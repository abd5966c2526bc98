"""The device-decided fallback (:class:`shardmax.integrations.vllm.fallback.DeviceFallback`):
vLLM's chain on the whole step, run by the device only when a request of the step is flagged.

The steps here are vLLM's own answers with planted damage: flagged requests get wrong tokens and
counts (the fallback must replace them by vLLM's), an unflagged request on a step with nothing
flagged keeps its (damaged) values (the body must not run: a fallback that always ran would
repair it). CPU (``emulate``: the same tables and kernels, the predicate read on the host) and
the H200 (the conditional CUDA graph, twice per step, bit-compared, no host sync).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardmax.integrations.vllm.fallback import DeviceFallback
from shardmax.ops.sampled import VerifyResult
from shardmax.testing.traffic import realistic_batch
from shardmax.testing.vllm_chain import NativeChain, verify_inputs

CHAINS = NativeChain.discover()
by_version = pytest.mark.parametrize("chain", CHAINS, ids=[c.id for c in CHAINS])


def _result(want, flagged: list[int], damaged: list[int]) -> VerifyResult:
    """vLLM's answer as a VerifyResult (-1 past num_sampled), ``damaged`` requests wrong,
    ``flagged`` requests flagged (reason 9)."""
    sampled, num_sampled, num_rejected = (t.clone() for t in want[:3])
    cols = torch.arange(sampled.shape[1], device=sampled.device)[None, :]
    sampled = torch.where(cols < num_sampled[:, None], sampled, -1).to(torch.int64).contiguous()
    num_sampled = num_sampled.to(torch.int32).contiguous()
    num_rejected = num_rejected.to(torch.int32).contiguous()
    n = sampled.shape[0]
    fallback = torch.zeros(n, dtype=torch.bool, device=sampled.device)
    reason = torch.zeros(n, dtype=torch.int8, device=sampled.device)
    for r in damaged:
        sampled[r] = 7
        num_sampled[r] = 1
        num_rejected[r] = 3
    for r in flagged:
        fallback[r] = True
        reason[r] = 9
    return VerifyResult(sampled, num_sampled, num_rejected, fallback, reason)


def _same(res: VerifyResult, want, what: str) -> None:
    got = (res.sampled.cpu(), res.num_sampled.cpu(), res.num_rejected.cpu())
    w = [t.cpu() for t in want[:3]]
    assert torch.equal(got[1], w[1].to(torch.int32)), (what, got[1], w[1])
    assert torch.equal(got[2], w[2].to(torch.int32)), what
    cols = torch.arange(got[0].shape[1])[None, :] < got[1][:, None]
    assert torch.equal(got[0][cols], w[0].to(torch.int64)[cols]), what
    assert bool((got[0][~cols] == -1).all()), what
    assert not bool(res.fallback.any()) and not bool(res.reason.any()), what


def _step(seed: int, num_reqs: int, vocab: int, device: str):
    b = realistic_batch(num_reqs, 3, vocab, seed=seed, mix="temperature", device=device)
    return b, verify_inputs(b)


@pytest.mark.e2e
@by_version
def test_device_fallback_emulated(chain: NativeChain) -> None:
    b, kw = _step(3, 5, 512, "cpu")
    want = chain.verify(b.logits, **kw)
    fb = DeviceFallback(chain, emulate=True)
    # first step of a signature: the caller's host read
    res = _result(want, [1], [1])
    assert not fb.run(res, b.logits, **kw)
    assert bool(res.fallback[1]) and fb.stats["host_read"] == 1 and fb.stats["launched"] == 0
    # then on the device (emulated): flagged requests get vLLM's answer, flags cleared
    for flagged in ([1], [0, 4], [0, 1, 2, 3, 4]):
        res = _result(want, flagged, flagged)
        assert fb.run(res, b.logits, **kw)
        _same(res, want, f"flagged {flagged}")
    # nothing flagged: the body does not run (the planted damage stays)
    res = _result(want, [], [2])
    assert fb.run(res, b.logits, **{**kw, "checks": False})
    assert int(res.num_sampled[2]) == 1 and int(res.sampled[2, 0]) == 7
    assert fb.stats["launched"] == 4
    # a moved logits tensor is another signature: host read first
    moved = b.logits.clone()
    res = _result(want, [3], [3])
    assert not fb.run(res, moved, **kw)
    assert fb.run(res, moved, **kw)
    _same(res, want, "moved logits")
    # sampling values changed in place (same addresses): vLLM decides otherwise (temperature
    # launches, fp32 copy), so it is another signature -- never the old body
    kw_hot = {**kw, "temperature_np": kw["temperature_np"].copy()}
    saved = kw["temperature_gpu"].clone()
    kw_hot["temperature_gpu"].mul_(0.7)
    kw_hot["temperature_np"] *= np.float32(0.7)
    want_hot = chain.verify(b.logits, **kw_hot)
    res = _result(want_hot, [0], [0])
    assert not fb.run(res, b.logits, **kw_hot)
    res = _result(want_hot, [0, 2], [0, 2])
    assert fb.run(res, b.logits, **kw_hot)
    _same(res, want_hot, "temperatures changed in place")
    kw["temperature_gpu"].copy_(saved)
    # outputs the kernel cannot write: the caller reads the flags
    res = _result(want, [1], [1])
    res = res._replace(num_sampled=res.num_sampled.to(torch.int64))
    assert not fb.run(res, b.logits, **kw)


@pytest.mark.e2e
@by_version
def test_device_fallback_bad_input(chain: NativeChain) -> None:
    b, kw = _step(4, 3, 256, "cpu")
    want = chain.verify(b.logits, **kw)
    fb = DeviceFallback(chain, emulate=True)
    with pytest.raises(ValueError, match="result"):
        fb.run(_result(want, [], [])._replace(fallback=torch.zeros(2, dtype=torch.bool)),
               b.logits, **kw)  # fmt: skip
    with pytest.raises(ValueError, match="draft_sampled"):
        fb.run(_result(want, [], []), b.logits, **{**kw, "draft_sampled": kw["draft_sampled"][:3]})
    with pytest.raises(TypeError, match="unexpected"):
        fb.run(_result(want, [], []), b.logits, **kw, top_kk=3)
    with pytest.raises(NotImplementedError):
        fb.run(_result(want, [], []), b.logits, **kw, num_logprobs=5)
    with pytest.raises(ValueError, match="capture_after"):
        DeviceFallback(chain, capture_after=0)
    # off CUDA without emulate: never on the device
    plain = DeviceFallback(chain)
    assert plain.unavailable(torch.device("cpu")) is not None
    assert not plain.run(_result(want, [0], [0]), b.logits, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("num_reqs", [1, 8, 24])
def test_gpu_device_fallback(num_reqs: int) -> None:
    """On the H200: per vLLM version, steps with nothing / some / every request flagged, each
    run twice from the captured conditional graph (bits compared), all `==` vLLM's chain, no
    host sync on a launched step."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if not CHAINS:
        pytest.skip("no vLLM chain tree (scripts/vllm_kernels.sh)")
    from shardmax.testing.syncs import host_syncs

    b, kw = _step(num_reqs, num_reqs, 200064, "cuda")
    gen = np.random.default_rng(num_reqs)
    for chain in CHAINS:
        want = chain.verify(b.logits, **kw)
        fb = DeviceFallback(chain)
        why = fb.unavailable(b.logits.device)
        assert why is None, why
        assert not fb.run(_result(want, [0], [0]), b.logits, **kw)  # first: host read
        res = _result(want, [0], [0])
        assert fb.run(res, b.logits, **kw)  # second: captured (a sync), then launched
        torch.cuda.synchronize()
        _same(res, want, f"vLLM {chain.version} {num_reqs} reqs, the capture's step")
        some = sorted(gen.choice(num_reqs, size=max(1, num_reqs // 3), replace=False).tolist())
        for flagged in ([0], some, list(range(num_reqs))):
            outs = []
            for _ in range(2):
                res = _result(want, flagged, flagged)
                syncs = host_syncs(
                    lambda res=res, fb=fb: fb.run(res, b.logits, **{**kw, "checks": False})
                )
                assert syncs == "none", syncs
                torch.cuda.synchronize()
                _same(res, want, f"vLLM {chain.version} {num_reqs} reqs flagged {flagged}")
                outs.append([t.clone() for t in res[:3]])
            assert all(torch.equal(x, y) for x, y in zip(*outs, strict=True))
        res = _result(want, [], [num_reqs - 1])
        assert fb.run(res, b.logits, **kw)
        torch.cuda.synchronize()
        assert int(res.sampled[num_reqs - 1, 0]) == 7  # nothing flagged: the body did not run
        assert fb.stats["captured"] == 1, fb.stats
        print(f"[device fallback] vLLM {chain.version} {num_reqs} requests: {fb.stats}")


def test_plugin_device_fallback_only_where_it_can_run(monkeypatch) -> None:
    """The plug-in's helper: None unless opted in, without a resolver, off CUDA, or with graphs
    off."""
    from shardmax.integrations.vllm import step

    monkeypatch.setattr(step, "_FALLBACK", [])
    monkeypatch.setattr(step, "resolver", lambda: object())
    monkeypatch.delenv(step.ENV_DEVICE_FALLBACK, raising=False)
    assert step.device_fallback(torch.device("cuda", 0)) is None  # opt-in
    monkeypatch.setenv(step.ENV_DEVICE_FALLBACK, "1")
    monkeypatch.setattr(step, "resolver", lambda: None)
    assert step.device_fallback(torch.device("cuda", 0)) is None
    monkeypatch.setattr(step, "resolver", lambda: object())
    assert step.device_fallback(torch.device("cpu")) is None
    monkeypatch.setenv(step.ENV_GRAPHS, "0")
    assert step.device_fallback(torch.device("cuda", 0)) is None
    assert step._FALLBACK == []
