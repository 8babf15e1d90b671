"""A decode room's integrity checks (docs/INTEGRITY.md): the mixin of :class:`~transfer_engine.actors.
room.receiver.ReceiverRoomActor` that compares what each writer carried with this rank's sum over
its own pages, and counts a chunk (or layer group) only once they matched.

On the direct and slice paths a landed chunk's sum is taken off the loop (``PoolChecksums.submit``)
and comes back to the room as :class:`~transfer_engine.runtime.mail.Checked`; on the staged paths
the scatter actor sums the pages right behind its copy, and the sums come back with ``Scattered``.
A mismatch, or a sum that could not be taken, fails the room with INTEGRITY.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import anyio
import numpy as np

from transfer_engine.errors import FailureReason, TransferError
from transfer_engine.protocol import descriptors, heads
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.integrity import Verdict, mismatch_detail, verdict
from transfer_engine.protocol.receiver_room import ReceiverRoom
from transfer_engine.runtime.mail import Checked, Mailbox, RoomMail
from transfer_engine.runtime.peers import Peer
from transfer_engine.runtime.ports import RoomPorts

log = logging.getLogger("transfer_engine.room")


CheckKey = tuple[int, int, tuple[int, int] | None]
"""What one integrity check covers: (chunk id, writer, layer group or None for the whole chunk)."""


class Outcome(enum.Enum):
    """What starting the check of a landed chunk (or layer group) of one writer came to."""

    COUNT = "count"
    """Nothing to compare (counted unchecked): the chunk counts now."""
    WAIT = "wait"
    """Its checksum is being taken off the loop: the chunk counts when :class:`Checked` comes."""
    FAILED = "failed"
    """The room failed (the landing broke the protocol): the chunk never counts."""


@dataclass(frozen=True)
class Check:
    """A direct path's check out (:meth:`ReceiverChecks._check`): what the writer carried, and the
    notification, counted once its bytes match."""

    carried: int
    landed: m.ChunkLanded


class StagedCopy(Protocol):
    """What a staged copy out of the ring names (the receiver's queued copy)."""

    @property
    def chunk_id(self) -> int: ...
    @property
    def sender(self) -> int | None: ...
    @property
    def layers(self) -> tuple[int, int] | None: ...


class ReceiverChecks:
    """The integrity half of a decode room; the room actor provides the state below."""

    ports: RoomPorts
    room: int
    core: ReceiverRoom
    inbox: Mailbox[RoomMail]
    writers: dict[int, Peer]
    slices: list[heads.HeadSlice]
    pages: np.ndarray
    carried: dict[CheckKey, int | None]
    """Staged: the checksum each (chunk, writer, layer group) landed with, until it is scattered."""
    checking: dict[CheckKey, Check]
    """Integrity checks out: their sums are being taken off the loop."""

    if TYPE_CHECKING:  # the room actor's

        def _fail(self, reason: FailureReason, detail: str) -> bool: ...
        def _landed(self, mail: m.ChunkLanded, now: float) -> None: ...

    def _heads(self, sender: int) -> tuple[int, int]:
        """``sender``'s destination head slice here: (its first head, its head count)."""
        (spec,) = [s for s in self.slices if s.prefill_rank == sender]
        return spec.dst_head_start, spec.num_heads

    def _scatter_checks(self, item: StagedCopy) -> list[tuple[CheckKey, int]]:
        """The integrity checks a staged copy takes behind itself, one per writer it covers (every
        writer of a whole chunk, or the one of a layer group) that carried a checksum; a writer with
        nothing to compare (none carried, or this side's integrity off) is counted unchecked now."""
        senders = [s.prefill_rank for s in self.slices] if item.sender is None else [item.sender]
        checks = []
        for sender in senders:
            key = (item.chunk_id, sender, item.layers)
            carried = self.carried.pop(key, None)
            if carried is None or self.ports.checksums is None:
                self.ports.counters["integrity_unchecked"] += 1
            else:
                checks.append((key, carried))
        return checks

    def _check(
        self,
        key: CheckKey,
        carried: int | None,
        page_start: int,
        num_pages: int,
        landed: m.ChunkLanded,
    ) -> Outcome:
        """Direct and slice paths: start comparing the checksum a writer carried for a chunk (or layer
        group, ``key``) with this rank's over the pages it landed in (docs/INTEGRITY.md). The sum is taken off the loop
        (``PoolChecksums.submit``) and comes back as :class:`Checked`, which judges it
        (:meth:`_checked`); meanwhile the chunk does not count, so the room cannot succeed before
        it matched. Nothing to compare (the writer carried none, or this side's integrity is off):
        counted unchecked, the chunk counts now."""
        chunk_id, sender, layers = key
        checksums = self.ports.checksums
        writer = self.writers.get(sender)
        if writer is None:  # not a writer of this room: the core refuses the notification
            return Outcome.COUNT
        if carried is None or checksums is None:
            self.ports.counters["integrity_unchecked"] += 1
            return Outcome.COUNT
        writer_ps = writer.layout.page_size
        page_size = self.ports.pool.layout.page_size
        start = page_start * writer_ps
        try:
            tokens = descriptors.chunk_tokens(start, num_pages, writer_ps, len(self.pages) * page_size)
            slots = descriptors.slots_of(self.pages, page_size, start, tokens)
        except TransferError as exc:  # pages outside the room's: the peer broke the protocol
            self._fail(FailureReason.PROTOCOL, f"chunk {chunk_id} from prefill rank {sender}: {exc}")
            return Outcome.FAILED
        self.checking[key] = Check(carried, landed)
        checksums.submit(
            slots,
            *self._heads(sender),
            layers,
            lambda value, why: self._post_checked(Checked(key, value, why)),
        )
        return Outcome.WAIT

    def _post_checked(self, mail: Checked) -> None:
        """On the loop, from the checksum thread: hand a check's sum to the room."""
        try:
            self.inbox.post(mail)
        except anyio.ClosedResourceError:  # the room ended meanwhile (it failed): nobody waits
            log.debug("decode room %d: a check came back after the room ended", self.room)

    def _checked(self, key: CheckKey, landed: int | None, detail: str, now: float) -> None:
        """A direct path's check came back: judge it; a match counts the chunk."""
        check = self.checking.pop(key)
        if self._judge(key, check.carried, landed, detail) and not self.core.status.final:
            self._landed(check.landed, now)

    def _judge(self, key: CheckKey, carried: int, landed: int | None, detail: str) -> bool:
        """Compare what a writer carried with the sum over this rank's pages, and count the result
        (True: a match). A mismatch, or a sum that could not be taken (``landed`` None: integrity
        fails closed), fails the room with INTEGRITY."""
        chunk_id, sender, layers = key
        intact = landed is not None and verdict(carried, landed) is Verdict.MATCH
        self.ports.counters["integrity_match" if intact else "integrity_mismatch"] += 1
        if landed is None:
            self._fail(FailureReason.INTEGRITY, f"integrity: chunk {chunk_id} could not be checked: {detail}")
        elif not intact:
            self._fail(FailureReason.INTEGRITY, mismatch_detail(chunk_id, sender, layers, carried, landed))
        return intact
