"""Room actors: one per live room and side, each a thin shell around the core's room state machine.

A room actor is the only task that mutates its room. Everything that concerns the room — wire
messages, notifications, WRITE completions, the user's ``send``/``abort`` — arrives in its mailbox.
It wakes at the room's deadline, lets the NixlPoller finish a drain cycle, applies whatever
arrived, and only then asks the core whether the deadline has passed.

A room ends (its actor returns and it leaves the engine) only when it is final AND quiescent: no
WRITE of it can still land. On the prefill side that means no posted WRITE is unfinished; on the
decode side that every writer has acknowledged an abort (or died) when the room did not succeed.
"""

from transfer_engine.actors.room.common import RoomActor
from transfer_engine.actors.room.receiver import ReceiverRoomActor
from transfer_engine.actors.room.sender import SenderRoomActor

__all__ = ["ReceiverRoomActor", "RoomActor", "SenderRoomActor"]
