"""CompletionWaiter: one thread wakes the loop when CPU threading.Events (and, on GPUs, CUDA events) complete."""

from __future__ import annotations

import threading
import time

import anyio
import pytest
import torch

from transfer_engine.runtime.completion import STOP_CHECK_S, CompletionWaiter, reached, recorded

pytestmark = pytest.mark.anyio


def _set_later(event: threading.Event, delay: float) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(delay), event.set()))
    thread.start()
    return thread


def _waiter_threads() -> list[threading.Thread]:
    """This module's waiters' threads (all named "t"); an engine of an earlier test may still be
    joining its own workers' threads, which are not these."""
    return [t for t in threading.enumerate() if t.name == "te-completion-t" and t.is_alive()]


async def test_wait_returns_once_another_thread_sets_the_event() -> None:
    waiter = CompletionWaiter("t")
    waiter.start()
    try:
        done = threading.Event()
        setter = _set_later(done, 0.05)
        with anyio.fail_after(10):
            await waiter.wait(done)
        assert reached(done)
        setter.join()
        assert waiter.counters["handed"] == 1 and waiter.counters["woken"] == 1
    finally:
        waiter.close()
    assert not waiter.running and not _waiter_threads()


async def test_a_reached_completion_needs_no_thread_hop() -> None:
    waiter = CompletionWaiter("t")
    waiter.start()
    try:
        done = threading.Event()
        done.set()
        await waiter.wait(done)
        called: list[int] = []
        waiter.notify(done, lambda: called.append(1))
        assert called == [1]  # inline: it had completed
        assert waiter.counters == {"reached": 2}
    finally:
        waiter.close()


async def test_many_waits_completed_in_any_order_all_wake() -> None:
    waiter = CompletionWaiter("t")
    waiter.start()
    events = [threading.Event() for _ in range(20)]
    woken: list[int] = []

    async def one(i: int) -> None:
        await waiter.wait(events[i])
        woken.append(i)

    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for i in range(len(events)):
                    tg.start_soon(one, i)
                await anyio.sleep(0.01)
                for event in reversed(events):  # the youngest first: they wait behind the oldest
                    event.set()
        assert sorted(woken) == list(range(20))
        assert waiter.counters["woken"] == 20
    finally:
        waiter.close()


async def test_notify_calls_back_on_the_loop_thread() -> None:
    waiter = CompletionWaiter("t")
    waiter.start()
    loop_thread = threading.get_ident()
    called = anyio.Event()
    seen: list[int] = []

    def callback() -> None:
        seen.append(threading.get_ident())
        called.set()

    try:
        done = threading.Event()
        waiter.notify(done, callback)
        assert seen == []
        done.set()
        with anyio.fail_after(10):
            await called.wait()
        assert seen == [loop_thread]
    finally:
        waiter.close()


async def test_notify_needs_the_thread() -> None:
    waiter = CompletionWaiter("t")
    with pytest.raises(RuntimeError, match="not running"):
        waiter.notify(threading.Event(), lambda: None)


async def test_a_cancelled_wait_is_dropped_quietly() -> None:
    waiter = CompletionWaiter("t")
    waiter.start()
    try:
        done = threading.Event()
        with anyio.move_on_after(0.02) as scope:
            await waiter.wait(done)
        assert scope.cancelled_caught
        done.set()
        later = threading.Event()
        later.set()
        await waiter.wait(later)  # the thread still serves
        with anyio.fail_after(10):
            while waiter.counters["woken"] < 1:  # noqa: ASYNC110 - observing the thread's counter
                await anyio.sleep(0.01)
    finally:
        waiter.close()


async def test_an_event_nobody_sets_does_not_hold_the_younger_waits() -> None:
    """The oldest wait's event is never set (its room was cancelled before its KV was written): a
    younger event that is set still calls back, and so does a waiting task."""
    waiter = CompletionWaiter("t")
    waiter.start()
    try:
        never, later, other = threading.Event(), threading.Event(), threading.Event()
        called = anyio.Event()
        waiter.notify(never, lambda: pytest.fail("never set"))
        waiter.notify(later, called.set)
        threading.Timer(0.01, later.set).start()
        threading.Timer(0.02, other.set).start()
        with anyio.fail_after(5):
            await called.wait()
            await waiter.wait(other)
        assert waiter.counters["woken"] + waiter.counters["reached"] == 2
    finally:
        waiter.close()


async def test_forgotten_waits_never_call_back() -> None:
    waiter = CompletionWaiter("t")
    waiter.start()
    try:
        job, kept = object(), object()
        done, also = threading.Event(), threading.Event()
        called = anyio.Event()
        waiter.notify(done, lambda: pytest.fail("forgotten"), owner=job)
        waiter.notify(done, lambda: pytest.fail("forgotten"), owner=job)
        waiter.forget(job)
        with anyio.fail_after(5):
            while waiter.counters["forgotten"] < 2:  # noqa: ASYNC110 (the thread takes it on its turn)
                await anyio.sleep(0.01)
        waiter.notify(also, called.set, owner=kept)
        done.set()
        also.set()
        with anyio.fail_after(5):
            await called.wait()
        await anyio.sleep(2 * STOP_CHECK_S)  # a forgotten callback would have been handed by now
        assert waiter.counters["woken"] == 1
    finally:
        waiter.close()


async def test_close_stops_a_thread_blocked_on_an_event_nobody_sets() -> None:
    waiter = CompletionWaiter("t")
    waiter.start()
    never = threading.Event()
    with anyio.move_on_after(0.02):
        await waiter.wait(never)
    started = time.monotonic()
    waiter.close()
    assert time.monotonic() - started < 10 * STOP_CHECK_S + 1
    assert not waiter.running and not _waiter_threads()


async def test_without_the_thread_wait_polls() -> None:
    waiter = CompletionWaiter("t")  # never started
    done = threading.Event()
    setter = _set_later(done, 0.02)
    with anyio.fail_after(10):
        await waiter.wait(done)
    setter.join()
    assert waiter.counters["handed"] == 0


async def test_started_twice_is_refused() -> None:
    waiter = CompletionWaiter("t")
    waiter.start()
    try:
        with pytest.raises(RuntimeError, match="started twice"):
            waiter.start()
    finally:
        waiter.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
async def test_cuda_events_of_one_stream_wake_in_order_while_the_loop_runs() -> None:
    """On a GPU: events recorded behind long kernels on a side stream wake their waiters, oldest
    first, and the loop keeps running meanwhile (no synchronize on the loop's thread)."""
    waiter = CompletionWaiter("cuda")
    waiter.start()
    stream = torch.cuda.Stream()
    woken: list[int] = []
    ticks = 0

    async def one(i: int, event: torch.cuda.Event) -> None:
        await waiter.wait(event)
        woken.append(i)

    try:
        events = []
        with torch.cuda.stream(stream):
            for _ in range(4):
                torch.cuda._sleep(20_000_000)  # tens of ms per kernel
                events.append(recorded(stream))
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i, event in enumerate(events):
                    tg.start_soon(one, i, event)
                while len(woken) < len(events):
                    ticks += 1
                    await anyio.sleep(0.001)
        assert woken == [0, 1, 2, 3]
        assert ticks > 4  # the loop ran while the GPU worked
        assert waiter.counters["handed"] == 4
    finally:
        waiter.close()
