"""Scatter actor (decode): copies landed staged chunks from the ring into the KV pages.

The room counts its writers' ``ChunkLanded`` notifications (in any order, in its core); when every
writer of a chunk has landed it sends a :class:`~transfer_engine.runtime.mail.ScatterJob` here. The actor scatters all writer
blocks of the region in one launch on its own CUDA stream (on CPU: the torch implementation, in a
worker thread so the event loop keeps polling), waits for the stream's event without blocking the
loop or polling it (:class:`~transfer_engine.runtime.completion.CompletionWaiter`), then frees the region by a call to the ring (its port) and tells the room
(:class:`~transfer_engine.runtime.mail.Scattered`, addressed by room id). Jobs run in arrival order, one at
a time. A layer-wise chunk comes as one job per landed layer group of a writer, the region freed
after the chunk's last one.

Integrity (docs/INTEGRITY.md): a job's ``checks`` are summed over the pages right behind the copy,
on the same stream (CUDA: the copy's completion event covers them, nothing more is waited for) or
the same thread (CPU), and the sums ride on the ``Scattered`` answer.
"""

from __future__ import annotations

import functools
import logging

import anyio
import anyio.abc
import torch

from transfer_engine.kernels import KVTable, as_kv_table, scatter_heads
from transfer_engine.memory.integrity import PoolChecksums, Sum
from transfer_engine.memory.layout import KVPool
from transfer_engine.memory.staging import StagingMemory, run_cpu_copy
from transfer_engine.runtime.completion import CompletionWaiter, recorded
from transfer_engine.runtime.mail import ScatterCheck, Scattered, ScatterJob, ScatterRun
from transfer_engine.runtime.ports import RingPort, RoomBoard

from .base import Actor

log = logging.getLogger(__name__)


class ScatterActor(Actor[ScatterJob]):
    """See the module docstring. ``ring``: the ring's port (a chunk's region is freed by a call)."""

    def __init__(
        self,
        pool: KVPool,
        memory: StagingMemory,
        ring: RingPort,
        rooms: RoomBoard,
        *,
        capacity: int = 4096,
        reserve: int = 0,
        checksums: PoolChecksums | None = None,
    ) -> None:
        super().__init__(capacity, reserve)
        self.checksums = checksums
        """Integrity on: what a job's ``checks`` are summed with (a job asks for none otherwise)."""
        self.pool = pool
        self.memory = memory
        self.ring = ring
        self.rooms = rooms
        self._kv = as_kv_table(pool.kv_views)
        self._runs: dict[tuple[int, int], KVTable] = {}
        """KV tables of the tensor runs ``(first, count)`` of layer-wise jobs, each made once."""
        self._cuda = pool.device.type == "cuda"
        self.stream = torch.cuda.Stream(pool.device) if self._cuda else None
        self.completions = CompletionWaiter("scatter")
        """Wakes this actor when its stream reached the end of a scatter."""

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        if self.stream is None:  # CPU scatters run inline or in a worker thread: nothing to wait for
            await super().run(task_status=task_status)
            return
        self.completions.start()
        try:
            await super().run(task_status=task_status)
        finally:
            self.completions.close()

    async def handle(self, job: ScatterJob) -> None:
        ok, detail = True, ""
        sums: list[Sum] = []
        try:
            await self._scatter(job, sums)
        except Exception as exc:  # a kernel error must fail the room, never the actor
            log.exception("scatter of room %d chunk %d failed", job.room, job.chunk_id)
            ok, detail = False, f"scatter of chunk {job.chunk_id} failed: {exc}"
        values: list[int | None] = []
        for one in sums if ok else ():
            try:
                values.append(one.value())  # known: the copy's completion came after it
            except Exception as exc:
                values.append(None)
                detail = f"{type(exc).__name__}: {exc}"
        if job.free:
            self.ring.free_regions((job.alloc_id,))
        await self.rooms.deliver(job.room, Scattered(job.chunk_id, ok, detail, job.free, tuple(values)))

    def _run(self, run: ScatterRun) -> KVTable:
        key = (run.first, run.count)
        table = self._runs.get(key)
        if table is None:
            table = self._runs[key] = as_kv_table(self.pool.kv_views[run.first : run.first + run.count])
        return table

    def _check(self, job: ScatterJob, check: ScatterCheck, now: bool) -> Sum:
        """Start (CUDA: on the scatter stream, behind the copy) or take (``now``: on this thread, a
        CPU copy's) the checksum ``check`` of the job's pages."""
        checksums = self.checksums
        assert checksums is not None, "a job asks for checks only with integrity on"
        part = (job.slots, check.head_start, check.num_heads, check.layers)
        if now:
            return Sum.known(checksums.chunk(*part))
        return checksums.enqueue(*part, stream=self.stream)

    async def _scatter(self, job: ScatterJob, sums: list[Sum]) -> None:
        """Copy ``job`` into the pages, then take its ``checks`` into ``sums`` (behind the copy)."""
        region = self.memory.view(job.offset, job.length)
        slots = torch.from_numpy(job.slots)
        parts = [(self._kv, job.blocks)] if not job.runs else [(self._run(r), r.blocks) for r in job.runs]
        launches = [
            functools.partial(scatter_heads, region, kv, slots, blocks, stream=self.stream)
            for kv, blocks in parts
        ]

        def launch() -> None:
            for one in launches:
                one()
            sums.extend(self._check(job, check, self.stream is None) for check in job.checks)

        if self.stream is None:
            tensors = sum(r.count for r in job.runs) if job.runs else len(self.pool.kv_views)
            await run_cpu_copy(launch, job.length * tensors // len(self.pool.kv_views))
            return
        launch()
        await self.completions.wait(recorded(self.stream))
