"""Unit tests of ``shardmax.integrations.vllm`` that run without vLLM.

The hooks' vLLM-facing behaviour is covered end to end by ``tests/e2e_vllm``; here: the module
imports without vLLM, ``install()`` is inert without ``SHARDMAX_VLLM=1``, and
``get_top_tokens`` / ``rejection_sample_sharded`` agree with torch on fake vLLM objects (TP=1).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from shardmax import reference
from shardmax.integrations import vllm as smv

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


class FakeShardIndices:
    """The fields of vLLM's ``VocabParallelEmbeddingShardIndices`` the hook reads."""

    def __init__(self, start: int, end: int, padded_width: int, added: int = 0):
        self.org_vocab_start_index = start
        self.org_vocab_end_index = end
        self.num_org_vocab_padding = padded_width - (end - start)
        self.num_added_elements = added
        self.num_added_elements_padded = added


class FakeHead:
    def __init__(self, weight: torch.Tensor, shard_indices: FakeShardIndices):
        self.weight = weight
        self.shard_indices = shard_indices


class FakeLogitsProcessor:
    """Stands in for vLLM's ``LogitsProcessor``; ``get_top_tokens`` plays the original."""

    def __init__(self, scale: float = 1.0, soft_cap: float | None = None):
        self.scale = scale
        self.soft_cap = soft_cap
        self.original_calls = 0

    def _apply_head(self, lm_head, hidden_states, embedding_bias):
        out = hidden_states @ lm_head.weight.t()
        return out if embedding_bias is None else out + embedding_bias

    def get_top_tokens(self, lm_head, hidden_states, embedding_bias=None):
        self.original_calls += 1
        return torch.full((hidden_states.shape[0],), -7, dtype=torch.int64)


def _setup(
    vocab: int = 50,
    width: int = 64,
    hidden: int = 16,
    rows: int = 9,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(width, hidden, generator=g)
    w[vocab:] = 0.0  # vLLM zero-fills padding rows: padded logits are exactly 0
    h = torch.randn(rows, hidden, generator=g)
    # Make every real logit of some rows negative, so an unmasked padding 0 would win.
    h[: rows // 2] = -h[: rows // 2].abs()
    w[:vocab] = w[:vocab].abs()
    head = FakeHead(w.to(dtype), FakeShardIndices(0, vocab, width))
    return head, h.to(dtype)


def _expected(lp: FakeLogitsProcessor, head: FakeHead, h: torch.Tensor, vocab: int):
    logits = lp._apply_head(head, h, None)
    if lp.soft_cap is not None:
        logits = torch.tanh(logits / lp.soft_cap) * lp.soft_cap
    if lp.scale != 1.0:
        logits = logits * lp.scale
    return torch.argmax(logits[:, :vocab], dim=-1)


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv("SHARDMAX_VLLM_STATS_DIR", raising=False)
    smv.reset_stats()
    yield
    smv.reset_stats()


def test_import_without_vllm():
    code = (
        "import sys; sys.modules['vllm'] = None\n"  # any `import vllm` now raises ImportError
        "import shardmax.integrations.vllm as m\n"
        "m.install()\n"
        "assert not m.is_installed()\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "SHARDMAX_VLLM"}
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_install_is_noop_without_env(monkeypatch):
    monkeypatch.delenv("SHARDMAX_VLLM", raising=False)
    smv.install()
    assert not smv.is_installed()
    monkeypatch.setenv("SHARDMAX_VLLM", "0")
    smv.install()
    assert not smv.is_installed()


@pytest.mark.skipif(HAVE_VLLM, reason="checks the error raised when vLLM is missing")
def test_install_without_vllm_names_supported_versions(monkeypatch):
    monkeypatch.setenv("SHARDMAX_VLLM", "1")
    with pytest.raises(RuntimeError, match=r"0\.32"):
        smv.install()
    assert not smv.is_installed()


@pytest.mark.parametrize("scale,soft_cap", [(1.0, None), (0.5, None), (1.0, 3.0), (2.0, 1.5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_get_top_tokens_matches_torch(scale, soft_cap, dtype):
    vocab = 50
    head, h = _setup(vocab=vocab, dtype=dtype)
    lp = FakeLogitsProcessor(scale=scale, soft_cap=soft_cap)
    got = smv.get_top_tokens(lp, head, h)
    assert got.dtype == torch.int64
    assert torch.equal(got, _expected(lp, head, h, vocab))
    assert bool((got < vocab).all())
    assert lp.original_calls == 0
    assert smv.stats()["sharded_argmax"] == 1


def test_get_top_tokens_padding_never_wins():
    vocab = 50
    head, h = _setup(vocab=vocab)
    lp = FakeLogitsProcessor()
    full = lp._apply_head(head, h, None)
    neg = (full[:, :vocab] < 0).all(dim=-1)
    assert bool(neg.any()), "fixture must contain rows whose padding (0) beats every real logit"
    got = smv.get_top_tokens(lp, head, h)
    assert torch.equal(got, torch.argmax(full[:, :vocab], dim=-1))


def test_get_top_tokens_embedding_bias():
    vocab = 50
    head, h = _setup(vocab=vocab)
    bias = torch.randn(64, generator=torch.Generator().manual_seed(3))
    lp = FakeLogitsProcessor()
    got = smv.get_top_tokens(lp, head, h, bias)
    assert torch.equal(got, torch.argmax((h @ head.weight.t() + bias)[:, :vocab], dim=-1))


def test_get_top_tokens_ties_pick_lowest_id():
    vocab = 50
    head, h = _setup(vocab=vocab)
    head.weight[7] = head.weight[3]  # ids 3 and 7 tie on every row
    head.weight[3] = head.weight[3] * 0 + 100.0
    head.weight[7] = head.weight[3]
    h = h.abs()
    got = smv.get_top_tokens(FakeLogitsProcessor(), head, h)
    assert bool((got == 3).all())


@pytest.mark.parametrize("scale", [0.0, -1.0])
def test_get_top_tokens_rejects_non_positive_scale(scale):
    head, h = _setup()
    with pytest.raises(ValueError, match="non-positive"):
        smv.get_top_tokens(FakeLogitsProcessor(scale=scale), head, h)


def test_get_top_tokens_added_vocab_falls_back_once(caplog):
    head, h = _setup()
    head.shard_indices.num_added_elements = 4
    lp = FakeLogitsProcessor()
    with caplog.at_level(logging.WARNING, logger="shardmax.integrations.vllm"):
        a = smv.get_top_tokens(lp, head, h)
        b = smv.get_top_tokens(lp, head, h)
    assert bool((a == -7).all()) and bool((b == -7).all())  # the original ran
    assert lp.original_calls == 2
    s = smv.stats()
    assert s["native_argmax"] == 2 and s["sharded_argmax"] == 0
    assert list(s["fallbacks"].values()) == [2]
    assert "added" in next(iter(s["fallbacks"]))


def test_stats_dump(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDMAX_VLLM_STATS_DIR", str(tmp_path))
    head, h = _setup()
    smv.get_top_tokens(FakeLogitsProcessor(), head, h)
    smv.get_top_tokens(FakeLogitsProcessor(), head, h)
    path = tmp_path / f"shardmax-vllm-{os.getpid()}.json"
    data = json.loads(path.read_text())
    assert data["sharded_argmax"] == 2
    assert data["pid"] == os.getpid()


def test_normalize_reason():
    assert (
        smv._normalize_reason("temperature[3]=0.7 != 0 (non-greedy request)")
        == "temperature != 0 (non-greedy request)"
    )


def _batch(num_logits_per_req, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(num_logits_per_req)
    logits = torch.randn(n, vocab, generator=g)
    cu = torch.tensor([0, *torch.tensor(num_logits_per_req).cumsum(0).tolist()], dtype=torch.int32)
    target = logits.argmax(-1)
    draft = torch.randint(0, vocab, (n,), generator=g, dtype=torch.int32)
    # Accept a prefix of drafts: copy the target argmax into the next slot for some rows.
    for r in range(len(num_logits_per_req)):
        s, e = int(cu[r]), int(cu[r + 1])
        for i in range(min(r, e - s - 1)):
            draft[s + i + 1] = target[s + i]
    pos = torch.arange(n, dtype=torch.int64) + 10
    local = torch.cat([torch.arange(k, dtype=torch.int32) for k in num_logits_per_req])
    idx = torch.arange(len(num_logits_per_req), dtype=torch.int32)
    seeds = torch.arange(8, dtype=torch.int64)
    return logits, draft, cu, pos, idx, local, seeds


def test_rejection_sample_sharded_tp1_matches_reference():
    vocab, width, k = 50, 64, 3
    logits, draft, cu, pos, idx, local, seeds = _batch([4, 4, 2, 1, 4], vocab)
    padded = torch.zeros(logits.shape[0], width)
    padded[:, :vocab] = logits
    sampled, num_sampled = smv.rejection_sample_sharded(
        padded,
        None,
        draft,
        cu,
        pos,
        idx,
        idx,
        local,
        torch.zeros(8),
        seeds,
        k,
        vocab_start=0,
        num_valid=vocab,
        group=None,
    )
    ref_sampled, ref_num = reference.rejection_sample_greedy(
        logits, draft, cu, pos, idx, local, seeds, k
    )
    assert torch.equal(num_sampled.to(torch.int64), ref_num.to(torch.int64))
    for r in range(sampled.shape[0]):
        n = int(ref_num[r])
        assert torch.equal(sampled[r, :n], ref_sampled[r, :n])


def test_rejection_sample_sharded_refuses_unsupported_modes():
    vocab, k = 50, 3
    logits, draft, cu, pos, idx, local, seeds = _batch([4], vocab)
    args = (logits, None, draft, cu, pos, idx, idx, local, torch.zeros(8), seeds, k)
    with pytest.raises(ValueError, match="draft logits"):
        smv.rejection_sample_sharded(logits, torch.zeros(1, k, vocab), *args[2:], vocab_start=0)
    with pytest.raises(ValueError, match="block"):
        smv.rejection_sample_sharded(*args, use_block_verification=True, vocab_start=0)
    with pytest.raises(ValueError, match="watermark"):
        smv.rejection_sample_sharded(*args, watermark_key=5, vocab_start=0)
