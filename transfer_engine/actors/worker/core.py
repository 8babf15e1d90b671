"""The state and the calls every part of a :class:`~transfer_engine.actors.worker.TransferWorker`
shares: its identity and ports, its counters, its completion waiter, and the one reply a job gets
from the worker itself (:meth:`WorkerCore.done`).

The worker is built in layers, one module each, every one adding to the one below: :mod:`.held`
(jobs held until their KV is written, started by the completion waiter's thread: the worker's one
cross-thread state machine), :mod:`.direct` (direct and slice WRITEs), :mod:`.staged` (staged and
host WRITEs through a ring region), :mod:`.layerwise` (layer groups) and :mod:`.actor` (the
mailbox). A layer calls what the layers below it define; the three calls that go the other way
(:mod:`.held` starting what :mod:`.direct` made) are declared here, so that each module reads on
its own.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict

import torch

from transfer_engine.errors import FailureReason
from transfer_engine.memory.integrity import PoolChecksums, Seal
from transfer_engine.memory.layout import KVPool
from transfer_engine.protocol import messages as m
from transfer_engine.runtime.completion import CompletionWaiter
from transfer_engine.runtime.mail import (
    CancelRoom,
    Reached,
    RepeatStaging,
    WriteDone,
    WriteEnded,
    WriteJob,
)
from transfer_engine.runtime.ports import Outbox, RankIdentity, RoomBoard, WritePort
from transfer_engine.transport.interface import WriteSpec

from ..base import Actor
from .plan import staged_slots

Made = tuple[int, WriteSpec]
"""A WRITE made ahead and not started: its transport handle and what it moves."""


def seal_of(spec: WriteSpec) -> Seal | None:
    """The integrity seal of ``spec`` (:meth:`WorkerCore.sealed`), if it has one."""
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


class WorkerCore(Actor["WorkerMail"]):
    """What every part of the worker uses; see the module docstring."""

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
        early_drive: float = 0.0,
        checksums: PoolChecksums | None = None,
    ) -> None:
        super().__init__(capacity, reserve)
        self.checksums = checksums
        """Integrity on: what a chunk's WRITE is sealed with (:meth:`sealed`)."""
        self.index = index
        self.me = me
        self.pool = pool
        self.poller = poller
        self.rooms = rooms
        self.outbox = outbox
        self.staging_bytes = staging_bytes
        """The size of each staging buffer (``EngineConfig.staging_bytes``, resolved)."""
        self.stream = torch.cuda.Stream(pool.device) if pool.device.type == "cuda" else None
        """The stream of this worker's gathers (None on CPU)."""
        self.counters: dict[str, int] = defaultdict(int)
        self.completions = CompletionWaiter(f"worker-{index}")
        """Wakes this worker when its gathers' stream or its jobs' ready events complete."""
        self.early_drive = early_drive
        """``EngineConfig.early_drive``: how long the waiter's thread looks at the WRITE of a layer group
        that closes its chunk, after starting it."""
        self._reached_posted = False
        """A :class:`Reached` is in the inbox (one at most)."""

    @property
    def depth(self) -> int:
        """Mails queued in the inbox."""
        return len(self.inbox)

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

    async def done(self, job: WriteJob, ok: bool, detail: str, reason: FailureReason) -> None:
        """The one reply for ``job`` that does not come from the poller."""
        await self.rooms.deliver(
            job.room, WriteDone(job.chunk_id, job.decode_rank, ok, detail, reason, job.key.layers)
        )

    def post_reached(self) -> None:
        """Queue one :class:`Reached` (none if one is queued already)."""
        if not self._reached_posted:
            self._reached_posted = True
            self.inbox.post(Reached())

    def reached_taken(self) -> None:
        """The queued :class:`Reached` was taken from the inbox: the next wake-up posts another."""
        self._reached_posted = False

    # --- made by DirectPath, called by HeldJobs (see the module docstring) --------------------------

    async def prepare(self, job: WriteJob) -> Made | None:
        """Plan and make a direct (or slice) job's WRITE without starting it; None when it cannot be
        made (the job was answered). Made by :class:`~.direct.DirectPath`."""
        raise NotImplementedError

    def start_made(self, job: WriteJob, made: Made) -> None:
        """Start ``job``'s WRITE made by :meth:`prepare`. Made by :class:`~.direct.DirectPath`."""
        raise NotImplementedError

    def is_relaxed(self, job: WriteJob) -> bool:
        """Whether nobody waits for the end of ``job``'s WRITE yet. Made by :class:`~.direct.DirectPath`."""
        raise NotImplementedError
