"""Staging layout, the decode ring allocator and its watermark.

Layout: a staged chunk occupies one ring *region*. Inside it the chunk's writers are packed back to
back in ``dst_head_start`` order; writer ``w``'s block is ``[num_kv_tensors, tokens, n_w, head_dim]``
contiguous, the tensors ordered ``K_0..K_{L-1}, V_0..V_{L-1}`` (or ``C_0..C_{L-1}`` for MLA).

Ring: :class:`RingAllocator` hands out regions of one decode rank's ring in *rounds*. Inside a round
regions are disjoint and increase in offset; a region that does not fit after ``head`` starts the
next round at offset 0. Assignment never blocks and may overcommit: a region of round ``r + 1`` may
overlap a still-live region of an older round. What keeps bytes safe is the writer's admission check,
:func:`admits`, against the ring's :class:`RingMark` — ``(round, offset)`` of the oldest live
region, which the decode side broadcasts and the prefill side tracks with :class:`WatermarkTracker`.

Granted with the request: when a staged room opens, the decode ring may place the region of the
room's first chunk at once, sized for every token the room's pages hold, and the room's
TransferRequests carry it (``messages.FirstRegion``); the writers then need no StagingRequest/Grant
round trip for that chunk. :func:`grant_with_request` decides. Such a region is a region like any
other: writers check :func:`admits` before writing into it, and the decode room frees it once
scattered, or when it ends.

The ring is owned by exactly one actor; nothing here is thread-safe or needs to be.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transfer_engine.errors import ConfigError, StagingError
from transfer_engine.protocol.heads import HeadSlice

__all__ = [
    "DEFAULT_ALIGN",
    "Allocation",
    "BufferLeases",
    "RegionLayout",
    "RingAllocator",
    "RingMark",
    "WatermarkTracker",
    "admits",
    "grant_with_request",
    "region_layout",
    "writer_block_bytes",
]

DEFAULT_ALIGN = 256
"""Default byte alignment of each writer's block inside a region (and of region sizes)."""


def writer_block_bytes(num_kv_tensors: int, tokens: int, num_heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes one writer stages for a chunk: ``num_kv_tensors * tokens * num_heads * head_dim * itemsize``.

    ``num_kv_tensors`` is ``2 * L`` (K and V per layer), or ``L`` for MLA. ``tokens`` may be 0 (a chunk
    the decode side has no slots for); every other argument must be >= 1, else :class:`ConfigError`.
    """
    for name, value in (
        ("num_kv_tensors", num_kv_tensors),
        ("num_heads", num_heads),
        ("head_dim", head_dim),
        ("itemsize", itemsize),
    ):
        if value < 1:
            raise ConfigError(f"writer_block_bytes: {name}={value} must be >= 1")
    if tokens < 0:
        raise ConfigError(f"writer_block_bytes: tokens={tokens} must be >= 0")
    return num_kv_tensors * tokens * num_heads * head_dim * itemsize


def _align_up(value: int, align: int) -> int:
    return -(-value // align) * align


@dataclass(frozen=True, slots=True)
class RegionLayout:
    """Where each writer's block lies inside one ring region.

    ``offsets[i]`` and ``sizes[i]`` are writer ``i``'s block, writers in the order given to
    :func:`region_layout`; ``total_bytes`` is the region size to allocate in the ring.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    total_bytes: int


def region_layout(
    num_kv_tensors: int,
    tokens: int,
    head_dim: int,
    itemsize: int,
    writers: Sequence[HeadSlice],
    *,
    align: int = DEFAULT_ALIGN,
) -> RegionLayout:
    """Pack the writers of one chunk back to back in one ring region.

    ``writers`` must be sorted by strictly increasing ``dst_head_start`` (as
    :func:`~transfer_engine.protocol.heads.writers_of` returns them), else :class:`ConfigError`.
    Writer ``i``'s block is ``writer_block_bytes(num_kv_tensors, tokens, writers[i].num_heads,
    head_dim, itemsize)`` bytes, laid out ``[num_kv_tensors, tokens, n, head_dim]`` contiguous.

    Each writer offset is rounded up to a multiple of ``align`` bytes (``align=1`` packs densely),
    and ``total_bytes`` is the end of the last block rounded up to ``align`` too, so regions placed
    back to back in a ring of aligned base keep every writer block aligned. With no writers the
    region is empty (``total_bytes == 0``). ``align`` must be >= 1.
    """
    if align < 1:
        raise ConfigError(f"region_layout: align={align} must be >= 1")
    offsets: list[int] = []
    sizes: list[int] = []
    cursor = 0
    previous_dst = -1
    for writer in writers:
        if writer.dst_head_start <= previous_dst:
            raise ConfigError(
                f"region_layout: writers must be sorted by increasing dst_head_start, got "
                f"{[w.dst_head_start for w in writers]}"
            )
        previous_dst = writer.dst_head_start
        offset = _align_up(cursor, align)
        size = writer_block_bytes(num_kv_tensors, tokens, writer.num_heads, head_dim, itemsize)
        offsets.append(offset)
        sizes.append(size)
        cursor = offset + size
    return RegionLayout(tuple(offsets), tuple(sizes), _align_up(cursor, align))


@dataclass(frozen=True, slots=True, order=True)
class RingMark:
    """How far a decode ring has been freed: ``(round, tail)``, compared lexicographically.

    While regions are live it is the ``(round, offset)`` of the oldest one; with none live it is
    ``(current round, 0)``.
    """

    round: int
    tail: int


@dataclass(frozen=True, slots=True)
class Allocation:
    """One ring region: bytes ``[offset, offset + length)`` of the ring, in round ``round``."""

    alloc_id: int
    round: int
    offset: int
    length: int

    @property
    def end(self) -> int:
        """One past the last byte of the region."""
        return self.offset + self.length


def admits(watermark: RingMark, allocation: Allocation) -> bool:
    """Whether a writer that knows ``watermark`` may write into ``allocation`` now.

    True iff the allocation is in round 0, or every region of the previous round has been freed
    (``round - 1 < watermark.round``), or the previous round is the oldest live one and the oldest
    live region there starts at or after this allocation's end (``round - 1 == watermark.round``
    and ``end <= watermark.tail``). A stale (older) watermark only ever admits less, so writers may
    check against whatever watermark they last received.
    """
    previous = allocation.round - 1
    return (
        allocation.round == 0
        or previous < watermark.round
        or (previous == watermark.round and allocation.end <= watermark.tail)
    )


class RingAllocator:
    """The staging ring allocator of one decode rank: assigns regions, frees them, reports the watermark.

    Owned and called by the decode Ring actor only: :meth:`assign` once per staged (room, chunk),
    :meth:`free` once per region on every terminal path (after its scatter finished and no WRITE
    into it can still be in flight). It never blocks and never touches memory: it hands out offsets.
    """

    def __init__(self, size: int) -> None:
        """A ring of ``size`` bytes (``ring_bytes``); :class:`ConfigError` if ``size < 1``."""
        if size < 1:
            raise ConfigError(f"ring size ring_bytes={size} must be >= 1")
        self.size = size
        self._round = 0
        self._head = 0
        self._next_id = 0
        # Insertion order is (round, offset) order, so the first entry is the oldest live region.
        self._live: dict[int, Allocation] = {}
        self._watermark = RingMark(0, 0)

    @property
    def round(self) -> int:
        """The round new allocations are placed in (unless they wrap)."""
        return self._round

    @property
    def head(self) -> int:
        """Offset where the next allocation of the current round would start."""
        return self._head

    @property
    def live(self) -> int:
        """Number of live (assigned and not yet freed) allocations."""
        return len(self._live)

    @property
    def watermark(self) -> RingMark:
        """``(round, offset)`` of the oldest live allocation, or ``(round, 0)`` when none is live.

        Starts at ``(0, 0)`` and never moves backward.
        """
        return self._watermark

    def allocations(self) -> tuple[Allocation, ...]:
        """The live allocations, oldest first (for introspection and leak checks)."""
        return tuple(self._live.values())

    def peek(self, length: int) -> Allocation:
        """The allocation :meth:`assign` would make for ``length`` now; nothing changes.

        Same errors as :meth:`assign`.
        """
        if length < 1:
            raise ConfigError(f"ring allocation length={length} must be >= 1")
        if length > self.size:
            raise StagingError(
                f"oversized: a staged chunk needs {length} bytes but the ring holds {self.size} bytes; "
                f"raise the config option `ring_bytes` to at least {length} (or send smaller chunks)"
            )
        if self._head + length > self.size:
            return Allocation(self._next_id, self._round + 1, 0, length)
        return Allocation(self._next_id, self._round, self._head, length)

    def assign(self, length: int) -> Allocation:
        """Place a region of ``length`` bytes; it never splits and never blocks.

        If ``[head, head + length)`` fits in the ring it is taken in the current round; otherwise a
        new round starts at offset 0. The region may overlap live regions of older rounds:
        writers must check :func:`admits` before writing. Raises :class:`ConfigError` when
        ``length < 1`` and :class:`StagingError` (``oversized``) when ``length`` exceeds the ring.
        """
        allocation = self.peek(length)
        self._round, self._head = allocation.round, allocation.end
        self._next_id += 1
        self._live[allocation.alloc_id] = allocation
        return allocation

    def free(self, alloc_id: int) -> RingMark | None:
        """Release allocation ``alloc_id``; return the new watermark if it moved, else ``None``.

        Freeing the last live allocation restarts the ring: ``round += 1``, ``head = 0``, and the
        watermark becomes ``(round, 0)``, which admits the next allocation at once. Raises
        :class:`ConfigError` naming the id when it is not live (unknown, or already freed).
        """
        try:
            del self._live[alloc_id]
        except KeyError:
            raise ConfigError(
                f"ring allocation id {alloc_id} is not live (unknown or already freed)"
            ) from None
        if self._live:
            oldest = next(iter(self._live.values()))
            new = RingMark(oldest.round, oldest.offset)
        else:
            self._round += 1
            self._head = 0
            new = RingMark(self._round, 0)
        if new > self._watermark:
            self._watermark = new
            return new
        return None


def grant_with_request(ring: RingAllocator, region_bytes: int) -> bool:
    """Whether a staged room that opens now gets its first chunk's region with its request.

    ``region_bytes`` is the region of a chunk covering every token the room's pages hold (the
    first chunk's real size is not known before the prefill sends it; it is never larger).
    Yes iff the region is at most half the ring, so that rooms granted ahead never hold the whole
    ring, and :meth:`RingAllocator.peek` places it where :func:`admits` lets a writer write at once
    against the ring's own watermark: a region placed ahead of its bytes must not wait on
    back-pressure, nor make the regions placed after it wait longer. Otherwise (a room of 0 bytes
    here, a big room, a ring under pressure) the first chunk asks with a StagingRequest, as the
    others do, once its bytes exist. Pure.
    """
    if region_bytes < 1 or 2 * region_bytes > ring.size:
        return False
    return admits(ring.watermark, ring.peek(region_bytes))


class WatermarkTracker:
    """The prefill side's view of one decode peer's ring watermark; keeps the newest it has seen.

    One per decode peer. Watermark messages may arrive reordered or duplicated; older or equal ones
    are ignored, so :attr:`current` never moves backward.
    """

    __slots__ = ("_current",)

    def __init__(self) -> None:
        self._current = RingMark(0, 0)

    @property
    def current(self) -> RingMark:
        """The newest watermark received; ``(0, 0)`` before any."""
        return self._current

    def update(self, wm: RingMark) -> bool:
        """Record ``wm``; return True iff it is newer than :attr:`current` (parked chunks may retry)."""
        if wm > self._current:
            self._current = wm
            return True
        return False

    def admits(self, allocation: Allocation) -> bool:
        """:func:`admits` against :attr:`current`."""
        return admits(self._current, allocation)


class BufferLeases:
    """Byte ranges of one prefill worker's staging buffer, leased per staged chunk.

    A chunk is gathered into its lease and WRITTEN from it; the lease is released when the WRITE
    has ended. Leases are placed first-fit after the newest one, wrapping to offset 0, never split
    and never overlapping a live lease; releases may come in any order. :meth:`lease` returns None
    when no gap is large enough *now* (the worker retries after a release); a request larger than
    the whole buffer raises :class:`StagingError` naming the option to raise.
    """

    def __init__(self, size: int, align: int = DEFAULT_ALIGN) -> None:
        if size < 1:
            raise ConfigError(f"staging buffer size staging_bytes={size} must be >= 1")
        if align < 1:
            raise ConfigError(f"BufferLeases: align={align} must be >= 1")
        self.size = size
        self.align = align
        self._live: dict[int, int] = {}  # offset -> end
        self._head = 0

    @property
    def live(self) -> int:
        """Number of leases not yet released."""
        return len(self._live)

    def lease(self, length: int) -> int | None:
        """Offset of a new lease of ``length`` bytes, or None while no gap fits it."""
        self.check_fits(length)
        for start in (self._head, 0):
            end = start + length
            if end <= self.size and not any(s < end and start < e for s, e in self._live.items()):
                self._live[start] = end
                self._head = _align_up(end, self.align) if end < self.size else 0
                return start
        return None

    def check_fits(self, length: int) -> None:
        """:class:`StagingError` naming ``staging_bytes`` when ``length`` can never be leased here."""
        if length < 1:
            raise ConfigError(f"staging lease length={length} must be >= 1")
        if length > self.size:
            raise StagingError(
                f"a staged chunk needs {length} bytes of staging buffer but it holds {self.size} bytes; "
                f"raise the config option `staging_bytes` to at least {length} (or send smaller chunks)"
            )

    def release(self, offset: int) -> None:
        """End the lease at ``offset``; :class:`ConfigError` naming it when none is live there."""
        if self._live.pop(offset, None) is None:
            raise ConfigError(f"no live staging lease at offset {offset}")
        if not self._live:
            self._head = 0
