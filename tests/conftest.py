"""Test configuration: CPU runs execute every Triton kernel under the Triton interpreter.

``TRITON_INTERPRET=1`` is set before anything imports Triton when no GPU is present, so the
same tests exercise every generated variant on CPU tensors. Tests marked ``gpu`` skip without a
CUDA/ROCm device; ``multigpu`` ones need two. Tests marked ``slow`` are deselected by
``pyproject.toml``'s ``addopts``; ``SHARDMAX_SLOW_TESTS=1`` (or ``scripts/test.sh --slow``, or
any ``-m`` expression on the command line) brings them back.

Warnings: ``pyproject.toml`` turns every RuntimeWarning and every warning from the project's own
modules into an error. Tests marked ``e2e`` run vLLM's own code and kernels in this process;
their warnings are vLLM's, so those tests keep pytest's default (warnings shown, not fatal).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


DEFAULT_MARKEXPR = "not e2e and not slow"

# Parametrizations marked ``slow`` here (their files belong to other work; the marker is the
# only change): the default run keeps a covering subset, so every class of behaviour still runs.
# test_every_local_variant_every_finish: 24 shard_keys variants (3 dtypes x 2 alignments x 4
# blocks), 13-26 CPU-s each; the default keeps every (alignment, block) pair once with the
# dtypes rotating (each dtype at least twice), the other 16 run with --slow.
_LOCAL_KEPT = {
    "shard_keys_bf16_va1_b1024", "shard_keys_fp16_va1_b2048", "shard_keys_fp32_va1_b4096",
    "shard_keys_bf16_va1_b8192", "shard_keys_fp16_va16_b1024", "shard_keys_fp32_va16_b2048",
    "shard_keys_bf16_va16_b4096", "shard_keys_fp16_va16_b8192",
}  # fmt: skip


def _slow_by_default(item: pytest.Item) -> bool:
    if getattr(item, "originalname", item.name) != "test_every_local_variant_every_finish":
        return False
    if not item.nodeid.startswith("tests/test_argmax.py::"):
        return False
    return item.callspec.params.get("variant") not in _LOCAL_KEPT  # type: ignore[attr-defined]


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("SHARDMAX_SLOW_TESTS") == "1" and config.option.markexpr == DEFAULT_MARKEXPR:
        config.option.markexpr = "not e2e"


@pytest.hookimpl(tryfirst=True)  # before the -m selection (the mark plugin's hook) runs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if _slow_by_default(item):
            item.add_marker(pytest.mark.slow)
        if "e2e" in item.keywords:
            item.add_marker(pytest.mark.filterwarnings("default"))
        if "gpu" in item.keywords and n == 0:
            item.add_marker(pytest.mark.skip(reason="needs a GPU"))
        if "multigpu" in item.keywords and n < 2:
            item.add_marker(pytest.mark.skip(reason="needs two GPUs"))


@pytest.fixture
def device() -> str:
    return DEVICE
