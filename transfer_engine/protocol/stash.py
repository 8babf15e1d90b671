"""Requests that reach a prefill rank before ``sender(room)``: kept, replayed, or answered.

A decode rank may ask for a room before the prefill application opens it (a long prefill queue is
normal). Its ``TransferRequest`` is kept here per room and handed to the room when ``sender()``
opens it. Two things end a stash early, and both owe the asking decode ranks an answer, which
these pure functions compute (the engine sends them):

- an ``Abort`` of the room from one decode rank: every *other* decode rank that asked is told
  ``RoomFailed`` (ABORTED, or STAGING when the ring refused), since the room can no longer complete;
- its lease: every decode rank that asked renews its request while it holds the room live (its
  heartbeat lists the room, or it repeats the request); a room none of whose askers renewed it for
  ``room_lease`` is dropped and every decode rank that asked is told ``RoomFailed(BOOTSTRAP_TIMEOUT)``.
  A request queued for minutes behind others on a live prefill therefore waits; one whose decode
  went away (its room ended, its process died) is dropped (docs/CONFIGURATION.md, ``room_lease``).
"""

from __future__ import annotations

from collections import defaultdict

from transfer_engine.errors import FailureReason
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.rooms import abort_reason

Answer = tuple[str, m.RoomFailed]
"""(decode agent to tell, the message)."""


class EarlyRequests:
    """TransferRequests kept per room until the room opens, oldest first, each with the last time its
    decode showed that it holds the room live."""

    def __init__(self) -> None:
        self._rooms: dict[int, list[tuple[float, m.TransferRequest]]] = defaultdict(list)

    def __len__(self) -> int:
        return sum(len(items) for items in self._rooms.values())

    def add(self, room: int, request: m.TransferRequest, now: float) -> bool:
        """Keep ``request``; False (nothing new kept) when the same request is already here (a repeat,
        ``protocol.retransmit``): the repeat only renews its lease."""
        items = self._rooms[room]
        for i, (_, held) in enumerate(items):
            if held == request:
                items[i] = (now, held)
                return False
        items.append((now, request))
        return True

    def hold(self, room: int, agent: str, now: float) -> None:
        """Decode ``agent`` holds ``room`` live at ``now`` (its heartbeat lists it): renew its requests."""
        items = self._rooms.get(room)
        if items:
            items[:] = [(now if request.agent == agent else at, request) for at, request in items]

    def forget(self, agent: str) -> list[int]:
        """Decode ``agent`` is dead: drop its requests (nobody to answer); the rooms left with none."""
        emptied = []
        for room, items in list(self._rooms.items()):
            items[:] = [(at, request) for at, request in items if request.agent != agent]
            if not items:
                del self._rooms[room]
                emptied.append(room)
        return emptied

    def held(self, agent: str) -> list[int]:
        """The rooms ``agent`` asked for and waits on here (listed in heartbeats to it)."""
        return [room for room, items in self._rooms.items() if any(r.agent == agent for _, r in items)]

    def rooms(self) -> list[int]:
        """The rooms with requests kept."""
        return list(self._rooms)

    def agents(self, room: int) -> frozenset[str]:
        """The decode agents whose requests for ``room`` are kept."""
        return frozenset(request.agent for _, request in self._rooms.get(room, []))

    def askers(self, room: int) -> dict[int, str]:
        """Decode rank -> the agent whose request for ``room`` is kept as that rank."""
        return {request.decode_rank: request.agent for _, request in self._rooms.get(room, [])}

    def take(self, room: int) -> list[m.TransferRequest]:
        """The room opened: its stashed requests, in arrival order (the stash forgets them)."""
        return [request for _, request in self._rooms.pop(room, [])]

    def stale(self, now: float, lease: float) -> list[int]:
        """Rooms none of whose askers renewed their request within ``lease`` of ``now``."""
        return [
            room for room, items in self._rooms.items() if items and max(at for at, _ in items) < now - lease
        ]

    def abort(self, room: int, abort: m.Abort, *, agent: str, rank: int) -> list[Answer]:
        """``room`` is not open here and a decode rank aborted it: drop its requests, answer the others."""
        why = abort_reason(abort.reason)
        detail = f"aborted by decode {abort.agent} before prefill rank {rank} opened the room: {abort.detail}"
        return [
            (request.agent, m.RoomFailed(room=room, agent=agent, rank=rank, reason=int(why), detail=detail))
            for request in self.take(room)
            if request.agent != abort.agent
        ]

    def expire(self, room: int, *, agent: str, rank: int, lease: float) -> list[Answer]:
        """No sender opened ``room`` and no asker renewed it within ``lease``: drop its requests and
        answer every asker."""
        detail = (
            f"prefill rank {rank} did not open room {room}, and no decode renewed its request within "
            f"room_lease={lease:g} s"
        )
        reason = int(FailureReason.BOOTSTRAP_TIMEOUT)
        return [
            (request.agent, m.RoomFailed(room=room, agent=agent, rank=rank, reason=reason, detail=detail))
            for request in self.take(room)
        ]
