"""The one bridge between threaded callers and the engine's event loop.

:class:`LoopThread` runs one asyncio event loop (under anyio) on a daemon thread of its own, with a
task group that every task it starts belongs to. Code on other threads never runs asyncio code: it
hands work to the loop with one of three calls, each of which says how long it may block:

- :meth:`LoopThread.call` blocks until the loop has run the function and returns its result (or
  raises its error);
- :meth:`LoopThread.call_soon` never blocks: the loop runs the synchronous callback soon, after every
  callback queued before it;
- :meth:`LoopThread.spawn` never blocks: the loop starts the async function as a task of its group.

:meth:`LoopThread.close` cancels the tasks, stops the loop and joins the thread. The blocking facade
(:mod:`transfer_engine.facade.blocking`), the bootstrap server (:mod:`transfer_engine.facade.bootstrap`)
and the integrations' runners share it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import anyio
from anyio.abc import TaskGroup

from transfer_engine.errors import LocalProtocolError

__all__ = ["LoopThread"]

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 30.0
"""How long :meth:`LoopThread.close` waits for the thread once its tasks are cancelled."""

_ALIVE_CHECK_S = 0.5
"""How often a blocked :meth:`LoopThread.call` checks that the loop's thread still runs."""


class LoopThread:
    """One asyncio event loop (anyio) on its own daemon thread; see the module docstring.

    Every method may be called from any thread but the loop's own (where :meth:`call` would wait for
    itself: it raises :class:`LocalProtocolError` there). After :meth:`close`, :meth:`call` raises
    LocalProtocolError and :meth:`call_soon` and :meth:`spawn` do too.
    """

    loop: asyncio.AbstractEventLoop
    """The running loop, for callers that use ``call_soon_threadsafe`` themselves (set by start())."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._closed = False
        self._close_lock = threading.Lock()
        self._tg: TaskGroup | None = None
        self._stop: anyio.Event | None = None
        self._queued: deque[tuple[Callable[..., Any], tuple[Any, ...]]] = deque()
        """Callbacks for the loop from callers' threads, in order (see :meth:`call_soon`)."""
        self._wake_pending = False
        """A wake-up of the loop is scheduled and has not started taking ``_queued`` yet."""
        self._spawns: deque[tuple[Callable[..., Any], tuple[Any, ...]]] = deque()
        self._spawn_wake: anyio.Event | None = None

    # --- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the thread and its loop; returns once the loop runs. Once only."""
        if self._closed:
            raise LocalProtocolError(f"loop thread {self.name!r} is closed")
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise self._start_error

    def close(self) -> None:
        """Cancel the loop's tasks, stop the loop and join the thread; idempotent, from any thread
        but the loop's. Calls blocked in :meth:`call` raise LocalProtocolError."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if not self._thread.is_alive():
            return
        if threading.current_thread() is self._thread:
            raise LocalProtocolError(f"loop thread {self.name!r} cannot close itself from its own loop")
        stop = self._stop
        if stop is not None:
            try:
                self.loop.call_soon_threadsafe(stop.set)
            except RuntimeError:  # the loop has already stopped
                pass
        self._thread.join(JOIN_TIMEOUT_S)
        if self._thread.is_alive():
            log.error("loop thread %r did not stop within %.0f s", self.name, JOIN_TIMEOUT_S)

    def _main(self) -> None:
        try:
            anyio.run(self._serve, backend="asyncio")
        except BaseException as exc:  # noqa: BLE001 - reported to start() or logged: nothing else waits
            if not self._started.is_set():
                self._start_error = exc
                self._started.set()
            else:
                log.exception("loop thread %r stopped on an error", self.name)

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = anyio.Event()
        self._spawn_wake = anyio.Event()
        async with anyio.create_task_group() as tg:
            self._tg = tg
            tg.start_soon(self._start_spawns)
            self._started.set()
            await self._stop.wait()
            tg.cancel_scope.cancel()

    # --- handing work to the loop (any thread) -------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise LocalProtocolError(f"loop thread {self.name!r} is closed")
        if not self._started.is_set():
            raise LocalProtocolError(f"loop thread {self.name!r} is not started")

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the loop, as a task of its group; block until it returns, and return
        its result or raise its error. ``fn`` is an async function (a synchronous one is run as one
        step of the loop). LocalProtocolError if the loop closes first."""
        self._check_open()
        if threading.current_thread() is self._thread:
            raise LocalProtocolError(f"call() on loop thread {self.name!r} from the loop itself")
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.spawn(self._settle, done, fn, args)
        while not done.done():  # a loop that stops before it started the call leaves it unsettled
            concurrent.futures.wait([done], timeout=_ALIVE_CHECK_S)
            if not done.done() and not self._thread.is_alive():
                done.cancel()
        try:
            return done.result()
        except concurrent.futures.CancelledError:
            raise LocalProtocolError(f"loop thread {self.name!r} closed before {fn!r} returned") from None

    async def _settle(
        self, done: concurrent.futures.Future[Any], fn: Callable[..., Any], args: tuple[Any, ...]
    ) -> None:
        try:
            result = fn(*args)
            if inspect.isawaitable(result):
                result = await result
        except Exception as exc:
            done.set_exception(exc)
        except BaseException:  # cancelled: the loop is closing
            done.cancel()
            raise
        else:
            done.set_result(result)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Have the loop run the synchronous ``fn(*args)`` soon, after every callback queued before
        it; never blocks. An error it raises is logged, and the callbacks after it still run.

        Costs a deque append; the loop is woken (``call_soon_threadsafe``: a callback and a write to
        its self-pipe) only when no wake-up is pending, so callbacks queued while the loop is busy
        ride on the wake-up already scheduled and run in one go. ``_wake_pending`` is cleared before
        the queue is taken: a callback appended after the loop's last look finds it False and wakes it.
        """
        self._check_open()
        self._queued.append((fn, args))
        if not self._wake_pending:
            self._wake_pending = True
            try:
                self.loop.call_soon_threadsafe(self._run_queued)
            except RuntimeError:  # the loop has stopped (closed, or ended on an error)
                raise LocalProtocolError(f"loop thread {self.name!r} has stopped") from None

    def _run_queued(self) -> None:
        """On the loop: run every queued callback, in order (an error in one is logged, the rest run)."""
        self._wake_pending = False
        queued = self._queued
        while queued:
            fn, args = queued.popleft()
            try:
                fn(*args)
            except Exception:
                log.exception("a callback on loop thread %r failed: %r", self.name, fn)

    def spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        """Start the async ``fn(*args)`` as a task of the loop's group; never blocks. The task is
        cancelled by :meth:`close`; an error it raises is logged and the loop's other tasks go on."""
        self.call_soon(self._queue_spawn, fn, args)

    def _queue_spawn(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        # A loop callback runs where no task is current, so it starts nothing itself: the
        # spawner task does (in the order the spawns were queued).
        assert self._spawn_wake is not None
        self._spawns.append((fn, args))
        self._spawn_wake.set()

    async def _start_spawns(self) -> None:
        tg = self._tg
        assert tg is not None and self._spawn_wake is not None
        while True:
            await self._spawn_wake.wait()
            self._spawn_wake = anyio.Event()
            while self._spawns:
                fn, args = self._spawns.popleft()
                tg.start_soon(self._guarded, fn, args, name=getattr(fn, "__qualname__", None))

    async def _guarded(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            await fn(*args)
        except Exception:
            log.exception("a task on loop thread %r failed: %r", self.name, fn)
