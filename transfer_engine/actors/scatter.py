"""Scatter actor (decode): copies landed staged chunks from the ring into the KV pages (DESIGN §4.2).

The room counts its writers' ``ChunkLanded`` notifications (in any order, in its core); when every
writer of a chunk has landed it sends a :class:`ScatterJob` here. The actor scatters all writer
blocks of the region in one launch on its own CUDA stream (on CPU: the torch implementation, in a
worker thread so the event loop keeps polling), waits for the stream's event without blocking the
loop, then frees the region through the ring actor and tells the room (:class:`Scattered`). Jobs
run in arrival order, one at a time.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import numpy as np
import torch
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from transfer_engine.kernels import as_kv_table, scatter_heads
from transfer_engine.layout import KVPool
from transfer_engine.memory import StagingMemory, run_cpu_copy, stream_reached

from .ring import FreeRegion

if TYPE_CHECKING:
    from .ring import RingActor
    from .room import ReceiverRoomActor

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ScatterJob:
    """Scatter region ``[offset, offset + length)`` of the ring into ``slots`` of the room's pages."""

    room: ReceiverRoomActor
    chunk_id: int
    alloc_id: int
    offset: int
    length: int
    blocks: list[tuple[int, int, int]]
    """(byte offset inside the region, dst_head_start, num_heads) per writer."""
    slots: np.ndarray


@dataclass(frozen=True, slots=True)
class Scattered:
    """Scatter -> room: chunk ``chunk_id`` is in the KV pages (``ok``), or the scatter failed."""

    chunk_id: int
    ok: bool
    detail: str = ""


class ScatterActor:
    """See the module docstring."""

    def __init__(self, pool: KVPool, ring: RingActor, memory: StagingMemory, *, mailbox: int = 4096) -> None:
        self.pool = pool
        self.ring = ring
        self.memory = memory
        self._kv = as_kv_table(pool.tensors)
        self._cuda = pool.device.type == "cuda"
        self.stream = torch.cuda.Stream(pool.device) if self._cuda else None
        self.inbox: MemoryObjectSendStream[ScatterJob]
        self._rx: MemoryObjectReceiveStream[ScatterJob]
        self.inbox, self._rx = anyio.create_memory_object_stream[ScatterJob](mailbox)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self._rx:
            async for job in self._rx:
                ok, detail = True, ""
                try:
                    await self._scatter(job)
                except Exception as exc:  # a kernel error must fail the room, never the actor
                    log.exception("scatter of room %d chunk %d failed", job.room.room, job.chunk_id)
                    ok, detail = False, f"scatter of chunk {job.chunk_id} failed: {exc}"
                freed = anyio.Event()
                await self.ring.inbox.send(FreeRegion(job.alloc_id, freed))
                await freed.wait()
                await job.room.inbox.send(Scattered(job.chunk_id, ok, detail))

    async def _scatter(self, job: ScatterJob) -> None:
        region = self.memory.view(job.offset, job.length)
        slots = torch.from_numpy(job.slots)
        launch = functools.partial(scatter_heads, region, self._kv, slots, job.blocks, stream=self.stream)
        if self.stream is None:
            await run_cpu_copy(launch, job.length)
            return
        launch()
        await stream_reached(self.stream)
