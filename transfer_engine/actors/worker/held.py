"""Jobs held until the KV they read is written: the worker's one cross-thread state machine.

A job whose KV is still being computed (a layer group whose layers are not written, a chunk whose
``ready`` event has not completed) has its WRITE made now and is held; the worker goes on with its
other jobs. The worker's :class:`~transfer_engine.runtime.completion.CompletionWaiter` thread is the
first to know that the KV is written, and it starts the made WRITE itself
(:meth:`HeldJobs.start_early`, :meth:`HeldJobs.claim_and_start`); the loop's callback, which comes
anyway, adopts it into the poller or answers the job when the start was refused
(:meth:`HeldJobs.settle`; docs/DECISIONS.md, "A held WRITE is started by the completion waiter's
thread").

Who starts a made WRITE is decided once, under its :class:`Held`'s own lock: the waiter's thread (to
start it) or the loop (to start it, when it saw the waits complete first, or to drop it: the room was
cancelled). :meth:`HeldJobs.claim_and_start` is the only method here that runs on the waiter's
thread; it touches nothing of the worker's but its ``Held`` and the poller's thread-safe calls.
"""

from __future__ import annotations

import enum
import functools
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from transfer_engine.errors import FailureReason, TransferError
from transfer_engine.runtime.completion import Completion, CompletionWaiter
from transfer_engine.runtime.mail import Mailbox, Ready, WriteJob
from transfer_engine.runtime.ports import RoomBoard, WritePort
from transfer_engine.runtime.steptrace import StepTrace

from .core import Done, Made, OwnInbox, Starter, seal_of, seal_ready

log = logging.getLogger(__name__)


class Start(enum.Enum):
    """Who starts a held job's made WRITE (:class:`Held`)."""

    HELD = "held"
    """Not started: the first to claim it (the waiter's thread or the loop) starts or drops it."""
    STARTING = "starting"
    """The completion waiter's thread claimed it and is starting it (and, for a layer group,
    looking at it until it ended)."""
    STARTED = "started"
    """The thread started it: the loop adopts it when its callback comes."""
    REFUSED = "refused"
    """The thread's start was refused: the loop answers the job when its callback comes."""
    TAKEN = "taken"
    """The loop claimed it (to start it itself, or to drop it: the room was cancelled)."""


@dataclass(eq=False, slots=True)
class Held:
    """The WRITE made for a held job, claimed once: by the completion waiter's thread, which starts
    it the moment the job's KV is written (:meth:`HeldJobs.start_early`), or by the loop."""

    made: Made
    state: Start = Start.HELD
    refusal: TransferError | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def claim(self, to: Start) -> bool:
        """Move it from HELD to ``to`` (STARTING: the waiter's thread; TAKEN: the loop); False when
        the other one has it already."""
        with self.lock:
            if self.state is not Start.HELD:
                return False
            self.state = to
            return True

    def take(self) -> bool:
        """Claim it for the loop; False when the thread has it (its callback answers for it)."""
        return self.claim(Start.TAKEN)


def is_ready(ready: Ready) -> bool:
    """Whether a layer-wise job's ``ready`` has completed (never blocks)."""
    if ready is None:
        return True
    if isinstance(ready, torch.cuda.Event):
        return bool(ready.query())
    return ready.is_set()


def pending_waits(job: WriteJob) -> list[Completion]:
    """The waits of ``job``'s layer group that have not completed yet."""
    return [w for w in job.waits if w is not None and not is_ready(w)]


def held_ready(job: WriteJob) -> bool:
    """Whether a held job's KV is written: every wait of its layer group, and its chunk's event."""
    return all(is_ready(w) for w in job.waits) and (job.ready is None or is_ready(job.ready))


class HeldJobs:
    """Holds jobs until their KV is written; see the module docstring.

    Given the poller (:class:`~transfer_engine.runtime.ports.WritePort`: its thread-safe starts, its
    adoption of a started WRITE), the room board (where a started WRITE's end is reported), the
    worker's own inbox (its wake-up), its completion waiter, and the worker's reply to a job."""

    def __init__(
        self,
        index: int,
        poller: WritePort,
        rooms: RoomBoard,
        inbox: OwnInbox,
        completions: CompletionWaiter,
        done: Done,
        *,
        trace: StepTrace,
        counters: dict[str, int],
        early_drive: float = 0.0,
    ) -> None:
        self.index = index
        self.poller = poller
        self.rooms = rooms
        self.inbox = inbox
        self.completions = completions
        self.done = done
        self.trace = trace
        self.counters = counters
        self.early_drive = early_drive
        """``EngineConfig.early_drive``: how long the waiter's thread looks at the WRITE of a layer group
        that closes its chunk, after starting it."""
        self._unready: list[WriteJob] = []
        """Held jobs whose ``waits`` (or ``ready``) have not all completed, in arrival order."""
        self._failed_starts: list[tuple[WriteJob, str]] = []
        """Held jobs whose start from the waiter's callback failed: answered by the next Reached."""
        self._prepared: dict[int, tuple[Held, Starter]] = {}
        """id(job) -> its WRITE, made and not started by the loop, and what starts it, for the held
        direct jobs in ``_unready`` (an entry leaves with its job, so an id is never a stale one)."""

    @property
    def held_jobs(self) -> int:
        """Jobs held until their KV is written (0 when idle)."""
        return len(self._unready)

    def stuck(self) -> tuple[int, int, int]:
        """``(held, made, failed starts)``: what this part holds, for a diagnosis of a room that did
        not end (``tools/bench_layerwise.py``)."""
        return len(self._unready), len(self._prepared), len(self._failed_starts)

    def hold(
        self,
        job: WriteJob,
        pending: Sequence[Completion],
        made: Made | None = None,
        starter: Starter | None = None,
    ) -> None:
        """Hold ``job`` until every wait in ``pending`` completed. A direct (or slice) job comes with
        its WRITE ``made`` and the ``starter`` that made it: the completion waiter's thread starts it
        (:meth:`start_early`; or its callback, :meth:`on_reached`, through ``starter``, when the loop
        saw them complete first). A staged layer group comes with neither: :meth:`take_ready` hands
        it back once its KV is written."""
        first = None
        if made is not None:
            assert starter is not None
            pending = [*pending, *self.start_seal(made, pending)]
            held = Held(made)
            self._prepared[id(job)] = (held, starter)
            first = functools.partial(self.start_early, job, held)
        self._unready.append(job)
        # Every wait found pending gets its callback, even one that completed since (while the WRITE
        # was made, or just now on the GPU): notify() then calls back at once. Looking again here and
        # skipping those would hold the job with nothing left to wake it (a room that never ended).
        for wait in pending:
            self.completions.notify(wait, functools.partial(self.on_reached, job), first, owner=job)

    def start_seal(self, made: Made, after: Sequence[Completion]) -> list[Completion]:
        """Start the checksum ``made``'s notification carries (integrity), once every completion of
        ``after`` has (the KV it reads is written then): the WRITE is held until it is known too
        (docs/INTEGRITY.md). Returns what to wait for: the sum's completion, or nothing (no seal, or
        one started already). A CUDA pool's KV ordered by a ``threading.Event`` not set yet cannot
        be summed ahead: its seal is taken as the WRITE starts, on the starting thread."""
        seal = seal_of(made[1])
        if seal is None or seal.sum is not None:
            return []
        try:
            return [seal.start(after=after).done]
        except ValueError:
            self.counters["seals_at_start"] += 1
            return []

    def on_reached(self, job: WriteJob) -> None:
        """On the loop, from the completion waiter: a wait of the held ``job`` completed.

        A job whose WRITE the waiter's thread started (:meth:`start_early`) is adopted here, or
        answered if its start was refused. A job whose WRITE was made ahead and whose waits have all
        completed is started here and now by its :class:`~.core.Starter`, without a mail hop through
        the inbox; any other job is left to the :class:`Reached` mail, as is a start that failed (its
        answer needs the worker's task)."""
        self.trace.mark(job.room, "reached")
        if self.inbox.closed:  # the worker ended, nobody waits
            return
        entry = self._prepared.get(id(job))
        if entry is not None:
            held, starter = entry
            if held.state in (Start.STARTED, Start.REFUSED):
                self.unhold(job)
                # A room with a job out never ends; only at shutdown is it gone, and then the poller's
                # reply goes nowhere: the worker's own inbox, closed (the poller drops it).
                room = self.rooms.get(job.room)
                reply_to = room if room is not None else self.inbox.mailbox
                refusal = self.settle(held, reply_to, job.key, starter.is_relaxed(job))
                if refusal is None:
                    return
                log.warning("worker %d: room %d: %s", self.index, job.room, refusal)
                self._failed_starts.append((job, str(refusal)))
            elif held_ready(job) and seal_ready(held.made) and held.take():
                self.unhold(job)
                self.trace.mark(job.room, "started")
                try:
                    starter.start_made(job, held.made)
                    return
                except Exception as exc:  # a callback must not lose a job: the Reached mail answers it
                    log.warning("worker %d: room %d: %s", self.index, job.room, exc)
                    self._failed_starts.append((job, f"{type(exc).__name__}: {exc}"))
        self.inbox.wake()

    def unhold(self, job: WriteJob) -> None:
        """``job`` is held no more (its WRITE was claimed)."""
        self._unready = [j for j in self._unready if j is not job]
        del self._prepared[id(job)]

    def start_early(self, job: WriteJob, held: Held) -> None:
        """On the completion waiter's thread, as a wait of held ``job`` completes: if every wait has,
        start its made WRITE now (:meth:`claim_and_start`); the loop adopts it in :meth:`on_reached`."""
        self.trace.mark(job.room, "woken")  # back from the wait, the GIL held again
        if held_ready(job) and seal_ready(held.made):
            # the group that closes its chunk is small: its bytes land within a fraction of a
            # millisecond, and the decode hears of them sooner if this thread looks until they have
            # (``early_drive``). Earlier groups are left to the poller: their notifications are not
            # the room's last, and a thread still looking at one wakes late for the next.
            closes = job.group is not None and job.group.closes
            self.claim_and_start(job.room, held, self.early_drive if closes else 0.0)

    def claim_and_start(self, room: int, held: Held, drive: float = 0.0) -> None:
        """On the completion waiter's thread: claim ``held``'s WRITE and start it, without waiting for
        the loop's turn, then look at it until it ended, for ``drive`` seconds at most
        (:meth:`~transfer_engine.runtime.ports.WritePort.drive`). Touches nothing of the worker's but ``held``
        and the poller's thread-safe calls (docs/DECISIONS.md, "A held WRITE is started by the
        completion waiter's thread")."""
        if not held.claim(Start.STARTING):
            return
        self.trace.mark(room, "started")
        try:
            at = self.poller.start_early(held.made[0])
        except TransferError as exc:
            with held.lock:
                held.refusal, held.state = exc, Start.REFUSED
            return
        if at is not None and self.trace.enabled:
            self.trace.mark_at(room, "locked", at[0])
            self.trace.mark_at(room, "transfer_cpu", at[0] + at[2])  # the lock + the call's CPU time
            self.trace.mark_at(room, "transferred", at[1])
        self.trace.mark(room, "posted")
        # still STARTING while it looks: the loop adopts it (and its poller may release it) only after
        if drive > 0 and self.poller.drive(held.made[0], drive):
            self.trace.mark(room, "driven")
        with held.lock:
            held.state = Start.STARTED

    def let_go(self, held: Held) -> None:
        """At the worker's end (its waiter thread joined): release ``held``'s WRITE, or, when the
        thread started it and the loop never adopted it, hand it to the poller to end."""
        if held.state is Start.STARTED:  # its reply goes to this worker's closed inbox: dropped
            self.poller.adopt(held.made[0], held.made[1], self.inbox.mailbox, None)
        elif held.state is not Start.REFUSED:  # (a refused start's handle is gone already)
            self.poller.discard(held.made[0])

    def settle(
        self, held: Held, reply_to: Mailbox[Any], token: object, relaxed: bool = False
    ) -> TransferError | None:
        """On the loop, for a WRITE the waiter's thread has finished with (STARTED or REFUSED): hand
        it to the poller, which sends ``WriteEnded(token, ...)`` to ``reply_to`` once it ends, or
        count its refusal and return it for the caller to answer."""
        if held.refusal is not None:
            self.poller.refused(held.refusal)
            return held.refusal
        self.counters["early_starts"] += 1
        self.poller.adopt(*held.made, reply_to, token, relaxed=relaxed)
        return None

    def _sealed(self, job: WriteJob) -> bool:
        """Whether held ``job``'s WRITE (if one was made) has its checksum known, or none to take."""
        entry = self._prepared.get(id(job))
        return entry is None or seal_ready(entry[0].made)

    def claim_held(self, job: WriteJob) -> bool:
        """Claim held ``job``'s made WRITE for the loop (True for a job with none made)."""
        entry = self._prepared.get(id(job))
        return entry is None or entry[0].take()

    def take_ready(self) -> list[tuple[WriteJob, Made | None]]:
        """Claim every held job whose KV is written, in arrival order, with the WRITE made for it (None
        for a staged job). A job whose WRITE the waiter's thread claimed is left to its callback
        (:meth:`on_reached`)."""
        done = [held_ready(job) and self._sealed(job) and self.claim_held(job) for job in self._unready]
        ready = [job for job, ok in zip(self._unready, done, strict=True) if ok]
        if not ready:
            return []
        self._unready = [job for job, ok in zip(self._unready, done, strict=True) if not ok]
        taken: list[tuple[WriteJob, Made | None]] = []
        for job in ready:
            self.trace.mark(job.room, "started")
            entry = self._prepared.pop(id(job), None)
            taken.append((job, entry[0].made if entry is not None else None))
        return taken

    async def answer_failed_starts(self) -> None:
        """Answer the held jobs whose start from the waiter's callback failed (on :class:`Reached`)."""
        failed, self._failed_starts = self._failed_starts, []
        for job, detail in failed:
            await self.done(job, False, detail, FailureReason.TRANSPORT)

    async def cancel(self, room: int) -> None:
        """Answer ``room``'s held jobs as cancelled and drop the WRITEs made for them. A held job whose
        WRITE the waiter's thread claimed stays held: that WRITE is (being) started, and the callback on
        its way adopts it (its WriteEnded answers the job) or answers its refusal."""
        cancelled = [job for job in self._unready if job.room == room and self.claim_held(job)]
        gone = {id(job) for job in cancelled}
        self._unready = [job for job in self._unready if id(job) not in gone]
        for job in cancelled:
            self.completions.forget(job)  # its KV may never be written: the waiter need not look
            entry = self._prepared.pop(id(job), None)
            if entry is not None:
                seal = seal_of(entry[0].made[1])
                if seal is not None:  # its sum, waiting for KV never written, frees the checksum thread
                    seal.cancel()
                self.poller.discard(entry[0].made[0])
            await self.done(job, False, "cancelled while its KV was not written", FailureReason.ABORTED)

    def let_go_all(self) -> None:
        """At the worker's end, its waiter thread joined: let go of the WRITEs of the jobs still held."""
        for held, _ in self._prepared.values():
            self.let_go(held)
        self._prepared.clear()
