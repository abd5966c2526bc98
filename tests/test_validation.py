"""Bad input gets a clear error naming the argument, never a silent wrong answer."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardmax
from shardmax.testing import random_verify_batch


def test_argmax_rejects_bad_logits() -> None:
    x = torch.randn(4, 64)
    with pytest.raises(TypeError, match="local_logits"):
        shardmax.vocab_parallel_argmax(x.numpy(), vocab_start=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"local_logits.*2 dims"):
        shardmax.vocab_parallel_argmax(x[0], vocab_start=0)
    with pytest.raises(TypeError, match=r"local_logits: dtype torch\.float64"):
        shardmax.vocab_parallel_argmax(x.double(), vocab_start=0)
    with pytest.raises(ValueError, match="last dim must be contiguous"):
        shardmax.vocab_parallel_argmax(x.t(), vocab_start=0)
    with pytest.raises(ValueError, match="num_valid: 65 out of range"):
        shardmax.vocab_parallel_argmax(x, vocab_start=0, num_valid=65)
    with pytest.raises(ValueError, match="num_valid: -1 out of range"):
        shardmax.vocab_parallel_argmax(x, vocab_start=0, num_valid=-1)
    with pytest.raises(ValueError, match="exceeds the largest supported vocabulary"):
        shardmax.vocab_parallel_argmax(x, vocab_start=2**31 - 10)
    with pytest.raises(TypeError, match="vocab_start"):
        shardmax.vocab_parallel_argmax(x, vocab_start=1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="group"):
        shardmax.vocab_parallel_argmax(x, vocab_start=0, group="nccl")


def _batch():
    return random_verify_batch(3, 3, 500, seed=1)


def _call(b, **over):
    args = dict(
        zip(
            [
                "draft_sampled",
                "cu_num_logits",
                "pos",
                "idx_mapping",
                "expanded_local_pos",
                "seed",
                "num_speculative_steps",
            ],
            b.args(),
            strict=True,
        )
    )
    kwargs = {k: v for k, v in b.kwargs().items()}
    logits = over.pop("local_logits", b.logits)
    for k, v in over.items():
        (args if k in args else kwargs)[k] = v
    kwargs["vocab_start"] = 0
    return shardmax.sharded_greedy_verify(logits, *args.values(), **kwargs)


def test_verify_rejects_bad_batches() -> None:
    b = _batch()
    n = b.logits.shape[0]
    with pytest.raises(ValueError, match="draft_sampled: shape"):
        _call(b, draft_sampled=b.draft_sampled[:-1])
    with pytest.raises(TypeError, match="draft_sampled: dtype"):
        _call(b, draft_sampled=b.draft_sampled.float())
    with pytest.raises(ValueError, match="cu_num_logits: expected 4 entries"):
        _call(b, cu_num_logits=b.cu_num_logits[:-1])
    bad_cu = b.cu_num_logits.clone()
    bad_cu[-1] = n - 1
    with pytest.raises(ValueError, match="cu_num_logits: must start at 0 and end"):
        _call(b, cu_num_logits=bad_cu)
    with pytest.raises(ValueError, match=r"cu_num_logits: request \d+ has \d+ logits rows"):
        _call(b, num_speculative_steps=1, synthetic_conditional_rates=None)
    with pytest.raises(ValueError, match="num_speculative_steps: must be >= 1"):
        _call(b, num_speculative_steps=0)
    big = b.draft_sampled.clone()
    big[0] = 500
    with pytest.raises(ValueError, match=r"draft_sampled: token ids must be in \[-1, 500\)"):
        _call(b, draft_sampled=big)
    with pytest.raises(TypeError, match="pos: dtype"):
        _call(b, pos=b.pos.to(torch.int32))
    with pytest.raises(ValueError, match="synthetic_conditional_rates: shape"):
        _call(b, synthetic_conditional_rates=torch.ones(2))
    with pytest.raises(ValueError, match="seq_lens and prefill_len"):
        _call(b, prefill_len=None)
    with pytest.raises(ValueError, match="idx_mapping: values must be in"):
        _call(b, idx_mapping=b.idx_mapping + 1000)


def test_placeholder_draft_is_legal() -> None:
    b = _batch()
    d = b.draft_sampled.clone()
    d[1] = -1
    sampled, num_sampled, _ = _call(b, draft_sampled=d)
    assert int(num_sampled[0]) >= 1
    assert sampled.shape == (3, 4)


def test_broadcast_and_negated_logits_are_refused_by_name() -> None:
    """Rows broadcast by ``expand()`` (row stride 0) and tensors carrying torch's lazy negation
    bit (whose storage holds the negated values: the kernels read the storage) are refused
    naming ``local_logits`` (found by a review: the first named an internal ``row_stride``, the
    second returned the argmax of the storage)."""
    with pytest.raises(ValueError, match="local_logits: row stride 0"):
        shardmax.vocab_parallel_argmax(torch.randn(1, 64).expand(4, 64), vocab_start=0)
    neg = torch._neg_view(torch.randn(2, 64))
    with pytest.raises(ValueError, match="local_logits: carries torch's lazy negation"):
        shardmax.vocab_parallel_argmax(neg, vocab_start=0)
    got = shardmax.vocab_parallel_argmax(neg.resolve_neg(), vocab_start=0)
    assert torch.equal(got, torch.argmax(neg, dim=-1))
    one = torch.randn(1, 64).expand(1, 64)  # one row: its stride is never used
    assert torch.equal(shardmax.vocab_parallel_argmax(one, vocab_start=0), one.argmax(-1))


def test_greedy_plan_refuses_a_sampled_batch() -> None:
    """A greedy plan given a batch with temperatures (a sampled step) raises instead of
    verifying it greedily (found by a review: it returned greedy answers for T = 1)."""
    from shardmax.plan import VocabShard
    from shardmax.runtime.validation import check_step_batch

    b = random_verify_batch(3, 2, 64, seed=1, prefill_prob=0.0)
    rows = b.logits.shape[0]
    shard = VocabShard(vocab_start=0, num_valid=64, width=64, dtype=b.logits.dtype,
                       device=b.logits.device)  # fmt: skip
    args = (rows, b.logits.device, *b.args()[:5], b.seed, b.num_speculative_steps)
    greedy = check_step_batch(*args)
    sampled = check_step_batch(*args, temperature=torch.ones(b.max_num_reqs))
    plan = shard.greedy_verify(rows)
    plan.run(b.logits, greedy)
    with pytest.raises(ValueError, match="temperature: a greedy plan"):
        plan.run(b.logits, sampled)


_STEP_NAMES = ("draft_sampled", "cu_num_logits", "pos", "idx_mapping", "expanded_local_pos",
               "seed", "num_speculative_steps", "synthetic_conditional_rates", "seq_lens",
               "prefill_len", "temperature", "top_k", "top_p", "min_p")  # fmt: skip


def _variant(t: object, how: str) -> object:
    """One argument of a step batch made otherwise: another dtype, rank, length, stride or
    type, or absent."""
    if how == "none":
        return None
    assert isinstance(t, torch.Tensor)
    return {
        "int32": lambda: t.to(torch.int32),
        "int64": lambda: t.to(torch.int64),
        "fp32": lambda: t.to(torch.float32),
        "fp64": lambda: t.to(torch.float64),
        "bf16": lambda: t.to(torch.bfloat16),
        "2d": lambda: t.unsqueeze(0),
        "shorter": lambda: t[:-1],
        "longer": lambda: torch.cat([t, t[:1]]),
        "strided": lambda: torch.stack([t, t], 1)[:, 0],  # same values, stride 2
        "list": lambda: t.tolist(),
        "subclass": lambda: torch.nn.Parameter(t.float(), requires_grad=False),
        "meta": lambda: t.to("meta"),
        "sparse": lambda: t.to_sparse(),  # contiguous() raises on it
    }[how]()


_HOW = ("none", "int32", "int64", "fp32", "fp64", "bf16", "2d", "shorter", "longer", "strided",
        "list", "subclass", "meta", "sparse")  # fmt: skip


def _fast_and_checks(changes: dict[str, str], sampled: bool) -> None:
    """``check_step_batch`` with its one-pass path against the per-argument checks alone, on
    a valid step batch (vLLM's engine batch: no synthetic rates) with ``changes`` applied."""
    from shardmax.runtime import validation

    b = random_verify_batch(3, 3, 64, seed=2)
    slots = b.seed.shape[0]
    args: dict[str, object] = dict(zip(_STEP_NAMES, b.args(), strict=False))
    args |= b.kwargs()
    assert args["synthetic_conditional_rates"] is None  # else only the checks would run
    if sampled:
        args |= {"temperature": torch.rand(slots), "top_k": torch.full((slots,), 5),
                 "top_p": torch.rand(slots), "min_p": torch.zeros(slots)}  # fmt: skip
    for name, how in changes.items():
        base = args.get(name)
        if base is None:
            base = torch.ones(3) if name == "synthetic_conditional_rates" else b.seed
        args[name] = _variant(base, how)
    rows, device = b.logits.shape[0], b.logits.device

    def outcome(fast: bool) -> object:
        with pytest.MonkeyPatch.context() as mp:
            if not fast:
                mp.setattr(validation, "_fast_step_batch", lambda *a: None)
            try:
                return validation.check_step_batch(rows, device, **args)  # type: ignore[arg-type]
            except Exception as e:  # the checks' errors, and torch's own (a sparse tensor)
                return (type(e), str(e))

    got, want = outcome(True), outcome(False)
    if not isinstance(want, validation.StepBatch):
        assert got == want, changes
        return
    assert isinstance(got, validation.StepBatch), (changes, got)
    for g, w in zip(got, want, strict=True):
        if isinstance(w, torch.Tensor):
            assert type(g) is type(w) and g.is_contiguous()
            assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)
        else:
            assert g == w


def test_step_batch_fast_path_is_the_checks_one_change_each() -> None:
    """``check_step_batch``'s one-pass path for the engine's batch (host time every step) gives
    what the per-argument checks give -- the same normalised batch, or the same error -- for
    every argument of the batch made otherwise in every way :func:`_variant` has (another
    dtype, rank, length, stride, type, device or layout, or absent), greedy and sampled."""
    _fast_and_checks({}, False)
    _fast_and_checks({}, True)
    for name in _STEP_NAMES:
        if name == "num_speculative_steps":
            continue
        for how in _HOW:
            for sampled in (False, True):
                _fast_and_checks({name: how}, sampled)


@settings(max_examples=200)
@given(
    changes=st.dictionaries(
        st.sampled_from([n for n in _STEP_NAMES if n != "num_speculative_steps"]),
        st.sampled_from(_HOW),
        min_size=2,
        max_size=3,
    ),
    sampled=st.booleans(),
)
def test_step_batch_fast_path_is_the_checks(changes: dict[str, str], sampled: bool) -> None:
    """The same on two or three arguments made otherwise at once."""
    _fast_and_checks(changes, sampled)
