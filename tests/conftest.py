"""Test configuration: CPU runs execute every Triton kernel under the Triton interpreter.

``TRITON_INTERPRET=1`` is set before anything imports Triton when no GPU is present, so the
same tests exercise every generated variant on CPU tensors. Tests marked ``gpu`` skip without a
CUDA/ROCm device; ``multigpu`` ones need two.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "gpu" in item.keywords and n == 0:
            item.add_marker(pytest.mark.skip(reason="needs a GPU"))
        if "multigpu" in item.keywords and n < 2:
            item.add_marker(pytest.mark.skip(reason="needs two GPUs"))


@pytest.fixture
def device() -> str:
    return DEVICE
