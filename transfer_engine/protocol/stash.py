"""Requests that reach a prefill rank before ``sender(room)``: kept, replayed, or answered.

A decode rank may ask for a room before the prefill application opens it (a long prefill queue is
normal). Its ``TransferRequest`` is kept here per room and handed to the room when ``sender()``
opens it. Two things end a stash early, and both owe the asking decode ranks an answer, which
these pure functions compute (the engine sends them):

- an ``Abort`` of the room from one decode rank: every *other* decode rank that asked is told
  ``RoomFailed`` (ABORTED, or STAGING when the ring refused), since the room can no longer complete;
- age: a stash older than ``bootstrap_timeout`` is dropped and every decode rank that asked is
  told ``RoomFailed(BOOTSTRAP_TIMEOUT)``.
"""

from __future__ import annotations

from collections import defaultdict

from transfer_engine.errors import FailureReason
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.rooms import abort_reason

Answer = tuple[str, m.RoomFailed]
"""(decode agent to tell, the message)."""


class EarlyRequests:
    """TransferRequests kept per room until the room opens; oldest first."""

    def __init__(self) -> None:
        self._rooms: dict[int, list[tuple[float, m.TransferRequest]]] = defaultdict(list)

    def __len__(self) -> int:
        return sum(len(items) for items in self._rooms.values())

    def add(self, room: int, request: m.TransferRequest, now: float) -> bool:
        """Keep ``request``; False (nothing kept) when the same request is already here (a repeat,
        ``protocol.retransmit``), so that its age still counts from the first."""
        items = self._rooms[room]
        if any(held == request for _, held in items):
            return False
        items.append((now, request))
        return True

    def agents(self, room: int) -> frozenset[str]:
        """The decode agents whose requests for ``room`` are kept."""
        return frozenset(request.agent for _, request in self._rooms.get(room, []))

    def take(self, room: int) -> list[m.TransferRequest]:
        """The room opened: its stashed requests, in arrival order (the stash forgets them)."""
        return [request for _, request in self._rooms.pop(room, [])]

    def stale(self, now: float, max_age: float) -> list[int]:
        """Rooms whose oldest request is older than ``max_age``."""
        return [room for room, items in self._rooms.items() if items and items[0][0] < now - max_age]

    def abort(self, room: int, abort: m.Abort, *, agent: str, rank: int) -> list[Answer]:
        """``room`` is not open here and a decode rank aborted it: drop its requests, answer the others."""
        why = abort_reason(abort.reason)
        detail = f"aborted by decode {abort.agent} before prefill rank {rank} opened the room: {abort.detail}"
        return [
            (request.agent, m.RoomFailed(room=room, agent=agent, rank=rank, reason=int(why), detail=detail))
            for request in self.take(room)
            if request.agent != abort.agent
        ]

    def expire(self, room: int, *, agent: str, rank: int, timeout: float) -> list[Answer]:
        """No sender opened ``room`` within ``timeout``: drop its requests and answer every asker."""
        detail = f"prefill rank {rank} did not open room {room} within bootstrap_timeout={timeout} s of the request"
        reason = int(FailureReason.BOOTSTRAP_TIMEOUT)
        return [
            (request.agent, m.RoomFailed(room=room, agent=agent, rank=rank, reason=reason, detail=detail))
            for request in self.take(room)
        ]
