"""vLLM's own ``rejection_sample`` on the logits tensor vLLM would verify: the parity oracle of
strict mode (tests only; needs vLLM's kernels importable -- an installed vLLM, or the minimal
tree ``scripts/vllm_kernels.sh`` extracts -- nothing of vLLM is copied into shardmax).

The tensor is built the way vLLM builds it (research §1.1, :func:`shardmax.ops.strict.vllm_row_stride`):
the ranks' padded shards concatenated (vLLM's all-gather of the LM-head output) and sliced to
``V`` columns -- the raw model-dtype view, row stride ``tp * W`` -- or, for a processed chunk, an
``empty_like(view, dtype=float32)`` copy with vLLM's temperature kernel applied in place and an
optional kept mask (top-k / top-p / min-p: values outside it become ``-inf``).
"""

from __future__ import annotations

import torch

from shardmax.testing.shards import default_pad_to, shard_like_vllm

__all__ = ["vllm_logits", "vllm_rejection_sample"]


def vllm_logits(
    full_logits: torch.Tensor,
    tp_size: int,
    expanded_idx_mapping: torch.Tensor,
    temperature: torch.Tensor,
    *,
    processed: bool,
    pad_to: int | None = None,
) -> torch.Tensor:
    """The ``[rows, V]`` tensor vLLM's verification reads (see the module docstring)."""
    from vllm.v1.worker.gpu.sample.gumbel import apply_temperature

    vocab = full_logits.shape[1]
    shards = shard_like_vllm(full_logits, tp_size, pad_to=pad_to or default_pad_to(vocab, tp_size))
    view = torch.cat([sh.local_logits for sh in shards], dim=1)[:, :vocab]
    if not processed:
        return view
    out = torch.empty_like(view, dtype=torch.float32).copy_(view)
    apply_temperature(out, expanded_idx_mapping, temperature)
    return out


def vllm_rejection_sample(
    target_logits: torch.Tensor,
    draft_sampled: torch.Tensor,
    cu_num_logits: torch.Tensor,
    pos: torch.Tensor,
    idx_mapping: torch.Tensor,
    expanded_idx_mapping: torch.Tensor,
    expanded_local_pos: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    num_speculative_steps: int,
    *,
    use_fp64_gumbel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``rejection_sample(target_logits, None, ...)`` (one-hot drafts): ``(sampled int64
    [num_reqs, K + 1], num_sampled int32 [num_reqs])``."""
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils import rejection_sample

    sampled, num_sampled = rejection_sample(
        target_logits,
        None,
        draft_sampled,
        cu_num_logits,
        pos,
        idx_mapping,
        expanded_idx_mapping,
        expanded_local_pos,
        temperature,
        seed,
        num_speculative_steps,
        None,
        use_fp64=use_fp64_gumbel,
    )
    return sampled, num_sampled
