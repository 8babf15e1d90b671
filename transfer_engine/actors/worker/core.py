"""What the parts of a :class:`~transfer_engine.actors.worker.TransferWorker` share: the mail it
takes, a WRITE made ahead (:data:`Made`) and its integrity seal (:class:`Sealer`), the one reply a
job gets from the worker itself (:func:`answer`), the worker's own inbox as its parts see it
(:class:`OwnInbox`), and the one call that goes against the flow of the parts (:class:`Starter`:
the held part starting what the direct part made).

The worker owns its parts and hands each only what it uses; no part holds the worker or another
part above it (docs/ARCHITECTURE.md, "Layout": the parts of the worker).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Awaitable, Callable
from typing import Protocol

from transfer_engine.errors import FailureReason
from transfer_engine.memory.integrity import PoolChecksums, Seal
from transfer_engine.memory.layout import KVPool
from transfer_engine.protocol import messages as m
from transfer_engine.runtime.mail import (
    CancelRoom,
    Mailbox,
    Reached,
    RepeatStaging,
    WriteDone,
    WriteEnded,
    WriteJob,
)
from transfer_engine.runtime.ports import RoomBoard
from transfer_engine.transport.interface import WriteSpec

from .plan import staged_slots

Made = tuple[int, WriteSpec]
"""A WRITE made ahead and not started: its transport handle and what it moves."""


def seal_of(spec: WriteSpec) -> Seal | None:
    """The integrity seal of ``spec`` (:meth:`Sealer.sealed`), if it has one."""
    return spec.seal if isinstance(spec.seal, Seal) else None


def seal_ready(made: Made) -> bool:
    """Whether ``made`` may start without waiting for its checksum: none to take, or known."""
    seal = seal_of(made[1])
    return seal is None or seal.ready


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

Done = Callable[[WriteJob, bool, str, FailureReason], Awaitable[None]]
"""The worker's own reply to a job (:func:`answer` bound to the room board)."""


async def answer(rooms: RoomBoard, job: WriteJob, ok: bool, detail: str, reason: FailureReason) -> None:
    """The one reply for ``job`` that does not come from the poller: a ``WriteDone`` to its room."""
    await rooms.deliver(
        job.room, WriteDone(job.chunk_id, job.decode_rank, ok, detail, reason, job.key.layers)
    )


class Starter(Protocol):
    """Starts a WRITE made ahead for a held job: the direct part implements it, the held part is
    handed it with each job it holds (:meth:`~.held.HeldJobs.hold`) and calls it from the completion
    waiter's callback on the loop."""

    def start_made(self, job: WriteJob, made: Made) -> None:
        """Start ``job``'s WRITE ``made`` now (a room gone: dropped). Raises TransferError."""
        ...

    def is_relaxed(self, job: WriteJob) -> bool:
        """Whether nobody waits for the end of ``job``'s WRITE yet."""
        ...


class OwnInbox:
    """The worker's own mailbox as its parts see it: the reply address of the WRITEs the worker
    tracks itself (staged WRITEs, and WRITEs nobody waits for at shutdown), and its wake-up: one
    :class:`Reached` at most queued, posted by completion callbacks when the worker's task has to
    look (held jobs ready, a start to answer, a parked chunk's KV written)."""

    def __init__(self, mailbox: Mailbox[WorkerMail]) -> None:
        self.mailbox = mailbox
        self._reached_posted = False
        """A :class:`Reached` is in the mailbox (one at most)."""

    @property
    def closed(self) -> bool:
        """The worker ended: nobody will read what is posted here."""
        return self.mailbox.closed

    def post(self, mail: WorkerMail) -> None:
        """Post ``mail`` to the worker (never waits)."""
        self.mailbox.post(mail)

    def wake(self) -> None:
        """Queue one :class:`Reached` (none if one is queued already)."""
        if not self._reached_posted:
            self._reached_posted = True
            self.mailbox.post(Reached())

    def woken(self) -> None:
        """The queued :class:`Reached` was taken from the mailbox: the next wake-up posts another."""
        self._reached_posted = False


class Sealer:
    """Seals a chunk's WRITE with the checksum of the KV it reads (docs/INTEGRITY.md), when
    integrity is on (``checksums`` set: ``EngineConfig.integrity``)."""

    def __init__(self, pool: KVPool, checksums: PoolChecksums | None) -> None:
        self.pool = pool
        self.checksums = checksums
        """Integrity on: what a chunk's WRITE is sealed with (:meth:`sealed`)."""

    def sealed(self, job: WriteJob, spec: WriteSpec) -> WriteSpec:
        """``spec`` sealed with the checksum of the KV its chunk (or layer group) reads from this
        rank's pages (docs/INTEGRITY.md): the prefill side of integrity, on every path. The sum is
        started once the bytes are final and the WRITE starts once it is known (:func:`seal_of`):
        after the gather on a staged path, as a held WRITE's last wait on a direct one. ``spec``
        itself with integrity off, or for the aux item."""
        if self.checksums is None or job.chunk is None:
            return spec
        head = job.request.slices[0] if job.request.slices else None
        heads = int(self.pool.kv_views[0].shape[-2])
        start, count = (head.src_head_start, head.num_heads) if head else (0, heads)
        layers = None if job.group is None else job.group.layers
        part = (staged_slots(job, self.pool), start, count, layers)
        seal = Seal(
            spec.notif,
            functools.partial(self.checksums.chunk, *part),
            functools.partial(self.checksums.enqueue, *part),
        )
        return dataclasses.replace(spec, seal=seal)
