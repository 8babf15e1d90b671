"""transfer_engine: KV-cache transfer for disaggregated LLM serving, over NIXL, between any TP sizes."""

from transfer_engine.errors import (
    ConfigError,
    LayoutError,
    PeerUnreachableError,
    RoomInUseError,
    TransferAborted,
    TransferError,
    TransferFailed,
    TransferTimeout,
)
from transfer_engine.protocol.failures import FailureReason

__all__ = [
    "ConfigError",
    "FailureReason",
    "LayoutError",
    "PeerUnreachableError",
    "RoomInUseError",
    "TransferAborted",
    "TransferError",
    "TransferFailed",
    "TransferTimeout",
]
