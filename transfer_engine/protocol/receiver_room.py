"""The decode side's room: which chunks landed from which writer, and when the room is complete.

The status table it fires is :data:`~transfer_engine.protocol.rooms.RECEIVER_TRANSITIONS`; the
module docstring of :mod:`transfer_engine.protocol.rooms` says how a room's bookkeeping and table
work together.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from transfer_engine.errors import LocalProtocolError, RemoteProtocolError
from transfer_engine.protocol.layers import LayerTally
from transfer_engine.protocol.rooms import (
    RECEIVER_TRANSITIONS,
    Bootstrapped,
    Completed,
    Landed,
    Room,
    RoomStatus,
    transition,
)

__all__ = ["ReceiverRoom"]


@dataclass
class ReceiverRoom(Room):
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
        if self.status is RoomStatus.SUCCESS:
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
        if self.status is not RoomStatus.TRANSFERRING:
            return
        if not all(self.writer_done(w) for w in self.writers):
            return
        if self.wants_aux_from is not None and not self.aux_landed:
            return
        if self.staged and len(self.scattered) != self.chunks_expected():
            return
        self._apply(Completed(), now)
