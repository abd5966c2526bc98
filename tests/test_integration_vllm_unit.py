"""Unit tests of ``shardmax.integrations.vllm`` that run without vLLM.

The hooks' vLLM-facing behaviour is covered end to end by ``tests/e2e_vllm`` (a real 0.32 engine;
the surface test on real 0.32 and 0.33 objects); here: the package imports without vLLM,
``install()`` is inert without ``SHARDMAX_VLLM=1`` and handles the vLLM version both ways (a
fake ``vllm`` package), ``get_top_tokens`` / ``rejection_sample_sharded`` agree with torch on
fake vLLM objects (TP=1; the 0.33 call with its ``fly_*`` arguments, FLy refused), the allow-list
gate names every feature it refuses on stand-in classes, and warm-up steps are counted apart.
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
from hypothesis import given, settings
from hypothesis import strategies as st

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


def test_rejection_sample_sharded_takes_the_033_call_and_refuses_fly():
    """vLLM 0.33's ``rejection_sample`` appends fly_window_size / fly_entropy_threshold /
    fly_entropy_top_k: the 0.33 call fits (window 0 == plain verification), FLy is refused."""
    vocab, k = 50, 3
    logits, draft, cu, pos, idx, local, seeds = _batch([4, 3, 1], vocab)
    args = (logits, None, draft, cu, pos, idx, idx, local, torch.zeros(8), seeds, k)
    base, base_num = smv.rejection_sample_sharded(*args, vocab_start=0, num_valid=vocab)
    # positional, as 0.33's signature orders them (after the 4 watermark arguments)
    got, got_num = smv.rejection_sample_sharded(
        *args, None, False, False, None, None, None, None, 0, 0.3, 3, vocab_start=0,
        num_valid=vocab,
    )  # fmt: skip
    assert torch.equal(got, base) and torch.equal(got_num, base_num)
    got, got_num = smv.rejection_sample_sharded(
        *args, fly_window_size=0, fly_entropy_threshold=0.9, fly_entropy_top_k=5, vocab_start=0,
        num_valid=vocab,
    )  # fmt: skip
    assert torch.equal(got, base) and torch.equal(got_num, base_num)
    with pytest.raises(ValueError, match=r"FLy verification \(fly_window_size=2"):
        smv.rejection_sample_sharded(*args, fly_window_size=2, vocab_start=0)


# --------------------------------------------------------------------------------------------
# version handling
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("v", "parsed", "supported"),
    [
        ("0.32.0", (0, 32, 0), True),
        ("0.32.0+cpu", (0, 32, 0), True),
        ("0.33.0", (0, 33, 0), True),
        ("0.33.2.dev4+g1234", (0, 33, 2), True),
        ("0.31.9", (0, 31, 9), False),
        ("0.34.0rc1", (0, 34, 0), False),
        ("1.0", (1, 0, 0), False),
        ("dev", None, False),
    ],
)
def test_version_parsing(v, parsed, supported):
    from shardmax.integrations.vllm import version

    assert version.parse_version(v) == parsed
    assert version.is_supported(v) is supported
    expect_table = f"{parsed[0]}.{parsed[1]}" if supported else version.SUPPORTED_VLLM_SERIES[-1]
    assert version.table_series(v) == expect_table


def _fake_vllm(monkeypatch, ver: str):
    """A minimal ``vllm`` package in ``sys.modules``: the classes / functions install() patches
    or looks up, and ``__version__ = ver``."""
    import types

    def mod(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)
        parent, _, leaf = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], leaf, m)
        return m

    class LogitsProcessor:
        def get_top_tokens(self, lm_head, hidden_states, embedding_bias=None):
            return "original get_top_tokens"

        def _apply_head(self, lm_head, hidden_states, embedding_bias):
            return hidden_states

    class GPUModelRunner:
        def sample(self, hidden_states, input_batch, grammar_output):
            return "original sample"

    mod("vllm", __version__=ver)
    mod("vllm.model_executor")
    mod("vllm.model_executor.layers")
    mod("vllm.model_executor.layers.logits_processor", LogitsProcessor=LogitsProcessor)
    for name in ("vllm.v1", "vllm.v1.worker", "vllm.v1.worker.gpu", "vllm.v1.worker.gpu.sample"):
        mod(name)
    mod("vllm.v1.worker.gpu.model_runner", GPUModelRunner=GPUModelRunner)
    mod("vllm.v1.worker.gpu.sample.output", SamplerOutput=object)
    mod("vllm.v1.worker.gpu.spec_decode")
    mod(
        "vllm.v1.worker.gpu.spec_decode.rejection_sampler",
        RejectionSampler=object,
        gather_draft_sampled=lambda *a: a,
    )
    return LogitsProcessor, GPUModelRunner


@pytest.fixture
def _plugin_on(monkeypatch):
    monkeypatch.setenv("SHARDMAX_VLLM", "1")
    monkeypatch.delenv("SHARDMAX_VLLM_ALLOW_UNVERIFIED", raising=False)
    yield
    smv.uninstall()


@pytest.mark.parametrize("ver", ["0.32.0", "0.32.3", "0.33.0", "0.33.1"])
def test_install_patches_a_supported_version(monkeypatch, _plugin_on, ver):
    lp, runner = _fake_vllm(monkeypatch, ver)
    orig_sample = runner.sample
    smv.install()
    assert smv.is_installed()
    assert runner.sample is not orig_sample and runner.sample.__wrapped__ is orig_sample
    assert lp.get_top_tokens.__shardmax_hook__
    assert smv.stats()["disabled"] is None
    smv.uninstall()
    assert runner.sample is orig_sample and not smv.is_installed()


@pytest.mark.parametrize("ver", ["0.31.0", "0.34.0", "1.0.0"])
def test_install_refuses_an_unsupported_version_loudly(monkeypatch, _plugin_on, caplog, ver):
    lp, runner = _fake_vllm(monkeypatch, ver)
    orig_sample, orig_gtt = runner.sample, lp.get_top_tokens
    with caplog.at_level(logging.WARNING, logger="shardmax.integrations.vllm"):
        smv.install()
    assert not smv.is_installed()
    assert runner.sample is orig_sample and lp.get_top_tokens is orig_gtt  # nothing patched
    msg = " ".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert f"vLLM {ver} is not a supported version" in msg
    assert "NOT installed" in msg and "SHARDMAX_VLLM_ALLOW_UNVERIFIED=1" in msg
    assert "0.32.x, 0.33.x" in msg
    assert f"vLLM {ver} is not a supported version" in smv.stats()["disabled"]


def test_install_unverified_version_with_override(monkeypatch, _plugin_on, caplog):
    _, runner = _fake_vllm(monkeypatch, "0.34.0")
    monkeypatch.setenv("SHARDMAX_VLLM_ALLOW_UNVERIFIED", "1")
    orig_sample = runner.sample
    with caplog.at_level(logging.WARNING, logger="shardmax.integrations.vllm"):
        smv.install()
    assert smv.is_installed() and runner.sample.__wrapped__ is orig_sample
    msg = " ".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert "vLLM 0.34.0 is not a verified version" in msg
    assert "checked against the tables of vLLM 0.33" in msg
    monkeypatch.setenv("SHARDMAX_VLLM_ALLOW_UNVERIFIED", "0")  # only "1" counts
    smv.uninstall()
    smv.install()
    assert not smv.is_installed()


def test_install_without_version_string_raises(monkeypatch, _plugin_on):
    _fake_vllm(monkeypatch, "0.33.0")
    monkeypatch.setattr(sys.modules["vllm"], "__version__", None)
    with pytest.raises(RuntimeError, match=r"cannot read vLLM's version.*0\.33\.x"):
        smv.install()


# --------------------------------------------------------------------------------------------
# the allow-list gate on stand-ins (real vLLM objects: tests/e2e_vllm/test_vllm_surface.py)
# --------------------------------------------------------------------------------------------

_V = 1000


class RejectionSampler:
    """Stand-in class for vLLM's (the gate compares classes by identity and methods by name)."""

    def __init__(self, sampler, **fields):
        self.sampler = sampler
        self.num_speculative_steps = 3
        self.synthetic_conditional_rates = None
        self.enable_adaptive_verification = False
        self.use_block_verification = False
        self.watermark_key = None
        self.fly_window_size = 0
        self.fly_entropy_threshold = 0.3
        self.fly_entropy_top_k = 3
        self.__dict__.update(fields)

    def __call__(self, logits, input_batch, draft_logits=None, invalid_drafts=None):
        raise AssertionError("never called by the gate")


class Sampler:
    def __init__(self, st, needs, **fields):
        from types import SimpleNamespace

        import numpy as np

        self.sampling_states = st
        self.needs_logits_processing = np.asarray(needs, dtype=bool)
        n = len(self.needs_logits_processing)
        procs = {
            "LogitBiasState": {"use_logit_bias": np.zeros(n, dtype=bool)},
            "PenaltiesState": {"use_penalty": np.zeros(n, dtype=bool)},
            "BadWordsState": {"num_bad_words": SimpleNamespace(np=np.zeros(n, dtype=np.int32))},
        }
        self.logits_processors = [type(k, (), v)() for k, v in procs.items()]
        self.thinking_budget_state = SimpleNamespace(enabled=False)
        self.compute_nans = False
        self.return_sampling_mask = False
        self.use_fp64_gumbel = False
        self.__dict__.update(fields)


class SamplingStates:
    def __init__(self, temps):
        from types import SimpleNamespace

        import numpy as np

        n = len(temps)
        self.temperature = SimpleNamespace(np=np.asarray(temps, dtype=np.float32))
        self.top_k = SimpleNamespace(np=np.full(n, _V, dtype=np.int32))
        self.top_p = SimpleNamespace(np=np.ones(n, dtype=np.float32))
        self.min_p = SimpleNamespace(np=np.zeros(n, dtype=np.float32))
        self.vocab_size = _V

    def max_num_logprobs(self, idx):
        return -1


def _classes(series="0.33"):
    from shardmax.integrations.vllm.gate import VllmClasses

    return VllmClasses(f"{series}.0", series, RejectionSampler, Sampler)


def _standin(temps=(0.0, 0.0), rs_fields=None, sampler_fields=None, spec=None, **runner_fields):
    from types import SimpleNamespace

    import numpy as np

    n = len(temps)
    needs = [t not in (0.0, 1.0) for t in temps]
    sampler = Sampler(SamplingStates(list(temps)), needs, **(sampler_fields or {}))
    rs = RejectionSampler(sampler, **(rs_fields or {}))
    si = SimpleNamespace(org_vocab_start_index=0, org_vocab_end_index=_V // 2, num_added_elements=0)
    model = SimpleNamespace(
        compute_logits_local=lambda h: h, lm_head=SimpleNamespace(shard_indices=si)
    )
    runner = SimpleNamespace(
        rejection_sampler=rs,
        batch_sharder=None,
        model=model,
        speculator=SimpleNamespace(draft_logits=None),
        speculative_config=SimpleNamespace(
            **{
                "rejection_sample_method": "standard",
                "draft_sample_method": "greedy",
                **(spec or {}),
            }
        ),
        adaptive_verification=None,
    )
    runner.__dict__.update(runner_fields)
    batch = SimpleNamespace(
        req_ids=[f"r{i}" for i in range(n)], num_reqs=n, num_draft_tokens=3 * n,
        idx_mapping_np=np.arange(n),
    )  # fmt: skip
    return runner, batch


def _decide(runner, batch, series="0.33", **kw):
    return smv.step_decision(runner, batch, None, classes=_classes(series), **kw)


def test_gate_admits_standard_and_synthetic():
    runner, batch = _standin()
    assert _decide(runner, batch).ok
    runner, batch = _standin(
        rs_fields={"synthetic_conditional_rates": torch.tensor([0.9, 0.8, 0.7])},
        spec={"rejection_sample_method": "synthetic"},
    )
    assert _decide(runner, batch).ok
    runner, batch = _standin(temps=(0.0, 0.8))
    assert not _decide(runner, batch).ok
    assert _decide(runner, batch, allow_temperature=True).ok


@pytest.mark.parametrize(
    ("setup", "reason"),
    [
        (
            {"rs_fields": {"fly_window_size": 3}, "spec": {"rejection_sample_method": "fly"}},
            "rejection_sample_method='fly' not reproduced by shardmax",
        ),
        (  # FLy fields without a config to say so
            {"rs_fields": {"fly_window_size": 3}, "speculative_config": None},
            "rejection_sample_method='fly' not reproduced by shardmax",
        ),
        (  # the config says standard, the sampler's fields say FLy
            {"rs_fields": {"fly_window_size": 2}},
            "rejection_sample_method='standard' but the rejection sampler's fields implement 'fly'",
        ),
        (
            {
                "rs_fields": {"use_block_verification": True},
                "spec": {"rejection_sample_method": "block"},
            },
            "rejection_sample_method='block' not reproduced by shardmax",
        ),
        (
            {"spec": {"rejection_sample_method": "fly2"}},
            "rejection_sample_method='fly2' unknown to shardmax for vLLM 0.33 (known: standard, "
            "synthetic, block, fly)",
        ),
        (
            {"rs_fields": {"enable_adaptive_verification": True}},
            "adaptive verification enabled (RejectionSampler.enable_adaptive_verification=True)",
        ),
        (
            {"adaptive_verification": object()},
            "adaptive verification enabled (runner.adaptive_verification)",
        ),
        (
            {"rs_fields": {"watermark_key": 0}},  # key 0 is a key
            "watermarking enabled (RejectionSampler.watermark_key=0)",
        ),
        (
            {"spec": {"draft_sample_method": "probabilistic"}},
            "draft_sample_method='probabilistic' (rejection sampling against draft logits)",
        ),
        (
            {"speculator": type("S", (), {"draft_logits": torch.zeros(1)})()},
            "draft logits kept (probabilistic drafting)",
        ),
        ({"batch_sharder": object()}, "batch-sharded sampling enabled"),
        (
            {"sampler_fields": {"compute_nans": True}},
            "NaN counting enabled (VLLM_COMPUTE_NANS_IN_LOGITS) (Sampler.compute_nans=True)",
        ),
        (
            {"sampler_fields": {"return_sampling_mask": True}},
            "return_sampling_mask enabled (Sampler.return_sampling_mask=True)",
        ),
        (
            {"rs_fields": {"fly2_window": 4}},
            "unknown RejectionSampler field fly2_window=4 (not in shardmax's table for vLLM 0.33)",
        ),
        (
            {"sampler_fields": {"new_sampler_state": torch.ones(2)}},
            "unknown Sampler field new_sampler_state=<Tensor (2,) torch.float32> (not in "
            "shardmax's table for vLLM 0.33)",
        ),
    ],
)
def test_gate_falls_back_naming_the_feature(setup, reason):
    runner_fields = {
        k: v for k, v in setup.items() if k not in ("rs_fields", "sampler_fields", "spec")
    }
    runner, batch = _standin(
        rs_fields=setup.get("rs_fields"), sampler_fields=setup.get("sampler_fields"),
        spec=setup.get("spec"), **runner_fields,
    )  # fmt: skip
    for allow in (False, True):
        d = _decide(runner, batch, allow_temperature=allow)
        assert not d and d.reason == reason


def test_gate_unknown_field_with_off_value_passes():
    runner, batch = _standin(rs_fields={"future_flag": False, "future_tensor": None})
    assert _decide(runner, batch).ok
    runner, batch = _standin(sampler_fields={"future_count": 0})
    assert _decide(runner, batch).ok


def test_gate_0_32_table_does_not_know_fly_fields():
    """0.32's table has no FLy fields: a 0.33-shaped rejection sampler checked against it falls
    back on the first of them that is not "off"; without them (0.32's shape) the step passes;
    ``fly`` is not a 0.32 method."""
    runner, batch = _standin()
    d = _decide(runner, batch, series="0.32")
    assert d.reason == (
        "unknown RejectionSampler field fly_entropy_threshold=0.3 (not in shardmax's table for "
        "vLLM 0.32)"
    )
    for f in ("fly_window_size", "fly_entropy_threshold", "fly_entropy_top_k"):
        delattr(runner.rejection_sampler, f)
    assert _decide(runner, batch, series="0.32").ok
    runner, batch = _standin(spec={"rejection_sample_method": "fly"})
    d = _decide(runner, batch, series="0.32")
    assert d.reason == (
        "rejection_sample_method='fly' unknown to shardmax for vLLM 0.32 (known: standard, "
        "synthetic, block)"
    )


def test_gate_input_batch_fields_new_in_033():
    runner, batch = _standin()
    batch.pcp = object()
    assert _decide(runner, batch).reason.startswith("PCP rank-local batch (input_batch.pcp set)")
    runner, batch = _standin()
    batch.num_admitted_draft_tokens = object()
    assert _decide(runner, batch).reason.startswith(
        "adaptive verification draft counts in flight (input_batch.num_admitted_draft_tokens)"
    )
    runner, batch = _standin()
    batch.pcp = None
    batch.num_admitted_draft_tokens = None
    assert _decide(runner, batch).ok


def test_gate_refuses_other_classes_unknown_and_patched_methods(monkeypatch):
    runner, batch = _standin()

    class Sub(RejectionSampler):
        pass

    runner.rejection_sampler.__class__ = Sub
    assert _decide(runner, batch).reason == "custom rejection sampler Sub"
    runner, batch = _standin()
    runner.rejection_sampler.sampler.__class__ = type("GPUWatermarkSampler", (Sampler,), {})
    assert _decide(runner, batch).reason == "custom sampler GPUWatermarkSampler"

    runner, batch = _standin()
    monkeypatch.setattr(RejectionSampler, "_verify_fly2", lambda self: None, raising=False)
    assert _decide(runner, batch).reason == (
        "unknown RejectionSampler method _verify_fly2 (not in shardmax's table for vLLM 0.33)"
    )
    monkeypatch.delattr(RejectionSampler, "_verify_fly2")
    assert _decide(runner, batch).ok

    import types

    patched = types.FunctionType(
        (lambda self, *a: None).__code__, {}, "__call__"
    )  # a __call__ defined outside the class's module
    patched.__module__ = "someone.elses.plugin"
    monkeypatch.setattr(RejectionSampler, "__call__", patched)
    assert _decide(runner, batch).reason == (
        "RejectionSampler.__call__ is patched (defined in someone.elses.plugin)"
    )


def test_gate_per_request_rules_still_apply():
    import numpy as np

    runner, batch = _standin(temps=(0.0, 0.8, 0.8))
    st = runner.rejection_sampler.sampler.sampling_states
    st.top_k.np[2] = 5
    d = _decide(runner, batch, allow_temperature=True)
    assert d.reason == f"top_k[2]=5 < vocab_size={_V} (top-k active)"
    runner, batch = _standin()
    runner.rejection_sampler.sampler.needs_logits_processing = np.array([False, True])
    assert _decide(runner, batch).reason == (
        "logits processors active (bias/penalties/bad words/min_tokens)"
    )


def test_warmup_steps_are_counted_apart():
    """vLLM 0.33 runs a greedy spec-decode warm-up (request ids ``_warmup_<i>_``): its steps go
    to ``stats()["warmup"]`` so the serving counts do not depend on the vLLM version."""
    from types import SimpleNamespace

    calls = []

    def native(runner, h, b, g):
        calls.append(b.req_ids)
        return "native"

    runner = SimpleNamespace(rejection_sampler=None)
    warm = SimpleNamespace(req_ids=["_warmup_0_", "_warmup_1_"], num_draft_tokens=0)
    serve = SimpleNamespace(req_ids=["req-a", "_warmup_0_"], num_draft_tokens=0)
    assert smv.maybe_verify_sharded(runner, None, warm, None, native) == "native"
    assert smv.maybe_verify_sharded(runner, None, warm, None, native) == "native"
    assert smv.maybe_verify_sharded(runner, None, serve, None, native) == "native"
    s = smv.stats()
    assert s["plain_sample"] == 1 and s["warmup"]["plain_sample"] == 2
    assert len(calls) == 3
    # the phase holds for the draft argmax of the same step
    head, h = _setup()
    smv.maybe_verify_sharded(runner, None, warm, None, native)
    smv.get_top_tokens(FakeLogitsProcessor(), head, h)
    s = smv.stats()
    assert s["sharded_argmax"] == 0 and s["warmup"]["sharded_argmax"] == 1
    smv.reset_stats()
    assert smv.stats()["warmup"]["plain_sample"] == 0


@pytest.mark.parametrize("what", ["penalties", "logit_bias", "bad_words", "thinking", "custom"])
def test_gate_logits_processors_and_thinking_budget_fall_back(what):
    """A temperature-0.8 request sets ``needs_logits_processing`` through vLLM's temperature
    alone; penalties / logit bias / bad words / a thinking budget / a custom processor on it must
    still send the step to vLLM (the sampled path re-derives the temperature term)."""
    from types import SimpleNamespace

    import numpy as np

    runner, batch = _standin(temps=(0.0, 0.8))
    sampler = runner.rejection_sampler.sampler
    assert _decide(runner, batch, allow_temperature=True).ok
    lb, pen, bw = sampler.logits_processors
    if what == "penalties":
        pen.use_penalty[1] = True
    elif what == "logit_bias":
        lb.use_logit_bias[1] = True
    elif what == "bad_words":
        bw.num_bad_words.np[1] = 2
    elif what == "thinking":
        sampler.thinking_budget_state = SimpleNamespace(
            enabled=True, use_thinking_budget=np.array([False, True])
        )
    else:
        sampler.logits_processors.append(type("MyProcessor", (), {})())
    d = _decide(runner, batch, allow_temperature=True)
    assert d.reason == "logits processors active (bias/penalties/bad words/min_tokens)"


def test_is_off():
    import numpy as np

    from shardmax.integrations.vllm.gate import is_off

    for v in (None, False, 0, 0.0, -0.0, "", b"", (), [], {}, set(), np.int64(0), np.bool_(False)):
        assert is_off(v), v
    for v in (True, 1, -1, 0.3, float("nan"), "standard", (0,), [None], np.float32(0.5),
              np.zeros(1), torch.zeros(()), object()):  # fmt: skip
        assert not is_off(v), v


@pytest.mark.parametrize(
    ("value", "tp1", "tp2"),
    [(None, False, True), ("auto", False, True), ("1", True, True), ("on", True, True),
     ("0", False, False), ("off", False, False)],
)  # fmt: skip
def test_sampled_routing_by_tp(monkeypatch, value, tp1, tp2):
    """Sampled steps shard at TP > 1 by default (at TP 1 there is nothing to gather and vLLM's
    chain measured faster); ``SHARDMAX_VLLM_SAMPLED`` forces either way; other values raise."""
    from shardmax.integrations.vllm import step

    if value is None:
        monkeypatch.delenv(step.ENV_SAMPLED, raising=False)
    else:
        monkeypatch.setenv(step.ENV_SAMPLED, value)
    assert step.sampled_routing(1) is tp1 and step.sampled_routing(2) is tp2


def _topp_runner(top_k: int, min_p: float, top_p: float, dtype: torch.dtype):
    """A stand-in runner / batch with vLLM's per-slot sampling arrays (V = 100, 2 requests)."""
    from types import SimpleNamespace as NS

    import numpy as np

    st = NS(
        vocab_size=100,
        top_k=NS(np=np.array([100, top_k, 100])),
        top_p=NS(np=np.array([1.0, top_p, 0.95])),
        min_p=NS(np=np.array([0.0, min_p, 0.0])),
    )
    runner = NS(rejection_sampler=NS(sampler=NS(sampling_states=st)), dtype=dtype)
    return runner, NS(idx_mapping_np=np.array([1, 2]), cu_num_logits_np=np.array([0, 4, 8]))


@pytest.mark.parametrize(
    ("value", "top_k", "min_p", "dtype", "routed"),
    [(None, 100, 0.0, torch.bfloat16, True), (None, 20, 0.0, torch.bfloat16, False),
     ("0", 100, 0.0, torch.bfloat16, False), ("auto", 100, 0.0, torch.bfloat16, True),
     ("auto", 100, 0.0, torch.float16, True), ("auto", 100, 0.0, torch.float32, False),
     ("auto", 20, 0.0, torch.bfloat16, False), ("auto", 100, 0.05, torch.bfloat16, False),
     ("1", 20, 0.05, torch.float32, True), ("off", 100, 0.0, torch.bfloat16, False)],
)  # fmt: skip
def test_nucleus_routing(monkeypatch, value, top_k, min_p, dtype, routed):
    """``SHARDMAX_VLLM_NUCLEUS``: ``auto`` by default (measured cost) routes bf16 / fp16 steps
    whose only truncation is top-p (the level-histogram path); ``1`` every such step; ``0``
    none."""
    from shardmax.integrations.vllm import step

    monkeypatch.delenv(step.ENV_TOPP, raising=False)
    if value is None:
        monkeypatch.delenv(step.ENV_NUCLEUS, raising=False)
    else:
        monkeypatch.setenv(step.ENV_NUCLEUS, value)
    runner, batch = _topp_runner(top_k, min_p, 0.9, dtype)
    assert step.nucleus_routing(runner, batch) is routed
    if value == "auto" and routed:
        monkeypatch.setenv(step.ENV_TOPP, "candidates")  # auto routes the histogram path only
        assert step.nucleus_routing(runner, batch) is False
        monkeypatch.setenv(step.ENV_TOPP, "sometimes")
        with pytest.raises(ValueError, match="SHARDMAX_VLLM_TOPP='sometimes'"):
            step.nucleus_routing(runner, batch)
    monkeypatch.setenv(step.ENV_NUCLEUS, "maybe")
    with pytest.raises(ValueError, match="SHARDMAX_VLLM_NUCLEUS='maybe'"):
        step.nucleus_routing(runner, batch)


@pytest.mark.parametrize(
    ("sampled", "top_k", "dtype", "fold", "resolver", "topp", "routed"),
    [(None, 100, torch.bfloat16, True, True, None, True),
     ("auto", 100, torch.float16, True, True, None, True),
     (None, 100, torch.bfloat16, False, True, None, False),  # no device fallback (CPU, ...)
     (None, 100, torch.bfloat16, True, False, None, False),  # no resolver
     (None, 20, torch.bfloat16, True, True, None, False),  # top-k too: the candidate path
     (None, 100, torch.float32, True, True, None, False),
     (None, 100, torch.bfloat16, True, True, "candidates", False),
     ("1", 100, torch.bfloat16, True, True, None, False),  # sampled_routing's already
     ("0", 100, torch.bfloat16, True, True, None, False)],
)  # fmt: skip
def test_topp_fold_routing_at_tp1(monkeypatch, sampled, top_k, dtype, fold, resolver, topp,
                                  routed):  # fmt: skip
    """``auto`` takes a TP-1 step when its only truncation is top-p, the model is bf16 / fp16,
    the level-histogram path is on, the step fits one vLLM chunk and the folded device fallback
    decides its flags (no host read); never otherwise (CPU engines: no fallback)."""
    import numpy as np

    from shardmax.integrations.vllm import step
    from shardmax.ops.sampled import max_chunk_rows

    for name, value in ((step.ENV_SAMPLED, sampled), (step.ENV_TOPP, topp)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    monkeypatch.delenv(step.ENV_NUCLEUS, raising=False)
    monkeypatch.setattr(step, "resolver", lambda: object() if resolver else None)
    monkeypatch.setattr(step, "device_fallback", lambda device: object() if fold else None)
    runner, batch = _topp_runner(top_k, 0.0, 0.9, dtype)
    assert step.topp_fold_routing(runner, batch, torch.device("cpu")) is routed
    runner, batch = _topp_runner(100, 0.0, 1.0, dtype)
    batch.idx_mapping_np = batch.idx_mapping_np[:1]  # no top-p in the step: never
    assert step.topp_fold_routing(runner, batch, torch.device("cpu")) is False
    runner, batch = _topp_runner(top_k, 0.0, 0.9, dtype)
    batch.cu_num_logits_np = np.array([0, 4, 4 + max_chunk_rows(100)])  # more than one chunk
    assert step.topp_fold_routing(runner, batch, torch.device("cpu")) is False
    runner, batch = _topp_runner(top_k, 0.0, 0.9, dtype)
    runner.rejection_sampler.synthetic_conditional_rates = torch.ones(4)  # the fold refuses it
    assert step.topp_fold_routing(runner, batch, torch.device("cpu")) is False


def test_sampled_routing_rejects_other_values(monkeypatch):
    from shardmax.integrations.vllm import step

    monkeypatch.setenv(step.ENV_SAMPLED, "sometimes")
    with pytest.raises(ValueError, match="SHARDMAX_VLLM_SAMPLED='sometimes'"):
        step.sampled_routing(2)


@pytest.mark.parametrize(
    ("value", "tp1", "tp2"),
    [(None, True, True), ("auto", True, True), ("1", True, True), ("yes", True, True),
     ("0", False, False), ("off", False, False)],
)  # fmt: skip
def test_graph_replay_by_tp_and_device(monkeypatch, value, tp1, tp2):
    """Steps replay their plan's CUDA graphs on CUDA devices at every TP by default (at TP > 1
    split at the collectives, which run eagerly); ``SHARDMAX_VLLM_GRAPHS=0`` turns it off;
    never on the CPU (no graphs there)."""
    from shardmax.integrations.vllm import step

    if value is None:
        monkeypatch.delenv(step.ENV_GRAPHS, raising=False)
    else:
        monkeypatch.setenv(step.ENV_GRAPHS, value)
    cuda = torch.device("cuda", 0)
    assert step.graph_replay(1, cuda) is tp1 and step.graph_replay(2, cuda) is tp2
    assert not step.graph_replay(1, torch.device("cpu"))


def test_graph_replay_rejects_other_values(monkeypatch):
    from shardmax.integrations.vllm import step

    monkeypatch.setenv(step.ENV_GRAPHS, "sometimes")
    with pytest.raises(ValueError, match="SHARDMAX_VLLM_GRAPHS='sometimes'"):
        step.graph_replay(1, torch.device("cuda", 0))


def test_gate_checks_slotted_fields_and_refuses_unreadable_ones():
    """A field the table does not know is refused on an object without ``__dict__`` too (a
    ``slots=True`` dataclass, a private slot stored mangled); an object with neither
    ``__dict__`` nor ``__slots__`` cannot be checked, so it is refused, never passed."""
    import dataclasses

    from shardmax.integrations.vllm import gate

    table = {"known": gate.Rule("a known switch", gate.is_off)}

    @dataclasses.dataclass(slots=True)
    class Slotted:
        known: int = 0
        future_switch: int = 0

    assert gate.check_fields(Slotted(), "X", table, "0.33") is None
    assert gate.check_fields(Slotted(future_switch=2), "X", table, "0.33") == (
        "unknown X field future_switch=2 (not in shardmax's table for vLLM 0.33)"
    )
    assert gate.check_fields(Slotted(known=1), "X", table, "0.33") == ("a known switch (X.known=1)")

    class Private:
        __slots__ = ("__mode", "known")

        def __init__(self, mode: int) -> None:
            self.__mode, self.known = mode, 0

    assert gate.check_fields(Private(0), "X", table, "0.33") is None
    assert gate.check_fields(Private(3), "X", table, "0.33") == (
        "unknown X field _Private__mode=3 (not in shardmax's table for vLLM 0.33)"
    )
    assert gate.check_fields(object(), "X", table, "0.33") == (
        "X fields unreadable (object has neither __dict__ nor __slots__; shardmax's table for "
        "vLLM 0.33 cannot be checked)"
    )


def test_gate_refuses_a_class_with_base_classes():
    """Only a class's own methods are walked: a base class (whose methods could be patched or
    new) is outside the table, so the class is refused."""
    from shardmax.integrations.vllm import gate

    class Base:
        def _verify(self) -> None: ...

    class Derived(Base):
        pass

    assert gate.check_methods(Derived, "RejectionSampler", ("_verify",), "0.33") == (
        "RejectionSampler inherits from "
        "test_gate_refuses_a_class_with_base_classes.<locals>.Base (not in shardmax's table "
        "for vLLM 0.33: only its own methods are checked)"
    )
    assert gate.check_methods(Base, "RejectionSampler", ("_verify",), "0.33") is None


@settings(max_examples=300)
@given(
    data=st.data(),
    n=st.integers(0, 6),
)
def test_step_requests_answer_as_the_numpy_expressions(data, n):
    """``StepRequests`` (``list.count`` on the values, read once per step) gives what the NumPy
    expressions it replaces give, on NaN, -0.0, inf and disabled values, through an
    ``idx_mapping`` that skips slots."""
    from types import SimpleNamespace

    import numpy as np

    odd = [0.0, -0.0, 1.0, 0.5, float("nan"), float("inf"), 1e-45]
    slots = 8
    floats = st.lists(st.sampled_from(odd), min_size=slots, max_size=slots)
    ks = st.lists(st.sampled_from([0, 1, 5, _V - 1, _V, _V + 1]), min_size=slots, max_size=slots)
    t = np.array(data.draw(floats), dtype=np.float32)
    k = np.array(data.draw(ks), dtype=np.int32)
    p = np.array(data.draw(floats), dtype=np.float32)
    m = np.array(data.draw(floats), dtype=np.float32)
    idx = np.array(data.draw(st.lists(st.integers(0, slots - 1), min_size=n, max_size=n)), np.int32)
    from shardmax.integrations.vllm import step

    ns = SimpleNamespace
    states = ns(temperature=ns(np=t), top_k=ns(np=k), top_p=ns(np=p), min_p=ns(np=m), vocab_size=_V)
    runner = ns(rejection_sampler=ns(sampler=ns(sampling_states=states)))
    got = step.StepRequests(runner, ns(idx_mapping_np=idx))
    assert got.all_greedy == bool(np.all(t[idx] == 0.0))
    assert got.has_nucleus == bool(
        np.any(k[idx] != _V) or np.any(p[idx] != 1.0) or np.any(m[idx] != 0.0)
    )
    assert got.topp_only == bool(
        np.any(p[idx] != 1.0) and np.all(k[idx] == _V) and np.all(m[idx] == 0.0)
    )


def test_env_read_follows_every_change_to_os_environ(monkeypatch):
    """The plug-in's per-step reads of its variables (``env.read``: a dict lookup instead of
    ``os.environ.get``'s ~1.2 us) give what ``os.environ.get`` gives, normalised, after every
    change -- set, changed, emptied, set to the same value again, unset -- through the fast
    lookup and through the public fallback, and with ``os.environ`` replaced by a dict."""
    from shardmax.integrations.vllm import env

    name = "SHARDMAX_TEST_ENV_READ"
    monkeypatch.delenv(name, raising=False)
    for value in (None, " On ", "", "0", "0", "1", "Histogram", None, "x" * 300, "ünï"):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        want = (os.environ.get(name) or "").strip().lower() or "auto"
        assert env.read(name, "auto") == want, value
        assert env.read(name, "") == (os.environ.get(name) or "").strip().lower(), value
        with pytest.MonkeyPatch.context() as m:
            m.setattr(env, "_DATA", None)
            assert env.read(name, "auto") == want, value
    with pytest.MonkeyPatch.context() as m:  # os.environ replaced by another mapping
        m.setattr(os, "environ", {name: " Off "})
        assert env.read(name, "auto") == "off"
