"""Staged and host WRITEs (docs/DECISIONS.md, "Staged paths"): a chunk's head slice is gathered into
a lease of the worker's staging buffer and written as ONE WRITE into a region of the decode rank's
ring.

The worker asks the decode rank's ring for a region (``StagingRequest``) as soon as the chunk is
known, and parks the chunk; chunk 0 asks nothing when the room's TransferRequest carried its region
(``first_region``: granted with the request). Once granted, and once the peer's latest ``Watermark``
admits the region, it gathers the chunk's head slice, every layer, K then V, into a lease of its
staging buffer (on its own CUDA stream, its completion observed by the worker's completion waiter;
on CPU in a worker thread) and posts ONE WRITE of it to ``region + writer offset``. A chunk that is
not admissible yet stays parked while the worker serves other chunks; newer watermarks and finished
WRITEs (which release staging leases) retry the parked ones. Nothing here blocks on the watermark.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import numpy as np
import torch

from transfer_engine.errors import FailureReason, StagingError, TransferError
from transfer_engine.kernels import KVTable, as_kv_table, gather_heads
from transfer_engine.kernels.checksum import checksum_value
from transfer_engine.memory.integrity import Sum
from transfer_engine.memory.layout import KVPool
from transfer_engine.memory.staging import StagingMemory, allocate_staging, run_cpu_copy
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.layers import group_tensors
from transfer_engine.protocol.staging import (
    Allocation,
    BufferLeases,
    RingMark,
    WatermarkTracker,
    writer_block_bytes,
)
from transfer_engine.runtime.completion import CompletionWaiter, recorded
from transfer_engine.runtime.mail import WriteEnded, WriteJob
from transfer_engine.runtime.ports import Outbox, WritePort
from transfer_engine.runtime.steptrace import StepTrace
from transfer_engine.transport.interface import WriteSpec

from .core import Done, OwnInbox, seal_of
from .held import Held, HeldJobs, Start, is_ready
from .plan import chunk_notification, staged_slots

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Staged:
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


@dataclass(frozen=True, slots=True)
class Lease:
    """Token of a staged WRITE: it ends with ``WriteEnded(Lease(...))`` from the poller."""

    staged: Staged
    offset: int


def staged_source(job: WriteJob, pool: KVPool) -> np.ndarray:
    """The prefill slots a staged chunk gathers; TransferError when it cannot be staged here."""
    req, peer, chunk = job.request, job.peer, job.chunk
    assert chunk is not None
    if peer.ring is None:
        raise TransferError(f"decode rank {req.decode_rank} ({peer.agent_name}) has no staging ring")
    src_slots = staged_slots(job, pool)
    if src_slots.size == 0:
        raise TransferError(f"room {job.room}: chunk {chunk.chunk_id} carries no tokens for this decode rank")
    return src_slots


def staging_request(agent: str, job: WriteJob, src_slots: np.ndarray) -> m.StagingRequest:
    """The ring-region request of a staged chunk (whole, or its layer groups' shared region) from
    the prefill agent ``agent``."""
    chunk = job.chunk
    assert chunk is not None
    return m.StagingRequest(
        agent=agent,
        room=job.room,
        chunk_id=chunk.chunk_id,
        sender=job.sender,
        page_start=chunk.page_start,
        num_pages=chunk.num_pages,
        tokens=int(src_slots.size),
    )


def first_region(job: WriteJob, nbytes: int) -> tuple[Allocation, int] | str | None:
    """Chunk 0's region granted with the room's TransferRequest: ``(allocation, address of this
    writer's block)``; None when the chunk must ask (another chunk, or none granted); a string
    saying why when the grant cannot hold the chunk's ``nbytes`` (the decode broke the protocol)."""
    chunk, first = job.chunk, job.request.first_region
    if first is None or chunk is None or chunk.chunk_id != 0:
        return None
    ring = job.peer.ring
    assert ring is not None  # staged_source refused a peer without one
    if nbytes > first.writer_bytes or first.writer_offset + first.writer_bytes > first.length:
        return (
            f"room {job.room}: chunk 0 stages {nbytes} bytes, the region granted with the request "
            f"gives {first.writer_bytes} at +{first.writer_offset} of {first.length}"
        )
    allocation = Allocation(first.alloc_id, first.round, first.offset, first.length)
    return allocation, ring.addr + first.offset + first.writer_offset


def staged_spec(staged: Staged, memory: StagingMemory, offset: int) -> WriteSpec:
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


class StagedPath:
    """Stages chunks through ring regions; see the module docstring.

    Given the pool, the poller (:class:`~transfer_engine.runtime.ports.WritePort`: it registers the
    staging buffers, makes and starts the WRITEs), the outbox (``StagingRequest`` to a decode rank),
    the held part (a gathered WRITE is started by the completion waiter's thread as a held one is),
    the worker's own inbox (where a staged WRITE's end comes back, and its wake-up), its completion
    waiter, the seal of a chunk's WRITE, and the worker's reply to a job."""

    def __init__(
        self,
        index: int,
        pool: KVPool,
        poller: WritePort,
        outbox: Outbox,
        held: HeldJobs,
        inbox: OwnInbox,
        completions: CompletionWaiter,
        sealed: Callable[[WriteJob, WriteSpec], WriteSpec],
        done: Done,
        *,
        agent_name: str,
        trace: StepTrace,
        counters: dict[str, int],
        staging_bytes: int,
    ) -> None:
        self.index = index
        self.pool = pool
        self.poller = poller
        self.outbox = outbox
        self.held = held
        self.inbox = inbox
        self.completions = completions
        self.sealed = sealed
        self.done = done
        self.agent_name = agent_name
        self.trace = trace
        self.counters = counters
        self.staging_bytes = staging_bytes
        """The size of each staging buffer (``EngineConfig.staging_bytes``, resolved)."""
        self.stream = torch.cuda.Stream(pool.device) if pool.device.type == "cuda" else None
        """The stream of this worker's gathers (None on CPU)."""
        self._kv = as_kv_table(pool.kv_views)
        self._group_kv: dict[tuple[int, int], KVTable] = {}
        self._buffers: dict[bool, tuple[StagingMemory, BufferLeases]] = {}
        """Staging buffer and its leases, by host memory or not (allocated on first use)."""
        self._granting: dict[tuple[str, int, int], Staged] = {}
        """(decode agent, room, chunk id) -> a chunk whose region was asked for and not granted yet."""
        self._parked: dict[str, list[Staged]] = defaultdict(list)
        """Granted chunks by decode agent, waiting for their KV, the watermark or a lease."""
        self._watermarks: dict[str, WatermarkTracker] = defaultdict(WatermarkTracker)
        self._gathering: dict[int, Held | TransferError] = {}
        """Staged chunks (by ``id`` of their ``Staged``) whose gather runs: the WRITE made for each
        (started by the completion waiter's thread once the gather completed), or why none was."""
        self._awaiting_kv: set[int] = set()
        """Parked staged chunks (``id`` of their ``Staged``, kept alive by the waiter's callback)
        whose KV event the completion waiter watches."""

    @property
    def parked(self) -> int:
        """Staged chunks granted a region but waiting for the watermark or a staging lease."""
        return sum(len(v) for v in self._parked.values())

    @property
    def awaiting_grant(self) -> int:
        """Chunks whose ring region was asked for and not granted yet."""
        return len(self._granting)

    def leases(self) -> int:
        """Staging-buffer leases held (0 when idle: the leak check)."""
        return sum(leases.live for _, leases in self._buffers.values())

    async def buffer(self, host: bool) -> tuple[StagingMemory, BufferLeases]:
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

    async def request_region(self, job: WriteJob) -> None:
        """A whole staged chunk: ask the decode rank's ring for its region (or take the one granted
        with the request) and park it."""
        req, peer, chunk = job.request, job.peer, job.chunk
        assert chunk is not None
        try:
            spec = req.slices[0]
            src_slots = staged_source(job, self.pool)
            layout = self.pool.layout
            nbytes = writer_block_bytes(
                layout.num_kv_tensors, src_slots.size, spec.num_heads, layout.head_dim, self.pool.itemsize
            )
            host = req.path == "host"
            (await self.buffer(host))[1].check_fits(nbytes)
        except StagingError as exc:
            await self.done(job, False, str(exc), FailureReason.STAGING)
            return
        except TransferError as exc:
            await self.done(job, False, str(exc), FailureReason.PROTOCOL)
            return
        first = first_region(job, nbytes)
        if isinstance(first, str):
            await self.done(job, False, first, FailureReason.PROTOCOL)
            return
        if first is not None:  # granted with the request: no round trip
            allocation, dst = first
            self._parked[peer.agent_name].append(Staged(job, src_slots, nbytes, host, allocation, dst))
            self.counters["granted_ahead"] += 1
            self.trace.mark(job.room, "granted_ahead")
            await self.progress(peer.agent_name)
            return
        request = staging_request(self.agent_name, job, src_slots)
        self._granting[(peer.agent_name, job.room, chunk.chunk_id)] = Staged(
            job, src_slots, nbytes, host, request=request, asked_at=time.monotonic()
        )
        self.counters["staging_requests"] += 1
        self.outbox.send(peer.endpoint, request)

    async def on_grant(self, grant: m.StagingGrant) -> None:
        staged = self._granting.pop((grant.agent, grant.room, grant.chunk_id), None)
        if staged is None:  # the room failed meanwhile; the decode room frees the region when it ends
            self.counters["grants_unmatched"] += 1
            return
        ring = staged.job.peer.ring
        assert ring is not None
        if grant.writer_bytes != staged.nbytes or grant.writer_offset + grant.writer_bytes > grant.length:
            await self.done(
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
        await self.progress(grant.agent)

    async def on_refused(self, refused: m.StagingRefused) -> None:
        """The decode refused a whole chunk's region: the chunk fails."""
        staged = self._granting.pop((refused.agent, refused.room, refused.chunk_id), None)
        if staged is not None:
            await self.done(
                staged.job,
                False,
                f"decode {refused.agent} refused the chunk: {refused.detail}",
                FailureReason.STAGING,
            )

    async def on_watermark(self, mark: m.Watermark) -> None:
        """A decode rank's ring moved on: start the parked chunks to it that it now admits."""
        if self._watermarks[mark.agent].update(RingMark(mark.round, mark.tail)):
            await self.progress(mark.agent)

    async def on_lease_ended(self, lease: Lease, ok: bool, detail: str) -> None:
        """A staged WRITE ended: free its lease, answer its job, retry the parked chunks."""
        self.trace.mark(lease.staged.job.room, "write_ended")
        self._buffers[lease.staged.host][1].release(lease.offset)
        await self.done(lease.staged.job, ok, detail, FailureReason.TRANSPORT)
        await self.progress_all()

    def repeat_requests(self, before: float) -> None:
        """Ask again for the regions asked for before ``before`` and not granted yet."""
        for staged in list(self._granting.values()):
            if staged.request is not None and staged.asked_at < before:
                self.counters["staging_repeats"] += 1
                self.outbox.send(staged.job.peer.endpoint, staged.request)

    def park(self, staged: Staged) -> None:
        """Park a granted chunk (or layer group) until :meth:`progress` can start it."""
        self._parked[staged.job.peer.agent_name].append(staged)

    async def progress(self, agent: str) -> None:
        """Start every parked chunk to ``agent`` that the watermark admits and a lease can hold."""
        parked = self._parked.get(agent)
        if not parked:
            return
        tracker = self._watermarks[agent]
        waiting: list[Staged] = []
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
                    self.completions.notify(ready, functools.partial(self._kv_written, staged), owner=staged)
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

    async def progress_all(self) -> None:
        """:meth:`progress` to every decode agent with parked chunks."""
        for agent in list(self._parked):
            await self.progress(agent)

    def _kv_written(self, staged: Staged) -> None:
        """On the loop, from the completion waiter: the KV of parked ``staged`` is written; the
        :class:`Reached` mail makes the worker look at its parked chunks again."""
        self._awaiting_kv.discard(id(staged))
        if not self.inbox.closed:
            self.inbox.wake()

    async def _gather_and_write(self, staged: Staged, memory: StagingMemory, offset: int) -> None:
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
        spec = self.sealed(job, staged_spec(staged, memory, offset))
        seal = seal_of(spec)
        # Integrity: the gather kernel sums what it writes, in the same pass (docs/INTEGRITY.md);
        # the sum is known when the gather is, so the WRITE's start waits for nothing more.
        summed = None
        if seal is not None:
            summed = torch.zeros(1, dtype=torch.int64, pin_memory=self.stream is not None)
            gather = functools.partial(gather, checksum=summed)
        made: int | TransferError | None = None
        gathered = None
        try:
            # The WRITE is made (checked, lists prepared) while the gather runs: only its start
            # waits for the gathered bytes (docs/DECISIONS.md, "A staged WRITE is made while its gather runs").
            if self.stream is None:
                made = self._make(spec)
                await run_cpu_copy(gather, staged.nbytes)
                if seal is not None and summed is not None:
                    seal.taken(Sum.known(checksum_value(summed)))
            else:
                if job.ready is not None:
                    self.stream.wait_event(job.ready)  # the gather reads KV the caller's stream wrote
                gather()
                made = self._make(spec)
                gathered = recorded(self.stream)
                if seal is not None and summed is not None:
                    seal.taken(Sum(gathered, functools.partial(checksum_value, summed)))
        except Exception as exc:  # a kernel error fails the room, never the worker
            log.exception("worker %d: gather for room %d failed", self.index, job.room)
            if isinstance(made, int):
                self.poller.discard(made)
            leases.release(offset)
            await self.done(job, False, f"gather failed: {exc}", FailureReason.TRANSPORT)
            return
        assert made is not None
        held = made if isinstance(made, TransferError) else Held((made, spec))
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
            functools.partial(self.held.claim_and_start, job.room, held)
            if isinstance(held, Held) and not staged.host
            else None
        )
        self.completions.notify(
            gathered, functools.partial(self._start_gathered, staged, offset, held), first
        )

    def _start_gathered(self, staged: Staged, offset: int, held: Held | TransferError) -> None:
        """The gather of ``staged`` into its lease at ``offset`` has completed: start its WRITE, or
        adopt it when the completion waiter's thread started it.

        On the loop: from the worker's task (CPU copies) or from the completion waiter. A WRITE that
        cannot start ends as if it had failed: ``WriteEnded`` to this worker, which frees the lease
        and answers the room."""
        tracked = self._gathering.pop(id(staged), None) is not None
        job = staged.job
        self.trace.mark(job.room, "gathered")
        if self.inbox.closed:  # the worker ended (and let go of the WRITEs it tracked): nobody will answer
            if isinstance(held, Held) and not tracked:
                self.held.let_go(held)
            return
        token = Lease(staged, offset)
        try:
            if isinstance(held, TransferError):
                raise held
            if held.state in (Start.STARTED, Start.REFUSED):
                refusal = self.held.settle(held, self.inbox.mailbox, token)
                if refusal is not None:
                    raise refusal
            else:
                # the thread is done with it (its first step ran before this callback), or never ran
                claimed = held.take()
                assert claimed, held.state
                self.poller.start_write(*held.made, self.inbox.mailbox, token)
                self.trace.mark(job.room, "posted")
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

    async def cancel(self, room: int) -> None:
        """End ``room``'s chunks waiting for a grant or parked."""
        for key in [k for k in self._granting if k[1] == room]:
            staged = self._granting.pop(key)
            await self.done(
                staged.job, False, "cancelled while waiting for a ring region", FailureReason.ABORTED
            )
        for agent in list(self._parked):
            ended = [staged for staged in self._parked[agent] if staged.job.room == room]
            if not ended:
                continue
            self._parked[agent] = [staged for staged in self._parked[agent] if staged.job.room != room]
            for staged in ended:
                if id(staged) in self._awaiting_kv:  # its KV may never be written
                    self._awaiting_kv.discard(id(staged))
                    self.completions.forget(staged)
                await self.done(staged.job, False, "cancelled before posting", FailureReason.ABORTED)
            if not self._parked[agent]:
                del self._parked[agent]

    def let_go_gathering(self) -> None:
        """At the worker's end, its waiter thread joined: let go of the WRITEs made for gathers still
        running."""
        for made in self._gathering.values():
            if isinstance(made, Held):
                self.held.let_go(made)
        self._gathering.clear()
