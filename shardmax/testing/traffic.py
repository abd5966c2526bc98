"""Realistic verification traffic: LM-like logits and drafts that are often right.

Every claim about coverage (how many requests run sharded) or speed is made on rows like a
language model's, not on random-normal rows (whose nuclei are thousands of tokens wide, and
whose fallback rate says nothing about real traffic).

* :data:`LM_PROFILE` -- the entropy profile of decode-time target rows measured on chat traffic
  (issue 18): about half the rows under 0.1 nat, ~85 % under 1 nat, the 90th percentile near 2
  nats, a tail to ~4 nats. :class:`EntropyProfile` makes other profiles.
* :func:`lm_logits` -- ``[rows, V]`` logits with a Zipf-like shape per row (a random id order,
  a power-law value ladder, noise), scaled so that each row's entropy at ``T = 1`` is drawn from
  the profile; a random offset keeps the values in an LM's range (max 8-30).
* :func:`realistic_batch` -- a decode step of ``num_reqs`` requests with ``K`` drafts each
  (vLLM's layout, spec §1.2-§1.3): the draft verified by a row is that row's top token with
  probability ``draft_top_prob`` and a random other token otherwise, and every request carries
  the sampling parameters of the traffic mix (``"greedy"``, ``"temperature"`` = T 1.0, or
  ``"top_p"`` = T 1.0 / top-p 0.95 -- the models' defaults -- or any given per-slot tensors).

All of it is seeded and built on the CPU with a private generator, then moved to ``device``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "LM_PROFILE",
    "MIXES",
    "EntropyProfile",
    "TrafficBatch",
    "lm_logits",
    "realistic_batch",
    "row_entropy",
]


@dataclass(frozen=True)
class EntropyProfile:
    """Row entropies (nats, at T = 1) as a mixture of uniform bins ``(low, high, weight)``."""

    bins: tuple[tuple[float, float, float], ...]

    def sample(self, n: int, gen: torch.Generator) -> torch.Tensor:
        """``n`` target entropies (fp64)."""
        w = torch.tensor([b[2] for b in self.bins], dtype=torch.float64)
        which = torch.multinomial(w / w.sum(), n, replacement=True, generator=gen)
        lo = torch.tensor([b[0] for b in self.bins], dtype=torch.float64)[which]
        hi = torch.tensor([b[1] for b in self.bins], dtype=torch.float64)[which]
        return lo + (hi - lo) * torch.rand(n, generator=gen, dtype=torch.float64)


LM_PROFILE = EntropyProfile(
    ((0.0, 0.1, 0.50), (0.1, 1.0, 0.35), (1.0, 2.0, 0.05), (2.0, 4.0, 0.10))
)
"""Half the rows under 0.1 nat, 85 % under 1 nat, the 90th percentile at 2 nats, a tail to 4."""


def row_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Softmax entropy (nats, fp64) of every row of ``logits / temperature``; -inf entries are
    zero-probability tokens."""
    x = (logits.float() if logits.dtype != torch.float64 else logits) / temperature
    p = torch.softmax(x, dim=-1)
    logp = torch.log_softmax(x, dim=-1)
    return -(torch.where(p > 0, p * logp, torch.zeros_like(p))).sum(dim=-1)


def lm_logits(
    rows: int,
    vocab: int,
    *,
    seed: int,
    dtype: torch.dtype = torch.bfloat16,
    profile: EntropyProfile = LM_PROFILE,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """``[rows, vocab]`` logits whose rows look like a language model's (module docstring).

    Per row: values ``-log(1 + rank) + 0.05 * noise`` over a random permutation of the ids,
    multiplied by the scale whose softmax entropy is the row's target (40 bisection steps on the
    log-scale; on ``device``), then shifted by a random offset in ``[8, 30]`` and cast to
    ``dtype`` (whose rounding moves the entropy by a little and makes ties, as real bf16 logits
    have).

    Raises:
        ValueError: ``rows < 0`` or ``vocab < 2``.
    """
    if rows < 0 or vocab < 2:
        raise ValueError(f"rows={rows}, vocab={vocab}: expected rows >= 0 and vocab >= 2")
    gen = torch.Generator().manual_seed(seed)
    dev = torch.device(device)
    target = profile.sample(rows, gen).clamp(max=0.98 * float(torch.log(torch.tensor(vocab))))
    noise = torch.randn(rows, vocab, generator=gen)
    offset = 8.0 + 22.0 * torch.rand(rows, 1, generator=gen)
    perm = torch.argsort(torch.rand(rows, vocab, generator=gen), dim=1)
    ladder = -torch.log1p(torch.arange(vocab, dtype=torch.float32, device=dev))
    shape = ladder[None, :] + 0.05 * noise.to(dev)
    shape = shape - shape.max(dim=1, keepdim=True).values
    target = target.to(dev)
    lo = torch.full((rows,), 1e-3, dtype=torch.float64, device=dev)  # bisection on log(scale)
    hi = torch.full((rows,), 1e4, dtype=torch.float64, device=dev)
    for _ in range(40):
        mid = (lo * hi).sqrt()
        h = row_entropy(shape * mid[:, None].float())
        hotter = h > target  # entropy falls as the scale grows
        lo = torch.where(hotter, mid, lo)
        hi = torch.where(hotter, hi, mid)
    scaled = shape * (lo * hi).sqrt()[:, None].float() + offset.to(dev)
    out = torch.empty(rows, vocab, dtype=torch.float32, device=dev)
    out.scatter_(1, perm.to(dev), scaled)
    return out.to(dtype)


MIXES = ("greedy", "temperature", "top_p")
"""Traffic mixes of :func:`realistic_batch`: every request greedy; T = 1.0 (temperature only);
T = 1.0 with top-p 0.95 (the chat default of current models)."""


@dataclass
class TrafficBatch:
    """One decode step in vLLM's layout (fields as :class:`shardmax.testing.VerifyBatch`, plus
    per-slot sampling tensors); ``logits`` is the full unpadded ``[num_logits, V]``."""

    logits: torch.Tensor
    draft_sampled: torch.Tensor  # int32 [num_logits]
    cu_num_logits: torch.Tensor  # int32 [num_reqs + 1]
    pos: torch.Tensor  # int64 [num_logits]
    idx_mapping: torch.Tensor  # int32 [num_reqs]
    expanded_local_pos: torch.Tensor  # int32 [num_logits]
    seed: torch.Tensor  # int64 [max_num_reqs]
    num_speculative_steps: int
    temperature: torch.Tensor  # fp32 [max_num_reqs]
    top_k: torch.Tensor | None = None  # int32 [max_num_reqs]
    top_p: torch.Tensor | None = None  # fp32 [max_num_reqs]
    min_p: torch.Tensor | None = None  # fp32 [max_num_reqs]
    seq_lens: torch.Tensor | None = None
    prefill_len: torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return int(self.idx_mapping.shape[0])

    def greedy_args(self) -> tuple[Any, ...]:
        """Positional args of ``sharded_greedy_verify`` after ``local_logits``."""
        return (self.draft_sampled, self.cu_num_logits, self.pos, self.idx_mapping,
                self.expanded_local_pos, self.seed, self.num_speculative_steps)  # fmt: skip

    def sampled_args(self) -> tuple[Any, ...]:
        """Positional args of ``sharded_verify`` after ``local_logits``."""
        return (self.draft_sampled, self.cu_num_logits, self.pos, self.idx_mapping,
                self.expanded_local_pos, self.temperature, self.seed,
                self.num_speculative_steps)  # fmt: skip

    def sampling_kwargs(self) -> dict[str, Any]:
        """``top_k`` / ``top_p`` / ``min_p`` that are set, and the prefill tensors."""
        kw = {
            k: getattr(self, k) for k in ("top_k", "top_p", "min_p") if getattr(self, k) is not None
        }
        return {**kw, "seq_lens": self.seq_lens, "prefill_len": self.prefill_len}


def realistic_batch(
    num_reqs: int,
    num_speculative_steps: int,
    vocab: int,
    *,
    seed: int,
    mix: str = "top_p",
    dtype: torch.dtype = torch.bfloat16,
    draft_top_prob: float = 0.8,
    profile: EntropyProfile = LM_PROFILE,
    device: str | torch.device = "cpu",
) -> TrafficBatch:
    """A decode step of ``num_reqs`` requests with ``K`` drafts each on LM-like logits.

    ``num_logits = num_reqs * (K + 1)``. Row ``cu[r] + i`` verifies ``draft_sampled[cu[r] + i +
    1]``, its top token with probability ``draft_top_prob`` (else a uniformly random other id);
    the acceptance rate that results depends on the rows' entropies and the mix (measured: see
    ``tests/test_traffic.py``). ``mix`` is one of :data:`MIXES`.
    Request-state slots are a random injection into ``2 * num_reqs + 1`` slots, seeds random,
    positions random, nobody prefilling.

    Raises:
        ValueError: an unknown ``mix``, ``K < 1`` or ``draft_top_prob`` outside ``[0, 1]``.
    """
    if mix not in MIXES:
        raise ValueError(f"mix: {mix!r}, expected one of {MIXES}")
    k = num_speculative_steps
    if k < 1 or not 0.0 <= draft_top_prob <= 1.0:
        raise ValueError(f"K={k}, draft_top_prob={draft_top_prob}: expected K >= 1, p in [0, 1]")
    gen = torch.Generator().manual_seed(seed + 1)
    rows = num_reqs * (k + 1)
    logits = lm_logits(rows, vocab, seed=seed, dtype=dtype, profile=profile, device=device).cpu()
    top = torch.argmax(logits.float(), dim=-1)
    other = (top + 1 + torch.randint(0, vocab - 1, (rows,), generator=gen)) % vocab
    verified = torch.where(torch.rand(rows, generator=gen) < draft_top_prob, top, other)
    draft = torch.randint(0, vocab, (rows,), generator=gen)  # the last sampled tokens
    starts = torch.arange(num_reqs) * (k + 1)
    for i in range(k):  # the draft row cu[r] + i verifies is read at cu[r] + i + 1
        draft[starts + i + 1] = verified[starts + i]
    max_reqs = 2 * num_reqs + 1
    idx = torch.randperm(max_reqs, generator=gen)[:num_reqs].to(torch.int32)
    pos = (torch.randint(0, 100_000, (num_reqs, 1), generator=gen) + torch.arange(k + 1)).view(-1)
    temp = torch.full((max_reqs,), 0.0 if mix == "greedy" else 1.0)
    b = TrafficBatch(
        logits=logits,
        draft_sampled=draft.to(torch.int32),
        cu_num_logits=(torch.arange(num_reqs + 1) * (k + 1)).to(torch.int32),
        pos=pos.to(torch.int64),
        idx_mapping=idx,
        expanded_local_pos=torch.arange(k + 1).repeat(num_reqs).to(torch.int32),
        seed=torch.randint(-(2**62), 2**62, (max_reqs,), generator=gen, dtype=torch.int64),
        num_speculative_steps=k,
        temperature=temp,
        top_p=torch.full((max_reqs,), 0.95) if mix == "top_p" else None,
    )
    for name in ("draft_sampled", "cu_num_logits", "pos", "idx_mapping", "expanded_local_pos",
                 "seed", "temperature", "top_p", "logits"):  # fmt: skip
        t = getattr(b, name)
        if t is not None:
            setattr(b, name, t.to(device))
    return b
