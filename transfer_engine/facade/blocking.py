"""A blocking facade over :class:`TransferEngine` for threaded callers (SGLang's and vLLM's schedulers).

:class:`BlockingEngine` runs the engine and its event loop on a thread of its own (a
:class:`~transfer_engine.facade.bridge.LoopThread`). The caller's threads never run asyncio code.
Every method says how long it may block:

- never blocks: ``poll()``, ``failure``, ``failure_error()``, ``send()``, ``request()``,
  ``abort()`` and ``receiver()``. They validate their arguments on the caller's thread (bad input
  raises the engine's typed errors there, and nothing is queued) and hand the rest to the loop
  without waiting for it;
- waits for the loop to run one synchronous step (no I/O): ``sender()``, ``leaks()``;
- waits, bounded by an argument or by the configuration: ``BlockingEngine(...)`` (engine start),
  ``connect()`` (``bootstrap_timeout``), ``wait(timeout)``, ``close()`` (every live room is failed
  with SHUTDOWN; at most twice the engine's 10 s drain bound, in practice milliseconds).

A caller whose work per request is a task on the engine's loop rather than a handle's calls (the
vLLM core: a prefill room's pages are known only once its decode's request came in) hands it over
with ``spawn()`` (never blocks) or ``call()`` (blocks until it returned), each given the asyncio
:class:`TransferEngine`, and queues callbacks with ``call_soon()`` (never blocks).

Every method may be called from any thread. Calls on one handle are serialised by its lock, so two
threads sending chunks of one room do not interleave a chunk's bookkeeping; chunks and aborts of a
handle reach the room in the order their calls returned. After :meth:`BlockingEngine.close`, every
call raises :class:`LocalProtocolError`.

``poll()`` follows the engine's rule (docs/DECISIONS.md, "Failed means safe"): Success and Failed
are reported only once the room has ended, so no WRITE can land in its pages afterwards.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine, Sequence
from types import TracebackType
from typing import Any

import anyio
import numpy as np
import torch

from transfer_engine.config import EngineConfig
from transfer_engine.engine import Receiver, Sender, TransferEngine, check_pages, check_room
from transfer_engine.errors import (
    ConfigError,
    FailureReason,
    LocalProtocolError,
    RoomInUseError,
    TransferError,
    TransferFailed,
    TransportError,
    failure_error,
)
from transfer_engine.facade.bridge import LoopThread
from transfer_engine.facade.mailer import Mailer
from transfer_engine.memory.layout import KVPool
from transfer_engine.protocol.cost import PeerLoad
from transfer_engine.protocol.room_ids import room_id
from transfer_engine.protocol.rooms import RoomStatus
from transfer_engine.runtime.mail import LocalAbort, Ready, RoomMail
from transfer_engine.transport.nixl import Transport

__all__ = ["BlockingEngine", "BlockingReceiver", "BlockingSender"]

log = logging.getLogger(__name__)

Pages = Sequence[int] | np.ndarray | Any


def _room(room: int | str) -> int:
    """A room id from an int or a string request id (:func:`transfer_engine.protocol.room_ids.room_id`)."""
    rid = room_id(room) if isinstance(room, str) else room
    check_room(rid)
    return rid


class _BlockingHandle(ABC):
    """What both blocking handles share (abstract: a handle is a BlockingSender or a BlockingReceiver)."""

    def __init__(self, engine: BlockingEngine, room: int) -> None:
        self._engine = engine
        self.room = room
        self._lock = threading.Lock()

    @abstractmethod
    def _handle(self) -> Sender | Receiver | None:
        """The engine's handle on the room (None while a receiver's room is not open yet)."""

    def poll(self) -> RoomStatus:
        """The room's status; never blocks. Success/Failed only once no WRITE of it can land."""
        handle = self._handle()
        return RoomStatus.BOOTSTRAPPING if handle is None else handle.poll()

    @property
    def failure(self) -> tuple[FailureReason, str] | None:
        """``(reason, detail)`` once the room failed (possibly before poll() says Failed), else None."""
        handle = self._handle()
        return None if handle is None else handle.failure

    def failure_error(self) -> TransferFailed | None:
        """The typed error of a failed room (TransferAborted, TransferTimeout...), else None."""
        failure = self.failure
        return None if failure is None else failure_error(self.room, *failure)

    def abort(self, detail: str = "aborted by the application") -> None:
        """Stop the room; returns at once. poll() says Failed once no WRITE of it can land."""
        with self._lock:
            handle = self._handle()
            if handle is not None:
                self._engine._post(handle, LocalAbort(detail))

    def wait(self, timeout: float) -> None:
        """Block until the room ended, at most ``timeout`` s (TimeoutError after that).

        Returns on Success; raises the room's TransferFailed (or the error that kept a receiver
        from opening) otherwise.
        """
        self._engine._call(self._wait, timeout)

    async def _wait(self, limit_s: float) -> None:
        with anyio.fail_after(limit_s):
            await self._opened()
            handle = self._handle()
            assert handle is not None
            error = await handle.ended()
        if error is not None:
            raise error

    @abstractmethod
    async def _opened(self) -> None:
        """Return once the room exists on the engine (a receiver may still be handshaking); raise
        the error that kept it from opening."""


class BlockingSender(_BlockingHandle):
    """Prefill side of one room, for threaded callers; see the module docstring for blocking rules."""

    def __init__(self, engine: BlockingEngine, sender: Sender) -> None:
        super().__init__(engine, sender.room)
        self._sender = sender

    def _handle(self) -> Sender:
        return self._sender

    async def _opened(self) -> None:
        """A sender's room is open when its handle exists."""

    @property
    def decode_prefix_len(self) -> int:
        """Tokens the decode side already holds (known once poll() passed Bootstrapping)."""
        return self._sender.decode_prefix_len

    def expect(self, total_pages: int, aux_slot: int | None = None) -> None:
        """See :meth:`Sender.expect`; never blocks."""
        with self._lock:
            self._engine._check_open()
            self._sender.expect(total_pages, aux_slot)

    def send(
        self,
        pages: Pages,
        last: bool | None = None,
        aux_slot: int | None = None,
        *,
        ready: torch.cuda.Event | None = None,
    ) -> None:
        """Queue the next chunk (see :meth:`Sender.send`); never blocks.

        On CUDA, without ``ready`` an event is recorded on this thread's current stream.
        """
        with self._lock:
            self._engine._check_open()
            chunk = self._sender.prepare_chunk(pages, last, aux_slot, ready)
            self._engine._post(self._sender, chunk)

    def begin_chunk(self, pages: Pages, last: bool | None = None, aux_slot: int | None = None) -> None:
        """Open the next chunk for layer-wise sending (see :meth:`Sender.begin_chunk`); never blocks."""
        with self._lock:
            self._engine._check_open()
            chunk = self._sender.prepare_chunk(pages, last, aux_slot, None, layerwise=True)
            self._engine._post(self._sender, chunk)

    def layers_ready(self, start: int, end: int, *, ready: Ready = None) -> None:
        """Layers ``[start, end)`` of the open chunk are written once ``ready`` completes (see
        :meth:`Sender.layers_ready`); never blocks. Called from inside a forward, per layer or group:
        on CUDA, without ``ready`` the group waits for this thread's current stream (one event per
        group). A call that closes no group only validates and counts; one that does queues the
        group for the loop, waking it only if no wake-up is pending."""
        with self._lock:
            self._engine._check_open()
            group = self._sender.prepare_layers(start, end, ready)
            if group is not None:
                self._engine._post(self._sender, group)


class BlockingReceiver(_BlockingHandle):
    """Decode side of one room, for threaded callers; see the module docstring for blocking rules.

    Created at once by :meth:`BlockingEngine.receiver`; the handshake runs on the loop and poll()
    says Bootstrapping until it is done (WaitingForInput), or Failed if it could not be done.
    """

    def __init__(self, engine: BlockingEngine, room: int) -> None:
        super().__init__(engine, room)
        self._receiver: Receiver | None = None
        self._error: TransferError | None = None
        self._abort: str | None = None
        self._requested = False
        self._ready = threading.Event()

    def _handle(self) -> Receiver | None:
        return self._receiver

    def poll(self) -> RoomStatus:
        if self._error is not None:
            return RoomStatus.FAILED  # the room never opened: nothing can land anywhere
        return super().poll()

    @property
    def failure(self) -> tuple[FailureReason, str] | None:
        error = self._error
        if error is not None:
            if isinstance(error, TransferFailed):
                return error.reason, error.detail
            reason = FailureReason.TRANSPORT if isinstance(error, TransportError) else FailureReason.PROTOCOL
            return reason, f"the room did not open: {type(error).__name__}: {error}"
        return super().failure

    @property
    def open_error(self) -> TransferError | None:
        """The error that kept the room from opening (PeerUnreachableError, LayoutError...), or None."""
        return self._error

    def request(self, pages: Pages, aux_slot: int | None = None, decode_prefix_len: int = 0) -> None:
        """Give the room its pages (see :meth:`Receiver.request`); never blocks.

        Allowed once, after poll() said WaitingForInput; LocalProtocolError before the handshake is
        done, a second time, or on a final room. Bad arguments raise ConfigError/LayoutError.
        """
        with self._lock:
            self._engine._check_open()
            arr = check_pages(self._engine.pool, pages, aux_slot, decode_prefix_len)
            receiver = self._receiver
            if receiver is None:
                raise LocalProtocolError(
                    f"room {self.room} has not finished its handshake; request() after poll() says "
                    "WAITING_FOR_INPUT"
                )
            if self._requested or receiver.requested:
                raise LocalProtocolError(f"room {self.room} already requested its pages")
            status = receiver.status
            if status is not RoomStatus.WAITING_FOR_INPUT:
                raise LocalProtocolError(
                    f"room {self.room} is {status.name}; request() needs WAITING_FOR_INPUT"
                )
            self._requested = True
            self._engine._call_soon(self._request_on_loop, receiver, arr, aux_slot, decode_prefix_len)

    def _request_on_loop(
        self, receiver: Receiver, arr: np.ndarray, aux_slot: int | None, prefix: int
    ) -> None:
        try:
            receiver.give_pages(arr, aux_slot, prefix)
        except TransferError as exc:  # the room failed between the check and now: poll() tells
            log.info("room %d: request() after the room failed: %s", self.room, exc)

    def abort(self, detail: str = "aborted by the application") -> None:
        with self._lock:
            if self._receiver is None:
                self._abort = detail  # the opening task aborts it as soon as it exists
                return
        super().abort(detail)

    async def _opened(self) -> None:
        if not self._ready.is_set():  # the handshake runs on this loop: wait for it off the loop
            await anyio.to_thread.run_sync(self._ready.wait)
        if self._error is not None:
            raise self._error

    async def _open(self, bootstrap: str, pages: Pages | None, aux_slot: int | None, prefix: int) -> None:
        """Runs on the loop, in the facade's task group: the handshake, then the room's requests if
        ``pages`` were given. Cancelled by ``close()``, which leaves the handle Failed."""
        try:
            try:
                receiver = await self._engine._engine.receiver(self.room, bootstrap, pages, aux_slot, prefix)
            except TransferError as exc:
                log.info("room %d did not open: %s", self.room, exc)
                self._error = exc
                return
            except BaseException:
                self._error = LocalProtocolError(f"the engine closed before room {self.room} opened")
                raise
            with self._lock:
                self._receiver = receiver
                self._requested = pages is not None
                abort = self._abort
        finally:
            self._ready.set()
        if abort is not None:
            await receiver.abort(abort)


def _lower_switch_interval(interval: float) -> None:
    """Lower the process's GIL switch interval to ``interval`` (``EngineConfig.gil_switch_interval``:
    why); never raise it, 0 leaves it alone."""
    current = sys.getswitchinterval()
    if 0 < interval < current:
        sys.setswitchinterval(interval)
        log.info(
            "GIL switch interval lowered from %.4f s to %.4f s for the engine's loop thread",
            current,
            interval,
        )


class BlockingEngine:
    """One rank's :class:`TransferEngine`, run on its own event-loop thread; see the module docstring.

    ``with BlockingEngine(config, pool) as engine:`` starts it (blocking until every actor is up,
    raising what the engine's start raised) and closes it on exit: live rooms fail with SHUTDOWN,
    then the loop thread, its sockets and NIXL handles are gone.
    """

    def __init__(
        self,
        config: EngineConfig,
        kv: KVPool,
        *,
        transport: Transport | None = None,
        cpus: frozenset[int] | None = None,
    ) -> None:
        """``transport``: the engine's NIXL transport (None: the engine makes its own). ``cpus``: the
        CPUs the loop thread, and every thread the engine starts (they inherit it), may run on (None:
        the caller's); ConfigError when the process may not run there."""
        self.config = config
        self.pool = kv
        _lower_switch_interval(config.gil_switch_interval)
        self._closed = False
        self._close_lock = threading.Lock()
        self._loop_thread = LoopThread(f"te-{config.role}-{config.tp_rank}")
        self._loop_thread.start()
        if cpus is not None:  # before the engine exists: the threads it starts inherit the mask
            try:
                self._loop_thread.call(os.sched_setaffinity, 0, cpus)
            except OSError as exc:
                self._loop_thread.close()
                raise ConfigError(f"cpus={sorted(cpus)}: cannot run the engine there: {exc}") from None
        opened: concurrent.futures.Future[tuple[TransferEngine, Mailer]] = concurrent.futures.Future()
        self._served: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._loop_thread.spawn(self._serve, config, kv, transport, opened)
        try:
            engine, mailer = opened.result()
        except BaseException:
            self._loop_thread.close()
            raise
        self._engine: TransferEngine = engine
        self._mailer: Mailer = mailer

    async def _serve(
        self,
        config: EngineConfig,
        kv: KVPool,
        transport: Transport | None,
        opened: concurrent.futures.Future[tuple[TransferEngine, Mailer]],
    ) -> None:
        """The engine's life on the loop: open it, report it to ``opened``, serve until close()."""
        try:
            self._closing = anyio.Event()
            if (
                kv.device.type == "cuda"
            ):  # the loop thread's CUDA calls (events, streams) on the pool's device
                torch.cuda.set_device(kv.device)
            async with (
                TransferEngine(config, kv, transport=transport) as engine,
                anyio.create_task_group() as tg,
            ):
                mailer = Mailer(tg)
                tg.start_soon(mailer.run)
                opened.set_result((engine, mailer))
                await self._closing.wait()
                tg.cancel_scope.cancel()
        except Exception as exc:
            (self._served if opened.done() else opened).set_exception(exc)
        except BaseException:  # the loop was closed under it
            opened.cancel()
            self._served.cancel()
            raise
        else:
            self._served.set_result(None)

    # --- plumbing (callable from any thread) ----------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise LocalProtocolError("this BlockingEngine is closed")

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        self._check_open()
        return self._loop_thread.call(fn, *args)

    def _call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        """Have the loop run ``fn(*args)`` soon, after every call queued before it; from any thread
        (:meth:`LoopThread.call_soon`)."""
        self._loop_thread.call_soon(fn, *args)

    def _post(self, handle: Sender | Receiver, mail: RoomMail) -> None:
        self._call_soon(self._mailer.post, handle, mail)

    # --- work on the engine's loop (callable from any thread) -----------------------------------

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(engine, *args)`` on the loop, ``engine`` being the asyncio :class:`TransferEngine`;
        block until it returned and return its result (or raise its error). ``fn`` is an async
        function, or a synchronous one run as one step of the loop. LocalProtocolError once closed."""
        return self._call(fn, self._engine, *args)

    def spawn(self, fn: Callable[..., Coroutine[Any, Any, None]], *args: Any) -> None:
        """Start the async ``fn(engine, *args)`` as a task on the loop (``engine`` as for :meth:`call`);
        never blocks. Tasks start in the order they were handed over, after everything queued before
        them; they are cancelled by :meth:`close` before the engine stops. An error a task raises is
        logged; the engine and the other tasks go on. LocalProtocolError once closed."""
        self._check_open()
        self._call_soon(self._mailer.start, self._logged, fn, args)

    def call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        """Have the loop run the synchronous ``fn(*args)`` soon, after everything queued before it
        (handles' mail, tasks, callbacks); never blocks. What it raises is logged. LocalProtocolError
        once closed."""
        self._check_open()
        self._call_soon(fn, *args)

    async def _logged(self, fn: Callable[..., Coroutine[Any, Any, None]], args: tuple[Any, ...]) -> None:
        try:
            await fn(self._engine, *args)
        except Exception:
            log.exception("a task on the %s engine's loop failed: %r", self.config.role, fn)

    # --- API --------------------------------------------------------------------------------------

    @property
    def agent_name(self) -> str:
        return self._engine.agent_name

    @property
    def endpoint(self) -> str:
        """This rank's control endpoint."""
        return self._engine.endpoint

    @property
    def introspect_endpoint(self) -> str:
        """Where ``transfer-engine dump --endpoint`` reaches this rank."""
        return self._engine.introspect_endpoint

    def sender(self, room: int | str, *, layers_per_write: int | None = None) -> BlockingSender:
        """Open ``room`` (an int, or a string request id) on this prefill rank.

        Waits for one synchronous step of the loop. ConfigError for a decode engine, a bad id or a
        bad ``layers_per_write`` (None: the config's), RoomInUseError while a room with that id is live.
        """
        opened = self._call(
            functools.partial(self._engine.sender, _room(room), layers_per_write=layers_per_write)
        )
        return BlockingSender(self, opened)

    def receiver(
        self,
        room: int | str,
        bootstrap: str,
        pages: Pages | None = None,
        aux_slot: int | None = None,
        decode_prefix_len: int = 0,
    ) -> BlockingReceiver:
        """Open ``room`` on this decode rank and start its handshake with ``bootstrap``; never blocks.

        Without ``pages``, give them with :meth:`BlockingReceiver.request` once poll() says
        WaitingForInput. Bad arguments raise ConfigError/LayoutError here; a handshake that fails
        (unreachable bootstrap, incompatible layout) makes poll() say Failed and ``open_error`` why.
        """
        self._check_open()
        if self.config.role != "decode":
            raise ConfigError("receiver() is for decode engines; this one is prefill")
        rid = _room(room)
        if pages is not None:
            check_pages(self.pool, pages, aux_slot, decode_prefix_len)
        if rid in self._engine.rooms:  # the loop checks again; this catches the usual case early
            raise RoomInUseError(rid)
        receiver = BlockingReceiver(self, rid)
        self._call_soon(self._mailer.start, receiver._open, bootstrap, pages, aux_slot, decode_prefix_len)
        return receiver

    def connect(self, bootstrap: str) -> None:
        """Handshake with the prefill instance behind ``bootstrap`` now; blocks (``bootstrap_timeout``)."""
        self._call(self._engine.connect, bootstrap)

    def estimate_transfer(self, peer: str, nbytes: int) -> float:
        """Seconds a new room of ``nbytes`` from the prefill instance behind ``peer`` would take if
        opened now (:meth:`TransferEngine.estimate_transfer`); one synchronous loop step."""
        return float(self._call(self._engine.estimate_transfer, peer, nbytes))

    def transfer_costs(self) -> dict[str, PeerLoad]:
        """Per prefill instance: rooms and bytes queued and in flight, and the measured rate
        (:meth:`TransferEngine.transfer_costs`); one synchronous loop step."""
        return dict(self._call(self._engine.transfer_costs))

    def leaks(self) -> dict[str, int]:
        """What the engine still holds (see :meth:`TransferEngine.leaks`); one synchronous loop step."""
        return dict(self._call(self._engine.leaks))

    def take_trace(self) -> list[tuple[int, int, str]]:
        """The step marks recorded since the last call (``EngineConfig.trace_steps``; none when
        off): ``(monotonic_ns, room, step)``, oldest first (``transfer_engine.runtime.steptrace``). One
        synchronous loop step."""
        return list(self._call(self._engine.me.trace.take))

    def close(self) -> None:
        """Fail live rooms with SHUTDOWN, stop the engine and its thread. Idempotent; see the module doc."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._loop_thread.call_soon(self._closing.set)
            self._served.result()
        except concurrent.futures.CancelledError:
            log.warning("the engine's loop stopped before the engine closed")
        finally:
            self._loop_thread.close()

    def __enter__(self) -> BlockingEngine:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
