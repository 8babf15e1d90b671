"""A short soak (``tools/soak.py``) in this process: about 300 random rooms over every path.

Random layouts, TP pairs, page sizes, tiny rings, aborts from either side at every point and failed
WRITEs, with delayed and reordered notifications and control messages in half the epochs; a third
of the rooms go layer-wise (aborts between layers included). Then a short lossy one: control
messages and notifications lost at random, half the rooms layer-wise. Nothing may be corrupted,
leak, or fail without an injected cause. ``TE_SOAK_SEED`` picks another seed; the default
one's first epochs cover the direct, slice, staged and host paths, MLA and a tiny ring.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.timeout(60)

ROOMS = 300
LOSSY_ROOMS = 40
SEED = int(os.environ.get("TE_SOAK_SEED", "4"))


def load_soak() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "tools" / "soak.py"
    spec = importlib.util.spec_from_file_location("te_soak", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.mark.anyio
async def test_soak_300_rooms() -> None:
    soak = load_soak()
    summary = await soak.soak(ROOMS, abort_rate=0.1, fault_rate=0.05, layerwise=0.3, seed=SEED)
    report = json.dumps(summary, indent=1)
    assert summary["corrupted"] == 0, report
    assert summary["leaked"] == 0, report
    assert summary["failed_unexpectedly"] == 0, report
    assert summary["rooms"] >= ROOMS and summary["completed"] >= 0.7 * ROOMS, report
    assert summary["failed_as_intended"] > 0 and summary["follow_ups"] > 0, report
    layerwise = summary["layerwise"]
    assert layerwise.get("completed", 0) > 0 and layerwise.get("failed_as_intended", 0) > 0, report
    if SEED == 4:
        assert set(summary["paths"]) == {"direct", "slice", "staged", "host"}, report
        assert summary["layouts"].get("mla") and summary["layouts"].get("tiny_ring"), report
    assert soak.healthy(summary)


@pytest.mark.anyio
async def test_lossy_soak_with_layerwise_rooms() -> None:
    """Each control message and notification lost with probability 0.02: every room still ends on
    both sides, Success with every byte right or Failed for a reason the loss explains."""
    soak = load_soak()
    summary = await soak.soak(
        LOSSY_ROOMS, abort_rate=0.05, fault_rate=0.0, loss=0.02, layerwise=0.5, seed=SEED,
        min_epoch=LOSSY_ROOMS // 2, max_epoch=LOSSY_ROOMS // 2,
    )  # fmt: skip
    report = json.dumps(summary, indent=1)
    assert soak.healthy(summary), report
    assert summary["layerwise"].get("completed", 0) > 0, report
    assert sum(summary["lost"].values()) > 0, report
