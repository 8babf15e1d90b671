"""When a decode rank's poller should poll quickly for a layer-wise room's next group (pure).

The groups of one layer-wise chunk leave the prefill one group's forward apart, and that spacing
hardly changes within a chunk: the same layers computed over the same tokens. So once a sender's
second group of a chunk has landed, the next one is expected one spacing after it. The poller
stays quick in a window around that moment and backs off in between: the group that closes the
chunk is drained within a quick poll of its landing, without quick polls through the whole forward
(a fixed quick window after every group cost a small machine's forward its CPU: docs/DECISIONS.md,
"The decode poller predicts a writer's next layer group").

Keys are ``(sender, room)``: with several prefill ranks the groups of one room come from each,
close together, and only one sender's own spacing predicts its next group. Times are the caller's
clock in seconds (``time.monotonic()``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

__all__ = ["GroupCadence"]


@dataclass(slots=True)
class GroupCadence:
    """Quick-poll windows predicted from each sender's spacing of layer groups (module docstring).

    ``margin`` of a window on either side of the expected moment: ``fraction`` of the spacing, at
    least ``min_margin`` seconds. At most ``max_keys`` senders' rooms are remembered (the oldest is
    forgotten first: a room that failed between its groups must not stay forever).
    """

    fraction: float = 0.1
    min_margin: float = 0.0003
    max_keys: int = 4096
    _last: OrderedDict[Hashable, float] = field(default_factory=OrderedDict)
    _windows: list[tuple[float, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 0 <= self.fraction < 0.5:
            raise ValueError(f"fraction={self.fraction} must be in [0, 0.5)")
        if self.min_margin < 0:
            raise ValueError(f"min_margin={self.min_margin} must be >= 0")
        if self.max_keys < 1:
            raise ValueError(f"max_keys={self.max_keys} must be >= 1")

    def landed(self, key: Hashable, now: float, more: bool) -> bool:
        """A group of ``key``'s chunk landed at ``now``; ``more``: the chunk has groups still to come.

        The second and later groups with more to come open a window around the next one's expected
        landing (returns True then); a chunk's last group forgets the key (the next chunk's spacing
        starts anew)."""
        before = self._last.pop(key, None)
        if not more:
            return False
        self._last[key] = now
        while len(self._last) > self.max_keys:
            self._last.popitem(last=False)
        if before is None or now <= before:
            return False
        spacing = now - before
        margin = max(self.fraction * spacing, self.min_margin)
        self._windows.append((now + spacing - margin, now + spacing + margin))
        return True

    def quick(self, now: float) -> bool:
        """Whether ``now`` is inside a window; windows that ended are dropped."""
        if not self._windows:  # the poller asks every cycle; rooms that are not layer-wise open none
            return False
        self._windows = [w for w in self._windows if w[1] > now]
        return any(start <= now for start, _ in self._windows)

    def next_start(self, now: float) -> float | None:
        """The earliest start of a window still ahead of ``now`` (a back-off sleep ends there), or None."""
        if not self._windows:
            return None
        return min((start for start, _ in self._windows if start > now), default=None)

    @property
    def keys(self) -> int:
        """Senders' rooms remembered (the integration test checks that a finished room left none)."""
        return len(self._last)
