"""The room table: one rank's live rooms, and what each leaves behind when it ends."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from transfer_engine.actors.room import RoomActor, SenderRoomActor
from transfer_engine.errors import RoomInUseError, RoomLimitError
from transfer_engine.protocol.cost import CostBook
from transfer_engine.protocol.retransmit import Ended, Tombstones
from transfer_engine.runtime.ports import RoomBoard


class RoomTable:
    """The live rooms of one rank by id (``rooms``) and the board every actor addresses them through.

    The engine opens a room here (:meth:`open`) and starts its actor; the board calls back when the
    room ended (final and quiescent) and left it: the room is then counted, its cost-book entry
    closed, a prefill room's outcome kept in ``tombstones`` (to answer repeated requests), and
    ``ended`` called with its actor (the engine records its final snapshot).
    """

    def __init__(
        self,
        max_rooms: int,
        counters: Counter[str],
        costs: CostBook,
        tombstones: Tombstones,
        ended: Callable[[RoomActor], None],
    ) -> None:
        self.rooms: dict[int, RoomActor] = {}
        self.board = RoomBoard(self._closed)
        """The live rooms' mailboxes: how every actor addresses a room."""
        self._max_rooms = max_rooms
        self._counters = counters
        self._costs = costs
        self._tombstones = tombstones
        self._ended = ended

    def __contains__(self, room: object) -> bool:
        return room in self.rooms

    def __len__(self) -> int:
        return len(self.rooms)

    def check_unused(self, room: int) -> None:
        """RoomInUseError while a room with id ``room`` is live."""
        if room in self.rooms:
            raise RoomInUseError(room)

    def check_capacity(self, room: int) -> None:
        """RoomLimitError while ``max_rooms`` rooms are live (``room``: the one refused)."""
        if len(self.rooms) >= self._max_rooms:
            raise RoomLimitError(room, self._max_rooms)

    def open(self, actor: RoomActor) -> None:
        """Put ``actor``'s room in the table and on the board (its task is started by the caller)."""
        self.rooms[actor.room] = actor
        self.board.open(actor.room, actor.inbox)
        self._counters["rooms_opened"] += 1

    def _closed(self, room: int) -> None:
        """The board's hook: room ``room`` ended (final and quiescent) and left the board."""
        actor = self.rooms.pop(room)
        self._counters[f"rooms_{actor.status.name.lower()}"] += 1
        failure = actor.core.failure
        self._costs.ended(room, time.monotonic(), ok=failure is None)
        if failure is not None:
            self._counters[f"failed_{failure.reason.name.lower()}"] += 1
        if isinstance(actor, SenderRoomActor):
            self._tombstones.put(
                actor.room,
                Ended(actor.status, None if failure is None else failure.reason,
                      "" if failure is None else failure.detail, time.monotonic(),
                      aborted_by=frozenset(actor.failed_by),
                      askers={rank: request.agent for rank, request in actor.requests.items()}),
            )  # fmt: skip
        self._ended(actor)
