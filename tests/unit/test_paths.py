"""``path="auto"`` per room (``protocol.paths.choose_path``): a table over page-table shapes, TP
splits, MLA, host memory and host staging; the crossovers' arithmetic; bad input named."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from transfer_engine.errors import ConfigError
from transfer_engine.protocol.paths import (
    CPU_CROSSOVER,
    GPU_CROSSOVER,
    Crossover,
    PathChoice,
    TransferPath,
    choose_path,
    direct_descriptors_at_least,
)
from transfer_engine.testing.pagetables import room_tables, side_seed

MIB = 1 << 20
QWEN_ROOM = 64 * 2 * 256 * 32 * 1024  # 128 tensors x 256 pages of 32 KiB: a 1.07 GB room
QWEN_TENSORS = 128

EQUAL: dict[str, Any] = dict(equal_tp=True, same_pages=True, has_ring=True, host=False, slice_pieces=math.inf)
UNEQUAL: dict[str, Any] = dict(EQUAL, equal_tp=False)

D, S, H, SL = TransferPath.DIRECT, TransferPath.STAGED, TransferPath.HOST, TransferPath.SLICE

CASES = [
    # (id, static arguments, descriptors, bytes, crossover, path, words in the reason)
    ("contiguous-gpu", EQUAL, 128, QWEN_ROOM, GPU_CROSSOVER, D, ["128 descriptors", "<= gpu crossover"]),
    ("scattered-c1-gpu", EQUAL, 339, QWEN_ROOM, GPU_CROSSOVER, D, ["339 descriptors", "<="]),
    ("scattered-gpu", EQUAL, 19_949, QWEN_ROOM, GPU_CROSSOVER, S, ["19949 descriptors", "> gpu crossover"]),
    ("realistic-gpu", EQUAL, 103 * 128, QWEN_ROOM, GPU_CROSSOVER, S, ["13184 descriptors", ">"]),
    ("small-room-gpu", EQUAL, 128, 128 * 32 * 1024, GPU_CROSSOVER, D, ["4.0 MiB", "<="]),
    ("scattered-host-staging", dict(EQUAL, host=True), 19_949, QWEN_ROOM, GPU_CROSSOVER, H, [">"]),
    (
        "scattered-no-ring",
        dict(EQUAL, has_ring=False),
        19_949,
        QWEN_ROOM,
        GPU_CROSSOVER,
        D,
        ["no staging ring"],
    ),
    ("scattered-cpu", EQUAL, 253 * 72, 253 * 72 * 32 * 1024, CPU_CROSSOVER, D, ["<= cpu crossover"]),
    ("pages-unknown", EQUAL, None, QWEN_ROOM, GPU_CROSSOVER, D, ["pages not known"]),
    ("mla-scattered", EQUAL, 61 * 250, 61 * 250 * 18 * 1024, GPU_CROSSOVER, S, [">"]),
    ("mla-contiguous", EQUAL, 61, 61 * 250 * 18 * 1024, GPU_CROSSOVER, D, ["<="]),
    ("unequal-tp-contiguous", UNEQUAL, 128, QWEN_ROOM, GPU_CROSSOVER, S, ["unequal TP", "staged"]),
    ("unequal-tp-host", dict(UNEQUAL, host=True), 128, QWEN_ROOM, GPU_CROSSOVER, H, ["unequal TP"]),
    (
        "unequal-tp-no-ring",
        dict(UNEQUAL, has_ring=False),
        128,
        QWEN_ROOM,
        GPU_CROSSOVER,
        SL,
        ["no staging ring"],
    ),
    (
        "unequal-tp-few-slices",
        dict(UNEQUAL, slice_pieces=2.0),
        128,
        QWEN_ROOM,
        CPU_CROSSOVER,
        SL,
        ["2 slice pieces"],
    ),
    ("unequal-pages", dict(EQUAL, same_pages=False), 1, QWEN_ROOM, GPU_CROSSOVER, S, ["unequal page sizes"]),
]


@pytest.mark.parametrize(
    ("static", "descriptors", "nbytes", "crossover", "path", "words"),
    [pytest.param(*case[1:], id=case[0]) for case in CASES],
)
def test_choose_path(
    static: dict[str, Any],
    descriptors: int | None,
    nbytes: int,
    crossover: Crossover,
    path: TransferPath,
    words: list[str],
) -> None:
    got = choose_path(
        **static,
        num_tensors=QWEN_TENSORS,
        direct_descriptors=descriptors,
        nbytes=nbytes,
        crossover=crossover,
    )
    assert isinstance(got, PathChoice)
    assert got.path is path, got.reason
    for word in words:
        assert word in got.reason, (word, got.reason)


@pytest.mark.parametrize("crossover", [GPU_CROSSOVER, CPU_CROSSOVER], ids=["gpu", "cpu"])
def test_the_crossover_is_the_boundary(crossover: Crossover) -> None:
    """At exactly the allowed count direct; one descriptor more, staged."""
    nbytes = 300 * MIB
    allowed = crossover.per_chunk + crossover.per_mib * 300
    assert crossover.allowed(nbytes) == allowed
    at = [
        choose_path(**EQUAL, num_tensors=8, direct_descriptors=n, nbytes=nbytes, crossover=crossover).path
        for n in (int(allowed), int(allowed) + 1)
    ]
    assert at == [D, S]


@pytest.mark.parametrize(
    ("shape", "side", "low", "high"),
    [("contiguous", "decode", 1, 1), ("scattered", "decode", 200, 256), ("realistic", "decode", 20, 200)],
)
def test_descriptor_bound_from_the_decodes_table(shape: str, side: str, low: int, high: int) -> None:
    """The decode's lower bound on the direct plan: its table's runs times the KV tensors; the
    shapes of the benchmarks fall on the two sides of the GPU crossover as the issue measured."""
    (table,) = room_tables(shape, 256, 1, seed=side_seed(0, side))
    bound = direct_descriptors_at_least(table, QWEN_TENSORS)
    assert bound % QWEN_TENSORS == 0 and low <= bound // QWEN_TENSORS <= high
    chose = choose_path(
        **EQUAL,
        num_tensors=QWEN_TENSORS,
        direct_descriptors=bound,
        nbytes=QWEN_ROOM,
        crossover=GPU_CROSSOVER,
    )
    assert chose.path is (D if shape == "contiguous" else S)


def test_descriptor_bound_small_cases() -> None:
    assert direct_descriptors_at_least(np.array([5]), 3) == 3
    assert direct_descriptors_at_least(np.array([4, 5, 6, 9, 10, 2]), 2) == 6
    assert direct_descriptors_at_least(np.array([], dtype=np.int64), 4) == 0


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda: Crossover(per_mib=-1.0, per_chunk=0, memory="gpu"), "per_mib=-1.0"),
        (lambda: Crossover(per_mib=float("nan"), per_chunk=0, memory="gpu"), "per_mib=nan"),
        (lambda: Crossover(per_mib=1.0, per_chunk=-3, memory="gpu"), "per_chunk=-3"),
        (
            lambda: choose_path(
                **EQUAL, num_tensors=2, direct_descriptors=-1, nbytes=1, crossover=GPU_CROSSOVER
            ),
            "direct_descriptors=-1",
        ),
        (
            lambda: choose_path(
                **EQUAL, num_tensors=2, direct_descriptors=1, nbytes=-5, crossover=GPU_CROSSOVER
            ),
            "nbytes=-5",
        ),
        (lambda: direct_descriptors_at_least([1, 2], 0), "num_tensors=0"),
        (lambda: direct_descriptors_at_least([1, -2], 1), ">= 0"),
    ],
)
def test_bad_input_is_named(call: object, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        call()  # type: ignore[operator]
