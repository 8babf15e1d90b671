"""Room state machines: one transition table per side, and the bookkeeping that feeds them.

A room is one request's transfer. Its status moves along

    Bootstrapping -> WaitingForInput -> Transferring -> Success | Failed

driven by events. The tables below are the whole truth about which event may move which state
where; an event with no entry raises :class:`LocalProtocolError` naming both. ``Success`` and
``Failed`` are final. :class:`SenderRoom` and :class:`ReceiverRoom` do the counting (requests, chunks
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
from collections.abc import Iterable
from dataclasses import dataclass, field

from transfer_engine.errors import FailureReason, LocalProtocolError, RemoteProtocolError
from transfer_engine.protocol.layers import LayerTally

__all__ = [
    "RECEIVER_TRANSITIONS",
    "SENDER_TRANSITIONS",
    "Bootstrapped",
    "Chunk",
    "Completed",
    "Deadlines",
    "Event",
    "Fail",
    "FailureReason",
    "InputReady",
    "Landed",
    "ReceiverRoom",
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
    """How long a room may stay in each phase, in seconds; ``None`` disables that deadline."""

    bootstrap: float | None = 30.0
    waiting: float | None = None
    transfer: float | None = 60.0

    def for_state(self, state: RoomStatus) -> tuple[float | None, FailureReason]:
        if state is _S.BOOTSTRAPPING:
            return self.bootstrap, FailureReason.BOOTSTRAP_TIMEOUT
        if state is _S.WAITING_FOR_INPUT:
            return self.waiting, FailureReason.INPUT_TIMEOUT
        return self.transfer, FailureReason.TRANSFER_TIMEOUT


@dataclass
class _Room:
    room: int
    deadlines: Deadlines
    now: float
    status: RoomStatus = _S.BOOTSTRAPPING
    failure: Fail | None = None
    entered_at: float = 0.0
    history: list[tuple[float, str]] = field(default_factory=list)

    _table = SENDER_TRANSITIONS

    def __post_init__(self) -> None:
        self.entered_at = self.now
        self.history.append((self.now, self.status.name))

    def _apply(self, event: Event, now: float) -> RoomStatus:
        nxt = transition(self._table, self.status, event)
        if isinstance(event, Fail):
            self.failure = event
        if nxt is not self.status:
            self.status = nxt
            self.entered_at = now
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

    @property
    def deadline(self) -> float | None:
        """When the current phase times out, or None (final state or no deadline for the phase)."""
        if self.status.final:
            return None
        limit, _ = self.deadlines.for_state(self.status)
        return None if limit is None else self.entered_at + limit

    def expired(self, now: float) -> Fail | None:
        """The timeout failure if the current phase's deadline has passed at ``now``, else None.

        Call only after applying every pending notification: a chunk that landed before the deadline
        but was read after it must count.
        """
        deadline = self.deadline
        if deadline is None or now < deadline:
            return None
        limit, reason = self.deadlines.for_state(self.status)
        waiting = self.waiting_for()
        return Fail(
            reason,
            f"room {self.room} spent more than {limit} s in {self.status.name}{f' ({waiting})' if waiting else ''}",
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
class SenderRoom(_Room):
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


@dataclass
class ReceiverRoom(_Room):
    """One room on one decode rank.

    ``writers`` are the global prefill ranks that write to this rank. Completion is counted per
    writer: writer ``w`` is done when the chunk it marked ``last`` and every lower chunk id have
    landed, in whatever order they came. For the staged paths a chunk also has to be scattered
    (``staged=True``) before it counts; ``wants_aux_from`` names the writer whose aux must land.
    """

    writers: frozenset[int] = frozenset()
    staged: bool = False
    wants_aux_from: int | None = None
    landed: dict[int, set[int]] = field(default_factory=dict)
    last_chunk: dict[int, int] = field(default_factory=dict)
    scattered: set[int] = field(default_factory=set)
    aux_landed: bool = False
    awaiting_acks: set[int] = field(default_factory=set)
    """Prefill ranks whose AbortAck (or death) this room waits for before its pages are safe (the
    room actor names every rank of the instance, writers or not: see ``ReceiverRoomActor.start_abort``)."""
    aborting: bool = False
    """Abort went out to every prefill rank; the room ends once ``awaiting_acks`` is empty."""
    scattering: int = 0
    """Chunks at the scatter actor, not yet reported back."""
    layer_tally: LayerTally | None = None
    """Layer groups landed per (writer, chunk) of layer-wise chunks (``protocol/layers.py``)."""

    _table = RECEIVER_TRANSITIONS

    def layers_landed(self, sender: int, chunk_id: int, layers: tuple[int, int]) -> bool:
        """Whether exactly this group of ``chunk_id`` from ``sender`` has landed already (a repeat)."""
        tally = self.layer_tally
        return chunk_id in self.landed.get(sender, ()) or (
            tally is not None and tally.has((sender, chunk_id), *layers)
        )

    def on_layers(self, sender: int, chunk_id: int, layers: tuple[int, int], now: float) -> bool:
        """A layer group of ``chunk_id`` from ``sender`` landed. True once the chunk covers every layer
        from that writer: the caller then counts the chunk with :meth:`on_chunk`.

        Raises RemoteProtocolError (recording nothing) for an unknown sender, a negative chunk id, or
        a range out of bounds or overlapping one that landed.
        """
        if sender not in self.landed:
            raise RemoteProtocolError(
                f"room {self.room}: layers from prefill rank {sender}, not a writer of it"
            )
        if chunk_id < 0:
            raise RemoteProtocolError(f"room {self.room}: chunk id {chunk_id} < 0 from rank {sender}")
        if self.layer_tally is None:
            raise LocalProtocolError(f"room {self.room} counts no layer groups (layer_tally unset)")
        if chunk_id in self.landed[sender]:
            raise RemoteProtocolError(
                f"room {self.room}: layers {layers} of chunk {chunk_id} from rank {sender} after it landed"
            )
        complete = self.layer_tally.add((sender, chunk_id), *layers)
        if not complete and not self.status.final:
            self._apply(Landed(), now)
        return complete

    @property
    def quiescent(self) -> bool:
        """No WRITE or scatter of this room can still touch its pages (or its ring regions)."""
        if self.scattering:
            return False
        if self.status is _S.SUCCESS:
            return True
        return self.aborting and not self.awaiting_acks

    def start_abort(self, live_writers: Iterable[int]) -> bool:
        """The room failed: wait for an AbortAck from each live writer. False if already aborting."""
        if self.aborting:
            return False
        self.aborting = True
        self.awaiting_acks = set(live_writers)
        return True

    def on_abort_ack(self, writer: int) -> None:
        self.awaiting_acks.discard(writer)

    def on_writer_dead(self, writer: int) -> None:
        """Writer ``writer`` was declared dead: nothing of it can land any more."""
        self.awaiting_acks.discard(writer)

    def scatter_started(self) -> None:
        self.scattering += 1

    def scatter_ended(self, chunk_id: int, ok: bool, now: float, freed: bool = True) -> None:
        """The scatter actor answered for ``chunk_id``: with ``freed`` the whole chunk is in the pages
        and its region is free again; without, one layer group of it is (the region still held)."""
        if self.scattering <= 0:
            raise LocalProtocolError(f"room {self.room}: chunk {chunk_id} scattered but none was running")
        self.scattering -= 1
        if ok and freed:
            self.on_scattered(chunk_id, now)

    def bootstrapped(self, writers: Iterable[int], wants_aux_from: int | None, now: float) -> None:
        """The writers are known and every TransferRequest went out."""
        transition(self._table, self.status, Bootstrapped())  # refuse before touching any state
        self.writers = frozenset(writers)
        self.wants_aux_from = wants_aux_from
        self.landed = {w: set() for w in self.writers}
        self._apply(Bootstrapped(), now)

    def on_chunk(self, sender: int, chunk_id: int, last: bool, now: float) -> bool:
        """A ChunkLanded from ``sender``. Returns True when chunk ``chunk_id`` has landed from every writer.

        Raises RemoteProtocolError for an unknown sender, a repeated chunk, or contradicting ``last``.
        """
        if sender not in self.landed:
            raise RemoteProtocolError(
                f"room {self.room}: chunk from prefill rank {sender}, not a writer of it"
            )
        if chunk_id < 0:
            raise RemoteProtocolError(f"room {self.room}: chunk id {chunk_id} < 0 from rank {sender}")
        seen = self.landed[sender]
        if chunk_id in seen:
            raise RemoteProtocolError(
                f"room {self.room}: chunk {chunk_id} from prefill rank {sender} landed twice"
            )
        # Every writer sends the same chunks (one per send() of the room): once any writer has marked
        # its last chunk, the room's chunk count is fixed for all of them. Staged completion counts
        # scattered chunks against it, so a writer that disagrees must not be believed.
        expected = self.chunks_expected()
        if expected is not None and (chunk_id >= expected or (last and chunk_id != expected - 1)):
            raise RemoteProtocolError(
                f"room {self.room}: chunk {chunk_id} (last={last}) of prefill rank {sender} after last chunk {expected - 1}"
            )
        if last:
            highest = max((max(ids) for ids in self.landed.values() if ids), default=-1)
            if highest > chunk_id:
                raise RemoteProtocolError(
                    f"room {self.room}: prefill rank {sender} marks chunk {chunk_id} last after chunk {highest} landed"
                )
        seen.add(chunk_id)
        if last:
            self.last_chunk[sender] = chunk_id
        if not self.status.final:
            self._apply(Landed(), now)
            self._maybe_complete(now)
        return all(chunk_id in s for s in self.landed.values())

    def on_scattered(self, chunk_id: int, now: float) -> None:
        self.scattered.add(chunk_id)
        if not self.status.final:
            self._maybe_complete(now)

    def on_aux(self, sender: int, now: float) -> None:
        if sender != self.wants_aux_from:
            raise RemoteProtocolError(
                f"room {self.room}: aux from prefill rank {sender}, expected {self.wants_aux_from}"
            )
        if self.aux_landed:
            raise RemoteProtocolError(f"room {self.room}: aux landed twice")
        self.aux_landed = True
        if not self.status.final:
            self._maybe_complete(now)

    def heard_from(self, writer: int) -> bool:
        """Whether anything of ``writer`` landed: it has this room's request (no need to repeat it)."""
        partial = self.layer_tally is not None and any(
            isinstance(key, tuple) and key[0] == writer for key in self.layer_tally.partial_keys()
        )
        return bool(self.landed.get(writer)) or partial or (self.aux_landed and writer == self.wants_aux_from)

    def writer_done(self, writer: int) -> bool:
        last = self.last_chunk.get(writer)
        return last is not None and len(self.landed[writer]) == last + 1

    def chunks_expected(self) -> int | None:
        """How many chunks every writer sends, once any writer's last chunk has landed; else None."""
        return next(iter(self.last_chunk.values())) + 1 if self.last_chunk else None

    def _maybe_complete(self, now: float) -> None:
        if self.status is not _S.TRANSFERRING:
            return
        if not all(self.writer_done(w) for w in self.writers):
            return
        if self.wants_aux_from is not None and not self.aux_landed:
            return
        if self.staged and len(self.scattered) != self.chunks_expected():
            return
        self._apply(Completed(), now)


def abort_reason(wire_reason: int) -> FailureReason:
    """How a prefill room fails when a decode rank aborts it with ``wire_reason``.

    A ring that could not place a chunk stays STAGING on this side too (it names ``ring_bytes``);
    every other abort is ABORTED.
    """
    return FailureReason.STAGING if wire_reason == FailureReason.STAGING else FailureReason.ABORTED


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
