"""The transfer paths a room can take: one enum, and what each implies.

The path is chosen by the decode rank per room and travels in its ``TransferRequest`` as the enum's
string value. ``EngineConfig.path`` is a policy (``auto`` picks one of these).
"""

from __future__ import annotations

import enum


class TransferPath(str, enum.Enum):
    """How a room's KV moves (see README, "Paths")."""

    DIRECT = "direct"
    """Coalesced page runs straight from prefill pages into decode pages."""
    SLICE = "slice"
    """One descriptor per (layer, K/V, token) head slice."""
    STAGED = "staged"
    """Gather into a staging buffer, one WRITE into the decode ring, scatter there."""
    HOST = "host"
    """``STAGED`` with the staging buffers and ring in pinned host memory."""

    @property
    def staged(self) -> bool:
        """Whether chunks go through the decode rank's staging ring."""
        return self in (TransferPath.STAGED, TransferPath.HOST)

    @classmethod
    def parse(cls, value: str) -> TransferPath | None:
        """The path named ``value``, or None when no path has that name."""
        try:
            return cls(value)
        except ValueError:
            return None


def is_staged(name: str) -> bool:
    """Whether the path (or policy) named ``name`` goes through a staging ring."""
    path = TransferPath.parse(name)
    return path is not None and path.staged
