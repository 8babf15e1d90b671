"""Why a room failed: the reasons a failed room carries, on both sides and on the wire."""

from __future__ import annotations

import enum


class FailureReason(enum.IntEnum):
    """Why a room ended in ``Failed``. An IntEnum because it crosses the wire in ``RoomFailed``."""

    BOOTSTRAP_TIMEOUT = 1
    """The room did not leave Bootstrapping/WaitingForInput before its bootstrap deadline."""
    TRANSFER_TIMEOUT = 2
    """The room did not finish Transferring before its transfer deadline."""
    ABORTED = 3
    """A side called ``abort()``; every posted WRITE of the room had ended before this was final."""
    PEER_DEAD = 4
    """The peer's heartbeat lease expired, or its process went away."""
    TRANSPORT = 5
    """A NIXL WRITE ended in error, or could not be posted."""
    PROTOCOL = 6
    """The peer sent something this side cannot accept for this room (bad pages, aux mismatch...)."""
    STAGING = 7
    """A staged chunk could not be placed in the decode ring (e.g. larger than ``ring_bytes``)."""
    REMOTE = 8
    """The other side failed the room and told us so with ``RoomFailed``."""
    SHUTDOWN = 9
    """The engine was closed while the room was live."""
    INPUT_TIMEOUT = 10
    """The room waited in WaitingForInput longer than its input deadline (the prefill never sent)."""
