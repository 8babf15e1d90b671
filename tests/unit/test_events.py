"""Completions a thread waits on are blocking (``transfer_engine.events.blocking``): a caller's own
CUDA event is replaced by a blocking one recorded after it on a side stream, so that the completion
waiter's ``synchronize()`` sleeps in the driver instead of spinning a core.

The CPU tests pin what passes as it is; the GPU tests (skipped without one) pin the replacement and
its order after the caller's work, and that a room sent with a non-blocking ``ready=`` mails a
blocking event and lands every byte (``tests/integration/test_ready_events.py``).
"""

from __future__ import annotations

import threading

import pytest
import torch

from transfer_engine.events import BlockingEvent, blocking, blocking_event, reached, recorded

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def test_cpu_events_pass_as_they_are() -> None:
    """``threading.Event``s go as given, in order, and nothing touches CUDA (a CPU-only torch here)."""
    a, b = threading.Event(), threading.Event()
    out = blocking([a, b], torch.device("cpu"))
    assert len(out) == 2 and out[0] is a and out[1] is b
    assert blocking([], torch.device("cpu")) == ()


def test_blocking_event_is_a_cuda_event() -> None:
    """What ``recorded`` makes is a ``torch.cuda.Event`` (every ``isinstance`` check of callers and of
    the mail's types holds) of its own class, the mark that it is blocking."""
    assert issubclass(BlockingEvent, torch.cuda.Event)


@pytest.mark.gpu
@GPU
def test_a_non_blocking_event_is_replaced_by_a_blocking_one_after_it() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream(device)
    theirs = torch.cuda.Event()  # non-blocking, as a caller makes it
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # tens of ms
        theirs.record(stream)
    done = blocking_event(theirs, device)
    assert isinstance(done, BlockingEvent) and done is not theirs
    assert not reached(done)  # ordered after the caller's work, which still runs
    done.synchronize()
    assert reached(theirs)  # reached only once theirs was


@pytest.mark.gpu
@GPU
def test_a_group_of_events_becomes_one_blocking_event_and_blocking_ones_pass() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    streams = [torch.cuda.Stream(device) for _ in range(3)]
    theirs = []
    for i, stream in enumerate(streams):
        with torch.cuda.stream(stream):
            torch.cuda._sleep(10_000_000 * (i + 1))
            event = torch.cuda.Event()
            event.record(stream)
            theirs.append(event)
    ours = recorded(streams[0])
    cpu = threading.Event()
    out = blocking([theirs[0], ours, cpu, theirs[1], theirs[2]], device)
    assert out[0] is ours and out[1] is cpu and len(out) == 3  # kept as they are, in order
    assert isinstance(out[2], BlockingEvent) and blocking_event(ours, device) is ours
    out[2].synchronize()
    assert all(reached(event) for event in theirs)  # after every one it stands for
