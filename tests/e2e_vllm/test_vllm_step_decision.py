"""The plug-in's per-step gate against vLLM 0.32's real ``RejectionSampler`` class (e2e venv).

``shardmax.integrations.vllm.step_decision`` on a stand-in runner whose rejection sampler is a
real (uninitialised) vLLM ``RejectionSampler`` and whose sampler holds vLLM-shaped sampling state
(``.np`` arrays, ``needs_logits_processing`` set the way ``Sampler.add_request`` sets it:
``T != 0 and (T != 1 or top-k/top-p/min-p)`` OR any logits processor). Covers what the engine
test cannot: a top-k request (vLLM's own top-k Triton kernel fails under ``TRITON_INTERPRET=1``
on CPU, plug-in off too) must send its step to vLLM with the top-k reason, and vLLM's temperature
flag alone must not count as logits processing on the ``allow_temperature`` path.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from types import SimpleNamespace

if importlib.util.find_spec("vllm") is not None and "vllm.triton_utils" not in sys.modules:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("SHARDMAX_FAKE_TRITON_CPU", "1")
    _shim = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_fake_triton_cpu.py")
    _spec = importlib.util.spec_from_file_location("_shardmax_step_decision_shim", _shim)
    if _spec is not None and _spec.loader is not None:
        _mod = importlib.util.module_from_spec(_spec)
        with contextlib.suppress(Exception):
            _spec.loader.exec_module(_mod)

import numpy as np
import pytest

pytestmark = [pytest.mark.e2e]

try:
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler
except Exception as exc:
    pytest.skip(f"vLLM 0.32 V2 rejection sampler not importable: {exc!r}", allow_module_level=True)

from shardmax.integrations.vllm import step_decision  # noqa: E402

V = 1000


def _arr(vals, dtype):
    return SimpleNamespace(np=np.asarray(vals, dtype=dtype))


def _proc(name, **fields):
    """An instance of a class named ``name`` (the plug-in matches vLLM's processors by name)."""
    obj = type(name, (), {})()
    obj.__dict__.update(fields)
    return obj


def _runner(temps, top_k=None, penalty=None, custom_proc=False):
    n = len(temps)
    top_k = [V] * n if top_k is None else top_k
    penalty = [False] * n if penalty is None else penalty
    top_p, min_p = [1.0] * n, [0.0] * n
    sampling_term = [
        t != 0.0 and (t != 1.0 or k != V or p != 1.0 or m != 0.0)
        for t, k, p, m in zip(temps, top_k, top_p, min_p, strict=True)
    ]
    needs = np.asarray([a or b for a, b in zip(sampling_term, penalty, strict=True)])
    procs = [
        _proc("LogitBiasState", use_logit_bias=np.zeros(n, dtype=bool)),
        _proc("PenaltiesState", use_penalty=np.asarray(penalty, dtype=bool)),
        _proc("BadWordsState", num_bad_words=_arr([0] * n, np.int32)),
    ]
    if custom_proc:
        procs.append(_proc("MyProcessor"))
    st = SimpleNamespace(
        temperature=_arr(temps, np.float32),
        top_k=_arr(top_k, np.int32),
        top_p=_arr(top_p, np.float32),
        min_p=_arr(min_p, np.float32),
        vocab_size=V,
        max_num_logprobs=lambda idx: -1,
    )
    sampler = SimpleNamespace(
        sampling_states=st,
        needs_logits_processing=needs,
        logits_processors=procs,
        thinking_budget_state=SimpleNamespace(enabled=False),
        compute_nans=False,
        return_sampling_mask=False,
    )
    rs = object.__new__(RejectionSampler)
    rs.sampler = sampler
    rs.enable_adaptive_verification = False
    rs.use_block_verification = False
    rs.watermark_key = None
    si = SimpleNamespace(org_vocab_start_index=0, org_vocab_end_index=V // 2, num_added_elements=0)
    model = SimpleNamespace(
        compute_logits_local=lambda h: h, lm_head=SimpleNamespace(shard_indices=si)
    )
    runner = SimpleNamespace(
        rejection_sampler=rs,
        batch_sharder=None,
        model=model,
        speculator=SimpleNamespace(draft_logits=None),
    )
    batch = SimpleNamespace(num_reqs=n, num_draft_tokens=3 * n, idx_mapping_np=np.arange(n))
    return runner, batch


def test_greedy_step_unchanged():
    runner, batch = _runner([0.0, 0.0])
    assert step_decision(runner, batch, None).ok
    assert step_decision(runner, batch, None, allow_temperature=True).ok


def test_temperature_only_step_allowed_only_with_allow_temperature():
    runner, batch = _runner([0.0, 0.8, 1.0])
    assert runner.rejection_sampler.sampler.needs_logits_processing.tolist() == [False, True, False]
    d = step_decision(runner, batch, None)
    assert d.reason == "temperature[1]=0.800000011920929 != 0 (non-greedy request)"
    assert step_decision(runner, batch, None, allow_temperature=True).ok


def test_top_k_request_falls_back_with_top_k_reason():
    runner, batch = _runner([0.0, 0.8, 0.8], top_k=[V, V, 5])
    d = step_decision(runner, batch, None, allow_temperature=True)
    assert not d
    assert d.reason == f"top_k[2]=5 < vocab_size={V} (top-k active)"


def test_penalties_on_sampled_request_fall_back():
    runner, batch = _runner([0.0, 0.8], penalty=[False, True])
    d = step_decision(runner, batch, None, allow_temperature=True)
    assert d.reason == "logits processors active (bias/penalties/bad words/min_tokens)"
    # greedy row with penalties: flagged by a processor alone
    runner, batch = _runner([0.0, 0.8], penalty=[True, False])
    d = step_decision(runner, batch, None, allow_temperature=True)
    assert d.reason == "logits processors active (bias/penalties/bad words/min_tokens)"


def test_custom_logits_processor_is_conservative():
    runner, batch = _runner([0.8], custom_proc=True)
    d = step_decision(runner, batch, None, allow_temperature=True)
    assert d.reason == "logits processors active (bias/penalties/bad words/min_tokens)"
