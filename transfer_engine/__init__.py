"""transfer_engine: KV-cache transfer for disaggregated LLM serving, over NIXL, between any TP sizes.

The public API::

    from transfer_engine import EngineConfig, KVLayout, KVPool, TransferEngine

Everything a caller needs is importable from here: the engine and its handles, the configuration,
the errors, KV layouts and pools (with the builders of pools over a serving system's own memory),
the control plane's CURVE keys. Threaded callers use :mod:`transfer_engine.facade` (BlockingEngine,
the LoopThread bridge, BootstrapServer). Other submodules are implementation detail unless a
docstring says otherwise (``transfer_engine.observe.Snapshot`` is the published dump format). The
integrations import nothing else (an import-linter contract in pyproject.toml), and nothing here
imports an integration (another contract): vLLM's caches become a pool through
``transfer_engine.integrations.vllm.pool_from_vllm``.
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
from transfer_engine.memory.layout import KVLayout, KVPool, views_vllm_cpu
from transfer_engine.memory.views import AuxBuffers, pool_from_caches, pool_from_pointers
from transfer_engine.protocol.cost import DEFAULT_PRIOR_RATE, choose, estimate_seconds
from transfer_engine.protocol.room_ids import room_id
from transfer_engine.protocol.rooms import RoomStatus
from transfer_engine.transport.security import Curve

__all__ = [
    "__version__",
    "DEFAULT_PRIOR_RATE",
    "AuxBuffers",
    "ConfigError",
    "Curve",
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
    "choose",
    "estimate_seconds",
    "pool_from_caches",
    "pool_from_pointers",
    "room_id",
    "views_vllm_cpu",
]
