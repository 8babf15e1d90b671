"""The room actors' common part: a mailbox loop that applies mail, judges the deadline and ends the room."""

from __future__ import annotations

import asyncio
import logging
import time

import anyio

from transfer_engine.errors import FailureReason, ProtocolError, TransferFailed, failure_error
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.rooms import Room, RoomStatus
from transfer_engine.runtime.mail import Drained, LeaseRenewed, Mailbox, RoomMail, WriteDone, WriteEnded
from transfer_engine.runtime.ports import ROOM_MAILBOX, ROOM_RESERVE, RoomPorts

log = logging.getLogger("transfer_engine.room")

TAKEN_NOW: frozenset[type] = frozenset({m.TransferRequest, m.ChunkLanded, m.AuxLanded, WriteEnded, WriteDone})
"""The mail a waiting room applies in the sender's call (:meth:`RoomActor._take`): what moves a room
along its latency path (a request in, a WRITE started, its end, the notification of its landing).
The rest (the user's chunks, replies of the ring and the scatter actor, timers) is queued as ever."""


class RoomActor:
    """What both sides' room actors share: the mailbox loop, the deadline, the end (see the package
    docstring). ``core`` is the room's state machine; ``side`` is "prefill" or "decode"."""

    core: Room
    side: str

    def __init__(self, ports: RoomPorts, room: int) -> None:
        self.ports = ports
        self.room = room
        self.inbox: Mailbox[RoomMail] = Mailbox(ROOM_MAILBOX, ROOM_RESERVE)
        self.inbox.taker = self._take
        self.done = anyio.Event()
        self.status_changed = anyio.Event()
        """Set when a mail changed the room's status, or the room ended; replaced by a fresh one
        after each change (a waiter looks at ``status`` again and waits on the new one)."""
        self.created = time.monotonic()
        self._drain_asked = False
        self._waiting = False
        """The room's task waits on its empty mailbox: mail sent now may be applied in the sender's call."""
        self._ended = False
        self._timer: asyncio.TimerHandle | None = None
        self._armed: float | None = None
        self._wake: float | None = None
        self._deadline: float | None = None

    @property
    def status(self) -> RoomStatus:
        return self.core.status

    def error(self) -> TransferFailed | None:
        failure = self.core.failure
        return None if failure is None else failure_error(self.room, failure.reason, failure.detail)

    def _fail(self, reason: FailureReason, detail: str) -> bool:
        if self.core.fail(reason, detail, time.monotonic()):
            log.info("%s room %d failed: %s: %s", self.side, self.room, reason.name, detail)
            return True
        return False

    def handle(self, mail: RoomMail) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """Runs once, when the room is final and quiescent, before it leaves the engine."""

    async def started(self) -> None:
        """Runs once, when the room's task starts, before it reads its mailbox."""

    def repeat_at(self) -> float | None:
        """When the room next repeats an unanswered message (:mod:`~transfer_engine.protocol.retransmit`)."""
        return None

    def repeat(self, now: float) -> None:
        """Repeat the unanswered messages (called once ``repeat_at`` has passed)."""

    async def run(self) -> None:
        """The room's life: mailbox loop until final and quiescent, then cleanup (always).

        A room waits on nothing but its own mailbox. At its deadline it asks the poller for a
        :class:`Drained` reply and keeps reading mail; the deadline is judged when the reply comes,
        after every notification that had arrived was applied. The deadline moves with the room's
        progress and its lease (``Deadlines.due``): the engine mails a waiting room
        :class:`LeaseRenewed` as its peer's heartbeats list it, and the timer is armed afresh.

        While the task waits on an empty mailbox, mail that another actor ``send``s is applied in
        that actor's call (:meth:`_take`): the same checks and transitions, one loop turn sooner;
        a room that ends so ends there too (docs/DECISIONS.md, "A room applies mail in the
        sender's call when it waits").
        """
        log.debug("%s room %d: %s", self.side, self.room, self.core.status.name)
        try:
            await self.started()
            while not (self.core.status.final and self.core.quiescent):
                self._arm()
                self._waiting = True
                try:
                    mail = await self.inbox.next()
                except anyio.EndOfStream:  # closed as the room ended in a sender's call (_take)
                    return
                finally:
                    self._waiting = False
                if mail is not None:
                    self._apply(mail)
                    continue
                self._armed = None  # the timer fired (or a stale one did): the next turn arms it afresh
                now = time.monotonic()
                wake, deadline = self._wake, self._deadline
                if wake is not None and now < wake:
                    continue  # early (the loop's clock) or stale: wait for the rest
                repeat_at = self.repeat_at()
                if repeat_at is not None and now >= repeat_at:
                    self.repeat(now)
                if deadline is not None and now >= deadline:
                    self._drain_asked = True
                    self.ports.drain.request_drain(self.room)
            self._close_inbox()
        finally:
            if not self._ended:
                self._end()

    def _arm(self) -> None:
        """Arm the one timer that nudges the inbox at the room's next wake (its deadline, or its
        next repeat); re-armed only when that time moved."""
        deadline = None if self._drain_asked else self.core.deadline
        wakes = [t for t in (deadline, self.repeat_at()) if t is not None]
        wake = min(wakes) if wakes else None
        self._wake, self._deadline = wake, deadline
        if wake != self._armed:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = (
                None
                if wake is None
                else asyncio.get_running_loop().call_later(wake - time.monotonic(), self.inbox.nudge)
            )
            self._armed = wake

    def _take(self, mail: RoomMail) -> bool:
        """The mailbox's taker: apply ``mail`` (one of :data:`TAKEN_NOW`) now, in the sender's call, if
        the room's task waits on its empty mailbox (False: queue it). A room that becomes final and
        quiescent ends here."""
        if not self._waiting or type(mail) not in TAKEN_NOW:
            return False
        self._waiting = False  # mail sent to this room while it applies this one is queued
        try:
            self._apply(mail)
            if self.core.status.final and self.core.quiescent:
                self._close_inbox()
                self._end()
            else:
                self._arm()
        finally:
            self._waiting = not self._ended
        return True

    def _close_inbox(self) -> None:
        # Mail sent from now on finds the room gone, and the engine answers it (an Abort gets
        # its AbortAck there); mail already queued is still applied, so no Abort is lost.
        self.inbox.close()
        while True:
            try:
                mail = self.inbox.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream):
                break
            self._apply(mail)

    def _end(self) -> None:
        """Once: the room leaves the engine (its cleanup, the board, ``done``)."""
        self._ended = True
        self._waiting = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        try:
            self.finish()
        finally:
            self.inbox.close()
            self.ports.rooms.close(self.room, self.inbox)
            self.done.set()
            self.status_changed.set()
            log.debug("%s room %d ended %s", self.side, self.room, self.core.status.name)

    def _apply(self, mail: RoomMail) -> None:
        before = self.core.status
        self.ports.me.trace.mark_mail("room", mail, self.room)
        try:
            if isinstance(mail, Drained):
                self._drain_asked = False
                now = time.monotonic()
                renewed = self.ports.stall_renewal(now)
                if renewed is not None:  # our loop was held: the peer's heartbeats may be unread yet
                    self.core.hold(renewed)
                failure = self.core.expired(now)
                if failure is not None:
                    self._fail(failure.reason, failure.detail)
            elif isinstance(mail, LeaseRenewed):
                self.core.hold(mail.at)
            else:
                self.handle(mail)
        except ProtocolError as exc:
            self._fail(FailureReason.PROTOCOL, str(exc))
        if self.core.status is not before:
            self.ports.me.trace.mark(self.room, self.core.status.name)
            log.debug("%s room %d: %s -> %s", self.side, self.room, before.name, self.core.status.name)
            changed, self.status_changed = self.status_changed, anyio.Event()
            changed.set()
            self.on_status_change(before)

    def on_status_change(self, before: RoomStatus) -> None:
        """Hook for side effects of a status change (telling peers about a failure, ...)."""
