"""Waking the event loop when a CUDA event, or a ``threading.Event`` of a CPU thread, completes.

Nothing on the GPU can signal an asyncio loop, and polling an event from the loop costs a poll
period plus however late the loop's timer fires while it is busy (a 50 us gather read 0.57 ms in
the step trace, docs/PERF.md "Per-room overhead"). A :class:`CompletionWaiter` owns ONE thread that
blocks on the completions handed to it, oldest first (``torch.cuda.Event.synchronize`` and
``threading.Event.wait`` release the GIL), and wakes each waiting task with
``loop.call_soon_threadsafe`` as soon as its completion is reached: no poll period, and the loop
sleeps meanwhile.

One waiter per actor that owns a CUDA stream (each prefill worker, the scatter actor), never one per
room or per event: the completions of one stream are reached in the order they were recorded, so
blocking on the oldest delays no younger one. Completions of other origins (a layer's ready event on
the application's stream) may sit behind an older one of another stream; after each wake-up the
thread also wakes every younger completion that is already reached. A ``threading.Event`` may never
be set (the layers of a room cancelled before its KV was written): the thread blocks on one for at
most STOP_CHECK_S before it looks at the younger ones again, so such an event delays them by that
much at worst, never for good, and :meth:`CompletionWaiter.forget` drops the waits of a cancelled
owner.

:meth:`wait` is for a task that has nothing else to do meanwhile (a gather, a scatter);
:meth:`notify` calls back on the loop, for an actor that keeps serving its mail meanwhile (a worker
holding layer-wise jobs whose layers are not written yet). Started by its actor's ``run`` and closed
when the actor ends (:meth:`close` joins the thread). Without an asyncio loop (another anyio
backend) :meth:`wait` polls on the loop's fine timers.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from transfer_engine.events import Completion, reached, recorded
from transfer_engine.runtime import ticker

log = logging.getLogger(__name__)

__all__ = ["Completion", "CompletionWaiter", "poll_reached", "reached", "recorded"]

POLL_S = 0.0001
"""Poll period of :func:`poll_reached`, the path without an asyncio loop."""

JOIN_S = 5.0
"""How long :meth:`CompletionWaiter.close` waits for the thread (it is blocked on a completion)."""

STOP_CHECK_S = 0.05
"""How often a thread blocked on a ``threading.Event`` looks whether its waiter is closing."""


async def poll_reached(done: Completion, poll_s: float = POLL_S) -> None:
    """Return once ``done`` completed, querying it every ``poll_s`` on the loop's fine timers."""
    while not reached(done):  # noqa: ASYNC110 - nothing of ours is told when it completes
        await ticker.sleep(poll_s)


@dataclass(slots=True)
class _Wait:
    done: Completion
    loop: asyncio.AbstractEventLoop
    callback: Callable[[], object]
    first: Callable[[], object] | None = None
    """Run on the waiter's thread once ``done`` is reached, before ``callback`` is handed to the loop."""
    owner: object = None
    """Whose wait it is (:meth:`CompletionWaiter.forget`)."""


@dataclass(frozen=True, slots=True)
class _Forget:
    owner: object


def _run_first(first: Callable[[], object] | None, name: str) -> None:
    """Run a wait's ``first`` (:meth:`CompletionWaiter.notify`); what it raises is logged, not raised:
    the thread must go on waking the others."""
    if first is None:
        return
    try:
        first()
    except Exception:
        log.exception("completion waiter %s: a first step raised", name)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():  # the waiting task was cancelled meanwhile
        future.set_result(None)


class CompletionWaiter:
    """One thread that wakes the loop's tasks when their completions are reached; see the module."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._started = False
        self._queue: queue.SimpleQueue[_Wait | _Forget | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.counters: Counter[str] = Counter()
        """``reached`` at once (no thread hop), ``handed`` to the thread, ``woken`` by it, ``polled``
        on the loop (no asyncio loop), ``forgotten`` (:meth:`forget`)."""

    @property
    def running(self) -> bool:
        """Started and not closed: its thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the thread (once)."""
        if self._started:
            raise RuntimeError(f"completion waiter {self.name} started twice")
        self._started = True
        self._thread = threading.Thread(target=self._run, name=f"te-completion-{self.name}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread; what it still holds is dropped (its actor ended: nobody waits for it).

        A thread blocked on a CUDA event returns when the GPU reaches it; one blocked on a
        ``threading.Event`` checks for the stop every STOP_CHECK_S.
        """
        self._stopping.set()
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._queue.put(None)
        thread.join(JOIN_S)
        if thread.is_alive():
            log.warning("completion waiter %s: thread still blocked after %.0f s", self.name, JOIN_S)

    async def wait(self, done: Completion) -> None:
        """Return once ``done`` has completed, without blocking the loop or polling it.

        Cancellable: a cancelled wait leaves the thread nothing to do but drop it once reached.
        """
        if reached(done):
            self.counters["reached"] += 1
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None or not self.running:
            self.counters["polled"] += 1
            await poll_reached(done)
            return
        future: asyncio.Future[None] = loop.create_future()
        self._hand(_Wait(done, loop, functools.partial(_wake, future)))
        await future

    def notify(
        self,
        done: Completion,
        callback: Callable[[], object],
        first: Callable[[], object] | None = None,
        *,
        owner: object = None,
    ) -> None:
        """Call ``callback()`` on the running loop's thread once ``done`` has completed (at once,
        from here, when it already has). Needs the thread running and an asyncio loop.

        ``first()``, if given, runs just before, on whichever thread saw ``done`` complete: the
        waiter's own, so that what cannot wait for the loop's turn (starting a made WRITE) is done
        the moment the GPU is (docs/DECISIONS.md, "A held WRITE is started by the completion
        waiter's thread"). It must be safe on any thread; what it raises is logged and dropped.
        ``owner``: whose wait it is, for :meth:`forget`."""
        if reached(done):
            self.counters["reached"] += 1
            _run_first(first, self.name)
            callback()
            return
        if not self.running:
            raise RuntimeError(f"completion waiter {self.name} is not running")
        self._hand(_Wait(done, asyncio.get_running_loop(), callback, first, owner))

    def forget(self, owner: object) -> None:
        """Drop the waits :meth:`notify` was given for ``owner`` and that have not called back: their
        owner no longer needs them (a cancelled job, whose KV may never be written). From the loop;
        a callback already on its way to the loop still runs."""
        if owner is not None and self.running:
            self._queue.put(_Forget(owner))

    def _hand(self, wait: _Wait) -> None:
        self.counters["handed"] += 1
        self._queue.put(wait)

    def _block(self, done: Completion) -> bool:
        """Block until ``done`` completed, or for STOP_CHECK_S at most on a ``threading.Event`` (which
        may never be set); True when it completed."""
        if isinstance(done, threading.Event):
            return done.wait(STOP_CHECK_S)
        done.synchronize()
        return True

    def _take(self, pending: list[_Wait], item: _Wait | _Forget) -> None:
        if isinstance(item, _Wait):
            pending.append(item)
            return
        kept = [wait for wait in pending if wait.owner is not item.owner]
        self.counters["forgotten"] += len(pending) - len(kept)
        pending[:] = kept

    def _run(self) -> None:
        pending: list[_Wait] = []
        while not self._stopping.is_set():
            if not pending:
                item = self._queue.get()
                if item is None:
                    return
                self._take(pending, item)
                continue
            first = pending[0]
            oldest = self._block(first.done)
            if self._stopping.is_set():
                return
            while True:  # take what came meanwhile: it may be reached too
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    return
                self._take(pending, item)
            still: list[_Wait] = []
            for wait in pending:
                if (wait is first and oldest) or reached(wait.done):
                    self.counters["woken"] += 1
                    _run_first(wait.first, self.name)
                    try:
                        wait.loop.call_soon_threadsafe(wait.callback)
                    except RuntimeError:  # the loop closed: nobody waits any more
                        pass
                else:
                    still.append(wait)
            pending = still
