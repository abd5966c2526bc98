"""Property-based fuzzing of every public op against the plain-torch references (Hypothesis).

Drawn: dtype (bf16 / fp16 / fp32), vocabulary (1, 2, 63, 65, odd and real-model sizes), TP 1-8
(emulated ranks, vLLM's padded layout: padding columns hold values that would win if read), the
rows' content (LM-like peaked rows, random normal, ties planted inside blocks, at block and
shard edges and across shards, +-0, +-inf, NaN, all -inf rows), strided views of the logits
and of every batch tensor, and random verification batches (drafts often right, placeholders,
chunked prefill, synthetic acceptance; sampled steps mix greedy, temperature, top-k, top-p and
min-p requests). Every op must return the reference's ids / tokens / counts exactly (sampled:
on every request it did not flag), or raise a documented clear error -- never anything else.

Examples per op: ``SHARDMAX_FUZZ_EXAMPLES`` (default 20) times the op's weight: 100 argmax, 50
greedy and 10 + 10 sampled examples in CI (the interpreter runs a sampled step's ten launches
program by program); the derandomized corpus is the same every run (``tests/conftest.py``).
A soak run: ``SHARDMAX_FUZZ_RANDOM=1 SHARDMAX_FUZZ_EXAMPLES=2000 pytest tests/test_fuzz.py``.
The same corpus runs on a GPU (``scripts/gpu_checks.sh``: this file under compute-sanitizer,
value checks off, via ``SHARDMAX_FUZZ_VALUE_CHECKS=0``).
"""

from __future__ import annotations

import os

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import shardmax  # noqa: E402
from shardmax import reference  # noqa: E402
from shardmax.reference.sampled import verify_sampled  # noqa: E402
from shardmax.testing import (  # noqa: E402
    emulate_greedy_verify,
    emulate_verify,
    emulate_vocab_parallel_argmax,
    random_verify_batch,
)

EXAMPLES = int(os.environ.get("SHARDMAX_FUZZ_EXAMPLES", "20"))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def fuzz(weight: float):  # type: ignore[no-untyped-def]
    """Hypothesis settings of one op: ``weight * SHARDMAX_FUZZ_EXAMPLES`` examples (the ops cost
    very different times in the interpreter: the argmax one launch, a sampled step up to ten)."""
    return settings(FUZZ, max_examples=max(1, int(weight * EXAMPLES)))


FUZZ = settings(
    max_examples=EXAMPLES,
    # derandomized, no database, no deadline: conftest's profile (SHARDMAX_FUZZ_RANDOM=1 draws)
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    # CI never spends minutes shrinking a failure (the printed example is the drawn one);
    # SHARDMAX_FUZZ_SHRINK=1 shrinks it to a minimal one
    phases=None
    if os.environ.get("SHARDMAX_FUZZ_SHRINK") == "1"
    else [hypothesis.Phase.explicit, hypothesis.Phase.reuse, hypothesis.Phase.generate],
)

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SMALL_VOCABS = (1, 2, 3, 63, 64, 65, 127, 129, 255, 1000, 1031, 2048, 4097)
REAL_VOCABS = (50257, 128256, 151936, 200064, 262144)


@st.composite
def vocab_tp(draw: st.DrawFn, real: bool = True) -> tuple[int, int]:
    """A vocabulary (a real model's one time in ten when ``real``) and a TP size 1-8 (the
    emulator pads the way a deployment must for it: :func:`default_pad_to`)."""
    pool = REAL_VOCABS if real and draw(st.integers(0, 9)) == 0 else SMALL_VOCABS
    return draw(st.sampled_from(pool)), draw(st.integers(1, 8))


def _plant(draw: st.DrawFn, x: torch.Tensor, tp: int, nan: bool = True) -> torch.Tensor:
    """Plant the cases of the module docstring in some rows (in fp32, before the dtype cast);
    ``nan=False`` leaves NaN out (the top-p / min-p reference refuses NaN rows: vLLM's search
    is undefined there, and the sharded op flags them)."""
    rows, vocab = x.shape
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))  # the example, not the run
    edges = sorted({0, vocab - 1, *(min(vocab - 1, e) for e in (1023, 1024, 8191, 8192))})
    shard = -(-vocab // tp)
    edges += [min(vocab - 1, shard * r + d) for r in range(1, tp) for d in (-1, 0)]
    for r in range(rows):
        cases = ("peak", "normal", "tie", "signed_zero", "inf", "all_neginf", "flat")
        case = draw(st.sampled_from((*cases, "nan") if nan else cases))
        if case == "peak":  # LM-like: one clear winner and a short tail
            ids = torch.randperm(vocab, generator=g)[: min(vocab, 8)]
            x[r] = -10.0 + torch.randn(vocab, generator=g) * 0.5
            x[r, ids] = torch.linspace(12.0, 6.0, ids.shape[0])
        elif case == "tie":
            a, b = draw(st.sampled_from(edges)), draw(st.sampled_from(edges))
            x[r, a] = x[r, b] = 20.0
        elif case == "signed_zero":
            x[r] = -1.0 - x[r].abs()
            x[r, draw(st.sampled_from(edges))] = -0.0
            x[r, draw(st.sampled_from(edges))] = 0.0
        elif case == "inf":
            x[r, draw(st.sampled_from(edges))] = float(draw(st.sampled_from((1, -1)))) * float(
                "inf"
            )
        elif case == "nan":
            x[r, draw(st.sampled_from(edges))] = float("nan")
        elif case == "all_neginf":
            x[r] = float("-inf")
        elif case == "flat":
            x[r] = 0.25
    return x


@st.composite
def logits(draw: st.DrawFn, real: bool = True, max_rows: int = 5) -> tuple[torch.Tensor, int]:
    vocab, tp = draw(vocab_tp(real))
    rows = draw(st.integers(0 if vocab < 1000 else 1, 2 if vocab > 5000 else max_rows))
    dtype = draw(st.sampled_from(DTYPES))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(rows, vocab, generator=g) * 3.0
    x = _plant(draw, x, tp).to(dtype)
    if draw(st.booleans()):  # a strided view: row stride > vocab, the extra columns would win
        wide = torch.full((rows, vocab + draw(st.integers(1, 40))), 99.0, dtype=dtype)
        wide[:, :vocab] = x
        x = wide[:, :vocab]
    return x.to(DEVICE), tp


def _strided(t: torch.Tensor) -> torch.Tensor:
    big = torch.full((2 * t.shape[0],), 7, dtype=t.dtype, device=t.device)
    big[::2] = t
    return big[::2]


def test_every_property_test_draws_the_same_examples_every_run() -> None:
    """conftest's profile is the default every ``@settings(...)`` of the suite starts from (as
    ``settings(max_examples=3)`` here does): a CI failure reproduces on the next run."""
    random = os.environ.get("SHARDMAX_FUZZ_RANDOM") == "1"
    for s in (settings.default, FUZZ, settings(max_examples=3)):
        assert s.derandomize is not random and s.database is None and s.deadline is None


def test_every_test_starts_the_global_generator_from_its_own_seed(
    request: pytest.FixtureRequest,
) -> None:
    """conftest seeds torch's global generator from the test's node id before each test."""
    import hashlib

    want = int.from_bytes(hashlib.sha256(request.node.nodeid.encode()).digest()[:8], "big")
    assert torch.initial_seed() == want
    torch.manual_seed(0)  # what test_argmax / test_verify do: the next test starts afresh


@fuzz(5)
@given(logits())
def test_fuzz_argmax(case: tuple[torch.Tensor, int]) -> None:
    x, tp = case
    want = reference.argmax(x)
    assert torch.equal(shardmax.vocab_parallel_argmax(x, vocab_start=0), want)
    assert torch.equal(emulate_vocab_parallel_argmax(x, tp), want)


def _on_device(b):  # type: ignore[no-untyped-def]
    """The batch's tensors on the test device (the references draw vLLM's random numbers with
    Triton: on a GPU machine CPU tensors would need the interpreter)."""
    import dataclasses

    moved = {f.name: getattr(b, f.name).to(DEVICE) for f in dataclasses.fields(b)
             if isinstance(getattr(b, f.name), torch.Tensor)}  # fmt: skip
    return dataclasses.replace(b, **moved)


def _batch(draw: st.DrawFn, vocab: int, dtype: torch.dtype, synthetic: bool, nan: bool = True):
    k = draw(st.sampled_from((1, 3, 5)))
    reqs = draw(st.integers(0, 3))
    b = random_verify_batch(
        reqs, k, vocab, seed=draw(st.integers(0, 2**31 - 1)), dtype=dtype, synthetic=synthetic,
        accept_prob=draw(st.sampled_from((0.3, 0.9))), prefill_prob=0.15,
    )  # fmt: skip
    x = b.logits.float()
    b.logits = _plant(draw, x, 1, nan).to(dtype)
    return _on_device(b)


def _maybe_strided(draw: st.DrawFn, args: list, kwargs: dict) -> tuple[list, dict]:
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.numel() and draw(st.integers(0, 3)) == 0:
            args[i] = _strided(a)
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor) and v.numel() and draw(st.integers(0, 3)) == 0:
            kwargs[k] = _strided(v)
    return args, kwargs


@fuzz(2.5)
@given(st.data())
def test_fuzz_greedy_verify(data: st.DataObject) -> None:
    vocab, tp = data.draw(vocab_tp(real=False))
    dtype = data.draw(st.sampled_from(DTYPES))
    b = _batch(data.draw, vocab, dtype, synthetic=data.draw(st.booleans()))
    want = b.reference()
    args, kwargs = _maybe_strided(data.draw, list(b.args()), dict(b.kwargs()))
    got = shardmax.sharded_greedy_verify(b.logits.to(DEVICE), *_dev(args), vocab_start=0,
                                         **_dev(kwargs))  # fmt: skip
    emu = emulate_greedy_verify(b.logits.to(DEVICE), tp, *_dev(args), **_dev(kwargs))
    for g, e, w in zip(got, emu, want, strict=True):
        assert torch.equal(g, w) and torch.equal(e, w)


def _dev(x):
    if isinstance(x, dict):
        return {k: _dev(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_dev(v) for v in x]
    return x.to(DEVICE) if isinstance(x, torch.Tensor) else x


@fuzz(0.5)
@given(st.data())
@pytest.mark.parametrize("mode", ["fast", "strict"])
def test_fuzz_sampled_verify(mode: str, data: st.DataObject) -> None:
    vocab, tp = data.draw(vocab_tp(real=False))
    dtype = data.draw(st.sampled_from(DTYPES))
    candidates = data.draw(st.booleans())
    b = _batch(data.draw, vocab, dtype, data.draw(st.integers(0, 4)) == 0, nan=not candidates)
    n = b.max_num_reqs
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    temp = torch.tensor([0.0, 0.6, 1.0, 1.7])[torch.randint(0, 4, (n,), generator=g)].to(DEVICE)
    kw = dict(b.kwargs())
    if candidates:
        kw["top_k"] = torch.tensor([0, 1, 5, 63, 64])[torch.randint(0, 5, (n,), generator=g)].to(
            DEVICE
        )
        kw["top_p"] = torch.tensor([1.0, 0.5, 0.95], dtype=torch.float64)[
            torch.randint(0, 3, (n,), generator=g)
        ]
        kw["min_p"] = torch.tensor([0.0, 0.1])[torch.randint(0, 2, (n,), generator=g)]
    kw = _dev(kw)
    fp64 = data.draw(st.integers(0, 3)) == 0
    a = list(b.args())
    want = verify_sampled(b.logits, *a[:5], temp, *a[5:], use_fp64_gumbel=fp64, **kw)
    args, kwargs = _maybe_strided(data.draw, [*a[:5], temp, *a[5:]], kw)
    args, kwargs = _dev(args), _dev(kwargs)
    x = b.logits.to(DEVICE)
    processed = None
    if mode == "strict" and b.max_num_reqs:
        from shardmax.ops.sampled import chunk_needs_processing

        processed = chunk_needs_processing(
            b.idx_mapping, temp, vocab, kw.get("top_k"), kw.get("top_p"), kw.get("min_p")
        )
    outs = [
        shardmax.sharded_verify(
            x,
            *args,
            vocab_start=0,
            mode=mode,
            use_fp64_gumbel=fp64,
            logits_processed=processed,
            **kwargs,
        ),
        emulate_verify(
            x,
            tp,
            *args,
            mode=mode,
            use_fp64_gumbel=fp64,
            record_splits=data.draw(st.sampled_from((1, 2, 3))),
            logits_processed=processed,
            **kwargs,
        ),
    ]
    for res in outs:
        keep = ~res.fallback.cpu()
        for got, w in zip(res[:3], want, strict=True):
            assert torch.equal(got.cpu()[keep], w.cpu()[keep])
        assert bool(((res.reason.cpu() == 0) == keep).all())


@pytest.fixture(autouse=True)
def _value_checks_knob():
    """``SHARDMAX_FUZZ_VALUE_CHECKS=0``: the ops run without their syncing value checks (the
    plug-in's mode), so a sanitizer run sees the kernels exactly as an engine launches them."""
    from shardmax.runtime.validation import value_checks

    with value_checks(os.environ.get("SHARDMAX_FUZZ_VALUE_CHECKS", "1") != "0"):
        yield
