"""vLLM's native verification chain outside vLLM (:mod:`shardmax.testing.vllm_chain`), once per
vLLM version whose extracted tree holds the chain (``scripts/vllm_kernels.sh``: ``.vllm-kernels/
<version>`` or ``$SHARDMAX_VLLM_KERNELS``; ``tests/e2e_vllm/run.sh`` builds 0.32.0 and 0.33.0).

CPU (Triton interpreter, marked ``e2e``, run by ``tests/e2e_vllm/run.sh``; skipped without the
trees):

* greedy / temperature-only / synthetic batches: the chain == :func:`shardmax.reference.sampled.
  verify_sampled` (``num_sampled``, ``num_rejected`` and every sampled token ``==``), with the
  raw-chunk path (T in {0, 1}: no fp32 copy, no temperature launch) and the chunking;
* top-k rows without ties at the boundary: vLLM's kept sets == the exact top-k, and the chain ==
  the reference with ``top_k``;
* top-p 0.5 on peaked rows whose nucleus is the top 2 tokens and whose draft is the rank-3 token
  (probability 0.31 without the mask): the chain never accepts it, every resampled token lies in
  the nucleus, and with top-p 1 the same drafts are accepted on some seeds -- the masking really
  happens (vLLM's dispatcher launches the kernel; a no-op would accept);
* min-p: vLLM's kept sets == the reference's rule, the chain == the reference;
* the dispatcher on CPU: vLLM's monolithic ``_topk_topp_kernel`` with its CPU launch parameters
  at <= 64 and > 64 rows (the split pipeline is CUDA-only), and vLLM's choice stated per version;
* bad input and unsupported features raise.

GPU (marked ``gpu``; the H200 run: ``pytest -m gpu tests/test_vllm_chain.py`` with
``.vllm-kernels`` carried): the split pipeline at <= 64 rows, the monolithic kernel above and
with ``topp_pipeline="monolithic"``, the version difference of ``has_topp_only_rows``, masking on
both pipelines, every call run twice and compared bit for bit, and no host sync
(:func:`shardmax.testing.syncs.host_syncs`) after the first call.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import pytest
import torch

from shardmax.reference.nucleus import exact_nucleus_keep, min_p_keep
from shardmax.reference.sampled import apply_temperature, top_k_mask, verify_sampled
from shardmax.testing import VerifyBatch, random_verify_batch
from shardmax.testing.syncs import host_syncs
from shardmax.testing.vllm_chain import (
    NativeChain,
    chain_trees,
    max_chunk_logits,
    request_chunks,
    verify_inputs,
)

CHAINS = NativeChain.discover()
if CHAINS:
    print(f"[vllm_chain] chains: {', '.join(f'{c.version} ({c.modules.source})' for c in CHAINS)}")
by_version = pytest.mark.parametrize("chain", CHAINS, ids=[c.id for c in CHAINS])

_SPLIT_KERNELS = {"_topp_sb_stats_kernel", "_topp_sb_step_kernel", "_topp_sb_mask_kernel"}
_RS_KERNELS = [
    "_compute_local_logits_stats_kernel",
    "_rejection_kernel",
    "_resample_kernel",
    "_insert_resampled_kernel",
    "_get_num_sampled_and_rejected_kernel",
]


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _kernels(log) -> list[str]:
    return [launch.kernel for launch in log]


def _reference(b, kw, **sampling):
    return verify_sampled(
        b.logits, b.draft_sampled, b.cu_num_logits, b.pos, b.idx_mapping, b.expanded_local_pos,
        kw["temperature_gpu"], b.seed, b.num_speculative_steps,
        seq_lens=kw["seq_lens"], prefill_len=kw["prefill_len"],
        use_fp64_gumbel=kw.get("use_fp64_gumbel", False),
        synthetic_conditional_rates=kw.get("synthetic_conditional_rates"), **sampling,
    )  # fmt: skip


def _assert_same(out, ref, what: str) -> tuple[int, int]:
    """``==`` on the counts and on the columns < num_sampled; returns (requests, tokens)."""
    sampled, num_sampled, num_rejected = out
    r_sampled, r_num, r_rej = ref
    assert torch.equal(num_sampled.cpu(), r_num.cpu()), (what, num_sampled, r_num)
    assert torch.equal(num_rejected.cpu(), r_rej.cpu()), (what, num_rejected, r_rej)
    cols = torch.arange(sampled.shape[1])[None, :] < num_sampled.cpu()[:, None]
    assert torch.equal(sampled.cpu()[cols], r_sampled.cpu()[cols]), (what, sampled, r_sampled)
    return int(num_sampled.numel()), int(cols.sum())


def _peaked(rows: int, vocab: int, gen: torch.Generator, peak: float = 12.0) -> torch.Tensor:
    x = torch.randn(rows, vocab, generator=gen) * 2.0
    x[torch.arange(rows), torch.randint(0, vocab, (rows,), generator=gen)] += peak
    return x


def _batch(seed: int, vocab: int, num_reqs: int, k: int, temps_from, *, dtype=torch.float32,
           synthetic: bool = False):  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    b = random_verify_batch(
        num_reqs, k, vocab, seed=seed, logits=_peaked(num_reqs * (k + 1), vocab, gen).to(dtype),
        accept_prob=0.8, placeholder_prob=0.1, prefill_prob=0.1, synthetic=synthetic,
    )  # fmt: skip
    pick = torch.randint(0, len(temps_from), (b.max_num_reqs,), generator=gen)
    temp = torch.tensor(temps_from, dtype=torch.float32)[pick]
    slots = b.idx_mapping.long()
    temp[slots[0]] = float(max(temps_from))  # the largest and a greedy one are present
    temp[slots[1]] = 0.0
    return b, temp


def _nucleus_batch(num_reqs: int, vocab: int, top_p_of_req, seed: int = 0):
    """K = 1 requests on peaked rows: probabilities 0.34 / 0.33 / 0.31 on three random ids and
    0.02 spread over the rest; the draft is each row's rank-3 id. At top-p 0.5 the exact nucleus
    is the top 2 (0.34 < 0.5 <= 0.67), so the draft is outside it; without top-p it has
    probability 0.31. Returns (batch, ids [rows, 3], top_p per slot)."""
    gen = torch.Generator().manual_seed(seed)
    rows = 2 * num_reqs
    probs = torch.full((rows, vocab), 0.02 / (vocab - 3), dtype=torch.float64)
    ids = torch.stack([torch.randperm(vocab, generator=gen)[:3] for _ in range(rows)])
    probs.scatter_(1, ids, torch.tensor([0.34, 0.33, 0.31], dtype=torch.float64).expand(rows, 3))
    logits = (probs.log() + 9.0).to(torch.float32)
    max_reqs = 2 * num_reqs + 1
    base = torch.randint(0, 100_000, (num_reqs, 1), generator=gen)
    draft = torch.randint(0, vocab, (rows,), generator=gen, dtype=torch.int32)
    draft[1::2] = ids[0::2, 2].to(torch.int32)  # row 2r verifies draft 2r+1: its rank-3 id
    b = VerifyBatch(
        logits=logits,
        draft_sampled=draft,
        cu_num_logits=torch.arange(0, rows + 1, 2, dtype=torch.int32),
        pos=(base + torch.arange(2)).view(-1).to(torch.int64),
        idx_mapping=torch.randperm(max_reqs, generator=gen)[:num_reqs].to(torch.int32),
        expanded_local_pos=torch.tensor([0, 1] * num_reqs, dtype=torch.int32),
        seed=torch.randint(-(2**63), 2**63 - 1, (max_reqs,), generator=gen, dtype=torch.int64),
        num_speculative_steps=1,
        synthetic_conditional_rates=None,
        seq_lens=(base.view(-1) + 2).to(torch.int32),
        prefill_len=torch.ones(max_reqs, dtype=torch.int32),
    )
    top_p = torch.ones(b.max_num_reqs, dtype=torch.float32)
    top_p[b.idx_mapping.long()] = torch.tensor(
        [float(top_p_of_req(r)) for r in range(num_reqs)], dtype=torch.float32
    )
    return b, ids, top_p


# --------------------------------------------------------------------------------------------
# host-side pieces (no trees needed)
# --------------------------------------------------------------------------------------------


def test_chunk_limits_and_request_chunks() -> None:
    """vLLM's chunk cap (2**30 bytes of fp32 rows) and its request grouping: one chunk when the
    step fits, else maximal runs of whole requests, at least one request per chunk."""
    assert max_chunk_logits(151936) == 1766
    assert max_chunk_logits(200064) == 1341
    assert max_chunk_logits(2**29) == 1
    cu = np.array([0, 4, 8, 9, 13, 17])
    assert request_chunks(cu, 17) == [(0, 5)]
    assert request_chunks(cu, 8) == [(0, 2), (2, 4), (4, 5)]
    assert request_chunks(cu, 9) == [(0, 3), (3, 5)]
    assert request_chunks(cu, 3) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]  # a request > cap
    with pytest.raises(ValueError, match="max_rows"):
        request_chunks(cu, 0)


def test_discover_needs_the_chain_files(tmp_path) -> None:
    """No tree, or a tree holding only the oracle kernels: no chain (and nothing raises)."""
    assert NativeChain.discover(tmp_path) == []
    oracle_only = tmp_path / "0.31.0" / "vllm" / "v1" / "worker" / "gpu" / "sample"
    oracle_only.mkdir(parents=True)
    (oracle_only / "gumbel.py").write_text("")
    assert chain_trees(tmp_path) == []
    assert NativeChain.discover(tmp_path) == []


# --------------------------------------------------------------------------------------------
# CPU: the chain == the reference where both are exact
# --------------------------------------------------------------------------------------------

_MIXED = (0.0, 0.5, 0.7, 1.0, 1.3)
SAME_CASES = [
    # name, vocab, reqs, K, temps, dtype, fp64 gumbel, synthetic, max_chunk_rows
    ("mixed-bf16", 2048, 10, 3, _MIXED, torch.bfloat16, False, False, None),
    ("raw-0-1-bf16", 2048, 10, 3, (0.0, 1.0), torch.bfloat16, False, False, None),
    ("mixed-fp32-fp64gumbel", 3000, 8, 2, _MIXED, torch.float32, True, False, None),
    ("synthetic-fp16", 2048, 8, 3, _MIXED, torch.float16, False, True, None),
    ("chunked-7-rows", 2048, 10, 3, _MIXED, torch.bfloat16, False, False, 7),
]


@pytest.mark.e2e
@by_version
@pytest.mark.parametrize("case", SAME_CASES, ids=[c[0] for c in SAME_CASES])
def test_greedy_and_temperature_match_reference(case, chain: NativeChain) -> None:
    name, vocab, reqs, k, temps, dtype, fp64, synthetic, chunk = case
    b, temp = _batch(11 + SAME_CASES.index(case), vocab, reqs, k, temps, dtype=dtype,
                     synthetic=synthetic)  # fmt: skip
    kw = verify_inputs(b, temperature=temp)
    kw["use_fp64_gumbel"] = fp64
    ch = chain.with_options(max_chunk_rows=chunk) if chunk else chain
    t0 = time.perf_counter()
    with ch.record_launches() as log:
        out = ch.verify(b.logits, **kw)
    dt = time.perf_counter() - t0
    n_req, n_tok = _assert_same(out, _reference(b, kw), f"{name} vLLM {chain.version}")
    chunks = request_chunks(kw["cu_num_logits_np"], chunk or max_chunk_logits(vocab))
    assert len(ch.last_pipelines) == len(chunks) and set(ch.last_pipelines) == {"none"}
    expected = []
    for start, end in chunks:  # a temperature launch where a request's T is not 0 or 1
        t = kw["temperature_np"][kw["idx_mapping_np"][start:end]]
        scaled = bool(((t != 0) & (t != 1)).any())
        expected += (["_temperature_kernel"] if scaled else []) + _RS_KERNELS[:-1]
    assert _kernels(log) == expected + _RS_KERNELS[-1:], _kernels(log)
    if chunk:
        assert len(chunks) > 1
    if temps == (0.0, 1.0):  # vLLM verifies the raw model-dtype chunk: no copy at all
        processed = ch.apply_sampling_params(
            b.logits, kw["expanded_idx_mapping"], kw["idx_mapping_np"],
            temperature_gpu=kw["temperature_gpu"], temperature_np=kw["temperature_np"],
        )  # fmt: skip
        assert processed is b.logits
        # the unchecked call (timed loops) runs the same chain
        _assert_same(ch.verify(b.logits, **kw, checks=False), out, "checks=False")
    accepted = int((out.num_sampled - 1).clamp(min=0).sum())
    print(f"[vllm_chain] {name} vLLM {chain.version}: {n_req} requests, {n_tok} tokens "
          f"({accepted} accepted drafts) == reference, {len(chunks)} chunk(s), {dt:.2f}s")  # fmt: skip


@pytest.mark.e2e
@by_version
def test_top_k_matches_exact_reference(chain: NativeChain) -> None:
    """Top-k 1 / 5 / 20 / off on fp32 rows without ties at the k-th value: vLLM's kept sets are
    the exact top-k, and the whole step equals the reference with ``top_k``."""
    vocab, reqs, k = 2048, 6, 2
    b, temp = _batch(31, vocab, reqs, k, (0.0, 0.7, 1.0))
    gen = torch.Generator().manual_seed(32)
    top_k = torch.tensor([1, 5, 20, vocab], dtype=torch.int32)[
        torch.randint(0, 4, (b.max_num_reqs,), generator=gen)
    ]
    slots = b.idx_mapping.long()
    top_k[slots[0]], top_k[slots[2]] = 5, 20
    kw = verify_inputs(b, temperature=temp, top_k=top_k)
    x = apply_temperature(b.logits, temp, b.idx_mapping, kw["expanded_idx_mapping"])
    k_row = top_k[kw["expanded_idx_mapping"].long()]
    srt = torch.sort(x, dim=1, descending=True).values
    for r in range(x.shape[0]):  # no tie at the boundary on any active row
        kr = int(k_row[r])
        if kr < vocab:
            assert float(srt[r, kr - 1]) != float(srt[r, kr]), r
    with chain.record_launches() as log:
        processed = chain.apply_sampling_params(
            b.logits, kw["expanded_idx_mapping"], kw["idx_mapping_np"],
            temperature_gpu=kw["temperature_gpu"], temperature_np=kw["temperature_np"],
            top_k_gpu=kw["top_k_gpu"], top_k_np=kw["top_k_np"],
        )  # fmt: skip
    assert chain.last_pipelines == ["monolithic"]
    topk_launches = [la for la in log if la.kernel == "_topk_topp_kernel"]
    assert len(topk_launches) == 1
    assert topk_launches[0].meta["TOPK_ENABLED"] is True
    assert topk_launches[0].meta["TOPP_ENABLED"] is False
    want = top_k_mask(x, k_row)
    got_keep, want_keep = torch.isfinite(processed), torch.isfinite(want)
    assert torch.equal(got_keep, want_keep), (got_keep.sum(1), want_keep.sum(1))
    assert torch.equal(processed[got_keep], x[got_keep])  # kept values untouched
    out = chain.verify(b.logits, **kw)
    n_req, n_tok = _assert_same(out, _reference(b, kw, top_k=top_k), f"top-k {chain.version}")
    print(f"[vllm_chain] top-k vLLM {chain.version}: kept sets {x.shape[0]}/{x.shape[0]} rows "
          f"exact, {n_req} requests / {n_tok} tokens == reference")  # fmt: skip


@pytest.mark.e2e
@by_version
def test_top_p_masks_a_draft_outside_the_nucleus(chain: NativeChain) -> None:
    """The masking really happens. Requests alternate top-p 0.5 and 1 on rows whose nucleus at
    0.5 is the top 2 and whose draft is the rank-3 id (p = 0.31 unmasked): vLLM's kept set is the
    exact nucleus on the 0.5 rows (all ids on the others); the 0.5 requests never accept their
    draft and resample inside the nucleus, the whole step == the exact-nucleus reference; and the
    same batch with top-p 1 everywhere accepts the same drafts on some of those requests."""
    vocab, reqs = 512, 20
    b, ids, p_mix = _nucleus_batch(reqs, vocab, lambda r: 0.5 if r % 2 else 1.0)
    masked_req = torch.arange(reqs) % 2 == 1
    masked_row = masked_req.repeat_interleave(2)
    kw = verify_inputs(b, temperature=torch.ones_like(p_mix), top_p=p_mix)
    with chain.record_launches() as log:
        processed = chain.apply_sampling_params(
            b.logits, kw["expanded_idx_mapping"], kw["idx_mapping_np"],
            temperature_gpu=kw["temperature_gpu"], temperature_np=kw["temperature_np"],
            top_p_gpu=kw["top_p_gpu"], top_p_np=kw["top_p_np"],
        )  # fmt: skip
    assert "_topk_topp_kernel" in _kernels(log) or _SPLIT_KERNELS & set(_kernels(log))
    kept = torch.isfinite(processed)
    top2 = torch.zeros_like(kept)
    top2.scatter_(1, ids[:, :2], True)
    assert torch.equal(kept[masked_row], top2[masked_row]), kept.sum(1)
    assert bool(kept[~masked_row].all())
    exact = exact_nucleus_keep(b.logits, p_mix[kw["expanded_idx_mapping"].long()])
    assert torch.equal(kept, exact)

    out = chain.verify(b.logits, **kw)
    assert bool((out.num_sampled[masked_req] == 1).all()), out.num_sampled
    first = out.sampled[:, 0]
    in_top2 = (first == ids[0::2, 0]) | (first == ids[0::2, 1])
    assert bool(in_top2[masked_req].all()), first
    _assert_same(out, _reference(b, kw, top_p=p_mix), "top-p mixed")

    p_one = torch.ones_like(p_mix)
    kw1 = verify_inputs(b, temperature=torch.ones_like(p_mix), top_p=p_one)
    out1 = chain.verify(b.logits, **kw1)
    opened = out1.num_sampled[masked_req] == 2
    assert int(opened.sum()) >= 1, out1.num_sampled
    drafts = b.draft_sampled[1::2].to(torch.int64)[masked_req]
    assert bool((out1.sampled[masked_req][opened, 0] == drafts[opened]).all())
    _assert_same(out1, _reference(b, kw1), "top-p 1")
    print(f"[vllm_chain] top-p vLLM {chain.version}: rank-3 drafts accepted 0/{reqs // 2} at "
          f"p=0.5 (nucleus = exact top 2 on {int(masked_row.sum())} rows) vs "
          f"{int(opened.sum())}/{reqs // 2} at p=1 (same drafts and seeds); "
          f"{int((out.num_sampled[~masked_req] == 2).sum())}/{reqs // 2} accepted on the p=1 "
          f"requests of the processed chunk; all == reference")  # fmt: skip


@pytest.mark.e2e
@by_version
def test_tiny_top_p_is_vllms_or_flagged(chain: NativeChain) -> None:
    """A top-p far below the top token's probability: vLLM's fp32 trim of the boundary ties
    takes the top token too and masks the whole row (token 0 sampled), the exact nucleus keeps
    it; ``sharded_verify``'s candidate path flags such requests and equals vLLM's chain on every
    request it does not flag (found by a review: tokens differed, unflagged, at 1e-8)."""
    import shardmax

    vocab = 300
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(12, vocab, generator=gen) * 2
    x[torch.arange(12), torch.randint(0, vocab, (12,), generator=gen)] += 30.0  # peaked rows
    flagged = 0
    for p in (1e-8, 2e-7, 1e-5):
        b = random_verify_batch(4, 2, vocab, seed=7, prefill_prob=0.0, logits=x, accept_prob=0.8)
        temp = torch.zeros(b.max_num_reqs)
        temp[b.idx_mapping.long()] = 1.0
        top_p = torch.full((b.max_num_reqs,), p)
        res = shardmax.sharded_verify(
            b.logits, *b.args()[:5], temp, b.seed, b.num_speculative_steps, vocab_start=0,
            top_p=top_p, **b.kwargs(),
        )  # fmt: skip
        out = chain.verify(b.logits, **verify_inputs(b, temperature=temp, top_p=top_p))
        keep = ~res.fallback
        flagged += int(res.fallback.sum())
        if p == 1e-8:
            assert bool(res.fallback.all()), res.fallback
        ours = (res.sampled[keep], res.num_sampled[keep], res.num_rejected[keep])
        _assert_same(ours, (out.sampled[keep], out.num_sampled[keep], out.num_rejected[keep]),
                     f"top-p {p}")  # fmt: skip
    assert flagged >= 4


@pytest.mark.e2e
@by_version
def test_min_p_matches_reference(chain: NativeChain) -> None:
    """Min-p 0.05 / 0.2 / off: vLLM's kept sets are the reference rule's and the step equals the
    reference with ``min_p``."""
    vocab, reqs, k = 2048, 8, 2
    b, temp = _batch(41, vocab, reqs, k, (0.0, 0.8, 1.0))
    gen = torch.Generator().manual_seed(42)
    min_p = torch.tensor([0.0, 0.05, 0.2], dtype=torch.float32)[
        torch.randint(0, 3, (b.max_num_reqs,), generator=gen)
    ]
    min_p[b.idx_mapping.long()[0]] = 0.2
    kw = verify_inputs(b, temperature=temp, min_p=min_p)
    with chain.record_launches() as log:
        processed = chain.apply_sampling_params(
            b.logits, kw["expanded_idx_mapping"], kw["idx_mapping_np"],
            temperature_gpu=kw["temperature_gpu"], temperature_np=kw["temperature_np"],
            min_p_gpu=kw["min_p_gpu"], min_p_np=kw["min_p_np"],
        )  # fmt: skip
    assert "_min_p_kernel" in _kernels(log)
    x = apply_temperature(b.logits, temp, b.idx_mapping, kw["expanded_idx_mapping"])
    want = min_p_keep(x, min_p[kw["expanded_idx_mapping"].long()])
    assert torch.equal(torch.isfinite(processed), want)
    out = chain.verify(b.logits, **kw)
    n_req, n_tok = _assert_same(out, _reference(b, kw, min_p=min_p), f"min-p {chain.version}")
    print(f"[vllm_chain] min-p vLLM {chain.version}: {n_req} requests / {n_tok} tokens "
          f"== reference")  # fmt: skip


# --------------------------------------------------------------------------------------------
# the dispatcher
# --------------------------------------------------------------------------------------------


@pytest.mark.e2e
@by_version
def test_pipeline_choice_per_version(chain: NativeChain) -> None:
    """vLLM's top-p pipeline per chunk as this version decides it (CUDA: split at <= 64 rows for
    p-only rows; 0.33 skips the split pass after the monolithic kernel when no row is p-only)."""
    pick = chain.topp_pipeline_for
    cuda = {"device_type": "cuda"}
    assert pick(64, top_k_active=False, top_p_active=True, has_topp_only_rows=True, **cuda) == (
        "split"
    )
    assert pick(65, top_k_active=False, top_p_active=True, has_topp_only_rows=True, **cuda) == (
        "monolithic"
    )
    assert pick(8, top_k_active=True, top_p_active=False, has_topp_only_rows=False, **cuda) == (
        "monolithic"
    )
    assert pick(8, top_k_active=True, top_p_active=True, has_topp_only_rows=True, **cuda) == (
        "monolithic+split"
    )
    both_no_ponly = pick(8, top_k_active=True, top_p_active=True, has_topp_only_rows=False, **cuda)
    assert chain.passes_has_topp_only_rows == chain.version.startswith("0.33")
    assert both_no_ponly == (
        "monolithic" if chain.passes_has_topp_only_rows else "monolithic+split"
    )
    for rows in (1, 8, 64, 65, 500):
        assert (
            pick(rows, top_k_active=False, top_p_active=True, has_topp_only_rows=True,
                 device_type="cpu") == "monolithic"
        )  # fmt: skip
    mono = chain.with_options(topp_pipeline="monolithic")
    assert mono.topp_pipeline_for(8, top_k_active=False, top_p_active=True,
                                  has_topp_only_rows=True, device_type="cuda") == "monolithic"  # fmt: skip
    assert pick(8, top_k_active=False, top_p_active=False, has_topp_only_rows=False, **cuda) == (
        "none"
    )


@pytest.mark.e2e
@by_version
@pytest.mark.parametrize("reqs", [4, 35], ids=["8-rows", "70-rows"])
def test_dispatcher_launches_monolithic_on_cpu(reqs: int, chain: NativeChain) -> None:
    """On CPU vLLM's dispatcher launches the monolithic kernel with its CPU launch parameters
    (one program per row up to the compute units = torch threads, 256/128 tiles, 4 warps, the
    split pipeline not covering p-only rows) at <= 64 and > 64 rows; never the split kernels.
    Only the first two requests use top-p 0.5 (the others pass through the kernel at p = 1); both
    are masked to the exact nucleus, and ``topp_pipeline="monolithic"`` runs the same launches."""
    vocab = 1024
    b, ids, top_p = _nucleus_batch(reqs, vocab, lambda r: 0.5 if r < 2 else 1.0, seed=5)
    kw = verify_inputs(b, temperature=torch.ones_like(top_p), top_p=top_p)
    rows = 2 * reqs
    logs = {}
    for ch in (chain, chain.with_options(topp_pipeline="monolithic")):
        with ch.record_launches() as log:
            processed = ch.apply_sampling_params(
                b.logits, kw["expanded_idx_mapping"], kw["idx_mapping_np"],
                temperature_gpu=kw["temperature_gpu"], temperature_np=kw["temperature_np"],
                top_p_gpu=kw["top_p_gpu"], top_p_np=kw["top_p_np"],
            )  # fmt: skip
        logs[ch.topp_pipeline] = [(la.kernel, la.grid, dict(la.meta)) for la in log]
        assert ch.last_pipelines == ["monolithic"]
        assert not _SPLIT_KERNELS & set(_kernels(log))
        (launch,) = [la for la in log if la.kernel == "_topk_topp_kernel"]
        assert launch.grid == (min(torch.get_num_threads(), rows),)
        m = launch.meta
        assert (m["BLOCK_SIZE"], m["BLOCK_SIZE_TRUNC"], m["num_warps"]) == (256, 128, 4)
        assert (m["TOPK_ENABLED"], m["TOPP_ENABLED"], m["SPLIT_COVERS_PONLY"]) == (
            False, True, False,
        )  # fmt: skip
        assert (m["BATCH_SIZE"], m["VOCAB_SIZE"]) == (rows, vocab)
        kept = torch.isfinite(processed)
        top2 = torch.zeros_like(kept[:4])
        top2.scatter_(1, ids[:4, :2], True)
        assert torch.equal(kept[:4], top2)
        assert bool(kept[4:].all())
    assert logs["auto"] == logs["monolithic"]


# --------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------


@pytest.mark.e2e
@by_version
def test_bad_input_and_unsupported_features_raise(chain: NativeChain) -> None:
    b, temp = _batch(51, 64, 3, 2, (0.0, 1.0))
    kw = verify_inputs(b, temperature=temp)

    def call(**over):
        args = {**kw, **over}
        logits = args.pop("logits", b.logits)
        return chain.verify(logits, **args)

    for over, match in [
        ({"draft_logits": torch.zeros(1)}, "draft_logits"),
        ({"rejection_sample_method": "block"}, "block"),
        ({"rejection_sample_method": "fly"}, "fly"),
        ({"logits_processing": True}, "penalties"),
        ({"num_logprobs": 5}, "logprobs"),
        ({"watermark_key": 7}, "watermark"),
    ]:
        with pytest.raises(NotImplementedError, match=match):
            call(**over)
    n = kw["temperature_gpu"].numel()
    for over, match in [
        ({"temperature_gpu": kw["temperature_gpu"].double()}, "temperature_gpu"),
        ({"seed_gpu": kw["seed_gpu"].to(torch.int32)}, "seed_gpu"),
        ({"top_k_gpu": torch.full((n,), 64, dtype=torch.int32)}, "top_k_gpu / top_k_np"),
        (
            {
                "top_k_gpu": torch.full((n,), 65, dtype=torch.int32),
                "top_k_np": np.full(n, 65, dtype=np.int32),
            },
            "top_k_np",
        ),
        ({"top_p_gpu": torch.zeros(n), "top_p_np": np.zeros(n, dtype=np.float32)}, "top_p_np"),
        ({"temperature_np": np.full(n, math.nan, dtype=np.float32)}, "temperature_np"),
        ({"cu_num_logits_np": kw["cu_num_logits_np"][::-1].copy()}, "cu_num_logits_np"),
        ({"idx_mapping_np": kw["idx_mapping_np"] + n}, "idx_mapping_np"),
        ({"pos": kw["pos"][:-1]}, "pos"),
        ({"logits": b.logits.t().contiguous().t()}, "stride"),
        ({"logits": b.logits.to(torch.int32)}, "logits"),
        ({"num_speculative_steps": -1}, "num_speculative_steps"),
        ({"rejection_sample_method": "synthetic"}, "synthetic_conditional_rates"),
        ({"rejection_sample_method": "other"}, "rejection_sample_method"),
    ]:
        with pytest.raises(ValueError, match=match):
            call(**over)
    with pytest.raises(TypeError, match="idx_mapping_np"):
        call(idx_mapping_np=list(kw["idx_mapping_np"]))
    with pytest.raises(TypeError, match="logits"):
        call(logits=b.logits.numpy())
    with pytest.raises(ValueError, match="topp_pipeline"):
        chain.with_options(topp_pipeline="split")


# --------------------------------------------------------------------------------------------
# GPU (the H200 run)
# --------------------------------------------------------------------------------------------


def _twice(fn):
    """Run ``fn`` (a step) twice; the two results must be identical (GPU rule): the counts and
    every token vLLM wrote (columns < num_sampled; the rest is uninitialised memory)."""
    a, b = fn(), fn()
    _assert_same(b, a, "two identical calls differ on the GPU")
    return a


def _to(kw: dict, device: str) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


def _batch_to(b: VerifyBatch, device: str) -> VerifyBatch:
    return dataclasses.replace(b, **_to(dataclasses.asdict(b), device))


_GPU_PIPELINES = [
    # name, requests, top-p of request r, top-k of request r (V = off)
    ("p-only-8-rows", 4, lambda r: 0.5, None, "split"),
    ("p-only-130-rows", 65, lambda r: 0.5, None, "monolithic"),
    ("k-and-p-only-8-rows", 4, lambda r: 0.5, lambda r: 2 if r % 2 else None, "monolithic+split"),
    ("k-with-p-8-rows", 4, lambda r: 0.5, lambda r: 2, "0.33:monolithic|0.32:monolithic+split"),
]


@pytest.mark.gpu
@by_version
@pytest.mark.parametrize("forced", [False, True], ids=["auto", "forced-monolithic"])
@pytest.mark.parametrize("case", _GPU_PIPELINES, ids=[c[0] for c in _GPU_PIPELINES])
def test_pipelines_mask_on_gpu(case, forced: bool, chain: NativeChain) -> None:
    """CUDA: the kernels vLLM launches per pipeline (recorded) match its stated choice; every
    pipeline masks the rank-3 draft (never accepted, tokens from the top 2); two calls are
    bit-identical; no host sync after the first call."""
    name, reqs, p_of, k_of, expected = case
    dev, vocab = "cuda", 151936
    ch = chain.with_options(topp_pipeline="monolithic") if forced else chain
    b, ids, top_p = _nucleus_batch(reqs, vocab, p_of, seed=9)
    top_k = None
    if k_of is not None:
        top_k = torch.full_like(top_p, vocab, dtype=torch.int32)
        top_k[b.idx_mapping.long()] = torch.tensor(
            [k_of(r) or vocab for r in range(reqs)], dtype=torch.int32
        )
    kw = _to(verify_inputs(b, temperature=torch.ones_like(top_p), top_p=top_p, top_k=top_k), dev)
    logits = b.logits.to(dev)
    with ch.record_launches() as log:
        out = _twice(lambda: ch.verify(logits, **kw))
    if forced:
        expected = "monolithic"
    elif ":" in expected:
        expected = dict(x.split(":") for x in expected.split("|"))[chain.version[:4]]
    assert ch.last_pipelines == [expected]
    names = set(_kernels(log))
    assert ("_topk_topp_kernel" in names) == ("monolithic" in expected), names
    assert bool(_SPLIT_KERNELS & names) == ("split" in expected), names
    if "split" in expected:
        steps = [la for la in log if la.kernel == "_topp_sb_step_kernel"]
        assert len(steps) == 2 * 5  # five rounds per call, two calls
    assert bool((out.num_sampled == 1).all()), out.num_sampled
    first = out.sampled[:, 0].cpu()
    assert bool(((first == ids[0::2, 0]) | (first == ids[0::2, 1])).all())
    assert host_syncs(lambda: ch.verify(logits, **kw)) == "none"
    print(f"[vllm_chain gpu] {name} vLLM {chain.version} {ch.topp_pipeline}: {expected}, "
          f"kernels {sorted(names)}")  # fmt: skip


@pytest.mark.gpu
@by_version
def test_temperature_0_1_matches_reference_on_gpu(chain: NativeChain) -> None:
    """CUDA: greedy and T = 1 requests (the raw bf16 chunk, no division) == the reference;
    deterministic."""
    b, temp = _batch(61, 151936, 24, 3, (0.0, 1.0), dtype=torch.bfloat16)
    b = _batch_to(b, "cuda")  # the reference's sampled rows need Triton on the device too
    kw = verify_inputs(b, temperature=temp.cuda())
    out = _twice(lambda: chain.verify(b.logits, **kw))
    n_req, n_tok = _assert_same(out, _reference(b, kw), "gpu T in {0, 1}")
    print(f"[vllm_chain gpu] T in {{0, 1}} vLLM {chain.version}: {n_req} requests / {n_tok} "
          f"tokens == reference")  # fmt: skip
