"""NixlPoller actor: the sole owner of the NIXL agent.

Every NIXL call of the engine is made by this object, on the event-loop thread, with one exception:
a WRITE made ahead may be started by a worker's completion waiter thread (:meth:`start_early`) the
moment the KV it reads is written, and handed over afterwards (:meth:`adopt`); the transport
serializes its calls (docs/DECISIONS.md, "A held WRITE is started by the completion waiter's
thread"). It makes WRITEs (:meth:`prepare_write`, :meth:`prepare_indexed`) and starts them
(:meth:`start_write`), synchronously: the caller learns at once whether a WRITE was refused. It polls the state of every posted WRITE — which is also what makes NIXL send
their notifications — releases finished handles, and drains incoming notifications, handing each
decoded one to its room through the :class:`~transfer_engine.runtime.ports.RoomBoard`. Polling is tight
while WRITEs or live rooms exist, backs off between, and all but stops when nothing can come
(:func:`poll_delay`; docs/DECISIONS.md, "An idle poller looks four times a second").

Replies are mail: a finished WRITE is a :class:`~transfer_engine.runtime.mail.WriteEnded` to the mailbox
that posted it, and :meth:`request_drain` answers a room with :class:`~transfer_engine.runtime.mail.Drained`
after the next full cycle, so that deadlines are checked only after every notification that had
arrived was applied. The poller waits on rooms' mailboxes; rooms never wait on it.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
from anyio.abc import TaskStatus

from transfer_engine.errors import (
    AddressRangeError,
    ConfigError,
    RemoteProtocolError,
    TransferError,
    TransportError,
)
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.cadence import GroupCadence
from transfer_engine.protocol.messages import MemRegion
from transfer_engine.runtime.logbook import LogBook
from transfer_engine.runtime.mail import Drained, Mailbox, WriteEnded
from transfer_engine.runtime.ports import RoomBoard
from transfer_engine.runtime.steptrace import StepTrace
from transfer_engine.runtime.ticker import fine_timers
from transfer_engine.transport.interface import RemotePeer, TableRows, Transport, WriteSpec, XferState

log = logging.getLogger(__name__)

QUICK_S = 0.002
"""After activity (a WRITE posted, a room started, a notification or completion) the poller sleeps
only ``poll_interval / QUICK_DIVISOR`` for this long: the answer to a WRITE or a request usually comes
within a millisecond or two, and each poll it is late by is added to the room's latency."""
QUICK_DIVISOR = 4
IDLE_FACTOR = 50
"""For ``PEER_WINDOW_S`` after a peer was added, with nothing of its own that can come, the poller
looks every ``poll_interval * IDLE_FACTOR``: the peer probes the link with WRITEs into this rank
(engine/handshake.py), and over a transport without one-sided puts (UCX over TCP) a WRITE's bytes
land only through the target's own progress calls, which are this poller's looks."""
PEER_WINDOW_S = 10.0
"""How long after :meth:`NixlPoller.add_peer` an idle poller looks at the ``IDLE_FACTOR`` cadence."""
IDLE_LOOK_S = 0.25
"""With nothing that can come (no WRITE out, no room waiting for a notification, no drain asked, no
peer added lately), the poller looks every this many seconds. Nothing local can be missed: a WRITE
started, a room opened, a drain asked or a peer added wakes it at once (:meth:`NixlPoller.wake`).
It still looks now and then, not never, for what only a far side starts: a WRITE a peer still has
in flight into a room this rank gave up on, or a late link probe, needs this rank's progress calls
over TCP to end."""
DRIVE_NAP_S = 20e-6
""":meth:`NixlPoller.drive` sleeps this long between two looks (the kernel's timer slack adds about
50 us): a look every ~70 us instead of a core held for up to ``early_drive``."""
BACKOFF_POLLS = 20
"""Polls at ``poll_interval`` after the quick window, before the poller slows to 2.5x that."""


def poll_delay(
    interval: float,
    *,
    posted: int,
    urgent: int,
    busy: bool,
    quick: bool,
    idle: int,
    relaxed: float,
    idle_look: float = IDLE_LOOK_S,
    listening: bool = False,
) -> tuple[float, bool]:
    """How long the poller sleeps before its next look, and whether that sleep counts as a back-off
    step (the caller counts ``idle`` up by one then). Pure.

    ``posted``: WRITEs out; ``urgent``: those of them whose end someone waits for now (the rest are
    relaxed: layer groups that do not close their chunk, docs/DECISIONS.md, "Relaxed looks at the
    layer groups before the last"); ``busy``: rooms wait for notifications (decode); ``quick``: in a
    quick window (activity, or a predicted layer group); ``idle``: back-off steps since the last
    activity; ``relaxed``: ``EngineConfig.poll_relaxed``, the period of a look while only relaxed
    WRITEs are out (> 0); ``idle_look``: the sleep when nothing can come (``IDLE_LOOK_S``, or
    ``poll_interval * IDLE_FACTOR`` while a peer added lately may probe the link); ``listening``:
    rooms are live whose notifications come another way (the kernel path's, over the control
    channel) but could come over NIXL (a writer that fell back to it): looked at every ``relaxed``,
    not at the quick cadence (docs/DECISIONS.md, "The decode's poller is quick only for rooms that
    hear over NIXL").
    """
    if not (posted or busy):  # nothing is expected over NIXL
        return (max(relaxed, interval) if listening else idle_look), False
    if quick:
        return interval / QUICK_DIVISOR, False
    if urgent == 0 and not busy:  # only relaxed WRITEs out
        return max(relaxed, interval), False
    return (interval if idle < BACKOFF_POLLS else interval * 2.5), True


@dataclass(slots=True)
class _Posted:
    handle: int
    peer: str
    nbytes: int
    reply_to: Mailbox[Any]
    token: object
    relaxed: bool = False
    """Nobody waits for its end right now: it does not quicken the poller (:func:`poll_delay`)."""


class NixlPoller:
    """See the module docstring."""

    def __init__(
        self,
        transport: Transport,
        rooms: RoomBoard,
        *,
        notifications: bool,
        poll_interval: float = 0.0002,
        busy: Callable[[], bool] = lambda: False,
        listening: Callable[[], bool] = lambda: False,
        spin: float = 0.0,
        trace: StepTrace | None = None,
        num_layers: int = 0,
        relaxed: float = 0.001,
    ) -> None:
        if relaxed <= 0:
            raise ConfigError(f"relaxed={relaxed} must be > 0 (the period of a look at relaxed WRITEs)")
        self.transport = transport
        self._trace = trace or StepTrace()
        self._rooms = rooms
        self._notifications = notifications
        """Whether notifications are expected (decode ranks); a prefill rank counts any as unrouted."""
        self._drain_next: list[int] = []
        """Rooms that asked for Drained; served after the next cycle that starts after the request."""
        self._interval = poll_interval
        self._busy = busy
        """Whether rooms wait for notifications over NIXL (:func:`poll_delay`'s ``busy``)."""
        self._listening = listening
        """Whether rooms are live that could hear over NIXL (:func:`poll_delay`'s ``listening``)."""
        self._spin = spin
        self._num_layers = num_layers
        """The KV pool's layers: a layer group's notification ending below it has more to come."""
        self.cadence = GroupCadence() if notifications else None
        """A decode rank's quick windows around each sender's next layer group (docs/DECISIONS.md,
        "The decode poller predicts a writer's next layer group"); None on a prefill rank, which hears
        no layer groups."""
        self._relaxed = relaxed
        """``EngineConfig.poll_relaxed``: the look's period while only relaxed WRITEs are out."""
        self._hot_until = 0.0
        self._quick_until = 0.0
        self._idle = 0
        self._sleep_until = float("inf")
        """When the poller's current sleep ends (inf: it is not asleep)."""
        self._peer_until = 0.0
        """Until then a peer added lately may probe the link into this rank (``PEER_WINDOW_S``)."""
        self._posted: list[_Posted] = []
        self._seals: dict[int, Callable[[], bytes]] = {}
        """Made WRITEs whose notification is made as they start (``WriteSpec.seal``: integrity)."""
        self._wake = anyio.Event()
        self.counters: Counter[str] = Counter()
        self.book = LogBook(log, transport.name)
        """Bounded log of dropped notifications (``counters`` stays exact)."""

    @property
    def name(self) -> str:
        return self.transport.name

    def metadata(self) -> bytes:
        return self.transport.metadata()

    def register(self, regions: list[MemRegion], mem_type: str) -> int:
        """Register local memory (a staging buffer) with the agent."""
        return self.transport.register(regions, mem_type)

    def add_peer(self, peer: RemotePeer, metadata: bytes) -> None:
        """Add ``peer``; an idle poller looks more often for ``PEER_WINDOW_S`` (its link probe)."""
        self.transport.add_peer(peer, metadata)
        self._peer_until = time.monotonic() + PEER_WINDOW_S
        self._wake.set()  # from a long idle sleep to the peer window's cadence

    def remove_peer(self, agent_name: str) -> None:
        self.transport.remove_peer(agent_name)

    def in_flight(self, peer: str | None = None) -> int:
        return sum(1 for p in self._posted if peer is None or p.peer == peer)

    def prepare_write(self, spec: WriteSpec) -> int:
        """Make a WRITE without starting it (its descriptors checked and prepared); returns the handle
        for :meth:`start_write` or :meth:`discard`. Raises AddressRangeError / TransportError when it
        cannot be made (nothing is then)."""
        return self._sealing(self._counted(lambda: self.transport.prepare_write(spec)), spec)

    def prepare_lists(self, spec: WriteSpec) -> int:
        """Check and prepare ``spec``'s descriptor lists once, for WRITEs of parts of it
        (:meth:`prepare_indexed`); :meth:`close_lists` gives them up. Raises as :meth:`prepare_write`."""
        lists = self._counted(lambda: self.transport.prepare_lists(spec))
        self.counters["lists_prepared"] += 1
        return lists

    def prepare_indexed(self, lists: int, index: np.ndarray, spec: WriteSpec) -> int:
        """Make the WRITE ``spec`` of the descriptors ``index`` of ``lists``, without starting it; as
        :meth:`prepare_write` otherwise."""
        return self._sealing(self._counted(lambda: self.transport.prepare_indexed(lists, index, spec)), spec)

    def _sealing(self, handle: int, spec: WriteSpec) -> int:
        if spec.seal is not None:
            self._seals[handle] = spec.seal
        return handle

    def _seal(self, handle: int) -> bytes:
        """The notification ``handle`` starts with: its seal's (b"": the one it was made with). The
        worker starts a sealed WRITE only once its checksum is known, so this reads it (integrity,
        docs/INTEGRITY.md). A seal that fails refuses the WRITE: TransportError, and the handle is
        released."""
        seal = self._seals.pop(handle, None)
        if seal is None:
            return b""
        try:
            return seal()
        except Exception as exc:
            self.transport.release(handle)
            raise TransportError(f"the notification of WRITE {handle} could not be sealed: {exc}") from exc

    def table(self, peer: str, key: Hashable) -> int | None:
        """The transport's :meth:`~transfer_engine.transport.interface.Transport.table`."""
        return self.transport.table(peer, key)

    def prepare_table(
        self,
        peer: str,
        key: Hashable,
        local: TableRows,
        remote: TableRows,
        local_mem: str,
        local_device: int,
        max_descriptors: int,
    ) -> int:
        """The transport's :meth:`~transfer_engine.transport.interface.Transport.prepare_table`; its
        refusals and the tables prepared are counted."""
        table = self._counted(
            lambda: self.transport.prepare_table(
                peer, key, local, remote, local_mem, local_device, max_descriptors
            )
        )
        self.counters["tables_prepared"] += 1
        return table

    def prepare_from_table(
        self, table: int, src_index: np.ndarray, dst_index: np.ndarray, spec: WriteSpec
    ) -> int:
        """The transport's :meth:`~transfer_engine.transport.interface.Transport.prepare_from_table`;
        its refusals counted and its seal kept, as :meth:`prepare_write`'s."""
        return self._sealing(
            self._counted(lambda: self.transport.prepare_from_table(table, src_index, dst_index, spec)), spec
        )

    def close_lists(self, lists: int) -> None:
        """No more WRITEs from ``lists``; released once the WRITEs made from them are."""
        try:
            self.transport.close_lists(lists)
        except KeyError:  # the transport was closed first (engine shutdown): it released them
            log.debug("shared lists %d were already released", lists)

    def start_write(
        self, handle: int, spec: WriteSpec, reply_to: Mailbox[Any], token: object, *, relaxed: bool = False
    ) -> None:
        """Start the WRITE ``handle`` made of ``spec``; once it ends, ``WriteEnded(token, ok, detail)``
        goes to ``reply_to``. TransportError: not started, the handle is gone, and no reply comes.
        ``relaxed``: nobody waits for its end until :meth:`hurry` (a layer group before its chunk's
        last): it is looked at every ``poll_relaxed``, not at the quick cadence."""
        started = self._counted(lambda: self.transport.start_write(handle, self._seal(handle)))
        self._track(started, spec, reply_to, token, relaxed)

    def start_early(self, handle: int) -> tuple[int, int, int] | None:
        """Start the made WRITE ``handle`` from any thread (the completion waiter's); nothing is
        tracked or counted until :meth:`adopt`, on the loop. TransportError: not started, and the
        handle is gone (count it with :meth:`refused`). Returns the transport's
        :attr:`~transfer_engine.transport.nixl.NixlTransport.last_start`, if it has one."""
        self.transport.start_write(handle, self._seal(handle))
        at: tuple[int, int, int] | None = getattr(self.transport, "last_start", None)
        return at

    def drive(self, handle: int, limit_s: float) -> bool:
        """From the thread that started ``handle`` (:meth:`start_early`), before it is adopted: ask
        NIXL for its state until it has ended, for ``limit_s`` at most. NIXL sends a WRITE's
        notification from that call once its bytes are in place, so the decode hears of it without
        waiting for this poller's own look, which waits for the loop's turn. True: it ended (its
        handle stays for the poller to release, as every other).

        It naps ``DRIVE_NAP_S`` between looks, letting the GIL and the core go (a loop of looks
        held a core for up to ``limit_s`` after every closing group; docs/DECISIONS.md, "An idle
        poller looks four times a second")."""
        until = time.monotonic() + limit_s
        while self.transport.state(handle) is XferState.PROC:
            if time.monotonic() >= until:
                return False
            time.sleep(DRIVE_NAP_S)
        return True

    def adopt(
        self, handle: int, spec: WriteSpec, reply_to: Mailbox[Any], token: object, *, relaxed: bool = False
    ) -> None:
        """Track a WRITE that :meth:`start_early` started, as :meth:`start_write` tracks its own."""
        self._track(handle, spec, reply_to, token, relaxed)

    def hurry(self, reply_to: Mailbox[Any]) -> None:
        """Someone waits for the ends of ``reply_to``'s relaxed WRITEs now (the closing group of their
        chunk came): they are urgent from here on, and the poller is quick."""
        hurried = 0
        for posted in self._posted:
            if posted.relaxed and posted.reply_to is reply_to:
                posted.relaxed = False
                hurried += 1
        if hurried:
            self.counters["writes_hurried"] += hurried
            self._heat()
            self._wake.set()

    def refused(self, exc: TransferError) -> None:
        """Count a refusal that :meth:`start_early` raised (on the loop: the counters are its)."""
        kind = "writes_refused_address" if isinstance(exc, AddressRangeError) else "writes_refused"
        self.counters[kind] += 1

    def _counted(self, call: Callable[[], int]) -> int:
        """``call()`` (a transport's make or start), counting the refusals it raises."""
        try:
            return call()
        except TransportError as exc:
            self.refused(exc)
            raise

    def _track(
        self, handle: int, spec: WriteSpec, reply_to: Mailbox[Any], token: object, relaxed: bool = False
    ) -> None:
        self._posted.append(_Posted(handle, spec.peer, spec.nbytes, reply_to, token, relaxed))
        self.counters["writes_posted"] += 1
        self.counters["descriptors_posted"] += len(spec.src)
        if relaxed:
            self.counters["writes_relaxed"] += 1
            # no quick window: the poller's sleep is cut short only when it would outlast a relaxed look
            if self._sleep_until > time.monotonic() + self._relaxed:
                self._wake.set()
            return
        self._heat()
        self._wake.set()

    def discard(self, handle: int) -> None:
        """Drop a WRITE made by :meth:`prepare_write` and never started."""
        self._seals.pop(handle, None)
        try:
            self.transport.release(handle)
        except KeyError:  # the transport was closed first (engine shutdown): it released every handle
            log.debug("prepared WRITE %d was already released", handle)

    def request_drain(self, room: int) -> None:
        """Send :class:`Drained` to ``room`` after the next poll-and-drain cycle that starts from now."""
        self._drain_next.append(room)
        self._wake.set()

    def wake(self, quick: bool = True) -> None:
        """Leave idle back-off now: a room started, so notifications may come any moment. With
        ``quick`` False (a room whose notifications come over the control channel) the poller only
        looks again now, without a quick window: its next sleep follows :func:`poll_delay`."""
        if quick:
            self._heat()
        self._wake.set()

    def listen(self) -> None:
        """A live room hears over NIXL from now on (a kernel-path room asked for its aux item):
        :meth:`wake`, quick."""
        self.wake()

    def _expect_more(self, cadence: GroupCadence, agent: str, notif: m.ChunkLanded | m.AuxLanded) -> None:
        """A layer group: tell the cadence (it predicts that sender's next group while more of its
        chunk is to come)."""
        if not (isinstance(notif, m.ChunkLanded) and notif.layers is not None):
            return
        more = notif.layers[1] < self._num_layers
        if cadence.landed((agent, notif.room), time.monotonic(), more):
            self.counters["cadence_windows"] += 1

    def _heat(self) -> None:
        """Poll without sleeping for the next ``spin`` seconds, then quickly until QUICK_S is over."""
        now = time.monotonic()
        self._hot_until = now + self._spin
        self._quick_until = max(self._quick_until, now + QUICK_S)
        self._idle = 0  # the back-off starts over once the quick window ends

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Poll and drain forever.

        While WRITEs are in flight or (``busy``) rooms wait for notifications, it polls every
        ``poll_interval / QUICK_DIVISOR`` for QUICK_S after activity (a WRITE posted, a room
        started, a notification or a completion), then every ``poll_interval`` for 20 polls, then
        2.5x slower; with nothing that can come, every ``IDLE_LOOK_S`` (every 50 ``poll_interval``
        for ``PEER_WINDOW_S`` after a peer was added) (:func:`poll_delay`). A relaxed WRITE's post and end are no activity, and while only relaxed
        WRITEs are out it looks every ``relaxed`` (``EngineConfig.poll_relaxed``) until
        :meth:`hurry`. Sleeps are on the loop's fine timers (:mod:`transfer_engine.runtime.ticker`):
        epoll's own would last a millisecond.
        With ``spin`` > 0 it first spins that long after activity, yielding to other tasks but
        never sleeping (for machines with cores to spare).
        """
        task_status.started()
        while True:
            self._wake = anyio.Event()
            self._sleep_until = float("inf")
            asked, self._drain_next = self._drain_next, []
            worked = await self._poll_once()
            self.counters["polls"] += 1
            for room in asked:
                await self._rooms.deliver(room, Drained())
            if worked:
                self._heat()
            if worked or time.monotonic() < self._hot_until:
                self._idle = 0
                await anyio.lowlevel.checkpoint()
                continue
            now = time.monotonic()
            delay, backoff = poll_delay(
                self._interval,
                posted=len(self._posted),
                urgent=sum(not p.relaxed for p in self._posted),
                busy=self._busy(),
                quick=now < self._quick_until or (self.cadence is not None and self.cadence.quick(now)),
                idle=self._idle,
                relaxed=self._relaxed,
                idle_look=self._interval * IDLE_FACTOR if now < self._peer_until else IDLE_LOOK_S,
                listening=self._listening(),
            )
            self._idle += backoff
            if self.cadence is not None and (ahead := self.cadence.next_start(now)) is not None:
                delay = min(delay, ahead - now)  # be quick from a predicted group's window on
            self._sleep_until = now + delay
            timers = fine_timers()
            if timers is not None:  # on time: epoll's own timeout would round up to 1 ms
                timers.call_later(delay, self._wake.set)
                await self._wake.wait()  # the timer, a new WRITE or a new room ends the wait
            else:
                with anyio.move_on_after(delay):
                    await self._wake.wait()

    async def _poll_once(self) -> bool:
        worked = False
        if self._posted:
            still: list[_Posted] = []
            finished: list[tuple[_Posted, bool, str]] = []
            for posted in self._posted:
                state = self.transport.state(posted.handle)
                if state is XferState.PROC:
                    still.append(posted)
                    continue
                self.transport.release(posted.handle)
                ok = state is XferState.DONE
                self.counters["writes_done" if ok else "writes_failed"] += 1
                if ok:
                    self.counters["bytes_written"] += posted.nbytes
                finished.append((posted, ok, "" if ok else f"WRITE to {posted.peer} ended in error"))
            self._posted = still
            for posted, ok, detail in finished:
                worked = worked or not posted.relaxed  # a relaxed end is no activity to be quick for
                await _reply(posted, ok, detail)
        try:
            notifs = self.transport.drain_notifs()
        except Exception as exc:  # NIXL raised; keep serving
            log.warning("get_new_notifs failed: %s", exc)
            notifs = {}
        for agent, items in notifs.items():
            for raw in items:
                worked = True
                try:
                    notif = m.decode_notification(raw)
                except RemoteProtocolError as exc:
                    self.counters["notifs_dropped"] += 1
                    self.book.note("malformed notification", "dropped notification from %s: %s", agent, exc)
                    continue
                self.counters["notifs"] += 1
                self._trace.mark(notif.room, "notif")
                if self.cadence is not None:
                    self._expect_more(self.cadence, agent, notif)
                if not (self._notifications and await self._rooms.deliver(notif.room, notif)):
                    self.counters["notifs_unrouted"] += 1
                    self.book.note(
                        "unrouted notification", "%s: notification %s from %s for no live room dropped",
                        self.name, notif, agent,
                    )  # fmt: skip
        return worked

    async def abandon(self, peer: str, detail: str) -> None:
        """End every WRITE to ``peer`` now (it was declared dead): their rooms may end.

        A WRITE to a dead process may never leave PROC (nothing acknowledges it), which would keep
        its room from ever being quiescent. Its bytes can only land in the dead peer's memory, so it
        is released and reported failed at once.
        """
        gone = [p for p in self._posted if p.peer == peer]
        if not gone:
            return
        self._posted = [p for p in self._posted if p.peer != peer]
        for posted in gone:
            self.transport.release(posted.handle)
            self.counters["writes_abandoned"] += 1
        for posted in gone:
            await _reply(posted, False, f"WRITE to {peer} abandoned: {detail}")

    async def drain_posted(self, limit_s: float) -> None:
        """Wait (bounded) until no WRITE is in flight; used when the engine shuts down."""
        with anyio.move_on_after(limit_s):
            while self._posted:
                await self._poll_once()
                await anyio.sleep(self._interval)
        if self._posted:
            log.warning("%d WRITEs still in flight at shutdown", len(self._posted))

    def close(self) -> None:
        try:
            self.transport.close()
        except TransportError as exc:
            log.warning("closing NIXL transport: %s", exc)


async def _reply(posted: _Posted, ok: bool, detail: str) -> None:
    try:
        await posted.reply_to.send(WriteEnded(posted.token, ok, detail))
    except anyio.ClosedResourceError:  # only while the engine closes: the poster is gone
        log.debug("WRITE to %s ended after its poster closed", posted.peer)
