"""The contract under hostile input (issue 16): one test per class of the adversarial review.

Each of these failed on the landed main before the fix: strided index tensors gave other tokens
in ``sharded_verify``, the plain path ignored ``vocab_start``, the sampled kernels read before
their inputs with value checks off, the interpreter's bf16 subnormals gave a wrong argmax, and
the clear-error cases raised the wrong thing or nothing. The multi-rank classes (geometry
changed on one rank, a rank refusing its inputs) are in tests/test_distributed.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import shardmax
from shardmax.reference.sampled import verify_sampled
from shardmax.runtime import dispatch
from shardmax.runtime.dispatch import Problem
from shardmax.runtime.validation import value_checks
from shardmax.testing import (
    emulate_greedy_verify,
    emulate_verify,
    emulate_vocab_parallel_argmax,
    random_verify_batch,
)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as a stride-2 view (the other slots hold garbage)."""
    big = torch.full((2 * t.shape[0],), 7, dtype=t.dtype)
    big[::2] = t
    return big[::2]


def _sampled_batch(num_reqs: int = 5, vocab: int = 700, seed: int = 2):
    b = random_verify_batch(num_reqs, 3, vocab, seed=seed, synthetic=False)
    n = b.max_num_reqs
    gen = torch.Generator().manual_seed(seed)
    temp = torch.tensor([0.0, 0.7, 1.0, 1.3])[torch.randint(0, 4, (n,), generator=gen)]
    top_k = torch.tensor([0, 5, 20])[torch.randint(0, 3, (n,), generator=gen)].to(torch.int32)
    top_p = torch.tensor([1.0, 0.9, 0.95], dtype=torch.float64)[
        torch.randint(0, 3, (n,), generator=gen)
    ]
    min_p = torch.tensor([0.0, 0.0, 0.05])[torch.randint(0, 3, (n,), generator=gen)]
    return b, temp, top_k, top_p, min_p


SAMPLED_TENSORS = (
    "draft_sampled", "cu_num_logits", "pos", "idx_mapping", "expanded_local_pos", "seed",
    "temperature", "top_k", "top_p", "min_p", "seq_lens", "prefill_len",
)  # fmt: skip


@pytest.mark.parametrize("name", SAMPLED_TENSORS)
def test_every_index_and_sampling_tensor_may_be_strided(name: str) -> None:
    """One rule for every public op: any stride is accepted and gives the contiguous answer
    (found: strided ``cu_num_logits`` / ``top_k`` / ``seed`` / ``pos`` changed tokens)."""
    b, temp, top_k, top_p, min_p = _sampled_batch()
    a = dict(zip(("draft_sampled", "cu_num_logits", "pos", "idx_mapping", "expanded_local_pos",
                  "seed"), b.args()[:6], strict=True))  # fmt: skip
    kw = {**b.kwargs(), "top_k": top_k, "top_p": top_p, "min_p": min_p}
    allt = {**a, "temperature": temp, **kw}

    def call(ts: dict) -> tuple:
        return shardmax.sharded_verify(
            b.logits, ts["draft_sampled"], ts["cu_num_logits"], ts["pos"], ts["idx_mapping"],
            ts["expanded_local_pos"], ts["temperature"], ts["seed"], 3, vocab_start=0,
            **{k: ts[k] for k in ("top_k", "top_p", "min_p", "seq_lens", "prefill_len",
                                  "synthetic_conditional_rates")},
        )  # fmt: skip

    want = call(allt)
    got = call({**allt, name: _strided(allt[name])})
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w), name
    assert want.fallback.sum() < len(want.fallback)  # some requests decided: the test can fail


def test_plain_path_uses_every_ranks_vocab_start() -> None:
    """The plain path (a ``plain`` table row or an override) returns global ids: a rank whose
    range does not start at 0, and an emulated group of ranks with a gap between ranges."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 300, generator=gen)
    with dispatch.override(variant="plain"):
        ids = shardmax.vocab_parallel_argmax(x, vocab_start=1000)
    assert torch.equal(ids, x.argmax(dim=-1) + 1000)
    b = random_verify_batch(4, 3, 300, seed=4, synthetic=True, prefill_prob=0.0)
    b.draft_sampled = torch.where(b.draft_sampled >= 0, b.draft_sampled + 1000, b.draft_sampled)
    full = torch.full((b.logits.shape[0], 1300), float("-inf"))
    full[:, 1000:] = b.logits
    want = shardmax.sharded_greedy_verify(full, *b.args(), vocab_start=0, **b.kwargs())
    with dispatch.override(variant="plain"):
        got = shardmax.sharded_greedy_verify(b.logits, *b.args(), vocab_start=1000, **b.kwargs())
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert int((want[1] > 0).sum()) > 0


def test_plain_path_equals_sharded_path_on_a_gapped_geometry() -> None:
    """Two emulated ranks whose ranges leave a gap: plain (gather) == sharded, ids global."""
    from shardmax.ops.argmax import ArgmaxPlan
    from shardmax.runtime.geometry import Geometry
    from shardmax.runtime.shard import ShardContext
    from shardmax.testing.emulate import EmulatedRank, emulated_exchange

    gen = torch.Generator().manual_seed(1)
    parts = [torch.randn(5, 64, generator=gen) for _ in range(2)]
    parts[1][:, 50:] = 99.0  # padding that would win if read
    geo = Geometry(((0, 64), (200, 50)), 64, torch.float32)
    ctxs = [ShardContext(EmulatedRank(r, 2), geo, r, torch.device("cpu")) for r in range(2)]
    for forced in (None, "plain"):
        with dispatch.override(**({"variant": forced} if forced else {})):
            plans = [ArgmaxPlan(c, 5, 64) for c in ctxs]
            sent = [p.local(x) for p, x in zip(plans, parts, strict=True)]
            ids = plans[0].finish(emulated_exchange(sent, plans[0].transport))
        full = torch.cat([parts[0], parts[1][:, :50]], dim=1)
        want = full.argmax(dim=-1)
        want = torch.where(want >= 64, want - 64 + 200, want)
        assert torch.equal(ids, want), forced


@pytest.mark.parametrize(
    "bad",
    [
        {"cu_num_logits": torch.tensor([-1000, 2, 4], dtype=torch.int32)},
        {"cu_num_logits": torch.tensor([0, 3, 1], dtype=torch.int32)},  # not monotone
        # a first request without rows, whose one clamped row is the next request's: its
        # record has no key in the two-phase step (found: 4294967295, the empty key's id)
        {"cu_num_logits": torch.tensor([0, 0, 4], dtype=torch.int32)},
        {"cu_num_logits": torch.tensor([0, 1_000_000, 4], dtype=torch.int32)},
        {"idx_mapping": torch.tensor([1_000_000, 1], dtype=torch.int32)},
        {"idx_mapping": torch.tensor([-5, 1], dtype=torch.int32)},
        {"draft_sampled": torch.tensor([0, 2**30, -7, 3], dtype=torch.int32)},
    ],
)
@pytest.mark.parametrize("mode", ["fast", "strict"])
@pytest.mark.parametrize("nucleus", [True, False], ids=["candidates", "two_phase"])
def test_sampled_kernels_never_read_out_of_bounds_with_checks_off(bad, mode, nucleus) -> None:
    """Value checks off (the plug-in's mode): a malformed batch gives unspecified outputs,
    but every id stays a real id or -1 (found: ids such as 4294967293 and planted values read
    from before the inputs), and with the checks on it is a clear ValueError."""
    vocab = 500
    b = random_verify_batch(2, 2, vocab, seed=3, synthetic=False, prefill_prob=0.0)
    b.cu_num_logits = torch.tensor([0, 2, 4], dtype=torch.int32)
    b.logits = b.logits[:4]
    b.draft_sampled, b.pos, b.expanded_local_pos = (
        t[:4] for t in (b.draft_sampled, b.pos, b.expanded_local_pos)
    )
    n = b.max_num_reqs
    temp = torch.ones(n)
    temp[b.idx_mapping[0]] = 0.0  # a greedy request first, then a sampled one
    kw = {"top_k": torch.full((n,), 10, dtype=torch.int32), "top_p": torch.full((n,), 0.9)}
    if not nucleus:
        kw = {}  # temperature only: two-phase (the token drawn after the finish)
    args = dict(zip(("draft_sampled", "cu_num_logits", "pos", "idx_mapping",
                     "expanded_local_pos", "seed"), b.args()[:6], strict=True))  # fmt: skip
    args.update(bad)
    a = list(args.values())

    def call():
        return shardmax.sharded_verify(
            b.logits, *a[:5], temp, a[5], 2, vocab_start=0, mode=mode,
            logits_processed=True if mode == "strict" else None, **kw,
        )  # fmt: skip

    with value_checks(False):
        res = call()
    assert res.sampled.shape == (2, 3)
    ok = (res.sampled == -1) | ((res.sampled >= 0) & (res.sampled < vocab))
    assert bool(ok.all()), res.sampled
    assert bool(((res.num_sampled >= 0) & (res.num_sampled <= 3)).all())
    with pytest.raises(ValueError):
        call()


def test_bf16_subnormals_exact_in_the_interpreter() -> None:
    """Every bf16 subnormal bit pattern (both signs): the argmax, the greedy verification and
    the sampled path's greedy rows are exact (the interpreter's own conversion got 127 of 128
    patterns of each sign wrong)."""
    bits = torch.arange(1, 128, dtype=torch.int16)
    pos = bits.view(torch.bfloat16)
    neg = (bits | -32768).to(torch.int16).view(torch.bfloat16)
    rows = []
    for i in range(pos.shape[0]):  # row i: a subnormal above zeros and negative subnormals
        r = torch.cat([neg, torch.zeros(4, dtype=torch.bfloat16), pos[: i + 1], neg[i + 1 :]])
        rows.append(r[torch.randperm(r.shape[0], generator=torch.Generator().manual_seed(i))])
    x = torch.stack(rows)
    want = torch.argmax(x.float(), dim=-1)
    assert torch.equal(shardmax.vocab_parallel_argmax(x, vocab_start=0), want)
    assert torch.equal(emulate_vocab_parallel_argmax(x, 2), want)
    # all-negative-subnormal rows: the largest (closest to zero) wins
    y = neg[None, :].repeat(3, 1)
    assert torch.equal(
        shardmax.vocab_parallel_argmax(y, vocab_start=0), torch.argmax(y.float(), -1)
    )


def test_greedy_rows_of_sampled_verification_on_bf16_subnormals() -> None:
    b = random_verify_batch(6, 3, 130, seed=8, prefill_prob=0.0, accept_prob=0.9)
    bits = torch.randint(-127, 128, b.logits.shape, generator=torch.Generator().manual_seed(8))
    x = torch.where(bits < 0, (-bits) | -32768, bits).to(torch.int16).view(torch.bfloat16)
    b.logits = x
    target = torch.argmax(x.float(), dim=-1)
    cu = b.cu_num_logits.tolist()
    for r in range(len(cu) - 1):  # drafts = the exact target argmax: accepted iff exact
        for j in range(cu[r], cu[r + 1] - 1):
            b.draft_sampled[j + 1] = target[j]
    temp = torch.zeros(b.max_num_reqs)
    a = b.args()
    got = shardmax.sharded_verify(x, *a[:5], temp, *a[5:], vocab_start=0, **b.kwargs())
    want = b.reference()
    for g, w in zip(got[:3], want, strict=True):
        assert torch.equal(g, w)


# --------------------------------------------------------------------- clear errors
def _table(path: Path, text: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text)
    return path


def test_table_files_that_are_not_tables(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not UTF-8"):
        dispatch.load_table(_table(tmp_path / "sm90" / "argmax.json", b"\xff\xfe{}"))
    d = tmp_path / "sm90" / "verify.json"
    d.mkdir(parents=True)
    with pytest.raises(ValueError, match="not a regular file"):
        dispatch.load_table(d)
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(ValueError, match=r"nested too deeply|not valid JSON"):
        dispatch.load_table(_table(tmp_path / "sm90" / "sampled.json", deep))


@pytest.mark.parametrize(
    ("arch", "exc"),
    [(90, TypeError), ("x" * 200, ValueError), ("sm90/../gfx950", ValueError), ("", ValueError),
     ("sm 90", ValueError)],
)  # fmt: skip
def test_arch_must_be_an_arch_id(arch, exc) -> None:
    with pytest.raises(exc, match="arch"):
        Problem("argmax", "bf16", 1, 4, 1024, 16, arch=arch)


def test_a_path_like_arch_never_loads_another_arch(tmp_path: Path, monkeypatch) -> None:
    table = {"schema": 1, "arch": "sm90", "op": "argmax", "tuned": True, "provenance": {},
             "rows": [{"match": {}, "variant": "shard_keys_bf16_va16_b4096",
                       "launch": {"splits": 2, "num_warps": 8, "num_stages": 2,
                                  "transport": "allgather"}}]}  # fmt: skip
    bad = json.loads(json.dumps(table))
    bad["arch"] = "sm90/../gfx950"
    with pytest.raises(ValueError, match="arch must be an arch id"):
        dispatch.validate_table(bad)


def test_override_refuses_wrong_families_and_missing_blocks() -> None:
    with (
        pytest.raises(ValueError, match="verify_finish kernel"),
        dispatch.override(variant="verify_finish_tp2_allgather"),
    ):
        pass
    with (
        pytest.raises(ValueError, match=r"not in shardmax\.generated"),
        dispatch.override(variant="shard_keys_bf16_va16_b512"),
    ):
        pass
    x = torch.randn(3, 256)
    with (
        dispatch.override(variant="sampled_record_fp32_b1024"),
        pytest.raises(ValueError, match="cannot run op argmax"),
    ):
        shardmax.vocab_parallel_argmax(x, vocab_start=0)
    with (
        dispatch.override(variant="shard_keys_bf16_va16_b1024"),
        pytest.raises(ValueError, match="cannot run op argmax"),
    ):
        shardmax.vocab_parallel_argmax(x, vocab_start=0)  # fp32 logits, a bf16 variant


def test_meta_device_logits_are_refused() -> None:
    x = torch.empty(3, 64, device="meta")
    with pytest.raises(ValueError, match="meta"):
        shardmax.vocab_parallel_argmax(x, vocab_start=0)


@pytest.mark.parametrize(
    "bad",
    [
        torch.randn(4, 50, dtype=torch.float64),
        torch.randn(50),
        torch.zeros(4, 50, dtype=torch.int32),
    ],
)
def test_testing_helpers_refuse_unsupported_logits(bad) -> None:
    with pytest.raises((TypeError, ValueError), match="local_logits"):
        emulate_vocab_parallel_argmax(bad, 2)
    b = random_verify_batch(2, 1, 50, seed=0, prefill_prob=0.0)
    rows = b.logits.shape[0]
    logits = bad[:rows] if bad.dim() == 2 else bad
    with pytest.raises((TypeError, ValueError), match="local_logits"):
        emulate_greedy_verify(logits, 2, *b.args(), **b.kwargs())
    a = b.args()
    with pytest.raises((TypeError, ValueError), match="local_logits"):
        emulate_verify(logits, 2, *a[:5], torch.ones(b.max_num_reqs), *a[5:], **b.kwargs())


def test_a_tiny_fp64_temperature_is_refused_not_made_greedy() -> None:
    """1e-50 in fp64 is 0 in fp32 (vLLM's storage dtype, where 0 means greedy): refused while
    value checks are on, rather than silently verifying a sampled request greedily."""
    b = random_verify_batch(3, 2, 200, seed=5, prefill_prob=0.0)
    a = b.args()
    temp = torch.full((b.max_num_reqs,), 1e-50, dtype=torch.float64)
    with pytest.raises(ValueError, match="becomes 0"):
        shardmax.sharded_verify(b.logits, *a[:5], temp, *a[5:], vocab_start=0, **b.kwargs())
    ok = torch.full((b.max_num_reqs,), 1e-30, dtype=torch.float64)  # a normal fp32: sampled
    res = shardmax.sharded_verify(b.logits, *a[:5], ok, *a[5:], vocab_start=0, **b.kwargs())
    want = verify_sampled(b.logits, *a[:5], ok.float(), *a[5:], **b.kwargs())
    keep = ~res.fallback
    for g, w in zip(res[:3], want, strict=True):
        assert torch.equal(g[keep], w[keep])
