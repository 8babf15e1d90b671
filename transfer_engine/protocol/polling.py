"""What ``poll()`` shows a caller that acts on it alone (SGLang's scheduler frees pages on Failed).

A room's status turns final the moment it succeeds or fails, but a failed room may still have
WRITEs in flight (or AbortAcks outstanding) that land in its pages. A caller that reuses the pages
when poll() says Failed would then see them overwritten. So poll() reports a final status only once
the room has ended (final and quiescent), and until then the last live status the caller saw.
"""

from __future__ import annotations

from transfer_engine.protocol.rooms import RoomStatus

__all__ = ["polled"]


def polled(status: RoomStatus, ended: bool, last_live: RoomStatus) -> RoomStatus:
    """The status poll() returns for a room whose core says ``status``.

    ``ended``: the room left its engine (final and quiescent: no WRITE of it can still land).
    ``last_live``: the last non-final status the caller's handle saw.
    """
    if last_live.final:
        raise ValueError(f"last_live={last_live.name} must be a live status")
    if not status.final or ended:
        return status
    return last_live
