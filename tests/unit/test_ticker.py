"""The loop's fine timers (one timerfd) that let the engine sleep less than epoll's millisecond."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import os
import sys

import anyio
import pytest

from transfer_engine.runtime import ticker
from transfer_engine.runtime.ticker import FineTimers, fine_timers

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timerfd is Linux-only")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_callbacks_run_in_deadline_order_once() -> None:
    timers = fine_timers()
    assert isinstance(timers, FineTimers)
    assert fine_timers() is timers  # one per loop
    order: list[str] = []
    done = anyio.Event()
    timers.call_later(0.003, lambda: order.append("late"))
    timers.call_later(0.0002, lambda: order.append("early"))  # re-arms for the earlier deadline
    timers.call_later(0.004, done.set)
    with anyio.fail_after(5):
        await done.wait()
    await anyio.sleep(0.02)  # one-shot: nothing runs twice
    assert order == ["early", "late"]


@pytest.mark.anyio
async def test_sleep_returns_and_many_sleepers_share_the_timer() -> None:
    woke: list[int] = []

    async def sleeper(i: int) -> None:
        await ticker.sleep(0.0001 * (i % 5))
        woke.append(i)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            for i in range(50):
                tg.start_soon(sleeper, i)
    assert sorted(woke) == list(range(50))


@pytest.mark.anyio
async def test_a_cancelled_sleep_leaves_nothing_behind_that_matters() -> None:
    with anyio.move_on_after(0.001):
        await ticker.sleep(3600)  # its heap entry stays, harmless: it only sets an orphan Event
    with anyio.fail_after(5):
        await ticker.sleep(0.0002)  # the timer still serves the next sleeper


@pytest.mark.anyio
async def test_close_stops_it() -> None:
    timers = fine_timers()
    assert timers is not None
    calls: list[int] = []
    timers.call_later(0.001, lambda: calls.append(1))
    timers.close()
    timers.close()  # idempotent
    await anyio.sleep(0.02)
    assert calls == []


def test_none_without_an_asyncio_loop() -> None:
    assert fine_timers() is None


def test_a_finished_loop_releases_its_timerfd() -> None:
    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    asyncio.run(ticker.sleep(0.0001))
    gc.collect()
    before = fds()
    for _ in range(50):
        asyncio.run(ticker.sleep(0.0001))
    gc.collect()
    assert fds() <= before + 2  # not one timerfd per loop that ever ran


@pytest.mark.anyio
async def test_a_raising_callback_does_not_stop_the_others() -> None:
    timers = fine_timers()
    assert timers is not None
    done = anyio.Event()

    def bad() -> None:
        raise ValueError("boom")

    timers.call_later(0.0005, bad)
    timers.call_later(0.0005, done.set)  # due in the same wake-up
    with anyio.fail_after(5):
        await done.wait()


@pytest.mark.anyio
async def test_arming_and_firing_keep_the_gil() -> None:
    """Arming the timer and reading it when it fired must not let the GIL go: with a busy Python
    thread in the process (a scheduler's), each release cost a hand-over, 164 us on average and up
    to 6.9 ms (docs/PERF.md). ctypes keeps the GIL only for the functions of a ``PyDLL`` (their
    ``FUNCFLAG_PYTHONAPI`` flag); those of a ``CDLL`` release it around every call. Every libc function the
    timers call is checked, then used once.

    Not a thread counting beside the calls: a release hands the GIL over only to a waiter that has
    already asked for a switch, so such a probe passed with a ``CDLL`` (tried) and failed under load
    with a ``PyDLL`` (a switch forced by the interval)."""
    timers = fine_timers()
    assert isinstance(timers, FineTimers)
    for name in ("timerfd_create", "timerfd_settime", "read"):
        flags = getattr(timers._libc, name)._flags_
        assert flags & ctypes._FUNCFLAG_PYTHONAPI, f"libc.{name} releases the GIL (flags {flags:#x})"
    timers._arm(0.0)  # a deadline in the past: the fd is readable at once
    timers._fired()
