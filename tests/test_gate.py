"""Per-step gate (shardmax.gate.can_shard_verify), spec §5."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardmax.gate import ShardDecision, can_shard_verify

GREEDY = [0.0, 0.0, 0.0]


def test_greedy_batch_is_ok():
    d = can_shard_verify(temperatures=GREEDY)
    assert d == ShardDecision(True, None)
    assert bool(d) is True
    full = can_shard_verify(
        temperatures=GREEDY,
        top_k=[-1, 0, 32000],
        top_p=[1.0, 1.0, 1.0],
        min_p=[0.0, 0.0, 0.0],
        vocab_size=32000,
        num_draft_tokens=5,
    )
    assert full.ok and full.reason is None


def test_empty_request_lists_are_ok():
    assert can_shard_verify(temperatures=[], top_k=[], top_p=[], min_p=[])


def test_decision_is_frozen_and_falsy_when_rejected():
    d = can_shard_verify(temperatures=[0.7])
    assert not d and d.ok is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.ok = True  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"temperatures": [0.0, 0.0, 0.0, 0.7]}, "temperature[3]=0.7 != 0 (non-greedy request)"),
        ({"temperatures": [1e-6]}, "temperature[0]=1e-06 != 0 (non-greedy request)"),
        ({"temperatures": [float("nan")]}, "temperature[0]=nan != 0 (non-greedy request)"),
        (
            {"temperatures": GREEDY, "top_k": [-1, 50, 0], "vocab_size": 32000},
            "top_k[1]=50 < vocab_size=32000 (top-k active)",
        ),
        (
            {"temperatures": GREEDY, "top_k": [32000]},
            "top_k[0]=32000 < vocab_size=unknown (top-k active)",
        ),
        ({"temperatures": GREEDY, "top_p": [1.0, 0.9]}, "top_p[1]=0.9 != 1 (top-p active)"),
        ({"temperatures": GREEDY, "min_p": [0.0, 0.0, 0.05]}, "min_p[2]=0.05 != 0 (min-p active)"),
        (
            {"temperatures": GREEDY, "has_logits_processors": True},
            "logits processors active (bias/penalties/bad words/min_tokens)",
        ),
        ({"temperatures": GREEDY, "returns_logprobs": True}, "logprobs requested"),
        (
            {"temperatures": GREEDY, "has_structured_output": True},
            "structured output (grammar bitmask)",
        ),
        (
            {"temperatures": GREEDY, "has_draft_logits": True},
            "draft logits kept (probabilistic drafting)",
        ),
        ({"temperatures": GREEDY, "adaptive_verification": True}, "adaptive verification enabled"),
        ({"temperatures": GREEDY, "block_verification": True}, "block verification enabled"),
        ({"temperatures": GREEDY, "watermark": True}, "watermarking enabled"),
        (
            {"temperatures": GREEDY, "compute_nans": True},
            "NaN counting enabled (VLLM_COMPUTE_NANS_IN_LOGITS)",
        ),
        ({"temperatures": GREEDY, "return_sampling_mask": True}, "return_sampling_mask enabled"),
        (
            {"temperatures": GREEDY, "num_draft_tokens": 0},
            "num_draft_tokens=0 <= 0 (no drafts: plain sampler)",
        ),
    ],
)
def test_reasons(kwargs, reason):
    d = can_shard_verify(**kwargs)
    assert not d
    assert d.reason == reason


def test_first_failing_condition_is_reported():
    d = can_shard_verify(
        temperatures=[0.0, 1.0],
        top_p=[0.5, 0.5],
        watermark=True,
        num_draft_tokens=0,
    )
    assert d.reason == "temperature[1]=1.0 != 0 (non-greedy request)"
    d = can_shard_verify(temperatures=GREEDY, returns_logprobs=True, watermark=True)
    assert d.reason == "logprobs requested"


def test_allow_temperature_accepts_sampled_rows():
    temps = [0.0, 0.8, 1.0, 1e-6, 2.5]
    assert not can_shard_verify(temperatures=temps)  # default unchanged: greedy only
    d = can_shard_verify(
        temperatures=temps,
        top_k=[-1, 0, 32000, 32000, 32000],
        top_p=[1.0] * 5,
        min_p=[0.0] * 5,
        vocab_size=32000,
        num_draft_tokens=3,
        allow_temperature=True,
    )
    assert d == ShardDecision(True, None)
    assert can_shard_verify(temperatures=GREEDY, allow_temperature=True)


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"temperatures": [0.5, float("nan")]}, "temperature[1]=nan is not a finite value >= 0"),
        ({"temperatures": [float("inf")]}, "temperature[0]=inf is not a finite value >= 0"),
        ({"temperatures": [0.0, -0.5]}, "temperature[1]=-0.5 is not a finite value >= 0"),
        (
            {"temperatures": [0.8, 0.8], "top_k": [-1, 5], "vocab_size": 32000},
            "top_k[1]=5 < vocab_size=32000 (top-k active)",
        ),
        ({"temperatures": [0.8], "top_p": [0.9]}, "top_p[0]=0.9 != 1 (top-p active)"),
        ({"temperatures": [0.8], "min_p": [0.1]}, "min_p[0]=0.1 != 0 (min-p active)"),
        (
            {"temperatures": [0.8], "has_logits_processors": True},
            "logits processors active (bias/penalties/bad words/min_tokens)",
        ),
        ({"temperatures": [0.8], "returns_logprobs": True}, "logprobs requested"),
        (
            {"temperatures": [0.8], "has_draft_logits": True},
            "draft logits kept (probabilistic drafting)",
        ),
        ({"temperatures": [0.8], "watermark": True}, "watermarking enabled"),
        (
            {"temperatures": [0.8], "num_draft_tokens": 0},
            "num_draft_tokens=0 <= 0 (no drafts: plain sampler)",
        ),
    ],
)
def test_allow_temperature_keeps_other_rules(kwargs, reason):
    d = can_shard_verify(allow_temperature=True, **kwargs)
    assert not d
    assert d.reason == reason


def test_allow_top_k_admits_candidates_sized_k():
    from shardmax.ops.sampled import TOPK_CANDIDATES

    temps = [0.0, 0.7, 1.0]
    ks = [5000, 20, TOPK_CANDIDATES - 1]  # a top-k on a greedy request is ignored
    assert not can_shard_verify(temperatures=temps, top_k=ks, vocab_size=32000,
                                allow_temperature=True)  # fmt: skip
    assert can_shard_verify(
        temperatures=temps, top_k=ks, vocab_size=32000, allow_temperature=True, allow_top_k=True
    )
    d = can_shard_verify(
        temperatures=[0.7], top_k=[TOPK_CANDIDATES], vocab_size=32000, allow_temperature=True,
        allow_top_k=True,
    )  # fmt: skip
    assert not d and d.reason == (
        f"top_k[0]={TOPK_CANDIDATES} >= {TOPK_CANDIDATES} (more than the fast mode's top-k "
        "candidates)"
    )
    # top-p / min-p still refused
    d = can_shard_verify(temperatures=[0.7], top_k=[20], top_p=[0.9], vocab_size=32000,
                         allow_temperature=True, allow_top_k=True)  # fmt: skip
    assert not d and "top-p active" in str(d.reason)
    with pytest.raises(ValueError, match="allow_top_k"):
        can_shard_verify(temperatures=[0.7], allow_top_k=True)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"top_k": [-1, float("nan")]}, r"top_k\[1\]=nan"),
        ({"top_k": [float("nan")], "vocab_size": 32000}, r"top_k\[0\]=nan"),
        ({"top_p": [1.0, 1.0, float("nan")]}, r"top_p\[2\]=nan"),
        ({"min_p": [float("nan")]}, r"min_p\[0\]=nan"),
    ],
)
@pytest.mark.parametrize("allow_temperature", [False, True])
def test_nan_sampling_parameter_raises(kwargs, name, allow_temperature):
    """Regression: ``top_k=[nan]`` answered ok (``nan > 0`` is False, so it read as "disabled").
    A NaN top-k / top-p / min-p is refused with a ValueError naming the argument and index."""
    with pytest.raises(ValueError, match=name + ": NaN is not a valid"):
        can_shard_verify(temperatures=[0.0] * 3, allow_temperature=allow_temperature, **kwargs)


def test_nan_numpy_values_raise_too():
    np = pytest.importorskip("numpy")
    with pytest.raises(ValueError, match=r"top_k\[0\]=nan"):
        can_shard_verify(temperatures=[0.0], top_k=[np.float32("nan")])
    with pytest.raises(ValueError, match=r"top_p\[0\]=nan"):
        can_shard_verify(temperatures=[0.0], top_p=np.asarray([np.nan], dtype=np.float32).tolist())


def test_nan_temperature_stays_a_refusal_reason():
    """vLLM's API does not refuse a NaN temperature (``nan < 0`` is False): the gate must send
    such a step to vLLM's own path, not raise."""
    assert can_shard_verify(temperatures=[float("nan")]).reason == (
        "temperature[0]=nan != 0 (non-greedy request)"
    )
    assert can_shard_verify(temperatures=[float("nan")], allow_temperature=True).reason == (
        "temperature[0]=nan is not a finite value >= 0"
    )


_ODD = [-0.0, 0.5, 0.95, 1e-45, 2.0, -1.0, float("inf"), float("-inf"), float("nan")]


def _mostly(value, odd):
    """``value`` most of the time (a rule that passes), else one of ``odd``: the vectorised pass
    then decides often, on steps one value away from failing."""
    return st.one_of(st.just(value), st.just(value), st.just(value), st.sampled_from(odd))


_KS = [-1, 0, 1, 5, 63, 64, 100, 999, 1000, 1001]


@settings(max_examples=400)
@given(
    data=st.data(),
    n=st.integers(0, 5),
    allow=st.sampled_from(
        [(False, False, False), (True, False, False), (True, True, False), (True, False, True)]
    ),
    dtype=st.sampled_from(["float32", "float64"]),
    vocab=st.sampled_from([None, 1000]),
)
def test_numpy_arrays_decide_as_lists(data, n, allow, dtype, vocab):
    """The vectorised pass over NumPy arrays (the plug-in's values) gives the decision -- or the
    error -- of the per-request loops over the same values as Python lists, reasons included."""
    import numpy as np

    temp = _mostly(0.0, [1.0, *_ODD]) if data.draw(st.booleans()) else _mostly(1.0, [0.0, *_ODD])

    def draw(values, dt):
        return np.array(data.draw(st.lists(values, min_size=n, max_size=n)), dtype=dt)

    temps = draw(temp, dtype)
    top_k = draw(_mostly(0, _KS), np.int32)
    top_p = draw(_mostly(1.0, [0.0, *_ODD]), dtype)
    min_p = draw(_mostly(0.0, [1.0, *_ODD]), dtype)
    allow_temperature, allow_top_k, allow_nucleus = allow
    kw = dict(
        vocab_size=vocab, allow_temperature=allow_temperature, allow_top_k=allow_top_k,
        allow_nucleus=allow_nucleus,
    )  # fmt: skip

    def decide(values):
        try:
            return can_shard_verify(
                temperatures=values[0], top_k=values[1], top_p=values[2], min_p=values[3], **kw
            )
        except ValueError as e:
            return ("raised", str(e))

    arrays = (temps, top_k, top_p, min_p)
    assert decide(arrays) == decide([a.tolist() for a in arrays])


@pytest.mark.parametrize(
    ("make", "allow"),
    [
        (
            lambda: {"temperatures": [np.float32(0.0), -1e-50]},
            True,
        ),  # min() in fp32 would tie with 0
        (lambda: {"temperatures": [np.float16(0.0), -1e-10]}, True),
        (lambda: {"temperatures": np.array([np.longdouble("1e400")])}, True),  # inf, kept by tolist
        (lambda: {"temperatures": [10**400]}, True),  # the loop's isfinite raises OverflowError
        (lambda: {"temperatures": [0.0], "min_p": [None]}, False),
        (lambda: {"temperatures": [None]}, True),
        (lambda: {"temperatures": (t for t in (0.7, 0.0))}, False),  # a generator, iterated once
        (lambda: {"temperatures": np.array([0.0, -1e-50])}, True),
        (lambda: {"temperatures": np.array([0.0, 0.5]), "top_p": np.array([1.0, np.nan])}, True),
    ],
)
def test_odd_values_decide_as_the_loops(make, allow):
    """Values the built-ins cannot decide exactly (NumPy scalars in a list, long doubles, None,
    huge ints, generators) go through the per-request loops: the decision or error is theirs
    (found by a review helper: ``ok`` for a temperature of -1e-50 beside ``np.float32(0.0)``)."""
    from shardmax import gate

    kw = {"vocab_size": 1000, "allow_temperature": allow}

    def loops():
        got = make()
        if not isinstance(got["temperatures"], (list, tuple, np.ndarray)):
            got["temperatures"] = list(got["temperatures"])
        lists = {k: gate._as_list(v) for k, v in got.items()}
        try:
            values = gate._Requests(
                lists["temperatures"], lists.get("top_k"), lists.get("top_p"), lists.get("min_p")
            )
            reason = gate._per_request_rules(values, 1000, allow, False, False, None)
        except (ValueError, TypeError, OverflowError) as e:
            return ("raised", type(e).__name__)
        return reason if reason is not None else ShardDecision(True, None)

    want = loops()
    try:
        got = can_shard_verify(**make(), **kw)
    except (ValueError, TypeError, OverflowError) as e:
        got = ("raised", type(e).__name__)
    assert got == want
