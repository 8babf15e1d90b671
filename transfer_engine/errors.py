"""The one error taxonomy of the engine.

Every exception the package raises on purpose derives from :class:`TransferError`. Exceptions of
NIXL, ZMQ and msgspec are translated into these at the boundary where they occur, so callers never
have to know which library failed.

    TransferError
    ├── ConfigError            bad configuration or bad arguments at a call (names the value)
    │   ├── LayoutError        a KV layout that does not validate, or two that do not match
    │   ├── HeadSplitError     an (H, P, D) combination no head assignment exists for
    │   └── RoomInUseError     a room id that is still live on this engine
    ├── RoomLimitError         ``max_rooms`` rooms are live already
    ├── ProtocolError          a message that cannot be decoded or is not allowed now
    │   ├── LocalProtocolError   this side tried to do something the protocol forbids
    │   └── RemoteProtocolError  the peer sent something the protocol forbids
    ├── TransportError         NIXL or the control sockets failed
    │   ├── PeerUnreachableError a bootstrap or peer endpoint could not be reached
    │   ├── BindError            a socket of this process could not bind its own address
    │   │   └── AddressInUseError    ... because another socket holds it
    │   ├── SlowLinkError        a peer pair's link is below its floor, or TCP where it may not be
    │   └── AddressRangeError    a WRITE aimed outside the peer's registered regions
    ├── TransferFailed         a room ended in Failed (carries reason and detail)
    │   ├── TransferAborted    ... because a side aborted it (cancelled, not broken)
    │   └── TransferTimeout    ... because it missed a deadline (``phase`` says which)
    └── StagingError           the staging ring cannot place a chunk (``oversized``)
"""

from __future__ import annotations

import enum

__all__ = [
    "AddressInUseError",
    "AddressRangeError",
    "BindError",
    "ConfigError",
    "FailureReason",
    "HeadSplitError",
    "LayoutError",
    "LocalProtocolError",
    "PeerUnreachableError",
    "ProtocolError",
    "RemoteProtocolError",
    "RoomInUseError",
    "RoomLimitError",
    "SlowLinkError",
    "StagingError",
    "TransferAborted",
    "TransferError",
    "TransferFailed",
    "TransferTimeout",
    "TransportError",
    "failure_error",
]


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
    INTEGRITY = 11
    """A chunk landed on the decode with bytes whose checksum differs from its writer's (docs/INTEGRITY.md)."""


class TransferError(Exception):
    """Base of every error this package raises on purpose."""


class ConfigError(TransferError, ValueError):
    """Raised for a bad configuration value or call argument; the message names the value."""


class LayoutError(ConfigError):
    """Raised when KV tensors do not match their layout, or two peers' layouts are incompatible."""


class HeadSplitError(ConfigError):
    """Raised when no head assignment exists for (H, P, D): neither of H and a TP size divides the other."""

    def __init__(self, num_heads: int, prefill_tp: int, decode_tp: int, why: str) -> None:
        self.num_heads = num_heads
        self.prefill_tp = prefill_tp
        self.decode_tp = decode_tp
        super().__init__(f"no head assignment for H={num_heads}, P={prefill_tp}, D={decode_tp}: {why}")


class RoomInUseError(ConfigError):
    """Raised when a room id is opened again while a room with that id is still live."""

    def __init__(self, room: int) -> None:
        self.room = room
        super().__init__(f"room {room} is still live on this engine")


class RoomLimitError(TransferError):
    """``sender()``/``receiver()`` while ``max_rooms`` rooms are live on this engine."""

    def __init__(self, room: int, limit: int) -> None:
        super().__init__(f"room {room}: {limit} rooms are live on this engine (max_rooms={limit})")
        self.room = room
        self.limit = limit


class ProtocolError(TransferError):
    """Raised when a control message or notification breaks the wire protocol."""


class LocalProtocolError(ProtocolError):
    """Raised when this side attempts an event the protocol forbids in the current state."""


class RemoteProtocolError(ProtocolError):
    """Raised when bytes from a peer cannot be decoded, are too large, or are not allowed now."""


class TransportError(TransferError):
    """Raised when NIXL or a control socket fails underneath a transfer."""


class PeerUnreachableError(TransportError):
    """Raised when a bootstrap server or peer does not answer in time."""

    def __init__(self, endpoint: str, detail: str = "") -> None:
        self.endpoint = endpoint
        super().__init__(f"peer {endpoint} unreachable" + (f": {detail}" if detail else ""))


class BindError(TransportError):
    """Raised when a socket of this process cannot bind its own address (a local fault, not a peer's)."""

    def __init__(self, address: str, detail: str = "") -> None:
        self.address = address
        """The address that could not be bound (``tcp://HOST:PORT``)."""
        super().__init__(f"cannot bind {address}" + (f": {detail}" if detail else ""))


class AddressInUseError(BindError):
    """Raised when the address to bind is held by another socket: another engine or process listens there."""


class SlowLinkError(TransportError):
    """Raised when the link probe of a peer pair measured less than ``min_link_gbps``, or TCP where refused."""

    def __init__(self, peer: str, transport: str, gbps: float, detail: str) -> None:
        self.peer = peer
        self.transport = transport
        self.gbps = gbps
        super().__init__(f"link to {peer}: {gbps:.3g} GB/s over {transport}, {detail}")


class AddressRangeError(TransportError):
    """Raised when a WRITE's remote range lies outside every region the peer registered."""


class StagingError(TransferError):
    """Raised when a staged chunk cannot be placed in the decode ring; names the knob to raise."""


class TransferFailed(TransferError):
    """Raised by ``wait()`` when a room ended in Failed; carries the reason and its detail."""

    def __init__(self, room: int, reason: FailureReason, detail: str) -> None:
        self.room = room
        self.reason = reason
        self.detail = detail
        super().__init__(f"room {room} failed: {reason.name}: {detail}")


class TransferAborted(TransferFailed):
    """Raised by ``wait()`` when a room was aborted by either side (cancelled, not broken)."""


class TransferTimeout(TransferFailed):
    """Raised by ``wait()`` when a room missed its bootstrap, input or transfer deadline."""

    @property
    def phase(self) -> str:
        return _TIMEOUTS.get(self.reason, "unknown")


_TIMEOUTS = {
    FailureReason.BOOTSTRAP_TIMEOUT: "bootstrap",
    FailureReason.INPUT_TIMEOUT: "input",
    FailureReason.TRANSFER_TIMEOUT: "transfer",
}


def failure_error(room: int, reason: FailureReason, detail: str) -> TransferFailed:
    """Rebuild the typed error for a failed room from its ``(reason, detail)``."""
    if reason is FailureReason.ABORTED:
        return TransferAborted(room, reason, detail)
    if reason in _TIMEOUTS:
        return TransferTimeout(room, reason, detail)
    return TransferFailed(room, reason, detail)
