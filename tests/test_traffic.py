"""The realistic traffic generator: LM-like entropy profile, drafts often right, vLLM's layout."""

from __future__ import annotations

import pytest
import torch

from shardmax.reference.sampled import verify_sampled
from shardmax.testing.traffic import (
    LM_PROFILE,
    EntropyProfile,
    lm_logits,
    realistic_batch,
    row_entropy,
)


def test_lm_logits_follow_the_entropy_profile() -> None:
    x = lm_logits(300, 2048, seed=0, dtype=torch.float32)
    h = row_entropy(x)
    assert float((h < 0.1).double().mean()) == pytest.approx(0.5, abs=0.08)
    assert float((h < 1.0).double().mean()) == pytest.approx(0.85, abs=0.06)
    q90 = float(torch.quantile(h.double(), 0.9))
    assert 1.5 < q90 < 2.6 and float(h.max()) < 4.2
    assert float(x.max(dim=1).values.min()) >= 8.0 and float(x.max()) <= 30.0
    flat = lm_logits(
        50, 4096, seed=1, profile=EntropyProfile(((3.0, 3.5, 1.0),)), dtype=torch.float32
    )
    assert float(row_entropy(flat).min()) > 2.9
    assert torch.equal(lm_logits(3, 100, seed=5), lm_logits(3, 100, seed=5))  # seeded


@pytest.mark.parametrize("mix", ["greedy", "temperature", "top_p"])
def test_realistic_batch_layout_and_acceptance(mix: str) -> None:
    b = realistic_batch(40, 3, 500, seed=2, mix=mix)
    assert b.logits.shape == (160, 500) and b.cu_num_logits.tolist() == list(range(0, 161, 4))
    cu = b.cu_num_logits.tolist()
    top = b.logits.float().argmax(dim=-1)
    hits = sum(
        int(b.draft_sampled[cu[r] + i + 1] == top[cu[r] + i]) for r in range(40) for i in range(3)
    )
    assert 0.7 < hits / 120 < 0.9  # draft_top_prob = 0.8
    res = verify_sampled(b.logits, *b.sampled_args(), **b.sampling_kwargs())
    acc = float((res[1].double() - 1).sum()) / 120
    assert 0.4 < acc < 0.9, acc
    assert (b.temperature[b.idx_mapping.long()] == (0.0 if mix == "greedy" else 1.0)).all()
    assert (b.top_p is not None) == (mix == "top_p")
    with pytest.raises(ValueError, match="mix"):
        realistic_batch(2, 3, 100, seed=0, mix="chat")
    assert LM_PROFILE.bins[0][2] == 0.5
