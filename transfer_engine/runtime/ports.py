"""Ports: what an actor is handed at construction instead of the engine.

- :class:`RankIdentity`: who this rank is, and the one ``stamp()`` every outgoing message carries.
- :class:`Outbox`: one-way control messages to a peer's endpoint (the Control actor implements it).
- :class:`PeerBook`: the remote ranks this rank knows, by NIXL agent name (the engine writes it;
  actors read it).
- :class:`RoomBoard`: the live rooms' mailboxes by room id. Actors address replies to a room id
  here; they never hold a room.
- :class:`WorkerShards`: the prefill workers' mailboxes, sharded by destination decode agent.
- :class:`WritePort`: posts WRITEs (the NIXL poller implements it).
- :class:`RingPort`: opens a staged room at the decode ring (the ring actor implements it).
- :class:`DrainPort`: asks the NIXL poller for a :class:`~transfer_engine.runtime.mail.Drained` reply.

Per-room bounds (:data:`JOBS_PER_ROOM`, :data:`SCATTERS_PER_ROOM`, :data:`RING_POSTS_PER_ROOM`)
size the mailbox reserves that rooms ``post`` into (see :mod:`transfer_engine.runtime.mail`).
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import numpy as np

from transfer_engine.errors import TransferError
from transfer_engine.memory.integrity import PoolChecksums
from transfer_engine.memory.layout import KVPool
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.cost import CostBook
from transfer_engine.protocol.layers import ChunkCut
from transfer_engine.protocol.messages import MemRegion
from transfer_engine.runtime.mail import Mailbox, RegionGranted, RingMail, RoomMail, RoomOpened, ScatterJob
from transfer_engine.runtime.peers import Peer
from transfer_engine.runtime.steptrace import StepTrace
from transfer_engine.transport.interface import TableRows
from transfer_engine.transport.nixl import WriteSpec

JOBS_PER_ROOM = 32
"""WriteJobs a prefill room has at its workers at once; more wait in the room until one ends."""
SCATTERS_PER_ROOM = 4
"""ScatterJobs a decode room has at the scatter actor at once."""
RING_POSTS_PER_ROOM = 3
"""Mails a decode room ever posts to the ring: RoomClosed (opening and freeing are calls now; the
bound keeps spares)."""
ROOM_MAILBOX = 256
"""Ordinary capacity of a room's mailbox (senders wait beyond it)."""
ROOM_RESERVE = 8
"""Reserve of a room's mailbox; rooms receive only ``send``s, so it is spare."""
ACTOR_MAILBOX = 4096
"""Ordinary capacity of the worker, ring and scatter mailboxes (their reserves come on top)."""


@dataclass(frozen=True, slots=True)
class RankIdentity:
    """This rank: NIXL agent name, role, TP rank and size, and its step trace (off by default)."""

    agent_name: str
    role: str
    rank: int
    tp_size: int
    trace: StepTrace = field(default_factory=StepTrace, compare=False, repr=False)

    def stamp(self) -> dict[str, Any]:
        """The sender fields of an outgoing wire message: ``m.AbortAck(room=r, **me.stamp())``."""
        return {"agent": self.agent_name, "rank": self.rank}


class Outbox(Protocol):
    """One-way control messages; never raises and never waits (drops are counted)."""

    def send(self, endpoint: str, message: m.Message) -> bool:
        """Queue ``message`` for ``endpoint``; False when it was dropped."""
        ...

    def count_drop(self, kind: str, ident: bytes, detail: str) -> None:
        """Count (and log) a message of ``kind`` that was refused."""
        ...


class WritePort(Protocol):
    """Making and starting WRITEs, and registering staging memory (the NIXL poller implements it)."""

    def prepare_write(self, spec: WriteSpec) -> int:
        """Make ``spec``'s WRITE without starting it; a handle for :meth:`start_write` or
        :meth:`discard`. Raises AddressRangeError / TransportError when it cannot be made."""
        ...

    def prepare_lists(self, spec: WriteSpec) -> int:
        """Check and prepare ``spec``'s descriptor lists once, for several WRITEs of parts of it
        (:meth:`prepare_indexed`); an id for :meth:`close_lists`. Raises as :meth:`prepare_write`."""
        ...

    def prepare_indexed(self, lists: int, index: np.ndarray, spec: WriteSpec) -> int:
        """Make the WRITE ``spec``, the descriptors ``index`` of ``lists``, without starting it; as
        :meth:`prepare_write` otherwise."""
        ...

    def close_lists(self, lists: int) -> None:
        """No more WRITEs from ``lists`` (released with the last WRITE made from them)."""
        ...

    def table(self, peer: str, key: Hashable) -> int | None:
        """As :meth:`Transport.table <transfer_engine.transport.interface.Transport.table>`."""
        ...

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
        """As :meth:`Transport.prepare_table <transfer_engine.transport.interface.Transport.prepare_table>`
        (the contract of descriptor tables is there)."""
        ...

    def prepare_from_table(
        self, table: int, src_index: np.ndarray, dst_index: np.ndarray, spec: WriteSpec
    ) -> int:
        """As :meth:`Transport.prepare_from_table
        <transfer_engine.transport.interface.Transport.prepare_from_table>`."""
        ...

    def start_write(
        self, handle: int, spec: WriteSpec, reply_to: Mailbox[Any], token: object, *, relaxed: bool = False
    ) -> None:
        """Start a prepared WRITE; ``WriteEnded(token, ...)`` goes to ``reply_to`` when it ends.
        TransportError: not started, the handle is gone, and no reply comes. ``relaxed``: nobody
        waits for its end until :meth:`hurry` (it is looked at less often)."""
        ...

    def start_early(self, handle: int) -> tuple[int, int, int] | None:
        """Start a prepared WRITE from any thread (a completion waiter's); untracked until
        :meth:`adopt`. TransportError: not started, and the handle is gone. Returns, if known, the
        monotonic ns at which the start held the transport's lock and ``transfer()`` had returned,
        and the thread's CPU ns inside ``transfer()``."""
        ...

    def drive(self, handle: int, limit_s: float) -> bool:
        """From the thread that started ``handle``, before :meth:`adopt`: look at its state until it
        ended (True), for ``limit_s`` at most (NIXL sends its notification from a look)."""
        ...

    def adopt(
        self, handle: int, spec: WriteSpec, reply_to: Mailbox[Any], token: object, *, relaxed: bool = False
    ) -> None:
        """On the loop: track a WRITE :meth:`start_early` started; ``WriteEnded(token, ...)`` goes
        to ``reply_to`` when it ends (``relaxed`` as for :meth:`start_write`)."""
        ...

    def hurry(self, reply_to: Mailbox[Any]) -> None:
        """On the loop: ``reply_to``'s relaxed WRITEs are waited for now."""
        ...

    def refused(self, exc: TransferError) -> None:
        """On the loop: count a refusal :meth:`start_early` raised."""
        ...

    def discard(self, handle: int) -> None:
        """Drop a prepared WRITE that was never started."""
        ...

    def register(self, regions: list[MemRegion], mem_type: str) -> int:
        """Register local memory (a staging buffer) with the NIXL agent."""
        ...


class RingPort(Protocol):
    """The decode ring's synchronous entries (the ring actor implements them; all else is mail)."""

    def open_room(self, opened: RoomOpened) -> RegionGranted | None:
        """A staged room exists; called by the room before its TransferRequests leave, on the loop's
        thread. Returns the region of its chunk 0 when the ring grants it with the request."""
        ...

    def free_regions(self, alloc_ids: tuple[int, ...]) -> None:
        """Release these ring allocations (no WRITE into them can land any more); on the loop's
        thread, by the scatter actor once a chunk is copied out and by a room as it ends. Done when
        it returns: a leak check right after a room's ``wait()`` sees the true state."""
        ...


class DrainPort(Protocol):
    def request_drain(self, room: int) -> None:
        """After the next full poll-and-drain cycle, send :class:`~transfer_engine.runtime.mail.Drained` to ``room``."""
        ...

    def listen(self) -> None:
        """A live room hears over NIXL from now on: look for notifications quickly."""
        ...


class PeerBook(dict[str, Peer]):
    """Remote ranks by NIXL agent name. The engine adds and removes them; actors only read.

    ``left`` names the last :data:`LEFT_KEPT` peers that left in good order (``PeerLeaving``, sent
    only once their rooms ended), so that a request of theirs still on its way is told apart from
    one of an agent never known."""

    LEFT_KEPT = 1024

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.left: dict[str, None] = {}

    def live(self) -> list[Peer]:
        return [peer for peer in self.values() if peer.alive]

    def mark_left(self, agent: str) -> None:
        """Remember that ``agent`` left in good order (the oldest such name is forgotten past LEFT_KEPT)."""
        self.left[agent] = None
        while len(self.left) > self.LEFT_KEPT:
            del self.left[next(iter(self.left))]


class RoomBoard:
    """Mailboxes of the live rooms, by room id.

    ``deliver`` waits for room to take the mail (rooms never wait on anyone, so it cannot
    deadlock). ``close`` is called once by the room itself as it ends; ``on_closed`` (the
    supervisor's bookkeeping) runs then.
    """

    def __init__(self, on_closed: Callable[[int], None] = lambda room: None) -> None:
        self._boxes: dict[int, Mailbox[RoomMail]] = {}
        self._on_closed = on_closed

    def __contains__(self, room: object) -> bool:
        return room in self._boxes

    def __len__(self) -> int:
        return len(self._boxes)

    def ids(self) -> list[int]:
        return list(self._boxes)

    def open(self, room: int, box: Mailbox[RoomMail]) -> None:
        if room in self._boxes:
            raise KeyError(f"room {room} is already on the board")
        self._boxes[room] = box

    def get(self, room: int) -> Mailbox[RoomMail] | None:
        return self._boxes.get(room)

    async def deliver(self, room: int, mail: RoomMail) -> bool:
        """Hand ``mail`` to live room ``room``; False when no such room takes mail any more."""
        box = self._boxes.get(room)
        if box is None or box.closed:
            return False
        try:
            await box.send(mail)
        except anyio.ClosedResourceError:
            return False
        return True

    def close(self, room: int, box: Mailbox[RoomMail]) -> None:
        """Room ``room`` (owning ``box``) ended: take it off the board."""
        if self._boxes.get(room) is box:
            del self._boxes[room]
            self._on_closed(room)


class WorkerShards:
    """The prefill workers' mailboxes; every job to one decode agent goes through the same worker."""

    def __init__(self, boxes: list[Mailbox[Any]]) -> None:
        self.boxes = boxes

    def for_agent(self, agent_name: str) -> Mailbox[Any]:
        return self.boxes[zlib.crc32(agent_name.encode()) % len(self.boxes)]

    def index_for(self, agent_name: str) -> int:
        return zlib.crc32(agent_name.encode()) % len(self.boxes)


def _never_stalled(now: float) -> float | None:
    return None


@dataclass
class RoomPorts:
    """Everything a room actor is handed: the same object for every room of an engine.

    ``workers`` exist on prefill ranks; ``ring``, ``ring_port`` and ``scatter`` on decode ranks with a staging
    ring. ``counters`` is the engine's stats sink (rooms only add to it).
    """

    me: RankIdentity
    pool: KVPool
    outbox: Outbox
    peers: PeerBook
    rooms: RoomBoard
    drain: DrainPort
    counters: Counter[str]
    workers: WorkerShards | None = None
    ring: Mailbox[RingMail] | None = None
    ring_port: RingPort | None = None
    scatter: Mailbox[ScatterJob] | None = None
    chunk_cut: ChunkCut = field(default_factory=ChunkCut)
    """Prefill: the whole chunks a room writes as layer groups once it knows the path."""
    checksums: PoolChecksums | None = None
    """Decode: the checksums over this rank's pool a room compares landed chunks with; None when
    ``EngineConfig.integrity`` is off (docs/INTEGRITY.md)."""
    costs: CostBook | None = None
    """Decode: the engine's cost book; a room marks itself started there when its first chunk lands."""
    stall_renewal: Callable[[float], float | None] = _never_stalled
    """At ``now``: None while the engine's loop runs on time; after a stall of the loop that the
    liveness task has not seen yet, the time a leased room's lease may run from
    (``Liveness.stall_renewal``): the peer's heartbeats may be queued unread, so a room judging its
    deadline renews itself as the liveness task will."""
