"""transfer_engine: KV-cache transfer for disaggregated LLM serving, over NIXL, between any TP sizes.

The public API::

    from transfer_engine import EngineConfig, KVLayout, KVPool, TransferEngine

Everything a caller needs is importable from here; submodules are implementation detail unless a
docstring says otherwise (``transfer_engine.observe.Snapshot`` is the published dump format).
"""

__version__ = "0.1.0"

from transfer_engine.config import EngineConfig
from transfer_engine.engine import Receiver, Sender, TransferEngine
from transfer_engine.errors import (
    ConfigError,
    FailureReason,
    LayoutError,
    LocalProtocolError,
    PeerUnreachableError,
    ProtocolError,
    RemoteProtocolError,
    RoomInUseError,
    TransferAborted,
    TransferError,
    TransferFailed,
    TransferTimeout,
)
from transfer_engine.memory.layout import KVLayout, KVPool
from transfer_engine.protocol.room_ids import room_id
from transfer_engine.protocol.rooms import RoomStatus

__all__ = [
    "__version__",
    "ConfigError",
    "EngineConfig",
    "FailureReason",
    "KVLayout",
    "KVPool",
    "LayoutError",
    "LocalProtocolError",
    "PeerUnreachableError",
    "ProtocolError",
    "Receiver",
    "RemoteProtocolError",
    "RoomInUseError",
    "RoomStatus",
    "Sender",
    "TransferAborted",
    "TransferEngine",
    "TransferError",
    "TransferFailed",
    "TransferTimeout",
    "room_id",
]
