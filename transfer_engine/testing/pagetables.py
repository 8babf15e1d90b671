"""Page tables as a serving system hands them out, for the benchmarks and the tests.

A room's page table is the list of pool pages its tokens occupy, in token order. Every benchmark
used to give a room ``np.arange`` pages; a serving system's page pool after warm-up hands a request
pages from all over the pool, and the direct path posts one descriptor per (KV tensor, run of pages
consecutive on both sides), so the shape of the tables decides what a room costs. Three
shapes:

- ``contiguous``: table ``i`` is pages ``[i * n, (i + 1) * n)``;
- ``scattered``: one fixed random permutation of a pool of at least :data:`MIN_POOL_ROOMS` rooms;
  table ``i`` is its ``i``-th block of ``n`` pages, sorted (the pages of one room drawn uniformly at
  random from the whole pool);
- ``realistic``: a FIFO free-list allocator (free pages taken from the head, freed pages appended to
  the tail, as the serving example's ``PageAllocator``) first serves a stream of requests of mixed
  lengths, which grow page by page while they decode and end in random order; the tables are then
  taken from its free list as it stands, each room's pages in the order the allocator hands them.
  Runs of consecutive pages survive (a request that allocated a block at once frees it in one
  piece), but are short and unsorted.

Every shape is deterministic for a ``seed``; the tables of one call are disjoint (no page is held by
two rooms in flight) and all lie in ``range(pool_pages(shape, n, rooms))``. Prefill and decode draw
their tables from different seeds (:func:`side_seed`), as two servers' allocators are unrelated.
"""

from __future__ import annotations

import collections
import enum

import numpy as np
import numpy.typing as npt

from transfer_engine.errors import ConfigError

__all__ = [
    "MIN_POOL_ROOMS",
    "PageTableShape",
    "free_order",
    "page_runs",
    "pool_pages",
    "room_tables",
    "side_seed",
]

I64Array = npt.NDArray[np.int64]

MIN_POOL_ROOMS = 8
"""Scattered and realistic tables come from a pool of at least this many rooms' pages."""

SPARE_PAGES = 4
"""Pages every pool has beyond its rooms' (the benchmarks' habit: a pool never exactly full)."""


class PageTableShape(str, enum.Enum):
    """How a room's pages lie in the pool (module docstring)."""

    CONTIGUOUS = "contiguous"
    SCATTERED = "scattered"
    REALISTIC = "realistic"

    @classmethod
    def parse(cls, value: str | PageTableShape) -> PageTableShape:
        """The shape named ``value``, or :class:`ConfigError` naming it."""
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(s.value for s in cls)
            raise ConfigError(f"page table shape {value!r} is not one of {names}") from None


def _check_counts(pages_per_room: int, rooms: int) -> None:
    for name, value in (("pages_per_room", pages_per_room), ("rooms", rooms)):
        if not isinstance(value, int | np.integer) or value < 1:
            raise ConfigError(f"{name}={value!r} must be a positive integer")


def pool_pages(shape: str | PageTableShape, pages_per_room: int, rooms: int) -> int:
    """Pages a pool needs for ``rooms`` disjoint tables of ``pages_per_room`` pages of ``shape``."""
    shape = PageTableShape.parse(shape)
    _check_counts(pages_per_room, rooms)
    if shape is PageTableShape.CONTIGUOUS:
        return rooms * pages_per_room + SPARE_PAGES
    return max(rooms, MIN_POOL_ROOMS) * pages_per_room + SPARE_PAGES


def side_seed(seed: int, side: str) -> int:
    """The seed of ``side``'s tables ("prefill" or "decode"): two unrelated allocators per run."""
    if side not in ("prefill", "decode"):
        raise ConfigError(f"side={side!r} must be 'prefill' or 'decode'")
    return seed * 2 + (side == "decode")


def room_tables(
    shape: str | PageTableShape, pages_per_room: int, rooms: int, *, seed: int = 0
) -> list[I64Array]:
    """``rooms`` disjoint int64 page tables of ``pages_per_room`` pages each, of ``shape``.

    Deterministic in ``(shape, pages_per_room, rooms, seed)``; every page is below
    ``pool_pages(shape, pages_per_room, rooms)``. Bad arguments raise :class:`ConfigError`.
    """
    shape = PageTableShape.parse(shape)
    total = pool_pages(shape, pages_per_room, rooms)
    n = pages_per_room
    if shape is PageTableShape.CONTIGUOUS:
        return [np.arange(i * n, (i + 1) * n, dtype=np.int64) for i in range(rooms)]
    rng = np.random.default_rng([seed, n, rooms, 1 if shape is PageTableShape.SCATTERED else 2])
    if shape is PageTableShape.SCATTERED:
        order = rng.permutation(total).astype(np.int64)
        return [np.sort(order[i * n : (i + 1) * n]) for i in range(rooms)]
    return _FreeListAllocator(total, rng).serve_then_hand_out(n, rooms)


def free_order(shape: str | PageTableShape, total: int, *, seed: int = 0) -> I64Array:
    """All ``total`` pages of a pool in the order a FIFO free list of ``shape`` holds them, for a server
    whose own allocator then hands them out head first (the serving example's ``PageAllocator``).

    ``contiguous``: ``0 .. total - 1``; ``scattered``: a fixed random permutation; ``realistic``: the
    free list of the simulated allocator once its stream has run and every request has ended (rooms
    of about ``total / 32`` pages). Deterministic per ``seed``; :class:`ConfigError` for bad input.
    """
    shape = PageTableShape.parse(shape)
    _check_counts(total, 1)
    if shape is PageTableShape.CONTIGUOUS:
        return np.arange(total, dtype=np.int64)
    rng = np.random.default_rng([seed, total, 3 if shape is PageTableShape.SCATTERED else 4])
    if shape is PageTableShape.SCATTERED:
        return rng.permutation(total).astype(np.int64)
    allocator = _FreeListAllocator(total, rng)
    allocator.serve(max(1, total // 32))
    while allocator.live:
        allocator._end(int(rng.integers(len(allocator.live))))
    return np.array(allocator.free, dtype=np.int64)


def page_runs(table: npt.ArrayLike) -> int:
    """Runs of consecutive ascending pages in ``table`` (1 for a contiguous table, 0 for an empty one)."""
    pages = np.asarray(table, dtype=np.int64)
    if pages.size == 0:
        return 0
    return int(np.count_nonzero(np.diff(pages) != 1)) + 1


class _FreeListAllocator:
    """A FIFO free list over ``total`` pages, driven by a simulated stream of requests.

    The stream (:meth:`serve_then_hand_out`): requests arrive with a prompt of mixed length (most
    short, a few long: a log-normal draw in pages), take their prompt's pages at once, then grow by
    one page now and then while they decode, interleaved with every other live request; they end in
    random order and give their pages back to the tail of the free list, in the order they held them.
    Arrivals stop taking pages while the list is short; the pool then drains by endings.
    """

    GROW = 0.35
    """Chance that a live request grows by a page at each step (decode crossing a page boundary)."""
    END = 0.04
    """Chance that a live request ends at each step."""
    TURNOVERS = 4
    """Pages handed out over the stream, in units of the pool's size, before the tables are taken."""

    def __init__(self, total: int, rng: np.random.Generator) -> None:
        self.free: collections.deque[int] = collections.deque(range(total))
        self.total = total
        self.rng = rng
        self.live: list[list[int]] = []
        self.served = 0

    def _take(self, count: int) -> list[int]:
        self.served += count
        return [self.free.popleft() for _ in range(count)]

    def _end(self, index: int) -> None:
        self.free.extend(self.live.pop(index))

    def _prompt_pages(self, room_pages: int) -> int:
        mean = max(1.0, room_pages / 4)  # most prompts well below the benchmark's rooms, a tail above
        return max(1, min(int(self.rng.lognormal(np.log(mean), 1.0)), self.total // 4))

    def _step(self, room_pages: int) -> None:
        rng = self.rng
        for i in reversed(range(len(self.live))):
            if rng.random() < self.END:
                self._end(i)
        for pages in self.live:
            if self.free and rng.random() < self.GROW:
                pages.extend(self._take(1))
        want = self._prompt_pages(room_pages)
        if want <= len(self.free) - self.total // 8:  # keep some headroom, as a scheduler does
            self.live.append(self._take(want))

    def serve(self, room_pages: int) -> None:
        """Serve the stream (prompts sized around ``room_pages``) until its pages turned over."""
        while self.served < self.TURNOVERS * self.total:
            self._step(room_pages)

    def serve_then_hand_out(self, room_pages: int, rooms: int) -> list[I64Array]:
        """Serve the stream, end requests in random order until ``rooms`` tables fit, hand them out."""
        self.serve(room_pages)
        while len(self.free) < rooms * room_pages:
            self._end(int(self.rng.integers(len(self.live))))
        return [np.array(self._take(room_pages), dtype=np.int64) for _ in range(rooms)]
