"""Sub-millisecond wake-ups for the event loop, from a Linux ``timerfd``.

asyncio sleeps through ``epoll_wait``, whose timeout is whole milliseconds (CPython rounds up), so
``anyio.sleep(0.0002)`` sleeps a millisecond or more. The NIXL poller must look for notifications
every few hundred microseconds while rooms are live, or every small room pays a millisecond per
side. A ``timerfd`` armed with a nanosecond deadline and watched by the loop like any other file
descriptor wakes it on time (hrtimer resolution, within the kernel's timer slack).

:class:`Ticker` owns one timerfd. :meth:`Ticker.arm` sets its one-shot deadline; when it expires the
loop calls ``on_fire`` (from the loop thread). Where there is no timerfd (not Linux) :func:`open_ticker`
returns None and the poller sleeps with the loop's own (millisecond) timers, which it logs once.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
import sys
from collections.abc import Callable

log = logging.getLogger(__name__)

_CLOCK_MONOTONIC = 1
_TFD_NONBLOCK = os.O_NONBLOCK
_TFD_CLOEXEC = os.O_CLOEXEC


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    return lib if hasattr(lib, "timerfd_create") else None


class Ticker:
    """One timerfd registered with the running asyncio loop; see the module docstring."""

    def __init__(self, libc: ctypes.CDLL, on_fire: Callable[[], None]) -> None:
        fd = libc.timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"timerfd_create: {os.strerror(err)}")
        self._libc = libc
        self._fd = fd
        self._on_fire = on_fire
        self._spec = _Itimerspec()
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(fd, self._fired)

    def arm(self, seconds: float) -> None:
        """Fire once, ``seconds`` from now (replacing any earlier deadline)."""
        ns = max(int(seconds * 1e9), 1000)
        self._spec.it_value.tv_sec, self._spec.it_value.tv_nsec = divmod(ns, 1_000_000_000)
        if self._libc.timerfd_settime(self._fd, 0, ctypes.byref(self._spec), None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"timerfd_settime: {os.strerror(err)}")

    def _fired(self) -> None:
        try:
            os.read(self._fd, 8)
        except BlockingIOError:  # disarmed or re-armed after it became readable
            return
        self._on_fire()

    def close(self) -> None:
        if self._fd >= 0:
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1


def open_ticker(on_fire: Callable[[], None]) -> Ticker | None:
    """A :class:`Ticker` on the running loop, or None where timerfd or an asyncio loop is missing."""
    libc = _libc()
    if libc is None:
        log.info("no timerfd on %s: NIXL polling sleeps with millisecond loop timers", sys.platform)
        return None
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        log.info("not on an asyncio loop: NIXL polling sleeps with the loop's own timers")
        return None
    return Ticker(libc, on_fire)
