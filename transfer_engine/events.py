"""Completions: what a thread or the loop waits for before it may touch the bytes of a chunk.

Below every module that uses it (it imports only torch), so that every part that orders work
after the GPU or after another thread (the completion waiter, the pool's checksums, the engine's
handles, the vLLM core through ``transfer_engine.facade``) shares one definition of a completion,
one way to ask whether it was reached, and one way to make one.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["Completion", "reached", "recorded"]

Completion = torch.cuda.Event | threading.Event
"""What a waiter waits for: a recorded CUDA event, or an Event a CPU thread sets."""


def reached(done: Completion) -> bool:
    """Whether ``done`` has completed (never blocks)."""
    if isinstance(done, threading.Event):
        return done.is_set()
    return bool(done.query())


def recorded(stream: torch.cuda.Stream) -> torch.cuda.Event:
    """An event recorded on ``stream`` now: reached once everything enqueued there so far has run.

    The package's one helper for "the work queued so far on a stream is done": the KV of a chunk or
    a layer group on the caller's current stream (the engine's handles, the vLLM core through
    ``transfer_engine.facade``), a worker's gather, the scatter's copy. Each such event may end up
    waited on by a thread, a :class:`CompletionWaiter` blocked in ``synchronize()``; the event is
    made blocking (``torch.cuda.Event(blocking=True)``) so that the wait sleeps in the driver
    instead of spinning a CPU core. Querying it (:func:`reached`) and ordering another stream after
    it (``Stream.wait_event``) are the same as for any event.
    """
    done = torch.cuda.Event(blocking=True)
    done.record(stream)
    return done
