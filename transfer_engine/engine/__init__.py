"""The engine of one rank (docs/ARCHITECTURE.md): :class:`TransferEngine`, its :class:`Sender` and :class:`Receiver`.

- ``engine.py``: TransferEngine: its state, ``sender()``/``receiver()``, the room table;
- ``handles.py``: Sender, Receiver and the checks of their arguments;
- ``supervisor.py``: the actors' task group, started in order and stopped;
- ``handshake.py``: decode connects to prefill instances, prefill answers PeerHello;
- ``dispatch.py``: wire messages to rooms, workers and the ring;
- ``liveness.py``: heartbeats, leases, peer death;
- ``paths.py``: the transfer path of a decode rank's rooms with one prefill instance;
- ``state.py``: what these parts share.
"""

from transfer_engine.engine.engine import TransferEngine
from transfer_engine.engine.handles import (
    MAX_ROOM_ID,
    Receiver,
    RoomHandle,
    Sender,
    check_request,
    check_room,
)

__all__ = ["MAX_ROOM_ID", "Receiver", "RoomHandle", "Sender", "TransferEngine", "check_request", "check_room"]
