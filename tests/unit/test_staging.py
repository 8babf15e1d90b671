"""Staging layout, ring allocator and watermark: literal tables and properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer_engine.errors import ConfigError, StagingError
from transfer_engine.protocol.heads import HeadSlice
from transfer_engine.protocol.staging import (
    Allocation,
    BufferLeases,
    RegionLayout,
    RingAllocator,
    RingMark,
    WatermarkTracker,
    admits,
    grant_with_request,
    region_layout,
    writer_block_bytes,
)

# ---------------------------------------------------------------- layout


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((8, 16, 2, 128, 2), 65536),  # L=4 non-MLA, 16 tokens, 2 heads of 128 bf16
        ((4, 10, 1, 576, 2), 46080),  # L=4 MLA latent of 576 bf16
        ((2, 1, 1, 1, 1), 2),
        ((2, 0, 4, 64, 2), 0),  # a chunk with no decode slots stages nothing
    ],
)
def test_writer_block_bytes(args: tuple[int, int, int, int, int], expected: int) -> None:
    assert writer_block_bytes(*args) == expected


@pytest.mark.parametrize(
    "args", [(0, 1, 1, 1, 1), (2, -1, 1, 1, 1), (2, 1, 0, 1, 1), (2, 1, 1, 0, 1), (2, 1, 1, 1, 0)]
)
def test_writer_block_bytes_rejects_bad_values(args: tuple[int, int, int, int, int]) -> None:
    with pytest.raises(ConfigError):
        writer_block_bytes(*args)


def test_region_layout_two_equal_writers() -> None:
    # H=8, P=4, D=2, decode rank 0: writers (0, 0, 0, 2), (1, 0, 2, 2). L=2 -> 4 tensors, 3 tokens,
    # head_dim 8, 2-byte items: each block 4*3*2*8*2 = 384 bytes.
    writers = [HeadSlice(0, 0, 0, 2), HeadSlice(1, 0, 2, 2)]
    assert region_layout(4, 3, 8, 2, writers) == RegionLayout((0, 512), (384, 384), 1024)
    assert region_layout(4, 3, 8, 2, writers, align=1) == RegionLayout((0, 384), (384, 384), 768)
    assert region_layout(4, 3, 8, 2, writers, align=128) == RegionLayout((0, 384), (384, 384), 768)


def test_region_layout_unequal_writers() -> None:
    writers = [HeadSlice(3, 0, 0, 1), HeadSlice(5, 1, 1, 3)]
    # blocks: 2*1*1*4*1 = 8 and 2*1*3*4*1 = 24 bytes
    assert region_layout(2, 1, 4, 1, writers, align=1) == RegionLayout((0, 8), (8, 24), 32)
    assert region_layout(2, 1, 4, 1, writers, align=16) == RegionLayout((0, 16), (8, 24), 48)


def test_region_layout_mla_single_writer_and_empty() -> None:
    assert region_layout(4, 10, 576, 2, [HeadSlice(1, 0, 0, 1)]) == RegionLayout((0,), (46080,), 46080)
    assert region_layout(4, 10, 576, 2, []) == RegionLayout((), (), 0)
    assert region_layout(4, 0, 8, 2, [HeadSlice(0, 0, 0, 2), HeadSlice(1, 0, 2, 2)]) == RegionLayout(
        (0, 0), (0, 0), 0
    )


def test_region_layout_rejects_unsorted_writers_and_bad_align() -> None:
    with pytest.raises(ConfigError, match="sorted"):
        region_layout(4, 3, 8, 2, [HeadSlice(1, 0, 2, 2), HeadSlice(0, 0, 0, 2)])
    with pytest.raises(ConfigError, match="sorted"):
        region_layout(4, 3, 8, 2, [HeadSlice(1, 0, 0, 2), HeadSlice(0, 0, 0, 2)])
    with pytest.raises(ConfigError, match="align=0"):
        region_layout(4, 3, 8, 2, [HeadSlice(0, 0, 0, 2)], align=0)


# ---------------------------------------------------------------- ring, literal


def _a(alloc: Allocation) -> tuple[int, int, int, int]:
    return alloc.alloc_id, alloc.round, alloc.offset, alloc.length


def test_ring_walkthrough_with_wrap() -> None:
    ring = RingAllocator(100)
    assert (ring.size, ring.round, ring.head, ring.live, ring.watermark) == (100, 0, 0, 0, RingMark(0, 0))
    a = ring.assign(40)
    b = ring.assign(40)
    c = ring.assign(30)  # does not fit after head=80: new round at 0, overlapping a
    assert [_a(x) for x in (a, b, c)] == [(0, 0, 0, 40), (1, 0, 40, 40), (2, 1, 0, 30)]
    assert (a.end, b.end, c.end) == (40, 80, 30)
    assert (ring.round, ring.head, ring.live) == (1, 30, 3)
    assert ring.allocations() == (a, b, c)
    wm = ring.watermark
    assert wm == RingMark(0, 0)
    assert (admits(wm, a), admits(wm, b), admits(wm, c)) == (True, True, False)

    assert ring.free(a.alloc_id) == RingMark(0, 40)
    assert admits(ring.watermark, c)
    assert ring.free(b.alloc_id) == RingMark(1, 0)
    assert ring.allocations() == (c,)
    assert ring.free(c.alloc_id) == RingMark(2, 0)  # empty: ring restarts in round 2
    assert (ring.round, ring.head, ring.live, ring.allocations()) == (2, 0, 0, ())

    d = ring.assign(100)
    assert _a(d) == (3, 2, 0, 100)
    assert admits(ring.watermark, d)


def test_free_of_a_younger_allocation_does_not_move_the_watermark() -> None:
    ring = RingAllocator(64)
    a, b, c = ring.assign(16), ring.assign(16), ring.assign(16)
    assert ring.free(b.alloc_id) is None
    assert ring.free(c.alloc_id) is None
    assert ring.watermark == RingMark(0, 0)
    assert ring.free(a.alloc_id) == RingMark(1, 0)


def test_empty_ring_admits_a_wrapped_allocation_at_once() -> None:
    ring = RingAllocator(100)
    a = ring.assign(60)
    assert ring.free(a.alloc_id) == RingMark(1, 0)
    b = ring.assign(60)
    assert _a(b) == (1, 1, 0, 60)
    assert admits(ring.watermark, b)


def test_wrapped_allocation_proceeds_once_the_old_round_is_freed() -> None:
    ring = RingAllocator(100)
    a = ring.assign(60)
    b = ring.assign(60)  # wraps over a
    assert _a(b) == (1, 1, 0, 60)
    assert not admits(ring.watermark, b)
    assert ring.free(a.alloc_id) == RingMark(1, 0)
    assert admits(ring.watermark, b)


def test_exact_fit_then_wrap() -> None:
    ring = RingAllocator(100)
    assert _a(ring.assign(100)) == (0, 0, 0, 100)
    assert _a(ring.assign(1)) == (1, 1, 0, 1)
    assert _a(ring.assign(99)) == (2, 1, 1, 99)
    assert _a(ring.assign(1)) == (3, 2, 0, 1)


def test_oversized_is_refused_naming_the_knob() -> None:
    ring = RingAllocator(1000)
    with pytest.raises(StagingError) as info:
        ring.assign(1001)
    message = str(info.value)
    assert "oversized" in message
    assert "1001" in message and "1000" in message
    assert "ring_bytes" in message
    assert (ring.live, ring.head, ring.round) == (0, 0, 0)


@pytest.mark.parametrize("length", [0, -5])
def test_assign_rejects_non_positive_length(length: int) -> None:
    with pytest.raises(ConfigError, match=f"length={length}"):
        RingAllocator(10).assign(length)


@pytest.mark.parametrize("size", [0, -1])
def test_ring_rejects_non_positive_size(size: int) -> None:
    with pytest.raises(ConfigError, match="ring_bytes"):
        RingAllocator(size)


def test_free_unknown_or_twice_names_the_id() -> None:
    ring = RingAllocator(10)
    with pytest.raises(ConfigError, match="id 7"):
        ring.free(7)
    a = ring.assign(5)
    ring.free(a.alloc_id)
    with pytest.raises(ConfigError, match=f"id {a.alloc_id}"):
        ring.free(a.alloc_id)


@pytest.mark.parametrize(
    ("watermark", "allocation", "expected"),
    [
        ((0, 0), (0, 50, 10), True),  # round 0 is always free
        ((5, 0), (0, 0, 10), True),
        ((0, 0), (1, 0, 10), False),  # previous round's oldest live region at offset 0
        ((0, 10), (1, 0, 10), True),  # ends exactly at the tail
        ((0, 9), (1, 0, 10), False),
        ((0, 100), (1, 90, 10), True),
        ((1, 0), (1, 0, 10), True),  # previous round fully freed
        ((2, 0), (1, 50, 50), True),
        ((0, 999), (2, 0, 10), False),  # two rounds behind
        ((1, 10), (2, 0, 10), True),
        ((1, 10), (2, 5, 10), False),
        ((3, 0), (2, 5, 10), True),
    ],
)
def test_admits_table(watermark: tuple[int, int], allocation: tuple[int, int, int], expected: bool) -> None:
    assert admits(RingMark(*watermark), Allocation(0, *allocation)) is expected


# ---------------------------------------------------------------- granted with the request


def _ring(size: int, live: list[int], freed: list[int]) -> RingAllocator:
    """A ring of ``size`` bytes after assigning ``live`` lengths in order and freeing the ``freed`` indices."""
    ring = RingAllocator(size)
    ids = [ring.assign(length).alloc_id for length in live]
    for i in freed:
        ring.free(ids[i])
    return ring


@pytest.mark.parametrize(
    ("size", "live", "freed", "region", "expected"),
    [
        (100, [], [], 50, True),  # empty ring, half of it: granted
        (100, [], [], 51, False),  # more than half the ring: the chunk asks when it exists
        (100, [], [], 0, False),  # nothing for this decode rank
        (100, [30], [], 50, True),  # fits after a live region in round 0
        (100, [30, 30], [], 50, False),  # would wrap over the live region at 0: under pressure
        (100, [30, 30], [0], 40, True),  # fits in round 0 after the two
        (100, [30, 30], [0], 50, False),  # wraps; round 1 over [0, 50) while [30, 60) lives
        (100, [30, 30, 30], [0], 30, True),  # wraps to [0, 30): the region there was freed
        (100, [40, 40], [0, 1], 50, True),  # all freed: the ring restarted, round 2 at 0
        (100, [60], [], 40, True),  # exact fit at the end of round 0
    ],
)
def test_grant_with_request_table(
    size: int, live: list[int], freed: list[int], region: int, expected: bool
) -> None:
    ring = _ring(size, live, freed)
    before = (ring.round, ring.head, ring.live, ring.watermark)
    assert grant_with_request(ring, region) is expected
    assert (ring.round, ring.head, ring.live, ring.watermark) == before  # a decision changes nothing
    if expected:  # what it promised: the region is admitted at once against the ring's watermark
        assert admits(ring.watermark, ring.assign(region))


def test_peek_is_what_assign_does_next() -> None:
    ring = _ring(100, [30, 50], [])
    for length in (20, 21, 100):
        peeked = ring.peek(length)
        assert ring.peek(length) == peeked
    assert ring.assign(20) == Allocation(2, 0, 80, 20)
    assert ring.peek(1) == Allocation(3, 1, 0, 1)
    with pytest.raises(StagingError, match="ring_bytes"):
        ring.peek(101)
    with pytest.raises(ConfigError, match="length=0"):
        ring.peek(0)


def test_watermark_orders_lexicographically() -> None:
    assert RingMark(0, 99) < RingMark(1, 0) < RingMark(1, 1)
    assert max(RingMark(2, 0), RingMark(1, 50)) == RingMark(2, 0)


def test_watermark_tracker_keeps_the_max() -> None:
    tracker = WatermarkTracker()
    assert tracker.current == RingMark(0, 0)
    assert tracker.update(RingMark(0, 0)) is False
    assert tracker.update(RingMark(0, 5)) is True
    assert tracker.update(RingMark(0, 5)) is False
    assert tracker.update(RingMark(0, 3)) is False
    assert tracker.update(RingMark(1, 0)) is True
    assert tracker.update(RingMark(0, 80)) is False
    assert tracker.current == RingMark(1, 0)
    assert tracker.admits(Allocation(0, 2, 0, 1)) is False
    assert tracker.admits(Allocation(0, 1, 0, 1)) is True


# ---------------------------------------------------------------- ring, properties

Op = tuple[str, int]

ops_strategy = st.lists(
    st.one_of(
        st.tuples(st.just("assign"), st.integers(1, 64)),
        st.tuples(st.just("finish"), st.integers(0, 1000)),  # a writing region lands and is freed
        st.tuples(st.just("abort"), st.integers(0, 1000)),  # a parked region is freed unwritten
        st.tuples(st.just("deliver"), st.integers(0, 1000)),  # one broadcast watermark reaches the writer
    ),
    max_size=80,
)


def _overlap(a: Allocation, b: Allocation) -> bool:
    return a.offset < b.end and b.offset < a.end


class _Sim:
    """A decode ring plus one writer that sees watermarks late and out of order."""

    def __init__(self, size: int) -> None:
        self.ring = RingAllocator(size)
        self.tracker = WatermarkTracker()
        self.in_flight: list[RingMark] = []  # broadcast, not yet delivered
        self.parked: list[Allocation] = []  # assigned, writer not yet allowed to write
        self.writing: list[Allocation] = []  # admitted, not yet freed
        self.last_wm = self.ring.watermark

    def check_ring(self) -> None:
        wm = self.ring.watermark
        assert wm >= self.last_wm, "watermark moved backward"
        self.last_wm = wm
        live = self.ring.allocations()
        assert len(live) == self.ring.live
        assert [(a.round, a.offset) for a in live] == sorted((a.round, a.offset) for a in live)
        if live:
            assert wm == RingMark(live[0].round, live[0].offset)
        else:
            assert wm == RingMark(self.ring.round, 0)
        for a in live:
            assert 0 <= a.offset < a.end <= self.ring.size

    def admit(self) -> None:
        for allocation in list(self.parked):
            if self.tracker.admits(allocation):
                for other in self.writing:
                    assert not _overlap(allocation, other), f"{allocation} admitted over {other}"
                self.parked.remove(allocation)
                self.writing.append(allocation)

    def free(self, allocation: Allocation) -> None:
        before = self.ring.watermark
        moved = self.ring.free(allocation.alloc_id)
        if moved is None:
            assert self.ring.watermark == before
        else:
            assert moved == self.ring.watermark > before
            self.in_flight.append(moved)
        self.check_ring()

    def deliver_all(self) -> None:
        for wm in self.in_flight:
            self.tracker.update(wm)
        self.in_flight.clear()
        assert self.tracker.current == self.ring.watermark

    def step(self, op: Op) -> None:
        kind, value = op
        if kind == "assign":
            length = min(value, self.ring.size)
            was_empty = self.ring.live == 0
            allocation = self.ring.assign(length)
            self.parked.append(allocation)
            if was_empty and not self.in_flight:
                # Writer is up to date and the ring was empty: a fresh (possibly wrapped) region is free.
                assert self.tracker.current == self.ring.watermark
                assert self.tracker.admits(allocation)
        elif kind == "finish" and self.writing:
            self.free(self.writing.pop(value % len(self.writing)))
        elif kind == "abort" and self.parked:
            self.free(self.parked.pop(value % len(self.parked)))
        elif kind == "deliver" and self.in_flight:
            self.tracker.update(self.in_flight.pop(value % len(self.in_flight)))
        self.check_ring()
        self.admit()

    def drain(self, choices: list[int]) -> None:
        """Land and free everything; each region must become admissible once all older ones are freed."""
        turn = 0
        while self.parked or self.writing:
            self.deliver_all()
            self.admit()
            if not self.writing:
                oldest = self.ring.allocations()[0]
                raise AssertionError(f"deadlock: oldest live {oldest} not admitted at {self.tracker.current}")
            pick = choices[turn % len(choices)] if choices else 0
            turn += 1
            self.free(self.writing.pop(pick % len(self.writing)))
        assert self.ring.live == 0 and self.ring.allocations() == ()
        self.deliver_all()


@settings(max_examples=200, deadline=None)
@given(size=st.integers(1, 160), ops=ops_strategy, choices=st.lists(st.integers(0, 1000), max_size=10))
def test_ring_property_admitted_regions_never_overlap(size: int, ops: list[Op], choices: list[int]) -> None:
    sim = _Sim(size)
    for op in ops:
        sim.step(op)
    sim.drain(choices)
    # After everything was freed, any fresh allocation is admitted at once.
    fresh = sim.ring.assign(size)
    assert sim.ring.watermark == RingMark(sim.ring.round, 0)
    assert admits(sim.ring.watermark, fresh)
    assert sim.tracker.admits(fresh)


@settings(max_examples=100, deadline=None)
@given(size=st.integers(1, 100), lengths=st.lists(st.integers(1, 100), min_size=1, max_size=30))
def test_ring_property_fifo_frees_admit_the_next_in_order(size: int, lengths: list[int]) -> None:
    ring = RingAllocator(size)
    allocations = [ring.assign(min(n, size)) for n in lengths]
    for index, allocation in enumerate(allocations):
        # every older allocation has been freed: this one must be admissible now
        assert admits(ring.watermark, allocation)
        for younger in allocations[index + 1 :]:
            if admits(ring.watermark, younger):
                assert not _overlap(allocation, younger), f"{younger} admitted over live {allocation}"
        ring.free(allocation.alloc_id)
    assert ring.live == 0


# --- BufferLeases: the prefill worker's staging buffer ---------------------------------------------


def test_leases_place_after_the_newest_and_wrap() -> None:
    leases = BufferLeases(1024, align=256)
    assert leases.lease(300) == 0
    assert leases.lease(300) == 512  # aligned after the first
    assert leases.lease(300) is None  # 812 + 300 > 1024 and offset 0 is live
    leases.release(0)
    assert leases.lease(300) == 0  # wraps to the freed start
    assert leases.live == 2


def test_leases_never_overlap_under_random_use() -> None:
    import random

    rng = random.Random(3)
    leases = BufferLeases(4096, align=64)
    live: dict[int, int] = {}
    for _ in range(2000):
        if live and rng.random() < 0.5:
            offset = rng.choice(list(live))
            leases.release(offset)
            del live[offset]
            continue
        n = rng.randint(1, 1500)
        offset = leases.lease(n)
        if offset is None:
            continue
        assert 0 <= offset and offset + n <= 4096
        assert all(offset + n <= s or e <= offset for s, e in live.items())
        live[offset] = offset + n
    for offset in list(live):
        leases.release(offset)
    assert leases.live == 0 and leases.lease(4096) == 0


def test_lease_larger_than_buffer_names_staging_bytes() -> None:
    leases = BufferLeases(100)
    with pytest.raises(StagingError, match="staging_bytes` to at least 101"):
        leases.lease(101)
    with pytest.raises(ConfigError, match="length=0"):
        leases.lease(0)
    with pytest.raises(ConfigError, match="offset 5"):
        leases.release(5)
    with pytest.raises(ConfigError, match="staging_bytes=0"):
        BufferLeases(0)
