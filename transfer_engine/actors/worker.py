"""TransferWorker actor (prefill): turns a room's chunk into one WRITE to one decode rank.

The engine runs N workers and shards jobs by destination decode agent, so every chunk a room sends
to one decode rank goes through one worker, in order.

Direct and slice paths: the worker computes the chunk's descriptors (a pure function of the layouts
and page lists, :mod:`~transfer_engine.actors.write_plan` over ``protocol.descriptors``) and posts the WRITE through the NixlPoller with the
chunk's notification on it; the poller tells the room directly when the WRITE ends
(:class:`~transfer_engine.runtime.mail.WriteEnded`). The worker never waits on the network, and every job
it is given ends in exactly one reply to its room: that WriteEnded, or a
:class:`~transfer_engine.runtime.mail.WriteDone` from here (refused, cancelled, staged WRITE finished).

Staged paths (README, "Paths"; docs/DECISIONS.md, "Staged paths"): the worker asks the decode rank's ring for a region
(``StagingRequest``) as soon as the chunk is known, and parks the chunk; chunk 0 asks nothing when the
room's TransferRequest carried its region (``first_region``: granted with the request). Once granted, and once the
peer's latest ``Watermark`` admits the region, it gathers the chunk's head slice — every layer, K
then V — into a lease of its staging buffer (on its own CUDA stream, its completion observed by the worker's
:class:`~transfer_engine.runtime.completion.CompletionWaiter`; on CPU in a worker thread) and
posts ONE WRITE of it to ``region + writer offset``. A chunk that is not admissible yet stays parked
while the worker serves other chunks; newer watermarks and finished WRITEs (which release staging
leases) retry the parked ones. Nothing here blocks on the watermark. ``CancelRoom`` ends a failed
room's chunks that are not posted yet.
"""

from __future__ import annotations

import enum
import functools
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np
import torch

from transfer_engine.errors import FailureReason, StagingError, TransferError
from transfer_engine.kernels import KVTable, as_kv_table, gather_heads
from transfer_engine.memory.layout import KVPool
from transfer_engine.memory.staging import StagingMemory, allocate_staging, run_cpu_copy
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.layers import group_block_runs, group_tensors
from transfer_engine.protocol.staging import (
    Allocation,
    BufferLeases,
    Watermark,
    WatermarkTracker,
    writer_block_bytes,
)
from transfer_engine.runtime.completion import Completion, CompletionWaiter, recorded
from transfer_engine.runtime.mail import (
    CancelRoom,
    Mailbox,
    Reached,
    Ready,
    RepeatStaging,
    WriteDone,
    WriteEnded,
    WriteJob,
)
from transfer_engine.runtime.ports import Outbox, RankIdentity, RoomBoard, WritePort
from transfer_engine.transport.nixl import WriteSpec

from .base import Actor
from .write_plan import (
    chunk_descriptors,
    chunk_notification,
    group_index,
    group_rows,
    is_staged_job,
    plan_write,
    shares_lists,
    staged_slots,
)

log = logging.getLogger(__name__)

Made = tuple[int, WriteSpec]
"""A WRITE made ahead and not started: its transport handle and what it moves."""


class _Start(enum.Enum):
    """Who starts a held job's made WRITE (:class:`_Held`)."""

    HELD = "held"
    """Not started: the first to claim it (the waiter's thread or the loop) starts or drops it."""
    STARTING = "starting"
    """The completion waiter's thread claimed it and is starting it (and, for a layer group,
    looking at it until it ended)."""
    STARTED = "started"
    """The thread started it: the loop adopts it when its callback comes."""
    REFUSED = "refused"
    """The thread's start was refused: the loop answers the job when its callback comes."""
    TAKEN = "taken"
    """The loop claimed it (to start it itself, or to drop it: the room was cancelled)."""


@dataclass(eq=False, slots=True)
class _Held:
    """The WRITE made for a held job, claimed once: by the completion waiter's thread, which starts
    it the moment the job's KV is written (:meth:`TransferWorker._start_early`), or by the loop."""

    made: Made
    state: _Start = _Start.HELD
    refusal: TransferError | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def claim(self, to: _Start) -> bool:
        """Move it from HELD to ``to`` (STARTING: the waiter's thread; TAKEN: the loop); False when
        the other one has it already."""
        with self.lock:
            if self.state is not _Start.HELD:
                return False
            self.state = to
            return True

    def take(self) -> bool:
        """Claim it for the loop; False when the thread has it (its callback answers for it)."""
        return self.claim(_Start.TAKEN)


def is_ready(ready: Ready) -> bool:
    """Whether a layer-wise job's ``ready`` has completed (never blocks)."""
    if ready is None:
        return True
    if isinstance(ready, torch.cuda.Event):
        return bool(ready.query())
    return ready.is_set()


@dataclass(eq=False)
class _Staged:
    """A staged job between its StagingRequest and its WRITE."""

    job: WriteJob
    src_slots: np.ndarray
    nbytes: int
    host: bool
    allocation: Allocation | None = None
    dst: int = 0
    request: m.StagingRequest | None = None
    asked_at: float = 0.0
    runs: list[tuple[int, int, int]] | None = None
    """A layer group: ``(offset in the lease, offset from dst, bytes)`` per WRITE descriptor."""


@dataclass(eq=False)
class _LayerRegion:
    """The ring region of one layer-wise staged chunk to one decode agent, shared by its groups.

    Asked for with the chunk's first group (its whole block, every layer); each group is gathered
    into a lease of its own and WRITTEN into its layers' part of the block once granted.
    """

    request: m.StagingRequest
    endpoint: str
    ring: int
    """Base address of the decode rank's ring."""
    src_slots: np.ndarray
    tensor_bytes: int
    """Bytes of one KV tensor's head slice for the chunk's tokens."""
    block_bytes: int
    host: bool
    asked_at: float
    allocation: Allocation | None = None
    dst: int = 0
    refused: str | None = None
    waiting: list[WriteJob] = field(default_factory=list)
    """Ready groups waiting for the grant."""
    pending: int = 0
    """Groups of the chunk received and not yet parked or failed."""
    closed: bool = False
    """The chunk's closing group was received: no more groups will come."""


@dataclass(frozen=True, slots=True)
class _ChunkLists:
    """Descriptor lists prepared once for every layer group of one chunk to one decode rank
    (:func:`shares_lists`): each group's WRITE is an index into them."""

    lists: int
    """The transport's id of the lists."""
    whole: WriteSpec
    """The whole chunk's descriptors, tensor-major (its ``notif`` unused)."""
    per_tensor: int
    """Descriptors of each tensor."""


@dataclass(frozen=True, slots=True)
class _Lease:
    """Token of a staged WRITE: it ends with ``WriteEnded(_Lease(...))`` from the poller."""

    staged: _Staged
    offset: int


WorkerMail = (
    WriteJob
    | CancelRoom
    | RepeatStaging
    | m.StagingGrant
    | m.StagingRefused
    | m.Watermark
    | WriteEnded
    | Reached
)


def held_ready(job: WriteJob) -> bool:
    """Whether a held job's KV is written: every wait of its layer group, and its chunk's event."""
    return all(is_ready(w) for w in job.waits) and (job.ready is None or is_ready(job.ready))


class TransferWorker(Actor["WorkerMail"]):
    """See the module docstring. ``inbox`` takes :data:`WorkerMail`."""

    def __init__(
        self,
        index: int,
        me: RankIdentity,
        pool: KVPool,
        poller: WritePort,
        rooms: RoomBoard,
        outbox: Outbox,
        *,
        staging_bytes: int,
        capacity: int = 4096,
        reserve: int = 0,
        completion_thread: bool = True,
        early_start: bool = True,
        early_drive: float = 0.0,
    ) -> None:
        super().__init__(capacity, reserve)
        self.index = index
        self.me = me
        self.pool = pool
        self.poller = poller
        self.rooms = rooms
        self.outbox = outbox
        self.staging_bytes = staging_bytes
        self._bases = np.array([t.data_ptr() for t in pool.tensors], dtype=np.uint64)
        self._kv = as_kv_table(pool.kv_views)
        self.stream = torch.cuda.Stream(pool.device) if pool.device.type == "cuda" else None
        self._buffers: dict[bool, tuple[StagingMemory, BufferLeases]] = {}
        self._granting: dict[tuple[str, int, int], _Staged] = {}
        self._parked: dict[str, list[_Staged]] = defaultdict(list)
        self._watermarks: dict[str, WatermarkTracker] = defaultdict(WatermarkTracker)
        self.counters: dict[str, int] = defaultdict(int)
        self._unready: list[WriteJob] = []
        """Layer-wise jobs whose ``waits`` have not all completed, in arrival order."""
        self._failed_starts: list[tuple[WriteJob, str]] = []
        """Held jobs whose start from the waiter's callback failed: answered by the next Reached."""
        self._prepared: dict[int, _Held] = {}
        """id(job) -> its WRITE, made and not started by the loop, for the held direct jobs in
        ``_unready`` (an entry leaves with its job, so an id is never a stale one)."""
        self._gathering: dict[int, _Held | TransferError] = {}
        """Staged chunks (by ``id`` of their ``_Staged``) whose gather runs: the WRITE made for each
        (started by the completion waiter's thread once the gather completed), or why none was."""
        self._awaiting_kv: set[int] = set()
        """Parked staged chunks (``id`` of their ``_Staged``, kept alive by the waiter's callback)
        whose KV event the completion waiter watches."""
        self._layer_regions: dict[tuple[str, int, int], _LayerRegion] = {}
        """(decode agent, room, chunk id) -> the region of a layer-wise staged chunk."""
        self._group_kv: dict[tuple[int, int], KVTable] = {}
        self._chunk_lists: dict[tuple[str, int, int], _ChunkLists] = {}
        """(decode agent, room, chunk id) -> the lists its direct or slice layer groups are made from,
        until its closing group is made or the room is cancelled."""
        self.completions = CompletionWaiter(f"worker-{index}", threaded=completion_thread)
        """Wakes this worker when its gathers' stream or its jobs' ready events complete."""
        self.early_start = early_start
        """``EngineConfig.early_start``: the waiter's thread starts a held job's made WRITE itself."""
        self.early_drive = early_drive
        """``EngineConfig.early_drive``: and, for a layer group, looks at its state until it ended, this
        long at most."""
        self._reached_posted = False
        """A :class:`Reached` is in the inbox (one at most)."""

    # --- introspection -------------------------------------------------------------------------

    @property
    def parked(self) -> int:
        """Staged chunks granted a region but waiting for the watermark or a staging lease."""
        return sum(len(v) for v in self._parked.values())

    @property
    def awaiting_grant(self) -> int:
        return len(self._granting) + sum(
            1 for r in self._layer_regions.values() if r.allocation is None and r.refused is None
        )

    @property
    def layer_jobs(self) -> int:
        """Jobs held until their KV is written (layer groups, direct chunks), and layer-wise regions held
        (0 when idle)."""
        return len(self._unready) + len(self._layer_regions)

    @property
    def depth(self) -> int:
        """Mails queued in the inbox."""
        return len(self.inbox)

    def leases(self) -> int:
        """Staging-buffer leases held (0 when idle: the leak check)."""
        return sum(leases.live for _, leases in self._buffers.values())

    # --- mailbox -------------------------------------------------------------------------------

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Handle mail until the inbox closes. Layer-wise jobs whose ``waits`` have not completed are
        held; the completion waiter's thread posts :class:`Reached` when one does (no polling)."""
        self.completions.start()
        try:
            await super().run(task_status=task_status)
        finally:
            self.completions.close()  # its thread is joined: no claim changes after this
            for held in self._prepared.values():  # jobs held when the worker ended
                self._let_go(held)
            self._prepared.clear()
            for made in self._gathering.values():  # WRITEs made for gathers still running
                if isinstance(made, _Held):
                    self._let_go(made)
            self._gathering.clear()
            for shared in self._chunk_lists.values():
                self.poller.close_lists(shared.lists)
            self._chunk_lists.clear()

    def _on_reached(self, job: WriteJob) -> None:
        """On the loop, from the completion waiter: a wait of the held ``job`` completed.

        A job whose WRITE the waiter's thread started (:meth:`_start_early`) is adopted here, or
        answered if its start was refused. A job whose WRITE was made ahead (:meth:`_prepare`) and
        whose waits have all completed is started here and now, without a mail hop through the
        inbox; any other job is left to the :class:`Reached` mail, as is a start that failed (its
        answer needs the worker's task)."""
        self.me.trace.mark(job.room, "reached")
        if self.inbox.closed:  # the worker ended, nobody waits
            return
        held = self._prepared.get(id(job))
        if held is not None and held.state in (_Start.STARTED, _Start.REFUSED):
            self._unhold(job)
            # A room with a job out never ends; only at shutdown is it gone, and then the poller's
            # reply goes nowhere: the worker's own inbox, closed (the poller drops it).
            room = self.rooms.get(job.room)
            reply_to = room if room is not None else self.inbox
            refusal = self._settle(held, reply_to, job.key, self._relaxed(job))
            if refusal is None:
                return
            log.warning("worker %d: room %d: %s", self.index, job.room, refusal)
            self._failed_starts.append((job, str(refusal)))
        elif held is not None and held_ready(job) and held.take():
            self._unhold(job)
            self.me.trace.mark(job.room, "started")
            try:
                self._start_made(job, held.made)
                return
            except Exception as exc:  # a callback must not lose a job: the Reached mail answers it
                log.warning("worker %d: room %d: %s", self.index, job.room, exc)
                self._failed_starts.append((job, f"{type(exc).__name__}: {exc}"))
        self._post_reached()

    def _unhold(self, job: WriteJob) -> None:
        """``job`` is held no more (its WRITE was claimed)."""
        self._unready = [j for j in self._unready if j is not job]
        del self._prepared[id(job)]

    def _start_early(self, job: WriteJob, held: _Held) -> None:
        """On the completion waiter's thread, as a wait of held ``job`` completes: if every wait has,
        start its made WRITE now (:meth:`_claim_and_start`); the loop adopts it in :meth:`_on_reached`."""
        self.me.trace.mark(job.room, "woken")  # back from the wait, the GIL held again
        if held_ready(job):
            # the group that closes its chunk is small: its bytes land within a fraction of a
            # millisecond, and the decode hears of them sooner if this thread looks until they have
            # (``early_drive``). Earlier groups are left to the poller: their notifications are not
            # the room's last, and a thread still looking at one wakes late for the next.
            closes = job.group is not None and job.group.closes
            self._claim_and_start(job.room, held, self.early_drive if closes else 0.0)

    def _claim_and_start(self, room: int, held: _Held, drive: float = 0.0) -> None:
        """On the completion waiter's thread: claim ``held``'s WRITE and start it, without waiting for
        the loop's turn, then look at it until it ended, for ``drive`` seconds at most
        (:meth:`~transfer_engine.runtime.ports.WritePort.drive`). Touches nothing of the worker's but ``held``
        and the poller's thread-safe calls (docs/DECISIONS.md, "A held WRITE is started by the
        completion waiter's thread")."""
        if not held.claim(_Start.STARTING):
            return
        self.me.trace.mark(room, "started")
        try:
            at = self.poller.start_early(held.made[0])
        except TransferError as exc:
            with held.lock:
                held.refusal, held.state = exc, _Start.REFUSED
            return
        if at is not None and self.me.trace.enabled:
            self.me.trace.mark_at(room, "locked", at[0])
            self.me.trace.mark_at(room, "transfer_cpu", at[0] + at[2])  # the lock + the call's CPU time
            self.me.trace.mark_at(room, "transferred", at[1])
        self.me.trace.mark(room, "posted")
        # still STARTING while it looks: the loop adopts it (and its poller may release it) only after
        if drive > 0 and self.poller.drive(held.made[0], drive):
            self.me.trace.mark(room, "driven")
        with held.lock:
            held.state = _Start.STARTED

    def _let_go(self, held: _Held) -> None:
        """At the worker's end (its waiter thread joined): release ``held``'s WRITE, or, when the
        thread started it and the loop never adopted it, hand it to the poller to end."""
        if held.state is _Start.STARTED:  # its reply goes to this worker's closed inbox: dropped
            self.poller.adopt(held.made[0], held.made[1], self.inbox, None)
        elif held.state is not _Start.REFUSED:  # (a refused start's handle is gone already)
            self.poller.discard(held.made[0])

    def _settle(
        self, held: _Held, reply_to: Mailbox[Any], token: object, relaxed: bool = False
    ) -> TransferError | None:
        """On the loop, for a WRITE the waiter's thread has finished with (STARTED or REFUSED): hand
        it to the poller, which sends ``WriteEnded(token, ...)`` to ``reply_to`` once it ends, or
        count its refusal and return it for the caller to answer."""
        if held.refusal is not None:
            self.poller.refused(held.refusal)
            return held.refusal
        self.counters["early_starts"] += 1
        self.poller.adopt(*held.made, reply_to, token, relaxed=relaxed)
        return None

    def _relaxed(self, job: WriteJob) -> bool:
        """Whether nobody waits for the end of ``job``'s WRITE yet: a layer group of a direct or slice
        chunk whose closing group has not come to this worker (its shared lists are still open). Its
        end matters only once the room's last WRITE has ended, and the closing group's coming hurries
        it (:meth:`_make_direct`); until then the poller looks at it less often, and takes the GIL from
        a forward less often (docs/DECISIONS.md, "Relaxed looks at the layer groups before the last")."""
        group, chunk = job.group, job.chunk
        if group is None or chunk is None or group.closes:
            return False
        return (job.peer.agent_name, job.room, chunk.chunk_id) in self._chunk_lists

    def _post_reached(self) -> None:
        """Queue one :class:`Reached` (none if one is queued already)."""
        if not self._reached_posted:
            self._reached_posted = True
            self.inbox.post(Reached())

    def _start_made(self, job: WriteJob, made: Made) -> None:
        """Start ``job``'s WRITE made by :meth:`_prepare` (a room gone: dropped). Raises TransferError."""
        handle, spec = made
        room = self.rooms.get(job.room)
        if room is None:  # ended (only at shutdown: a room with jobs out is never quiescent)
            self.poller.discard(handle)
            return
        self.poller.start_write(handle, spec, room, job.key, relaxed=self._relaxed(job))
        self.me.trace.mark(job.room, "posted")

    async def handle(self, mail: WorkerMail) -> None:
        self.me.trace.mark_mail("worker", mail)
        match mail:
            case WriteJob(group=group) if group is not None:
                await self._layer_job(mail)
            case WriteJob() if is_staged_job(mail):
                await self._request_region(mail)
            case WriteJob():
                await self._execute(mail)
            case m.StagingGrant(agent=agent, room=room, chunk_id=chunk_id) if (
                agent,
                room,
                chunk_id,
            ) in self._layer_regions:
                await self._on_layer_grant(mail)
            case m.StagingGrant():
                await self._on_grant(mail)
            case m.StagingRefused(agent=agent, room=room, chunk_id=chunk_id, detail=detail) if (
                agent,
                room,
                chunk_id,
            ) in self._layer_regions:
                await self._on_layer_refused(self._layer_regions[(agent, room, chunk_id)], agent, detail)
            case m.StagingRefused(agent=agent, room=room, chunk_id=chunk_id, detail=detail):
                staged = self._granting.pop((agent, room, chunk_id), None)
                if staged is not None:
                    await self._done(
                        staged.job,
                        False,
                        f"decode {agent} refused the chunk: {detail}",
                        FailureReason.STAGING,
                    )
            case m.Watermark(agent=agent, round=rnd, tail=tail):
                if self._watermarks[agent].update(Watermark(rnd, tail)):
                    await self._progress(agent)
            case WriteEnded(token=_Lease(staged=staged, offset=offset), ok=ok, detail=detail):
                self.me.trace.mark(staged.job.room, "write_ended")
                self._buffers[staged.host][1].release(offset)
                await self._done(staged.job, ok, detail, FailureReason.TRANSPORT)
                for agent in list(self._parked):
                    await self._progress(agent)
            case CancelRoom(room=room):
                await self._cancel(room)
            case Reached():
                self._reached_posted = False
                failed, self._failed_starts = self._failed_starts, []
                for job, detail in failed:
                    await self._done(job, False, detail, FailureReason.TRANSPORT)
                await self._start_ready()
                for agent in list(self._parked):  # parked chunks whose KV was written meanwhile
                    await self._progress(agent)
            case RepeatStaging(before=before):
                for staged in list(self._granting.values()):
                    if staged.request is not None and staged.asked_at < before:
                        self.counters["staging_repeats"] += 1
                        self.outbox.send(staged.job.peer.endpoint, staged.request)
                for region in self._layer_regions.values():
                    if region.allocation is None and region.refused is None and region.asked_at < before:
                        self.counters["staging_repeats"] += 1
                        self.outbox.send(region.endpoint, region.request)

    # --- direct and slice ----------------------------------------------------------------------

    async def _done(self, job: WriteJob, ok: bool, detail: str, reason: FailureReason) -> None:
        """The one reply for ``job`` that does not come from the poller."""
        await self.rooms.deliver(
            job.room, WriteDone(job.chunk_id, job.decode_rank, ok, detail, reason, job.key.layers)
        )

    def _spec(self, job: WriteJob) -> WriteSpec:
        """Plan ``job``'s WRITE (``plan_write``); TransferError when it has nothing to move."""
        src, dst, length, notif = plan_write(job, self.pool, self._bases)
        self.me.trace.mark(job.room, "planned")
        if len(src) == 0:
            raise TransferError(f"room {job.room}: empty WRITE")
        return WriteSpec(
            job.peer.agent_name, self.pool.mem_type, src, dst, length, self.pool.device_id, notif
        )

    async def _prepare(self, job: WriteJob) -> Made | None:
        """Plan and make a direct (or slice) job's WRITE while the KV it reads is still being
        computed (a held layer group, or a chunk whose ``ready`` event has not completed), so that
        only the start is left once it is (docs/DECISIONS.md, "A layer group's WRITE is made before
        its layers are ready"). None: it cannot be made, and the job was answered."""
        try:
            made = self._make_direct(job)
        except TransferError as exc:
            log.warning("worker %d: room %d: %s", self.index, job.room, exc)
            await self._done(job, False, str(exc), FailureReason.TRANSPORT)
            return None
        self.me.trace.mark(job.room, "prepared")
        return made

    def _make_direct(self, job: WriteJob) -> Made:
        """Plan and make ``job``'s WRITE without starting it. Raises TransferError.

        A layer group of a direct or slice chunk (:func:`shares_lists`) is made from lists prepared
        with the chunk's first group, once for every group: its planning, range check and list
        preparation are the chunk's, done once (docs/DECISIONS.md, "A chunk's layer groups share
        prepared descriptor lists")."""
        if not shares_lists(job, self.pool):
            spec = self._spec(job)
            return self.poller.prepare_write(spec), spec
        assert job.chunk is not None and job.group is not None
        key = (job.peer.agent_name, job.room, job.chunk.chunk_id)
        shared = self._chunk_lists.get(key)
        try:
            if shared is None:
                src, dst, length = chunk_descriptors(job, self.pool, self._bases, None)
                if len(src) == 0 or len(src) % len(self._bases):
                    raise TransferError(
                        f"room {job.room}: {len(src)} descriptors for {len(self._bases)} KV tensors "
                        "(a chunk's groups need the same count of each)"
                    )
                whole = WriteSpec(
                    job.peer.agent_name, self.pool.mem_type, src, dst, length, self.pool.device_id, b""
                )
                shared = _ChunkLists(self.poller.prepare_lists(whole), whole, len(src) // len(self._bases))
                self._chunk_lists[key] = shared
            rows = group_rows(job, self.pool)
            assert rows is not None
            index = group_index(rows, shared.per_tensor)
            whole = shared.whole
            spec = WriteSpec(
                whole.peer, whole.local_mem, whole.src[index], whole.dst[index], whole.length[index],
                whole.local_devices, chunk_notification(job, region=-1),
            )  # fmt: skip
            self.me.trace.mark(job.room, "planned")
            return self.poller.prepare_indexed(shared.lists, index, spec), spec
        finally:
            if job.group.closes and key in self._chunk_lists:  # the chunk's last group: no more WRITEs
                self.poller.close_lists(self._chunk_lists.pop(key).lists)
                room = self.rooms.get(job.room)
                if room is not None:  # the room's last WRITE is near: its earlier groups' ends matter now
                    self.poller.hurry(room)

    def _close_lists(self, room: int) -> None:
        """Give up the shared lists of ``room``'s chunks (the room was cancelled)."""
        for key in [k for k in self._chunk_lists if k[1] == room]:
            self.poller.close_lists(self._chunk_lists.pop(key).lists)

    async def _execute(self, job: WriteJob, made: Made | None = None) -> None:
        """Make and start ``job``'s WRITE, or start ``made``, the one made for it while it was held."""
        if job.ready is not None:
            if not is_ready(job.ready):
                # The KV is still being computed (NIXL reads it itself: it must be written first).
                # The WRITE is made now and the job held, not the worker: the completion waiter
                # starts it (:meth:`_on_reached`), and the jobs behind it go on meanwhile.
                await self._hold(job, [job.ready], made)
                return
            self.me.trace.mark(job.room, "ready")
        try:
            self._start_made(job, made if made is not None else self._make_direct(job))
        except TransferError as exc:
            log.warning("worker %d: room %d: %s", self.index, job.room, exc)
            await self._done(job, False, str(exc), FailureReason.TRANSPORT)

    # --- staged --------------------------------------------------------------------------------

    async def _buffer(self, host: bool) -> tuple[StagingMemory, BufferLeases]:
        """This worker's staging buffer of that kind, allocated and registered on first use.

        The allocation runs on a thread: pinning host memory takes seconds for GBs (a 8.6 GB buffer
        stalled the loop 5.2 s on the GPU machine, longer than a peer's lease), and the loop must
        keep polling and heartbeating meanwhile. Only the NIXL registration runs on the loop."""
        if host not in self._buffers:
            started = time.monotonic()
            memory = await anyio.to_thread.run_sync(
                functools.partial(allocate_staging, self.pool, self.staging_bytes, host=host)
            )
            allocated = time.monotonic()
            self.poller.register([memory.region()], memory.mem_type)
            self._buffers[host] = (memory, BufferLeases(memory.nbytes))
            log.info(
                "worker %d: %s staging buffer of %d bytes (allocated in %.3f s, registered in %.3f s)",
                self.index,
                "host" if host else "device",
                memory.nbytes,
                allocated - started,
                time.monotonic() - allocated,
            )
        return self._buffers[host]

    def _staged_source(self, job: WriteJob) -> np.ndarray:
        """The prefill slots a staged chunk gathers; TransferError when it cannot be staged here."""
        req, peer, chunk = job.request, job.peer, job.chunk
        assert chunk is not None
        if peer.ring is None:
            raise TransferError(f"decode rank {req.decode_rank} ({peer.agent_name}) has no staging ring")
        src_slots = staged_slots(job, self.pool)
        if src_slots.size == 0:
            raise TransferError(
                f"room {job.room}: chunk {chunk.chunk_id} carries no tokens for this decode rank"
            )
        return src_slots

    def _staging_request(self, job: WriteJob, src_slots: np.ndarray) -> m.StagingRequest:
        """The ring-region request of a staged chunk (whole, or its layer groups' shared region)."""
        chunk = job.chunk
        assert chunk is not None
        return m.StagingRequest(
            agent=self.me.agent_name,
            room=job.room,
            chunk_id=chunk.chunk_id,
            sender=job.sender,
            page_start=chunk.page_start,
            num_pages=chunk.num_pages,
            tokens=int(src_slots.size),
        )

    async def _request_region(self, job: WriteJob) -> None:
        req, peer, chunk = job.request, job.peer, job.chunk
        assert chunk is not None
        try:
            spec = req.slices[0]
            src_slots = self._staged_source(job)
            layout = self.pool.layout
            nbytes = writer_block_bytes(
                layout.num_kv_tensors, src_slots.size, spec.num_heads, layout.head_dim, self.pool.itemsize
            )
            host = req.path == "host"
            (await self._buffer(host))[1].check_fits(nbytes)
        except StagingError as exc:
            await self._done(job, False, str(exc), FailureReason.STAGING)
            return
        except TransferError as exc:
            await self._done(job, False, str(exc), FailureReason.PROTOCOL)
            return
        first = self._first_region(job, nbytes)
        if isinstance(first, str):
            await self._done(job, False, first, FailureReason.PROTOCOL)
            return
        if first is not None:  # granted with the request: no round trip
            allocation, dst = first
            self._parked[peer.agent_name].append(_Staged(job, src_slots, nbytes, host, allocation, dst))
            self.counters["granted_ahead"] += 1
            self.me.trace.mark(job.room, "granted_ahead")
            await self._progress(peer.agent_name)
            return
        request = self._staging_request(job, src_slots)
        self._granting[(peer.agent_name, job.room, chunk.chunk_id)] = _Staged(
            job, src_slots, nbytes, host, request=request, asked_at=time.monotonic()
        )
        self.counters["staging_requests"] += 1
        self.outbox.send(peer.endpoint, request)

    @staticmethod
    def _first_region(job: WriteJob, nbytes: int) -> tuple[Allocation, int] | str | None:
        """Chunk 0's region granted with the room's TransferRequest: ``(allocation, address of this
        writer's block)``; None when the chunk must ask (another chunk, or none granted); a string
        saying why when the grant cannot hold the chunk's ``nbytes`` (the decode broke the protocol)."""
        chunk, first = job.chunk, job.request.first_region
        if first is None or chunk is None or chunk.chunk_id != 0:
            return None
        ring = job.peer.ring
        assert ring is not None  # _staged_source refused a peer without one
        if nbytes > first.writer_bytes or first.writer_offset + first.writer_bytes > first.length:
            return (
                f"room {job.room}: chunk 0 stages {nbytes} bytes, the region granted with the request "
                f"gives {first.writer_bytes} at +{first.writer_offset} of {first.length}"
            )
        allocation = Allocation(first.alloc_id, first.round, first.offset, first.length)
        return allocation, ring.addr + first.offset + first.writer_offset

    async def _on_grant(self, grant: m.StagingGrant) -> None:
        staged = self._granting.pop((grant.agent, grant.room, grant.chunk_id), None)
        if staged is None:  # the room failed meanwhile; the decode room frees the region when it ends
            self.counters["grants_unmatched"] += 1
            return
        ring = staged.job.peer.ring
        assert ring is not None
        if grant.writer_bytes != staged.nbytes or grant.writer_offset + grant.writer_bytes > grant.length:
            await self._done(
                staged.job,
                False,
                f"grant for room {grant.room} chunk {grant.chunk_id} gives {grant.writer_bytes} bytes at "
                f"+{grant.writer_offset} of {grant.length}; this writer stages {staged.nbytes}",
                FailureReason.PROTOCOL,
            )
            return
        staged.allocation = Allocation(grant.alloc_id, grant.round, grant.offset, grant.length)
        staged.dst = ring.addr + grant.offset + grant.writer_offset
        self._parked[grant.agent].append(staged)
        await self._progress(grant.agent)

    async def _progress(self, agent: str) -> None:
        """Start every parked chunk to ``agent`` that the watermark admits and a lease can hold."""
        parked = self._parked.get(agent)
        if not parked:
            return
        tracker = self._watermarks[agent]
        waiting: list[_Staged] = []
        while parked:
            staged = parked.pop(0)
            assert staged.allocation is not None
            ready = staged.job.ready
            if ready is not None and not is_ready(ready):
                # Its KV is still being computed: it waits without a lease, and the chunks behind
                # it to this peer go first (a gather ordered after its event would hold the stream).
                self.counters["kv_waits"] += 1
                waiting.append(staged)
                if id(staged) not in self._awaiting_kv:
                    self._awaiting_kv.add(id(staged))
                    self.completions.notify(ready, functools.partial(self._kv_written, staged))
                continue
            if not tracker.admits(staged.allocation):
                self.counters["watermark_waits"] += 1
                waiting.append(staged)
                continue
            memory, leases = self._buffers[staged.host]
            offset = leases.lease(staged.nbytes)
            if offset is None:
                self.counters["lease_waits"] += 1
                waiting.append(staged)
                continue
            await self._gather_and_write(staged, memory, offset)
        if waiting:
            self._parked[agent] = waiting + self._parked.get(agent, [])
        else:
            self._parked.pop(agent, None)

    def _kv_written(self, staged: _Staged) -> None:
        """On the loop, from the completion waiter: the KV of parked ``staged`` is written; the
        :class:`Reached` mail makes the worker look at its parked chunks again."""
        self._awaiting_kv.discard(id(staged))
        if not self.inbox.closed:
            self._post_reached()

    async def _gather_and_write(self, staged: _Staged, memory: StagingMemory, offset: int) -> None:
        job = staged.job
        chunk = job.chunk
        assert chunk is not None and staged.allocation is not None
        head_slice = job.request.slices[0]
        out = memory.view(offset, staged.nbytes)
        slots = torch.from_numpy(staged.src_slots)
        gather = functools.partial(
            gather_heads,
            self._kv if job.group is None else self._group_table(job),
            slots,
            head_slice.src_head_start,
            head_slice.num_heads,
            out,
            stream=self.stream,
        )
        leases = self._buffers[staged.host][1]
        spec = self._staged_spec(staged, memory, offset)
        made: int | TransferError | None = None
        gathered = None
        try:
            # The WRITE is made (checked, lists prepared) while the gather runs: only its start
            # waits for the gathered bytes (docs/DECISIONS.md, "made before its bytes are ready").
            if self.stream is None:
                made = self._make(spec)
                await run_cpu_copy(gather, staged.nbytes)
            else:
                if job.ready is not None:
                    self.stream.wait_event(job.ready)  # the gather reads KV the caller's stream wrote
                gather()
                made = self._make(spec)
                gathered = recorded(self.stream)
        except Exception as exc:  # a kernel error fails the room, never the worker
            log.exception("worker %d: gather for room %d failed", self.index, job.room)
            if isinstance(made, int):
                self.poller.discard(made)
            leases.release(offset)
            await self._done(job, False, f"gather failed: {exc}", FailureReason.TRANSPORT)
            return
        assert made is not None
        held = made if isinstance(made, TransferError) else _Held((made, spec))
        if gathered is None:
            self._start_gathered(staged, offset, held)
            return
        # The worker goes on with its next job while the gather runs (the next chunk's or layer
        # group's gather queues behind it on the stream); the completion waiter's thread starts this
        # WRITE once the gather has completed (docs/DECISIONS.md, "A worker never waits for its
        # gather", "A held WRITE is started by the completion waiter's thread").
        self._gathering[id(staged)] = held
        # (not from host staging memory: UCX copies a DRAM WRITE inside its start, up to a millisecond
        # that would hold the waiter's thread and, through the transport's lock, the poller)
        first = (
            functools.partial(self._claim_and_start, job.room, held)
            if isinstance(held, _Held) and self.early_start and not staged.host
            else None
        )
        self.completions.notify(
            gathered, functools.partial(self._start_gathered, staged, offset, held), first
        )

    def _start_gathered(self, staged: _Staged, offset: int, held: _Held | TransferError) -> None:
        """The gather of ``staged`` into its lease at ``offset`` has completed: start its WRITE, or
        adopt it when the completion waiter's thread started it.

        On the loop: from the worker's task (CPU copies) or from the completion waiter. A WRITE that
        cannot start ends as if it had failed: ``WriteEnded`` to this worker, which frees the lease
        and answers the room."""
        tracked = self._gathering.pop(id(staged), None) is not None
        job = staged.job
        self.me.trace.mark(job.room, "gathered")
        if self.inbox.closed:  # the worker ended (and let go of the WRITEs it tracked): nobody will answer
            if isinstance(held, _Held) and not tracked:
                self._let_go(held)
            return
        token = _Lease(staged, offset)
        try:
            if isinstance(held, TransferError):
                raise held
            if held.state in (_Start.STARTED, _Start.REFUSED):
                refusal = self._settle(held, self.inbox, token)
                if refusal is not None:
                    raise refusal
            else:
                # the thread is done with it (its first step ran before this callback), or never ran
                claimed = held.take()
                assert claimed, held.state
                self.poller.start_write(*held.made, self.inbox, token)
                self.me.trace.mark(job.room, "posted")
        except TransferError as exc:
            log.warning("worker %d: room %d: %s", self.index, job.room, exc)
            self.inbox.post(WriteEnded(token, False, str(exc)))
            return
        self.counters["staged_writes"] += 1

    def _make(self, spec: WriteSpec) -> int | TransferError:
        """Make ``spec``'s WRITE without starting it: its handle, or the error that refused it."""
        try:
            return self.poller.prepare_write(spec)
        except TransferError as exc:
            return exc

    @staticmethod
    def _staged_spec(staged: _Staged, memory: StagingMemory, offset: int) -> WriteSpec:
        """The WRITE of a staged chunk (or group) from its staging lease into its ring region."""
        assert staged.allocation is not None
        runs = staged.runs if staged.runs is not None else [(0, 0, staged.nbytes)]
        return WriteSpec(
            staged.job.peer.agent_name,
            memory.mem_type,
            np.array([memory.addr + offset + src for src, _, _ in runs], dtype=np.uint64),
            np.array([staged.dst + dst for _, dst, _ in runs], dtype=np.uint64),
            np.array([length for _, _, length in runs], dtype=np.uint64),
            memory.device_id,
            chunk_notification(staged.job, staged.allocation.alloc_id),
        )

    async def _cancel(self, room: int) -> None:
        """End every chunk of ``room`` not posted yet: waiting for events or a grant, or parked."""
        # A held job whose WRITE the waiter's thread claimed stays held: that WRITE is (being) started,
        # and the callback on its way adopts it (its WriteEnded answers the job) or answers its refusal.
        cancelled = [job for job in self._unready if job.room == room and self._take(job)]
        gone = {id(job) for job in cancelled}
        self._unready = [job for job in self._unready if id(job) not in gone]
        self._close_lists(room)
        for job in cancelled:
            held = self._prepared.pop(id(job), None)
            if held is not None:
                self.poller.discard(held.made[0])
            await self._done(job, False, "cancelled while its KV was not written", FailureReason.ABORTED)
        for key in [k for k in self._layer_regions if k[1] == room]:
            region = self._layer_regions.pop(key)
            for job in region.waiting:
                await self._done(
                    job, False, "cancelled while waiting for a ring region", FailureReason.ABORTED
                )
        for key in [k for k in self._granting if k[1] == room]:
            staged = self._granting.pop(key)
            await self._done(
                staged.job, False, "cancelled while waiting for a ring region", FailureReason.ABORTED
            )
        for agent in list(self._parked):
            ended = [staged for staged in self._parked[agent] if staged.job.room == room]
            if not ended:
                continue
            self._parked[agent] = [staged for staged in self._parked[agent] if staged.job.room != room]
            for staged in ended:
                await self._done(staged.job, False, "cancelled before posting", FailureReason.ABORTED)
            if not self._parked[agent]:
                del self._parked[agent]

    # --- layer-wise ----------------------------------------------------------------------------

    async def _layer_job(self, job: WriteJob) -> None:
        """A layer group of a chunk to one decode rank: on staged paths ask for the chunk's region
        with its first group; post once every ``waits`` completed. A direct group still waiting has its
        WRITE made now; the completion waiter's callback (:meth:`_on_reached`) starts it."""
        if is_staged_job(job) and not await self._layer_region(job):
            return
        pending = [w for w in job.waits if w is not None and not is_ready(w)]
        if not pending:
            await self._start_layer(job)
            return
        await self._hold(job, pending)

    async def _hold(self, job: WriteJob, pending: Sequence[Completion], made: Made | None = None) -> None:
        """Hold ``job`` until every wait in ``pending`` completed; a direct (or slice) job has its
        WRITE made now (``made``, if it already was), which the completion waiter's thread starts
        (:meth:`_start_early`; or its callback, :meth:`_on_reached`, without ``early_start``). A job
        whose WRITE cannot be made was answered already."""
        first = None
        if not is_staged_job(job):
            if made is None:
                made = await self._prepare(job)
                if made is None:
                    return
            held = self._prepared[id(job)] = _Held(made)
            if self.early_start:
                first = functools.partial(self._start_early, job, held)
        self._unready.append(job)
        # Every wait found pending gets its callback, even one that completed since (while the WRITE
        # was made, or just now on the GPU): notify() then calls back at once. Looking again here and
        # skipping those would hold the job with nothing left to wake it (a room that never ended).
        for wait in pending:
            self.completions.notify(wait, functools.partial(self._on_reached, job), first)

    async def _start_ready(self) -> None:
        """Start the layer-wise jobs whose events completed, in arrival order."""
        # (a job whose WRITE the waiter's thread claimed is left to its callback: _on_reached)
        done = [held_ready(job) and self._take(job) for job in self._unready]
        ready = [job for job, ok in zip(self._unready, done, strict=True) if ok]
        if not ready:
            return
        self._unready = [job for job, ok in zip(self._unready, done, strict=True) if not ok]
        for job in ready:
            self.me.trace.mark(job.room, "started")
            held = self._prepared.pop(id(job), None)
            await self._start_layer(job, held.made if held is not None else None)

    def _take(self, job: WriteJob) -> bool:
        """Claim held ``job``'s made WRITE for the loop (True for a job with none made)."""
        held = self._prepared.get(id(job))
        return held is None or held.take()

    async def _start_layer(self, job: WriteJob, made: Made | None = None) -> None:
        """Start a job whose KV is written: a direct (or slice) one, layer group or held chunk, through
        :meth:`_execute`; a staged layer group through its chunk's ring region."""
        if not is_staged_job(job):
            await self._execute(job, made)
            return
        assert job.chunk is not None and job.group is not None
        key = (job.peer.agent_name, job.room, job.chunk.chunk_id)
        region = self._layer_regions.get(key)
        if region is None:  # cancelled meanwhile (CancelRoom answered every job it held)
            return
        if region.refused is not None:
            self._group_left(key, region)
            await self._done(job, False, region.refused, FailureReason.STAGING)
        elif region.allocation is None:
            region.waiting.append(job)
        else:
            self._park_group(job, region)
            self._group_left(key, region)
            await self._progress(job.peer.agent_name)

    def _group_left(self, key: tuple[str, int, int], region: _LayerRegion) -> None:
        """One group of the chunk was parked or failed; forget the region after the last one."""
        region.pending -= 1
        if region.closed and region.pending == 0:
            del self._layer_regions[key]

    async def _layer_region(self, job: WriteJob) -> bool:
        """Count ``job`` against its chunk's region, asking the ring for it with the first group.
        False (the job answered) when the chunk cannot be staged."""
        req, peer, chunk, group = job.request, job.peer, job.chunk, job.group
        assert chunk is not None and group is not None
        key = (peer.agent_name, job.room, chunk.chunk_id)
        region = self._layer_regions.get(key)
        if region is None:
            try:
                spec = req.slices[0]
                src_slots = self._staged_source(job)
                layout = self.pool.layout
                tensor_bytes = writer_block_bytes(
                    1, src_slots.size, spec.num_heads, layout.head_dim, self.pool.itemsize
                )
                host = req.path == "host"
                (await self._buffer(host))[1].check_fits(tensor_bytes * len(group_tensors(
                    layout.num_layers, layout.mla, group.start, group.end
                )))  # fmt: skip
            except StagingError as exc:
                await self._done(job, False, str(exc), FailureReason.STAGING)
                return False
            except TransferError as exc:
                await self._done(job, False, str(exc), FailureReason.PROTOCOL)
                return False
            assert peer.ring is not None  # _staged_source refused a peer without one
            request = self._staging_request(job, src_slots)
            region = _LayerRegion(
                request, peer.endpoint, peer.ring.addr, src_slots, tensor_bytes,
                tensor_bytes * layout.num_kv_tensors, host, time.monotonic(),
            )  # fmt: skip
            first = self._first_region(job, region.block_bytes)
            if isinstance(first, str):
                await self._done(job, False, first, FailureReason.PROTOCOL)
                return False
            self._layer_regions[key] = region
            if first is None:
                self.counters["staging_requests"] += 1
                self.outbox.send(peer.endpoint, request)
            else:  # granted with the request: no round trip
                region.allocation, region.dst = first
                self.counters["granted_ahead"] += 1
                self.me.trace.mark(job.room, "granted_ahead")
        region.pending += 1
        region.closed = region.closed or group.closes
        return True

    async def _on_layer_grant(self, grant: m.StagingGrant) -> None:
        key = (grant.agent, grant.room, grant.chunk_id)
        region = self._layer_regions[key]
        if region.allocation is not None or region.refused is not None:
            self.counters["grants_unmatched"] += 1  # a repeated grant
            return
        if (
            grant.writer_bytes != region.block_bytes
            or grant.writer_offset + grant.writer_bytes > grant.length
        ):
            await self._on_layer_refused(
                region,
                grant.agent,
                f"grant for room {grant.room} chunk {grant.chunk_id} gives {grant.writer_bytes} bytes at "
                f"+{grant.writer_offset} of {grant.length}; this writer stages {region.block_bytes}",
                FailureReason.PROTOCOL,
            )
            return
        region.allocation = Allocation(grant.alloc_id, grant.round, grant.offset, grant.length)
        region.dst = region.ring + grant.offset + grant.writer_offset
        waiting, region.waiting = region.waiting, []
        for job in waiting:
            self._park_group(job, region)
            self._group_left(key, region)
        await self._progress(grant.agent)

    async def _on_layer_refused(
        self, region: _LayerRegion, agent: str, detail: str, reason: FailureReason = FailureReason.STAGING
    ) -> None:
        """The chunk's region was refused: its waiting groups fail now, later ones when they start."""
        region.refused = f"decode {agent} refused the chunk: {detail}"
        key = (agent, region.request.room, region.request.chunk_id)
        waiting, region.waiting = region.waiting, []
        for job in waiting:
            self._group_left(key, region)
            await self._done(job, False, region.refused, reason)

    def _park_group(self, job: WriteJob, region: _LayerRegion) -> None:
        """Park one ready group of a granted chunk: gathered and WRITTEN once the watermark admits."""
        assert job.group is not None and region.allocation is not None
        layout = self.pool.layout
        runs = group_block_runs(
            layout.num_layers, layout.mla, region.tensor_bytes, job.group.start, job.group.end
        )
        nbytes = sum(length for _, _, length in runs)
        self._parked[job.peer.agent_name].append(
            _Staged(job, region.src_slots, nbytes, region.host, region.allocation, region.dst, runs=runs)
        )

    def _group_table(self, job: WriteJob) -> KVTable:
        """The KV table of one layer group's tensors (cached per group)."""
        assert job.group is not None
        key = job.group.layers
        table = self._group_kv.get(key)
        if table is None:
            rows = group_tensors(self.pool.layout.num_layers, self.pool.layout.mla, *key)
            table = as_kv_table([self.pool.kv_views[int(i)] for i in rows])
            self._group_kv[key] = table
        return table
