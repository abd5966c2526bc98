"""Findings of the adversarial review, kept as regression tests.

Non-contiguous index tensors, malformed batches with value checks off (never an out-of-bounds
read), an empty vocabulary, malformed tuned tables and overrides, the generator's stale check
in another checkout, and the Triton interpreter's bf16-subnormal conversion (upstream bug).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import shardmax
from generator.render import render_all, stale_files
from shardmax.runtime import dispatch
from shardmax.runtime.validation import value_checks
from shardmax.testing import random_verify_batch


def _verify(b, **over):
    names = [
        "draft_sampled",
        "cu_num_logits",
        "pos",
        "idx_mapping",
        "expanded_local_pos",
        "seed",
        "num_speculative_steps",
    ]
    args = dict(zip(names, b.args(), strict=True))
    kwargs = dict(b.kwargs())
    for k, v in over.items():
        (args if k in args else kwargs)[k] = v
    return shardmax.sharded_greedy_verify(b.logits, *args.values(), vocab_start=0, **kwargs)


def _strided(t: torch.Tensor) -> torch.Tensor:
    big = torch.full((2 * t.shape[0],), 7, dtype=t.dtype)
    big[::2] = t
    return big[::2]


@pytest.mark.parametrize(
    "name",
    [
        "draft_sampled",
        "cu_num_logits",
        "pos",
        "idx_mapping",
        "seed",
        "seq_lens",
        "prefill_len",
        "synthetic_conditional_rates",
    ],
)
def test_non_contiguous_index_tensors(name: str) -> None:
    b = random_verify_batch(4, 3, 300, seed=1, synthetic=True)
    want = b.reference()
    value = (
        b.kwargs()[name]
        if name in b.kwargs()
        else dict(
            zip(
                [
                    "draft_sampled",
                    "cu_num_logits",
                    "pos",
                    "idx_mapping",
                    "expanded_local_pos",
                    "seed",
                ],
                b.args(),
                strict=False,
            )
        )[name]
    )
    got = _verify(b, **{name: _strided(value)})
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w), name


@pytest.mark.parametrize(
    "bad",
    [
        {"idx_mapping": torch.tensor([1_000_000, 1], dtype=torch.int32)},
        {"idx_mapping": torch.tensor([-1_000_000, 1], dtype=torch.int32)},
        {"cu_num_logits": torch.tensor([-1_000_000, 2, 4], dtype=torch.int32)},
        {"cu_num_logits": torch.tensor([0, 1_000_000, 4], dtype=torch.int32)},
    ],
)
def test_malformed_batch_with_checks_off_never_reads_out_of_bounds(bad) -> None:
    b = random_verify_batch(2, 2, 200, seed=3, synthetic=True, prefill_prob=0.0)
    b.cu_num_logits = torch.tensor([0, 2, 4], dtype=torch.int32)
    b.logits = b.logits[:4]
    b.draft_sampled, b.pos, b.expanded_local_pos = (
        t[:4] for t in (b.draft_sampled, b.pos, b.expanded_local_pos)
    )
    with value_checks(False):
        sampled, num_sampled, num_rejected = _verify(b, **bad)  # unspecified, but no crash
    assert num_rejected.shape == (2,)
    assert sampled.shape == (2, 3) and num_sampled.shape == (2,)
    with pytest.raises(ValueError):
        _verify(b, **bad)  # value checks on: a clear error


def test_empty_vocabulary_is_an_error() -> None:
    with pytest.raises(ValueError, match="num_valid: 0 real columns"):
        shardmax.vocab_parallel_argmax(torch.randn(3, 64), vocab_start=0, num_valid=0)
    with pytest.raises(ValueError, match="num_valid: 0 real columns"):
        shardmax.vocab_parallel_argmax(torch.empty(3, 0), vocab_start=0)


def _table(rows):
    return {
        "schema": 1,
        "arch": "sm90",
        "op": "argmax",
        "tuned": True,
        "provenance": {},
        "rows": rows,
    }


GOOD = {
    "match": {},
    "variant": "shard_keys_bf16_va16_b4096",
    "launch": {"splits": 2, "num_warps": 8, "num_stages": 2, "transport": "allgather"},
}


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"variant": "plain", "launch": {}}, GOOD], 'needs a "match"'),
        ([{**GOOD, "match": []}], 'needs a "match"'),
        ([{**GOOD, "match": {"tp": "2"}}, GOOD], "match tp='2'"),
        ([{**GOOD, "match": {"dtype": "bfloat16"}}, GOOD], "match dtype='bfloat16'"),
        ([{**GOOD, "match": {"rows_le": "32"}}, GOOD], "match rows_le='32'"),
        ([{**GOOD, "launch": {**GOOD["launch"], "transport": "nccl"}}], "transport must be"),
        ([{**GOOD, "launch": {**GOOD["launch"], "num_warps": 3}}], "num_warps must be"),
        ([{**GOOD, "launch": {**GOOD["launch"], "splits": 0}}], "splits must be"),
        ([{**GOOD, "variant": "shard_keys_bf16_va16_b999"}], "not in shardmax.generated"),
        ([{**GOOD, "match": {"tp": 2}}], "last row must be the catch-all"),
    ],
)
def test_malformed_tables_are_rejected(rows, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        dispatch.validate_table(_table(rows))


def test_table_file_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "argmax.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"argmax\.json: not valid JSON"):
        dispatch.load_table(path)
    with pytest.raises(ValueError, match="rows must be a non-empty list"):
        dispatch.validate_table({**_table([]), "rows": {"a": 1}})
    bad = _table([GOOD])
    bad["op"] = "sample"
    with pytest.raises(ValueError, match="op 'sample'"):
        dispatch.validate_table(bad)
    assert json.loads(json.dumps(_table([GOOD])))  # the good one passes
    dispatch.validate_table(_table([GOOD]))


def test_override_validates_its_fields() -> None:
    for bad in ({"splits": 0}, {"splits": -1}, {"transport": "bogus"}, {"num_warps": 3}):
        with pytest.raises(ValueError), dispatch.override(**bad):
            pass
    with pytest.raises(TypeError, match="unknown fields"), dispatch.override(block=4):
        pass


def test_generator_check_sees_its_own_checkout(tmp_path: Path) -> None:
    gen = Path(__file__).resolve().parent.parent / "generated"
    copy = tmp_path / "generated"
    shutil.copytree(gen, copy)
    files = render_all()
    assert stale_files(copy, files) == []
    target = copy / "shard_keys_fp32_va1_b1024.py"
    target.write_text(target.read_text().replace("x > best", "x >= best"))
    assert stale_files(copy, files) == ["shard_keys_fp32_va1_b1024.py"]


def test_bf16_subnormals() -> None:
    y = torch.tensor([[0.0, 2e-39, 3e-39]], dtype=torch.bfloat16)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    got = shardmax.vocab_parallel_argmax(y.to(dev), vocab_start=0)
    assert torch.equal(got.cpu(), torch.argmax(y, dim=1))


def test_plain_path_through_the_public_ops() -> None:
    """``plain`` (what a table picks where sharding does not pay) gives the same answers."""
    b = random_verify_batch(6, 3, 3000, seed=9, synthetic=True)
    with dispatch.override(variant="plain"):
        ids = shardmax.vocab_parallel_argmax(b.logits, vocab_start=0)
        got = _verify(b)
    assert torch.equal(ids, torch.argmax(b.logits, dim=-1))
    for g, w in zip(got, b.reference(), strict=True):
        assert torch.equal(g, w)
