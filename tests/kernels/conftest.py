"""Kernel tests: CPU cases run the Triton kernels under Triton's interpreter; ``gpu`` cases compile them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kvgen import Backend

# Where the gather/scatter cases run: Triton's interpreter and the torch path on CPU; compiled, with
# device and pinned-host staging, on a GPU. Test files take the ``backend`` fixture.
BACKENDS = [
    pytest.param(Backend("interp", "cpu", False, "auto"), id="interp"),
    pytest.param(Backend("torch", "cpu", False, "torch"), id="torch"),
    pytest.param(Backend("cuda", "cuda", False, "auto"), id="cuda", marks=pytest.mark.gpu),
    pytest.param(Backend("cuda-host", "cuda", True, "auto"), id="cuda-host", marks=pytest.mark.gpu),
]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Backend:
    chosen: Backend = request.param
    if chosen.name == "interp":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return chosen


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    here = Path(__file__).parent
    for item in items:
        if "gpu" in item.keywords and here in item.path.parents:
            item.add_marker(skip)
