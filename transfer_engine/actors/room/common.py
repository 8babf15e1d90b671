"""The room actors' common part: a mailbox loop that applies mail, judges the deadline and ends the room."""

from __future__ import annotations

import asyncio
import logging
import time

import anyio

from transfer_engine.errors import FailureReason, ProtocolError, TransferFailed, failure_error
from transfer_engine.protocol.rooms import Room, RoomStatus
from transfer_engine.runtime.mail import Drained, LeaseRenewed, Mailbox, RoomMail
from transfer_engine.runtime.ports import ROOM_MAILBOX, ROOM_RESERVE, RoomPorts

log = logging.getLogger("transfer_engine.room")


class RoomActor:
    """What both sides' room actors share: the mailbox loop, the deadline, the end (see the package
    docstring). ``core`` is the room's state machine; ``side`` is "prefill" or "decode"."""

    core: Room
    side: str

    def __init__(self, ports: RoomPorts, room: int) -> None:
        self.ports = ports
        self.room = room
        self.inbox: Mailbox[RoomMail] = Mailbox(ROOM_MAILBOX, ROOM_RESERVE)
        self.done = anyio.Event()
        self.status_changed = anyio.Event()
        """Set when a mail changed the room's status, or the room ended; replaced by a fresh one
        after each change (a waiter looks at ``status`` again and waits on the new one)."""
        self.created = time.monotonic()
        self._drain_asked = False

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

    async def handle(self, mail: RoomMail) -> None:
        raise NotImplementedError

    async def finish(self) -> None:
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
        """
        log.debug("%s room %d: %s", self.side, self.room, self.core.status.name)
        loop = asyncio.get_running_loop()
        timer: asyncio.TimerHandle | None = None
        armed: float | None = None
        try:
            await self.started()
            while not (self.core.status.final and self.core.quiescent):
                deadline = None if self._drain_asked else self.core.deadline
                wakes = [t for t in (deadline, self.repeat_at()) if t is not None]
                wake = min(wakes) if wakes else None
                if wake != armed:  # one timer nudges the inbox at the next wake, re-armed only when it moves
                    if timer is not None:
                        timer.cancel()
                    timer = (
                        None if wake is None else loop.call_later(wake - time.monotonic(), self.inbox.nudge)
                    )
                    armed = wake
                mail = await self.inbox.next()
                if mail is not None:
                    await self._apply(mail)
                    continue
                armed = None  # the timer fired (or a stale one did): the next turn arms it afresh
                now = time.monotonic()
                if wake is not None and now < wake:
                    continue  # early (the loop's clock) or stale: wait for the rest
                repeat_at = self.repeat_at()
                if repeat_at is not None and now >= repeat_at:
                    self.repeat(now)
                if deadline is not None and now >= deadline:
                    self._drain_asked = True
                    self.ports.drain.request_drain(self.room)
            # Mail sent from now on finds the room gone, and the engine answers it (an Abort gets
            # its AbortAck there); mail already queued is still applied, so no Abort is lost.
            self.inbox.close()
            while True:
                try:
                    mail = self.inbox.receive_nowait()
                except (anyio.WouldBlock, anyio.EndOfStream):
                    break
                await self._apply(mail)
        finally:
            if timer is not None:
                timer.cancel()
            with anyio.CancelScope(shield=True):
                await self.finish()
                self.inbox.close()
                self.ports.rooms.close(self.room, self.inbox)
                self.done.set()
                self.status_changed.set()
            log.debug("%s room %d ended %s", self.side, self.room, self.core.status.name)

    async def _apply(self, mail: RoomMail) -> None:
        before = self.core.status
        self.ports.me.trace.mark_mail("room", mail, self.room)
        try:
            if isinstance(mail, Drained):
                self._drain_asked = False
                failure = self.core.expired(time.monotonic())
                if failure is not None:
                    self._fail(failure.reason, failure.detail)
            elif isinstance(mail, LeaseRenewed):
                self.core.hold(mail.at)
            else:
                await self.handle(mail)
        except ProtocolError as exc:
            self._fail(FailureReason.PROTOCOL, str(exc))
        if self.core.status is not before:
            self.ports.me.trace.mark(self.room, self.core.status.name)
            log.debug("%s room %d: %s -> %s", self.side, self.room, before.name, self.core.status.name)
            changed, self.status_changed = self.status_changed, anyio.Event()
            changed.set()
            await self.on_status_change(before)

    async def on_status_change(self, before: RoomStatus) -> None:
        """Hook for side effects of a status change (telling peers about a failure, ...)."""
