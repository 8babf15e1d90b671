"""TransferWorker actor (prefill): turns a room's chunk into one WRITE to one decode rank.

The engine runs N workers and shards jobs by destination decode agent, so every chunk a room sends
to one decode rank goes through one worker, in order. A worker computes the chunk's descriptors (a
pure function of the layouts and page lists, see ``protocol.descriptors``), checks them against the
peer's registered regions, and posts the WRITE through the NixlPoller with the chunk's notification
on it. The WRITE's end is reported to the room's mailbox by the poller, not to the worker: the
worker never waits on the network for the direct and slice paths.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio
import numpy as np
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from transfer_engine.errors import TransferError
from transfer_engine.layout import KVPool
from transfer_engine.peers import Peer
from transfer_engine.protocol import descriptors
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.rooms import Chunk

from .nixl_poller import NixlPoller

log = logging.getLogger(__name__)

JobDone = Callable[[bool, str], Awaitable[None]]


@dataclass(eq=False)
class WriteJob:
    """One chunk of one room to one decode rank, or the room's aux item (``chunk is None``)."""

    room: int
    sender: int
    peer: Peer
    request: m.TransferRequest
    chunk: Chunk | None
    src_pages: np.ndarray
    on_done: JobDone
    aux_slot: int | None = None
    cancelled: bool = field(default=False)


def plan_write(
    job: WriteJob, pool: KVPool, bases: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, bytes]:
    """The WRITE for a job: ``(src_addr, dst_addr, length, notification)``. Pure; raises TransferError.

    Direct path: coalesced page runs of every KV tensor. Slice path: one descriptor per tensor and
    token, covering the writer's head slice. Aux: one descriptor.
    """
    req, peer, chunk = job.request, job.peer, job.chunk
    if chunk is None:
        assert (
            job.aux_slot is not None
            and req.aux_slot is not None
            and peer.aux is not None
            and pool.aux is not None
        )
        item = pool.aux.shape[1]
        src = np.array([pool.aux.data_ptr() + job.aux_slot * item], dtype=np.uint64)
        dst = np.array([peer.aux.addr + req.aux_slot * item], dtype=np.uint64)
        return (
            src,
            dst,
            np.array([item], dtype=np.uint64),
            m.encode(m.AuxLanded(room=job.room, sender=job.sender)),
        )
    dst_pages_all = np.asarray(req.dst_pages, dtype=np.int64)
    notif = m.encode(
        m.ChunkLanded(
            room=job.room,
            chunk_id=chunk.chunk_id,
            last=chunk.last,
            sender=job.sender,
            page_start=chunk.page_start,
            num_pages=chunk.num_pages,
            region=-1,
        )
    )
    spec = req.slices[0]
    if req.path == "direct":
        dst_pages = dst_pages_all[chunk.page_start : chunk.page_start + chunk.num_pages]
        if len(dst_pages) != len(job.src_pages):
            raise TransferError(
                f"room {job.room}: chunk {chunk.chunk_id} covers request pages "
                f"[{chunk.page_start}, {chunk.page_start + chunk.num_pages}) but decode rank "
                f"{req.decode_rank} gave only {len(dst_pages_all)} pages"
            )
        src, dst, length = descriptors.direct_descriptors(
            bases, peer.bases, pool.page_bytes, job.src_pages, dst_pages
        )
        return src, dst, length, notif
    src_ps, dst_ps = pool.layout.page_size, peer.layout.page_size
    start = chunk.page_start * src_ps
    tokens = descriptors.chunk_tokens(start, chunk.num_pages, src_ps, len(dst_pages_all) * dst_ps)
    src_slots = descriptors.slots_of(job.src_pages, src_ps, 0, tokens)
    dst_slots = descriptors.slots_of(dst_pages_all, dst_ps, start, tokens)
    src, dst, length = descriptors.slice_descriptors(
        bases,
        peer.bases,
        pool.slot_bytes,
        peer.slot_bytes(pool.itemsize),
        pool.head_bytes,
        src_slots,
        dst_slots,
        spec.src_head_start,
        spec.dst_head_start,
        spec.num_heads,
    )
    return src, dst, length, notif


class TransferWorker:
    """See the module docstring. ``inbox`` takes :class:`WriteJob`s."""

    def __init__(self, index: int, pool: KVPool, poller: NixlPoller, *, mailbox: int = 1024) -> None:
        self.index = index
        self.pool = pool
        self.poller = poller
        self._bases = np.array([t.data_ptr() for t in pool.tensors], dtype=np.uint64)
        self.inbox: MemoryObjectSendStream[WriteJob]
        self._rx: MemoryObjectReceiveStream[WriteJob]
        self.inbox, self._rx = anyio.create_memory_object_stream[WriteJob](mailbox)
        self.queued = 0

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self._rx:
            async for job in self._rx:
                await self._execute(job)

    async def _execute(self, job: WriteJob) -> None:
        if job.cancelled:
            await job.on_done(False, "cancelled before posting")
            return
        try:
            src, dst, length, notif = plan_write(job, self.pool, self._bases)
            if len(src) == 0:
                raise TransferError(f"room {job.room}: empty WRITE")
            self.poller.post_write(
                job.peer.agent_name,
                self.pool.mem_type,
                src,
                dst,
                length,
                self.pool.device_id,
                notif,
                job.on_done,
            )
        except TransferError as exc:
            log.warning("worker %d: room %d: %s", self.index, job.room, exc)
            await job.on_done(False, str(exc))
