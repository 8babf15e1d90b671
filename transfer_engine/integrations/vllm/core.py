"""The vLLM connector's core, free of vLLM: one rank's engine over vLLM's KV caches, per request.

The vLLM binding (``connector.py``) translates vLLM's hooks and objects into the calls below, all
made from vLLM's worker thread; nothing here imports vLLM. One :class:`ConnectorCore` per TP rank:

- built from what ``register_kv_caches`` receives (layer name -> tensor) and the resolved
  ``KVCacheLayout`` name, through :func:`~transfer_engine.integrations.vllm.layouts.pool_from_vllm`
  (no copies); :meth:`start` runs the engine through the facade, as SGLang's backend does
  (:class:`~transfer_engine.facade.BlockingEngine`), each request a task on its loop
  (``BlockingEngine.spawn``);
- a request is a transfer ID (both sides derive the room from it, :func:`transfer_engine.room_id`)
  and vLLM block ids. Prefill: :meth:`send` (the request's KV is written) or :meth:`begin_layers`
  and then :meth:`layers_ready` per layer range as the forward writes them. Decode: :meth:`receive`.
  :meth:`abort` ends a live request's room, :meth:`cancel` tells the prefill that a decode request
  ended before its room opened;
- readiness comes from the caller's CURRENT CUDA stream: :meth:`send` and :meth:`layers_ready`
  record an event there (:func:`transfer_engine.facade.recorded`; vLLM's forward queues a layer's
  kernels and returns before they ran), and
  the engine starts the WRITE only once it completed (docs/ARCHITECTURE.md, "The path of a room").
  On CPU the KV is written when the call is made: no event;
- every request is reported exactly once, when its room has ended (no WRITE of it can still land):
  :meth:`take_finished` (prefill and decode request ids), and :meth:`take_load_errors` (the vLLM
  blocks of decode requests that failed, or whose KV was not their transfer's).

The prefill WRITEs a 16-byte digest of the transfer ID as the room's aux item and the decode
checks it (:func:`digest_of`), so two IDs whose rooms collide can never hand one request another's KV.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import msgspec
import torch

from transfer_engine import (
    EngineConfig,
    TransferEngine,
    room_id,
)
from transfer_engine.errors import ConfigError, LocalProtocolError, TransferError
from transfer_engine.facade import BlockingEngine, recorded

from .layouts import VllmKV, pool_from_vllm
from .records import (
    DIGEST_BYTES,
    DigestSlots,
    GroupReady,
    LayerQueue,
    Reports,
    RequestRecord,
    digest_of,
    failure_kind,
    no_stats,
)

__all__ = ["DIGEST_BYTES", "ConnectorCore", "digest_of", "failure_kind"]

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 60.0
"""How long :meth:`ConnectorCore.close` waits for the live rooms it aborts to end."""


class ConnectorCore:
    """One TP rank's engine over vLLM's KV caches; see the module docstring.

    ``config``: the rank's engine configuration (role, TP, addresses, ``layers_per_write``...).
    ``kv_caches``, ``layout``, ``block_size``, ``head_size`` (None for MLA), ``num_kv_heads``: as
    :func:`~transfer_engine.integrations.vllm.layouts.pool_from_vllm` takes them. ``max_requests``:
    requests live at once on this rank (each holds an aux slot; default ``config.max_rooms``).
    ``cpus``: the CPUs the engine's threads may run on (None: the caller's; vLLM's CPU worker pins its
    thread to one core before it registers the caches, and threads inherit their creator's mask).
    ``transport``: the engine's NIXL transport (None: the engine makes its own; tests pass a
    fault-injecting wrapper around a real one, whose agent is named ``config.agent_name``).
    Raises LayoutError/ConfigError naming a bad value; nothing is started then.
    """

    def __init__(
        self,
        config: EngineConfig,
        kv_caches: Mapping[str, torch.Tensor],
        *,
        layout: str,
        block_size: int,
        head_size: int | None,
        num_kv_heads: int | None = None,
        max_requests: int | None = None,
        cpus: frozenset[int] | None = None,
        transport: Any = None,
    ) -> None:
        if max_requests is None:
            max_requests = config.max_rooms
        if not isinstance(max_requests, int) or max_requests < 1:
            raise ConfigError(f"max_requests={max_requests!r} must be a positive integer")
        if cpus is not None and not cpus:
            raise ConfigError("cpus is empty; give the CPU ids the engine may run on, or None")
        self.config = config
        first = next(iter(kv_caches.values()), None)
        device = first.device if isinstance(first, torch.Tensor) else torch.device("cpu")
        # the aux item travels with the KV and lives in the same kind of memory (one memory type a rank)
        self._slots = DigestSlots(max_requests, device)
        self.kv: VllmKV = pool_from_vllm(
            kv_caches,
            layout=layout,
            block_size=block_size,
            head_size=head_size,
            tp_size=config.tp_size,
            tp_rank=config.tp_rank,
            num_kv_heads=num_kv_heads,
            aux=self._slots.tensor,
        )
        self.pool = self.kv.pool
        self.num_layers = self.pool.layout.num_layers
        self._page_bytes = self.pool.page_bytes * self.pool.layout.num_kv_tensors
        """Bytes of one pool page, every layer."""
        self._cuda = self.pool.device.type == "cuda"
        self._cpus = cpus
        self._transport = transport
        self._engine: BlockingEngine | None = None
        self._live: dict[int, RequestRecord] = {}
        """Rooms of this rank by room (loop thread only)."""
        self._layerwise: dict[str, LayerQueue] = {}
        """Layer-wise requests whose layers are not all reported (worker thread only)."""
        self._lock = threading.Lock()
        self._reports = Reports()
        self._outstanding = 0
        """Requests handed to the loop and not reported yet (under ``_lock``)."""
        self._news = threading.Event()
        """Set while a report waits to be taken (set and cleared under ``_lock``)."""

    # ---- lifecycle (worker thread) -------------------------------------------------------------

    def start(self) -> None:
        """Start the engine on its loop thread (the facade's); returns once it is up, or raises its error.

        vLLM's process keeps its GIL switch interval: the facade's lowering
        (``EngineConfig.gil_switch_interval``) is measured for SGLang's scheduler thread, and is
        left off here."""
        config = msgspec.structs.replace(self.config, gil_switch_interval=0.0)
        self._engine = BlockingEngine(config, self.pool, transport=self._transport, cpus=self._cpus)
        log.info(
            "transfer engine %s rank %d: transfer-engine dump --endpoint %s",
            self.config.role, self.config.tp_rank, self._engine.introspect_endpoint,
        )  # fmt: skip

    def close(self) -> None:
        """Abort the live rooms, stop the engine and the loop thread. Idempotent."""
        engine = self._engine
        if engine is None:
            return
        try:
            engine.call(self._abort_live)
        except LocalProtocolError:  # closed already
            pass
        engine.close()

    def __enter__(self) -> ConnectorCore:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def _abort_live(self, engine: TransferEngine) -> None:
        """On the loop: abort every live room; returns once they ended (at most CLOSE_TIMEOUT_S)."""
        with anyio.move_on_after(CLOSE_TIMEOUT_S):
            for request in list(self._live.values()):
                if request.handle is not None:
                    await request.handle.abort("vLLM is shutting down")

    def leaks(self) -> dict[str, int]:
        """What the engine still holds (``TransferEngine.leaks``) and the core's live requests."""

        def look(engine: TransferEngine) -> dict[str, int]:
            return {**engine.leaks(), "core_requests": len(self._live)}

        return dict(self._running().call(look))

    @property
    def bootstrap(self) -> str:
        """Where a decode reaches this prefill instance (its rank 0's bootstrap registry)."""
        return self.config.bootstrap_endpoint

    # ---- requests (worker thread) --------------------------------------------------------------

    def layer_index(self, layer_name: str) -> int:
        """The engine index of a registered layer (LayoutError for another name)."""
        return self.kv.layer_index(layer_name)

    def send(self, req_id: str, transfer_id: str, block_ids: Sequence[int]) -> None:
        """Prefill: send the request's KV, written by the work queued so far on the caller's
        current stream, to whatever decode asks for its room. Never blocks."""
        request = self._request(req_id, transfer_id, block_ids)
        ready = self._ready_event(torch.cuda.current_stream(self.pool.device)) if self._cuda else None
        self._hand(self._send, request, None, ready)

    def begin_layers(self, req_id: str, transfer_id: str, block_ids: Sequence[int]) -> None:
        """Prefill: open the request's room as one layer-wise chunk, before the forward that writes
        its KV; :meth:`layers_ready` then reports its layers. Never blocks."""
        if req_id in self._layerwise:
            raise LocalProtocolError(f"request {req_id!r} already has layers pending")
        request = self._request(req_id, transfer_id, block_ids)
        layers = LayerQueue(asyncio.Queue())
        self._layerwise[req_id] = layers
        self._hand(self._send, request, layers.queue, None)

    def layers_ready(self, req_id: str, start: int, end: int) -> None:
        """Prefill: the forward queued the writes of layers ``[start, end)`` of ``req_id`` on the
        caller's current stream (CPU: wrote them). Ranges come in order from layer 0; the range
        ending at the last layer closes the request. Never blocks; called once per layer.

        Layers are handed to the engine in groups of ``layers_per_write``, each with one CUDA event
        recorded on the stream that wrote them, when the group closes (or the stream changes):
        work on a stream runs in order, so it covers every layer of the group.
        """
        layers = self._layerwise.get(req_id)
        if layers is None:
            raise LocalProtocolError(f"request {req_id!r} has no layers pending (begin_layers first)")
        if start != layers.end or not start < end <= self.num_layers:
            raise ConfigError(
                f"layers [{start}, {end}) of request {req_id!r}: the next range starts at {layers.end} "
                f"and ends by {self.num_layers}"
            )
        stream = torch.cuda.current_stream(self.pool.device) if self._cuda else None
        if layers.stream is not None and stream != layers.stream:
            self._hand_layers(layers)
        layers.end, layers.stream = end, stream
        if end - layers.handed >= self.config.layers_per_write or end == self.num_layers:
            self._hand_layers(layers)
        if end == self.num_layers:
            del self._layerwise[req_id]

    def layer_written(self, index: int) -> None:
        """vLLM's ``save_kv_layer``: the forward queued layer ``index`` (layers come in order), for
        every layer-wise request of this step."""
        for req_id, layers in list(self._layerwise.items()):
            if index >= layers.end:
                self.layers_ready(req_id, layers.end, index + 1)

    def step_written(self) -> None:
        """vLLM's ``wait_for_save``: the forward is queued, every layer: report the rest."""
        for req_id, layers in list(self._layerwise.items()):
            self.layers_ready(req_id, layers.end, self.num_layers)

    def receive(
        self, req_id: str, transfer_id: str, block_ids: Sequence[int], bootstrap: str, prefix_len: int = 0
    ) -> None:
        """Decode: open the request's room into its blocks; it is reported once its KV landed (its
        blocks count as failed unless the digest matched). ``prefix_len``: tokens this instance
        holds already (its prefix cache), a multiple of the block size; ``block_ids`` are the
        blocks of the tokens after them, and the prefill sends only those. Never blocks."""
        if not isinstance(prefix_len, int) or prefix_len < 0 or prefix_len % self.kv.block_size:
            raise ConfigError(
                f"request {req_id!r}: prefix_len={prefix_len!r} is not a multiple of block_size={self.kv.block_size}"
            )
        request = self._request(req_id, transfer_id, block_ids)
        self._hand(self._receive, request, bootstrap, prefix_len)

    def announce(self, req_id: str, transfer_id: str, bootstrap: str) -> None:
        """Decode: the request is queued here and will :meth:`receive` (or :meth:`cancel`) later;
        until then this rank's heartbeats to the prefill behind ``bootstrap`` hold its room live there
        (``TransferEngine.announce``). A prefill that cannot be reached is logged; the request's
        receive fails later. Never blocks."""
        self._running().spawn(self._announce, req_id, room_id(transfer_id), bootstrap)

    def abort(self, req_id: str, transfer_id: str) -> None:
        """End the request's room; it is reported once no WRITE of it can land. A prefill request
        that has no room here fails its room, so a decode waiting on it learns at once."""
        self._running().spawn(self._abort, req_id, room_id(transfer_id))

    def cancel(self, req_id: str, transfer_id: str, bootstrap: str) -> None:
        """Decode: the request ended before its room opened here; tell the prefill, which then
        fails its room at once instead of holding its blocks. Nothing is reported."""
        self._running().spawn(self._cancel, req_id, room_id(transfer_id), bootstrap)

    def take_finished(self) -> tuple[set[str], set[str]]:
        """Requests whose room ended since the last call: (prefill side, decode side)."""
        with self._lock:
            reports = self._reports
            self._reports = Reports(load_errors=reports.load_errors, stats=reports.stats)
            self._news.clear()
        return reports.sent, reports.received

    def take_stats(self) -> dict[str, Any]:
        """What ended since the last call: ``bytes`` this rank moved, and (TP rank 0 only: every
        rank ends each room) ``transfers`` that succeeded, their ``seconds`` from hand-over to end,
        and ``failures`` by kind (:func:`failure_kind`; requests vLLM aborted are not counted)."""
        with self._lock:
            stats, self._reports.stats = self._reports.stats, no_stats()
        return stats

    def take_load_errors(self) -> set[int]:
        """vLLM blocks of decode requests that failed since the last call (vLLM recomputes them)."""
        with self._lock:
            errors, self._reports.load_errors = self._reports.load_errors, set()
        return errors

    def wait_for_news(self, timeout: float) -> None:
        """Block up to ``timeout`` s until a request is reported (at once if one already is, or none
        is outstanding). Releases the GIL while it waits."""
        with self._lock:
            if not self._outstanding:
                return
        self._news.wait(timeout)

    # ---- worker-thread helpers ---------------------------------------------------------------------

    def _request(self, req_id: str, transfer_id: str, block_ids: Sequence[int]) -> RequestRecord:
        if not isinstance(transfer_id, str) or not transfer_id:
            raise ConfigError(f"request {req_id!r}: transfer_id={transfer_id!r} must be a non-empty string")
        self.kv.pages_of(block_ids)  # a bad block raises here, on the caller's thread
        return RequestRecord(req_id, transfer_id, room_id(transfer_id), tuple(int(b) for b in block_ids))

    def _running(self) -> BlockingEngine:
        engine = self._engine
        if engine is None:
            raise LocalProtocolError("the connector core is not started")
        return engine

    def _hand(self, fn: Any, *args: Any) -> None:
        engine = self._running()
        with self._lock:
            self._outstanding += 1
        engine.spawn(fn, *args)

    def _ready_event(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        """The event a chunk or layer group waits for: recorded on ``stream``, the one that wrote it.
        The one place both :meth:`send` and the layer groups take it (tests/gpu's control that skips
        the wait replaces it)."""
        return recorded(stream)

    def _hand_layers(self, layers: LayerQueue) -> None:
        if layers.end == layers.handed:
            return
        stream = layers.stream
        ready = self._ready_event(stream) if stream is not None else None
        self._running().call_soon(layers.queue.put_nowait, (layers.handed, layers.end, ready))
        layers.handed, layers.stream = layers.end, None

    # ---- on the loop ---------------------------------------------------------------------------------

    def _claim(self, request: RequestRecord) -> int | None:
        """Register ``request`` for its room and give it an aux slot; None (logged) when another
        request holds the room or no slot is free."""
        other = self._live.get(request.room)
        if other is not None:
            log.error(
                "room %d of transfer %r collides with live transfer %r; failing request %s",
                request.room, request.transfer_id, other.transfer_id, request.req_id,
            )  # fmt: skip
            return None
        if not self._slots.free:
            log.error(
                "no free aux slot for request %s (more live requests than max_requests)", request.req_id
            )
            return None
        self._live[request.room] = request
        return self._slots.free.pop()

    def _release(self, request: RequestRecord, slot: int) -> None:
        self._slots.free.append(slot)
        del self._live[request.room]

    def _report(self, request: RequestRecord, ok: bool, prefill: bool) -> None:
        with self._lock:
            self._outstanding -= 1
            self._news.set()
            self._reports.record(
                request, ok, prefill, page_bytes=self._page_bytes, counts_rooms=self.config.tp_rank == 0
            )

    async def _send(
        self,
        engine: TransferEngine,
        request: RequestRecord,
        layers: asyncio.Queue[tuple[int, int, GroupReady]] | None,
        ready: GroupReady,
    ) -> None:
        """One prefill room: the whole request at once, or (``layers`` given) as the worker thread
        reports its layers."""
        slot = self._claim(request)
        if slot is None:
            request.failure = "refused"
            self._report(request, False, prefill=True)
            return
        ok = False
        try:
            self._slots.write(slot, digest_of(request.transfer_id))
            sender = request.handle = engine.sender(request.room)
            if request.aborted:
                await sender.abort("vLLM aborted the request")
            # the decode's request says which tokens it lacks (its prefix cache holds the rest)
            await sender.wait_bootstrapped()
            pages = self.kv.pages_of(request.block_ids)[
                sender.decode_prefix_len // self.pool.layout.page_size :
            ]
            request.pages = len(pages)
            if layers is None:
                await sender.send(pages, last=True, aux_slot=slot, ready=ready)
            else:
                await sender.begin_chunk(pages, last=True, aux_slot=slot)
                end = 0
                while end < self.num_layers:
                    start, end, group_ready = await layers.get()
                    await sender.layers_ready(start, end, ready=group_ready)
            await sender.wait()
            ok = True
        except TransferError as exc:
            request.failure = failure_kind(exc)
            if not request.aborted:
                log.warning("request %s (room %d): send failed: %s", request.req_id, request.room, exc)
            if request.handle is not None:  # returns once no WRITE of the room can still read the blocks
                await request.handle.abort(f"send failed: {exc}")
        finally:
            self._release(request, slot)
            self._report(request, ok, prefill=True)

    async def _receive(
        self, engine: TransferEngine, request: RequestRecord, bootstrap: str, prefix_len: int
    ) -> None:
        engine.withdraw(request.room)  # the room opens now (or never): its own requests hold it
        slot = self._claim(request)
        if slot is None:
            request.failure = "refused"
            self._report(request, False, prefill=False)
            return
        ok = False
        try:
            self._slots.write(slot, bytes(DIGEST_BYTES))
            pages = self.kv.pages_of(request.block_ids)
            request.pages = len(pages)
            receiver = request.handle = await engine.receiver(
                request.room, bootstrap, pages, aux_slot=slot, decode_prefix_len=prefix_len
            )
            if request.aborted:
                await receiver.abort("vLLM aborted the request")
            await receiver.wait()
            ok = self._slots.read(slot) == digest_of(request.transfer_id)
            if not ok:
                request.failure = "digest"
                log.error(
                    "request %s (room %d): the KV that landed is not transfer %r's",
                    request.req_id, request.room, request.transfer_id,
                )  # fmt: skip
        except TransferError as exc:
            request.failure = failure_kind(exc)
            if not request.aborted:
                log.warning("request %s (room %d): receive failed: %s", request.req_id, request.room, exc)
        finally:
            self._release(request, slot)
            self._report(request, ok, prefill=False)

    async def _announce(self, engine: TransferEngine, req_id: str, room: int, bootstrap: str) -> None:
        try:
            await engine.announce(room, bootstrap)
        except TransferError as exc:
            log.warning("request %s (room %d): announcing it to its prefill: %s", req_id, room, exc)

    async def _abort(self, engine: TransferEngine, req_id: str, room: int) -> None:
        request = self._live.get(room)
        if request is not None and request.req_id == req_id:
            request.aborted = True
            if request.handle is not None:
                await request.handle.abort("vLLM aborted the request")
            return
        if self.config.role == "prefill" and request is None:
            try:  # the request never finished: fail the room so a decode waiting on it learns at once
                await engine.sender(room).abort("vLLM aborted the request on the prefill")
            except TransferError as exc:
                log.warning("request %s (room %d): abort: %s", req_id, room, exc)

    async def _cancel(self, engine: TransferEngine, req_id: str, room: int, bootstrap: str) -> None:
        engine.withdraw(room)
        if room in self._live:
            return  # the room is live here under another request: not this one's to end
        try:
            receiver = await engine.receiver(room, bootstrap)
            await receiver.abort("vLLM finished the request before its KV was asked for")
        except TransferError as exc:
            log.warning("request %s (room %d): cancelling on the prefill: %s", req_id, room, exc)
