"""The one actor shape shared by the worker, ring and scatter actors.

An actor owns a :class:`~transfer_engine.runtime.mail.Mailbox` (``inbox``), reports ready through
``tg.start`` once its resources exist, and handles its mail one message at a time until the
mailbox is closed and drained. Producers hold the mailbox, never the actor's other state.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import anyio
from anyio.abc import TaskStatus

from transfer_engine.runtime.mail import Mailbox

T = TypeVar("T")


class Actor(Generic[T]):
    """Subclasses implement :meth:`handle`; :meth:`run` is what the supervisor starts."""

    def __init__(self, capacity: int, reserve: int = 0) -> None:
        self.inbox: Mailbox[T] = Mailbox(capacity, reserve)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async for mail in self.inbox:
            await self.handle(mail)

    async def handle(self, mail: T) -> None:
        raise NotImplementedError
