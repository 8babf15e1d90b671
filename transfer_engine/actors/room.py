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

import asyncio
import logging
import time
from collections import deque
from dataclasses import replace
from typing import NamedTuple

import anyio
import numpy as np
import torch

from transfer_engine.errors import (
    FailureReason,
    LocalProtocolError,
    ProtocolError,
    TransferFailed,
    failure_error,
)
from transfer_engine.memory.staging import chunk_region_bytes
from transfer_engine.protocol import descriptors, heads
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.layers import LayerGroup, LayerTally, group_tensor_runs
from transfer_engine.protocol.paths import TransferPath, is_staged
from transfer_engine.protocol.retransmit import (
    REPEAT_BASE_S,
    REPEAT_CAP_S,
    Backoff,
    Repeat,
    RequestAnswer,
    answer_request,
    decode_repeat,
)
from transfer_engine.protocol.rooms import (
    Deadlines,
    ReceiverRoom,
    RoomStatus,
    SenderRoom,
    _Room,
    abort_reason,
    reason_name,
    remote_failure_reason,
)
from transfer_engine.protocol.staging import RegionLayout, writer_block_bytes
from transfer_engine.runtime.mail import (
    CancelRoom,
    Drained,
    JobKey,
    LayersReady,
    LocalAbort,
    Mailbox,
    MailboxOverflow,
    PeerDead,
    QueueChunk,
    Ready,
    RegionGranted,
    RoomClosed,
    RoomMail,
    RoomOpened,
    Scattered,
    ScatterJob,
    ScatterRun,
    Shutdown,
    StagingFailed,
    WriteDone,
    WriteEnded,
    WriteJob,
)
from transfer_engine.runtime.peers import Peer
from transfer_engine.runtime.ports import (
    JOBS_PER_ROOM,
    ROOM_MAILBOX,
    ROOM_RESERVE,
    SCATTERS_PER_ROOM,
    RoomPorts,
)

log = logging.getLogger("transfer_engine.room")


class _ToScatter(NamedTuple):
    """A copy out of a chunk's ring region a decode room waits to hand to the scatter actor."""

    chunk_id: int
    sender: int | None
    """Layer-wise: the writer whose group landed; None with ``layers`` None (every writer's block)."""
    layers: tuple[int, int] | None
    """Layer-wise: the group's layers; None: the whole chunk."""
    final: bool
    """The chunk's last copy: the chunk is then wholly in the pages and its region is freed."""


class _RoomActor:
    core: _Room
    side: str

    def __init__(self, ports: RoomPorts, room: int) -> None:
        self.ports = ports
        self.room = room
        self.inbox: Mailbox[RoomMail] = Mailbox(ROOM_MAILBOX, ROOM_RESERVE)
        self.done = anyio.Event()
        self.status_changed = anyio.Event()
        """Set when a mail changed the room's status, or the room ended; replaced by a fresh one
        after each change (a waiter looks at ``status`` again and waits on the new one)."""
        self.created = time.monotonic()
        self._drain_asked = False

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

    async def handle(self, mail: RoomMail) -> None:
        raise NotImplementedError

    async def finish(self) -> None:
        """Runs once, when the room is final and quiescent, before it leaves the engine."""

    def repeat_at(self) -> float | None:
        """When the room next repeats an unanswered message (:mod:`~transfer_engine.protocol.retransmit`)."""
        return None

    def repeat(self, now: float) -> None:
        """Repeat the unanswered messages (called once ``repeat_at`` has passed)."""

    async def run(self) -> None:
        """The room's life: mailbox loop until final and quiescent, then cleanup (always).

        A room waits on nothing but its own mailbox. At its deadline it asks the poller for a
        :class:`Drained` reply and keeps reading mail; the deadline is judged when the reply comes,
        after every notification that had arrived was applied.
        """
        log.debug("%s room %d: %s", self.side, self.room, self.core.status.name)
        loop = asyncio.get_running_loop()
        timer: asyncio.TimerHandle | None = None
        armed: float | None = None
        try:
            while not (self.core.status.final and self.core.quiescent):
                deadline = None if self._drain_asked else self.core.deadline
                wakes = [t for t in (deadline, self.repeat_at()) if t is not None]
                wake = min(wakes) if wakes else None
                if wake != armed:  # one timer nudges the inbox at the next wake, re-armed only when it moves
                    if timer is not None:
                        timer.cancel()
                    timer = (
                        None if wake is None else loop.call_later(wake - time.monotonic(), self.inbox.nudge)
                    )
                    armed = wake
                mail = await self.inbox.next()
                if mail is not None:
                    await self._apply(mail)
                    continue
                armed = None  # the timer fired (or a stale one did): the next turn arms it afresh
                now = time.monotonic()
                if wake is not None and now < wake:
                    continue  # early (the loop's clock) or stale: wait for the rest
                repeat_at = self.repeat_at()
                if repeat_at is not None and now >= repeat_at:
                    self.repeat(now)
                if deadline is not None and now >= deadline:
                    self._drain_asked = True
                    self.ports.drain.request_drain(self.room)
            # Mail sent from now on finds the room gone, and the engine answers it (an Abort gets
            # its AbortAck there); mail already queued is still applied, so no Abort is lost.
            self.inbox.close()
            while True:
                try:
                    mail = self.inbox.receive_nowait()
                except (anyio.WouldBlock, anyio.EndOfStream):
                    break
                await self._apply(mail)
        finally:
            if timer is not None:
                timer.cancel()
            with anyio.CancelScope(shield=True):
                await self.finish()
                self.inbox.close()
                self.ports.rooms.close(self.room, self.inbox)
                self.done.set()
                self.status_changed.set()
            log.debug("%s room %d ended %s", self.side, self.room, self.core.status.name)

    async def _apply(self, mail: RoomMail) -> None:
        before = self.core.status
        self.ports.me.trace.mark_mail("room", mail, self.room)
        try:
            if isinstance(mail, Drained):
                self._drain_asked = False
                failure = self.core.expired(time.monotonic())
                if failure is not None:
                    self._fail(failure.reason, failure.detail)
            else:
                await self.handle(mail)
        except ProtocolError as exc:
            self._fail(FailureReason.PROTOCOL, str(exc))
        if self.core.status is not before:
            self.ports.me.trace.mark(self.room, self.core.status.name)
            log.debug("%s room %d: %s -> %s", self.side, self.room, before.name, self.core.status.name)
            changed, self.status_changed = self.status_changed, anyio.Event()
            changed.set()
            await self.on_status_change(before)

    async def on_status_change(self, before: RoomStatus) -> None:
        """Hook for side effects of a status change (telling peers about a failure, ...)."""


class SenderRoomActor(_RoomActor):
    """One room on a prefill rank; see the module docstring.

    Jobs go to the workers by ``post`` (never waiting); at most :data:`JOBS_PER_ROOM` are out at a
    time, the rest wait in ``backlog`` until a reply comes back.
    """

    side = "prefill"

    def __init__(self, ports: RoomPorts, room: int, deadlines: Deadlines) -> None:
        super().__init__(ports, room)
        self.core: SenderRoom = SenderRoom(room, deadlines, time.monotonic())
        self.requests: dict[int, m.TransferRequest] = {}
        self.peers: dict[int, Peer] = {}
        self.pages: list[np.ndarray] = []
        self.ready: list[torch.cuda.Event | None] = []
        self.backlog: deque[WriteJob] = deque()
        """Jobs not handed to a worker yet (over JOBS_PER_ROOM)."""
        self.worker_agents: set[str] = set()
        """Decode agents this room sent jobs for (their workers hear CancelRoom on failure)."""
        self.ack_to: dict[str, Peer] = {}
        self.failed_by: set[str] = set()
        """Decode agents that aborted or failed this room themselves (they need no RoomFailed)."""
        self.decode_prefix_len = 0
        """Tokens the decode side already holds, from its TransferRequests (the same on every one)."""
        self.groups: dict[int, list[tuple[LayerGroup, tuple[Ready, ...]]]] = {}
        """Layer-wise chunks (``Sender.begin_chunk``): the groups ready so far and what each waits on."""
        self.written = LayerTally(ports.pool.layout.num_layers, LocalProtocolError)
        """Layer groups written per (chunk, decode rank); a chunk is done for a rank once they cover it."""

    async def handle(self, mail: RoomMail) -> None:
        now = time.monotonic()
        match mail:
            case m.TransferRequest():
                self._on_request(mail, now)
            case QueueChunk(pages=pages, last=last, aux_slot=aux_slot, ready=ready, layerwise=True):
                chunk = self.core.queue_chunk(len(pages), last, aux_slot, now)
                self.pages.append(pages)
                self.ready.append(None)
                self.groups[chunk.chunk_id] = []
            case LayersReady(group=group, ready=waits):
                if group.chunk_id not in self.groups:  # its QueueChunk was refused: the room had failed
                    raise LocalProtocolError(
                        f"room {self.room}: layers of chunk {group.chunk_id}, never queued"
                    )
                self.groups[group.chunk_id].append((group, waits))
                for d in sorted(self.requests):
                    self._schedule_group(group, waits, d)
                if group.closes and self.core.chunks[group.chunk_id].last:
                    for d in sorted(self.core.aux_targets):
                        self._schedule_aux(d)
            case QueueChunk(pages=pages, last=last, aux_slot=aux_slot, ready=ready):
                chunk = self.core.queue_chunk(len(pages), last, aux_slot, now)
                self.pages.append(pages)
                self.ready.append(ready)
                for d in sorted(self.requests):
                    self._schedule(chunk.chunk_id, d)
                if last:
                    for d in sorted(self.core.aux_targets):
                        self._schedule_aux(d)
            case WriteDone(
                chunk_id=chunk_id, decode_rank=d, ok=ok, detail=detail, reason=reason, layers=layers
            ):
                self._job_ended(chunk_id, d, ok, detail, reason, now, layers)
            case WriteEnded(
                token=JobKey(chunk_id=chunk_id, decode_rank=d, layers=layers), ok=ok, detail=detail
            ):
                self._job_ended(chunk_id, d, ok, detail, FailureReason.TRANSPORT, now, layers)
            case m.Abort(agent=agent, reason=reason, detail=detail):
                peer = self.ports.peers.get(agent)
                if peer is not None:
                    self.ack_to[agent] = peer
                self.failed_by.add(agent)
                self._fail(abort_reason(reason), f"aborted by decode {agent}: {detail}")
            case m.RoomFailed(agent=agent, reason=reason, detail=detail):
                self.failed_by.add(agent)
                self._fail(
                    FailureReason.REMOTE, f"decode {agent} failed the room: {reason_name(reason)}: {detail}"
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

    def _job_ended(
        self,
        chunk_id: int | None,
        d: int,
        ok: bool,
        detail: str,
        reason: FailureReason,
        now: float,
        layers: tuple[int, int] | None = None,
    ) -> None:
        self.core.job_ended()
        if not ok:
            self._fail(reason, detail)
        elif chunk_id is None:
            self.core.aux_written(d, now)
        elif layers is None or self.written.add((chunk_id, d), *layers):
            self.core.write_done(chunk_id, d, now)
        self._pump()

    def _on_request(self, req: m.TransferRequest, now: float) -> None:
        peer = self.ports.peers.get(req.agent)
        if peer is None:
            raise ProtocolError(f"TransferRequest from unknown decode agent {req.agent!r}")
        if (req.decode_tp, req.decode_rank) != (peer.tp_size, peer.rank):
            raise ProtocolError(
                f"TransferRequest says decode rank {req.decode_rank} of {req.decode_tp}, but agent "
                f"{req.agent} said rank {peer.rank} of {peer.tp_size} in its PeerHello"
            )
        layout = self.ports.pool.layout
        me = self.ports.me
        expected = heads.targets_of(layout.num_heads, me.tp_size, req.decode_tp, me.rank, layout.mla).get(
            req.decode_rank
        )
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
        first = req.first_region
        if first is not None:
            if not is_staged(req.path) or got is None:
                why = "this rank writes nothing there" if got is None else "the path is not staged"
                raise ProtocolError(
                    f"decode rank {req.decode_rank} granted ring region {first.alloc_id} with its request on "
                    f"path {req.path!r}, but {why}"
                )
            assert peer.ring is not None
            if (
                first.offset + first.length > peer.ring.length
                or first.writer_offset + first.writer_bytes > first.length
            ):
                raise ProtocolError(
                    f"decode rank {req.decode_rank} granted {first} with the request: outside its ring of "
                    f"{peer.ring.length} bytes"
                )
        bad = [p for p in req.dst_pages if not 0 <= p < peer.layout.num_pages]
        if bad:
            raise ProtocolError(f"decode page {bad[0]} outside [0, {peer.layout.num_pages})")
        held = self.requests.get(req.decode_rank)
        answer = answer_request(
            self.core.status, None if held is None else held == req, peer.agent_name in self.failed_by
        )
        if answer is RequestAnswer.TELL_FAILURE:
            # This decode rank asked after the room failed (an abort, a failed WRITE) or repeats its
            # request: the RoomFailed of that moment did not reach it, and no chunk ever will.
            self._tell_failure(peer)
            return
        if answer in (RequestAnswer.DUPLICATE, RequestAnswer.IGNORE):
            self.ports.counters["requests_repeated"] += 1
            return
        if self.requests and req.decode_prefix_len != self.decode_prefix_len:
            raise ProtocolError(
                f"decode rank {req.decode_rank} says decode_prefix_len={req.decode_prefix_len}, "
                f"earlier requests said {self.decode_prefix_len}"
            )
        self.core.on_request(req.decode_rank, req.decode_tp, got is not None, req.aux_slot is not None, now)
        self.decode_prefix_len = req.decode_prefix_len
        self.requests[req.decode_rank] = req
        self.peers[req.decode_rank] = peer
        for chunk in self.core.chunks:
            self._schedule(chunk.chunk_id, req.decode_rank)
        if self._aux_due() and req.decode_rank in self.core.aux_targets:
            self._schedule_aux(req.decode_rank)

    def _aux_due(self) -> bool:
        """The last chunk is queued, and, when layer-wise, every layer of it is ready."""
        if not self.core.sealed:
            return False
        last = self.core.chunks[-1].chunk_id
        groups = self.groups.get(last)
        return groups is None or any(group.closes for group, _ in groups)

    def _schedule(self, chunk_id: int, decode_rank: int) -> None:
        req = self.requests[decode_rank]
        if not req.slices or self.core.status.final:
            return
        if chunk_id in self.groups:
            for group, waits in self.groups[chunk_id]:
                self._schedule_group(group, waits, decode_rank)
            return
        pool = self.ports.pool
        nbytes = chunk_region_bytes(pool, len(self.pages[chunk_id]))
        cut = self.ports.chunk_cut.groups(chunk_id, pool.layout.num_layers, nbytes, req.path)
        if cut is not None:  # written as layer groups, each once the chunk's KV is (its one event)
            ready = self.ready[chunk_id]
            for group in cut:
                self._schedule_group(group, () if ready is None else (ready,), decode_rank)
            return
        self._dispatch(
            WriteJob(
                self.room,
                self.ports.me.rank,
                self.peers[decode_rank],
                req,
                self.core.chunks[chunk_id],
                self.pages[chunk_id],
                ready=self.ready[chunk_id],
            )
        )

    def _schedule_group(self, group: LayerGroup, waits: tuple[Ready, ...], decode_rank: int) -> None:
        """One job per (layer group, decode rank): the worker posts it once ``waits`` completed."""
        req = self.requests[decode_rank]
        if not req.slices or self.core.status.final:
            return
        chunk_id = group.chunk_id
        self._dispatch(
            WriteJob(
                self.room,
                self.ports.me.rank,
                self.peers[decode_rank],
                req,
                self.core.chunks[chunk_id],
                self.pages[chunk_id],
                group=group,
                waits=waits,
            )
        )

    def _schedule_aux(self, d: int) -> None:
        if d not in self.requests or self.core.status.final:
            return
        aux_slot = self.core.aux_slot
        if aux_slot is None:
            raise ProtocolError(
                f"decode rank {d} asked for the aux item but the last send() gave no aux_slot"
            )
        empty = np.empty(0, dtype=np.int64)
        job = WriteJob(
            self.room, self.ports.me.rank, self.peers[d], self.requests[d], None, empty, aux_slot=aux_slot
        )
        self._dispatch(job)

    def _dispatch(self, job: WriteJob) -> None:
        self.backlog.append(job)
        self._pump()

    def _pump(self) -> None:
        """Hand backlog jobs to their workers while fewer than JOBS_PER_ROOM are out."""
        workers = self.ports.workers
        assert workers is not None
        while self.backlog and self.core.in_flight < JOBS_PER_ROOM and not self.core.status.final:
            job = self.backlog.popleft()
            self.core.job_started()
            self.worker_agents.add(job.peer.agent_name)
            workers.for_agent(job.peer.agent_name).post(job)
            self.ports.me.trace.mark(self.room, "job_posted")

    async def on_status_change(self, before: RoomStatus) -> None:
        if self.core.status is not RoomStatus.FAILED:
            return
        self.backlog.clear()
        workers = self.ports.workers
        assert workers is not None
        # parked staged chunks end now instead of waiting for a grant
        for index in sorted({workers.index_for(agent) for agent in self.worker_agents}):
            workers.boxes[index].post(CancelRoom(self.room))
        # Every other decode rank of the room hears it too: when one decode rank aborts, the others
        # must not wait for chunks this rank will never send.
        for peer in self.peers.values():
            if peer.agent_name not in self.failed_by:
                self._tell_failure(peer)

    def _tell_failure(self, peer: Peer) -> None:
        """Send the room's failure to decode ``peer`` (the room is Failed)."""
        failure = self.core.failure
        assert failure is not None
        self.ports.outbox.send(
            peer.endpoint,
            m.RoomFailed(
                room=self.room, **self.ports.me.stamp(), reason=int(failure.reason), detail=failure.detail
            ),
        )

    async def finish(self) -> None:
        if not self.core.status.final:
            self._fail(FailureReason.SHUTDOWN, "room actor stopped")
        self.backlog.clear()
        for agent, peer in self.ack_to.items():
            self.ports.outbox.send(peer.endpoint, m.AbortAck(room=self.room, **self.ports.me.stamp()))
            log.debug("prefill room %d: AbortAck to %s", self.room, agent)


class ReceiverRoomActor(_RoomActor):
    """One room on a decode rank; see the module docstring.

    On the staged paths the room announces itself to the ring (``RoomOpened``) when it is made,
    before any request leaves, and holds its ring regions: the ring tells it of each
    (:class:`RegionGranted`); when a chunk has landed from every writer the room hands it to the
    scatter actor (at most :data:`SCATTERS_PER_ROOM` at a time), which frees the region once the
    chunk is in the pages. Regions of chunks that were never scattered are freed when the room ends
    — only once quiescent, so no WRITE into them can still land — and a room with a scatter running
    is not quiescent.
    """

    side = "decode"

    def __init__(
        self,
        ports: RoomPorts,
        room: int,
        deadlines: Deadlines,
        writers: dict[int, Peer],
        *,
        pages: np.ndarray,
        slices: list[heads.HeadSlice],
        path: str,
    ) -> None:
        super().__init__(ports, room)
        self.core: ReceiverRoom = ReceiverRoom(room, deadlines, time.monotonic())
        self.core.layer_tally = LayerTally(ports.pool.layout.num_layers)
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
        self.to_scatter: deque[_ToScatter] = deque()
        """Copies out of the ring waiting for a scatter slot."""
        self.whole: set[int] = set()
        """Staged chunks some writer sent whole (not layer-wise): scattered whole once complete."""
        self.remote_failure = False
        self.requests: list[tuple[Peer, m.TransferRequest]] = []
        """The TransferRequest sent to each prefill rank (set by the engine), repeated until final."""
        self._abort: m.Abort | None = None
        self.backoff = Backoff.start(REPEAT_BASE_S, REPEAT_CAP_S, time.monotonic())
        self.opened: RoomOpened | None = None
        """What this staged room told the ring when its pages were given."""
        self.requested = False
        """Whether the room's pages were given (:meth:`set_pages`) and its TransferRequests sent."""
        if len(pages):
            self.set_pages(pages)

    def set_pages(self, pages: np.ndarray) -> None:
        """The room's pages, once (at construction, or later when the receiver opened without them).

        On the staged paths the room announces itself to the ring now, before any request leaves.
        """
        assert not self.requested, "a room's pages are set once"
        self.requested = True
        self.pages = pages
        if self.staged:
            ring = self.ports.ring_port
            assert ring is not None, "a staged room needs the ring"
            self.opened = RoomOpened(
                self.room,
                tuple(self.slices),
                {rank: peer.layout.page_size for rank, peer in self.writers.items()},
                len(pages) * self.ports.pool.layout.page_size,
            )
            first = ring.open_room(self.opened)
            if first is not None:
                self.regions[0] = first

    def first_region(self, writer: int) -> m.FirstRegion | None:
        """What the TransferRequest to ``writer`` (its index in :attr:`slices`) carries of chunk 0's
        region when the ring granted it with the request, else None."""
        granted = self.regions.get(0)
        if granted is None or not granted.ahead:
            return None
        allocation = granted.allocation
        return m.FirstRegion(
            allocation.alloc_id, allocation.round, allocation.offset, allocation.length,
            granted.layout.offsets[writer], granted.layout.sizes[writer], granted.tokens,
        )  # fmt: skip

    def _landed_ahead(self, granted: RegionGranted, mail: m.ChunkLanded) -> None:
        """Chunk 0 landed in the region granted with the request: the region's scatter needs the
        chunk's real pages and tokens (its writer blocks stay where the request put them)."""
        writer_ps = self.writers[mail.sender].layout.page_size
        capacity = len(self.pages) * self.ports.pool.layout.page_size
        tokens = descriptors.chunk_tokens(mail.page_start * writer_ps, mail.num_pages, writer_ps, capacity)
        if tokens < 1:
            raise ProtocolError(
                f"chunk 0 from prefill rank {mail.sender} landed pages [{mail.page_start}, "
                f"+{mail.num_pages}), which carry no tokens here"
            )
        pool = self.ports.pool
        sizes = tuple(
            writer_block_bytes(
                pool.layout.num_kv_tensors, tokens, spec.num_heads, pool.layout.head_dim, pool.itemsize
            )
            for spec in self.slices
        )
        layout = RegionLayout(granted.layout.offsets, sizes, granted.layout.total_bytes)
        self.regions[0] = replace(
            granted,
            layout=layout,
            page_start=mail.page_start,
            num_pages=mail.num_pages,
            tokens=tokens,
            ahead=False,
        )

    # --- mailbox -------------------------------------------------------------------------------

    async def handle(self, mail: RoomMail) -> None:
        now = time.monotonic()
        match mail:
            case m.ChunkLanded(sender=sender, chunk_id=chunk_id) if chunk_id in self.core.landed.get(
                sender, ()
            ):
                # a duplicated notification: the chunk is there already; count it, change nothing
                self.ports.counters["notifs_duplicate"] += 1
                log.warning(
                    "decode room %d: chunk %d from rank %d notified twice", self.room, chunk_id, sender
                )
            case m.AuxLanded(sender=sender) if self.core.aux_landed and sender == self.core.wants_aux_from:
                self.ports.counters["notifs_duplicate"] += 1
            case m.ChunkLanded(sender=sender, chunk_id=chunk_id, last=last, region=region):
                if self.staged:
                    granted = self.regions.get(chunk_id)
                    if granted is None or granted.allocation.alloc_id != region:
                        raise ProtocolError(
                            f"chunk {chunk_id} from prefill rank {sender} landed in region {region}, "
                            f"but the room holds {None if granted is None else granted.allocation.alloc_id}"
                        )
                    if granted.ahead:
                        self._landed_ahead(granted, mail)
                    elif (granted.page_start, granted.num_pages) != (mail.page_start, mail.num_pages):
                        raise ProtocolError(
                            f"chunk {chunk_id} from prefill rank {sender} landed pages [{mail.page_start}, "
                            f"+{mail.num_pages}), its region holds [{granted.page_start}, +{granted.num_pages})"
                        )
                elif region != -1:
                    raise ProtocolError(
                        f"chunk {chunk_id} landed in ring region {region} on the {self.path} path"
                    )
                group = mail.layers
                if group is not None:
                    if self.core.layers_landed(sender, chunk_id, group):
                        self.ports.counters["notifs_duplicate"] += 1
                        return
                    if not self.core.on_layers(sender, chunk_id, group, now):
                        # more groups of this chunk are still to land from this writer
                        self._queue_scatter(_ToScatter(chunk_id, sender, group, False))
                        return
                elif self.staged:
                    self.whole.add(chunk_id)
                complete = self.core.on_chunk(sender, chunk_id, last, now)
                if chunk_id in self.whole:
                    if complete:
                        self.whole.discard(chunk_id)
                        self._queue_scatter(_ToScatter(chunk_id, None, None, True))
                else:
                    self._queue_scatter(_ToScatter(chunk_id, sender, group, complete))
            case m.AuxLanded(sender=sender):
                self.core.on_aux(sender, now)
            case RegionGranted(chunk_id=chunk_id):
                self.regions[chunk_id] = mail
            case Scattered(chunk_id=chunk_id, ok=ok, detail=detail, freed=freed):
                if freed:
                    self.regions.pop(chunk_id, None)  # the scatter actor freed it
                self.core.scatter_ended(chunk_id, ok, now, freed)
                if not ok:
                    self._fail(FailureReason.TRANSPORT, detail)
                self._pump_scatter()
            case StagingFailed(detail=detail):
                self._fail(FailureReason.STAGING, detail)
            case m.AbortAck(rank=rank):
                self.core.on_abort_ack(rank)
            case m.RoomFailed(agent=agent, reason=reason, detail=detail):
                self.remote_failure = True
                self._fail(
                    remote_failure_reason(reason),
                    f"prefill {agent} failed the room: {reason_name(reason)}: {detail}",
                )
            case LocalAbort(detail=detail):
                self._fail(FailureReason.ABORTED, detail)
            case PeerDead(agent=agent, detail=detail):
                for peer in [*self.writers.values(), *self.everyone]:  # its ack is no longer awaited
                    if peer.agent_name == agent:
                        self.core.on_writer_dead(peer.rank)
                if any(peer.agent_name == agent for peer in self.writers.values()):
                    self._fail(FailureReason.PEER_DEAD, detail)
            case Shutdown():
                self._fail(FailureReason.SHUTDOWN, "engine closed")
            case _:
                raise ProtocolError(f"{type(mail).__name__} is not for a decode room")

    def _queue_scatter(self, item: _ToScatter) -> None:
        """Staged paths: queue a copy out of the ring (a whole chunk, or a layer group of a writer)."""
        if self.staged:
            self.to_scatter.append(item)
            self._pump_scatter()

    def _pump_scatter(self) -> None:
        """Hand queued copies to the scatter actor while fewer than SCATTERS_PER_ROOM are there."""
        while self.to_scatter and self.core.scattering < SCATTERS_PER_ROOM and not self.core.status.final:
            self._scatter(self.to_scatter.popleft())

    def _scatter(self, item: _ToScatter) -> None:
        """Copy ``item`` out of its chunk's region into the pages: every writer's block once the chunk
        landed from all of them, or (layer-wise) the layers of one writer's group as soon as it landed;
        the chunk's last copy frees the region."""
        chunk_id = item.chunk_id
        granted = self.regions[chunk_id]
        layout = self.ports.pool.layout
        start = granted.page_start * self.writers[self.slices[0].prefill_rank].layout.page_size
        slots = descriptors.slots_of(self.pages, layout.page_size, start, granted.tokens)
        writers = list(zip(granted.layout.offsets, self.slices, strict=True))
        blocks = [(offset, spec.dst_head_start, spec.num_heads) for offset, spec in writers]
        runs: tuple[ScatterRun, ...] = ()
        if item.layers is not None:
            ((offset, spec),) = [(o, spec) for o, spec in writers if spec.prefill_rank == item.sender]
            tensor_bytes = writer_block_bytes(
                1, granted.tokens, spec.num_heads, layout.head_dim, self.ports.pool.itemsize
            )
            runs = tuple(
                ScatterRun(
                    first, count, ((offset + first * tensor_bytes, spec.dst_head_start, spec.num_heads),)
                )
                for first, count in group_tensor_runs(layout.num_layers, layout.mla, *item.layers)
            )
            blocks = []
        scatter = self.ports.scatter
        assert scatter is not None
        self.core.scatter_started()
        self.ports.me.trace.mark(self.room, "scatter_posted")
        scatter.post(
            ScatterJob(
                self.room,
                chunk_id,
                granted.allocation.alloc_id,
                granted.allocation.offset,
                granted.allocation.length,
                blocks,
                slots,
                runs,
                item.final,
            )  # fmt: skip
        )

    async def on_status_change(self, before: RoomStatus) -> None:
        if not self.core.status.final:
            return
        self.to_scatter.clear()
        if self.opened is not None and self.ports.ring is not None:
            self.ports.ring.post(RoomClosed(self.room, self.opened))
        if self.core.status is RoomStatus.FAILED:
            self.start_abort()

    def start_abort(self) -> None:
        """Ask every writer to stop; the room becomes quiescent once all of them acknowledged.

        Writers that do not acknowledge hear the Abort again (:meth:`repeat`) until they do or die.
        """
        # Every prefill rank of the instance, not only this rank's writers: a prefill rank acks once
        # its room ended, so when all have, no WRITE of the room can land on ANY decode rank, and a
        # scheduler that frees pages on the group's MIN poll (SGLang) is safe on every rank.
        if not self.core.start_abort({p.rank for p in [*self.writers.values(), *self.everyone] if p.alive}):
            return
        failure = self.core.failure
        detail = failure.detail if failure else "aborted"
        reason = failure.reason if failure else FailureReason.ABORTED
        self._abort = m.Abort(room=self.room, **self.ports.me.stamp(), reason=int(reason), detail=detail)
        for peer in self.everyone:
            self.ports.outbox.send(peer.endpoint, self._abort)
        self.backoff.reset(time.monotonic())

    def repeat_at(self) -> float | None:
        kind = decode_repeat(self.core.status, self.core.aborting, self.core.awaiting_acks)
        return None if kind is Repeat.NOTHING else self.backoff.next_at

    def repeat(self, now: float) -> None:
        kind = decode_repeat(self.core.status, self.core.aborting, self.core.awaiting_acks)
        if kind is Repeat.REQUESTS:
            for peer, request in self.requests:
                if not self.core.heard_from(peer.rank):  # a writer whose chunks land has the request
                    self.ports.outbox.send(peer.endpoint, request)
        elif kind is Repeat.ABORTS and self._abort is not None:
            ranks = {peer.rank: peer for peer in [*self.everyone, *self.writers.values()]}
            for rank in sorted(self.core.awaiting_acks):
                self.ports.outbox.send(ranks[rank].endpoint, self._abort)
        self.ports.counters[f"repeated_{kind.value}"] += 1
        self.backoff.sent(now)

    async def finish(self) -> None:
        if not self.core.status.final:
            self._fail(FailureReason.SHUTDOWN, "room actor stopped")
            if self.staged and self.ports.ring is not None and self.opened is not None:
                try:
                    self.ports.ring.post(RoomClosed(self.room, self.opened))
                except (anyio.ClosedResourceError, MailboxOverflow):
                    pass
        ring = self.ports.ring_port
        if ring is not None and self.regions:
            ring.free_regions(tuple(granted.allocation.alloc_id for granted in self.regions.values()))
        self.regions.clear()
