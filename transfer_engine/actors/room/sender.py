"""The prefill side's room actor: requests in, WRITE jobs out to the workers, one per chunk and decode rank."""

from __future__ import annotations

import logging
import time
from collections import deque

import numpy as np
import torch

from transfer_engine.actors.room.common import RoomActor
from transfer_engine.errors import FailureReason, LocalProtocolError, ProtocolError
from transfer_engine.memory.staging import chunk_region_bytes
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.layers import LayerGroup, LayerTally
from transfer_engine.protocol.requests import Asker, Writer, check_request
from transfer_engine.protocol.retransmit import RequestAnswer, answer_request
from transfer_engine.protocol.rooms import Deadlines, RoomStatus, SenderRoom, abort_reason, reason_name
from transfer_engine.runtime.mail import (
    CancelRoom,
    JobKey,
    LayersReady,
    LocalAbort,
    PeerDead,
    QueueChunk,
    Ready,
    RoomMail,
    Shutdown,
    WriteDone,
    WriteEnded,
    WriteJob,
)
from transfer_engine.runtime.peers import Peer
from transfer_engine.runtime.ports import JOBS_PER_ROOM, RoomPorts

log = logging.getLogger("transfer_engine.room")


class SenderRoomActor(RoomActor):
    """One room on a prefill rank; see the module docstring.

    Jobs go to the workers by ``post`` (never waiting); at most :data:`JOBS_PER_ROOM` are out at a
    time, the rest wait in ``backlog`` until a reply comes back.
    """

    side = "prefill"

    def __init__(
        self, ports: RoomPorts, room: int, deadlines: Deadlines, *, aborted_by: frozenset[str] = frozenset()
    ) -> None:
        """``aborted_by``: decode agents that aborted the room before this rank opened it (the
        engine's tombstones): they need no RoomFailed, and the engine fails the room at once."""
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
        self.failed_by: set[str] = set(aborted_by)
        """Decode agents that aborted or failed this room themselves (they need no RoomFailed)."""
        self.decode_prefix_len = 0
        """Tokens the decode side already holds, from its TransferRequests (the same on every one)."""
        self.groups: dict[int, list[tuple[LayerGroup, tuple[Ready, ...]]]] = {}
        """Layer-wise chunks (``Sender.begin_chunk``): the groups ready so far and what each waits on."""
        self.written = LayerTally(ports.pool.layout.num_layers, LocalProtocolError)
        """Layer groups written per (chunk, decode rank); a chunk is done for a rank once they cover it."""
        self._offer = False
        """Jobs go to the workers by ``offer`` (a request came for chunks already sent), not ``post``."""

    def handle(self, mail: RoomMail) -> None:
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
                # a peer that left in good order fails only a room that still writes to it
                left = agent in self.ports.peers.left
                if any(
                    p.agent_name == agent and (not left or self._writes_to(d)) for d, p in self.peers.items()
                ):
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
            if (
                req.agent in self.ports.peers.left
                and not req.slices
                and req.aux_slot is None
                and req.decode_rank not in self.requests
            ):
                # It asked nothing of this rank, and its engine has left since (PeerLeaving comes only
                # after its rooms ended): the request still counts, so the room is not failed for it.
                self.core.on_request(req.decode_rank, req.decode_tp, False, False, now)
                self.requests[req.decode_rank] = req
                return
            raise ProtocolError(f"TransferRequest from unknown decode agent {req.agent!r}")
        layout = self.ports.pool.layout
        me = self.ports.me
        got = check_request(
            req,
            Asker(
                peer.rank,
                peer.tp_size,
                peer.layout.num_pages,
                None if peer.ring is None else peer.ring.length,
            ),
            Writer(layout.num_heads, me.tp_size, me.rank, layout.mla),
        )
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
        # The chunks sent before the request came are ready to go: their jobs are offered to the
        # worker, which plans and starts them in this call if it waits on an empty inbox (the small
        # room's latency path); jobs made later are posted and queue there as ever.
        self._offer = True
        try:
            for chunk in self.core.chunks:
                self._schedule(chunk.chunk_id, req.decode_rank)
            if self._aux_due() and req.decode_rank in self.core.aux_targets:
                self._schedule_aux(req.decode_rank)
        finally:
            self._offer = False

    def _writes_to(self, decode_rank: int) -> bool:
        """Whether this room has chunks or the aux item to write to ``decode_rank``."""
        return bool(self.requests[decode_rank].slices) or decode_rank in self.core.aux_targets

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
            self.ports.me.trace.mark(self.room, "job_posted")
            box = workers.for_agent(job.peer.agent_name)
            if self._offer:
                box.offer(job)
            else:
                box.post(job)

    def on_status_change(self, before: RoomStatus) -> None:
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

    def finish(self) -> None:
        if not self.core.status.final:
            self._fail(FailureReason.SHUTDOWN, "room actor stopped")
        self.backlog.clear()
        for agent, peer in self.ack_to.items():
            self.ports.outbox.send(peer.endpoint, m.AbortAck(room=self.room, **self.ports.me.stamp()))
            log.debug("prefill room %d: AbortAck to %s", self.room, agent)
