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


def auto_path(
    *, equal_tp: bool, same_pages: bool, has_ring: bool, host: bool, slice_pieces: float, num_tensors: int
) -> TransferPath:
    """The path ``EngineConfig.path="auto"`` takes for one prefill instance (decode side).

    ``equal_tp``: equal TP sizes (or MLA); ``same_pages``: equal page sizes on every rank;
    ``has_ring``: this decode rank runs a staging ring (``host``: in pinned host memory);
    ``slice_pieces``: the slice path's descriptors per page for the worst writer
    (``descriptors.slice_pieces_per_page``); ``num_tensors``: KV tensors per rank. Direct where it
    applies; else staged, unless the slice path moves each page in no more pieces than direct moves
    it (one per tensor), as between two vLLM CPU layouts, where gathering and scattering would only
    add two copies.
    """
    if equal_tp and same_pages:
        return TransferPath.DIRECT
    if not has_ring or slice_pieces <= num_tensors:
        return TransferPath.SLICE
    return TransferPath.HOST if host else TransferPath.STAGED
