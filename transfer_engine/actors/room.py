"""Room actors: one per live room and side, each a thin shell around the core's room state machine.

A room actor is the only task that mutates its room. Everything that concerns the room — wire
messages, notifications, WRITE completions, the user's ``send``/``abort`` — arrives in its mailbox.
It wakes at the room's deadline, lets the NixlPoller finish a drain cycle, applies whatever
arrived, and only then asks the core whether the deadline has passed.

A room ends (its actor returns and it leaves the engine) only when it is final AND quiescent: no
WRITE of it can still land. On the prefill side that means no posted WRITE is unfinished; on the
decode side that every writer has acknowledged an abort (or died) when the room did not succeed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import numpy as np
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from transfer_engine.errors import ConfigError, FailureReason, ProtocolError, TransferFailed, failure_error
from transfer_engine.peers import Peer
from transfer_engine.protocol import descriptors, heads
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.paths import TransferPath, is_staged
from transfer_engine.protocol.rooms import Deadlines, ReceiverRoom, RoomStatus, SenderRoom, _Room

from .ring import FreeRegion, RegionGranted, StagingFailed
from .scatter import Scattered, ScatterJob
from .worker import CancelRoom, WriteJob

if TYPE_CHECKING:
    from transfer_engine.engine import TransferEngine

log = logging.getLogger("transfer_engine.room")

MAILBOX = 256
DRAINED_WAIT_S = 0.5
"""How long a deadline check waits for the poller's next full cycle before it reads its own mailbox
(which is what a poller blocked on this room's full mailbox needs)."""
RING_FREE_WAIT_S = 5.0


@dataclass(frozen=True, slots=True)
class QueueChunk:
    pages: np.ndarray
    last: bool
    aux_slot: int | None
    ready: torch.cuda.Event | None = None
    """Recorded on the caller's CUDA stream at ``send()``: the chunk's KV is written once it completes."""


@dataclass(frozen=True, slots=True)
class WriteDone:
    chunk_id: int | None
    """None for the aux WRITE."""
    decode_rank: int
    ok: bool
    detail: str
    reason: FailureReason = FailureReason.TRANSPORT
    """What the room fails with when not ``ok``."""


@dataclass(frozen=True, slots=True)
class LocalAbort:
    detail: str


@dataclass(frozen=True, slots=True)
class PeerDead:
    agent: str
    detail: str


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


RoomMail = (
    QueueChunk
    | WriteDone
    | RegionGranted
    | StagingFailed
    | Scattered
    | LocalAbort
    | PeerDead
    | Shutdown
    | m.TransferRequest
    | m.Abort
    | m.AbortAck
    | m.RoomFailed
    | m.ChunkLanded
    | m.AuxLanded
)


class _RoomActor:
    core: _Room
    side: str

    def __init__(self, engine: TransferEngine, room: int) -> None:
        self.engine = engine
        self.room = room
        self.inbox: MemoryObjectSendStream[RoomMail]
        self._rx: MemoryObjectReceiveStream[RoomMail]
        self.inbox, self._rx = anyio.create_memory_object_stream[RoomMail](MAILBOX)
        self.done = anyio.Event()
        self.created = time.monotonic()

    @property
    def status(self) -> RoomStatus:
        return self.core.status

    def error(self) -> TransferFailed | None:
        failure = self.core.failure
        return None if failure is None else failure_error(self.room, failure.reason, failure.detail)

    def _fail(self, reason: FailureReason, detail: str) -> bool:
        if self.core.fail(reason, detail, time.monotonic()):
            log.info("%s room %d failed: %s: %s", self.side, self.room, reason.name, detail)
            return True
        return False

    def quiescent(self) -> bool:
        raise NotImplementedError

    async def handle(self, mail: RoomMail) -> None:
        raise NotImplementedError

    async def finish(self) -> None:
        """Runs once, when the room is final and quiescent, before it leaves the engine."""

    async def run(self) -> None:
        """The room's life: mailbox loop until final and quiescent, then cleanup (always)."""
        log.info("%s room %d: %s", self.side, self.room, self.core.status.name)
        try:
            async with self._rx:
                while not (self.core.status.final and self.quiescent()):
                    deadline = self.core.deadline
                    wait = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                    with anyio.move_on_after(wait):
                        await self._apply(await self._rx.receive())
                        continue
                    await self._check_deadline()
                # Mail sent from now on finds the room gone, and the engine answers it (an Abort gets
                # its AbortAck there); mail already queued is still applied, so no Abort is lost.
                self.inbox.close()
                while True:
                    try:
                        mail = self._rx.receive_nowait()
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break
                    await self._apply(mail)
        finally:
            with anyio.CancelScope(shield=True):
                await self.finish()
                self.inbox.close()
                self.engine.forget_room(self)
                self.done.set()
            log.info("%s room %d ended %s", self.side, self.room, self.core.status.name)

    async def _apply(self, mail: RoomMail) -> None:
        before = self.core.status
        try:
            await self.handle(mail)
        except ProtocolError as exc:
            self._fail(FailureReason.PROTOCOL, str(exc))
        if self.core.status is not before:
            log.info("%s room %d: %s -> %s", self.side, self.room, before.name, self.core.status.name)
            await self.on_status_change(before)

    async def on_status_change(self, before: RoomStatus) -> None:
        """Hook for side effects of a status change (telling peers about a failure, ...)."""

    async def _check_deadline(self) -> None:
        # Bounded: the poller may itself be waiting to put mail into this room's full mailbox.
        with anyio.move_on_after(DRAINED_WAIT_S):
            await self.engine.poller.drained()
        while True:
            try:
                mail = self._rx.receive_nowait()
            except anyio.WouldBlock:
                break
            await self._apply(mail)
        failure = self.core.expired(time.monotonic())
        if failure is not None:
            before = self.core.status
            self._fail(failure.reason, failure.detail)
            await self.on_status_change(before)


class SenderRoomActor(_RoomActor):
    """One room on a prefill rank; see the module docstring."""

    side = "prefill"

    def __init__(self, engine: TransferEngine, room: int, deadlines: Deadlines) -> None:
        super().__init__(engine, room)
        self.core: SenderRoom = SenderRoom(room, deadlines, time.monotonic())
        self.requests: dict[int, m.TransferRequest] = {}
        self.peers: dict[int, Peer] = {}
        self.pages: list[np.ndarray] = []
        self.ready: list[torch.cuda.Event | None] = []
        self.jobs: list[WriteJob] = []
        self.ack_to: dict[str, Peer] = {}
        self.failed_by: set[str] = set()
        """Decode agents that aborted or failed this room themselves (they need no RoomFailed)."""

    def quiescent(self) -> bool:
        return self.core.in_flight == 0

    async def handle(self, mail: RoomMail) -> None:
        now = time.monotonic()
        match mail:
            case m.TransferRequest():
                await self._on_request(mail, now)
            case QueueChunk(pages=pages, last=last, aux_slot=aux_slot, ready=ready):
                chunk = self.core.queue_chunk(len(pages), last, aux_slot, now)
                self.pages.append(pages)
                self.ready.append(ready)
                for d in sorted(self.requests):
                    await self._schedule(chunk.chunk_id, d)
                if last:
                    for d in sorted(self.core.aux_targets):
                        await self._schedule_aux(d)
            case WriteDone(chunk_id=chunk_id, decode_rank=d, ok=ok, detail=detail, reason=reason):
                self.core.in_flight -= 1
                if not ok:
                    self._fail(reason, detail)
                elif chunk_id is None:
                    self.core.aux_written(d, now)
                else:
                    self.core.write_done(chunk_id, d, now)
            case m.Abort(agent=agent, reason=reason, detail=detail):
                peer = self.engine.peers.get(agent)
                if peer is not None:
                    self.ack_to[agent] = peer
                self.failed_by.add(agent)
                # A ring that cannot place a chunk is worth naming as such on this side too.
                why = FailureReason.STAGING if reason == FailureReason.STAGING else FailureReason.ABORTED
                self._fail(why, f"aborted by decode {agent}: {detail}")
            case m.RoomFailed(agent=agent, reason=reason, detail=detail):
                self.failed_by.add(agent)
                self._fail(
                    FailureReason.REMOTE,
                    f"decode {agent} failed the room: {FailureReason(reason).name}: {detail}",
                )
            case LocalAbort(detail=detail):
                self._fail(FailureReason.ABORTED, detail)
            case PeerDead(agent=agent, detail=detail):
                if any(p.agent_name == agent for p in self.peers.values()):
                    self._fail(FailureReason.PEER_DEAD, detail)
            case Shutdown():
                self._fail(FailureReason.SHUTDOWN, "engine closed")
            case _:
                raise ProtocolError(f"{type(mail).__name__} is not for a prefill room")

    async def _on_request(self, req: m.TransferRequest, now: float) -> None:
        peer = self.engine.peers.get(req.agent)
        if peer is None:
            raise ProtocolError(f"TransferRequest from unknown decode agent {req.agent!r}")
        if (req.decode_tp, req.decode_rank) != (peer.tp_size, peer.rank):
            raise ProtocolError(
                f"TransferRequest says decode rank {req.decode_rank} of {req.decode_tp}, but agent "
                f"{req.agent} said rank {peer.rank} of {peer.tp_size} in its PeerHello"
            )
        layout = self.engine.pool.layout
        my_rank = self.engine.config.tp_rank
        expected = heads.targets_of(
            layout.num_heads, self.engine.config.tp_size, req.decode_tp, my_rank, layout.mla
        ).get(req.decode_rank)
        got = req.slices[0] if req.slices else None
        if len(req.slices) > 1 or (expected is None) != (got is None):
            raise ProtocolError(
                f"decode rank {req.decode_rank} asked for slices {req.slices}, expected {expected}"
            )
        if got is not None and expected is not None:
            if (got.src_head_start, got.dst_head_start, got.num_heads) != (
                expected.src_head_start,
                expected.dst_head_start,
                expected.num_heads,
            ):
                raise ProtocolError(f"decode rank {req.decode_rank} asked for {got}, expected {expected}")
        if TransferPath.parse(req.path) is None:
            raise ProtocolError(f"path {req.path!r} is not served by this engine")
        if is_staged(req.path) and got is not None and peer.ring is None:
            raise ProtocolError(
                f"path {req.path!r} but decode rank {req.decode_rank} registered no staging ring"
            )
        bad = [p for p in req.dst_pages if not 0 <= p < peer.layout.num_pages]
        if bad:
            raise ProtocolError(f"decode page {bad[0]} outside [0, {peer.layout.num_pages})")
        if self.core.status is RoomStatus.FAILED:
            # This decode rank asked after the room failed (an abort, a failed WRITE): the RoomFailed
            # of that moment did not reach it, and no chunk ever will, so tell it now.
            if peer.agent_name not in self.failed_by:
                self._tell_failure(peer)
            return
        self.core.on_request(req.decode_rank, req.decode_tp, got is not None, req.aux_slot is not None, now)
        self.requests[req.decode_rank] = req
        self.peers[req.decode_rank] = peer
        for chunk in self.core.chunks:
            await self._schedule(chunk.chunk_id, req.decode_rank)
        if self.core.sealed and req.decode_rank in self.core.aux_targets:
            await self._schedule_aux(req.decode_rank)

    async def _schedule(self, chunk_id: int, decode_rank: int) -> None:
        req = self.requests[decode_rank]
        if not req.slices or self.core.status.final:
            return
        await self._dispatch(
            WriteJob(
                self.room,
                self.engine.config.tp_rank,
                self.peers[decode_rank],
                req,
                self.core.chunks[chunk_id],
                self.pages[chunk_id],
                self._completion(chunk_id, decode_rank),
                ready=self.ready[chunk_id],
            )
        )

    async def _schedule_aux(self, d: int) -> None:
        if d not in self.requests or self.core.status.final:
            return
        aux_slot = self.core.aux_slot
        if aux_slot is None:
            raise ProtocolError(
                f"decode rank {d} asked for the aux item but the last send() gave no aux_slot"
            )
        empty = np.empty(0, dtype=np.int64)
        job = WriteJob(
            self.room, self.engine.config.tp_rank, self.peers[d], self.requests[d], None, empty,
            self._completion(None, d), aux_slot=aux_slot,
        )  # fmt: skip
        await self._dispatch(job)

    async def _dispatch(self, job: WriteJob) -> None:
        self.core.in_flight += 1
        self.jobs.append(job)
        await self.engine.worker_for(job.peer.agent_name).inbox.send(job)

    def _completion(
        self, chunk_id: int | None, decode_rank: int
    ) -> Callable[[bool, str, FailureReason], Awaitable[None]]:
        async def done(ok: bool, detail: str, reason: FailureReason = FailureReason.TRANSPORT) -> None:
            await self.inbox.send(WriteDone(chunk_id, decode_rank, ok, detail, reason))

        return done

    async def on_status_change(self, before: RoomStatus) -> None:
        if self.core.status is not RoomStatus.FAILED:
            return
        workers = set()
        for job in self.jobs:
            job.cancelled = True
            workers.add(self.engine.worker_for(job.peer.agent_name))
        for worker in workers:  # parked staged chunks end now instead of waiting for a grant
            await worker.inbox.send(CancelRoom(self.room))
        # Every other decode rank of the room hears it too: when one decode rank aborts, the others
        # must not wait for chunks this rank will never send.
        for peer in self.peers.values():
            if peer.agent_name not in self.failed_by:
                self._tell_failure(peer)

    def _tell_failure(self, peer: Peer) -> None:
        """Send the room's failure to decode ``peer`` (the room is Failed)."""
        failure = self.core.failure
        assert failure is not None
        self.engine.control.send(
            peer.endpoint,
            m.RoomFailed(
                room=self.room,
                agent=self.engine.agent_name,
                rank=self.engine.config.tp_rank,
                reason=int(failure.reason),
                detail=failure.detail,
            ),
        )

    async def finish(self) -> None:
        if not self.core.status.final:
            self._fail(FailureReason.SHUTDOWN, "room actor stopped")
        self.jobs.clear()
        for agent, peer in self.ack_to.items():
            self.engine.control.send(
                peer.endpoint,
                m.AbortAck(room=self.room, agent=self.engine.agent_name, rank=self.engine.config.tp_rank),
            )
            log.debug("prefill room %d: AbortAck to %s", self.room, agent)


class ReceiverRoomActor(_RoomActor):
    """One room on a decode rank; see the module docstring.

    On the staged paths the room also holds its ring regions: the ring actor tells it of each
    (:class:`RegionGranted`); when a chunk has landed from every writer the room hands it to the
    scatter actor, which frees the region once the chunk is in the pages. Regions of chunks that
    were never scattered are freed when the room ends — only once quiescent, so no WRITE into them
    can still land — and a room with a scatter running is not quiescent.
    """

    side = "decode"

    def __init__(
        self,
        engine: TransferEngine,
        room: int,
        deadlines: Deadlines,
        writers: dict[int, Peer],
        *,
        pages: np.ndarray,
        slices: list[heads.HeadSlice],
        path: str,
    ) -> None:
        super().__init__(engine, room)
        self.core: ReceiverRoom = ReceiverRoom(room, deadlines, time.monotonic())
        self.writers = writers
        """Global prefill rank -> peer, for every rank that writes into this decode rank."""
        self.everyone: list[Peer] = []
        """Every prefill rank of the instance: all got a TransferRequest, all hear about a failure."""
        self.pages = pages
        self.slices = slices
        """The writers' head slices, in ``dst_head_start`` order (their block order in a region)."""
        self.path = path
        self.staged = is_staged(path)
        self.core.staged = self.staged
        self.regions: dict[int, RegionGranted] = {}
        """Ring regions this room holds, by chunk id (until scattered, or freed at the end)."""
        self.scattering = 0
        self.aborting = False
        self.remote_failure = False

    def quiescent(self) -> bool:
        if self.scattering:
            return False
        if self.core.status is RoomStatus.SUCCESS:
            return True
        return self.aborting and not self.core.awaiting_acks

    # --- staged-path helpers (called by the ring actor, which owns the ring) --------------------

    def writer_index(self, sender: int) -> int:
        """Position of prefill rank ``sender`` among this room's writers; ConfigError if not one."""
        for i, spec in enumerate(self.slices):
            if spec.prefill_rank == sender:
                return i
        raise ConfigError(f"prefill rank {sender} is not a writer of room {self.room}")

    def chunk_tokens(self, sender: int, page_start: int, num_pages: int) -> int:
        """Tokens a chunk of ``num_pages`` prefill pages from ``page_start`` carries into this rank."""
        src_ps = self.writers[sender].layout.page_size
        capacity = len(self.pages) * self.engine.pool.layout.page_size
        return descriptors.chunk_tokens(page_start * src_ps, num_pages, src_ps, capacity)

    # --- mailbox -------------------------------------------------------------------------------

    async def handle(self, mail: RoomMail) -> None:
        now = time.monotonic()
        match mail:
            case m.ChunkLanded(sender=sender, chunk_id=chunk_id) if chunk_id in self.core.landed.get(
                sender, ()
            ):
                # a duplicated notification: the chunk is there already; count it, change nothing
                self.engine.counters["notifs_duplicate"] += 1
                log.warning(
                    "decode room %d: chunk %d from rank %d notified twice", self.room, chunk_id, sender
                )
            case m.AuxLanded(sender=sender) if self.core.aux_landed and sender == self.core.wants_aux_from:
                self.engine.counters["notifs_duplicate"] += 1
            case m.ChunkLanded(sender=sender, chunk_id=chunk_id, last=last, region=region):
                if self.staged:
                    granted = self.regions.get(chunk_id)
                    if granted is None or granted.allocation.alloc_id != region:
                        raise ProtocolError(
                            f"chunk {chunk_id} from prefill rank {sender} landed in region {region}, "
                            f"but the room holds {None if granted is None else granted.allocation.alloc_id}"
                        )
                elif region != -1:
                    raise ProtocolError(
                        f"chunk {chunk_id} landed in ring region {region} on the {self.path} path"
                    )
                if self.core.on_chunk(sender, chunk_id, last, now) and self.staged:
                    await self._scatter(chunk_id, now)
            case m.AuxLanded(sender=sender):
                self.core.on_aux(sender, now)
            case RegionGranted(chunk_id=chunk_id):
                self.regions[chunk_id] = mail
            case Scattered(chunk_id=chunk_id, ok=ok, detail=detail):
                self.scattering -= 1
                self.regions.pop(chunk_id, None)  # the scatter actor freed it
                if ok:
                    self.core.on_scattered(chunk_id, now)
                else:
                    self._fail(FailureReason.TRANSPORT, detail)
            case StagingFailed(detail=detail):
                self._fail(FailureReason.STAGING, detail)
            case m.AbortAck(rank=rank):
                self.core.awaiting_acks.discard(rank)
            case m.RoomFailed(agent=agent, reason=reason, detail=detail):
                self.remote_failure = True
                why = FailureReason(reason)
                passed_on = (FailureReason.ABORTED, FailureReason.STAGING, FailureReason.BOOTSTRAP_TIMEOUT)
                self._fail(
                    why if why in passed_on else FailureReason.REMOTE,
                    f"prefill {agent} failed the room: {why.name}: {detail}",
                )
            case LocalAbort(detail=detail):
                self._fail(FailureReason.ABORTED, detail)
            case PeerDead(agent=agent, detail=detail):
                for rank, peer in self.writers.items():
                    if peer.agent_name == agent:
                        self.core.awaiting_acks.discard(rank)
                        self._fail(FailureReason.PEER_DEAD, detail)
            case Shutdown():
                self._fail(FailureReason.SHUTDOWN, "engine closed")
            case _:
                raise ProtocolError(f"{type(mail).__name__} is not for a decode room")

    async def _scatter(self, chunk_id: int, now: float) -> None:
        """Every writer of ``chunk_id`` landed: copy the region into the pages (unless the room failed)."""
        if self.core.status.final:
            return
        granted = self.regions[chunk_id]
        start = granted.page_start * self.writers[self.slices[0].prefill_rank].layout.page_size
        slots = descriptors.slots_of(self.pages, self.engine.pool.layout.page_size, start, granted.tokens)
        blocks = [
            (offset, spec.dst_head_start, spec.num_heads)
            for offset, spec in zip(granted.layout.offsets, self.slices, strict=True)
        ]
        scatter = self.engine.scatter
        assert scatter is not None
        self.scattering += 1
        await scatter.inbox.send(
            ScatterJob(
                self,
                chunk_id,
                granted.allocation.alloc_id,
                granted.allocation.offset,
                granted.allocation.length,
                blocks,
                slots,
            )  # fmt: skip
        )

    async def on_status_change(self, before: RoomStatus) -> None:
        if self.core.status is not RoomStatus.FAILED or self.aborting:
            return
        await self.start_abort()

    async def start_abort(self) -> None:
        """Ask every writer to stop; the room becomes quiescent once all of them acknowledged."""
        self.aborting = True
        failure = self.core.failure
        detail = failure.detail if failure else "aborted"
        reason = failure.reason if failure else FailureReason.ABORTED
        self.core.awaiting_acks = {rank for rank, peer in self.writers.items() if peer.alive}
        for peer in self.everyone:
            self.engine.control.send(
                peer.endpoint,
                m.Abort(
                    room=self.room,
                    agent=self.engine.agent_name,
                    rank=self.engine.config.tp_rank,
                    reason=int(reason),
                    detail=detail,
                ),
            )

    async def finish(self) -> None:
        if not self.core.status.final:
            self._fail(FailureReason.SHUTDOWN, "room actor stopped")
        ring = self.engine.ring
        if ring is not None and self.regions:
            freed = [anyio.Event() for _ in self.regions]
            try:
                for granted, done in zip(self.regions.values(), freed, strict=True):
                    ring.inbox.send_nowait(FreeRegion(granted.allocation.alloc_id, done))
                with anyio.move_on_after(RING_FREE_WAIT_S):
                    for done in freed:
                        await done.wait()
            except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError):
                # only while the engine closes: the ring goes away with it
                log.debug("room %d: ring closed before its regions were freed", self.room)
        self.regions.clear()
