"""The transfer-cost signal: per peer instance, what is queued and in flight, the measured rate,
and how long a new room of N bytes would take now (docs/INTEGRITY.md, "The cost signal").

Pure: every call takes ``now`` (monotonic seconds); nothing here reads a clock, a socket or a
device. The engine keeps one :class:`PeerCost` per peer instance and feeds it its rooms' life:
:meth:`PeerCost.queued` when a room with that instance opens, :meth:`PeerCost.started` when its
first bytes move, :meth:`PeerCost.moved` as its WRITEs end, :meth:`PeerCost.ended` when it ends.
A router ranks instances by :meth:`PeerCost.estimate` (:func:`choose`).

The rate is the instance's throughput while it is busy, not a room's: bytes moved over the time
at least one of its rooms was in flight, both weighted by ``exp(-age / horizon_s)`` in busy time
(an exponential moving average over time). So eight rooms sharing a link each at an eighth of it
still measure the link, and rooms that end together are not each a tiny sample. Idle time counts
for nothing. Before the first byte moved the estimate uses ``prior_rate``: the book's default for an
instance nothing was measured of, or what the link probe measured at the handshake (:meth:`CostBook.seed`).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "DEFAULT_HORIZON_S",
    "DEFAULT_PRIOR_RATE",
    "MIN_SAMPLE_S",
    "CostBook",
    "PeerCost",
    "PeerLoad",
    "Phase",
    "choose",
    "estimate_seconds",
]

DEFAULT_PRIOR_RATE = 1e9
"""Bytes/s a peer instance is assumed to move before anything was measured of it: every instance
starts equal, and the first rooms measure the truth (a router then tells them apart)."""
DEFAULT_HORIZON_S = 2.0
"""Busy seconds over which the rate forgets: bytes moved this long ago weigh ``1/e`` of new ones."""
MIN_SAMPLE_S = 1e-3
"""Busy time measured before a rate is given (a room that ended within a millisecond says little
about a link)."""


def estimate_seconds(backlog_bytes: float, nbytes: float, rate: float | None, prior_rate: float) -> float:
    """Seconds to move ``nbytes`` behind ``backlog_bytes`` at ``rate`` bytes/s (``prior_rate`` when
    nothing was measured yet). A rate of zero makes it infinite."""
    if nbytes < 0 or backlog_bytes < 0:
        raise ValueError(f"nbytes={nbytes} and backlog_bytes={backlog_bytes} must be >= 0")
    speed = prior_rate if rate is None else rate
    if speed <= 0:
        return math.inf
    return (backlog_bytes + nbytes) / speed


class Phase(enum.Enum):
    """Where one room of a peer instance stands, for its cost."""

    QUEUED = "queued"
    """Opened; no byte of it moves yet."""
    IN_FLIGHT = "in_flight"
    """Its bytes move."""


@dataclass(frozen=True)
class PeerLoad:
    """A peer instance's load now: what :meth:`PeerCost.load` returns and the dump shows."""

    queued_rooms: int
    queued_bytes: int
    inflight_rooms: int
    inflight_bytes: int
    """Bytes of the rooms in flight not moved yet."""
    rate: float | None
    """Measured bytes/s while busy (moving average); None before the first byte moved."""

    @property
    def backlog_bytes(self) -> int:
        return self.queued_bytes + self.inflight_bytes


class PeerCost:
    """One peer instance's rooms and measured rate; see the module docstring.

    ``horizon_s``: the moving average's time constant in busy seconds; ``prior_rate``: bytes/s
    assumed before the first byte moved (> 0). A room id is counted once; calls for a room not
    counted raise ValueError naming it (the engine's bookkeeping is wrong), except :meth:`ended`,
    which may come for a room that failed before it was counted here.
    """

    def __init__(self, *, prior_rate: float, horizon_s: float = DEFAULT_HORIZON_S) -> None:
        if not horizon_s > 0:
            raise ValueError(f"horizon_s={horizon_s} must be > 0")
        if not prior_rate > 0:
            raise ValueError(f"prior_rate={prior_rate} must be > 0")
        self.horizon_s = horizon_s
        self.prior_rate = prior_rate
        self._rooms: dict[int, tuple[Phase, int]] = {}
        """room -> (phase, bytes not moved yet)."""
        self._inflight = 0
        self._last = 0.0
        """When the weighted sums were last brought up to date (meaningful while busy)."""
        self._bytes = 0.0
        self._busy = 0.0
        """Weighted sums of bytes moved and of busy seconds."""

    @property
    def rate(self) -> float | None:
        """Bytes/s while busy; None before a byte moved or before ``MIN_SAMPLE_S`` of busy time."""
        if self._bytes == 0.0 or self._busy < MIN_SAMPLE_S:
            return None
        return self._bytes / self._busy

    def queued(self, room: int, nbytes: int) -> None:
        """``room`` of ``nbytes`` opened with this instance."""
        if room in self._rooms:
            raise ValueError(f"room {room} is already counted for this peer")
        if nbytes < 0:
            raise ValueError(f"room {room}: nbytes={nbytes} must be >= 0")
        self._rooms[room] = (Phase.QUEUED, nbytes)

    def grew(self, room: int, nbytes: int) -> None:
        """``room`` moves ``nbytes`` more than it was counted with (a chunk added to an open room)."""
        phase, left = self._get(room)
        if nbytes < 0:
            raise ValueError(f"room {room}: nbytes={nbytes} must be >= 0")
        self._rooms[room] = (phase, left + nbytes)

    def started(self, room: int, now: float) -> None:
        """``room``'s first bytes move (again: no change)."""
        phase, left = self._get(room)
        if phase is Phase.IN_FLIGHT:
            return
        self._advance(now)
        self._rooms[room] = (Phase.IN_FLIGHT, left)
        self._inflight += 1

    def moved(self, room: int, nbytes: int, now: float) -> None:
        """``nbytes`` of ``room`` landed (one of its WRITEs ended well)."""
        if nbytes < 0:
            raise ValueError(f"room {room}: nbytes={nbytes} must be >= 0")
        self.started(room, now)
        self._advance(now)
        _, left = self._rooms[room]
        self._rooms[room] = (Phase.IN_FLIGHT, max(0, left - nbytes))
        self._bytes += nbytes

    def ended(self, room: int, now: float, ok: bool) -> None:
        """``room`` ended: its bytes leave the backlog; what was left of a successful one moved now."""
        entry = self._rooms.pop(room, None)
        if entry is None:
            return
        phase, left = entry
        if phase is not Phase.IN_FLIGHT:
            return
        self._advance(now)
        self._inflight -= 1
        if ok:
            self._bytes += left

    def _advance(self, now: float) -> None:
        """Age the sums by the busy time since the last event (none while idle)."""
        if self._inflight > 0:
            dt = max(0.0, now - self._last)
            keep = math.exp(-dt / self.horizon_s)
            self._bytes *= keep
            self._busy = self._busy * keep + dt
        self._last = now

    def load(self) -> PeerLoad:
        """What is queued and in flight now, and the rate."""
        queued = [n for phase, n in self._rooms.values() if phase is Phase.QUEUED]
        inflight = [n for phase, n in self._rooms.values() if phase is Phase.IN_FLIGHT]
        return PeerLoad(len(queued), sum(queued), len(inflight), sum(inflight), self.rate)

    def estimate(self, nbytes: int) -> float:
        """Seconds a new room of ``nbytes`` would take now: behind every byte queued and in flight,
        at the measured rate (``prior_rate`` before one was measured)."""
        return estimate_seconds(self.load().backlog_bytes, nbytes, self.rate, self.prior_rate)

    def _get(self, room: int) -> tuple[Phase, int]:
        try:
            return self._rooms[room]
        except KeyError:
            raise ValueError(f"room {room} is not counted for this peer") from None


class CostBook:
    """An engine's :class:`PeerCost` per peer instance, and which instance each of its rooms is with.

    ``instance`` is how the engine names a peer instance (a decode rank: the prefill instance's
    bootstrap address). Calls for a room the book does not hold are ignored, except :meth:`queued`
    twice (ValueError): a room ends once, and its chunks may land after it failed.
    """

    def __init__(self, *, prior_rate: float, horizon_s: float = DEFAULT_HORIZON_S) -> None:
        self.prior_rate = prior_rate
        self.horizon_s = horizon_s
        self.peers: dict[str, PeerCost] = {}
        self._rooms: dict[int, str] = {}

    def peer(self, instance: str) -> PeerCost:
        """The instance's cost (made on first use: a peer never seen costs its backlog-free prior)."""
        cost = self.peers.get(instance)
        if cost is None:
            cost = self.peers[instance] = PeerCost(prior_rate=self.prior_rate, horizon_s=self.horizon_s)
        return cost

    def seed(self, instance: str, prior_rate: float) -> None:
        """Start ``instance``'s estimates from ``prior_rate`` bytes/s (> 0) instead of the book's
        default: what the link probe measured at the handshake. Its rooms' measured rate replaces it
        as soon as there is one, as it replaces the default."""
        if not prior_rate > 0 or math.isinf(prior_rate):
            raise ValueError(f"instance {instance!r}: prior_rate={prior_rate} must be > 0 and finite")
        self.peer(instance).prior_rate = prior_rate

    def queued(self, room: int, instance: str, nbytes: int) -> None:
        """``room`` of ``nbytes`` opened with ``instance``."""
        if room in self._rooms:
            raise ValueError(f"room {room} is already counted (with {self._rooms[room]!r})")
        self.peer(instance).queued(room, nbytes)
        self._rooms[room] = instance

    def started(self, room: int, now: float) -> None:
        """``room``'s first bytes move (again: no change)."""
        instance = self._rooms.get(room)
        if instance is not None:
            self.peers[instance].started(room, now)

    def moved(self, room: int, nbytes: int, now: float) -> None:
        """``nbytes`` of ``room`` landed."""
        instance = self._rooms.get(room)
        if instance is not None:
            self.peers[instance].moved(room, nbytes, now)

    def ended(self, room: int, now: float, ok: bool) -> None:
        """``room`` ended (``ok``: successfully)."""
        instance = self._rooms.pop(room, None)
        if instance is not None:
            self.peers[instance].ended(room, now, ok)

    def estimate(self, instance: str, nbytes: int) -> float:
        """Seconds a new room of ``nbytes`` with ``instance`` would take now."""
        return self.peer(instance).estimate(nbytes)

    def loads(self) -> dict[str, PeerLoad]:
        """Every instance's load, by name."""
        return {name: cost.load() for name, cost in sorted(self.peers.items())}


def choose(estimates: Mapping[str, float] | Sequence[tuple[str, float]]) -> str:
    """The instance a router sends a new request to: the least estimated seconds; ties go to the
    first one given (so a router's own order, e.g. round robin, breaks them). Raises ValueError
    for no instance, or for an estimate that is NaN or negative (naming it)."""
    items = list(estimates.items()) if isinstance(estimates, Mapping) else list(estimates)
    if not items:
        raise ValueError("no instance to choose from")
    for name, seconds in items:
        if math.isnan(seconds) or seconds < 0:
            raise ValueError(f"instance {name!r} has estimate {seconds}; expected seconds >= 0")
    best = min(range(len(items)), key=lambda i: (items[i][1], i))
    return items[best][0]
