"""Exact nucleus / min-p reference and the sharded top-p guard (plain torch, no kernels).

The guard's contract: whenever it passes, the ids it keeps (from per-rank candidates and an LSE
accurate only to the compact exchange's bound) are exactly the exact nucleus of the full row.
Checked on rows of many entropies, TP 2/4, C 16/64, p 0.8-0.99, both vLLM pipelines, with the
LSE perturbed inside its error bound; plus planted boundary ties, nuclei larger than C,
p = 1 / p -> 0, min-p with top-k and top-p together.
"""

from __future__ import annotations

import math

import pytest
import torch

from shardmax.reference.nucleus import (
    GuardReason,
    candidates_of,
    exact_nucleus_keep,
    lse_error_bound,
    min_p_keep,
    nucleus_guard,
    top_k_keep,
)
from shardmax.testing.shards import vllm_shard_ranges


def _zipf_rows(n: int, vocab: int, alphas: list[float], seed: int) -> torch.Tensor:
    """Rows with logits ``-alpha * log(rank)`` + noise, ids shuffled (Zipf-like next-token
    distributions; larger alpha = lower entropy)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        a = alphas[i % len(alphas)]
        x = -a * torch.log(torch.arange(1, vocab + 1, dtype=torch.float64))
        x = x + 0.05 * torch.randn(vocab, generator=gen, dtype=torch.float64)
        rows.append(x[torch.randperm(vocab, generator=gen)].to(torch.float32))
    return torch.stack(rows)


def _guard_row(x: torch.Tensor, tp: int, c: int, p: float, rows_in_step: int, **kw):
    ranges = vllm_shard_ranges(x.numel(), tp, 64)
    cands = candidates_of(x, ranges, c)
    lse = float(torch.logsumexp(x.to(torch.float64), 0))
    finite = x[torch.isfinite(x)]
    return nucleus_guard(
        cands, lse, float(x.max()), float(finite.min()), p, rows_in_step=rows_in_step, **kw
    ), lse


def _ids(mask_row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(mask_row).flatten().tolist())


def test_exact_nucleus_definition() -> None:
    x = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]], dtype=torch.float32)
    for p, want in ((0.49, {0}), (0.51, {0, 1}), (0.79, {0, 1}), (0.81, {0, 1, 2}), (1, {0, 1, 2})):
        got = exact_nucleus_keep(x, torch.tensor([p]))
        assert _ids(got[0]) == want, (p, got)
    # p -> 0: the top token alone; ties in (value desc, id asc) order: lowest id first
    y = torch.tensor([[1.0, 3.0, 3.0, -0.0, 0.0]])
    assert _ids(exact_nucleus_keep(y, torch.tensor([1e-9]))[0]) == {1}
    assert _ids(top_k_keep(y, torch.tensor([2]))[0]) == {1, 2}
    assert _ids(top_k_keep(y, torch.tensor([4]))[0]) == {0, 1, 2, 3}  # -0.0 ties +0.0: id 3
    with pytest.raises(ValueError, match="NaN"):
        exact_nucleus_keep(torch.tensor([[0.0, math.nan]]), torch.tensor([0.9]))


def test_min_p_rule() -> None:
    x = torch.tensor([[0.0, -1.0, -2.0, -3.0]])
    thr = float(torch.tensor(0.0) + torch.log(torch.tensor(0.2)))  # -1.609
    assert _ids(min_p_keep(x, torch.tensor([0.2]))[0]) == {i for i in range(4) if -i >= thr}
    assert bool(min_p_keep(x, torch.tensor([0.0])).all())
    # order: min-p, then top-k, then top-p on the renormalised survivors
    keep = exact_nucleus_keep(x, torch.tensor([0.6]), torch.tensor([3]), torch.tensor([0.1]))
    surv = torch.tensor([0.0, -1.0, -2.0], dtype=torch.float64)
    probs = torch.softmax(surv, 0)  # 0.665, 0.245, 0.090
    assert probs[0] >= 0.6 and _ids(keep[0]) == {0}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("c", [16, 64])
def test_guard_never_passes_a_wrong_nucleus(tp: int, c: int) -> None:
    """The core property, with the LSE moved anywhere inside its error bound."""
    x = _zipf_rows(24, 6000, [0.6, 0.9, 1.2, 1.6, 2.2, 3.0], seed=tp * 100 + c)
    gen = torch.Generator().manual_seed(c)
    passed = 0
    for row in x:
        for p in (0.8, 0.9, 0.95, 0.99):
            want = _ids(exact_nucleus_keep(row[None], torch.tensor([p]))[0])
            for rows_in_step in (8, 100):
                d, lse = _guard_row(row, tp, c, p, rows_in_step)
                # the same guard with the LSE anywhere in [L - delta, L + delta]
                shift = (2 * torch.rand(1, generator=gen).item() - 1) * lse_error_bound(lse)
                ranges = vllm_shard_ranges(row.numel(), tp, 64)
                d2 = nucleus_guard(
                    candidates_of(row, ranges, c), lse + shift, float(row.max()),
                    float(row.min()), p, rows_in_step=rows_in_step,
                )  # fmt: skip
                for dec in (d, d2):
                    if dec:
                        passed += 1
                        assert set(dec.kept_ids) == want
    assert passed > 0


def test_planted_ties_and_wide_nuclei_fall_back() -> None:
    row = _zipf_rows(1, 4000, [2.0], seed=3)[0]
    want = _ids(exact_nucleus_keep(row[None], torch.tensor([0.9]))[0])
    d, _ = _guard_row(row, 2, 64, 0.9, 8)
    assert d and set(d.kept_ids) == want
    # tie the last kept value with the first excluded one
    order = torch.sort(row, descending=True, stable=True).indices
    j = len(want)
    tied = row.clone()
    tied[order[j]] = tied[order[j - 1]]
    d, _ = _guard_row(tied, 2, 64, 0.9, 8)
    assert d.reason in (GuardReason.TIE_STRADDLE, GuardReason.MASS_MARGIN)
    # a nucleus larger than the candidates
    flat = _zipf_rows(1, 4000, [0.3], seed=4)[0]
    d, _ = _guard_row(flat, 2, 16, 0.95, 8)
    assert d.reason == GuardReason.NOT_COVERED
    # NaN in the row
    bad = row.clone()
    bad[5] = math.nan
    ranges = vllm_shard_ranges(4000, 2, 64)
    d = nucleus_guard(candidates_of(row, ranges, 64), 0.0, float(row.max()), float(row.min()),
                      0.9, rows_in_step=8, has_nan=True)  # fmt: skip
    assert d.reason == GuardReason.NAN


def test_p_one_and_tiny_p() -> None:
    row = _zipf_rows(1, 3000, [1.5], seed=5)[0]
    d, _ = _guard_row(row, 2, 64, 1e-6, 8)
    assert d and d.kept_ids == (int(torch.argmax(row)),)
    with pytest.raises(ValueError, match="nothing to guard"):
        _guard_row(row, 2, 64, 1.0, 8)
    # p = 1 with top-k: the kept k
    d, _ = _guard_row(row, 2, 64, 1.0, 8, top_k=10)
    assert d and set(d.kept_ids) == _ids(top_k_keep(row[None], torch.tensor([10]))[0])
    d, _ = _guard_row(row, 2, 16, 1.0, 8, top_k=16)
    assert d.reason == GuardReason.NOT_COVERED


@pytest.mark.parametrize("rows_in_step", [8, 100])
def test_min_p_with_top_k_and_top_p(rows_in_step: int) -> None:
    x = _zipf_rows(24, 5000, [1.0, 1.5, 2.5], seed=rows_in_step)
    n_ok = 0
    for row in x:
        for mp, k, p in (
            (0.05, 0, 1.0), (0.02, 20, 1.0), (0.0, 20, 0.9), (0.02, 20, 0.9), (0.01, 40, 0.95),
            (0.1, 0, 0.8),
        ):  # fmt: skip
            want = _ids(
                exact_nucleus_keep(
                    row[None], torch.tensor([p]), torch.tensor([k]), torch.tensor([mp])
                )[0]
            )
            d, _ = _guard_row(row, 4, 64, p, rows_in_step, top_k=k, min_p=mp)
            if mp > 0 and p < 1:  # min-p with top-p: never reproduced (see the test below)
                assert d.reason == GuardReason.NOT_CONVERGED
            if d:
                n_ok += 1
                assert set(d.kept_ids) == want, (mp, k, p)
            else:
                assert d.reason != GuardReason.OK
    assert n_ok > len(x)  # the rules pass most of these peaked rows


def test_min_p_coverage_and_margin() -> None:
    row = torch.zeros(3000)  # every value survives min-p: candidates cannot cover them
    d, _ = _guard_row(row, 2, 16, 1.0, 8, min_p=0.5)
    assert d.reason == GuardReason.MIN_P_NOT_COVERED
    row = _zipf_rows(1, 3000, [2.0], seed=8)[0]
    m = float(row.max())
    thr = float(torch.tensor(m) + torch.log(torch.tensor(0.1)))
    order = torch.sort(row, descending=True).indices
    row[order[3]] = thr  # exactly on the threshold
    d, _ = _guard_row(row, 2, 64, 1.0, 8, min_p=0.1)
    assert d.reason == GuardReason.MIN_P_MARGIN


def _pack_pair(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    h = hi.to(torch.float32).view(torch.int32).to(torch.int64)
    lw = lo.to(torch.float32).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return (h << 32) | lw


def test_tiny_p_whose_trim_vllm_rounds_is_flagged() -> None:
    """A top-p far below the top token's probability: vLLM trims ``uint32((C_1 - p) / p_1)``
    boundary ties in fp32, which rounds to 1 there -- the top token trimmed, every logit masked,
    token 0 sampled (vLLM 0.32 / 0.33, found by a review) -- so the guard flags the row
    (MASS_MARGIN) where the budget ``p`` is within those roundings, in the reference and in the
    ``sampled_merge`` kernel, and still passes a budget well above them (``p`` = 1e-6 on a row
    whose top token has ~1/4 of the mass: ``test_p_one_and_tiny_p``)."""
    from shardmax.reference.nucleus import FP32_EPS

    row = torch.randn(600, generator=torch.Generator().manual_seed(3)) * 2.0
    row[17] += 30.0  # one token with almost all the mass
    for p, flagged in ((1e-8, True), (3 * FP32_EPS * 0.99, True), (1e-5, False)):
        d, _ = _guard_row(row, 2, 64, p, 100)
        want = GuardReason.MASS_MARGIN if flagged else GuardReason.OK
        assert d.reason == want, (p, d.reason)
        if not flagged:
            assert d.kept_ids == (17,)
    *_, unsafe = _merge_rows(row[None].expand(3, -1).clone(), torch.tensor([1e-8, 3.5e-7, 1e-5]))
    assert unsafe.tolist() == [3, 3, 0]


def _merge_rows(
    x: torch.Tensor,
    top_p: torch.Tensor,
    rows_in_step: int = 100,
    top_k: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sampled_merge`` on rows ``x`` of one rank whose candidates are its exact top 64 keys:
    (merged candidates, the rank's candidates, kept count, guard code) per row."""
    from shardmax.ops.sampled import merge_candidates
    from shardmax.runtime.keys import pack_keys
    from shardmax.runtime.validation import check_step_batch

    c = 64
    n, vocab = x.shape
    keys = pack_keys(x, torch.arange(vocab).expand(n, vocab))
    cand = torch.topk(keys, c, dim=1).values  # one part's candidates: its exact top-C keys
    m = x.max(dim=1).values
    s = torch.exp(x - m[:, None]).sum(dim=1)
    words = torch.zeros(n, 4, dtype=torch.int64)  # one part: key, (m, s), (xd, flag), min
    words[:, 1] = _pack_pair(m, s)
    words[:, 3] = _pack_pair(x.min(dim=1).values, torch.zeros(n))
    gathered = torch.cat([words.view(-1), cand.view(-1)]).view(1, -1)
    batch = check_step_batch(
        n, x.device, torch.zeros(n, dtype=torch.int32), torch.arange(n + 1, dtype=torch.int32),
        torch.zeros(n, dtype=torch.int64), torch.arange(n, dtype=torch.int32),
        torch.zeros(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int64), 1,
        temperature=torch.ones(n), top_k=top_k, top_p=top_p, min_p=min_p,
    )  # fmt: skip
    merged = torch.empty((n, c), dtype=torch.int64)
    keep = torch.empty(n, dtype=torch.int32)
    unsafe = torch.empty(n, dtype=torch.int8)
    merge_candidates(
        gathered, 1, n, 4, torch.arange(n), batch, (merged, keep, unsafe), vocab=vocab,
        candidates=c, rows_in_step=rows_in_step,
    )  # fmt: skip
    return merged, cand, keep, unsafe


@pytest.mark.parametrize("rows_in_step", [8, 100])
def test_sampled_merge_keeps_the_exact_nucleus(rows_in_step: int) -> None:
    """The ``sampled_merge`` kernel (merge + kept count + guard of the sharded finish), one rank:
    on every row it calls safe, the kept count is the exact nucleus size (after min-p and top-k).
    ``rows_in_step`` switches the convergence rule between vLLM's split and monolithic pipeline."""
    vocab = 3000
    x = _zipf_rows(40, vocab, [0.8, 1.1, 1.5, 2.0, 3.0], seed=rows_in_step)
    n = x.shape[0]
    gen = torch.Generator().manual_seed(1)
    top_p = torch.tensor([0.8, 0.9, 0.95, 0.99, 1.0])[torch.randint(0, 5, (n,), generator=gen)]
    min_p = torch.tensor([0.0, 0.0, 0.02])[torch.randint(0, 3, (n,), generator=gen)]
    top_k = torch.tensor([0, 0, 20])[torch.randint(0, 3, (n,), generator=gen)]
    top_p[(top_p >= 1) & (min_p == 0)] = 0.9  # every row has a rule
    merged, cand, keep, unsafe = _merge_rows(x, top_p, rows_in_step, top_k=top_k, min_p=min_p)
    assert torch.equal(merged, cand)  # one part: its whole list is the exact prefix
    want = exact_nucleus_keep(x, top_p, top_k, min_p).sum(dim=1)
    safe = unsafe == 0
    assert int(safe.sum()) >= n // 3
    assert torch.equal(keep[safe].to(torch.int64), want[safe]), (keep[safe], want[safe])


def test_split_pipeline_model() -> None:
    """The modelled split top-p search: a peaked row converges to the exact nucleus; a flat row
    (every probability on the ladder's end point) never converges and keeps everything, a
    superset the guard must not pass."""
    from shardmax.reference.nucleus import split_pipeline_model_keep

    x = _zipf_rows(1, 3000, [1.5], seed=3)[0]
    keep, converged = split_pipeline_model_keep(x, 0.9)
    assert converged
    assert torch.equal(keep, exact_nucleus_keep(x[None], torch.tensor([0.9]))[0])
    flat = torch.zeros(1000)
    keep, converged = split_pipeline_model_keep(flat, 0.95)
    assert not converged and int(keep.sum()) == 1000
    assert int(exact_nucleus_keep(flat[None], torch.tensor([0.95]))[0].sum()) == 950
    d, _ = _guard_row(flat, 2, 64, 0.95, 8)
    assert not d
    with pytest.raises(ValueError, match="top_p"):
        split_pipeline_model_keep(flat, 0.0)


def test_min_p_with_top_p_is_not_reproduced() -> None:
    """An adversarial review's row: min-p 0.1 keeps {31, 39} (``p39 / p31 = e**-1.75``) and the
    exact nucleus of those survivors at top-p 0.9 is both, but vLLM's top-p search on the
    min-p-masked row keeps 31 alone -- so every row with both rules is flagged (guard and the
    kernels), and min-p alone still passes."""
    from shardmax.ops.sampled import FallbackReason
    from shardmax.testing.emulate_sampled import emulate_verify

    x = torch.full((256,), -5.0)
    x[31], x[39] = 2.0, 0.25
    d, _ = _guard_row(x, 2, 64, 0.9, 8, min_p=0.1)
    assert d.reason == GuardReason.NOT_CONVERGED
    d, _ = _guard_row(x, 2, 64, 1.0, 8, min_p=0.1)
    assert d.reason == GuardReason.OK and set(d.kept_ids) == {31, 39}
    logits = x[None].to(torch.bfloat16)
    one = torch.tensor([1.0])
    args = (
        torch.tensor([7], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([1234]), torch.tensor([0], dtype=torch.int32),
        torch.tensor([0], dtype=torch.int32), one, torch.tensor([77]), 1,
    )  # fmt: skip
    res = emulate_verify(logits, 2, *args, top_p=torch.tensor([0.9]), min_p=torch.tensor([0.1]))
    assert res.reason.tolist() == [FallbackReason.NUCLEUS_NOT_CONVERGED]
    res = emulate_verify(logits, 2, *args, min_p=torch.tensor([0.1]))
    assert not bool(res.fallback.any())
