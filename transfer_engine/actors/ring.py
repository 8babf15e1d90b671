"""Ring actor (decode): the only owner of this rank's staging ring (DESIGN §5).

Prefill writers ask for a region per (room, chunk) with ``StagingRequest``. The first request of a
chunk places its region — every writer's block packed in ``dst_head_start`` order — and tells the
room (:class:`RegionGranted`); every writer gets a ``StagingGrant`` naming the region and its own
block. A request that cannot be served gets ``StagingRefused`` with the reason (an ``oversized``
chunk names ``ring_bytes``), and an oversized chunk also fails the room here.

Regions are freed only through this actor's mailbox (:class:`FreeRegion`): by the scatter actor
once a chunk has been copied out, and by the room for every region it still holds when it ends,
which happens only once no WRITE into them can still land. When a free moves the watermark, the
new one goes to every prefill peer; a peer that connects gets the current one at once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from transfer_engine.errors import ConfigError, StagingError
from transfer_engine.memory import StagingMemory
from transfer_engine.peers import Peer
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.staging import Allocation, RegionLayout, RingAllocator, region_layout

if TYPE_CHECKING:
    from transfer_engine.engine import TransferEngine

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FreeRegion:
    """Release ring allocation ``alloc_id`` (no WRITE into it can land any more).

    ``done`` is set once it is released, so the sender can report the room quiescent only after
    the ring really is (a leak check right after ``wait()`` sees the true state).
    """

    alloc_id: int
    done: anyio.Event | None = None


@dataclass(frozen=True, slots=True)
class Subscribe:
    """A prefill peer connected: send it the current watermark."""

    peer: Peer


@dataclass(frozen=True, slots=True)
class RegionGranted:
    """Ring -> room: chunk ``chunk_id`` has region ``allocation`` with these writer blocks."""

    chunk_id: int
    allocation: Allocation
    layout: RegionLayout
    page_start: int
    num_pages: int
    tokens: int


@dataclass(frozen=True, slots=True)
class StagingFailed:
    """Ring -> room: a chunk of the room cannot be placed; the room fails with ``detail``."""

    detail: str


RingMail = m.StagingRequest | FreeRegion | Subscribe


class RingActor:
    """See the module docstring. ``memory`` is the registered ring; ``allocator`` its sole state."""

    def __init__(self, engine: TransferEngine, memory: StagingMemory, *, mailbox: int = 4096) -> None:
        self.engine = engine
        self.memory = memory
        self.allocator = RingAllocator(memory.nbytes)
        self.inbox: MemoryObjectSendStream[RingMail]
        self._rx: MemoryObjectReceiveStream[RingMail]
        self.inbox, self._rx = anyio.create_memory_object_stream[RingMail](mailbox)
        self._by_chunk: dict[tuple[int, int], RegionGranted] = {}
        """(room, chunk id) -> its region, as the room was told."""
        self._chunk_of: dict[int, tuple[int, int]] = {}
        """Allocation id -> (room, chunk id)."""

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self._rx:
            async for mail in self._rx:
                match mail:
                    case m.StagingRequest():
                        await self._on_request(mail)
                    case FreeRegion(alloc_id=alloc_id, done=done):
                        self._free(alloc_id)
                        if done is not None:
                            done.set()
                    case Subscribe(peer=peer):
                        self._send_watermark([peer])

    # --- requests ------------------------------------------------------------------------------

    async def _on_request(self, req: m.StagingRequest) -> None:
        peer = self.engine.peers.get(req.agent)
        if peer is None:
            self.engine.control.count_drop(
                "StagingRequest", b"", f"from unknown agent {req.agent!r} (room {req.room})"
            )
            return
        granted, index, detail = await self._place(req)
        if granted is None:
            log.info("ring: refused room %d chunk %d of %s: %s", req.room, req.chunk_id, req.agent, detail)
            self.engine.control.send(
                peer.endpoint,
                m.StagingRefused(
                    agent=self.engine.agent_name, room=req.room, chunk_id=req.chunk_id, detail=detail
                ),
            )
            return
        self.engine.control.send(
            peer.endpoint,
            m.StagingGrant(
                agent=self.engine.agent_name,
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
        from transfer_engine.actors.room import ReceiverRoomActor

        actor = self.engine.rooms.get(req.room)
        if not isinstance(actor, ReceiverRoomActor) or not actor.staged:
            return (
                None,
                -1,
                f"room {req.room} is not a live staged room on decode rank {self.engine.config.tp_rank}",
            )
        if actor.status.final or actor.done.is_set():
            return None, -1, f"room {req.room} is {actor.status.name}"
        try:
            index = actor.writer_index(req.sender)
            tokens = actor.chunk_tokens(req.sender, req.page_start, req.num_pages)
        except ConfigError as exc:
            return None, -1, f"room {req.room} chunk {req.chunk_id}: {exc}"
        if tokens != req.tokens:
            return (
                None,
                -1,
                (
                    f"room {req.room} chunk {req.chunk_id}: writer {req.sender} asked for {req.tokens} tokens, "
                    f"pages [{req.page_start}, {req.page_start + req.num_pages}) carry {tokens} here"
                ),
            )
        if req.chunk_id in actor.core.landed.get(req.sender, ()):
            # A repeat (protocol.retransmit) that arrived after the chunk landed, maybe after its region
            # was scattered and freed: placing it again would hand the room a region nobody writes.
            return None, -1, f"room {req.room} chunk {req.chunk_id} from writer {req.sender} already landed"
        key = (req.room, req.chunk_id)
        granted = self._by_chunk.get(key)
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
        pool = self.engine.pool
        layout = region_layout(
            pool.layout.num_kv_tensors, tokens, pool.layout.head_dim, pool.itemsize, actor.slices
        )
        if layout.total_bytes == 0:
            return None, -1, f"room {req.room} chunk {req.chunk_id} carries no tokens for this decode rank"
        try:
            allocation = self.allocator.assign(layout.total_bytes)
        except StagingError as exc:
            await _tell(actor, StagingFailed(str(exc)))
            return None, -1, str(exc)
        granted = RegionGranted(req.chunk_id, allocation, layout, req.page_start, req.num_pages, tokens)
        if not await _tell(actor, granted):
            if self.allocator.free(allocation.alloc_id) is not None:
                self._send_watermark(list(self.engine.peers.values()))
            return None, -1, f"room {req.room} ended"
        self._by_chunk[key] = granted
        self._chunk_of[allocation.alloc_id] = key
        return granted, index, ""

    # --- frees and the watermark ------------------------------------------------------------------

    def _free(self, alloc_id: int) -> None:
        key = self._chunk_of.pop(alloc_id, None)
        if key is None:
            log.error("ring: free of unknown allocation %d", alloc_id)
            return
        del self._by_chunk[key]
        if self.allocator.free(alloc_id) is not None:
            self._send_watermark(list(self.engine.peers.values()))

    def _send_watermark(self, peers: list[Peer]) -> None:
        wm = self.allocator.watermark
        message = m.Watermark(
            agent=self.engine.agent_name, rank=self.engine.config.tp_rank, round=wm.round, tail=wm.tail
        )
        for peer in peers:
            if peer.alive:
                self.engine.control.send(peer.endpoint, message)

    def live(self) -> int:
        """Allocations not yet freed (0 when idle: the leak check)."""
        return self.allocator.live


async def _tell(actor: object, mail: object) -> bool:
    try:
        await actor.inbox.send(mail)  # type: ignore[attr-defined]
    except (anyio.ClosedResourceError, anyio.BrokenResourceError):
        return False
    return True
