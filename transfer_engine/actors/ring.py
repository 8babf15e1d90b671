"""Ring actor (decode): the only owner of this rank's staging ring.

A decode room on a staged path announces itself before its first TransferRequest leaves
(:meth:`RingActor.open_room`, a call: its writers' slices, page sizes and capacity) and says when it
is final (``RoomClosed``); the ring keeps its own table of those rooms. When
:func:`~transfer_engine.protocol.staging.grant_with_request` says so, ``open_room`` places the
region of the room's chunk 0 at once, sized for the room's whole capacity, and returns it: it rides
on the room's TransferRequests, so that chunk needs no StagingRequest. A StagingRequest for it is
refused (the writer must use the region it was given).

Prefill writers ask for a region per (room, chunk) with ``StagingRequest``. The first request of a
chunk places its region — every writer's block packed in ``dst_head_start`` order — and tells the
room (:class:`RegionGranted`); every writer gets a ``StagingGrant`` naming the region and its own
block. A request that cannot be served gets ``StagingRefused`` with the reason (an ``oversized``
chunk names ``ring_bytes``), and an oversized chunk also fails the room here.

Regions are freed by a call (:meth:`RingActor.free_regions`, the RingPort): by the scatter actor
once a chunk has been copied out, and by the room for every region it still holds when it ends,
which happens only once no WRITE into them can still land. A call, not a mail: the copy's
``Scattered`` waited for a round trip through this mailbox, behind any StagingRequests queued
there (docs/DECISIONS.md, "Ring regions are freed by a call"). When a free moves the watermark, the
new one goes to every prefill peer; a peer that connects gets the current one at once.
"""

from __future__ import annotations

import logging

from transfer_engine.errors import StagingError
from transfer_engine.memory.layout import KVPool
from transfer_engine.memory.staging import StagingMemory
from transfer_engine.protocol import descriptors
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.staging import RingAllocator, grant_with_request, region_layout
from transfer_engine.runtime.mail import (
    RegionGranted,
    RingMail,
    RoomClosed,
    RoomOpened,
    StagingFailed,
    Subscribe,
)
from transfer_engine.runtime.peers import Peer
from transfer_engine.runtime.ports import Outbox, PeerBook, RankIdentity, RoomBoard

from .base import Actor

log = logging.getLogger(__name__)


class RingActor(Actor[RingMail]):
    """See the module docstring. ``memory`` is the registered ring; ``allocator`` its sole state."""

    def __init__(
        self,
        me: RankIdentity,
        pool: KVPool,
        memory: StagingMemory,
        peers: PeerBook,
        outbox: Outbox,
        rooms: RoomBoard,
        *,
        capacity: int = 4096,
        reserve: int = 0,
        grant_ahead: bool = True,
    ) -> None:
        super().__init__(capacity, reserve)
        self.grant_ahead = grant_ahead
        """Whether :meth:`open_room` may grant chunk 0's region with the request (``EngineConfig.grant_with_request``)."""
        self.me = me
        self.pool = pool
        self.memory = memory
        self.peers = peers
        self.outbox = outbox
        self.rooms = rooms
        self.allocator = RingAllocator(memory.nbytes)
        self._open: dict[int, RoomOpened] = {}
        """Staged rooms that are live and not final, as they announced themselves."""
        self._by_chunk: dict[tuple[int, int], RegionGranted] = {}
        """(room, chunk id) -> its region, as the room was told."""
        self._chunk_of: dict[int, tuple[int, int]] = {}
        """Allocation id -> (room, chunk id)."""
        self._placed: dict[int, set[int]] = {}
        """Chunk ids ever placed, per open room: a repeated request for one that was freed is refused."""

    async def handle(self, mail: RingMail) -> None:
        match mail:
            case m.StagingRequest():
                await self._on_request(mail)
            case RoomClosed(room=room, opened=opened) if self._open.get(room) is opened:
                del self._open[room]
                self._placed.pop(room, None)
            case RoomClosed():
                pass  # a room of that id opened again since: it is not the one closing
            case Subscribe(peer=peer):
                self._send_watermark([peer])

    # --- rooms and requests -----------------------------------------------------------------------

    def open_room(self, opened: RoomOpened) -> RegionGranted | None:
        """A staged room exists (:class:`~transfer_engine.runtime.ports.RingPort`); returns its chunk 0's region
        when it is granted with the request. Synchronous: it runs between this actor's mails."""
        self._open[opened.room] = opened
        if not self.grant_ahead:
            return None
        pool = self.pool
        layout = region_layout(
            pool.layout.num_kv_tensors,
            opened.capacity,
            pool.layout.head_dim,
            pool.itemsize,
            list(opened.slices),
        )
        if not grant_with_request(self.allocator, layout.total_bytes):
            return None
        allocation = self.allocator.assign(layout.total_bytes)
        granted = RegionGranted(0, allocation, layout, 0, 0, opened.capacity, ahead=True)
        key = (opened.room, 0)
        self._by_chunk[key] = granted
        self._chunk_of[allocation.alloc_id] = key
        self._placed.setdefault(opened.room, set()).add(0)
        return granted

    async def _on_request(self, req: m.StagingRequest) -> None:
        peer = self.peers.get(req.agent)
        if peer is None:
            self.outbox.count_drop(
                "StagingRequest", b"", f"from unknown agent {req.agent!r} (room {req.room})"
            )
            return
        granted, index, detail = await self._place(req)
        if granted is None:
            log.info("ring: refused room %d chunk %d of %s: %s", req.room, req.chunk_id, req.agent, detail)
            self.outbox.send(
                peer.endpoint,
                m.StagingRefused(
                    agent=self.me.agent_name, room=req.room, chunk_id=req.chunk_id, detail=detail
                ),
            )
            return
        self.outbox.send(
            peer.endpoint,
            m.StagingGrant(
                agent=self.me.agent_name,
                room=req.room,
                chunk_id=req.chunk_id,
                alloc_id=granted.allocation.alloc_id,
                round=granted.allocation.round,
                offset=granted.allocation.offset,
                length=granted.allocation.length,
                writer_offset=granted.layout.offsets[index],
                writer_bytes=granted.layout.sizes[index],
            ),
        )

    async def _place(self, req: m.StagingRequest) -> tuple[RegionGranted | None, int, str]:
        """The chunk's region (placed on the first request) and the writer's block index, or why not."""
        room = self._open.get(req.room)
        if room is None:
            return None, -1, f"room {req.room} is not a live staged room on decode rank {self.me.rank}"
        index = next((i for i, spec in enumerate(room.slices) if spec.prefill_rank == req.sender), None)
        if index is None:
            return (
                None,
                -1,
                f"room {req.room} chunk {req.chunk_id}: prefill rank {req.sender} is not a writer of it",
            )
        src_ps = room.writer_page_size[req.sender]
        tokens = descriptors.chunk_tokens(req.page_start * src_ps, req.num_pages, src_ps, room.capacity)
        if tokens != req.tokens:
            return (
                None,
                -1,
                (
                    f"room {req.room} chunk {req.chunk_id}: writer {req.sender} asked for {req.tokens} tokens, "
                    f"pages [{req.page_start}, {req.page_start + req.num_pages}) carry {tokens} here"
                ),
            )
        key = (req.room, req.chunk_id)
        granted = self._by_chunk.get(key)
        if granted is None and req.chunk_id in self._placed.get(req.room, ()):
            # A repeat (protocol.retransmit) that came after the chunk's region was scattered and
            # freed: placing it again would hand the room a region nobody writes.
            return None, -1, f"room {req.room} chunk {req.chunk_id} was placed and scattered already"
        if granted is not None and granted.ahead:
            return (
                None,
                -1,
                (
                    f"room {req.room} chunk {req.chunk_id}: its region {granted.allocation.alloc_id} was granted "
                    f"with the TransferRequest; writer {req.sender} must write there, not ask"
                ),
            )
        if granted is not None:
            if (granted.page_start, granted.num_pages) != (req.page_start, req.num_pages):
                return (
                    None,
                    -1,
                    (
                        f"room {req.room} chunk {req.chunk_id}: writer {req.sender} says pages "
                        f"[{req.page_start}, +{req.num_pages}), another writer said [{granted.page_start}, "
                        f"+{granted.num_pages})"
                    ),
                )
            return granted, index, ""
        pool = self.pool
        layout = region_layout(
            pool.layout.num_kv_tensors, tokens, pool.layout.head_dim, pool.itemsize, list(room.slices)
        )
        if layout.total_bytes == 0:
            return None, -1, f"room {req.room} chunk {req.chunk_id} carries no tokens for this decode rank"
        try:
            allocation = self.allocator.assign(layout.total_bytes)
        except StagingError as exc:
            await self.rooms.deliver(req.room, StagingFailed(str(exc)))
            return None, -1, str(exc)
        granted = RegionGranted(req.chunk_id, allocation, layout, req.page_start, req.num_pages, tokens)
        if not await self.rooms.deliver(req.room, granted):
            if self.allocator.free(allocation.alloc_id) is not None:
                self._send_watermark(self.peers.live())
            return None, -1, f"room {req.room} ended"
        self._by_chunk[key] = granted
        self._chunk_of[allocation.alloc_id] = key
        self._placed.setdefault(req.room, set()).add(req.chunk_id)
        return granted, index, ""

    # --- frees and the watermark ------------------------------------------------------------------

    def free_regions(self, alloc_ids: tuple[int, ...]) -> None:
        """Release ``alloc_ids`` (the RingPort call). Synchronous: it runs between this actor's mails,
        or while one waits for a room to take a grant; it touches only allocations already handed
        out, never the one being placed."""
        for alloc_id in alloc_ids:
            self._free(alloc_id)

    def _free(self, alloc_id: int) -> None:
        key = self._chunk_of.pop(alloc_id, None)
        if key is None:
            log.error("ring: free of unknown allocation %d", alloc_id)
            return
        granted = self._by_chunk.get(key)
        if granted is not None and granted.allocation.alloc_id == alloc_id:
            del self._by_chunk[key]
        if self.allocator.free(alloc_id) is not None:
            self._send_watermark(self.peers.live())

    def _send_watermark(self, peers: list[Peer]) -> None:
        wm = self.allocator.watermark
        message = m.Watermark(**self.me.stamp(), round=wm.round, tail=wm.tail)
        for peer in peers:
            if peer.alive:
                self.outbox.send(peer.endpoint, message)

    def live(self) -> int:
        """Allocations not yet freed (0 when idle: the leak check)."""
        return self.allocator.live
