"""Keyed Gumbel noise of vLLM's non-greedy resample / bonus step, as Triton ``@jit`` helpers.

vLLM 0.33 draws the recovered (resampled) and bonus tokens of a non-greedy row with a Gumbel-max
whose noise is a pure function of ``(seed, position, global token id)`` -- never of the block
layout (research ``sampled-verification.md`` §1.3). This module reproduces that noise as written
in the research text (paraphrase; no vLLM code):

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

Everything a later GPU/vLLM parity run has to confirm is marked **UNVERIFIED** below (the research
text does not spell these out; the mathematically standard choice was taken):

* UNVERIFIED (series): the degree-8 series of ``L(u)`` is taken as the Taylor series
  ``log(1 - u) = -(u + u**2/2 + ... + u**8/8)``, coefficients ``1/n`` rounded to fp32, evaluated
  in Horner form ``-u * (1 + u*(1/2 + u*(1/3 + ... + u*(1/8))))`` in fp32. vLLM could use other
  coefficients (e.g. a minimax fit) or another evaluation order; either changes low bits of ``G``.
  (Plain Taylor truncation error at ``u = 0.25`` is ~``0.25**9/9`` = 4e-7 absolute, i.e. ~1.4e-6
  relative to ``L`` -- above fp32 resolution, which is itself a hint that vLLM may do otherwise.)
* UNVERIFIED (threshold): the branch test is ``u < 0.25`` on the fp32 ``u`` (strict), as the
  research says; note that hash words just below ``0x40000000`` round to ``u = 0.25`` exactly and
  take the direct branch.
* UNVERIFIED (word order): message words in the order listed above, each read as one
  little-endian 32-bit MurmurHash3 block; ``seed high word = (seed >> 32)`` of the two's-complement
  int64; ``pos low word`` = low 32 bits of the int64 position; token id truncated to uint32.
* UNVERIFIED (fp64 bits): which 53 bits form ``r`` -- taken as the top 53 bits of the 64-bit value
  ``(hash_hi << 32) | hash_lo`` (``hash_lo`` = seed-0 hash, ``hash_hi`` = seed-``0x9E3779B9``
  hash), i.e. ``r = value >> 11``; the map of ``1.0`` below 1 is taken as
  ``u := 1 - 2**-53`` (the largest double below 1) when the fp64 rounding of ``(r + 0.5)*2**-53``
  gives ``1.0`` (it does for ``r = 2**53 - 1``).
* UNVERIFIED (fp32 u evaluation): ``hi16 * 2**-16`` and ``(lo16 + 0.5) * 2**-32`` are formed
  separately (both exact) and added once; an FMA would give the same bits since the product is
  exact.
* ``tl.log`` is Triton's own: on the interpreter it is NumPy's fp32/fp64 ``log``; on GPUs it is
  the backend's. The noise is deterministic per backend; GPU-vs-interpreter bit identity of ``G``
  is NOT claimed (the hash words and ``u`` are integer/exact and backend-independent).

Helpers (all element-wise, scalars or blocks):

* :func:`murmur3_x86_32_16` / :func:`gumbel_hash32` -- the hash.
* :func:`uniform_fp32_from_hash`, :func:`gumbel_fp32_from_uniform`, :func:`gumbel_fp32` -- fp32 mode.
* :func:`uniform_fp64_from_hashes`, :func:`gumbel_fp64_from_uniform`, :func:`gumbel_fp64` -- fp64.
* :func:`acceptance_log_u` -- ``(u, log u)`` of the acceptance test (``tl.rand`` via
  :func:`shardmax._rand.synthetic_u`, then ``tl.log``), research §1.2 / §2.3 ("u and log u from
  Triton's own ``tl.rand`` and ``tl.log``").

Host launchers over 1-D int64 tensors: :func:`gumbel_components_triton`,
:func:`gumbel_noise_triton`, :func:`gumbel_from_hash_triton`, :func:`acceptance_uniform_triton`.
CPU tensors need ``TRITON_INTERPRET=1`` set before ``triton``/``shardmax`` are imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardmax._rand import synthetic_u

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
    w0 = seed.to(tl.uint32)  # low word (truncation)
    w1 = (seed >> 32).to(tl.uint32)  # high word of the two's-complement int64
    w2 = pos.to(tl.uint32)  # position low word
    w3 = token.to(tl.uint32)  # global token id as uint32
    hs = tl.full(w0.shape, HASH_SEED, tl.uint32)
    return murmur3_x86_32_16(w0, w1, w2, w3, hs)


# --------------------------------------------------------------------------------------------
# fp32 mode
# --------------------------------------------------------------------------------------------


@triton.jit
def uniform_fp32_from_hash(h):
    """``u = hi16 * 2**-16 + (lo16 + 0.5) * 2**-32`` in fp32 from uint32 ``h``; in ``(0, 1]``."""
    hi = (h >> 16).to(tl.float32) * 1.52587890625e-05  # 2**-16, exact
    lo = ((h & 0xFFFF).to(tl.float32) + 0.5) * 2.3283064365386963e-10  # 2**-32, exact
    return hi + lo


@triton.jit
def gumbel_fp32_from_uniform(u):
    """``G = -log(-L(u))``, ``L(u) = log(1 - u)``: degree-8 Taylor series below 0.25 (UNVERIFIED
    coefficients/order, see the module docstring), ``log(max(1 - u, 2**-24))`` otherwise. fp32."""
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


# --------------------------------------------------------------------------------------------
# fp64 mode
# --------------------------------------------------------------------------------------------


@triton.jit
def uniform_fp64_from_hashes(h_lo, h_hi):
    """``u = (r + 0.5) * 2**-53`` in fp64, ``r`` = top 53 bits of ``(h_hi << 32) | h_lo``
    (UNVERIFIED bit choice); ``1.0`` mapped to ``1 - 2**-53``. In ``(0, 1)``."""
    v = (h_hi.to(tl.uint64) << 32) | h_lo.to(tl.uint64)
    r = (v >> 11).to(tl.float64)  # < 2**53: exact
    u = (r + 0.5) * 1.1102230246251565e-16  # 2**-53
    return tl.where(u >= 1.0, 0.9999999999999999, u)  # 1 - 2**-53


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
