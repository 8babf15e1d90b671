"""The connector's engine, on its own event loop in a thread: vLLM's hooks are synchronous.

Private to the vLLM integration. The loop is the package's one bridge, :class:`transfer_engine.facade.LoopThread`.
vLLM's worker thread calls :meth:`EngineThread.send`, :meth:`~EngineThread.receive` and
:meth:`~EngineThread.abort`, which only schedule work on the loop, and collects what ended with :meth:`~EngineThread.take_finished` and
:meth:`~EngineThread.take_load_errors`. Each transfer is one task on the loop that reports its
request exactly once, when its room has ended (no WRITE of it can still land).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from transfer_engine import (
    EngineConfig,
    KVLayout,
    KVPool,
    PeerUnreachableError,
    Receiver,
    Sender,
    TransferAborted,
    TransferEngine,
    TransferTimeout,
)
from transfer_engine.errors import ConfigError, TransferError
from transfer_engine.facade import LoopThread
from transfer_engine.memory.layout import views_vllm_cpu

log = logging.getLogger(__name__)

START_TIMEOUT = 60.0


def pool_from_vllm_cpu(
    layers: list[torch.Tensor], head_dim: int, tp_size: int, tp_rank: int, aux: torch.Tensor
) -> KVPool:
    """A pool over vLLM CPU attention's KV: per layer ``[num_blocks, heads_local, block_size, 2 *
    head_dim]`` (head-major blocks, K beside V). LayoutError/ConfigError name anything else."""
    first = layers[0]
    if first.dim() != 4 or first.shape[-1] != 2 * head_dim:
        raise ConfigError(
            f"vLLM KV cache layer of shape {tuple(first.shape)} is not the CPU backend's "
            f"[num_blocks, heads, block_size, 2 * {head_dim}]"
        )
    _, heads_local, block_size, _ = first.shape
    layout = KVLayout(
        num_layers=len(layers),
        num_heads=heads_local * tp_size,
        head_dim=head_dim,
        dtype=first.dtype,
        page_size=block_size,
    )
    return KVPool.from_views(layout, tp_size, tp_rank, views_vllm_cpu(layers, head_dim), layers, aux)


@dataclass
class _Entry:
    req_id: str
    transfer_id: str
    block_ids: list[int]
    handle: Sender | Receiver | None = None
    aborted: bool = False
    opened: float = field(default_factory=time.monotonic)
    pages: int = 0
    """Pages this rank moved for the room (set once known)."""
    failure: str = "failed"
    """The kind of failure, for :meth:`EngineThread.take_stats`."""


def failure_kind(exc: BaseException) -> str:
    """The ``failures`` key of a room's error (``TransferStats``)."""
    if isinstance(exc, TransferTimeout):
        return "timeout"
    if isinstance(exc, TransferAborted):
        return "aborted"
    if isinstance(exc, PeerUnreachableError):
        return "unreachable"
    return "failed"


def _no_stats() -> dict[str, Any]:
    return {"transfers": 0, "bytes": 0, "seconds": [], "failures": {}}


@dataclass
class _Layers:
    """A layer-wise room's layers as the worker thread reports them (worker thread only)."""

    queue: asyncio.Queue[tuple[int, int]]
    next: int = 0
    """The first layer not handed to the room yet."""


class EngineThread:
    """A TransferEngine on an asyncio loop in a daemon thread, driven from synchronous code."""

    def __init__(
        self, config: EngineConfig, *, layers: list[torch.Tensor], head_dim: int, cpus: frozenset[int]
    ) -> None:
        self._cpus = cpus
        self._aux = torch.zeros(config.max_rooms, 16, dtype=torch.uint8)
        self._free_aux = list(range(config.max_rooms))
        self.pool = pool_from_vllm_cpu(layers, head_dim, config.tp_size, config.tp_rank, self._aux)
        self.config = config
        self._page_bytes = sum(layer[0].nbytes for layer in layers)
        """Bytes of one block of this rank's KV, every layer."""
        self.engine: TransferEngine | None = None
        self._loop = LoopThread(f"te-{config.role}-{config.tp_rank}")
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._served = threading.Event()
        """The engine's task has returned (the engine is closed, or never opened)."""
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._sent: set[str] = set()
        self._received: set[str] = set()
        self._load_errors: set[int] = set()
        self._outstanding = 0
        """Transfers handed to the loop and not reported yet (under ``_lock``)."""
        self._layerwise: list[_Layers] = []
        """Rooms opened by send_layerwise() whose layers are not all reported (worker thread only)."""
        self._news = threading.Event()
        """Set while a report waits to be taken (set and cleared under ``_lock``)."""
        self._live: dict[int, _Entry] = {}
        """Rooms of this rank, by room (loop thread only)."""
        self._stats: dict[str, Any] = _no_stats()
        """What ended since the last :meth:`take_stats` (under ``_lock``)."""

    # ---- lifecycle ----------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the loop and the engine; returns once the engine is up, or raises its error."""
        self._loop.start()
        try:
            # Linux threads inherit their creator's CPU mask, and vLLM's CPU worker has pinned its
            # main thread to one core (its first OpenMP thread) before it registers the KV caches. Set
            # on the loop's thread before the engine exists, the mask also covers the ZMQ and NIXL
            # threads the engine starts.
            self._loop.call(os.sched_setaffinity, 0, self._cpus)
        except OSError as exc:
            self._loop.close()
            raise ConfigError(
                f"engine_cpus={sorted(self._cpus)}: cannot run the engine there: {exc}"
            ) from None
        self._loop.spawn(self._serve)
        if not self._ready.wait(START_TIMEOUT):
            self._loop.close()
            raise TransferError(f"the {self.config.role} engine did not start within {START_TIMEOUT} s")
        if self._error is not None:
            self._loop.close()
            raise self._error

    def stop(self) -> None:
        """Stop the engine (its rooms end) and the loop's thread."""
        if self._stop is not None and not self._served.is_set():
            self._loop.call_soon(self._stop.set)
            self._served.wait(START_TIMEOUT)
        self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        try:
            async with TransferEngine(self.config, self.pool) as engine:
                self.engine = engine
                log.info(
                    "transfer engine %s rank %d: transfer-engine dump --endpoint %s",
                    self.config.role, self.config.tp_rank, engine.introspect_endpoint,
                )  # fmt: skip
                self._ready.set()
                await self._stop.wait()
                for entry in list(self._live.values()):
                    if entry.handle is not None:
                        await entry.handle.abort("vLLM is shutting down")
        except Exception as exc:  # reported to start(), or logged once the engine was up
            if not self._ready.is_set():
                self._error = exc
                self._ready.set()
            else:
                log.exception("transfer engine stopped")
        finally:
            self._served.set()

    # ---- called from vLLM's worker thread ---------------------------------------------------------

    def send(self, req_id: str, room: int, transfer_id: str, block_ids: list[int], digest: bytes) -> None:
        """Prefill: send the request's blocks (and the ID digest) into whatever decode asks for ``room``."""
        with self._lock:
            self._outstanding += 1
        self._loop.spawn(self._send, req_id, room, transfer_id, block_ids, digest)

    def receive(
        self,
        req_id: str,
        room: int,
        transfer_id: str,
        block_ids: list[int],
        bootstrap: str,
        digest: bytes,
        prefix_len: int = 0,
    ) -> None:
        """Decode: open ``room`` into the request's blocks (those of its tokens ``prefix_len`` on,
        the earlier ones being cached here); report them loaded once the digest matched."""
        with self._lock:
            self._outstanding += 1
        self._loop.spawn(self._receive, req_id, room, transfer_id, block_ids, bootstrap, digest, prefix_len)

    def abort(self, req_id: str, room: int) -> None:
        """Abort the request's room; its task reports it once no WRITE can land (see the module doc)."""
        self._loop.spawn(self._abort, req_id, room)

    def send_layerwise(
        self, req_id: str, room: int, transfer_id: str, block_ids: list[int], digest: bytes
    ) -> None:
        """Prefill: like :meth:`send`, for a request whose last prompt tokens this step computes:
        each layer goes out once :meth:`layer_written` (or :meth:`step_written`) reports it."""
        with self._lock:
            self._outstanding += 1
        layers: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
        self._layerwise.append(_Layers(layers))
        self._loop.spawn(self._send, req_id, room, transfer_id, block_ids, digest, layers)

    def layer_written(self, index: int) -> None:
        """vLLM wrote layer ``index`` of this step's KV (layers come in order): rooms opened by
        :meth:`send_layerwise` this step may send it."""
        for pending in self._layerwise:
            if index >= pending.next:
                self._layers_ready(pending, index + 1)
        self._layerwise = [p for p in self._layerwise if p.next < self.pool.layout.num_layers]

    def step_written(self) -> None:
        """The step's forward is over, every layer is written: send what was not reported yet."""
        for pending in self._layerwise:
            self._layers_ready(pending, self.pool.layout.num_layers)
        self._layerwise = []

    def _layers_ready(self, pending: _Layers, end: int) -> None:
        self._loop.call_soon(pending.queue.put_nowait, (pending.next, end))
        pending.next = end

    def cancel(self, req_id: str, room: int, bootstrap: str) -> None:
        """Decode: the request ended before its room opened here; tell the prefill (see ``_cancel``)."""
        self._loop.spawn(self._cancel, req_id, room, bootstrap)

    def take_finished(self) -> tuple[set[str], set[str]]:
        """Requests whose room ended since the last call: (prefill side, decode side)."""
        with self._lock:
            sent, received = self._sent, self._received
            self._sent, self._received = set(), set()
            self._news.clear()
        return sent, received

    def wait_for_news(self, timeout: float) -> None:
        """Block up to ``timeout`` s until a transfer is reported (at once if one already is, or
        none is outstanding). Releases the GIL while it waits."""
        with self._lock:
            if not self._outstanding:
                return
        self._news.wait(timeout)

    def take_stats(self) -> dict[str, Any]:
        """What ended since the last call, as ``TransferStats.data``: rooms are counted on TP rank 0
        only (every rank ends each room), bytes on every rank; rooms vLLM aborted are not counted."""
        with self._lock:
            stats, self._stats = self._stats, _no_stats()
        return stats

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- on the loop ------------------------------------------------------------------------------------

    def _claim(self, room: int, entry: _Entry) -> bool:
        """Register ``entry`` for ``room``; False (and logged) when another transfer holds the room."""
        other = self._live.get(room)
        if other is not None:
            log.error(
                "room %d of transfer %r collides with live transfer %r; failing request %s",
                room, entry.transfer_id, other.transfer_id, entry.req_id,
            )  # fmt: skip
            return False
        if not self._free_aux:
            log.error(
                "no free aux slot for request %s (more live transfers than max_num_seqs * 2)", entry.req_id
            )
            return False
        self._live[room] = entry
        return True

    def _report(self, entry: _Entry, ok: bool, prefill: bool) -> None:
        with self._lock:
            self._outstanding -= 1
            self._news.set()
            stats = self._stats
            if ok:
                stats["bytes"] += entry.pages * self._page_bytes
            if self.config.tp_rank == 0 and ok:
                stats["transfers"] += 1
                stats["seconds"].append(time.monotonic() - entry.opened)
            elif self.config.tp_rank == 0 and not entry.aborted:
                stats["failures"][entry.failure] = stats["failures"].get(entry.failure, 0) + 1
            if prefill:
                self._sent.add(entry.req_id)
            else:
                self._received.add(entry.req_id)
                if not ok and not entry.aborted:
                    self._load_errors.update(entry.block_ids)

    async def _send(
        self,
        req_id: str,
        room: int,
        transfer_id: str,
        block_ids: list[int],
        digest: bytes,
        layers: asyncio.Queue[tuple[int, int]] | None = None,
    ) -> None:
        """One prefill room: the whole chunk at once, or (``layers`` given) one chunk whose layers
        go out as the worker reports them written (``layers_ready``)."""
        assert self.engine is not None
        entry = _Entry(req_id, transfer_id, block_ids)
        if not self._claim(room, entry):
            entry.failure = "refused"
            self._report(entry, False, prefill=True)
            return
        slot = self._free_aux.pop()
        ok = False
        try:
            self._aux[slot] = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
            sender = entry.handle = self.engine.sender(room)
            if entry.aborted:
                await sender.abort("vLLM aborted the request")
            # The decode's request says which blocks it lacks (its prefix cache holds the rest).
            await sender.wait_bootstrapped()
            pages = block_ids[sender.decode_prefix_len // self.pool.layout.page_size :]
            entry.pages = len(pages)
            if layers is None:
                await sender.send(pages, last=True, aux_slot=slot)
            else:
                await sender.begin_chunk(pages, last=True, aux_slot=slot)
                end = 0
                while end < self.pool.layout.num_layers:
                    start, end = await layers.get()
                    await sender.layers_ready(start, end)
            await sender.wait()
            ok = True
        except TransferError as exc:
            entry.failure = failure_kind(exc)
            if not entry.aborted:
                log.warning("request %s (room %d): send failed: %s", req_id, room, exc)
            if entry.handle is not None:  # returns once no WRITE of the room can still read the blocks
                await entry.handle.abort(f"send failed: {exc}")
        finally:
            self._free_aux.append(slot)
            del self._live[room]
            self._report(entry, ok, prefill=True)

    async def _receive(
        self,
        req_id: str,
        room: int,
        transfer_id: str,
        block_ids: list[int],
        bootstrap: str,
        digest: bytes,
        prefix_len: int,
    ) -> None:
        assert self.engine is not None
        entry = _Entry(req_id, transfer_id, block_ids, pages=len(block_ids))
        if not self._claim(room, entry):
            entry.failure = "refused"
            self._report(entry, False, prefill=False)
            return
        slot = self._free_aux.pop()
        ok = False
        try:
            self._aux[slot].zero_()
            receiver = entry.handle = await self.engine.receiver(
                room, bootstrap, block_ids, aux_slot=slot, decode_prefix_len=prefix_len
            )
            if entry.aborted:
                await receiver.abort("vLLM aborted the request")
            await receiver.wait()
            ok = bytes(self._aux[slot].tolist()) == digest
            if not ok:
                entry.failure = "digest"
                log.error(
                    "request %s (room %d): the KV that landed is not transfer %r's", req_id, room, transfer_id
                )
        except TransferError as exc:
            entry.failure = failure_kind(exc)
            if not entry.aborted:
                log.warning("request %s (room %d): receive failed: %s", req_id, room, exc)
        finally:
            self._free_aux.append(slot)
            del self._live[room]
            self._report(entry, ok, prefill=False)

    async def _abort(self, req_id: str, room: int) -> None:
        assert self.engine is not None
        entry = self._live.get(room)
        if entry is not None and entry.req_id == req_id:
            entry.aborted = True
            if entry.handle is not None:
                await entry.handle.abort("vLLM aborted the request")
            return
        if self.config.role == "prefill" and entry is None:
            # the request never finished: fail the room so a decode waiting on it learns at once
            try:
                await self.engine.sender(room).abort("vLLM aborted the request on the prefill")
            except TransferError as exc:
                log.warning("request %s (room %d): abort: %s", req_id, room, exc)

    async def _cancel(self, req_id: str, room: int, bootstrap: str) -> None:
        """Open ``room`` without pages and abort it: every prefill rank then knows the decode will
        never ask, and fails its room at once (now or when it opens) instead of holding the
        request's blocks until ``bootstrap_timeout``. Nothing is reported to vLLM: no blocks here."""
        assert self.engine is not None
        if room in self._live:
            return  # the room is this instance's, live under another request: not ours to end
        try:
            receiver = await self.engine.receiver(room, bootstrap)
            await receiver.abort("vLLM finished the request before its KV was asked for")
        except TransferError as exc:
            log.warning("request %s (room %d): cancelling on the prefill: %s", req_id, room, exc)
