"""Bounded logging of repeated events: the first of each kind in full, then one summary per interval.

Anyone who can reach a rank's port can make it drop frames, and a line per dropped frame lets them
fill a disk at wire speed. Every receive path therefore counts its drops exactly (its own counters,
shown by ``transfer-engine dump`` and the metrics) but logs them through a :class:`LogBook`:

- the first event of a kind opens a *window* of ``interval`` seconds and is logged in full;
- the events of that kind inside the window are only counted;
- once the window is over, the next :meth:`LogBook.note` or :meth:`LogBook.flush` writes one line
  ``"<name>: N more <kind> in the last T s (M in all)"`` and closes the window; the next event of
  that kind opens a new one. Owners flush on any traffic and :meth:`LogBook.close` when they stop,
  so a summary waits at most until the endpoint's next frame (heartbeats, on control endpoints).

So a kind writes at most two lines per window, and windows of one kind never overlap and last at
least ``interval``: over ``T`` seconds one book writes at most ``K * 2 * (T / interval + 1)``
lines for ``K`` kinds, whatever the event rate.

:class:`Summarizer` is the decision alone (sans-IO: every call takes ``now``); :class:`LogBook`
puts it in front of a :class:`logging.Logger` with an injected clock.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["DEFAULT_INTERVAL_S", "LogBook", "Summary", "Summarizer"]

DEFAULT_INTERVAL_S = 10.0
"""How long a window lasts unless the owner says otherwise."""


@dataclass(frozen=True, slots=True)
class Summary:
    """``count`` events of ``kind`` were not logged in the window of ``span`` seconds that just ended."""

    kind: str
    count: int
    span: float
    total: int
    """Events of this kind since the book was made, the logged ones included."""


@dataclass(slots=True)
class _Window:
    opened: float
    suppressed: int = 0


class Summarizer:
    """Decides which events are written in full and which summaries are due; see the module docstring.

    Pure: no clock, no logging. ``total`` counts every event noted, by kind.
    """

    def __init__(self, interval: float = DEFAULT_INTERVAL_S) -> None:
        if not interval > 0:
            raise ValueError(f"interval={interval} must be > 0")
        self.interval = interval
        self.total: Counter[str] = Counter()
        self._open: dict[str, _Window] = {}

    def note(self, kind: str, now: float) -> bool:
        """Record one event of ``kind`` at ``now``; True when it is to be written in full.

        Call :meth:`due` first (with the same ``now``) so that a window that is over is summarised
        and closed before this event opens the next one.
        """
        self.total[kind] += 1
        window = self._open.get(kind)
        if window is None:
            self._open[kind] = _Window(now)
            return True
        window.suppressed += 1
        return False

    def due(self, now: float) -> list[Summary]:
        """Close the windows that are over at ``now``; the summaries of those that held unwritten events."""
        out: list[Summary] = []
        if not self._open:
            return out
        for kind, window in list(self._open.items()):
            if now - window.opened >= self.interval:
                del self._open[kind]
                if window.suppressed:
                    out.append(Summary(kind, window.suppressed, now - window.opened, self.total[kind]))
        return out

    def close(self, now: float) -> list[Summary]:
        """Close every window, over or not; the summaries of those that held unwritten events."""
        out = [
            Summary(kind, w.suppressed, now - w.opened, self.total[kind])
            for kind, w in self._open.items()
            if w.suppressed
        ]
        self._open.clear()
        return out

    def next_due(self) -> float | None:
        """When the earliest open window with unwritten events ends; None when there is none."""
        return min((w.opened + self.interval for w in self._open.values() if w.suppressed), default=None)


class LogBook:
    """A :class:`Summarizer` in front of ``log``: :meth:`note` instead of ``log.warning`` on hot paths.

    ``name`` prefixes the summary lines (the endpoint, e.g. ``prefill0``). Not thread-safe: one owner
    (the event loop) calls it.
    """

    def __init__(
        self,
        log: logging.Logger,
        name: str,
        *,
        interval: float = DEFAULT_INTERVAL_S,
        level: int = logging.WARNING,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log = log
        self.name = name
        self.level = level
        self.clock = clock
        self.summarizer = Summarizer(interval)

    @property
    def total(self) -> Counter[str]:
        """Events noted, by kind (exact, logged or not)."""
        return self.summarizer.total

    def note(self, kind: str, msg: str, *args: object, exc_info: bool = False) -> bool:
        """Count one event of ``kind``; write ``msg % args`` only when it opens a window. True if written."""
        now = self.clock()
        self._write(self.summarizer.due(now))
        if not self.summarizer.note(kind, now):
            return False
        self.log.log(self.level, msg, *args, exc_info=exc_info)
        return True

    def flush(self) -> None:
        """Write the summaries of the windows that are over (owners call it now and then, and at close)."""
        self._write(self.summarizer.due(self.clock()))

    def close(self) -> None:
        """Write every pending summary, windows over or not."""
        self._write(self.summarizer.close(self.clock()))

    def _write(self, summaries: list[Summary]) -> None:
        for s in summaries:
            self.log.log(
                self.level, "%s: %d more %s in the last %.0f s (%d in all)",
                self.name, s.count, s.kind, s.span, s.total,
            )  # fmt: skip
