"""transfer_engine: KV-cache transfer for disaggregated LLM serving, over NIXL, between any TP sizes.

The public API::

    from transfer_engine import EngineConfig, KVLayout, KVPool, TransferEngine

Everything a caller needs is importable from here; submodules are implementation detail unless a
docstring says otherwise (``transfer_engine.introspect.Snapshot`` is the published dump format).
"""

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
from transfer_engine.layout import KVLayout, KVPool
from transfer_engine.protocol.rooms import RoomStatus

__all__ = [
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
]
