"""The engine, the supervisor of one rank's actors (docs/ARCHITECTURE.md): :class:`TransferEngine`, its :class:`Sender` and :class:`Receiver`.

``TransferEngine`` is the supervisor actor. Entering it starts every other actor under one task
group (each reports ready through ``tg.start`` only once its resources exist): the NixlPoller with
the rank's registered KV memory, the Control sockets, the Bootstrap registry where this rank hosts
it, the TransferWorkers (prefill) and the heartbeat loop. Rooms are actors started per request.
Leaving it fails live rooms with ``SHUTDOWN``, waits (bounded) for posted WRITEs, and releases
every socket, NIXL handle and registration.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import zlib
from collections import Counter, deque
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import anyio
import numpy as np
import torch
from anyio.abc import TaskGroup

from transfer_engine.actors.bootstrap import Bootstrap
from transfer_engine.actors.control import Control
from transfer_engine.actors.introspect import Introspect
from transfer_engine.actors.metrics import MetricsServer, load_metrics
from transfer_engine.actors.nixl_poller import NixlPoller
from transfer_engine.actors.ring import RingActor
from transfer_engine.actors.room import ReceiverRoomActor, SenderRoomActor, _RoomActor
from transfer_engine.actors.scatter import ScatterActor
from transfer_engine.actors.worker import TransferWorker
from transfer_engine.config import EngineConfig
from transfer_engine.errors import (
    ConfigError,
    FailureReason,
    LayoutError,
    LocalProtocolError,
    PeerUnreachableError,
    RemoteProtocolError,
    RoomInUseError,
    RoomLimitError,
    TransferError,
)
from transfer_engine.memory.layout import KVPool, stride_rows_of
from transfer_engine.memory.staging import allocate_staging, chunk_region_bytes, warm_staging_kernels
from transfer_engine.observe import ENDED_ROOMS_KEPT, RoomSnapshot
from transfer_engine.observe.build import build_snapshot, record_ended
from transfer_engine.protocol import descriptors, handshake, heads, leases
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.cadence import GroupCadence
from transfer_engine.protocol.layers import ChunkCut, LayerChunks, check_layers_per_write
from transfer_engine.protocol.paths import auto_path, is_staged
from transfer_engine.protocol.polling import polled
from transfer_engine.protocol.retransmit import Ended, Late, Tombstones, answer_late_request
from transfer_engine.protocol.rooms import Deadlines, RoomStatus
from transfer_engine.protocol.stash import EarlyRequests
from transfer_engine.runtime.mail import (
    LayersReady,
    LocalAbort,
    PeerDead,
    QueueChunk,
    Ready,
    RepeatStaging,
    RoomMail,
    Shutdown,
    Subscribe,
)
from transfer_engine.runtime.peers import Peer, PrefillInstance
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
from transfer_engine.runtime.steptrace import StepTrace
from transfer_engine.transport.nixl import NixlTransport, RemotePeer, Transport, default_params
from transfer_engine.transport.security import Curve

log = logging.getLogger(__name__)

MAX_ROOM_ID = (1 << 63) - 1
SHUTDOWN_DRAIN_S = 10.0


def _pages_array(pages: Sequence[int] | np.ndarray | Any, pool: KVPool, what: str) -> np.ndarray:
    arr = np.asarray(pages.cpu() if hasattr(pages, "cpu") else pages)
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise ConfigError(
            f"{what} must be a non-empty 1-D sequence of integers, got {arr.dtype} shape {arr.shape}"
        )
    arr = arr.astype(np.int64)
    bad = np.flatnonzero((arr < 0) | (arr >= pool.num_pages))
    if bad.size:
        raise LayoutError(f"{what} contains page {int(arr[bad[0]])}, outside [0, {pool.num_pages})")
    return arr


def _check_request(
    pool: KVPool, pages: Sequence[int] | np.ndarray | Any, aux_slot: int | None, decode_prefix_len: int
) -> np.ndarray:
    """A decode room's pages as an int64 array; ConfigError/LayoutError naming a bad argument."""
    arr = _pages_array(pages, pool, "pages")
    pool.check_aux_slot(aux_slot)
    page_size = pool.layout.page_size
    if (
        not isinstance(decode_prefix_len, int)
        or isinstance(decode_prefix_len, bool)
        or decode_prefix_len < 0
        or decode_prefix_len % page_size
    ):
        raise ConfigError(
            f"decode_prefix_len={decode_prefix_len!r} must be a non-negative multiple of page_size={page_size}"
        )
    return arr


def _check_room(room: int) -> None:
    if not isinstance(room, int) or not 0 <= room <= MAX_ROOM_ID:
        raise ConfigError(f"room={room!r} must be an integer in [0, 2**63)")


def _recorded(stream: torch.cuda.Stream) -> torch.cuda.Event:
    """A CUDA event recorded on ``stream`` now: it completes once the work queued on it so far has."""
    event = torch.cuda.Event()
    event.record(stream)
    return event


class _Handle:
    def __init__(self, actor: _RoomActor) -> None:
        self._actor = actor
        self._live = RoomStatus.BOOTSTRAPPING if actor.status.final else actor.status

    @property
    def room(self) -> int:
        return self._actor.room

    def poll(self) -> RoomStatus:
        """The room's status now; never blocks, and may be called from any thread (it only reads).

        Success and Failed are reported only once the room has ended (final AND quiescent): from
        then on no WRITE of it can land, so a caller that acts on poll() alone may free or reuse
        the room's pages at once. A room that failed but still waits for WRITEs or AbortAcks
        keeps reporting the last status this handle saw before (``failure`` already says why).
        """
        status = self._actor.status
        if not status.final:
            self._live = status
            return status
        return polled(status, self._actor.done.is_set(), self._live)

    @property
    def failure(self) -> tuple[FailureReason, str] | None:
        """``(reason, detail)`` as soon as the room failed (before poll() reports it), else None."""
        f = self._actor.core.failure
        return None if f is None else (f.reason, f.detail)

    async def wait(self) -> None:
        """Return once the room succeeded and nothing of it is in flight; raise TransferFailed otherwise."""
        await self._actor.done.wait()
        self._actor.ports.me.trace.mark(self.room, "waited")
        error = self._actor.error()
        if error is not None:
            raise error

    async def wait_bootstrapped(self) -> None:
        """Return once the room has left Bootstrapping: on a prefill, every decode rank's
        TransferRequest is in (WaitingForInput, or further on after an early ``send()``); a decode
        room has left it when :meth:`TransferEngine.receiver` returns. Raises the room's
        TransferFailed if it failed instead, once nothing of it is in flight (as :meth:`wait`).

        The awaitable form of polling until ``poll()`` is no longer BOOTSTRAPPING: it returns as the
        room's mail changes the status, with no polling interval added to the room's latency.
        """
        actor = self._actor
        while actor.status is RoomStatus.BOOTSTRAPPING and not actor.done.is_set():
            await actor.status_changed.wait()
        if actor.status is RoomStatus.FAILED:
            await self.wait()

    async def abort(self, detail: str = "aborted by the application") -> None:
        """Stop the room at any point; returns when no WRITE of it can still land. Idempotent."""
        if not self._actor.done.is_set():
            try:
                await self._actor.inbox.send(LocalAbort(detail))
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                pass
        await self._actor.done.wait()


class Sender(_Handle):
    """Prefill side of one room. Created by :meth:`TransferEngine.sender`.

    Chunks go out in ``send()`` order. The last one is marked by ``last=True``, or, once
    :meth:`expect` gave the room's page count, by the page count reaching it.
    """

    def __init__(
        self,
        actor: SenderRoomActor,
        pool: KVPool,
        layers_per_write: int = 4,
        pipeline: tuple[int, int] = (0, 0),
    ) -> None:
        super().__init__(actor)
        self._room_actor = actor
        self._pool = pool
        self._sealed = False
        self._total: int | None = None
        self._aux_slot: int | None = None
        self._sent = 0
        self._chunks = 0
        self._layers = LayerChunks(pool.layout.num_layers, layers_per_write)
        self._pipeline_layers, self._pipeline_min_bytes = pipeline
        """``EngineConfig.pipeline_layers`` and ``pipeline_min_bytes``: when send() cuts a chunk into groups."""
        self._waits: list[Ready] = []
        """The ``ready`` of each layers_ready() call since the last group went out (None left out)."""
        self._pending_stream: torch.cuda.Stream | None = None
        """CUDA: the stream of the layers_ready() calls without ``ready`` since the last event recorded
        for them; one event on it, recorded when the group closes (or the caller's stream changes),
        covers them all."""

    @property
    def decode_prefix_len(self) -> int:
        """Tokens the decode side already holds (0 until its requests arrived): send only the rest.

        Pages given to ``send()`` are those of tokens ``decode_prefix_len`` onwards, in order.
        """
        return self._room_actor.decode_prefix_len

    def expect(self, total_pages: int, aux_slot: int | None = None) -> None:
        """Declare the room's page count (and the aux slot of its last chunk) before its last chunk.

        From then on ``send(pages)`` marks the chunk that reaches ``total_pages`` as the last and
        refuses pages beyond it. ConfigError for a count below the pages already sent, LayoutError
        for an aux slot outside the pool, LocalProtocolError after the last chunk or a second call.
        """
        if not isinstance(total_pages, int) or isinstance(total_pages, bool) or total_pages < 1:
            raise ConfigError(f"total_pages={total_pages!r} must be a positive integer")
        self._pool.check_aux_slot(aux_slot)
        if self._sealed:
            raise LocalProtocolError(f"room {self.room} already sent its last chunk")
        if self._total is not None:
            raise LocalProtocolError(f"room {self.room} already expects {self._total} pages")
        if total_pages <= self._sent:
            raise ConfigError(
                f"total_pages={total_pages} but room {self.room} already sent {self._sent} pages"
            )
        self._total = total_pages
        self._aux_slot = aux_slot

    def _prepare(
        self,
        pages: Sequence[int] | np.ndarray | Any,
        last: bool | None,
        aux_slot: int | None,
        ready: torch.cuda.Event | None,
        layerwise: bool = False,
    ) -> QueueChunk:
        """Validate one send() (or begin_chunk()) and return its mail; changes this handle's counts
        only when valid."""
        arr = _pages_array(pages, self._pool, "pages")
        self._pool.check_aux_slot(aux_slot)
        self._layers.check_open(self._chunks)
        if self._sealed:
            raise LocalProtocolError(f"room {self.room} already sent its last chunk")
        if self._actor.done.is_set() or self._actor.status.final:
            raise LocalProtocolError(f"room {self.room} is {self._actor.status.name}; send() is not allowed")
        sent = self._sent + arr.size
        if self._total is not None:
            if sent > self._total:
                raise ConfigError(
                    f"{arr.size} pages would make {sent}, over the room's total_pages={self._total}"
                )
            if last is not None and last != (sent == self._total):
                raise ConfigError(
                    f"last={last} but the room has sent {sent} of total_pages={self._total} pages"
                )
            last = sent == self._total
            if aux_slot is None:
                aux_slot = self._aux_slot
        last = bool(last)
        if ready is None and self._pool.device.type == "cuda" and not layerwise:
            # the KV of this chunk is written by work queued so far on the caller's stream
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self._pool.device))
        pipelined = not layerwise and self._pipelines(arr.size)
        if layerwise or pipelined:
            self._layers.open(self._chunks)
        self._sealed = last
        self._sent = sent
        self._chunks += 1
        return QueueChunk(arr, last, aux_slot, ready, layerwise or pipelined)

    def _pipelines(self, pages: int) -> bool:
        """Whether send() of ``pages`` pages goes out as layer groups (``EngineConfig.pipeline_layers``)."""
        per = self._pipeline_layers
        if not per or per >= self._pool.layout.num_layers:
            return False
        return chunk_region_bytes(self._pool, pages) >= self._pipeline_min_bytes

    def _groups_of(self, chunk: QueueChunk) -> list[LayersReady]:
        """The layer groups of a chunk that send() cuts (every layer ready once ``chunk.ready`` is)."""
        waits: tuple[Ready, ...] = () if chunk.ready is None else (chunk.ready,)
        return [LayersReady(group, waits) for group in self._layers.ready_in_groups(self._pipeline_layers)]

    def _prepare_layers(self, start: int, end: int, ready: Ready) -> LayersReady | None:
        """Validate one layers_ready() and return the group's mail when a group is complete (else
        None); changes nothing when invalid.

        Called once per layer from inside a forward, so it does no more than it must: on CUDA a call
        without ``ready`` records no event unless it closes a group (or the caller's current stream
        changed since the last such call): work queued on a stream is ordered, so the one event
        recorded when the group closes covers every layer of the group that stream wrote.
        """
        status = self._actor.status
        # A rank that writes nothing to any decode rank of the room succeeds once its last chunk is
        # queued; the layers of that chunk are still reported (and validated), and go nowhere.
        writes_nothing = status is RoomStatus.SUCCESS and self._layers.is_open
        if (self._actor.done.is_set() or status.final) and not writes_nothing:
            raise LocalProtocolError(f"room {self.room} is {status.name}; layers_ready() is not allowed")
        self._layers.check_ready(start, end)
        cuda = self._pool.device.type == "cuda"
        if ready is not None and not isinstance(ready, threading.Event | torch.cuda.Event):
            raise ConfigError(f"ready={ready!r} must be a torch.cuda.Event, a threading.Event or None")
        if isinstance(ready, torch.cuda.Event) and not cuda:
            raise ConfigError(f"ready={ready!r} is a CUDA event but this KV pool is on {self._pool.device}")
        group = self._layers.ready(start, end)
        if ready is not None:
            self._waits.append(ready)
        elif cuda:
            # the layers are written by work queued so far on the caller's stream
            stream = torch.cuda.current_stream(self._pool.device)
            if self._pending_stream is not None and self._pending_stream != stream:
                self._waits.append(_recorded(self._pending_stream))
            self._pending_stream = stream
        if group is None:
            return None
        if self._pending_stream is not None:
            self._waits.append(_recorded(self._pending_stream))
            self._pending_stream = None
        waits = tuple(self._waits)
        self._waits = []
        return None if writes_nothing else LayersReady(group, waits)

    async def begin_chunk(
        self, pages: Sequence[int] | np.ndarray | Any, last: bool | None = None, aux_slot: int | None = None
    ) -> None:
        """Open the next chunk for layer-wise sending: its pages, ``last`` and ``aux_slot`` as for
        :meth:`send`, but nothing is written until :meth:`layers_ready` reports its layers.

        Errors as for :meth:`send`, and LocalProtocolError while another layer-wise chunk is still
        open (its layers must all be ready first). Nothing is queued then.
        """
        await self._mail(self._prepare(pages, last, aux_slot, None, layerwise=True))

    async def layers_ready(self, start: int, end: int, *, ready: Ready = None) -> None:
        """Layers ``[start, end)`` of the open chunk are written (once ``ready`` completes). Returns at once.

        Ranges come in layer order, back to back from layer 0; the one ending at ``num_layers``
        closes the chunk (it then counts as a :meth:`send` of its pages, and the aux item of the
        last chunk follows it). Ready layers go out in groups of at least ``layers_per_write``
        (``EngineConfig``), one WRITE per decode rank, as soon as every ``ready`` of the group has
        completed, while the caller's forward goes on.

        ``ready``: on CUDA, an event recorded after the kernels that wrote the layers (None: the
        work queued so far on the caller's current stream; one event per group and stream is
        recorded for such calls, when the group closes, so a call that closes no group records
        nothing); on CPU, a ``threading.Event`` the writing thread sets, or None when the layers are
        written already. Called once per layer from a forward: a call costs microseconds and wakes
        nothing unless it closes a group. ConfigError for a range outside
        ``[0, num_layers]`` or a bad ``ready``; LocalProtocolError when no chunk is open, the range
        does not start where the last one ended, or the room is final. Nothing is queued then.
        """
        mail = self._prepare_layers(start, end, ready)
        if mail is not None:
            await self._mail(mail)

    async def _mail(self, mail: RoomMail) -> None:
        try:
            await self._actor.inbox.send(mail)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            raise LocalProtocolError(
                f"room {self.room} is {self._actor.status.name}; sending is not allowed"
            ) from None

    async def send(
        self,
        pages: Sequence[int] | np.ndarray | Any,
        last: bool | None = None,
        aux_slot: int | None = None,
        *,
        ready: torch.cuda.Event | None = None,
    ) -> None:
        """Queue the next chunk: the prefill's KV page indices of it, in request order. Returns at once.

        ``last`` None means False, or, after :meth:`expect`, whether this chunk reaches the total.
        ``ready``: a CUDA event after which the chunk's KV is written (for a caller on another
        thread or stream); without it, an event is recorded on the caller's current stream.
        Raises LayoutError/ConfigError for pages or an aux slot outside the pool or past the
        expected total, and LocalProtocolError after the last chunk or once the room is final.
        Nothing is queued then. With ``EngineConfig.pipeline_layers``, a chunk of at least
        ``pipeline_min_bytes`` goes out as layer groups, all ready once ``ready`` is.
        """
        self._actor.ports.me.trace.mark(self.room, "send")
        chunk = self._prepare(pages, last, aux_slot, ready)
        groups = self._groups_of(chunk) if chunk.layerwise else []
        try:
            await self._actor.inbox.send(chunk)
            for group in groups:
                await self._actor.inbox.send(group)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            # the room ended while send() waited for its turn (an abort came in): nothing (more) was
            # queued, and the room is final
            raise LocalProtocolError(
                f"room {self.room} is {self._actor.status.name}; send() is not allowed"
            ) from None


class Receiver(_Handle):
    """Decode side of one room. Created by :meth:`TransferEngine.receiver`.

    Opened without pages, the room handshakes and waits in WaitingForInput until :meth:`request`
    gives them (SGLang's order: pages are allocated only once the handshake is done).
    """

    def __init__(self, actor: ReceiverRoomActor, engine: TransferEngine) -> None:
        super().__init__(actor)
        self._room_actor = actor
        self._engine = engine

    @property
    def requested(self) -> bool:
        """Whether the room's pages were given (and its TransferRequests went out)."""
        return self._room_actor.requested

    def request(
        self,
        pages: Sequence[int] | np.ndarray | Any,
        aux_slot: int | None = None,
        decode_prefix_len: int = 0,
    ) -> None:
        """Give the room its pages and ask every prefill rank for the KV; returns at once.

        ``pages``: this rank's page indices for the request's tokens from ``decode_prefix_len`` on
        (the decode already holds the first ``decode_prefix_len`` tokens, a multiple of the page
        size; the prefill sends only the rest). Call once, on the event loop, while the room is in
        WaitingForInput. Bad arguments raise ConfigError/LayoutError naming the value, a second
        call or a final room LocalProtocolError; nothing is sent then.
        """
        arr = _check_request(self._engine.pool, pages, aux_slot, decode_prefix_len)
        self._engine._request(self._room_actor, arr, aux_slot, decode_prefix_len)


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
        self._transport = transport
        self.curve = Curve.from_config(config)
        """Control-plane CURVE keys (None: off); loaded here so a bad key file fails the constructor."""
        self.deadlines = Deadlines(config.bootstrap_timeout, config.waiting_timeout, config.transfer_timeout)
        self.rooms: dict[int, _RoomActor] = {}
        self.board = RoomBoard(self._room_closed)
        """The live rooms' mailboxes: how every actor addresses a room."""
        self.me = RankIdentity(
            self.agent_name,
            config.role,
            config.tp_rank,
            config.tp_size,
            StepTrace(config.trace_steps, config.role),
        )
        self.peers = PeerBook()
        self.instances: dict[str, PrefillInstance] = {}
        self._slice_pieces_of: dict[str, float] = {}
        """Per prefill bootstrap: the slice path's descriptors per page (see ``_slice_pieces``)."""
        self._connecting: dict[str, anyio.Event] = {}
        self._stash = EarlyRequests()
        self.tombstones = Tombstones(config.bootstrap_timeout + config.transfer_timeout)
        """Prefill: outcomes of rooms no longer live, to answer repeated requests (protocol.retransmit)."""
        self.workers: list[TransferWorker] = []
        self.bootstrap: Bootstrap | None = None
        self.ring: RingActor | None = None
        self.scatter: ScatterActor | None = None
        self._tg: TaskGroup | None = None
        self._info = kv.info()
        self._compat = m.compat_hash(self._info)
        self._heartbeat_seq = 0
        self.counters: Counter[str] = Counter()
        self.started_at = time.monotonic()
        self.ended_rooms: deque[RoomSnapshot] = deque(maxlen=ENDED_ROOMS_KEPT)
        """Final snapshots of the latest rooms that ended, oldest first (for ``transfer-engine dump``)."""
        self.introspect: Introspect | None = None
        self.metrics = (
            load_metrics(config.metrics_port, lambda: build_snapshot(self))
            if config.metrics_port is not None
            else None
        )
        """Prometheus metrics (``metrics_port``); ConfigError above when prometheus-client is missing."""
        self.room_ended = None if self.metrics is None else self.metrics.room_ended
        """Called with each ended room's final snapshot (the metrics' histograms)."""
        self.metrics_server: MetricsServer | None = None

    # --- lifecycle ----------------------------------------------------------------------------

    async def __aenter__(self) -> TransferEngine:
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        try:
            await self._start(tg)
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
        return self

    async def _start(self, tg: TaskGroup) -> None:
        cfg = self.config
        transport = self._transport or NixlTransport(
            self.agent_name,
            cfg.nixl_backend,
            default_params(cfg.nixl_backend, cfg.nixl_params, self.pool.device.type),
            progress_thread=cfg.nixl_progress_thread,
        )
        self._transport = transport
        transport.register(self.pool.regions(), self.pool.mem_type)
        aux = self.pool.aux_region()
        if aux is not None:
            transport.register(
                [aux], "VRAM" if self.pool.aux is not None and self.pool.aux.is_cuda else "DRAM"
            )
        self.poller = NixlPoller(
            transport,
            self.board,
            notifications=cfg.role == "decode",
            poll_interval=cfg.poll_interval,
            busy=(lambda: bool(self.rooms)) if cfg.role == "decode" else (lambda: False),
            spin=cfg.poll_spin,
            trace=self.me.trace,
            layer_window=cfg.poll_layer_window,
            cadence=GroupCadence() if cfg.poll_group_cadence and cfg.role == "decode" else None,
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
        self.control = Control(
            cfg.host, cfg.control_port, self._dispatch, name=f"{cfg.role}{cfg.tp_rank}", curve=self.curve
        )
        await tg.start(self.control.run)
        self.introspect = Introspect(
            cfg.host,
            cfg.introspect_port,
            lambda room: build_snapshot(self, room),
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
        if cfg.role == "prefill":
            # default: two chunks, so a worker gathers the next chunk while the last one's WRITE runs
            staging_bytes = cfg.staging_bytes or 2 * chunk_region_bytes(self.pool, cfg.staging_chunk_pages)
            for i in range(cfg.num_workers):
                worker = TransferWorker(
                    i, self.me, self.pool, self.poller, self.board, self.control,
                    staging_bytes=staging_bytes, capacity=ACTOR_MAILBOX, reserve=(JOBS_PER_ROOM + 1) * cfg.max_rooms,
                    completion_thread=cfg.completion_thread, early_start=cfg.early_start, early_drive=cfg.early_drive,
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
            chunk_cut=ChunkCut(cfg.host_pipeline_layers, cfg.pipeline_min_bytes),
        )  # fmt: skip
        tg.start_soon(self._heartbeat_loop)
        log.info(
            "%s rank %d/%d up: control %s agent %s",
            cfg.role,
            cfg.tp_rank,
            cfg.tp_size,
            self.endpoint,
            self.agent_name,
        )

    async def _start_ring(self, tg: TaskGroup) -> None:
        """Decode: allocate and register the staging ring, start the ring and scatter actors."""
        cfg = self.config
        size = cfg.ring_bytes
        if size == 0:  # four chunks of `staging_chunk_pages`, but never more than the KV itself
            chunk = chunk_region_bytes(self.pool, cfg.staging_chunk_pages)
            size = max(chunk, min(4 * chunk, chunk_region_bytes(self.pool, self.pool.num_pages)))
        memory = allocate_staging(self.pool, size, host=self.host_staging)
        assert self._transport is not None
        self._transport.register([memory.region()], memory.mem_type)
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
            completion_thread=cfg.completion_thread,
        )
        await tg.start(self.scatter.run)
        log.info("decode rank %d: %s staging ring of %d bytes", cfg.tp_rank, memory.mem_type, size)

    @property
    def host_staging(self) -> bool:
        return self.config.path == "host" or self.config.staging_memory == "host"

    @property
    def endpoint(self) -> str:
        return self.control.endpoint

    @property
    def introspect_endpoint(self) -> str:
        """Where ``transfer-engine dump --endpoint`` reaches this rank (``tcp://host:port``)."""
        return self.introspect.endpoint if self.introspect is not None else ""

    @property
    def metrics_endpoint(self) -> str | None:
        """``http://host:port/metrics`` when ``metrics_port`` is set, else None."""
        return self.metrics_server.endpoint if self.metrics_server is not None else None

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
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
            self._close_transport()

    def _close_transport(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def leaks(self) -> dict[str, int]:
        """What is still held: rooms, stashed messages, NIXL handles in flight. All 0 when idle."""
        return {
            "rooms": len(self.rooms),
            "stashed": len(self._stash),
            "nixl_handles": self._transport.live_handles() if self._transport else 0,
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
        _check_room(room)
        per_write = check_layers_per_write(
            self.config.layers_per_write if layers_per_write is None else layers_per_write
        )
        if room in self.rooms:
            raise RoomInUseError(room)
        self._check_capacity(room)
        actor = SenderRoomActor(self.room_ports, room, self.deadlines)
        ended = self.tombstones.get(room, time.monotonic())
        aborted_before = not self.tombstones.reopen(room)
        self._start_room(actor)
        for request in self._stash.take(room):
            actor.inbox.send_nowait(request)
        if aborted_before:  # a decode rank aborted the room before this rank opened it: it cannot
            assert ended is not None  # complete, so it fails now instead of at bootstrap_timeout
            actor.failed_by.update(ended.aborted_by)
            actor.inbox.send_nowait(LocalAbort(ended.detail))
        return Sender(
            actor, self.pool, per_write, (self.config.pipeline_layers, self.config.pipeline_min_bytes)
        )

    def _check_capacity(self, room: int) -> None:
        if len(self.rooms) >= self.config.max_rooms:
            raise RoomLimitError(room, self.config.max_rooms)

    def worker_for(self, agent_name: str) -> TransferWorker:
        return self.workers[zlib.crc32(agent_name.encode()) % len(self.workers)]

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
        in WaitingForInput. With ``pages`` the room's TransferRequests go out before it returns;
        without, they go out at :meth:`Receiver.request`. Bad arguments raise before anything is
        registered.
        """
        if self.config.role != "decode":
            raise ConfigError("receiver() is for decode engines; this one is prefill")
        self.me.trace.mark(room, "receiver")
        _check_room(room)
        checked = None if pages is None else _check_request(self.pool, pages, aux_slot, decode_prefix_len)
        if room in self.rooms:
            raise RoomInUseError(room)
        instance = await self._instance(bootstrap)
        if room in self.rooms:
            raise RoomInUseError(room)
        self._check_capacity(room)
        path = self._choose_path(instance)
        layout = self.pool.layout
        D, d = self.config.tp_size, self.config.tp_rank
        writers = heads.writers_of(layout.num_heads, instance.tp_size, D, d, layout.mla)
        actor = ReceiverRoomActor(
            self.room_ports, room, self.deadlines, {w.prefill_rank: instance.ranks[w.prefill_rank] for w in writers},
            pages=np.empty(0, dtype=np.int64), slices=list(writers), path=path,
        )  # fmt: skip
        actor.everyone = list(instance.ranks)
        self._start_room(actor)  # before any request leaves: a prefill must never write for no room
        actor.core.bootstrapped([w.prefill_rank for w in writers], None, time.monotonic())
        log.debug(
            "decode room %d: connected to %s (%d writers, path %s)", room, bootstrap, len(writers), path
        )
        if checked is not None:
            self._request(actor, checked, aux_slot, decode_prefix_len)
        return Receiver(actor, self)

    def _request(
        self,
        actor: ReceiverRoomActor,
        arr: np.ndarray,
        aux_slot: int | None,
        decode_prefix_len: int,
    ) -> None:
        """Send ``actor``'s TransferRequests for ``arr``, pages that :func:`_check_request` returned
        for these arguments (see :meth:`Receiver.request`)."""
        if actor.requested:
            raise LocalProtocolError(f"room {actor.room} already requested its pages")
        if actor.done.is_set() or actor.status is not RoomStatus.WAITING_FOR_INPUT:
            raise LocalProtocolError(
                f"room {actor.room} is {actor.status.name}; request() needs WAITING_FOR_INPUT"
            )
        actor.set_pages(arr)
        aux_writer = actor.slices[0].prefill_rank if aux_slot is not None else None
        actor.core.wants_aux_from = aux_writer
        by_rank = {w.prefill_rank: (i, w) for i, w in enumerate(actor.slices)}
        pages_list = arr.tolist()
        for peer in actor.everyone:
            index, w = by_rank.get(peer.rank, (-1, None))
            slices = (
                []
                if w is None
                else [m.SliceSpec(w.prefill_rank, w.src_head_start, w.dst_head_start, w.num_heads)]
            )
            request = m.TransferRequest(
                room=actor.room,
                agent=self.agent_name,
                decode_rank=self.config.tp_rank,
                decode_tp=self.config.tp_size,
                path=actor.path,
                dst_pages=pages_list,
                aux_slot=aux_slot if peer.rank == aux_writer else None,
                slices=slices,
                decode_prefix_len=decode_prefix_len,
                first_region=None if w is None else actor.first_region(index),
            )
            actor.requests.append((peer, request))  # repeated until the room is final
            self.control.send(peer.endpoint, request)
        self.me.trace.mark(actor.room, "requested")

    async def connect(self, bootstrap: str) -> None:
        """Handshake with the prefill instance behind ``bootstrap`` now, ahead of its first room."""
        if self.config.role != "decode":
            raise ConfigError("connect() is for decode engines; this one is prefill")
        await self._instance(bootstrap)

    def _choose_path(self, instance: PrefillInstance) -> str:
        layout = self.pool.layout
        policy = self.config.path
        same_pages = all(p.layout.page_size == layout.page_size for p in instance.ranks)
        equal = instance.tp_size == self.config.tp_size or layout.mla
        staged = "host" if self.host_staging else "staged"
        if policy == "auto":
            has_ring = self.ring is not None
            pieces = self._slice_pieces(instance) if has_ring and not (equal and same_pages) else float("inf")
            return auto_path(
                equal_tp=equal, same_pages=same_pages, has_ring=has_ring, host=self.host_staging,
                slice_pieces=pieces, num_tensors=layout.num_kv_tensors,
            ).value  # fmt: skip
        if policy == "direct":
            if not equal:
                raise ConfigError(
                    f"path=direct needs equal TP or MLA; prefill tp {instance.tp_size}, decode tp {self.config.tp_size}"
                )
            if not same_pages:
                raise ConfigError("path=direct needs equal page sizes on prefill and decode")
            return "direct"
        if policy == "slice":
            return "slice"
        assert is_staged(policy) and self.ring is not None  # the ring exists for these policies
        return staged

    def _slice_pieces(self, instance: PrefillInstance) -> float:
        """Slice-path descriptors per page from the worst writer of this rank (``path=auto``), once
        per instance; infinite between contiguous pools, which keep staged for hetero TP or pages."""
        found = self._slice_pieces_of.get(instance.bootstrap)
        if found is not None:
            return found
        pool = self.pool
        pieces = float("inf")
        if pool.strides is not None or any(p.layout.strides is not None for p in instance.ranks):
            layout = pool.layout
            writers = heads.writers_of(
                layout.num_heads, instance.tp_size, self.config.tp_size, self.config.tp_rank, layout.mla
            )
            src_heads = layout.heads_local(instance.tp_size)
            pieces = max(
                descriptors.slice_pieces_per_page(
                    stride_rows_of(instance.ranks[w.prefill_rank].layout, src_heads),
                    pool.stride_rows,
                    pool.head_bytes,
                    instance.ranks[w.prefill_rank].layout.page_size,
                    layout.page_size,
                    w.src_head_start,
                    w.dst_head_start,
                    w.num_heads,
                    src_heads,
                    pool.heads_local,
                )
                for w in writers
            )
        self._slice_pieces_of[instance.bootstrap] = pieces
        return pieces

    async def _instance(self, bootstrap: str) -> PrefillInstance:
        """The prefill instance behind ``bootstrap``, connecting (once, shared by callers) if needed."""
        while bootstrap not in self.instances:
            pending = self._connecting.get(bootstrap)
            if pending is not None:
                await pending.wait()
                if bootstrap not in self.instances:
                    raise PeerUnreachableError(
                        bootstrap, "connection attempt by a concurrent receiver() failed"
                    )
                break
            event = self._connecting[bootstrap] = anyio.Event()
            try:
                self.instances[bootstrap] = await self._connect(bootstrap)
            finally:
                del self._connecting[bootstrap]
                event.set()
        return self.instances[bootstrap]

    async def _connect(self, bootstrap: str) -> PrefillInstance:
        cfg = self.config
        deadline = time.monotonic() + cfg.bootstrap_timeout
        while True:
            try:
                topo = await self.control.request(bootstrap, m.TopologyQuery(), cfg.connect_timeout)
            except PeerUnreachableError:
                raise
            if not isinstance(topo, m.Topology):
                raise RemoteProtocolError(f"bootstrap {bootstrap} answered {type(topo).__name__}")
            if topo.complete:
                break
            if time.monotonic() > deadline:
                raise PeerUnreachableError(
                    bootstrap, f"only {len(topo.ranks)} of {topo.tp_size} prefill ranks registered"
                )
            await anyio.sleep(0.05)
        if not self.pool.layout.mla:
            heads.validate_split(self.pool.layout.num_heads, topo.tp_size, cfg.tp_size)
        hello = m.PeerHello(
            rank=cfg.tp_rank,
            tp_size=cfg.tp_size,
            endpoint=self.endpoint,
            agent_name=self.agent_name,
            agent_metadata=self.poller.metadata(),
            mem_type=self.pool.mem_type,
            regions=self.pool.regions(),
            aux=self.pool.aux_region(),
            ring=None if self.ring is None else self.ring.memory.region(),
            ring_mem_type="" if self.ring is None else self.ring.memory.mem_type,
            layout=self._info,
            compat=self._compat,
        )
        peers: list[Peer] = []
        for info in topo.ranks:
            ack = await self.control.request(info.endpoint, hello, cfg.connect_timeout)
            if not isinstance(ack, m.PeerHelloAck):
                raise RemoteProtocolError(
                    f"prefill rank {info.rank} answered {type(ack).__name__} to PeerHello"
                )
            if not ack.ok or ack.layout is None:
                raise LayoutError(
                    f"prefill rank {info.rank} at {info.endpoint} refused this decode rank: {ack.detail}"
                )
            peer = Peer(
                ack.agent_name, info.endpoint, info.rank, ack.tp_size, ack.layout, last_seen=time.monotonic()
            )
            self.poller.add_peer(RemotePeer(peer.agent_name, "DRAM", []), ack.agent_metadata)
            self.peers[peer.agent_name] = peer
            peers.append(peer)
            if self.ring is not None:
                await self.ring.inbox.send(Subscribe(peer))
        log.info(
            "decode rank %d connected to prefill instance %s (tp %d)", cfg.tp_rank, bootstrap, topo.tp_size
        )
        return PrefillInstance(bootstrap, topo.tp_size, peers)

    def _on_peer_hello(self, hello: m.PeerHello) -> m.PeerHelloAck:
        """Prefill side of the handshake: validate, load the peer's agent and memory, answer."""
        refuse = handshake.refusal(hello, self._info, self._compat, self.config.tp_size)
        if refuse is None:
            try:
                peer = Peer(
                    hello.agent_name, hello.endpoint, hello.rank, hello.tp_size, hello.layout,
                    hello.mem_type, list(hello.regions), hello.aux, hello.ring, time.monotonic(),
                )  # fmt: skip
                remote_regions = list(hello.regions) + ([hello.aux] if hello.aux else [])
                mem_types = [hello.mem_type] * len(remote_regions)
                if hello.ring:
                    remote_regions.append(hello.ring)
                    mem_types.append(hello.ring_mem_type)
                self.poller.add_peer(
                    RemotePeer(hello.agent_name, hello.mem_type, remote_regions, mem_types),
                    hello.agent_metadata,
                )
                old = self.peers.get(hello.agent_name)
                if old is not None and old.endpoint != hello.endpoint:
                    self.control.forget(old.endpoint)
                self.peers[hello.agent_name] = peer
            except TransferError as exc:
                refuse = str(exc)
        if refuse is not None:
            log.warning("refused PeerHello from %s: %s", hello.agent_name, refuse)
            return m.PeerHelloAck(ok=False, detail=refuse, rank=self.config.tp_rank, tp_size=self.config.tp_size,
                                  agent_name=self.agent_name, agent_metadata=b"", layout=None, compat=self._compat)  # fmt: skip
        log.info(
            "prefill rank %d accepted decode rank %d/%d (%s)",
            self.config.tp_rank,
            hello.rank,
            hello.tp_size,
            hello.agent_name,
        )
        return m.PeerHelloAck(ok=True, detail="", rank=self.config.tp_rank, tp_size=self.config.tp_size,
                              agent_name=self.agent_name, agent_metadata=self.poller.metadata(), layout=self._info,
                              compat=self._compat)  # fmt: skip

    # --- routing ----------------------------------------------------------------------------------

    def _start_room(self, actor: _RoomActor) -> None:
        assert self._tg is not None
        self.rooms[actor.room] = actor
        self.board.open(actor.room, actor.inbox)
        self.counters["rooms_opened"] += 1
        self._tg.start_soon(actor.run, name=f"{actor.side}-room-{actor.room}")
        self.poller.wake()

    def _room_closed(self, room: int) -> None:
        """The room board's hook: room ``room`` ended (final and quiescent) and left the board."""
        actor = self.rooms.pop(room)
        self.counters[f"rooms_{actor.status.name.lower()}"] += 1
        failure = actor.core.failure
        if failure is not None:
            self.counters[f"failed_{failure.reason.name.lower()}"] += 1
        if isinstance(actor, SenderRoomActor):
            self.tombstones.put(
                actor.room,
                Ended(actor.status, None if failure is None else failure.reason,
                      "" if failure is None else failure.detail, time.monotonic(),
                      aborted_by=frozenset(actor.failed_by),
                      askers=frozenset(request.agent for request in actor.requests.values())),
            )  # fmt: skip
        record_ended(self, actor, self.ended_rooms)

    async def _to_room(self, room: int, mail: RoomMail) -> bool:
        return await self.board.deliver(room, mail)

    async def _dispatch(self, message: m.AnyMessage, ident: bytes) -> None:
        self.me.trace.mark_mail("in", message)
        match message:
            case m.PeerHello() if self.config.role == "prefill":
                await self.control.reply_to(ident, self._on_peer_hello(message))
            case m.TransferRequest(agent=agent, room=room) if agent not in self.peers:
                # every decode rank says PeerHello before it asks for rooms: this one is forged or stale
                self.control.count_drop(
                    "TransferRequest", ident, f"room {room} from {agent!r}, which never said PeerHello"
                )
            case m.TransferRequest(room=room, agent=agent) if self.config.role == "prefill":
                ended = self.tombstones.get(room, time.monotonic())
                if (
                    answer_late_request(ended, agent) is not Late.STASH
                ):  # a repeat, or overtaken by its room's end
                    assert ended is not None
                    self._answer_late(room, agent, ended)
                elif not await self._to_room(room, message) and not self._stash.add(
                    room, message, time.monotonic()
                ):
                    self.counters["requests_repeated"] += 1
            case m.Abort(room=room, agent=agent, rank=rank) if self.config.role == "prefill":
                if not await self._to_room(room, message):
                    peer = self.peers.get(agent)
                    if peer is not None:
                        if self.tombstones.get(room, time.monotonic()) is None:
                            self.tombstones.put(room, Ended(
                                RoomStatus.FAILED, FailureReason.ABORTED, f"aborted by decode {agent} before "
                                f"prefill rank {self.config.tp_rank} opened it: {message.detail}",
                                time.monotonic(), opened=False, aborted_by=frozenset({agent}),
                                askers=self._stash.agents(room) | {agent},
                            ))  # fmt: skip
                        self._answer(
                            self._stash.abort(room, message, agent=self.agent_name, rank=self.config.tp_rank)
                        )
                        self.control.send(
                            peer.endpoint,
                            m.AbortAck(room=room, agent=self.agent_name, rank=self.config.tp_rank),
                        )
                    else:
                        self.control.count_drop(
                            "Abort", ident, f"abort of room {room} from unknown agent {agent} (rank {rank})"
                        )
            case m.StagingRequest() if self.ring is not None:
                await self.ring.inbox.send(message)
            case m.StagingGrant(agent=agent) | m.StagingRefused(agent=agent) | m.Watermark(agent=agent) if (
                self.config.role == "prefill"
            ):
                await self.worker_for(agent).inbox.send(message)
            case m.RoomFailed(room=room) | m.AbortAck(room=room):
                if not await self._to_room(room, message):
                    self.counters["late_messages"] += 1
            case m.Heartbeat(agent=agent):
                peer = self.peers.get(agent)
                if peer is not None:
                    peer.last_seen = time.monotonic()
            case _:
                self.control.count_drop(
                    type(message).__name__, ident, f"not accepted by a {self.config.role} engine"
                )

    # --- liveness -----------------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        """Send a heartbeat every half interval; check leases every quarter interval.

        A peer silent for more than ``LEASE_SILENCE`` intervals is dead; checked every quarter interval,
        that fails its rooms within 2.25 x heartbeat_interval of its last heartbeat.
        """
        interval = self.config.heartbeat_interval
        tick = interval / 4
        last_tick = last_beat = time.monotonic()
        while True:
            await anyio.sleep(tick)
            now = time.monotonic()
            stall = leases.stalled(last_tick, now, tick, interval)
            if stall is not None:
                log.warning("heartbeat loop stalled %.2f s; extending peer leases", stall)
                for peer in self.peers.values():
                    peer.last_seen = leases.extended(peer.last_seen, now, interval)
            last_tick = now
            if now - last_beat >= interval / 2 - tick / 2:  # twice per interval: see leases.LEASE_SILENCE
                last_beat = now
                self._heartbeat_seq += 1
                beat = m.Heartbeat(
                    agent=self.agent_name,
                    rank=self.config.tp_rank,
                    side=self.config.role,
                    seq=self._heartbeat_seq,
                )
                for peer in list(self.peers.values()):
                    if peer.alive:
                        self.control.send(peer.endpoint, beat)
                        if self.ring is not None:  # the watermark is state: repeat it, a lost one heals
                            with contextlib.suppress(anyio.WouldBlock, anyio.ClosedResourceError):
                                self.ring.inbox.send_nowait(Subscribe(peer))
                for worker in self.workers:  # unanswered StagingRequests (protocol.retransmit)
                    if worker.awaiting_grant:
                        with contextlib.suppress(anyio.WouldBlock, anyio.ClosedResourceError):
                            worker.inbox.send_nowait(RepeatStaging(before=now - interval / 2))
            silent = leases.dead(
                {p.agent_name: p.last_seen for p in self.peers.values() if p.alive}, now, interval
            )
            for agent in silent:
                gone = self.peers.get(agent)
                if gone is not None and gone.alive:
                    await self._peer_dead(gone, f"no heartbeat from {agent} for {now - gone.last_seen:.2f} s")
            for room in self._stash.stale(now, self.config.bootstrap_timeout):
                self.counters["stash_expired"] += 1
                answers = self._stash.expire(
                    room,
                    agent=self.agent_name,
                    rank=self.config.tp_rank,
                    timeout=self.config.bootstrap_timeout,
                )
                log.warning(
                    "room %d: no sender() within bootstrap_timeout; %d decode rank(s) told",
                    room,
                    len(answers),
                )
                self._answer(answers)

    def _answer_late(self, room: int, agent: str, ended: Ended) -> None:
        """Answer a TransferRequest for ``room``, which is no longer live here (protocol.retransmit)."""
        peer = self.peers.get(agent)
        if answer_late_request(ended, agent) is not Late.TELL_FAILURE or peer is None:
            self.counters["requests_repeated"] += 1
            return
        assert ended.reason is not None
        self.control.send(
            peer.endpoint,
            m.RoomFailed(room=room, agent=self.agent_name, rank=self.config.tp_rank,
                         reason=int(ended.reason), detail=ended.detail),
        )  # fmt: skip

    def _answer(self, answers: list[tuple[str, m.RoomFailed]]) -> None:
        """Send each (decode agent, RoomFailed) the stash owes; agents no longer known are skipped."""
        for agent, message in answers:
            peer = self.peers.get(agent)
            if peer is not None:
                self.control.send(peer.endpoint, message)

    async def _peer_dead(self, peer: Peer, detail: str) -> None:
        log.warning("%s rank %d: peer %s (rank %d) declared dead: %s", self.config.role, self.config.tp_rank,
                    peer.agent_name, peer.rank, detail)  # fmt: skip
        peer.alive = False
        self.counters["peers_dead"] += 1
        del self.peers[peer.agent_name]
        for bootstrap, inst in list(self.instances.items()):
            if peer in inst.ranks:
                del self.instances[bootstrap]
                self._slice_pieces_of.pop(bootstrap, None)
        self.control.forget(peer.endpoint)
        for actor in list(self.rooms.values()):
            await self._to_room(actor.room, PeerDead(peer.agent_name, detail))
        await self.poller.abandon(peer.agent_name, detail)
        self.poller.remove_peer(peer.agent_name)
