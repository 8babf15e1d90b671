"""The blocking facade's loop side: mail from callers' threads to room actors, in order.

:class:`Mailer` lives on the facade's loop thread (:class:`~transfer_engine.facade.bridge.LoopThread`);
:class:`~transfer_engine.facade.blocking.BlockingEngine` hands it every handle's mail and every task a
caller starts, through :meth:`LoopThread.call_soon`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
from anyio.abc import TaskGroup

from transfer_engine.engine import Receiver, Sender
from transfer_engine.runtime.mail import RoomMail

__all__ = ["Mailer"]


class Mailer:
    """Loop side of the facade: delivers handles' mail to room actors in the order it was posted,
    and starts the tasks callers ask for (a receiver's handshake).

    ``post`` and ``start`` run as plain loop callbacks (:meth:`LoopThread.call_soon`), where no task is
    current, so they start nothing themselves: they queue work and wake :meth:`run`, a task of the
    facade's task group that starts it. Mail goes straight into the room's mailbox when there is
    room and nothing is queued ahead of it; otherwise it waits in a backlog that one task drains in
    order. Mail for a room that has ended is dropped: the room's final status already tells.
    """

    def __init__(self, tg: TaskGroup) -> None:
        self._tg = tg
        self._backlog: deque[tuple[Sender | Receiver, RoomMail]] = deque()
        self._spawns: deque[tuple[Callable[..., Coroutine[Any, Any, None]], tuple[Any, ...]]] = deque()
        self._draining = False
        self._wake = anyio.Event()

    def start(self, fn: Callable[..., Coroutine[Any, Any, None]], *args: Any) -> None:
        """Have ``fn(*args)`` started in the facade's task group (cancelled when the engine closes)."""
        self._spawns.append((fn, args))
        self._wake.set()

    def post(self, handle: Sender | Receiver, mail: RoomMail) -> None:
        if not self._backlog:
            try:
                handle.deliver_nowait(mail)
                return
            except anyio.WouldBlock:
                pass
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                return
        self._backlog.append((handle, mail))
        self._wake.set()

    async def run(self) -> None:
        """Start queued tasks and the backlog's drain, each time a callback queued something."""
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            while self._spawns:
                fn, args = self._spawns.popleft()
                self._tg.start_soon(fn, *args)
            if self._backlog and not self._draining:
                self._draining = True
                self._tg.start_soon(self._drain)

    async def _drain(self) -> None:
        try:
            while self._backlog:
                handle, mail = self._backlog[0]
                try:
                    await handle.deliver(mail)
                except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                    pass
                self._backlog.popleft()
        finally:
            self._draining = False
