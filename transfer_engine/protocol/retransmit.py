"""Lost control messages: who repeats what until it is answered, and how repeats are answered.

Control messages travel over ZMQ, which can lose them (a full queue, a reconnect, a peer that
restarts). The protocol must not wait for a message that will never come. The rule is that **the
decode room is the one that repeats**, because it is the side whose pages are at stake:

- while it is not final, each decode room repeats its ``TransferRequest`` to every prefill rank of
  the room (a lost request, or a lost ``RoomFailed``: a prefill room that failed answers a repeat
  with its failure);
- once it failed, it repeats its ``Abort`` to every writer that has not acknowledged it (a lost
  ``Abort`` or a lost ``AbortAck``). Its pages are released only when every writer acknowledged or
  was declared dead, as before.

Repeats back off from :data:`REPEAT_BASE_S` to :data:`REPEAT_CAP_S` (:class:`Backoff`), so a room that waits a long
time for its prefill costs a handful of small messages. The prefill answers every repeat as if it
were the first (:func:`answer_request`, :func:`answer_late_request`): a room that failed says so
again, a duplicate of a request it already holds changes nothing, and a room that ended is
remembered for a while (:class:`Tombstones`) so that a late repeat is answered with the room's real
outcome instead of being taken for a room not opened yet. Aborts were already idempotent: a live
room records who to acknowledge, and a room that is not live is acknowledged at once.

Losses nobody can repeat for end at a deadline: a lost NIXL notification (the prefill saw its
WRITE complete; the decode room fails at ``transfer_timeout``), lost staging messages (both sides
fail at ``transfer_timeout``). Everything here is pure: no clock (``now`` is an argument), no I/O.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

from transfer_engine.errors import FailureReason
from transfer_engine.protocol.rooms import RoomStatus

__all__ = [
    "REPEAT_BASE_S",
    "REPEAT_CAP_S",
    "Backoff",
    "Ended",
    "Late",
    "Repeat",
    "RequestAnswer",
    "Tombstones",
    "answer_late_request",
    "answer_request",
    "decode_repeat",
]


REPEAT_BASE_S = 0.5
"""A decode room's first repeat comes this long after the message it repeats (half the default
heartbeat interval: a room that waits that long for a prefill rank is rare in itself)."""
REPEAT_CAP_S = 4.0
"""Repeats back off up to this interval."""


class Repeat(enum.Enum):
    """What a decode room repeats when its repeat timer fires."""

    NOTHING = "nothing"
    REQUESTS = "requests"
    """Its TransferRequest, to every prefill rank of the room."""
    ABORTS = "aborts"
    """Its Abort, to the writers whose AbortAck it still waits for."""


def decode_repeat(status: RoomStatus, aborting: bool, awaiting_acks: frozenset[int] | set[int]) -> Repeat:
    """What a decode room in ``status`` repeats: requests until final, then aborts until acknowledged."""
    if not status.final:
        return Repeat.REQUESTS
    if status is RoomStatus.FAILED and aborting and awaiting_acks:
        return Repeat.ABORTS
    return Repeat.NOTHING


@dataclass
class Backoff:
    """When to repeat next: ``base`` seconds after the first send, doubling up to ``cap``.

    :meth:`reset` restarts from ``base`` (the room moved on to a new kind of repeat).
    """

    base: float
    cap: float
    next_at: float
    _step: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.base <= self.cap:
            raise ValueError(f"base={self.base}, cap={self.cap}: need 0 < base <= cap")
        self._step = self.base

    @classmethod
    def start(cls, base: float, cap: float, now: float) -> Backoff:
        return cls(base, cap, now + base)

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def sent(self, now: float) -> None:
        """A repeat went out at ``now``: the next one waits twice as long (at most ``cap``)."""
        self._step = min(self._step * 2, self.cap)
        self.next_at = now + self._step

    def reset(self, now: float) -> None:
        self._step = self.base
        self.next_at = now + self.base


class RequestAnswer(enum.Enum):
    """How a live prefill room answers a TransferRequest."""

    ACCEPT = "accept"
    """The first request of this decode rank: take it."""
    DUPLICATE = "duplicate"
    """The same request again (a repeat): nothing changes."""
    TELL_FAILURE = "tell_failure"
    """The room failed and this decode rank may not know: send it RoomFailed (again)."""
    IGNORE = "ignore"
    """The room is final and this decode rank knows why (it failed or aborted the room itself), or
    the room succeeded (a success needs this rank's request: this is a repeat of it)."""
    CONFLICT = "conflict"
    """A second, different request from the same decode rank: a protocol error."""


def answer_request(status: RoomStatus, held_is_same: bool | None, told_us: bool) -> RequestAnswer:
    """The answer of a live prefill room in ``status`` to a TransferRequest from one decode rank.

    ``held_is_same``: None when the room holds no request of that decode rank yet, else whether the
    one it holds equals this one. ``told_us``: that decode rank aborted or failed the room itself.
    """
    if status is RoomStatus.FAILED:
        return RequestAnswer.IGNORE if told_us else RequestAnswer.TELL_FAILURE
    if held_is_same is None:
        return RequestAnswer.IGNORE if status.final else RequestAnswer.ACCEPT
    return RequestAnswer.DUPLICATE if held_is_same else RequestAnswer.CONFLICT


@dataclass(frozen=True, slots=True)
class Ended:
    """What a prefill rank remembers of a room that is no longer live on it."""

    status: RoomStatus
    reason: FailureReason | None
    detail: str
    at: float
    opened: bool = True
    """False for a room aborted by a decode rank before this rank opened it."""
    aborted_by: frozenset[str] = frozenset()
    """Decode agents that aborted or failed the room themselves (they need not be told)."""
    askers: Mapping[int, str] = field(default_factory=dict)
    """Decode rank -> the decode agent that asked for this room as that rank. A request from another
    agent for a rank already asked for is for a new room under the same id (a decode process that
    replaced a dead one); a request for a rank nobody asked for yet is a late one for this room (with
    decode TP > 1, the room may end before every rank's request arrived)."""


class Late(enum.Enum):
    """How a prefill rank answers a TransferRequest for a room that is not live on it."""

    STASH = "stash"
    """Unknown room: keep the request for a ``sender()`` to come (until ``bootstrap_timeout``)."""
    TELL_FAILURE = "tell_failure"
    """The room failed here: say so (again)."""
    DROP = "drop"
    """A repeat for a room that succeeded, or from the decode rank that aborted it: nothing to say."""


def answer_late_request(ended: Ended | None, agent: str, rank: int) -> Late:
    """The answer to a TransferRequest from ``agent``, decode rank ``rank``, for a room not live here
    (``ended``: its tombstone)."""
    if ended is None:
        return Late.STASH
    asked = ended.askers.get(rank)
    if asked is not None and asked != agent and agent not in ended.aborted_by:
        # Another agent asked as this rank before the room ended: this request is for a new room
        # under the same id (a decode process that replaced a dead one, say), not a late one.
        return Late.STASH
    if ended.status is RoomStatus.SUCCESS or agent in ended.aborted_by:
        return Late.DROP
    return Late.TELL_FAILURE


class Tombstones:
    """The outcomes of rooms that ended here, for ``keep_s`` seconds and at most ``limit`` rooms.

    Bounded both ways, so a flood of rooms cannot grow it. A tombstone of a room that this rank
    opened and ended is replaced when ``sender()`` opens the same id again (:meth:`reopen`); one of
    a room aborted before it was opened is kept, so that a request overtaken by its own Abort can
    never start WRITEs into pages the decode rank has already released.
    """

    def __init__(self, keep_s: float, limit: int = 65_536) -> None:
        if keep_s <= 0 or limit < 1:
            raise ValueError(f"keep_s={keep_s}, limit={limit}: both must be > 0")
        self.keep_s = keep_s
        self.limit = limit
        self._ended: OrderedDict[int, Ended] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ended)

    def put(self, room: int, ended: Ended) -> None:
        """Remember ``room``'s outcome (the oldest tombstone goes when over ``limit``)."""
        self._ended.pop(room, None)
        self._ended[room] = ended
        while len(self._ended) > self.limit:
            self._ended.popitem(last=False)

    def get(self, room: int, now: float) -> Ended | None:
        """``room``'s tombstone if it is younger than ``keep_s`` at ``now``."""
        self.expire(now)
        return self._ended.get(room)

    def reopen(self, room: int) -> bool:
        """``sender(room)`` opens the id again: forget an ended room's tombstone. False (kept) when
        the room was aborted before it was ever opened."""
        ended = self._ended.get(room)
        if ended is None or not ended.opened:
            return ended is None
        del self._ended[room]
        return True

    def expire(self, now: float) -> None:
        """Forget tombstones older than ``keep_s`` (they are in insertion order, oldest first)."""
        while self._ended:
            room, ended = next(iter(self._ended.items()))
            if now - ended.at < self.keep_s:
                break
            del self._ended[room]
