"""Sub-millisecond timers for the event loop, from one Linux ``timerfd`` per loop.

asyncio sleeps through ``epoll_wait``, whose timeout is whole milliseconds (CPython rounds up), so
``anyio.sleep(0.0002)`` sleeps a millisecond or more. Two loops of the engine must wake sooner than
that: the NIXL poller, which looks for notifications every few hundred microseconds while rooms are
live (or every small room pays a millisecond per side), and the waits on CUDA events (a gather or a
scatter that takes 50 us must not cost 1 ms). A ``timerfd`` armed with a nanosecond deadline and
watched by the loop like any other file descriptor wakes it on time (hrtimer resolution, within the
kernel's timer slack, 50 us by default).

:func:`fine_timers` gives the running loop's :class:`FineTimers` (made on first use): a heap of
deadlines on one timerfd, armed for the earliest. Where there is no timerfd (not Linux) or no asyncio
loop it returns None, and :func:`sleep` falls back to the loop's own millisecond timers, which it logs
once.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import errno
import heapq
import itertools
import logging
import os
import sys
import time
import weakref
from collections.abc import Callable

import anyio

log = logging.getLogger(__name__)

_CLOCK_MONOTONIC = 1  # the clock of time.monotonic()
_TFD_TIMER_ABSTIME = 1
_SLACK_S = 20e-6
"""Deadlines this close are run in the same wake-up (the timer would fire again at once)."""


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _load_libc() -> ctypes.CDLL | None:
    """libc as a ``PyDLL``: its calls keep the GIL. ``timerfd_settime`` and a non-blocking ``read``
    return in about a microsecond; through ``ctypes.CDLL`` (and ``os.read``) each released the GIL,
    and with a busy Python thread in the process (a scheduler's) every release cost a hand-over:
    164 us per arm on average, 6.9 ms at worst, against 1.2 us (docs/PERF.md, "The loop's GIL
    hand-overs")."""
    if not sys.platform.startswith("linux"):
        return None
    lib = ctypes.PyDLL(ctypes.util.find_library("c") or None, use_errno=True)
    return lib if hasattr(lib, "timerfd_create") else None


_LIBC = _load_libc()
_BY_LOOP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, FineTimers] = weakref.WeakKeyDictionary()
_warned = False


def _oserror(call: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{call}: {os.strerror(err)}")


class FineTimers:
    """Callbacks at sub-millisecond deadlines on one asyncio loop; see the module docstring."""

    def __init__(self, libc: ctypes.CDLL, loop: asyncio.AbstractEventLoop) -> None:
        fd = libc.timerfd_create(_CLOCK_MONOTONIC, os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            raise _oserror("timerfd_create")
        self._libc = libc
        self._fd = fd
        self._loop = weakref.ref(loop)  # not the loop itself: _BY_LOOP must not keep it alive
        self._heap: list[tuple[float, int, Callable[[], object]]] = []
        self._seq = itertools.count()
        self._spec = _Itimerspec()
        self._expirations = ctypes.c_uint64()
        self._armed = float("inf")
        loop.add_reader(fd, self._fired)
        self._finalizer = weakref.finalize(self, os.close, fd)

    def call_later(self, seconds: float, callback: Callable[[], object]) -> None:
        """Run ``callback()`` on the loop ``seconds`` from now. Only from the loop's own thread.

        Not cancellable: callbacks must be harmless when late (setting an Event nobody waits on any
        more). One that raises is logged and does not keep the others from running.
        """
        if not self.open:
            raise RuntimeError("FineTimers used after close()")
        deadline = time.monotonic() + max(seconds, 0.0)
        heapq.heappush(self._heap, (deadline, next(self._seq), callback))
        if deadline < self._armed:
            self._arm(deadline)

    async def sleep(self, seconds: float) -> None:
        done = anyio.Event()
        self.call_later(seconds, done.set)
        await done.wait()

    def _arm(self, deadline: float) -> None:
        self._armed = deadline
        sec, frac = divmod(max(deadline, 1e-6), 1.0)
        self._spec.it_value.tv_sec = int(sec)
        self._spec.it_value.tv_nsec = int(frac * 1e9)
        if self._libc.timerfd_settime(self._fd, _TFD_TIMER_ABSTIME, ctypes.byref(self._spec), None) != 0:
            raise _oserror("timerfd_settime")

    def _fired(self) -> None:
        # libc's read, keeping the GIL (os.read would hand it over); the fd is non-blocking
        if self._libc.read(self._fd, ctypes.byref(self._expirations), 8) != 8:
            if ctypes.get_errno() in (errno.EAGAIN, errno.EWOULDBLOCK):  # re-armed after it became readable
                return
            raise _oserror("read(timerfd)")
        self._armed = float("inf")
        now = time.monotonic()
        due: list[Callable[[], object]] = []
        while self._heap and self._heap[0][0] <= now + _SLACK_S:
            due.append(heapq.heappop(self._heap)[2])
        if self._heap:
            self._arm(self._heap[0][0])
        for callback in due:
            try:
                callback()
            except Exception:
                log.exception("fine timer callback %r raised", callback)

    @property
    def open(self) -> bool:
        return self._finalizer.alive

    def close(self) -> None:
        if self._finalizer.alive:
            loop = self._loop()
            if loop is not None and not loop.is_closed():
                loop.remove_reader(self._fd)
            self._finalizer()
        self._heap.clear()


def fine_timers() -> FineTimers | None:
    """The running asyncio loop's :class:`FineTimers`, or None without timerfd or an asyncio loop."""
    global _warned
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    if _LIBC is None or loop is None:
        if not _warned:
            _warned = True
            log.info("no timerfd or no asyncio loop: sub-millisecond sleeps last a millisecond or more")
        return None
    timers = _BY_LOOP.get(loop)
    if timers is None or not timers.open:
        timers = _BY_LOOP[loop] = FineTimers(_LIBC, loop)
    return timers


async def sleep(seconds: float) -> None:
    """Like ``anyio.sleep`` but on time below a millisecond (see the module docstring)."""
    timers = fine_timers()
    if timers is None:
        await anyio.sleep(seconds)
    else:
        await timers.sleep(seconds)
