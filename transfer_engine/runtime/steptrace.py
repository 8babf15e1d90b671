"""Timestamps of a room's steps, for benchmarks: where does a room's time go?

Off unless ``EngineConfig.trace_steps`` > 0; then every actor that handles a room marks named steps
(``trace.mark(room, "posted")``) into a bounded buffer of ``(monotonic_ns, room, step)``, the
oldest dropped first. ``CLOCK_MONOTONIC`` is machine-wide on Linux, so the traces of a prefill and
a decode process on one machine merge into one timeline (``tools/bench_transfer.py --trace``
prints the median time of each step from the decode's ``receiver()``). Off, ``mark`` is one test.

Steps are named ``<side>.<step>``: the side is the engine's role's first letter (``p``/``d``).
"""

from __future__ import annotations

import time
from collections import deque


class StepTrace:
    """A bounded buffer of step marks; ``capacity`` 0 keeps nothing."""

    __slots__ = ("_events", "_side")

    def __init__(self, capacity: int = 0, side: str = "") -> None:
        if capacity < 0:
            raise ValueError(f"trace capacity {capacity} must be >= 0")
        self._events: deque[tuple[int, int, str]] | None = deque(maxlen=capacity) if capacity else None
        self._side = side[:1]

    @property
    def enabled(self) -> bool:
        return self._events is not None

    def mark(self, room: int, step: str) -> None:
        """Record that ``room`` reached ``step`` now (nothing when tracing is off)."""
        events = self._events
        if events is not None:
            events.append((time.monotonic_ns(), room, f"{self._side}.{step}"))

    def mark_at(self, room: int, step: str, monotonic_ns: int) -> None:
        """Record that ``room`` reached ``step`` at ``monotonic_ns`` (a time taken earlier, on any
        thread, by code that has no trace of its own: the transport's start)."""
        events = self._events
        if events is not None:
            events.append((monotonic_ns, room, f"{self._side}.{step}"))

    def mark_mail(self, where: str, mail: object, room: int | None = None) -> None:
        """Mark ``<where>:<mail's type>`` for ``room`` (default: the mail's ``room`` field, if any).

        The step name is built only when tracing is on: actors call this for every mail they handle.
        """
        events = self._events
        if events is None:
            return
        if room is None:
            room = getattr(mail, "room", None)
            if room is None:
                return
        events.append((time.monotonic_ns(), room, f"{self._side}.{where}:{type(mail).__name__}"))

    def take(self) -> list[tuple[int, int, str]]:
        """The marks recorded so far, oldest first; the buffer is emptied."""
        if self._events is None:
            return []
        out = list(self._events)
        self._events.clear()
        return out
