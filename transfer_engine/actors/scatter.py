"""Scatter actor (decode): copies landed staged chunks from the ring into the KV pages.

The room counts its writers' ``ChunkLanded`` notifications (in any order, in its core); when every
writer of a chunk has landed it sends a :class:`~transfer_engine.runtime.mail.ScatterJob` here. The actor scatters all writer
blocks of the region in one launch on its own CUDA stream (on CPU: the torch implementation, in a
worker thread so the event loop keeps polling), then frees the region by a call to the ring (its
port) and tells the room (:class:`~transfer_engine.runtime.mail.Scattered`, addressed by room id)
once the copy has completed. A layer-wise chunk comes as one job per landed layer group of a
writer, the region freed after the chunk's last one.

The actor does not wait for a job's copy before it launches the next one: its mailbox task enqueues
each job's kernels on the stream back to back and hands the stream's event to its answering task,
which waits for the events in launch order (the order the stream reaches them) without blocking the
loop or polling it (:class:`~transfer_engine.runtime.completion.CompletionWaiter`) and answers each
job as its copy completes (docs/DECISIONS.md, "The decode scatters without waiting on each job").
At most :data:`IN_FLIGHT` copies are launched and not answered; the mailbox task waits beyond that.
On CPU the mailbox task does each copy itself, one after another (they share the rank's cores:
there is nothing to overlap them with), and hands it over done.

Integrity (docs/INTEGRITY.md): a job's ``checks`` are summed over the pages right behind the copy,
on the same stream (CUDA: the copy's completion event covers them, nothing more is waited for) or
the same thread (CPU), and the sums ride on the ``Scattered`` answer.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import anyio
import anyio.abc
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from transfer_engine.kernels import KVTable, as_kv_table, scatter_heads
from transfer_engine.memory.integrity import PoolChecksums, Sum
from transfer_engine.memory.layout import KVPool
from transfer_engine.memory.staging import StagingMemory, run_cpu_copy
from transfer_engine.runtime.completion import Completion, CompletionWaiter, recorded
from transfer_engine.runtime.mail import ScatterCheck, Scattered, ScatterJob, ScatterRun
from transfer_engine.runtime.ports import RingPort, RoomBoard

from .base import Actor

log = logging.getLogger(__name__)

IN_FLIGHT = 64
"""Copies launched and not yet answered, at most (the mailbox task waits beyond it): on CUDA, enqueued
on the scatter stream. Each holds only its job; the ring regions they read are allocated already."""


@dataclass(slots=True)
class _Launched:
    """A job whose copy was enqueued (``done``: the stream's event after it; None: done already, on
    CPU), or failed (``detail``: why): what the answering task answers, in launch order."""

    job: ScatterJob
    sums: list[Sum]
    done: Completion | None
    detail: str = ""


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
        """Wakes the answering task when the stream reached the end of a copy."""
        self._launched: MemoryObjectSendStream[_Launched]
        """Where the mailbox task hands each launched job to the answering task (set by :meth:`run`)."""

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        if self.stream is not None:  # CPU copies are done when the mailbox task hands them over
            self.completions.start()
        launched, answering = anyio.create_memory_object_stream[_Launched](IN_FLIGHT)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._answer_launched, answering)
                with launched:
                    self._launched = launched
                    await super().run(task_status=task_status)
                # the mailbox is closed and drained: the answering task answers what is left, and ends
        finally:
            self.completions.close()

    async def handle(self, job: ScatterJob) -> None:
        sums: list[Sum] = []
        done: Completion | None = None
        try:
            if self.stream is None:
                await self._scatter_cpu(job, sums)
            else:
                self._launch(job, sums)
                # the next job is launched at once, behind this one on the stream; this one is
                # answered by the answering task once the stream has passed this point
                done = recorded(self.stream)
        except Exception as exc:  # a kernel error must fail the room, never the actor
            log.exception("scatter of room %d chunk %d failed", job.room, job.chunk_id)
            await self._launched.send(
                _Launched(job, [], None, f"scatter of chunk {job.chunk_id} failed: {exc}")
            )
            return
        await self._launched.send(_Launched(job, sums, done))

    async def _answer_launched(self, launched: MemoryObjectReceiveStream[_Launched]) -> None:
        """Answer the launched jobs in launch order, each once its copy has completed (CUDA: its
        stream's event; CPU: done when handed over)."""
        with launched:
            async for one in launched:
                if one.done is not None:
                    await self.completions.wait(one.done)
                await self._answer(one.job, one.sums, one.detail)

    async def _answer(self, job: ScatterJob, sums: list[Sum], failed: str = "") -> None:
        """``job``'s copy ended (``failed``: why it did not happen): free its region when it is the
        chunk's last, and tell its room, with the checksums taken behind the copy."""
        ok, detail = not failed, failed
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

    def _launch(self, job: ScatterJob, sums: list[Sum]) -> None:
        """Copy ``job`` into the pages, then take its ``checks`` into ``sums`` (behind the copy): on
        CUDA enqueued on the scatter stream, on CPU done on this thread."""
        region = self.memory.view(job.offset, job.length)
        slots = torch.from_numpy(job.slots)
        parts = [(self._kv, job.blocks)] if not job.runs else [(self._run(r), r.blocks) for r in job.runs]
        for kv, blocks in parts:
            scatter_heads(region, kv, slots, blocks, stream=self.stream)
        sums.extend(self._check(job, check, self.stream is None) for check in job.checks)

    async def _scatter_cpu(self, job: ScatterJob, sums: list[Sum]) -> None:
        """CPU: :meth:`_launch`, inline when small, else in a worker thread."""
        tensors = sum(r.count for r in job.runs) if job.runs else len(self.pool.kv_views)
        await run_cpu_copy(
            functools.partial(self._launch, job, sums), job.length * tensors // len(self.pool.kv_views)
        )
