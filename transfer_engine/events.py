"""Completions: what a thread or the loop waits for before it may touch the bytes of a chunk.

Below every module that uses it (it imports only torch), so that every part that orders work
after the GPU or after another thread (the completion waiter, the pool's checksums, the engine's
handles, the vLLM core through ``transfer_engine.facade``) shares one definition of a completion,
one way to ask whether it was reached, and one way to make one.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

__all__ = ["BlockingEvent", "Completion", "blocking", "blocking_event", "reached", "recorded"]

Completion = torch.cuda.Event | threading.Event
"""What a waiter waits for: a recorded CUDA event, or an Event a CPU thread sets."""


class BlockingEvent(torch.cuda.Event):
    """A CUDA event made blocking (``torch.cuda.Event(blocking=True)``): a thread's ``synchronize()``
    on it sleeps in the driver instead of spinning a core. Every event :func:`recorded` makes is
    one; :func:`blocking` tells them from a caller's own events by this class (CUDA keeps an
    event's flags to itself)."""

    def __new__(cls) -> BlockingEvent:
        return super().__new__(cls, blocking=True)


_SIDE: dict[int, torch.cuda.Stream] = {}
_SIDE_LOCK = threading.Lock()


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """This process's side stream on ``device``, made on first use: it runs no work, it only waits
    for callers' events and records blocking ones after them (:func:`blocking`)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _SIDE_LOCK:
        stream = _SIDE.get(index)
        if stream is None:
            stream = _SIDE[index] = torch.cuda.Stream(torch.device("cuda", index))
        return stream


def reached(done: Completion) -> bool:
    """Whether ``done`` has completed (never blocks)."""
    if isinstance(done, threading.Event):
        return done.is_set()
    return bool(done.query())


def recorded(stream: torch.cuda.Stream) -> BlockingEvent:
    """An event recorded on ``stream`` now: reached once everything enqueued there so far has run.

    The package's one helper for "the work queued so far on a stream is done": the KV of a chunk or
    a layer group on the caller's current stream (the engine's handles, the vLLM core through
    ``transfer_engine.facade``), a worker's gather, the scatter's copy. Each such event may end up
    waited on by a thread, a :class:`CompletionWaiter` blocked in ``synchronize()``; the event is
    a :class:`BlockingEvent` so that the wait sleeps in the driver instead of spinning a CPU core. Querying it (:func:`reached`) and ordering another stream after
    it (``Stream.wait_event``) are the same as for any event.
    """
    done = BlockingEvent()
    done.record(stream)
    return done


def blocking(waits: Iterable[Completion], device: torch.device) -> tuple[Completion, ...]:
    """``waits`` as completions a thread may wait on without spinning: each ``threading.Event`` and
    each :class:`BlockingEvent` as it is, and every other CUDA event (a caller's own, non-blocking
    by default) replaced by one :func:`recorded` event on ``device``'s side stream, made to wait for
    them first (``Stream.wait_event``: ordered on the GPU, no CPU waits here). Reached exactly when
    all of them are. A caller's event must be recorded before this call, as for any wait on it.

    Costs a few microseconds of CUDA calls per event replaced, and nothing when none is."""
    kept: list[Completion] = []
    foreign: list[torch.cuda.Event] = []
    for done in waits:
        if isinstance(done, threading.Event | BlockingEvent):
            kept.append(done)
        else:
            foreign.append(done)
    if foreign:
        kept.append(_after(foreign, device))
    return tuple(kept)


def blocking_event(done: torch.cuda.Event, device: torch.device) -> torch.cuda.Event:
    """One CUDA event as :func:`blocking` makes it: ``done`` if a :class:`BlockingEvent`, else a
    blocking event recorded on ``device``'s side stream after it."""
    return done if isinstance(done, BlockingEvent) else _after([done], device)


def _after(events: list[torch.cuda.Event], device: torch.device) -> BlockingEvent:
    stream = _side_stream(device)
    for done in events:
        stream.wait_event(done)
    return recorded(stream)
