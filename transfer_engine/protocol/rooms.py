"""Room state machines: one transition table per side, and the bookkeeping that feeds them.

A room is one request's transfer. Its status moves along

    Bootstrapping -> WaitingForInput -> Transferring -> Success | Failed

driven by events. The tables below are the whole truth about which event may move which state
where; an event with no entry raises :class:`LocalProtocolError` naming both. ``Success`` and
``Failed`` are final. :class:`SenderRoom` and :class:`~transfer_engine.protocol.receiver_room.ReceiverRoom` do the counting (requests, chunks
per sender, aux) and fire the table's events; they take ``now`` as an argument and never read a
clock, so every deadline is data checked by :meth:`expired` — which the actor calls only after it
has applied every notification it had pending.

A failure does not release memory by itself: a WRITE may still be in flight. Each room therefore
knows whether it is *quiescent* (no WRITE of it can still land); the actor frees pages and ring
regions only then. Status becomes ``Failed`` at once (so pollers learn promptly), but
``receiver.abort()`` returns only once the room is quiescent.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from transfer_engine.errors import FailureReason, LocalProtocolError, RemoteProtocolError

__all__ = [
    "RECEIVER_TRANSITIONS",
    "SENDER_TRANSITIONS",
    "Bootstrapped",
    "Chunk",
    "Clocks",
    "Completed",
    "Deadlines",
    "Due",
    "Event",
    "Fail",
    "FailureReason",
    "InputReady",
    "Landed",
    "Room",
    "RoomStatus",
    "SenderRoom",
    "transition",
]


class RoomStatus(enum.IntEnum):
    """A room's status. Values are those of SGLang's ``KVPoll`` so schedulers can compare directly."""

    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4

    @property
    def final(self) -> bool:
        return self in (RoomStatus.SUCCESS, RoomStatus.FAILED)

    def __str__(self) -> str:
        """The name (``WAITING_FOR_INPUT``), as ``print(receiver.poll())`` and log lines show it; the
        value stays an int for comparisons with SGLang's ``KVPoll`` and on the wire."""
        return self.name

    def __format__(self, spec: str) -> str:
        """The name in f-strings too; a numeric format (``{status:d}``) gives the number."""
        if spec and spec[-1] in "bcdeEfFgGnoxX%":
            return int.__format__(self, spec)
        return format(self.name, spec)


# --- events ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Bootstrapped:
    """Sender: every decode rank's TransferRequest arrived. Receiver: its requests went out."""


@dataclass(frozen=True, slots=True)
class InputReady:
    """Sender: the first chunk is queued on a bootstrapped room."""


@dataclass(frozen=True, slots=True)
class Landed:
    """Receiver: a chunk (or the aux) of some writer landed. Sender: a chunk's WRITE finished."""


@dataclass(frozen=True, slots=True)
class Completed:
    """Every chunk of every writer (and the aux, if asked for) is done."""


@dataclass(frozen=True, slots=True)
class Fail:
    """The room fails with a reason and a detail (a timeout, an abort, a dead peer, ...)."""

    reason: FailureReason
    detail: str


Event = Bootstrapped | InputReady | Landed | Completed | Fail

_S = RoomStatus

SENDER_TRANSITIONS: dict[RoomStatus, dict[type, RoomStatus]] = {
    _S.BOOTSTRAPPING: {Bootstrapped: _S.WAITING_FOR_INPUT, Fail: _S.FAILED},
    _S.WAITING_FOR_INPUT: {InputReady: _S.TRANSFERRING, Completed: _S.SUCCESS, Fail: _S.FAILED},
    _S.TRANSFERRING: {Landed: _S.TRANSFERRING, Completed: _S.SUCCESS, Fail: _S.FAILED},
    _S.SUCCESS: {},
    _S.FAILED: {},
}
"""Prefill side. ``Completed`` from WaitingForInput: a rank that writes nothing for this room."""

RECEIVER_TRANSITIONS: dict[RoomStatus, dict[type, RoomStatus]] = {
    _S.BOOTSTRAPPING: {Bootstrapped: _S.WAITING_FOR_INPUT, Fail: _S.FAILED},
    _S.WAITING_FOR_INPUT: {Landed: _S.TRANSFERRING, Fail: _S.FAILED},
    _S.TRANSFERRING: {Landed: _S.TRANSFERRING, Completed: _S.SUCCESS, Fail: _S.FAILED},
    _S.SUCCESS: {},
    _S.FAILED: {},
}
"""Decode side."""


def transition(
    table: dict[RoomStatus, dict[type, RoomStatus]], state: RoomStatus, event: Event
) -> RoomStatus:
    """The next state, or LocalProtocolError naming the state and the event."""
    try:
        return table[state][type(event)]
    except KeyError:
        raise LocalProtocolError(
            f"event {type(event).__name__} is not allowed in state {state.name}"
        ) from None


@dataclass(frozen=True, slots=True)
class Deadlines:
    """How long a room may wait, in seconds; ``None`` disables that bound (docs/CONFIGURATION.md).

    ``bootstrap`` bounds a room that has not reached its peer (from entering Bootstrapping);
    ``waiting`` bounds WaitingForInput from entering it, whatever the peer does; ``transfer`` bounds
    Transferring from the room's *last progress* (a chunk or layer group landed; a WRITE ended), so a
    slow room that keeps moving never times out; ``lease`` bounds a room waiting on its peer from the
    last sign that the peer still holds the room live (its heartbeat listing the room, its request).
    """

    bootstrap: float | None = 30.0
    waiting: float | None = None
    transfer: float | None = 60.0
    lease: float | None = 30.0

    def for_state(self, state: RoomStatus) -> tuple[float | None, FailureReason]:
        """The fixed window of ``state`` and the reason it fails with (the lease aside)."""
        if state is _S.BOOTSTRAPPING:
            return self.bootstrap, FailureReason.BOOTSTRAP_TIMEOUT
        if state is _S.WAITING_FOR_INPUT:
            return self.waiting, FailureReason.INPUT_TIMEOUT
        return self.transfer, FailureReason.TRANSFER_TIMEOUT

    def due(self, state: RoomStatus, clocks: Clocks) -> Due | None:
        """When a room in ``state`` with ``clocks`` times out, and why; None: it cannot (final, or
        every bound of the state disabled). The earliest bound wins.

        ==================  ==========================  =========================================
        state               held_at None                held_at set (the room is leased)
        ==================  ==========================  =========================================
        Bootstrapping       entered + bootstrap         held_at + lease
        WaitingForInput     entered + waiting           min(entered + waiting, held_at + lease)
        Transferring        progress + transfer         progress + transfer
        ==================  ==========================  =========================================
        """
        if state.final:
            return None
        limit, reason = self.for_state(state)
        bounds: list[Due] = []
        if state is _S.TRANSFERRING:
            if limit is not None:
                stuck = f"made no progress for more than {limit} s"
                bounds.append(Due(clocks.progress_at + limit, reason, stuck))
            return min(bounds, default=None)
        lease, held_at = self.lease, clocks.held_at
        leased = lease is not None and held_at is not None
        if limit is not None and not (state is _S.BOOTSTRAPPING and leased):
            bounds.append(Due(clocks.entered_at + limit, reason, f"spent more than {limit} s"))
        if lease is not None and held_at is not None:
            bounds.append(Due(held_at + lease, reason, f"saw no sign of its peer for room_lease={lease:g} s"))
        return min(bounds, default=None)


@dataclass(frozen=True, slots=True)
class Clocks:
    """The times a room's deadline is computed from (monotonic seconds)."""

    entered_at: float
    """When the room entered its current status."""
    progress_at: float
    """The room's last progress: entering its status, or a ``Landed`` since."""
    held_at: float | None = None
    """The last sign that the peer holds the room live; None: the room waits on no peer (unleased)."""


@dataclass(frozen=True, slots=True, order=True)
class Due:
    """A room's next timeout: when, the failure reason, and the bound in words ("room 7 <bound> in
    TRANSFERRING")."""

    at: float
    reason: FailureReason = field(compare=False)
    bound: str = field(compare=False)


@dataclass
class Room:
    """What both sides' rooms share: the status, its history, the failure and the deadlines."""

    room: int
    deadlines: Deadlines
    now: float
    status: RoomStatus = _S.BOOTSTRAPPING
    failure: Fail | None = None
    entered_at: float = 0.0
    progress_at: float = 0.0
    """The last progress: entering the current status, or a ``Landed`` since (Transferring's clock)."""
    held_at: float | None = None
    """The last sign that the peer holds this room live (:meth:`lease`, :meth:`hold`); None: unleased."""
    history: list[tuple[float, str]] = field(default_factory=list)

    _table = SENDER_TRANSITIONS
    _leased_at_open = False
    """Whether the lease runs from the room's creation (the prefill's), or from :meth:`lease`."""

    def __post_init__(self) -> None:
        self.entered_at = self.progress_at = self.now
        if self._leased_at_open:
            self.held_at = self.now
        self.history.append((self.now, self.status.name))

    def _apply(self, event: Event, now: float) -> RoomStatus:
        nxt = transition(self._table, self.status, event)
        if isinstance(event, Fail):
            self.failure = event
        if isinstance(event, Landed):
            self.progress_at = max(self.progress_at, now)
        if nxt is not self.status:
            self.status = nxt
            self.entered_at = now
            self.progress_at = now
            self.history.append((now, nxt.name if self.failure is None else f"{nxt.name}:{event}"))
        return nxt

    @property
    def quiescent(self) -> bool:
        """Nothing of the room is in flight any more (each side says what that means)."""
        raise NotImplementedError

    def fail(self, reason: FailureReason, detail: str, now: float) -> bool:
        """Fail the room; returns False (and changes nothing) when it is already final."""
        if self.status.final:
            return False
        self._apply(Fail(reason, detail), now)
        return True

    def lease(self, now: float) -> None:
        """The room starts waiting on its peer: leased from ``now`` (a no-op once leased)."""
        if self.held_at is None:
            self.held_at = now

    def hold(self, now: float) -> None:
        """The peer showed that it holds the room live at ``now``: the lease runs from then.

        A room not leased yet (it waits on its own application, not on the peer) stays unleased.
        """
        if self.held_at is not None:
            self.held_at = max(self.held_at, now)

    def due(self) -> Due | None:
        """The room's next timeout (:meth:`Deadlines.due`), or None."""
        return self.deadlines.due(self.status, Clocks(self.entered_at, self.progress_at, self.held_at))

    @property
    def deadline(self) -> float | None:
        """When the room times out unless something happens first, or None (final or no bound)."""
        due = self.due()
        return None if due is None else due.at

    def expired(self, now: float) -> Fail | None:
        """The timeout failure if the room's deadline has passed at ``now``, else None.

        Call only after applying every pending notification: a chunk that landed before the deadline
        but was read after it must count.
        """
        due = self.due()
        if due is None or now < due.at:
            return None
        waiting = self.waiting_for()
        return Fail(
            due.reason,
            f"room {self.room} {due.bound} in {self.status.name}{f' ({waiting})' if waiting else ''}",
        )

    def waiting_for(self) -> str:
        """What the room still waits for, in words (for a deadline's failure); empty: not said."""
        return ""


@dataclass(frozen=True, slots=True)
class Chunk:
    """One ``send()`` of a room on the prefill side: pages ``[page_start, page_start+num_pages)``."""

    chunk_id: int
    page_start: int
    num_pages: int
    last: bool
    aux_slot: int | None


@dataclass
class SenderRoom(Room):
    """One room on one prefill rank.

    Learns the decode instance from its TransferRequests (one per decode rank, even from decode
    ranks this prefill rank sends nothing to), queues chunks from ``send()``, and counts WRITEs done
    per (chunk, decode rank). ``targets`` are the decode ranks this rank writes to.
    """

    decode_tp: int | None = None
    requested: set[int] = field(default_factory=set)
    targets: set[int] = field(default_factory=set)
    aux_targets: set[int] = field(default_factory=set)
    """The decode ranks whose aux item this prefill rank writes (each decode rank has its own)."""
    chunks: list[Chunk] = field(default_factory=list)
    done: set[tuple[int, int]] = field(default_factory=set)
    aux_done: set[int] = field(default_factory=set)
    in_flight: int = 0
    """Jobs handed to workers and not yet answered; the room is quiescent only at 0."""

    _table = SENDER_TRANSITIONS
    _leased_at_open = True

    def job_started(self) -> None:
        """A job (one chunk or the aux item, to one decode rank) went to a worker."""
        self.in_flight += 1

    def job_ended(self) -> None:
        """A job's one reply arrived (whatever its outcome)."""
        if self.in_flight <= 0:
            raise LocalProtocolError(f"room {self.room}: a job ended but none was in flight")
        self.in_flight -= 1

    @property
    def quiescent(self) -> bool:
        """No WRITE of this room can still be posted or land."""
        return self.in_flight == 0

    def waiting_for(self) -> str:
        chunks = f"{len(self.chunks)} chunk(s) queued{', the last' if self.sealed else ', not the last'}"
        writes = f"{len(self.done)} of {len(self.chunks) * len(self.targets)} chunk WRITEs done"
        aux = f"aux {len(self.aux_done)} of {len(self.aux_targets)}"
        return f"{chunks}; {writes}; {aux}; {self.in_flight} job(s) at the workers"

    @property
    def next_page(self) -> int:
        return sum(c.num_pages for c in self.chunks)

    @property
    def sealed(self) -> bool:
        """The last chunk has been queued."""
        return bool(self.chunks) and self.chunks[-1].last

    def on_request(self, decode_rank: int, decode_tp: int, sends: bool, sends_aux: bool, now: float) -> None:
        """A decode rank's TransferRequest arrived; ``sends`` if it names heads for this rank."""
        if self.status.final:
            return
        if decode_tp < 1 or not 0 <= decode_rank < decode_tp:
            raise RemoteProtocolError(f"room {self.room}: decode rank {decode_rank} of tp {decode_tp}")
        if self.decode_tp is None:
            self.decode_tp = decode_tp
        elif decode_tp != self.decode_tp:
            raise RemoteProtocolError(
                f"room {self.room}: decode tp {decode_tp} from rank {decode_rank}, earlier requests said {self.decode_tp}"
            )
        if decode_rank in self.requested:
            raise RemoteProtocolError(
                f"room {self.room}: second TransferRequest from decode rank {decode_rank}"
            )
        self.requested.add(decode_rank)
        self.hold(now)  # the decode holds the room live: it just asked for it
        if sends:
            self.targets.add(decode_rank)
        if sends_aux:
            self.aux_targets.add(decode_rank)
        if len(self.requested) == self.decode_tp:
            self._apply(Bootstrapped(), now)
            self._advance(now)

    def queue_chunk(self, num_pages: int, last: bool, aux_slot: int | None, now: float) -> Chunk:
        """Record the next chunk of this room; LocalProtocolError after the last one or when final."""
        if self.status.final:
            raise LocalProtocolError(f"room {self.room} is {self.status.name}; send() is not allowed")
        if self.sealed:
            raise LocalProtocolError(f"room {self.room} already sent its last chunk")
        chunk = Chunk(len(self.chunks), self.next_page, num_pages, last, aux_slot)
        self.chunks.append(chunk)
        self._advance(now)
        return chunk

    def write_done(self, chunk_id: int, decode_rank: int, now: float) -> None:
        """The WRITE of ``chunk_id`` to ``decode_rank`` finished (its notification went out)."""
        if not 0 <= chunk_id < len(self.chunks) or decode_rank not in self.targets:
            raise LocalProtocolError(
                f"room {self.room}: WRITE done for chunk {chunk_id} to decode rank {decode_rank}, but the room has "
                f"{len(self.chunks)} chunks and writes to decode ranks {sorted(self.targets)}"
            )
        key = (chunk_id, decode_rank)
        if key in self.done:
            raise LocalProtocolError(
                f"room {self.room}: chunk {chunk_id} to decode rank {decode_rank} done twice"
            )
        self.done.add(key)
        if not self.status.final:
            if self.status is _S.TRANSFERRING:  # a WRITE may finish while other decode ranks still bootstrap
                self._apply(Landed(), now)
            self._advance(now)

    def aux_written(self, decode_rank: int, now: float) -> None:
        """The aux WRITE to ``decode_rank`` finished."""
        if decode_rank not in self.aux_targets or decode_rank in self.aux_done:
            raise LocalProtocolError(
                f"room {self.room}: unexpected aux completion for decode rank {decode_rank}"
            )
        self.aux_done.add(decode_rank)
        if not self.status.final:
            self._advance(now)

    def _advance(self, now: float) -> None:
        if self.status is _S.WAITING_FOR_INPUT and self.chunks and self.targets:
            self._apply(InputReady(), now)
        if self.status in (_S.WAITING_FOR_INPUT, _S.TRANSFERRING) and self._complete():
            self._apply(Completed(), now)

    def _complete(self) -> bool:
        if not self.sealed:
            return False
        if self.aux_done != self.aux_targets:
            return False
        return len(self.done) == len(self.chunks) * len(self.targets)

    @property
    def aux_slot(self) -> int | None:
        return self.chunks[-1].aux_slot if self.sealed else None


def abort_reason(wire_reason: int) -> FailureReason:
    """How a prefill room fails when a decode rank aborts it with ``wire_reason``.

    A ring that could not place a chunk stays STAGING on this side too (it names ``ring_bytes``), and
    a chunk that landed corrupted stays INTEGRITY (docs/INTEGRITY.md); every other abort is ABORTED.
    """
    if wire_reason in (FailureReason.STAGING, FailureReason.INTEGRITY):
        return FailureReason(wire_reason)
    return FailureReason.ABORTED


PASSED_ON = frozenset({FailureReason.ABORTED, FailureReason.STAGING, FailureReason.BOOTSTRAP_TIMEOUT})
"""Reasons a decode room keeps when its prefill fails the room; anything else becomes REMOTE."""


def remote_failure_reason(wire_reason: int) -> FailureReason:
    """How a decode room fails when a prefill rank's ``RoomFailed`` says ``wire_reason``."""
    try:
        why = FailureReason(wire_reason)
    except ValueError:
        return FailureReason.REMOTE
    return why if why in PASSED_ON else FailureReason.REMOTE


def reason_name(wire_reason: int) -> str:
    """``wire_reason``'s name, or the number when no FailureReason has it."""
    try:
        return FailureReason(wire_reason).name
    except ValueError:
        return str(wire_reason)
