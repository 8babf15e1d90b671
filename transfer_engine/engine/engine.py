"""The engine of one rank (docs/ARCHITECTURE.md): :class:`TransferEngine`, the supervisor of its actors.

``async with TransferEngine(config, kv) as engine`` starts every actor of the rank under one task
group and stops them on the way out. The engine is made of parts, each given only what it uses, that
call each other downward only: the :class:`~transfer_engine.engine.supervisor.Supervisor` (the
actors' task group), the :class:`~transfer_engine.engine.rooms.RoomTable` (the live rooms), the
:class:`~transfer_engine.engine.handshake.Handshake`, :class:`~transfer_engine.engine.dispatch.Dispatch`,
:class:`~transfer_engine.engine.liveness.Liveness` and :class:`~transfer_engine.engine.paths.PathPolicy`.
This module holds the books they share, the API that opens rooms (``sender()``, ``receiver()``,
``connect()``) and the wiring. Rooms are actors started per request: the engine hands each what it
needs when it makes it, or by mail, and never changes a room itself.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter, deque
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Self

import anyio
import numpy as np

from transfer_engine.actors.bootstrap import Bootstrap
from transfer_engine.actors.control import Control
from transfer_engine.actors.introspect import Introspect
from transfer_engine.actors.metrics import MetricsServer, load_metrics
from transfer_engine.actors.nixl_poller import NixlPoller
from transfer_engine.actors.ring import RingActor
from transfer_engine.actors.room import ReceiverRoomActor, RoomActor, SenderRoomActor
from transfer_engine.actors.scatter import ScatterActor
from transfer_engine.actors.worker import TransferWorker
from transfer_engine.config import EngineConfig
from transfer_engine.engine.checks import check_pages, check_room
from transfer_engine.engine.dispatch import Dispatch
from transfer_engine.engine.handles import Receiver, Sender
from transfer_engine.engine.handshake import Handshake
from transfer_engine.engine.liveness import Liveness
from transfer_engine.engine.paths import PathPolicy
from transfer_engine.engine.rooms import RoomTable
from transfer_engine.engine.snapshot import build_snapshot, record_ended
from transfer_engine.engine.started import host_staging
from transfer_engine.engine.supervisor import Supervisor
from transfer_engine.errors import ConfigError
from transfer_engine.memory.integrity import PoolChecksums
from transfer_engine.memory.layout import KVPool
from transfer_engine.observe import ENDED_ROOMS_KEPT, RoomSnapshot
from transfer_engine.protocol import heads, leases
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.cost import DEFAULT_PRIOR_RATE, CostBook, PeerLoad
from transfer_engine.protocol.layers import check_layers_per_write
from transfer_engine.protocol.retransmit import Tombstones
from transfer_engine.protocol.rooms import Deadlines
from transfer_engine.protocol.stash import EarlyRequests
from transfer_engine.runtime.mail import LocalAbort, RequestPages
from transfer_engine.runtime.peers import Peer, PrefillInstance
from transfer_engine.runtime.ports import PeerBook, RankIdentity, RoomBoard, RoomPorts
from transfer_engine.runtime.steptrace import StepTrace
from transfer_engine.transport.nixl import Transport
from transfer_engine.transport.probe import LinkProbe
from transfer_engine.transport.security import Curve

log = logging.getLogger("transfer_engine.engine")


class TransferEngine:
    """One rank's transfer engine; use as ``async with TransferEngine(config, kv) as engine``."""

    def __init__(self, config: EngineConfig, kv: KVPool, *, transport: Transport | None = None) -> None:
        if (config.tp_size, config.tp_rank) != (kv.tp_size, kv.tp_rank):
            raise ConfigError(
                f"config tp_size/tp_rank={config.tp_size}/{config.tp_rank} but the KV pool is for "
                f"{kv.tp_size}/{kv.tp_rank}"
            )
        self.config = config
        self.pool = kv
        self.agent_name = config.agent_name or f"te-{config.role}-{config.tp_rank}-{os.getpid()}-{id(self):x}"
        self.curve = Curve.from_config(config)
        """Control-plane CURVE keys (None: off); loaded here so a bad key file fails the constructor."""
        self.deadlines = Deadlines(
            config.bootstrap_timeout,
            config.waiting_timeout,
            config.transfer_timeout,
            leases.room_lease(config.room_lease, config.heartbeat_interval),
        )
        self.me = RankIdentity(
            self.agent_name,
            config.role,
            config.tp_rank,
            config.tp_size,
            StepTrace(config.trace_steps, config.role),
        )
        self.peers = PeerBook()
        self._stash = EarlyRequests()
        self._announced: dict[int, str] = {}
        """Decode: rooms of requests queued here whose ``receiver()`` comes later, by the bootstrap of
        their prefill instance (:meth:`announce`)."""
        self.tombstones = Tombstones(config.bootstrap_timeout + config.transfer_timeout)
        """Prefill: outcomes of rooms no longer live, to answer repeated requests (protocol.retransmit)."""
        self.counters: Counter[str] = Counter()
        self.costs = CostBook(prior_rate=DEFAULT_PRIOR_RATE)
        """Decode: per prefill instance (its bootstrap address), the rooms queued and in flight and the
        measured rate: :meth:`estimate_transfer` (docs/INTEGRITY.md, "The cost signal")."""
        self.started_at = time.monotonic()
        self.ended_rooms: deque[RoomSnapshot] = deque(maxlen=ENDED_ROOMS_KEPT)
        """Final snapshots of the latest rooms that ended, oldest first (for ``transfer-engine dump``)."""
        self.metrics = (
            load_metrics(config.metrics_port, lambda: build_snapshot(self))
            if config.metrics_port is not None
            else None
        )
        """Prometheus metrics (``metrics_port``); ConfigError above when prometheus-client is missing."""
        self.room_ended = None if self.metrics is None else self.metrics.room_ended
        """Called with each ended room's final snapshot (the metrics' histograms)."""
        info = kv.info()
        compat = m.compat_hash(info)
        self._table = RoomTable(
            config.max_rooms, self.counters, self.costs, self.tombstones,
            lambda actor: record_ended(self, actor, self.ended_rooms),
        )  # fmt: skip
        self._supervisor = Supervisor(
            config, kv, self.me, curve=self.curve, board=self._table.board, rooms=self._table.rooms,
            peers=self.peers, counters=self.counters, costs=self.costs, metrics=self.metrics,
            info=info, compat=compat, transport=transport,
        )  # fmt: skip
        started = self._supervisor
        self._handshake = Handshake(
            config, kv, self.agent_name, started, self.peers, info, compat, self.costs
        )
        self._paths = PathPolicy(config, kv, started)
        self._liveness = Liveness(
            config, self.agent_name, started, rooms=self._table.rooms, board=self._table.board,
            peers=self.peers, stash=self._stash, announced=self._announced,
            instances=self._handshake.instances, forget=self._forget_instances, counters=self.counters,
        )  # fmt: skip
        self._dispatch = Dispatch(
            config, self.me, started, board=self._table.board, peers=self.peers, stash=self._stash,
            tombstones=self.tombstones, counters=self.counters,
            hello=self._handshake.on_peer_hello, held_by=self._liveness.held_by,
        )  # fmt: skip

    # --- lifecycle (:mod:`transfer_engine.engine.supervisor`) -------------------------------------

    async def __aenter__(self) -> Self:
        await self._supervisor.open(
            route=self._route,
            snapshot=lambda room: build_snapshot(self, room),
            heartbeats=self._background,
            stall_renewal=self._liveness.stall_renewal,
        )
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._supervisor.close(exc_type, exc, tb, leaving=self._handshake.leave)
        self._handshake.close()  # the workers are gone: no copy into a mapped pool is in flight

    async def _background(self) -> None:
        """The engine's own loops: heartbeats and leases, and the link probes run in the background."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._liveness.run)
            tg.start_soon(self._handshake.run)

    async def _route(self, message: m.AnyMessage, ident: bytes) -> None:
        """Where Control hands each message: a peer's PeerLeaving to liveness (answered), the rest to
        :class:`~transfer_engine.engine.dispatch.Dispatch`."""
        if isinstance(message, m.PeerLeaving):
            await self.control.reply_to(ident, await self._liveness.on_leaving(message))
        else:
            await self._dispatch.route(message, ident)

    def _forget_instances(self, peer: Peer) -> None:
        """``peer`` died: forget the prefill instances it is a rank of, and what was measured of them."""
        for bootstrap in self._handshake.forget(peer):
            self._paths.forget(bootstrap)

    # --- state --------------------------------------------------------------------------------------

    @property
    def rooms(self) -> dict[int, RoomActor]:
        """The live rooms' actors by room id (read only: the room table changes it)."""
        return self._table.rooms

    @property
    def board(self) -> RoomBoard:
        """The live rooms' mailboxes: how every actor addresses a room."""
        return self._table.board

    @property
    def instances(self) -> dict[str, PrefillInstance]:
        """Decode: the prefill instances this rank connected to, by bootstrap address."""
        return self._handshake.instances

    @property
    def links(self) -> dict[str, LinkProbe]:
        """Decode: the link probe of each prefill rank that writes here, by agent (read only)."""
        return self._handshake.links

    @property
    def host_staging(self) -> bool:
        """Whether this rank's staging ring is in host memory (``path=host`` or ``staging_memory=host``)."""
        return host_staging(self.config)

    @property
    def poller(self) -> NixlPoller:
        return self._supervisor.poller

    @property
    def control(self) -> Control:
        return self._supervisor.control

    @property
    def room_ports(self) -> RoomPorts:
        return self._supervisor.room_ports

    @property
    def workers(self) -> list[TransferWorker]:
        return self._supervisor.workers

    @property
    def ring(self) -> RingActor | None:
        return self._supervisor.ring

    @property
    def scatter(self) -> ScatterActor | None:
        return self._supervisor.scatter

    @property
    def bootstrap(self) -> Bootstrap | None:
        return self._supervisor.bootstrap

    @property
    def introspect(self) -> Introspect | None:
        return self._supervisor.introspect

    @property
    def metrics_server(self) -> MetricsServer | None:
        return self._supervisor.metrics_server

    @property
    def checksums(self) -> PoolChecksums | None:
        return self._supervisor.checksums

    @property
    def _transport(self) -> Transport | None:
        return self._supervisor.transport

    @property
    def endpoint(self) -> str:
        """This rank's control endpoint."""
        return self._supervisor.endpoint

    @property
    def introspect_endpoint(self) -> str:
        """Where ``transfer-engine dump --endpoint`` reaches this rank (``tcp://host:port``)."""
        return self.introspect.endpoint if self.introspect is not None else ""

    @property
    def metrics_endpoint(self) -> str | None:
        """``http://host:port/metrics`` when ``metrics_port`` is set, else None."""
        return self.metrics_server.endpoint if self.metrics_server is not None else None

    def worker_for(self, agent_name: str) -> TransferWorker:
        """The prefill worker that serves decode agent ``agent_name``."""
        return self._supervisor.worker_for(agent_name)

    def leaks(self) -> dict[str, int]:
        """What is still held: rooms, stashed messages, NIXL handles in flight. All 0 when idle (a link
        probe's WRITE is not counted: the probe releases its handle itself, within ``connect_timeout``)."""
        handles = self._transport.live_handles() - self._handshake.probing if self._transport else 0
        return {
            "rooms": len(self.rooms),
            "stashed": len(self._stash),
            "announced": len(self._announced),
            "nixl_handles": max(handles, 0),
            "writes_in_flight": self.poller.in_flight(),
            "ring_allocations": self.ring.live() if self.ring else 0,
            "staging_leases": sum(w.leases() for w in self.workers),
            "parked_chunks": sum(w.parked + w.awaiting_grant + w.layer_jobs for w in self.workers),
        }

    # --- prefill API ----------------------------------------------------------------------------

    def sender(self, room: int, *, layers_per_write: int | None = None) -> Sender:
        """Open ``room`` on this prefill rank. RoomInUseError while a room with that id is live.

        A room that a decode rank aborted before this rank opened it (its Abort came first, with or
        without a request) opens failed, ABORTED: it can no longer complete, and its ``wait()``
        returns at once instead of at ``bootstrap_timeout``.

        ``layers_per_write``: this room's layer grouping for layer-wise chunks (None: the config's).
        """
        if self.config.role != "prefill":
            raise ConfigError("sender() is for prefill engines; this one is decode")
        check_room(room)
        per_write = check_layers_per_write(
            self.config.layers_per_write if layers_per_write is None else layers_per_write
        )
        self._table.check_unused(room)
        self._table.check_capacity(room)
        ended = self.tombstones.get(room, time.monotonic())
        aborted_before = not self.tombstones.reopen(room)
        aborted_by = ended.aborted_by if aborted_before and ended is not None else frozenset()
        actor = SenderRoomActor(self.room_ports, room, self.deadlines, aborted_by=aborted_by)
        self._start_room(actor)
        for request in self._stash.take(room):
            actor.inbox.send_nowait(request)
        if aborted_before:  # a decode rank aborted the room before this rank opened it: it cannot
            assert ended is not None  # complete, so it fails now instead of at bootstrap_timeout
            actor.inbox.send_nowait(LocalAbort(ended.detail))
        return Sender(actor, self.pool, per_write)

    # --- decode API -----------------------------------------------------------------------------

    async def receiver(
        self,
        room: int,
        bootstrap: str,
        pages: Sequence[int] | np.ndarray | Any | None = None,
        aux_slot: int | None = None,
        decode_prefix_len: int = 0,
    ) -> Receiver:
        """Open ``room`` on this decode rank; its KV goes into ``pages`` (this rank's page indices).

        Connects to the prefill instance behind ``bootstrap`` the first time (raising
        PeerUnreachableError, or LayoutError for an incompatible layout) and returns with the room
        in WaitingForInput. With ``pages`` the room has them when it is made and sends its
        TransferRequests as soon as it runs; without, at :meth:`Receiver.request`. Bad arguments raise before anything is
        registered.
        """
        if self.config.role != "decode":
            raise ConfigError("receiver() is for decode engines; this one is prefill")
        self.me.trace.mark(room, "receiver")
        check_room(room)
        checked = None if pages is None else check_pages(self.pool, pages, aux_slot, decode_prefix_len)
        self._table.check_unused(room)
        self._announced.pop(room, None)
        instance = await self._handshake.instance(bootstrap)
        self._table.check_unused(room)
        self._table.check_capacity(room)
        path, why = self._paths.choose(instance, checked)
        layout = self.pool.layout
        D, d = self.config.tp_size, self.config.tp_rank
        writers = heads.writers_of(layout.num_heads, instance.tp_size, D, d, layout.mla)
        actor = ReceiverRoomActor(
            self.room_ports, room, self.deadlines, {w.prefill_rank: instance.ranks[w.prefill_rank] for w in writers},
            everyone=list(instance.ranks), slices=list(writers), path=path,
            request=None if checked is None else RequestPages(checked, aux_slot, decode_prefix_len),
        )  # fmt: skip
        actor.path_reason = why
        self._start_room(actor)  # before any request leaves: a prefill must never write for no room
        self.costs.queued(room, bootstrap, 0 if checked is None else len(checked) * self.pool.page_bytes)
        if checked is not None:  # its requests leave now (without pages: at its first landing)
            self.costs.started(room, time.monotonic())
            actor.send_unsent()  # here, not a loop turn later in the room's task
        log.debug("decode room %d: %s, %d writers, path %s (%s)", room, bootstrap, len(writers), path, why)
        return Receiver(actor, self.pool)

    def estimate_transfer(self, peer: str, nbytes: int) -> float:
        """Seconds a new room of ``nbytes`` (this rank's KV bytes) from the prefill instance behind
        ``peer`` (its bootstrap address, as given to :meth:`receiver`) would take if opened now: behind
        every byte of this rank's rooms with it queued and in flight, at the rate measured of it (a
        moving average over busy time; ``protocol.cost.DEFAULT_PRIOR_RATE`` before any room ended).
        A router asks each decode instance and picks the least (``protocol.cost.choose``). Cheap, pure
        bookkeeping; call it on the engine's loop (BlockingEngine: from any thread)."""
        if nbytes < 0:
            raise ConfigError(f"nbytes={nbytes} must be >= 0")
        return self.costs.estimate(peer, nbytes)

    def transfer_costs(self) -> dict[str, PeerLoad]:
        """Per prefill instance (bootstrap address): rooms and bytes queued and in flight, and the rate."""
        return self.costs.loads()

    async def announce(self, room: int, bootstrap: str) -> None:
        """Announce ``room``, whose request is queued on this decode and whose :meth:`receiver` comes
        later (its pages are not allocated yet): until then, heartbeats to the prefill instance behind
        ``bootstrap`` list the room as held live, which renews that instance's lease on a room it
        opened and no decode rank asked for yet (the prefill finished first and holds its KV: vLLM's
        sequential router protocol, docs/vllm.md). Connects first (PeerUnreachableError, LayoutError
        as :meth:`receiver`; the room is not announced then). :meth:`receiver` or :meth:`withdraw`
        ends the announcement."""
        if self.config.role != "decode":
            raise ConfigError("announce() is for decode engines; this one is prefill")
        check_room(room)
        self._announced[room] = bootstrap  # before connecting: a receiver() called next removes it
        try:
            await self._handshake.instance(bootstrap)
        except BaseException:
            if self._announced.get(room) == bootstrap:
                del self._announced[room]
            raise

    def withdraw(self, room: int) -> None:
        """End :meth:`announce` of ``room`` (its request ended without a receiver)."""
        self._announced.pop(room, None)

    async def connect(self, bootstrap: str) -> None:
        """Handshake with the prefill instance behind ``bootstrap`` now, ahead of its first room."""
        if self.config.role != "decode":
            raise ConfigError("connect() is for decode engines; this one is prefill")
        await self._handshake.instance(bootstrap)

    # --- rooms ----------------------------------------------------------------------------------

    def _start_room(self, actor: RoomActor) -> None:
        self._table.open(actor)
        self._supervisor.spawn_room(actor)
