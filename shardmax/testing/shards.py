"""Split full logits into vocab shards exactly as vLLM's ``VocabParallelEmbedding`` lays them out.

Spec ``vllm-semantics.md`` §4.1 (no added/LoRA vocabulary): ``padded = ceil(V / pad_to) * pad_to``,
``P = padded / tp`` (must divide), rank ``r`` holds global ids ``[min(r*P, V), min((r+1)*P, V))``
in its first ``num_valid`` local columns and padding in the remaining ``P - num_valid`` columns
(only the rank(s) whose padded range crosses ``V`` have padding; a rank past ``V`` has
``num_valid == 0``).

In vLLM the padding columns hold zero (or the bias). Here they hold values that WOULD WIN if a
kernel forgot to mask them, so a missing mask is caught by any exact comparison:

* row ``b % 3 == 0``: NaN (beats every number),
* row ``b % 3 == 1``: ``+inf``,
* row ``b % 3 == 2``: the dtype's largest finite value.

(For a row whose real logits already contain NaN/+inf/that maximum at a lower id the padding would
only tie and lose on id; random or adversarial rows rarely do -- tests that assert "padding would
win" use random-normal rows.)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["Shard", "shard_like_vllm", "vllm_shard_ranges"]


class Shard(NamedTuple):
    """One rank's view: padded local logits ``[B, P]``, first global id, real column count."""

    local_logits: torch.Tensor
    vocab_start: int
    num_valid: int


def default_pad_to(vocab: int, tp_size: int) -> int:
    """vLLM's padding (64) when the padded vocab splits evenly over ``tp_size`` ranks, else
    ``64 * tp_size`` (what a deployment with a non-power-of-two TP size has to configure)."""
    if tp_size < 1:
        raise ValueError(f"tp_size={tp_size} < 1")
    padded = -(-vocab // 64) * 64
    return 64 if padded % tp_size == 0 else 64 * tp_size


def vllm_shard_ranges(vocab: int, tp_size: int, pad_to: int = 64) -> list[tuple[int, int, int]]:
    """``(vocab_start, num_valid, width)`` of every rank, vLLM's layout (spec §4.1).

    Raises:
        ValueError: ``vocab < 1``, ``tp_size < 1``, ``pad_to < 1``, or the padded vocabulary not
            divisible by ``tp_size``.
    """
    if vocab < 1:
        raise ValueError(f"vocab={vocab} < 1")
    if tp_size < 1:
        raise ValueError(f"tp_size={tp_size} < 1")
    if pad_to < 1:
        raise ValueError(f"pad_to={pad_to} < 1")
    padded = -(-vocab // pad_to) * pad_to
    if padded % tp_size:
        raise ValueError(
            f"padded vocab {padded} (vocab={vocab} padded to a multiple of {pad_to}) is not "
            f"divisible by tp_size={tp_size}"
        )
    width = padded // tp_size
    out = []
    for r in range(tp_size):
        start = min(r * width, vocab)
        end = min((r + 1) * width, vocab)
        out.append((start, end - start, width))
    return out


def _padding_value(row: int, dtype: torch.dtype) -> float:
    kind = row % 3
    if kind == 0:
        return float("nan")
    if kind == 1:
        return float("inf")
    return float(torch.finfo(dtype).max)


def shard_like_vllm(full_logits: torch.Tensor, tp_size: int, pad_to: int = 64) -> list[Shard]:
    """Split ``full_logits [B, V]`` into ``tp_size`` padded shards, vLLM's layout.

    Args:
        full_logits: ``[B, V]`` float tensor (any dtype/device), the unpadded vocabulary.
        tp_size: number of ranks (>= 1).
        pad_to: vocabulary padding multiple (vLLM ``DEFAULT_VOCAB_PADDING_SIZE = 64``).

    Returns:
        One :class:`Shard` per rank, in rank order. Each ``local_logits`` is a new contiguous
        ``[B, P]`` tensor of the input dtype and device; columns ``>= num_valid`` are filled with
        a would-win value (see module docstring). Example: ``V = 32001, tp = 2`` ->
        ``Shard(_, 0, 16032)``, ``Shard(_, 16032, 15969)`` with 63 padding columns, ``P = 16032``.

    Raises:
        ValueError: not 2-D, ``V < 1``, ``tp_size < 1``, ``pad_to < 1``, or the padded
            vocabulary not divisible by ``tp_size`` (the message names the numbers).
    """
    if full_logits.dim() != 2:
        raise ValueError(f"full_logits must be 2-D [B, V], got shape {tuple(full_logits.shape)}")
    rows, vocab = full_logits.shape
    ranges = vllm_shard_ranges(vocab, tp_size, pad_to)
    fill = torch.tensor(
        [_padding_value(b, full_logits.dtype) for b in range(rows)], dtype=full_logits.dtype
    ).to(full_logits.device)
    shards = []
    for start, num_valid, width in ranges:
        local = torch.empty((rows, width), dtype=full_logits.dtype, device=full_logits.device)
        local[:, :num_valid] = full_logits[:, start : start + num_valid]
        local[:, num_valid:] = fill[:, None]
        shards.append(Shard(local, start, num_valid))
    return shards
