"""The engine of one rank (docs/ARCHITECTURE.md): :class:`TransferEngine`, its :class:`Sender` and :class:`Receiver`.

The engine owns its parts; each is given only what it uses, and calls go downward:

- ``engine.py``: TransferEngine: the books the parts share, ``sender()``/``receiver()``, the wiring;
- ``supervisor.py``: Supervisor: the actors' task group, started in order and stopped;
- ``rooms.py``: RoomTable: the live rooms, and what an ended room leaves behind;
- ``handshake.py``: Handshake: decode connects to prefill instances, prefill answers PeerHello;
- ``dispatch.py``: Dispatch: wire messages to rooms, workers and the ring;
- ``liveness.py``: Liveness: heartbeats, leases, peer death;
- ``paths.py``: PathPolicy: the transfer path of a decode rank's rooms with one prefill instance;
- ``snapshot.py``: the engine's state as a Snapshot (``transfer-engine dump``, metrics);
- ``started.py``: what the parts share: the running actors they reach (``Started``), one send;
- ``handles.py``: Sender, Receiver over their abstract base RoomHandle;
- ``checks.py``: the checks of room ids and a decode room's pages.
"""

from transfer_engine.engine.checks import MAX_ROOM_ID, check_pages, check_room
from transfer_engine.engine.engine import TransferEngine
from transfer_engine.engine.handles import Receiver, RoomHandle, Sender

__all__ = ["MAX_ROOM_ID", "Receiver", "RoomHandle", "Sender", "TransferEngine", "check_pages", "check_room"]
