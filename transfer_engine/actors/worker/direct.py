"""Direct and slice WRITEs: the worker computes a chunk's descriptors (a pure function of the layouts
and page lists, :mod:`.plan` over ``protocol.descriptors``), makes the WRITE and starts it through
the NixlPoller with the chunk's notification on it; the poller tells the room directly when the
WRITE ends (:class:`~transfer_engine.runtime.mail.WriteEnded`). The worker never waits on the
network.

The layer groups of one direct or slice chunk share descriptor lists prepared once, with the chunk's
first group (:class:`ChunkLists`; docs/DECISIONS.md, "A chunk's layer groups share prepared
descriptor lists"), and until the chunk's closing group comes their WRITEs are relaxed: nobody waits
for their ends yet (docs/DECISIONS.md, "Relaxed looks at the layer groups before the last").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from transfer_engine.errors import FailureReason, TransferError
from transfer_engine.memory.layout import KVPool
from transfer_engine.events import Completion
from transfer_engine.runtime.mail import WriteJob
from transfer_engine.runtime.ports import RoomBoard, WritePort
from transfer_engine.runtime.steptrace import StepTrace
from transfer_engine.transport.interface import WriteSpec

from .core import Done, Made, seal_of
from .held import HeldJobs, is_ready, pending_waits
from .plan import chunk_descriptors, chunk_notification, group_index, group_rows, plan_write, shares_lists

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ChunkLists:
    """Descriptor lists prepared once for every layer group of one chunk to one decode rank
    (:func:`shares_lists`): each group's WRITE is an index into them."""

    lists: int
    """The transport's id of the lists."""
    whole: WriteSpec
    """The whole chunk's descriptors, tensor-major (its ``notif`` unused)."""
    per_tensor: int
    """Descriptors of each tensor."""


class DirectPath:
    """Makes and starts direct and slice WRITEs (the :class:`~.core.Starter` of the jobs it holds);
    see the module docstring.

    Given the pool, the poller (:class:`~transfer_engine.runtime.ports.WritePort`: it makes and
    starts the WRITEs), the room board (where a WRITE's end is reported), the held part (jobs whose
    KV is not written yet), the seal of a chunk's WRITE, and the worker's reply to a job."""

    def __init__(
        self,
        index: int,
        pool: KVPool,
        poller: WritePort,
        rooms: RoomBoard,
        held: HeldJobs,
        sealed: Callable[[WriteJob, WriteSpec], WriteSpec],
        done: Done,
        *,
        trace: StepTrace,
    ) -> None:
        self.index = index
        self.pool = pool
        self.poller = poller
        self.rooms = rooms
        self.held = held
        self.sealed = sealed
        self.done = done
        self.trace = trace
        self._bases = np.array([t.data_ptr() for t in pool.tensors], dtype=np.uint64)
        """Base address of each KV tensor of the pool."""
        self._chunk_lists: dict[tuple[str, int, int], ChunkLists] = {}
        """(decode agent, room, chunk id) -> the lists its direct or slice layer groups are made from,
        until its closing group is made or the room is cancelled."""

    def is_relaxed(self, job: WriteJob) -> bool:
        """Whether nobody waits for the end of ``job``'s WRITE yet: a layer group of a direct or slice
        chunk whose closing group has not come to this worker (its shared lists are still open). Its
        end matters only once the room's last WRITE has ended, and the closing group's coming hurries
        it (:meth:`_make_direct`); until then the poller looks at it less often, and takes the GIL from
        a forward less often (docs/DECISIONS.md, "Relaxed looks at the layer groups before the last")."""
        group, chunk = job.group, job.chunk
        if group is None or chunk is None or group.closes:
            return False
        return (job.peer.agent_name, job.room, chunk.chunk_id) in self._chunk_lists

    def start_made(self, job: WriteJob, made: Made) -> None:
        """Start ``job``'s WRITE made by :meth:`prepare` (a room gone: dropped). Raises TransferError."""
        handle, spec = made
        room = self.rooms.get(job.room)
        if room is None:  # ended (only at shutdown: a room with jobs out is never quiescent)
            self.poller.discard(handle)
            return
        self.poller.start_write(handle, spec, room, job.key, relaxed=self.is_relaxed(job))
        self.trace.mark(job.room, "posted")

    def _spec(self, job: WriteJob) -> WriteSpec:
        """Plan ``job``'s WRITE (``plan_write``); TransferError when it has nothing to move."""
        src, dst, length, notif = plan_write(job, self.pool, self._bases)
        self.trace.mark(job.room, "planned")
        if len(src) == 0:
            raise TransferError(f"room {job.room}: empty WRITE")
        spec = WriteSpec(
            job.peer.agent_name, self.pool.mem_type, src, dst, length, self.pool.device_id, notif
        )
        return self.sealed(job, spec)

    async def prepare(self, job: WriteJob) -> Made | None:
        """Plan and make a direct (or slice) job's WRITE while the KV it reads is still being
        computed (a held layer group, or a chunk whose ``ready`` event has not completed), so that
        only the start is left once it is (docs/DECISIONS.md, "A layer group's WRITE is made before
        its layers are ready"). None: it cannot be made, and the job was answered."""
        try:
            made = self._make_direct(job)
        except TransferError as exc:
            log.warning("worker %d: room %d: %s", self.index, job.room, exc)
            await self.done(job, False, str(exc), FailureReason.TRANSPORT)
            return None
        self.trace.mark(job.room, "prepared")
        return made

    async def _hold(self, job: WriteJob, pending: Sequence[Completion], made: Made | None = None) -> None:
        """Hold ``job`` until every wait in ``pending`` completed, its WRITE made now (``made``, if it
        already was); the completion waiter starts it (:class:`~.held.HeldJobs`). A job whose WRITE
        cannot be made is answered."""
        if made is None:
            made = await self.prepare(job)
            if made is None:
                return
        self.held.hold(job, pending, made, self)

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
                shared = ChunkLists(self.poller.prepare_lists(whole), whole, len(src) // len(self._bases))
                self._chunk_lists[key] = shared
            rows = group_rows(job, self.pool)
            assert rows is not None
            index = group_index(rows, shared.per_tensor)
            whole = shared.whole
            spec = WriteSpec(
                whole.peer, whole.local_mem, whole.src[index], whole.dst[index], whole.length[index],
                whole.local_devices, chunk_notification(job, region=-1),
            )  # fmt: skip
            spec = self.sealed(job, spec)
            self.trace.mark(job.room, "planned")
            return self.poller.prepare_indexed(shared.lists, index, spec), spec
        finally:
            if job.group.closes and key in self._chunk_lists:  # the chunk's last group: no more WRITEs
                self.poller.close_lists(self._chunk_lists.pop(key).lists)
                room = self.rooms.get(job.room)
                if room is not None:  # the room's last WRITE is near: its earlier groups' ends matter now
                    self.poller.hurry(room)

    def close_lists(self, room: int) -> None:
        """Give up the shared lists of ``room``'s chunks (the room was cancelled)."""
        for key in [k for k in self._chunk_lists if k[1] == room]:
            self.poller.close_lists(self._chunk_lists.pop(key).lists)

    def close_all_lists(self) -> None:
        """Give up every chunk's shared lists (the worker ended)."""
        for shared in self._chunk_lists.values():
            self.poller.close_lists(shared.lists)
        self._chunk_lists.clear()

    async def layer_group(self, job: WriteJob) -> None:
        """A layer group of a direct or slice chunk: started now if every one of its ``waits``
        completed, else its WRITE is made now and held until they have."""
        pending = pending_waits(job)
        if not pending:
            await self.execute(job)
            return
        await self._hold(job, pending)

    async def execute(self, job: WriteJob, made: Made | None = None) -> None:
        """Make and start ``job``'s WRITE, or start ``made``, the one made for it while it was held."""
        if job.ready is not None:
            if not is_ready(job.ready):
                # The KV is still being computed (NIXL reads it itself: it must be written first).
                # The WRITE is made now and the job held, not the worker: the completion waiter
                # starts it (:meth:`~.held.HeldJobs.on_reached`), and the jobs behind it go on meanwhile.
                await self._hold(job, [job.ready], made)
                return
            self.trace.mark(job.room, "ready")
        try:
            if made is None:
                made = self._make_direct(job)
            seal = seal_of(made[1])
            if seal is not None:
                self.held.start_seal(made, ())
                if not seal.ready:
                    # integrity: the WRITE starts once its checksum is known (docs/INTEGRITY.md); the
                    # worker goes on meanwhile, and the completion waiter's thread starts it
                    assert seal.sum is not None
                    await self._hold(job, [seal.sum.done], made)
                    return
            self.start_made(job, made)
        except TransferError as exc:
            log.warning("worker %d: room %d: %s", self.index, job.room, exc)
            await self.done(job, False, str(exc), FailureReason.TRANSPORT)
