"""Kernel tests: CPU cases run the Triton kernels under Triton's interpreter; ``gpu`` cases compile them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    here = Path(__file__).parent
    for item in items:
        if "gpu" in item.keywords and here in item.path.parents:
            item.add_marker(skip)
