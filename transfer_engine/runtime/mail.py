"""In-process mail: every message one actor sends another, and the mailbox they travel in.

Actors never hold each other (docs/ARCHITECTURE.md). They exchange the frozen messages below
through :class:`Mailbox` send ends handed to them at construction, and reply by addressing a room
id, never by calling back into the sender. Wire messages live in :mod:`transfer_engine.protocol.messages`;
these never leave the process.

Two ways to put mail into a mailbox, and the rule that keeps the actor graph free of deadlock:

- ``await send(mail)`` waits while the mailbox holds ``capacity`` items. Only actors that nobody
  they send to can ever wait on may use it towards a room.
- ``post(mail)`` never waits: it uses the mailbox's ``reserve`` beyond ``capacity`` and raises
  :class:`MailboxOverflow` if even that is full. Room actors use only ``post`` (to workers, the
  scatter actor and the ring), and bound what they have outstanding in each so that the reserve
  can never be exceeded. A room therefore never waits on another actor, every other actor may wait
  on a room, and no cycle of waits can form.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import anyio
import numpy as np
import torch

from transfer_engine.errors import FailureReason
from transfer_engine.protocol import heads
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.layers import LayerGroup
from transfer_engine.protocol.rooms import Chunk
from transfer_engine.protocol.staging import Allocation, RegionLayout
from transfer_engine.runtime.peers import Peer

T = TypeVar("T")


class MailboxOverflow(RuntimeError):
    """A ``post`` found the mailbox's reserve full: a sender broke its bound (a bug, never load)."""


class Mailbox(Generic[T]):
    """A bounded FIFO mailbox with one receiver; see the module docstring for ``send`` vs ``post``.

    Closing it (from either end) makes later sends raise ``anyio.ClosedResourceError``; the
    receiver still gets what was queued, then ``anyio.EndOfStream``.
    """

    def __init__(self, capacity: int, reserve: int = 0) -> None:
        if capacity < 1 or reserve < 0:
            raise ValueError(f"mailbox capacity={capacity} reserve={reserve}")
        self.capacity = capacity
        self.reserve = reserve
        self._items: deque[T] = deque()
        self._closed = False
        self._nudged = False
        self._readable = anyio.Event()
        self._writable = anyio.Event()
        self.high_water = 0
        """The most items it ever held (tests check bounds with it)."""
        self.taker: Callable[[T], bool] | None = None
        """Set by a receiver that can apply mail in the sender's own call (a room actor waiting on
        its empty mailbox): :meth:`send` hands it the mail first, and queues it only when the taker
        says False. Never called while items are queued, so the order of mail is kept."""
        self.waiting = False
        """The receiver waits in :meth:`next` (on an empty mailbox) right now."""

    def __len__(self) -> int:
        return len(self._items)

    @property
    def closed(self) -> bool:
        return self._closed

    def _put(self, mail: T) -> None:
        self._items.append(mail)
        if len(self._items) > self.high_water:
            self.high_water = len(self._items)
        self._readable.set()

    def post(self, mail: T) -> None:
        """Queue ``mail`` now, using the reserve if need be (never waits)."""
        if self._closed:
            raise anyio.ClosedResourceError
        if len(self._items) >= self.capacity + self.reserve:
            raise MailboxOverflow(
                f"mailbox full: {len(self._items)} items, capacity {self.capacity} + reserve {self.reserve}"
            )
        self._put(mail)

    def offer(self, mail: T) -> None:
        """:meth:`post`, but hand ``mail`` to the :attr:`taker` first when there is one and nothing is
        queued (as :meth:`send` does)."""
        if self.taker is not None and not self._items and not self._closed and self.taker(mail):
            return
        self.post(mail)

    def send_nowait(self, mail: T) -> None:
        """Queue ``mail`` if it is under ``capacity``; ``anyio.WouldBlock`` otherwise."""
        if self._closed:
            raise anyio.ClosedResourceError
        if len(self._items) >= self.capacity:
            raise anyio.WouldBlock
        self._put(mail)

    async def send(self, mail: T) -> None:
        """Queue ``mail``, waiting while the mailbox holds ``capacity`` items or more; or hand it to
        the :attr:`taker`, when there is one and nothing is queued."""
        if self.taker is not None and not self._items and not self._closed and self.taker(mail):
            return
        while True:
            if self._closed:
                raise anyio.ClosedResourceError
            if len(self._items) < self.capacity:
                self._put(mail)
                return
            if self._writable.is_set():
                self._writable = anyio.Event()
            await self._writable.wait()

    def receive_nowait(self) -> T:
        """The oldest item; ``anyio.WouldBlock`` when empty, ``anyio.EndOfStream`` when closed and empty."""
        if not self._items:
            if self._closed:
                raise anyio.EndOfStream
            raise anyio.WouldBlock
        mail = self._items.popleft()
        if len(self._items) < self.capacity:
            self._writable.set()
        return mail

    def nudge(self) -> None:
        """Make the receiver's :meth:`next` return None once (now if it waits), even with nothing queued."""
        self._nudged = True
        self._readable.set()

    async def next(self) -> T | None:
        """The oldest item, waiting for one, or None when :meth:`nudge` was called since the last
        None; ``anyio.EndOfStream`` once closed and drained. Queued items come before a nudge."""
        while True:
            try:
                return self.receive_nowait()
            except anyio.WouldBlock:
                if self._nudged:
                    self._nudged = False
                    return None
                if self._readable.is_set():
                    self._readable = anyio.Event()
                self.waiting = True
                try:
                    await self._readable.wait()
                finally:
                    self.waiting = False

    async def receive(self) -> T:
        """The oldest item, waiting for one; ``anyio.EndOfStream`` once closed and drained. A
        :meth:`nudge` is passed over."""
        while (mail := await self.next()) is None:
            pass
        return mail

    def close(self) -> None:
        """No more sends; queued mail can still be received. Wakes every waiter. Drops the
        :attr:`taker` (a closed mailbox never calls it): a receiver's bound method held here is a
        reference cycle (receiver -> mailbox -> taker -> receiver) that kept every ended room's
        objects for CPython's full collections, 86 objects a room (docs/DECISIONS.md, "A closed
        mailbox lets go of its taker")."""
        self._closed = True
        self.taker = None
        self._readable.set()
        self._writable.set()

    def __aiter__(self) -> AsyncIterator[T]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[T]:
        while True:
            try:
                yield await self.receive()
            except anyio.EndOfStream:
                return


# --- user -> room ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QueueChunk:
    """``Sender.send()``: the next chunk's prefill pages, in request order."""

    pages: np.ndarray
    last: bool
    aux_slot: int | None
    ready: torch.cuda.Event | None = None
    """Recorded on the caller's CUDA stream at ``send()``: the chunk's KV is written once it completes."""
    layerwise: bool = False
    """``Sender.begin_chunk``: nothing is written until :class:`LayersReady` says which layers are."""


Ready = torch.cuda.Event | threading.Event | None
"""What orders a layer-wise WRITE after the KV it reads: a CUDA event (GPU), a ``threading.Event``
set by the thread that wrote the KV (CPU), or None (already written)."""


@dataclass(frozen=True, slots=True)
class LayersReady:
    """``Sender.layers_ready``: layer group ``group`` of the open layer-wise chunk is written once
    every one of ``ready`` has completed (one per ``layers_ready`` call the group gathers)."""

    group: LayerGroup
    ready: tuple[Ready, ...]


@dataclass(frozen=True, slots=True)
class RequestPages:
    """``Receiver.request()``: the decode room's pages (checked), its aux slot and the tokens the
    decode already holds; the room sends its TransferRequests."""

    pages: np.ndarray
    aux_slot: int | None
    decode_prefix_len: int


@dataclass(frozen=True, slots=True)
class LocalAbort:
    """``abort()`` on this side."""

    detail: str


# --- engine -> room -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PeerDead:
    """The heartbeat lease of ``agent`` expired."""

    agent: str
    detail: str


@dataclass(frozen=True, slots=True)
class LeaseRenewed:
    """The peer's heartbeat at ``at`` listed the room as held live: its lease runs from then."""

    at: float


@dataclass(frozen=True, slots=True)
class Shutdown:
    """The engine is closing."""


# --- room <-> workers ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WriteJob:
    """Room -> worker: one chunk of one room to one decode rank, or the room's aux item (``chunk`` None).

    The worker answers with exactly one :class:`WriteDone` to room ``room``.
    """

    room: int
    sender: int
    peer: Peer
    request: m.TransferRequest
    chunk: Chunk | None
    src_pages: np.ndarray
    aux_slot: int | None = None
    ready: torch.cuda.Event | None = None
    """CUDA event after which the chunk's KV is written (recorded at ``send()``); None on CPU."""
    group: LayerGroup | None = None
    """A layer-wise job moves only this group's layers of ``chunk``; None: every layer."""
    waits: tuple[Ready, ...] = ()
    """A layer-wise job is posted only once each of these has completed (polled by the worker)."""

    @property
    def chunk_id(self) -> int | None:
        return None if self.chunk is None else self.chunk.chunk_id

    @property
    def decode_rank(self) -> int:
        return self.request.decode_rank

    @property
    def key(self) -> JobKey:
        layers = None if self.group is None else self.group.layers
        return JobKey(self.chunk_id, self.request.decode_rank, layers)


@dataclass(frozen=True, slots=True)
class JobKey:
    """Which job of a room a reply is for: a chunk (or the aux item, ``chunk_id`` None) to a decode rank."""

    chunk_id: int | None
    decode_rank: int
    layers: tuple[int, int] | None = None
    """The layer group of a layer-wise job; None for a whole chunk."""


@dataclass(frozen=True, slots=True)
class Reached:
    """Worker's completion waiter -> worker: a completion that a held layer-wise job or a parked
    staged chunk waits for was reached (at most one of these is queued at a time)."""


@dataclass(frozen=True, slots=True)
class RepeatStaging:
    """Engine -> worker, every half heartbeat interval: repeat the StagingRequests asked before
    ``before`` and still unanswered (a lost request, grant or refusal; the ring answers a repeat
    with the region it already placed, see ``protocol.retransmit``)."""

    before: float


@dataclass(frozen=True, slots=True)
class CancelRoom:
    """Room -> worker: the room failed; end its chunks that are not posted yet."""

    room: int


@dataclass(frozen=True, slots=True)
class WriteDone:
    """Worker or poller -> room: the job of (``chunk_id``, ``decode_rank``) ended."""

    chunk_id: int | None
    """None for the aux WRITE."""
    decode_rank: int
    ok: bool
    detail: str
    reason: FailureReason = FailureReason.TRANSPORT
    """What the room fails with when not ``ok``."""
    layers: tuple[int, int] | None = None
    """The layer group of a layer-wise job; None for a whole chunk."""


# --- poller --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WriteEnded:
    """Poller -> whoever posted: the WRITE posted with ``token`` ended (``ok``) and its handle is released."""

    token: object
    ok: bool
    detail: str


@dataclass(frozen=True, slots=True)
class Drained:
    """Poller -> room: a full poll-and-drain cycle ran since the room asked (deadline checks wait for it)."""


# --- decode: room, ring and scatter ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RoomOpened:
    """Room -> ring, before the room's first TransferRequest leaves: a staged room exists.

    Handed over by a call (:meth:`~transfer_engine.runtime.ports.RingPort.open_room`), not posted: its answer,
    the region of chunk 0 granted with the request, rides on the TransferRequests.

    ``slices`` are the writers' head slices in ``dst_head_start`` order (their block order in a
    region); ``writer_page_size`` each writer's page size; ``capacity`` the tokens the room's
    pages hold on this rank.
    """

    room: int
    slices: tuple[heads.HeadSlice, ...]
    writer_page_size: dict[int, int]
    capacity: int


@dataclass(frozen=True, slots=True)
class RoomClosed:
    """Room -> ring: the room is final; grant it no more regions.

    ``opened`` is what the room opened with: a room of the same id opened since (its RoomOpened a
    call, this a post) is not closed by it.
    """

    room: int
    opened: RoomOpened


@dataclass(frozen=True, slots=True)
class Subscribe:
    """Engine -> ring: a prefill peer connected; send it the current watermark."""

    peer: Peer


@dataclass(frozen=True, slots=True)
class RegionGranted:
    """Ring -> room: chunk ``chunk_id`` has region ``allocation`` with these writer blocks.

    ``ahead``: chunk 0's region, placed when the room opened and sent with its TransferRequests
    (``protocol.staging.grant_with_request``); its layout is for ``tokens``, the room's whole
    capacity, and ``page_start``/``num_pages`` are not known until the chunk lands.
    """

    chunk_id: int
    allocation: Allocation
    layout: RegionLayout
    page_start: int
    num_pages: int
    tokens: int
    ahead: bool = False


@dataclass(frozen=True, slots=True)
class StagingFailed:
    """Ring -> room: a chunk of the room cannot be placed; the room fails with ``detail``."""

    detail: str


@dataclass(frozen=True, slots=True)
class ScatterRun:
    """KV tensors ``[first, first + count)`` (``protocol.layers.group_tensor_runs``), from ``blocks``
    that hold just those tensors: (byte offset inside the region, dst_head_start, num_heads)."""

    first: int
    count: int
    blocks: tuple[tuple[int, int, int], ...]


@dataclass(frozen=True, slots=True)
class ScatterJob:
    """Room -> scatter: copy region ``[offset, offset + length)`` of the ring into ``slots``.

    Answered with one :class:`Scattered` to room ``room``, after the region was freed (``free``).
    A layer-wise chunk is scattered a layer group at a time, as its groups land: such a job copies
    the group's runs of tensors (``runs``) from one writer's block, and only the chunk's last job
    frees the region (jobs run in arrival order, so every earlier job of it has run by then).
    """

    room: int
    chunk_id: int
    alloc_id: int
    offset: int
    length: int
    blocks: list[tuple[int, int, int]]
    """(byte offset inside the region, dst_head_start, num_heads) per writer: every tensor of it."""
    slots: np.ndarray
    runs: tuple[ScatterRun, ...] = ()
    """Layer-wise: copy only these runs of tensors instead (``blocks`` is then empty)."""
    free: bool = True
    """Free the region after this job: the chunk is then wholly in the pages."""
    checks: tuple[ScatterCheck, ...] = ()
    """Integrity: the checksums to take of the pages once the copy is in them (docs/INTEGRITY.md)."""


@dataclass(frozen=True, slots=True)
class ScatterCheck:
    """The checksum of one writer's part of a scattered copy, taken over the pages behind the copy:
    heads ``[head_start, head_start + num_heads)`` of the job's ``slots``, every tensor or the
    layer group ``layers``'s."""

    head_start: int
    num_heads: int
    layers: tuple[int, int] | None


@dataclass(frozen=True, slots=True)
class Scattered:
    """Scatter -> room: chunk ``chunk_id`` is in the KV pages (``ok``), or the scatter failed.

    ``freed`` False: a layer group's job, the region is still held (more of the chunk follows).
    ``sums``: the job's ``checks``, in order (None: that one could not be taken, ``detail`` says why)."""

    chunk_id: int
    ok: bool
    detail: str = ""
    freed: bool = True
    sums: tuple[int | None, ...] = ()


@dataclass(frozen=True, slots=True)
class Checked:
    """Checksum thread -> room (decode): the checksum of bytes that landed in the room's pages, taken
    off the loop (``landed``; None: taking it failed, ``detail`` says why). ``key`` is the room's
    own name for what it asked (docs/INTEGRITY.md)."""

    key: tuple[int, int, tuple[int, int] | None]
    landed: int | None
    detail: str = ""


RoomMail = (
    QueueChunk
    | LayersReady
    | RequestPages
    | WriteDone
    | WriteEnded
    | Drained
    | RegionGranted
    | StagingFailed
    | Scattered
    | Checked
    | LocalAbort
    | PeerDead
    | LeaseRenewed
    | Shutdown
    | m.TransferRequest
    | m.Abort
    | m.AbortAck
    | m.RoomFailed
    | m.ChunkLanded
    | m.AuxLanded
)
RingMail = m.StagingRequest | Subscribe | RoomClosed
