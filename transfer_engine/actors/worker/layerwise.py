"""Layer groups of a staged chunk (``Sender.begin_chunk``/``layers_ready`` on the staged and host
paths): the chunk's first group asks for one ring region for the whole chunk (:class:`LayerRegion`:
every layer's block); each group is gathered into a lease of its own and WRITTEN into its layers'
part of that region once granted, through :mod:`.staged`'s parking. A group whose layers are not
written yet is held (:mod:`.held`) and handed back once they are.

The layer groups of a direct or slice chunk are WRITEs of their layers' rows of the chunk's
descriptors, made and started by :mod:`.direct`; the worker hands each group to the part that
carries it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from transfer_engine.errors import FailureReason, StagingError, TransferError
from transfer_engine.memory.layout import KVPool
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.layers import group_block_runs, group_tensors
from transfer_engine.protocol.staging import Allocation, writer_block_bytes
from transfer_engine.runtime.mail import WriteJob
from transfer_engine.runtime.ports import Outbox
from transfer_engine.runtime.steptrace import StepTrace

from .core import Done
from .held import HeldJobs, pending_waits
from .staged import Staged, StagedPath, first_region, staged_source, staging_request


@dataclass(eq=False)
class LayerRegion:
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


class StagedGroups:
    """Sends the layer groups of staged chunks; see the module docstring.

    Given the pool, the outbox (``StagingRequest`` to a decode rank), the staged part (its buffers,
    where a granted group is parked and started), the held part (groups whose layers are not
    written yet), and the worker's reply to a job."""

    def __init__(
        self,
        pool: KVPool,
        outbox: Outbox,
        staged: StagedPath,
        held: HeldJobs,
        done: Done,
        *,
        agent_name: str,
        trace: StepTrace,
        counters: dict[str, int],
    ) -> None:
        self.pool = pool
        self.outbox = outbox
        self.staged = staged
        self.held = held
        self.done = done
        self.agent_name = agent_name
        self.trace = trace
        self.counters = counters
        self._layer_regions: dict[tuple[str, int, int], LayerRegion] = {}
        """(decode agent, room, chunk id) -> the region of a layer-wise staged chunk."""

    @property
    def regions(self) -> int:
        """Layer-wise chunks' regions held (0 when idle)."""
        return len(self._layer_regions)

    @property
    def awaiting_grant(self) -> int:
        """Layer-wise chunks whose ring region was asked for and not granted yet."""
        return sum(1 for r in self._layer_regions.values() if r.allocation is None and r.refused is None)

    def has_layer_region(self, agent: str, room: int, chunk_id: int) -> bool:
        """Whether that chunk is a layer-wise one with a region (asked for or granted)."""
        return (agent, room, chunk_id) in self._layer_regions

    async def layer_group(self, job: WriteJob) -> None:
        """A layer group of a staged chunk to one decode rank: ask for the chunk's region with its
        first group; start it once every ``waits`` completed (held until then: the worker hands it
        back to :meth:`start`)."""
        if not await self._layer_region(job):
            return
        pending = pending_waits(job)
        if not pending:
            await self.start(job)
            return
        self.held.hold(job, pending)

    async def start(self, job: WriteJob) -> None:
        """Start a staged layer group whose KV is written, through its chunk's ring region."""
        assert job.chunk is not None and job.group is not None
        key = (job.peer.agent_name, job.room, job.chunk.chunk_id)
        region = self._layer_regions.get(key)
        if region is None:  # cancelled meanwhile (CancelRoom answered every job it held)
            return
        if region.refused is not None:
            self._group_left(key, region)
            await self.done(job, False, region.refused, FailureReason.STAGING)
        elif region.allocation is None:
            region.waiting.append(job)
        else:
            self._park_group(job, region)
            self._group_left(key, region)
            await self.staged.progress(job.peer.agent_name)

    def _group_left(self, key: tuple[str, int, int], region: LayerRegion) -> None:
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
                src_slots = staged_source(job, self.pool)
                layout = self.pool.layout
                tensor_bytes = writer_block_bytes(
                    1, src_slots.size, spec.num_heads, layout.head_dim, self.pool.itemsize
                )
                host = req.path == "host"
                (await self.staged.buffer(host))[1].check_fits(tensor_bytes * len(group_tensors(
                    layout.num_layers, layout.mla, group.start, group.end
                )))  # fmt: skip
            except StagingError as exc:
                await self.done(job, False, str(exc), FailureReason.STAGING)
                return False
            except TransferError as exc:
                await self.done(job, False, str(exc), FailureReason.PROTOCOL)
                return False
            assert peer.ring is not None  # staged_source refused a peer without one
            request = staging_request(self.agent_name, job, src_slots)
            region = LayerRegion(
                request, peer.endpoint, peer.ring.addr, src_slots, tensor_bytes,
                tensor_bytes * layout.num_kv_tensors, host, time.monotonic(),
            )  # fmt: skip
            first = first_region(job, region.block_bytes)
            if isinstance(first, str):
                await self.done(job, False, first, FailureReason.PROTOCOL)
                return False
            self._layer_regions[key] = region
            if first is None:
                self.counters["staging_requests"] += 1
                self.outbox.send(peer.endpoint, request)
            else:  # granted with the request: no round trip
                region.allocation, region.dst = first
                self.counters["granted_ahead"] += 1
                self.trace.mark(job.room, "granted_ahead")
        region.pending += 1
        region.closed = region.closed or group.closes
        return True

    async def on_grant(self, grant: m.StagingGrant) -> None:
        """The decode granted a layer-wise chunk's region: park its groups that wait for it."""
        key = (grant.agent, grant.room, grant.chunk_id)
        region = self._layer_regions[key]
        if region.allocation is not None or region.refused is not None:
            self.counters["grants_unmatched"] += 1  # a repeated grant
            return
        if (
            grant.writer_bytes != region.block_bytes
            or grant.writer_offset + grant.writer_bytes > grant.length
        ):
            await self._refuse(
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
        await self.staged.progress(grant.agent)

    async def on_refused(self, refused: m.StagingRefused) -> None:
        """The decode refused a layer-wise chunk's region."""
        region = self._layer_regions[(refused.agent, refused.room, refused.chunk_id)]
        await self._refuse(region, refused.agent, refused.detail)

    async def _refuse(
        self, region: LayerRegion, agent: str, detail: str, reason: FailureReason = FailureReason.STAGING
    ) -> None:
        """The chunk's region was refused: its waiting groups fail now, later ones when they start."""
        region.refused = f"decode {agent} refused the chunk: {detail}"
        key = (agent, region.request.room, region.request.chunk_id)
        waiting, region.waiting = region.waiting, []
        for job in waiting:
            self._group_left(key, region)
            await self.done(job, False, region.refused, reason)

    def _park_group(self, job: WriteJob, region: LayerRegion) -> None:
        """Park one ready group of a granted chunk: gathered and WRITTEN once the watermark admits."""
        assert job.group is not None and region.allocation is not None
        layout = self.pool.layout
        runs = group_block_runs(
            layout.num_layers, layout.mla, region.tensor_bytes, job.group.start, job.group.end
        )
        nbytes = sum(length for _, _, length in runs)
        self.staged.park(
            Staged(job, region.src_slots, nbytes, region.host, region.allocation, region.dst, runs=runs)
        )

    def repeat_requests(self, before: float) -> None:
        """Ask again for the layer-wise chunks' regions asked for before ``before`` and not granted
        yet."""
        for region in self._layer_regions.values():
            if region.allocation is None and region.refused is None and region.asked_at < before:
                self.counters["staging_repeats"] += 1
                self.outbox.send(region.endpoint, region.request)

    async def cancel(self, room: int) -> None:
        """Forget ``room``'s layer-wise regions, answering the groups that waited for a grant."""
        for key in [k for k in self._layer_regions if k[1] == room]:
            region = self._layer_regions.pop(key)
            for job in region.waiting:
                await self.done(
                    job, False, "cancelled while waiting for a ring region", FailureReason.ABORTED
                )
