"""The supervisor: one task group for every actor of a rank, started in order, each ready before the next.

Entering the engine starts the NixlPoller with the rank's registered KV memory, the Control sockets,
the Introspect and metrics servers, the Bootstrap registry where this rank hosts it, the
TransferWorkers (prefill) or the staging ring and scatter actors (decode), and the heartbeat loop.
Leaving it fails live rooms with ``SHUTDOWN``, waits (bounded) for posted WRITEs, and releases every
socket, NIXL handle and registration.
"""

from __future__ import annotations

import atexit
import gc
import logging
import time
import zlib
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio
from anyio.abc import TaskGroup

from transfer_engine.actors.bootstrap import Bootstrap
from transfer_engine.actors.control import Control
from transfer_engine.actors.introspect import Introspect, SnapshotSource
from transfer_engine.actors.metrics import MetricsServer
from transfer_engine.actors.nixl_poller import NixlPoller
from transfer_engine.actors.ring import RingActor
from transfer_engine.actors.room import ReceiverRoomActor, RoomActor
from transfer_engine.actors.scatter import ScatterActor
from transfer_engine.actors.worker import TransferWorker, warm_copy_kernel
from transfer_engine.config import EngineConfig
from transfer_engine.engine.started import host_staging
from transfer_engine.errors import ConfigError, PeerUnreachableError
from transfer_engine.memory.integrity import PoolChecksums
from transfer_engine.memory.layout import KVPool
from transfer_engine.memory.staging import allocate_staging, chunk_region_bytes, warm_staging_kernels
from transfer_engine.observe.stalls import trace_stalls
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.cost import CostBook
from transfer_engine.protocol.layers import ChunkCut
from transfer_engine.runtime.mail import Shutdown
from transfer_engine.runtime.ports import (
    ACTOR_MAILBOX,
    JOBS_PER_ROOM,
    RING_POSTS_PER_ROOM,
    SCATTERS_PER_ROOM,
    PeerBook,
    RankIdentity,
    RoomBoard,
    RoomPorts,
    WorkerShards,
)
from transfer_engine.transport.nixl import NixlTransport, Transport, default_params
from transfer_engine.transport.security import Curve

if TYPE_CHECKING:
    from transfer_engine.observe.metrics import Metrics

SHUTDOWN_DRAIN_S = 10.0
"""How long leaving the engine waits for live rooms to end and posted WRITEs to finish."""


log = logging.getLogger("transfer_engine.engine")


_gc_frozen = False
"""Whether this process's objects were frozen out of CPython's collections (:func:`freeze_gc_once`)."""


def freeze_gc_once() -> None:
    """Once per process, as the first engine has started: collect, then move every object alive
    into CPython's permanent generation (``gc.freeze``), so that later full collections walk only
    what was made since (rooms, messages) instead of torch, NIXL, the pools and the actors, which
    live as long as the process. A full collection over those took 36-47 ms on the CPU box,
    a stall on the loop that moves KV. Later engines of the same process freeze nothing more: what
    is alive then may be a finished test's garbage-to-be, and frozen objects are never collected.

    The interpreter's teardown never walks the permanent generation either, so what was frozen is
    handed back at exit (``atexit``, before modules are torn down). Left frozen, every class stays
    alive past teardown (a class sits in reference cycles of its own: its ``__mro__``, its
    descriptors; only the collector frees it), and for Triton's nanobind classes nanobind reports
    that as ~27 lines of ``leaked ... instances/types/functions`` at every exit."""
    global _gc_frozen
    if _gc_frozen:
        return
    _gc_frozen = True
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
    log.info("gc: %d objects frozen in %.1f ms", gc.get_freeze_count(), (time.perf_counter() - started) * 1e3)


class Supervisor:
    """Starts every actor of the rank under one task group, and stops them (docs/ARCHITECTURE.md).

    Made with the engine, given the books the actors share (the room board and the live rooms, the
    peer book, the counters and cost book) and what the engine alone knows (``route``: where Control
    hands each message; ``snapshot``: what Introspect answers; ``heartbeats``: the liveness loop),
    it makes nothing until :meth:`open`. From then on it holds the actors (``poller``, ``control``,
    ``workers``...), which the other parts reach through it (:class:`~transfer_engine.engine.started.Started`).
    """

    poller: NixlPoller
    control: Control
    room_ports: RoomPorts
    """Everything a room actor is handed (set once the actors are up)."""

    def __init__(
        self,
        config: EngineConfig,
        pool: KVPool,
        me: RankIdentity,
        *,
        curve: Curve | None,
        board: RoomBoard,
        rooms: Mapping[int, RoomActor],
        peers: PeerBook,
        counters: Counter[str],
        costs: CostBook,
        metrics: Metrics | None,
        info: m.LayoutInfo,
        compat: int,
        transport: Transport | None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.me = me
        self.curve = curve
        self.board = board
        self.rooms = rooms
        self.peers = peers
        self.counters = counters
        self.costs = costs
        self.metrics = metrics
        self.transport = transport
        """The rank's NIXL transport (made at :meth:`open` unless one was given)."""
        self._info = info
        self._compat = compat
        self.workers: list[TransferWorker] = []
        self.bootstrap: Bootstrap | None = None
        self.ring: RingActor | None = None
        self.scatter: ScatterActor | None = None
        self.introspect: Introspect | None = None
        self.metrics_server: MetricsServer | None = None
        self.checksums: PoolChecksums | None = None
        self._tg: TaskGroup | None = None

    @property
    def endpoint(self) -> str:
        """This rank's control endpoint."""
        return self.control.endpoint

    def worker_for(self, agent_name: str) -> TransferWorker:
        """The prefill worker that serves decode agent ``agent_name``."""
        return self.workers[zlib.crc32(agent_name.encode()) % len(self.workers)]

    def spawn_room(self, actor: RoomActor) -> None:
        """Start a room's actor in the task group (its room is on the board already)."""
        assert self._tg is not None
        self._tg.start_soon(actor.run, name=f"{actor.side}-room-{actor.room}")
        self.poller.wake(quick=not isinstance(actor, ReceiverRoomActor) or actor.hears_nixl)

    async def open(
        self,
        *,
        route: Callable[[m.AnyMessage, bytes], Awaitable[None]],
        snapshot: SnapshotSource,
        heartbeats: Callable[[], Coroutine[Any, Any, None]],
        stall_renewal: Callable[[float], float | None],
    ) -> None:
        """Start every actor in order; on an error, stop what started and release the transport."""
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        try:
            await self._start(tg, route, snapshot, heartbeats, stall_renewal)
        except BaseException as exc:
            tg.cancel_scope.cancel()
            for worker in self.workers:
                worker.inbox.close()
            try:
                await tg.__aexit__(type(exc), exc, exc.__traceback__)
            except BaseException:
                pass  # the task group re-raises ``exc`` wrapped in a group; the caller gets it bare
            finally:
                self._close_transport()
            raise

    async def _start(
        self,
        tg: TaskGroup,
        route: Callable[[m.AnyMessage, bytes], Awaitable[None]],
        snapshot: SnapshotSource,
        heartbeats: Callable[[], Coroutine[Any, Any, None]],
        stall_renewal: Callable[[float], float | None],
    ) -> None:
        cfg = self.config
        transport = self.transport or NixlTransport(
            self.me.agent_name,
            cfg.nixl_backend,
            default_params(cfg.nixl_backend, cfg.nixl_params, self.pool.device.type),
            progress_thread=cfg.nixl_progress_thread,
            host=cfg.host,  # UCX listens where the control plane does (transport/binding.py)
        )
        self.transport = transport
        transport.register(self.pool.regions(), self.pool.mem_type)
        aux = self.pool.aux_region()
        if aux is not None:
            transport.register(
                [aux], "VRAM" if self.pool.aux is not None and self.pool.aux.is_cuda else "DRAM"
            )
        rooms = self.rooms
        self.poller = NixlPoller(
            transport,
            self.board,
            notifications=cfg.role == "decode",
            poll_interval=cfg.poll_interval,
            busy=(lambda: hears_nixl(rooms)) if cfg.role == "decode" else (lambda: False),
            listening=(lambda: bool(rooms)) if cfg.role == "decode" else (lambda: False),
            spin=cfg.poll_spin,
            trace=self.me.trace,
            num_layers=self.pool.layout.num_layers,
            relaxed=cfg.poll_relaxed,  # (a decode rank posts no WRITEs: nothing of it is relaxed)
        )
        await tg.start(self.poller.run)
        if cfg.path in ("auto", "staged", "host"):  # before any peer can wait on this loop
            started = time.monotonic()
            launches = warm_staging_kernels(self.pool, scatter=cfg.role == "decode")
            if launches:
                log.info(
                    "staging kernels warmed: %d launches in %.2f s", launches, time.monotonic() - started
                )
        if cfg.role == "prefill" and cfg.kernel_path:
            started = time.monotonic()  # the kernel path's copy (one host: what auto takes)
            launches = warm_copy_kernel(self.pool, cfg.layers_per_write)
            if launches:
                log.info("copy kernel warmed: %d launches in %.2f s", launches, time.monotonic() - started)
        self.control = Control(
            cfg.host, cfg.control_port, route, name=f"{cfg.role}{cfg.tp_rank}", curve=self.curve,
            local_notices=cfg.local_notices, receives_notices=cfg.role == "decode",
        )  # fmt: skip
        await tg.start(self.control.run)
        self.introspect = Introspect(
            cfg.host,
            cfg.introspect_port,
            snapshot,
            name=f"{cfg.role}{cfg.tp_rank}",
            secure=None if self.curve is None else self.curve.server,
        )
        await tg.start(self.introspect.run)
        if self.metrics is not None:
            assert cfg.metrics_port is not None
            self.metrics_server = MetricsServer(cfg.host, cfg.metrics_port, self.metrics)
            await tg.start(self.metrics_server.run)
        if cfg.hosts_bootstrap:
            self.bootstrap = Bootstrap(cfg.bootstrap_host, cfg.bootstrap_port, curve=self.curve)
            await tg.start(self.bootstrap.run)
        self.checksums = PoolChecksums(self.pool) if cfg.integrity else None
        if cfg.role == "prefill":
            # default: two chunks, so a worker gathers the next chunk while the last one's WRITE runs
            staging_bytes = cfg.staging_bytes or 2 * chunk_region_bytes(self.pool, cfg.staging_chunk_pages)
            for i in range(cfg.num_workers):
                worker = TransferWorker(
                    i, self.me, self.pool, self.poller, self.board, self.control,
                    staging_bytes=staging_bytes, capacity=ACTOR_MAILBOX, reserve=(JOBS_PER_ROOM + 1) * cfg.max_rooms,
                    early_drive=cfg.early_drive, checksums=self.checksums,
                    table_max_descriptors=cfg.table_max_descriptors,
                )  # fmt: skip
                self.workers.append(worker)
                await tg.start(worker.run)
            await self._register()
        elif cfg.path in ("auto", "staged", "host"):
            await self._start_ring(tg)
        self.room_ports = RoomPorts(
            self.me, self.pool, self.control, self.peers, self.board, self.poller, self.counters,
            workers=WorkerShards([w.inbox for w in self.workers]) if self.workers else None,
            ring=None if self.ring is None else self.ring.inbox,
            ring_port=self.ring,
            scatter=None if self.scatter is None else self.scatter.inbox,
            chunk_cut=ChunkCut(
                {"host": cfg.host_pipeline_layers, "staged": cfg.staged_pipeline_layers},
                cfg.pipeline_min_bytes,
            ),
            checksums=self.checksums,
            costs=self.costs,
            stall_renewal=stall_renewal,
        )  # fmt: skip
        tg.start_soon(heartbeats)
        if cfg.stall_traceback > 0:
            tg.start_soon(
                trace_stalls, cfg.stall_traceback, f"{cfg.role} rank {cfg.tp_rank} {self.me.agent_name}"
            )
        log.info(
            "%s rank %d/%d up: control %s agent %s",
            cfg.role,
            cfg.tp_rank,
            cfg.tp_size,
            self.endpoint,
            self.me.agent_name,
        )
        freeze_gc_once()

    async def _start_ring(self, tg: TaskGroup) -> None:
        """Decode: allocate and register the staging ring, start the ring and scatter actors."""
        cfg = self.config
        size = cfg.ring_bytes
        if size == 0:  # four chunks of `staging_chunk_pages`, but never more than the KV itself
            chunk = chunk_region_bytes(self.pool, cfg.staging_chunk_pages)
            size = max(chunk, min(4 * chunk, chunk_region_bytes(self.pool, self.pool.num_pages)))
        memory = allocate_staging(self.pool, size, host=host_staging(cfg))
        assert self.transport is not None
        self.transport.register([memory.region()], memory.mem_type)
        self.ring = RingActor(
            self.me, self.pool, memory, self.peers, self.control, self.board,
            capacity=ACTOR_MAILBOX, reserve=RING_POSTS_PER_ROOM * cfg.max_rooms,
            grant_ahead=cfg.grant_with_request,
        )  # fmt: skip
        await tg.start(self.ring.run)
        self.scatter = ScatterActor(
            self.pool,
            memory,
            self.ring,
            self.board,
            capacity=ACTOR_MAILBOX,
            reserve=SCATTERS_PER_ROOM * cfg.max_rooms,
            checksums=self.checksums,
        )
        await tg.start(self.scatter.run)
        log.info("decode rank %d: %s staging ring of %d bytes", cfg.tp_rank, memory.mem_type, size)

    async def close(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
        *,
        leaving: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Fail live rooms with SHUTDOWN, wait (bounded) for them and for posted WRITEs, then run
        ``leaving`` (the engine tells its peers it leaves, bounded) while the sockets are still open,
        stop every actor and release the transport."""
        assert self._tg is not None
        tg = self._tg
        with anyio.CancelScope(shield=True):
            for actor in list(self.rooms.values()):
                try:
                    actor.inbox.send_nowait(Shutdown())
                except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError):
                    pass
            with anyio.move_on_after(SHUTDOWN_DRAIN_S):
                for actor in list(self.rooms.values()):
                    if not actor.status.final or actor.side == "prefill":
                        await actor.done.wait()
            await self.poller.drain_posted(SHUTDOWN_DRAIN_S)
            if leaving is not None:
                with anyio.move_on_after(SHUTDOWN_DRAIN_S):
                    await leaving()
            for worker in self.workers:
                worker.inbox.close()
            if self.ring is not None:
                self.ring.inbox.close()
            if self.scatter is not None:
                self.scatter.inbox.close()
            tg.cancel_scope.cancel()
        try:
            await tg.__aexit__(exc_type, exc, tb)
        finally:
            if self.checksums is not None:  # its thread: no room waits for a check any more
                self.checksums.close()
            self._close_transport()

    def _close_transport(self) -> None:
        if self.transport is not None:
            self.transport.close()

    async def _register(self) -> None:
        cfg = self.config
        msg = m.RegisterRank(
            rank=cfg.tp_rank,
            tp_size=cfg.tp_size,
            endpoint=self.endpoint,
            layout=self._info,
            compat=self._compat,
        )
        deadline = time.monotonic() + cfg.bootstrap_timeout
        while True:
            try:
                reply = await self.control.request(cfg.bootstrap_endpoint, msg, min(cfg.connect_timeout, 1.0))
                break
            except PeerUnreachableError:
                if time.monotonic() > deadline:
                    raise
        if not isinstance(reply, m.RegisterAck) or not reply.ok:
            raise ConfigError(f"bootstrap {cfg.bootstrap_endpoint} refused rank {cfg.tp_rank}: {reply}")


def hears_nixl(rooms: Mapping[int, RoomActor]) -> bool:
    """Whether a live decode room waits for notifications over NIXL (the poller's ``busy``): any but a
    kernel-path room without an aux item (docs/DECISIONS.md, "The decode's poller is quick only for
    rooms that hear over NIXL")."""
    return any(not isinstance(r, ReceiverRoomActor) or r.hears_nixl for r in rooms.values())
