"""The random number of vLLM's synthetic acceptance, drawn with Triton's own ``tl.rand``.

vLLM's synthetic ("load-testing") acceptance accepts draft ``i`` of a request iff
``u < conditional_rate[i]`` where ``u`` is Triton's ``tl.rand(seed, pos)`` evaluated on the
request's int64 seed and the int64 position of the verifying row, clamped to at least
``4.6566127342e-10`` (spec ``vllm-semantics.md`` §1.6, vLLM ``tl_rand32``). Reimplementing Philox on
the host would be fragile (its word handling depends on the argument dtypes and on the Triton
version), so both the reference and the kernels draw the number through the same jitted helper:

* :func:`synthetic_u` -- ``@triton.jit`` helper, callable from any kernel with an int64 seed and an
  int64 position (scalars or blocks; Philox works element-wise, so a block gives the same numbers
  as one scalar call per element).
* :func:`synthetic_uniform_triton` -- host launcher over 1-D int64 tensors. CUDA/ROCm tensors run
  the compiled kernel; CPU tensors need ``TRITON_INTERPRET=1`` in the environment *before*
  ``triton``/``shardmax`` are imported (the interpreter is chosen when the kernel is decorated).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

RAND_MIN = 4.6566127342e-10
"""Lower clamp of the synthetic uniform (vLLM ``tl_rand32``): ``u`` is never 0."""

_BLOCK = 256


@triton.jit
def synthetic_u(seed, pos):
    """``max(tl.rand(seed, pos), 4.6566127342e-10)`` as fp32.

    ``seed`` and ``pos`` must be int64 (scalars or blocks of the same shape): the argument dtypes
    select Philox's word split, so other dtypes give other numbers than vLLM's.
    """
    u = tl.rand(seed, pos)
    return tl.maximum(u, 4.6566127342e-10)


@triton.jit
def _synthetic_uniform_kernel(seed_ptr, pos_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    seed = tl.load(seed_ptr + offs, mask=mask, other=0)
    pos = tl.load(pos_ptr + offs, mask=mask, other=0)
    tl.store(out_ptr + offs, synthetic_u(seed, pos), mask=mask)


def _interpreted() -> bool:
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - every supported Triton has it
        return False
    return isinstance(_synthetic_uniform_kernel, InterpretedFunction)


def synthetic_uniform_triton(seed: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Launch :func:`synthetic_u` element-wise.

    Args:
        seed: int64 ``[N]`` (one seed per element, already gathered through ``idx_mapping``).
        pos: int64 ``[N]`` positions, same device as ``seed``.

    Returns:
        fp32 ``[N]`` in ``[4.6566127342e-10, 1)`` on the input device.

    Raises:
        ValueError: wrong dtype/shape/device mix.
        RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.
    """
    if seed.dtype != torch.int64 or pos.dtype != torch.int64:
        raise ValueError(f"seed and pos must be int64, got {seed.dtype} and {pos.dtype}")
    if seed.dim() != 1 or seed.shape != pos.shape:
        raise ValueError(
            f"seed and pos must be 1-D of equal length, got {tuple(seed.shape)} and "
            f"{tuple(pos.shape)}"
        )
    if seed.device != pos.device:
        raise ValueError(f"seed on {seed.device} but pos on {pos.device}")
    n = seed.numel()
    out = torch.empty(n, dtype=torch.float32, device=seed.device)
    if n == 0:
        return out
    if seed.device.type == "cpu" and not _interpreted():
        raise RuntimeError(
            "synthetic_uniform on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 "
            "before importing triton/shardmax (or pass CUDA/ROCm tensors)"
        )
    seed = seed.contiguous()
    pos = pos.contiguous()
    grid = (triton.cdiv(n, _BLOCK),)
    _synthetic_uniform_kernel[grid](seed, pos, out, n, BLOCK=_BLOCK)
    return out
