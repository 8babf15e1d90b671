"""Page tables of the benchmarks and tests (``transfer_engine.testing.pagetables``): counts, no page
twice in flight, determinism, and each shape's character."""

from __future__ import annotations

import numpy as np
import pytest

from transfer_engine.errors import ConfigError
from transfer_engine.protocol.descriptors import page_runs as pair_runs
from transfer_engine.testing.pagetables import (
    MIN_POOL_ROOMS,
    PageTableShape,
    free_order,
    page_runs,
    pool_pages,
    room_tables,
    side_seed,
)

SHAPES = list(PageTableShape)
SIZES = [(1, 1), (1, 8), (5, 3), (32, 4), (256, 1), (256, 8), (64, 12)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.value)
@pytest.mark.parametrize(("pages", "rooms"), SIZES)
def test_counts_bounds_and_no_page_twice_in_flight(shape: PageTableShape, pages: int, rooms: int) -> None:
    tables = room_tables(shape, pages, rooms, seed=3)
    total = pool_pages(shape, pages, rooms)
    assert len(tables) == rooms
    for table in tables:
        assert table.dtype == np.int64 and table.shape == (pages,)
        assert table.min() >= 0 and table.max() < total
    flat = np.concatenate(tables)
    assert np.unique(flat).size == flat.size, "a page is in two tables"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.value)
def test_deterministic_per_seed_and_sides_differ(shape: PageTableShape) -> None:
    a = room_tables(shape, 64, 4, seed=side_seed(7, "prefill"))
    b = room_tables(shape.value, 64, 4, seed=side_seed(7, "prefill"))
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    other = room_tables(shape, 64, 4, seed=side_seed(7, "decode"))
    same = all(np.array_equal(x, y) for x, y in zip(a, other, strict=True))
    assert same == (shape is PageTableShape.CONTIGUOUS)


def test_pool_sizes() -> None:
    assert pool_pages("contiguous", 10, 3) == 34
    assert pool_pages("scattered", 10, 3) == MIN_POOL_ROOMS * 10 + 4
    assert pool_pages("realistic", 10, 12) == 124


def test_contiguous_is_one_run_per_room() -> None:
    tables = room_tables("contiguous", 16, 3)
    assert [t.tolist() for t in tables] == [list(range(i * 16, (i + 1) * 16)) for i in range(3)]
    assert [page_runs(t) for t in tables] == [1, 1, 1]


def test_scattered_is_sorted_and_spread_over_the_pool() -> None:
    pages, rooms = 256, 1
    (table,) = room_tables("scattered", pages, rooms, seed=0)
    assert np.all(np.diff(table) > 0)
    total = pool_pages("scattered", pages, rooms)
    # a uniform draw of 256 of ~2052 pages: about 7/8 of the neighbours are not consecutive
    assert page_runs(table) > 0.75 * pages
    assert table.max() - table.min() > 0.75 * total


def test_realistic_is_neither_contiguous_nor_uniform() -> None:
    """The allocator's tables keep some runs of consecutive pages (freed requests' blocks), far more
    than a uniform draw would, and are still broken into many runs and not sorted."""
    pages = 256
    for seed in range(4):
        (table,) = room_tables("realistic", pages, 1, seed=seed)
        (uniform,) = room_tables("scattered", pages, 1, seed=seed)
        runs = page_runs(table)
        assert 8 <= runs < 0.6 * page_runs(uniform), (seed, runs, page_runs(uniform))
        assert np.any(np.diff(table) < 0), "an allocator's free list hands pages out unsorted"


@pytest.mark.parametrize(
    ("shape", "low", "high"), [("contiguous", 1, 1), ("realistic", 40, 200), ("scattered", 230, 256)]
)
def test_direct_runs_between_two_sides(shape: str, low: int, high: int) -> None:
    """What the direct path would post per KV tensor for a 256-page room: page runs consecutive on
    BOTH sides, with the prefill's and the decode's tables from unrelated allocators."""
    src = room_tables(shape, 256, 1, seed=side_seed(0, "prefill"))[0]
    dst = room_tables(shape, 256, 1, seed=side_seed(0, "decode"))[0]
    assert low <= len(pair_runs(src, dst)) <= high


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda: room_tables("striped", 4, 1), "'striped'"),
        (lambda: room_tables("scattered", 0, 1), "pages_per_room=0"),
        (lambda: room_tables("realistic", 4, -1), "rooms=-1"),
        (lambda: pool_pages("contiguous", 2.5, 1), "pages_per_room=2.5"),  # type: ignore[arg-type]
        (lambda: side_seed(0, "both"), "'both'"),
    ],
)
def test_bad_input_is_named(call: object, named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        call()  # type: ignore[operator]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.value)
@pytest.mark.parametrize("total", [1, 7, 300, 4100])
def test_free_order_is_a_permutation_of_the_pool(shape: PageTableShape, total: int) -> None:
    order = free_order(shape, total, seed=5)
    assert order.dtype == np.int64 and sorted(order.tolist()) == list(range(total))
    assert np.array_equal(order, free_order(shape, total, seed=5))


def test_free_order_shapes() -> None:
    total = 4096
    runs = {shape: page_runs(free_order(shape, total, seed=1)) for shape in SHAPES}
    assert runs[PageTableShape.CONTIGUOUS] == 1
    assert runs[PageTableShape.SCATTERED] > 0.99 * total
    assert 16 < runs[PageTableShape.REALISTIC] < 0.6 * total, runs
