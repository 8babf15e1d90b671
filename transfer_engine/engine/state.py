"""The state the engine's parts share, and the calls one part makes on another."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio
from anyio.abc import TaskGroup

from transfer_engine.actors.bootstrap import Bootstrap
from transfer_engine.actors.control import Control
from transfer_engine.actors.introspect import Introspect
from transfer_engine.actors.metrics import MetricsServer
from transfer_engine.actors.nixl_poller import NixlPoller
from transfer_engine.actors.ring import RingActor
from transfer_engine.actors.room import RoomActor
from transfer_engine.actors.scatter import ScatterActor
from transfer_engine.actors.worker import TransferWorker
from transfer_engine.config import EngineConfig
from transfer_engine.memory.integrity import PoolChecksums
from transfer_engine.memory.layout import KVPool
from transfer_engine.observe import RoomSnapshot
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.cost import CostBook
from transfer_engine.protocol.retransmit import Tombstones
from transfer_engine.protocol.rooms import Deadlines
from transfer_engine.protocol.stash import EarlyRequests
from transfer_engine.runtime.mail import RoomMail
from transfer_engine.runtime.peers import PrefillInstance
from transfer_engine.runtime.ports import PeerBook, RankIdentity, RoomBoard, RoomPorts
from transfer_engine.transport.nixl import Transport
from transfer_engine.transport.security import Curve

if TYPE_CHECKING:
    from transfer_engine.observe.metrics import Metrics


class EngineState:
    """What the engine's parts share (set by :class:`~transfer_engine.engine.engine.TransferEngine`):
    its configuration, its actors and the books they read. Each part of the engine is a base class
    of TransferEngine over this state; a method one part calls on another is declared here."""

    config: EngineConfig
    pool: KVPool
    agent_name: str
    curve: Curve | None
    deadlines: Deadlines
    rooms: dict[int, RoomActor]
    board: RoomBoard
    me: RankIdentity
    peers: PeerBook
    instances: dict[str, PrefillInstance]
    tombstones: Tombstones
    workers: list[TransferWorker]
    bootstrap: Bootstrap | None
    ring: RingActor | None
    scatter: ScatterActor | None
    poller: NixlPoller
    control: Control
    room_ports: RoomPorts
    counters: Counter[str]
    costs: CostBook
    checksums: PoolChecksums | None
    introspect: Introspect | None
    metrics: Metrics | None
    metrics_server: MetricsServer | None
    started_at: float
    ended_rooms: deque[RoomSnapshot]
    room_ended: Callable[[RoomSnapshot], None] | None
    _transport: Transport | None
    _tg: TaskGroup | None
    _info: m.LayoutInfo
    _compat: int
    _stash: EarlyRequests
    _announced: dict[int, str]
    _connecting: dict[str, anyio.Event]
    _slice_pieces_of: dict[str, float]
    _heartbeat_seq: int

    @property
    def host_staging(self) -> bool:
        """Whether this rank's staging ring is in host memory (``path=host`` or ``staging_memory=host``)."""
        return self.config.path == "host" or self.config.staging_memory == "host"

    @property
    def endpoint(self) -> str:
        """This rank's control endpoint."""
        return self.control.endpoint

    @property
    def introspect_endpoint(self) -> str:
        """Where ``transfer-engine dump --endpoint`` reaches this rank (``tcp://host:port``)."""
        return self.introspect.endpoint if self.introspect is not None else ""

    @property
    def metrics_endpoint(self) -> str | None:
        """``http://host:port/metrics`` when ``metrics_port`` is set, else None."""
        return self.metrics_server.endpoint if self.metrics_server is not None else None

    # --- what one part calls on another (each defined by that part) ---------------------------------

    async def _dispatch(self, message: m.AnyMessage, ident: bytes) -> None:
        """Route one control message (:mod:`transfer_engine.engine.dispatch`)."""
        raise NotImplementedError

    async def _to_room(self, room: int, mail: RoomMail) -> bool:
        """Deliver ``mail`` to a live room; False when no such room is live (dispatch)."""
        raise NotImplementedError

    def _answer(self, answers: list[tuple[str, m.RoomFailed]]) -> None:
        """Send each (decode agent, RoomFailed) owed (dispatch)."""
        raise NotImplementedError

    def _on_peer_hello(self, hello: m.PeerHello) -> m.PeerHelloAck:
        """The prefill side of the handshake (:mod:`transfer_engine.engine.handshake`)."""
        raise NotImplementedError

    async def _heartbeat_loop(self) -> None:
        """Heartbeats, leases and stale requests (:mod:`transfer_engine.engine.liveness`)."""
        raise NotImplementedError

    def _held_by(self, agent: str, rooms: list[int] | None, now: float) -> None:
        """Renew the leases of ``rooms``, which peer ``agent`` holds live (liveness)."""
        raise NotImplementedError

    def _room_closed(self, room: int) -> None:
        """The room board's hook when a room ended (:mod:`transfer_engine.engine.engine`)."""
        raise NotImplementedError

    def worker_for(self, agent_name: str) -> TransferWorker:
        """The prefill worker that serves decode agent ``agent_name`` (supervisor)."""
        raise NotImplementedError
