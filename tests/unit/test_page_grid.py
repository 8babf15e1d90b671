"""PageGrid: which prepared-list entries cover a WRITE's ranges (pure; hand-made vectors)."""

from __future__ import annotations

import numpy as np

from transfer_engine.transport.nixl import PageGrid

PB = 256  # page bytes
# three tensors of 4 pages, deliberately not in address order: tensor 1 lies lowest
GRID = PageGrid(np.array([10_000, 2_000, 50_000], dtype=np.uint64), PB, 4, device=0)


def u64(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.uint64)


def test_descs_are_tensor_major() -> None:
    table = GRID.descs()
    assert table.shape == (12, 3)
    assert table[:4, 0].tolist() == [10_000, 10_256, 10_512, 10_768]
    assert table[4, 0] == 2_000 and table[11, 0] == 50_000 + 3 * PB
    assert set(table[:, 1].tolist()) == {PB} and set(table[:, 2].tolist()) == {0}


def test_single_pages_map_to_their_entries() -> None:
    # page 2 of tensor 0 -> 2; page 0 of tensor 1 -> 4; page 3 of tensor 2 -> 11
    got = GRID.indices(u64([10_512, 2_000, 50_768]), u64([PB, PB, PB]))
    assert got is not None and got.tolist() == [2, 4, 11]


def test_runs_expand_in_order() -> None:
    # pages 1..3 of tensor 1 (3 entries: 5, 6, 7), then pages 0..1 of tensor 2 (8, 9)
    got = GRID.indices(u64([2_256, 50_000]), u64([3 * PB, 2 * PB]))
    assert got is not None and got.tolist() == [5, 6, 7, 8, 9]


def test_ranges_off_the_grid_give_none() -> None:
    off = {
        "not page aligned": (u64([10_001]), u64([PB])),
        "partial page": (u64([10_000]), u64([PB // 2])),
        "run past the tensor's last page": (u64([10_768]), u64([2 * PB])),
        "below every tensor": (u64([1_000]), u64([PB])),
        "zero length": (u64([10_000]), u64([0])),
        "nothing": (u64([]), u64([])),
        "one good, one bad": (u64([10_000, 60_000]), u64([PB, PB])),
    }
    for what, (addr, length) in off.items():
        assert GRID.indices(addr, length) is None, what
