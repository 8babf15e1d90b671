"""The decode side's room actor: requests out, landed chunks in, staged chunks to the scatter actor."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import replace
from typing import NamedTuple

import anyio
import numpy as np

from transfer_engine.actors.room.checks import Check, CheckKey, Outcome, ReceiverChecks
from transfer_engine.actors.room.common import RoomActor
from transfer_engine.errors import (
    FailureReason,
    ProtocolError,
)
from transfer_engine.protocol import descriptors, heads
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.layers import LayerTally, group_tensor_runs
from transfer_engine.protocol.paths import TransferPath, is_staged
from transfer_engine.protocol.receiver_room import ReceiverRoom
from transfer_engine.protocol.requests import HeldRegion, check_landed
from transfer_engine.protocol.retransmit import (
    REPEAT_BASE_S,
    REPEAT_CAP_S,
    Backoff,
    Repeat,
    decode_repeat,
)
from transfer_engine.protocol.rooms import (
    Deadlines,
    RoomStatus,
    reason_name,
    remote_failure_reason,
)
from transfer_engine.protocol.staging import RegionLayout, writer_block_bytes
from transfer_engine.runtime.mail import (
    Checked,
    LocalAbort,
    MailboxOverflow,
    PeerDead,
    RegionGranted,
    RequestPages,
    RoomClosed,
    RoomMail,
    RoomOpened,
    ScatterCheck,
    Scattered,
    ScatterJob,
    ScatterRun,
    Shutdown,
    StagingFailed,
)
from transfer_engine.runtime.peers import Peer
from transfer_engine.runtime.ports import (
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


class ReceiverRoomActor(ReceiverChecks, RoomActor):
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
    path_reason = ""
    """Why the room takes ``path`` (set by the engine as it makes the room; shown in the dump)."""

    def __init__(
        self,
        ports: RoomPorts,
        room: int,
        deadlines: Deadlines,
        writers: dict[int, Peer],
        *,
        everyone: list[Peer],
        slices: list[heads.HeadSlice],
        path: str,
        request: RequestPages | None = None,
    ) -> None:
        """A room whose prefill instance is connected (``everyone``: its ranks; ``writers``: those
        that write here, with their head ``slices``). With ``request`` it has its pages now (a staged
        room places its first region at once) and sends its TransferRequests as soon as it runs;
        without, it waits for them in its mailbox (:class:`RequestPages`)."""
        super().__init__(ports, room)
        self.core: ReceiverRoom = ReceiverRoom(room, deadlines, time.monotonic())
        self.core.layer_tally = LayerTally(ports.pool.layout.num_layers)
        self.writers = writers
        """Global prefill rank -> peer, for every rank that writes into this decode rank."""
        self.everyone = everyone
        """Every prefill rank of the instance: all got a TransferRequest, all hear about a failure."""
        self.pages = np.empty(0, dtype=np.int64)
        self.slices = slices
        """The writers' head slices, in ``dst_head_start`` order (their block order in a region)."""
        self.path = path
        self.staged = is_staged(path)
        self.core.staged = self.staged
        self.regions: dict[int, RegionGranted] = {}
        """Ring regions this room holds, by chunk id (until scattered, or freed at the end)."""
        self.to_scatter: deque[_ToScatter] = deque()
        """Copies out of the ring waiting for a scatter slot."""
        self.scattering: deque[tuple[_ToScatter, list[tuple[CheckKey, int]]]] = deque()
        """Copies at the scatter actor, in the order it answers them (it runs jobs in arrival order)."""
        self.carried: dict[CheckKey, int | None] = {}
        """Staged: the checksum each (chunk, writer, layer group) landed with, until it is scattered."""
        self.checking: dict[CheckKey, Check] = {}
        """Integrity checks out: their sums are being taken off the loop (docs/INTEGRITY.md)."""
        self.whole: set[int] = set()
        """Staged chunks some writer sent whole (not layer-wise): scattered whole once complete."""
        self.remote_failure = False
        self.requests: list[tuple[Peer, m.TransferRequest]] = []
        """The TransferRequest sent to each prefill rank, repeated until final."""
        self._abort: m.Abort | None = None
        self.backoff = Backoff.start(REPEAT_BASE_S, REPEAT_CAP_S, time.monotonic())
        self.opened: RoomOpened | None = None
        """What this staged room told the ring when its pages were given."""
        self.requested = False
        """Whether the room's pages were given (:meth:`set_pages`) and its TransferRequests sent."""
        self.core.bootstrapped(list(writers), None, time.monotonic())
        self._unsent: RequestPages | None = None
        """Pages given at creation whose TransferRequests have not gone out yet (:meth:`send_unsent`)."""
        if request is not None:
            self.set_pages(request.pages)
            self._unsent = request

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

    def request(self, mail: RequestPages) -> None:
        """Take the room's pages and send every prefill rank of the instance its TransferRequest
        (repeated until the room is final); a room that is no longer waiting for them ignores them."""
        if self.requested or self.core.status is not RoomStatus.WAITING_FOR_INPUT:
            log.info("decode room %d: pages given while %s, ignored", self.room, self.core.status.name)
            return
        self.set_pages(mail.pages)
        self._send_requests(mail)

    @property
    def hears_nixl(self) -> bool:
        """Whether this room's notifications come over NIXL: every path's but the kernel path's, whose
        chunks are announced over the control channel; its aux item still comes as a NIXL WRITE
        (the engine's poller is quick only while such a room is live)."""
        if self.path != TransferPath.KERNEL.value:
            return True
        unsent = self._unsent
        return self.core.wants_aux_from is not None or (unsent is not None and unsent.aux_slot is not None)

    async def started(self) -> None:
        self.send_unsent()

    def send_unsent(self) -> None:
        """Send the TransferRequests of the pages given at creation, once: the engine calls it in
        ``receiver()`` right after the room is on the board (a loop turn sooner than the room's
        task would), and the task's start finds nothing left to send."""
        if self._unsent is not None:
            request, self._unsent = self._unsent, None
            self._send_requests(request)

    def _send_requests(self, mail: RequestPages) -> None:
        """Send every prefill rank of the instance its TransferRequest for the room's pages."""
        aux_writer = self.slices[0].prefill_rank if mail.aux_slot is not None else None
        self.core.wants_aux_from = aux_writer
        if aux_writer is not None and self.path == TransferPath.KERNEL.value:
            self.ports.drain.listen()  # its aux item comes as a NIXL WRITE: the poller looks quickly
        self.core.lease(time.monotonic())  # it waits on the prefill now: the prefill's heartbeats renew it
        me = self.ports.me
        by_rank = {w.prefill_rank: (i, w) for i, w in enumerate(self.slices)}
        pages = m.pack_pages(mail.pages)  # once for every prefill rank
        for peer in self.everyone:
            index, w = by_rank.get(peer.rank, (-1, None))
            slices = (
                []
                if w is None
                else [m.SliceSpec(w.prefill_rank, w.src_head_start, w.dst_head_start, w.num_heads)]
            )
            request = m.TransferRequest(
                room=self.room,
                agent=me.agent_name,
                decode_rank=me.rank,
                decode_tp=me.tp_size,
                path=self.path,
                dst_pages=pages,
                aux_slot=mail.aux_slot if peer.rank == aux_writer else None,
                slices=slices,
                decode_prefix_len=mail.decode_prefix_len,
                first_region=None if w is None else self.first_region(index),
            )
            self.requests.append((peer, request))
            self.ports.outbox.send(peer.endpoint, request)
        me.trace.mark(self.room, "requested")

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

    def handle(self, mail: RoomMail) -> None:
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
            case m.ChunkLanded(sender=sender, chunk_id=chunk_id):
                if self.ports.costs is not None:
                    self.ports.costs.started(self.room, now)
                key = (chunk_id, sender, mail.layers)
                if self.staged:  # checked once in the pages (docs/INTEGRITY.md)
                    self.carried[key] = mail.checksum
                elif key in self.checking:  # a duplicate of one whose check is out
                    self.ports.counters["notifs_duplicate"] += 1
                    return
                elif (
                    self._check(key, mail.checksum, mail.page_start, mail.num_pages, mail)
                    is not Outcome.COUNT
                ):
                    return  # counted once its check matches (Checked), or never: the room failed
                self._landed(mail, now)
            case Checked(key=key, landed=landed, detail=detail):
                self._checked(key, landed, detail, now)
            case m.AuxLanded(sender=sender):
                self.core.on_aux(sender, now)
            case RequestPages():
                self.request(mail)
            case RegionGranted(chunk_id=chunk_id):
                self.regions[chunk_id] = mail
            case Scattered(chunk_id=chunk_id, ok=ok, detail=detail, freed=freed, sums=sums):
                _, checks = self.scattering.popleft()
                if freed:
                    self.regions.pop(chunk_id, None)  # the scatter actor freed it
                # each writer's part, summed over the pages behind the copy (docs/INTEGRITY.md)
                if ok:
                    judged = [
                        self._judge(key, carried, landed, detail)
                        for (key, carried), landed in zip(checks, sums, strict=True)
                    ]
                    self.core.scatter_ended(chunk_id, all(judged), now, freed)
                else:
                    self.core.scatter_ended(chunk_id, False, now, freed)
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

    def _landed(self, mail: m.ChunkLanded, now: float) -> None:
        """Count a landed chunk (or layer group) of one writer: checked (or with nothing to check) on
        the direct paths; on the staged paths its check comes once it is scattered."""
        sender, chunk_id, last = mail.sender, mail.chunk_id, mail.last
        granted = self.regions.get(chunk_id) if self.staged else None
        held = (
            None
            if granted is None
            else HeldRegion(granted.allocation.alloc_id, granted.page_start, granted.num_pages, granted.ahead)
        )
        if check_landed(mail, self.path, held):
            assert granted is not None
            self._landed_ahead(granted, mail)
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
        checks = self._scatter_checks(item)
        scatter = self.ports.scatter
        assert scatter is not None
        self.core.scatter_started()
        self.scattering.append((item, checks))
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
                tuple(ScatterCheck(*self._heads(key[1]), item.layers) for key, _ in checks),
            )  # fmt: skip
        )

    def on_status_change(self, before: RoomStatus) -> None:
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

    def finish(self) -> None:
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
