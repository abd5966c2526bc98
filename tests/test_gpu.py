"""GPU checks (marked ``gpu``; skipped without a device). Run on the H200 by scripts/gpu_checks.sh.

1. every generated shard_keys variant x every finish (TP 1/2/3/4/8, both transports) == torch.argmax
   on the adversarial suite at real vocab sizes; 2. every verify finish == the reference;
3. the public ops through the dispatcher (packaged table for this arch); 4. CUDA-graph capture and
replay with changing inputs == eager; 5. after ``shardmax.ops.warmup.warmup`` a capture compiles nothing.
"""

from __future__ import annotations

import pytest
import torch

import shardmax
from generator.space import local_variants
from shardmax import reference
from shardmax.ops.warmup import warmup
from shardmax.runtime import dispatch
from shardmax.runtime.dispatch import Problem, Selection
from shardmax.runtime.variants import parse_name
from shardmax.testing import (
    ADVERSARIAL_CASES,
    adversarial_logits,
    assert_same_ids,
    emulate_greedy_verify,
    emulate_vocab_parallel_argmax,
    random_verify_batch,
)
from tests._twice import twice

pytestmark = pytest.mark.gpu
DEV = "cuda"
TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOPOLOGIES = [
    (1, "allreduce"),
    (2, "allgather"),
    (3, "allgather"),
    (4, "allgather"),
    (8, "allgather"),
    (8, "allreduce"),
]


@pytest.mark.parametrize("variant", [k.name for k in local_variants()])
def test_every_variant_on_gpu(variant: str) -> None:
    key = parse_name(variant)
    dtype = TORCH_DTYPE[str(key.dtype)]
    for vocab in (50257, 151936, 200064):
        for tp, transport in TOPOLOGIES:
            for splits in (1, 4, 16):
                logits = adversarial_logits(
                    2 * len(ADVERSARIAL_CASES),
                    vocab,
                    dtype=dtype,
                    seed=vocab + tp + splits,
                    tp_size=tp,
                    block=int(key.block or 1024),
                    device=DEV,
                )
                sel = Selection(
                    variant,
                    {"splits": splits, "num_warps": 8, "num_stages": 2, "transport": transport},
                    False,
                    "test",
                )
                got = emulate_vocab_parallel_argmax(logits, tp, selection=sel)
                assert_same_ids(got.cpu(), torch.argmax(logits, dim=-1).cpu(), logits.cpu())


@pytest.mark.parametrize(("tp", "transport"), TOPOLOGIES)
@pytest.mark.parametrize("k", [1, 3, 5])
def test_every_verify_finish_on_gpu(tp: int, transport: str, k: int) -> None:
    for vocab in (32001, 200064):
        for synthetic in (False, True):
            batch = random_verify_batch(
                24,
                k,
                vocab,
                seed=vocab + tp + k,
                synthetic=synthetic,
                dtype=torch.bfloat16,
                device=DEV,
            )
            sel = Selection(
                "shard_keys_bf16_va1_b4096",
                {"splits": 4, "num_warps": 8, "transport": transport},
                False,
                "t",
            )
            got = emulate_greedy_verify(
                batch.logits, tp, *batch.args(), selection=sel, **batch.kwargs()
            )
            for g, w in zip(got, batch.reference(), strict=True):
                assert torch.equal(g.cpu(), w.cpu())


@pytest.mark.parametrize("rows", [1, 32, 96, 512])
def test_public_ops_through_dispatcher(rows: int) -> None:
    logits = torch.randn(rows, 50016, device=DEV, dtype=torch.bfloat16)  # V=200064 at TP4
    got = shardmax.vocab_parallel_argmax(logits, vocab_start=50016)
    assert torch.equal(got, torch.argmax(logits, dim=-1) + 50016)
    sel = dispatch.select(Problem("argmax", "bf16", 1, rows, 50016, 16))
    assert sel.variant == "plain" or sel.variant.startswith("shard_keys_bf16_va16_")


def test_cuda_graph_replay_matches_eager() -> None:
    static = torch.randn(96, 50016, device=DEV, dtype=torch.bfloat16)
    batch = random_verify_batch(24, 3, 50016, seed=5, device=DEV, dtype=torch.bfloat16)
    vstatic = batch.logits.clone()
    with dispatch.override(variant="shard_keys_bf16_va16_b4096"):
        shardmax.vocab_parallel_argmax(static, vocab_start=0)
        shardmax.sharded_greedy_verify(vstatic, *batch.args(), vocab_start=0, **batch.kwargs())
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ids = shardmax.vocab_parallel_argmax(static, vocab_start=0)
            verified = shardmax.sharded_greedy_verify(
                vstatic, *batch.args(), vocab_start=0, **batch.kwargs()
            )
    for i in range(4):
        static.copy_(torch.randn_like(static))
        vstatic.copy_(torch.randn_like(vstatic))
        vstatic[i] = 0.0
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(ids, torch.argmax(static, dim=-1))
        want = reference.greedy_verify(vstatic, *batch.args(), **batch.kwargs())
        for g, w in zip(verified, want, strict=True):
            assert torch.equal(g, w)


def _compiled() -> int:
    """Compiled kernel binaries held by every generated module loaded so far."""
    import sys

    total = 0
    for name, mod in list(sys.modules.items()):
        if name.startswith("shardmax.generated.") and hasattr(mod, "kernel"):
            for cache in mod.kernel.device_caches.values():
                total += len(cache[0])
    return total


def test_capture_after_warmup_never_compiles() -> None:
    # vLLM captures a fixed list of batch sizes; warm up exactly those, then capture.
    sizes = (7, 96, 300)
    inputs = []
    for rows in sizes:
        logits = torch.randn(rows, 50016, device=DEV, dtype=torch.bfloat16)
        batch = random_verify_batch(
            max(1, rows // 4), 3, 50016, seed=rows, device=DEV, dtype=torch.bfloat16
        )
        inputs.append((logits, batch))
    problems = [Problem("argmax", "bf16", 1, rows, 50016, 16) for rows in sizes]
    problems += [Problem("verify", "bf16", 1, b.logits.shape[0], 50016, 16) for _, b in inputs]
    warmup(problems, num_speculative_steps=(3,))
    before = _compiled()
    for logits, batch in inputs:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            shardmax.vocab_parallel_argmax(logits, vocab_start=0)
            shardmax.sharded_greedy_verify(
                batch.logits, *batch.args(), vocab_start=0, **batch.kwargs()
            )
        graph.replay()
    torch.cuda.synchronize()
    assert _compiled() == before, "a launch during capture compiled a kernel"


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("fp64", [False, True])
@pytest.mark.parametrize("with_topk", [False, True])
def test_sampled_verify_fast_mode_on_gpu(tp: int, fp64: bool, with_topk: bool) -> None:
    """Sampled verification (fast mode) on the GPU vs the reference on the GPU: every
    non-fallback request identical, greedy requests never flagged; with top-k 1/20/50, top-p
    0.8/0.95 and min-p 0.05 (and off) per request and 4 record splits per rank. (Temperature division:
    the kernel uses Triton's default fp32 division, as vLLM's temperature kernel does; a
    mismatch here on a sampled row points at the reference's torch division.)"""
    from shardmax.reference.sampled import verify_sampled
    from shardmax.testing import emulate_verify

    gen = torch.Generator().manual_seed(tp)
    for vocab, dtype in ((32001, torch.bfloat16), (200064, torch.float32)):
        rows = 24 * 4
        logits = (torch.randn(rows, vocab, generator=gen) * 3.0).to(dtype).to(DEV)
        batch = random_verify_batch(24, 3, vocab, seed=tp, logits=logits, device=DEV)
        temps = torch.tensor((0.5, 0.7, 1.0, 1.3, 0.0))[
            torch.randint(0, 5, (batch.max_num_reqs,), generator=gen)
        ].to(DEV)
        a = batch.args()
        kw = dict(batch.kwargs(), use_fp64_gumbel=fp64)
        splits = 1
        if with_topk:  # top-k, top-p and min-p rows (candidates path), 4 record splits
            n = batch.max_num_reqs
            ks = torch.tensor((0, 1, 20, 50))
            kw["top_k"] = ks[torch.randint(0, 4, (n,), generator=gen)].to(DEV)
            ps = torch.tensor((1.0, 0.8, 0.95))
            kw["top_p"] = ps[torch.randint(0, 3, (n,), generator=gen)].to(DEV)
            mps = torch.tensor((0.0, 0.0, 0.05))
            kw["min_p"] = mps[torch.randint(0, 3, (n,), generator=gen)].to(DEV)
            splits = 4
        got = twice(
            emulate_verify, batch.logits, tp, *a[:5], temps, *a[5:], record_splits=splits, **kw
        )
        want = verify_sampled(batch.logits, *a[:5], temps, *a[5:], **kw)
        ok = ~got.fallback
        assert torch.equal(got.reason != 0, got.fallback)
        assert int(ok.sum()) >= ok.numel() // 3  # most requests run sharded
        for g, w in zip(got[:3], want, strict=True):
            assert torch.equal(g[ok].cpu(), w[ok].cpu())


@pytest.mark.parametrize("c", [32, 128])
def test_sampled_verify_every_candidate_count_on_gpu(c: int) -> None:
    """Fast mode with C = 32 / 128 (a tuned table may pick either) at V = 151936, TP 2 and 4,
    4 record splits, fp32 rows with 200 well-spaced planted values on top (so top-k
    boundaries and nuclei are decidable): top-k ``C - 1`` runs sharded, top-k ``C`` comes back
    TOPK_CAPACITY, top-p 0.9 / 0.95 rows ride along; every request not flagged == the reference
    on the GPU."""
    from shardmax.ops.sampled import FallbackReason
    from shardmax.reference.sampled import verify_sampled
    from shardmax.testing import emulate_verify

    vocab = 151936
    gen = torch.Generator().manual_seed(c)
    for tp in (2, 4):
        logits = torch.randn(16 * 4, vocab, generator=gen)
        for r in range(logits.shape[0]):  # 40.0, 39.9, ... 20.1 at random ids
            ids = torch.randperm(vocab, generator=gen)[:200]
            logits[r, ids] = 40.0 - 0.1 * torch.arange(200.0)
        batch = random_verify_batch(16, 3, vocab, seed=c + tp, logits=logits.to(DEV), device=DEV,
                                    prefill_prob=0.0)  # fmt: skip
        n = batch.max_num_reqs
        slots = batch.idx_mapping.long().cpu()
        temps = torch.ones(n)
        ks = torch.zeros(n, dtype=torch.int64)
        ks[slots] = torch.tensor([c - 1, c, 20, 0] * 4)
        ps = torch.ones(n)
        ps[slots] = torch.tensor([1.0, 1.0, 0.95, 0.9] * 4)
        a = batch.args()
        kw = dict(batch.kwargs(), top_k=ks.to(DEV), top_p=ps.to(DEV))
        got = twice(emulate_verify, batch.logits, tp, *a[:5], temps.to(DEV), *a[5:], record_splits=4,
                             candidates=c, **kw)  # fmt: skip
        want = verify_sampled(batch.logits, *a[:5], temps.to(DEV), *a[5:], **kw)
        reason = got.reason.cpu().view(4, 4)
        assert (reason[:, 1] == FallbackReason.TOPK_CAPACITY).all(), reason
        assert (reason[:, 0] != FallbackReason.TOPK_CAPACITY).all(), reason
        ok = ~got.fallback
        assert int(ok.sum()) >= 8, reason  # top-k C - 1, top-k 20 + top-p 0.95, top-p 0.9
        for g, w in zip(got[:3], want, strict=True):
            assert torch.equal(g[ok].cpu(), w[ok].cpu())


@pytest.mark.parametrize(
    ("dtype", "splits", "c"),
    [(torch.bfloat16, 1, 64), (torch.float32, 4, 64), (torch.bfloat16, 2, 32),
     (torch.bfloat16, 8, 128), (torch.float32, 1, 128)],
)  # fmt: skip
def test_record_candidates_on_gpu(dtype: torch.dtype, splits: int, c: int) -> None:
    """The compiled record kernel's candidates (bitonic ``tl.topk`` selection) == each split's
    top-C packed keys for every C a table may pick, with the temperatures whose division is
    exact in any rounding (1, 0.5, 2; 0 = greedy: ``EMPTY_KEY``), planted ties across the C-th
    value, an all -inf row, a row with 10 finite values and padding columns that would win if
    read."""
    from shardmax.ops.sampled import record_variant, record_words
    from shardmax.runtime.keys import EMPTY_KEY
    from tests.test_sampled_verify import _split_top_c, record_buffer

    gen = torch.Generator().manual_seed(3)
    rows, width, num_valid, vocab_start, block = 5, 100032, 100000, 100032, 2048
    raw = (torch.randn(rows, width, generator=gen) * 2.0).to(dtype)
    raw[:, num_valid:] = 100.0
    top = torch.argsort(raw[0, :num_valid].float(), descending=True)
    raw[0, top[20:140]] = raw[0, top[20]].clone()
    raw[1] = float("-inf")
    few = torch.randperm(num_valid, generator=gen)[:10]
    raw[2] = float("-inf")
    raw[2, few] = torch.randn(10, generator=gen).to(dtype)
    temps = torch.tensor([1.0, 0.5, 2.0, 0.0, 0.5])
    buf = record_buffer(raw.to(DEV), vocab_start, num_valid, temps, record_variant(dtype, block),
                        splits, c)  # fmt: skip
    n_rec = splits * rows * (record_words(False) + 1)
    got = buf[n_rec:].view(splits * rows, c).cpu()
    x = raw.float() / torch.where(temps == 0, 1.0, temps)[:, None]
    want = _split_top_c(x[:, :num_valid], vocab_start, num_valid, splits, block, c)
    want[(temps == 0).repeat(splits)] = EMPTY_KEY
    assert torch.equal(got, want)


@pytest.mark.parametrize("with_topk", [False, True])
def test_sampled_strict_cuda_graph_replay_matches_eager(with_topk: bool) -> None:
    """Strict mode captured once, replayed on new logits: every output == the eager call (the
    tables of the cut blocks are made before capture; nothing syncs with the host)."""
    vocab = 50257
    batch = random_verify_batch(12, 3, vocab, seed=9, device=DEV, dtype=torch.bfloat16)
    rows = batch.logits.shape[0]
    gen = torch.Generator().manual_seed(9)
    temps = torch.tensor([0.0, 0.7, 1.0, 1.3])[torch.randint(0, 4, (batch.max_num_reqs,),
                                                             generator=gen)].to(DEV)  # fmt: skip
    extra = {}
    if with_topk:
        extra["top_k"] = torch.tensor([0, 1, 20, 50], dtype=torch.int32)[
            torch.randint(0, 4, (batch.max_num_reqs,), generator=gen)
        ].to(DEV)
    a = batch.args()
    static = batch.logits.clone()

    def call():
        return twice(shardmax.sharded_verify,
            static, *a[:5], temps, *a[5:], vocab_start=0, mode="strict", logits_processed=True,
            **batch.kwargs(), **extra,
        )  # fmt: skip

    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    for i in range(3):
        static.copy_(torch.randn(rows, vocab, device=DEV).to(torch.bfloat16) * 3)
        graph.replay()
        torch.cuda.synchronize()
        eager = call()
        for name, g, w in zip(captured._fields, captured, eager, strict=True):
            assert torch.equal(g, w), f"replay {i}: {name}"
