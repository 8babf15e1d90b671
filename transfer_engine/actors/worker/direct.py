"""Direct and slice WRITEs: the worker computes a chunk's descriptors (a pure function of the layouts
and page lists, :mod:`.plan` over ``protocol.descriptors``), makes the WRITE and starts it through
the NixlPoller with the chunk's notification on it; the poller tells the room directly when the
WRITE ends (:class:`~transfer_engine.runtime.mail.WriteEnded`). The worker never waits on the
network.

A chunk's WRITE, or a layer group's, is made from descriptor tables prepared once per decode rank
(:class:`PairTables`; docs/DECISIONS.md, "Descriptor tables made once per peer"): two index arrays
into them, computed from the chunk's page ids, with no descriptor list of its own. A pair whose
tables cannot be made (over ``EngineConfig.table_max_descriptors``, DRAM spread over NIXL's posting
threads, NIXL refusing) plans each WRITE's descriptors as before, and the layer groups of one such
chunk share lists prepared once, with the chunk's first group (:class:`ChunkLists`;
docs/DECISIONS.md, "A chunk's layer groups share prepared descriptor lists"). Until a chunk's
closing group comes its groups' WRITEs are relaxed: nobody waits for their ends yet
(docs/DECISIONS.md, "Relaxed looks at the layer groups before the last").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from transfer_engine.errors import ConfigError, FailureReason, TransferError, TransportError
from transfer_engine.events import Completion
from transfer_engine.memory.layout import KVPool, stride_rows_of
from transfer_engine.protocol import tables
from transfer_engine.runtime.mail import WriteJob
from transfer_engine.runtime.peers import Peer
from transfer_engine.runtime.ports import RoomBoard, WritePort
from transfer_engine.runtime.steptrace import StepTrace
from transfer_engine.transport.interface import WriteSpec

from .core import Done, Made, seal_of
from .held import HeldJobs, is_ready, pending_waits
from .plan import (
    SideTable,
    chunk_descriptors,
    chunk_notification,
    group_index,
    group_layers_of,
    group_rows,
    is_staged_job,
    plan_write,
    shares_lists,
    side_table,
    table_chunk_groups,
    table_spec,
    table_write,
)

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


TABLE_MAX_DESCRIPTORS = 1 << 25
"""``EngineConfig.table_max_descriptors``' default: descriptors a pair's table may hand NIXL per side."""


@dataclass(frozen=True, slots=True)
class PairTable:
    """One decode rank's descriptor tables for one spec: the transport's id and both sides' layout."""

    table: int
    spec: tables.TableSpec
    src: SideTable
    dst: SideTable


@dataclass(slots=True)
class OpenChunk:
    """A direct or slice chunk whose layer groups are being made: until its closing group comes, its
    groups' WRITEs are relaxed (:meth:`DirectPath.is_relaxed`)."""

    lists: ChunkLists | None = None
    """The lists its groups share when they are planned per WRITE (no tables for the pair)."""
    groups: dict[tables.TableSpec, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    """Its slot groups on both sides (``tables.chunk_groups``), per spec: computed with its first group."""


class PairTables:
    """The descriptor tables of each (decode rank, spec) pair this worker writes to, found or prepared
    at the pair's first WRITE, and why a pair has none (its WRITEs are then planned per WRITE).

    The spec (``tables.decide_table``) is decided once per (decode rank, head slice, layer group
    alignment); each side's table is laid out once (:func:`~.plan.side_table`) and prepared by the
    transport (``WritePort.prepare_table``), which keeps it until the peer is removed; a peer seen
    anew (a new handshake) starts over. A refusal's reason is logged once per pair and kept in
    :attr:`reasons`; ``counters["tables_refused"]`` counts them."""

    def __init__(
        self,
        index: int,
        pool: KVPool,
        poller: WritePort,
        bases: np.ndarray,
        counters: MutableMapping[str, int],
        max_descriptors: int,
    ) -> None:
        self.index = index
        self.pool = pool
        self.poller = poller
        self.bases = bases
        self.counters = counters
        self.max_descriptors = max_descriptors
        self.reasons: dict[str, str] = {}
        """Decode agent -> why its latest refused pair has no tables (empty: every pair has them)."""
        self._peers: dict[str, Peer] = {}
        """The peer object each decode agent's cached specs and sides were made from."""
        self._specs: dict[tuple[str, int, int, int, int | None], tables.TableSpec | None] = {}
        self._pairs: dict[tuple[str, tables.TableSpec], PairTable | None] = {}
        self._local: dict[tables.TableSpec, SideTable] = {}

    def pair(self, job: WriteJob) -> PairTable | None:
        """The tables ``job`` is made from (prepared now if this is the pair's first WRITE), or None:
        the pair has none, and the job is planned per WRITE."""
        peer = job.peer
        agent = peer.agent_name
        if not peer.alive:
            return None
        if self._peers.get(agent) is not peer:
            self._forget(agent)
            self._peers[agent] = peer
        head = job.request.slices[0]
        key = (agent, head.src_head_start, head.dst_head_start, head.num_heads, group_layers_of(job))
        if key not in self._specs:
            try:
                self._specs[key] = table_spec(job, self.pool)
            except ConfigError as exc:
                self._specs[key] = None
                self._refuse(agent, f"no table spec: {exc}")
        spec = self._specs[key]
        if spec is None:
            return None
        pair = self._pairs.get((agent, spec))
        if pair is not None and self.poller.table(agent, (spec, id(peer))) == pair.table:
            return pair
        if (agent, spec) in self._pairs and pair is None:
            return None  # refused once: its reason was logged
        pair = self._prepare(peer, spec)
        self._pairs[(agent, spec)] = pair
        return pair

    def _prepare(self, peer: Peer, spec: tables.TableSpec) -> PairTable | None:
        pool, agent = self.pool, peer.agent_name
        try:
            src = self._local.get(spec)
            if src is None:
                src = side_table(
                    spec, "src", self.bases, pool.region_lengths, pool.stride_rows, pool.num_pages
                )
                self._local[spec] = src
            dst = side_table(
                spec, "dst", peer.bases, np.array([r.length for r in peer.regions], dtype=np.uint64),
                stride_rows_of(peer.layout, peer.heads_local), peer.layout.num_pages,
            )  # fmt: skip
            table = self.poller.table(agent, (spec, id(peer)))
            if table is None:
                table = self.poller.prepare_table(
                    agent, (spec, id(peer)), src.rows, dst.rows, pool.mem_type, pool.device_id,
                    self.max_descriptors,
                )  # fmt: skip
                self.counters["tables_prepared"] += 1
                log.debug(
                    "worker %d: descriptor tables for %s: %s entries, %d + %d rows, %d + %d entries",
                    self.index, agent, spec.granularity, src.rows.rows, dst.rows.rows, src.rows.entries,
                    dst.rows.entries,
                )  # fmt: skip
        except (ConfigError, TransportError) as exc:
            self._refuse(agent, f"{spec.granularity} entries: {exc}")
            return None
        return PairTable(table, spec, src, dst)

    def _refuse(self, agent: str, reason: str) -> None:
        self.counters["tables_refused"] += 1
        self.reasons[agent] = reason
        log.warning(
            "worker %d: no descriptor tables for %s (WRITEs planned one by one): %s",
            self.index,
            agent,
            reason,
        )

    def _forget(self, agent: str) -> None:
        """Drop what was decided for ``agent``'s previous peer (a new handshake)."""
        self.reasons.pop(agent, None)
        for key in [k for k in self._specs if k[0] == agent]:
            del self._specs[key]
        for pkey in [k for k in self._pairs if k[0] == agent]:
            del self._pairs[pkey]


class DirectPath:
    """Makes and starts direct and slice WRITEs (the :class:`~.core.Starter` of the jobs it holds);
    see the module docstring.

    Given the pool, the poller (:class:`~transfer_engine.runtime.ports.WritePort`: it makes and
    starts the WRITEs), the room board (where a WRITE's end is reported), the held part (jobs whose
    KV is not written yet), the seal of a chunk's WRITE, the worker's reply to a job, the worker's
    counters and the cap on a pair's tables (``EngineConfig.table_max_descriptors``)."""

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
        counters: MutableMapping[str, int] | None = None,
        table_max_descriptors: int = TABLE_MAX_DESCRIPTORS,
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
        self.tables = PairTables(
            index, pool, poller, self._bases, {} if counters is None else counters, table_max_descriptors
        )
        """Each decode rank's descriptor tables (the pairs without them, and why)."""
        self._open: dict[tuple[str, int, int], OpenChunk] = {}
        """(decode agent, room, chunk id) -> a direct or slice chunk whose layer groups are being made,
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
        return (job.peer.agent_name, job.room, chunk.chunk_id) in self._open

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

        A chunk or layer group is made from its pair's descriptor tables (:class:`PairTables`), the
        slot groups of a chunk computed once for its groups; without tables, a layer group of a
        direct or slice chunk in the contiguous layout (:func:`shares_lists`) is made from lists
        prepared with the chunk's first group, once for every group (docs/DECISIONS.md, "A chunk's
        layer groups share prepared descriptor lists"), and anything else is planned on its own."""
        chunk, group = job.chunk, job.group
        if chunk is None or is_staged_job(job):
            spec = self._spec(job)
            return self.poller.prepare_write(spec), spec
        key = (job.peer.agent_name, job.room, chunk.chunk_id)
        try:
            pair = self.tables.pair(job)
            if pair is not None:
                return self._make_from_table(job, pair, key)
            if not shares_lists(job, self.pool):
                spec = self._spec(job)
                return self.poller.prepare_write(spec), spec
            return self._make_listed(job, key)
        finally:
            if group is not None and group.closes and key in self._open:  # the chunk's last group
                opened = self._open.pop(key)
                if opened.lists is not None:
                    self.poller.close_lists(opened.lists.lists)
                room = self.rooms.get(job.room)
                if room is not None:  # the room's last WRITE is near: its earlier groups' ends matter now
                    self.poller.hurry(room)

    def _make_from_table(self, job: WriteJob, pair: PairTable, key: tuple[str, int, int]) -> Made:
        """``job``'s WRITE made from its pair's tables: both sides' index arrays (the chunk's slot
        groups, computed with its first group, times the units of the job's tensors)."""
        spec = pair.spec
        if job.group is None:
            groups = table_chunk_groups(job, self.pool, spec)
        else:
            opened = self._open.setdefault(key, OpenChunk())
            found = opened.groups.get(spec)
            if found is None:
                found = opened.groups[spec] = table_chunk_groups(job, self.pool, spec)
            groups = found
        try:
            units = tables.units_of(spec, group_rows(job, self.pool))
        except ConfigError as exc:
            raise TransferError(f"room {job.room}: {exc}") from exc
        src_index, dst_index, src, dst, length = table_write(
            pair.src, pair.dst, groups, units, spec.entry_bytes
        )
        if len(src_index) == 0:
            raise TransferError(f"room {job.room}: empty WRITE")
        write = WriteSpec(
            job.peer.agent_name, self.pool.mem_type, src, dst, length, self.pool.device_id,
            chunk_notification(job, region=-1),
        )  # fmt: skip
        write = self.sealed(job, write)
        self.trace.mark(job.room, "planned")
        return self.poller.prepare_from_table(pair.table, src_index, dst_index, write), write

    def _make_listed(self, job: WriteJob, key: tuple[str, int, int]) -> Made:
        """A layer group made from lists its chunk prepared once (:func:`shares_lists`)."""
        opened = self._open.setdefault(key, OpenChunk())
        shared = opened.lists
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
            opened.lists = shared
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

    def close_lists(self, room: int) -> None:
        """Give up the shared lists of ``room``'s chunks, and their slot groups (the room was cancelled)."""
        for key in [k for k in self._open if k[1] == room]:
            opened = self._open.pop(key)
            if opened.lists is not None:
                self.poller.close_lists(opened.lists.lists)

    def close_all_lists(self) -> None:
        """Give up every chunk's shared lists (the worker ended)."""
        for opened in self._open.values():
            if opened.lists is not None:
                self.poller.close_lists(opened.lists.lists)
        self._open.clear()

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
