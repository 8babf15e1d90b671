"""Room ids from the string request ids serving systems use (vLLM: ``"cmpl-..."``).

Both sides derive the id on their own, from the request id alone, so it must be a pure function.
It is a keyed 63-bit BLAKE2b digest: two distinct request ids share a room id with probability
about ``n**2 / 2**64`` among ``n`` live rooms (1e-8 for 600,000 live rooms), and an engine refuses a
second live room with the same id (``RoomInUseError``) rather than mix two requests' KV.
"""

from __future__ import annotations

import hashlib

from transfer_engine.errors import ConfigError

__all__ = ["room_id"]

_MASK = (1 << 63) - 1


def room_id(request_id: str) -> int:
    """The room id in ``[0, 2**63)`` for ``request_id``; ConfigError for an empty or non-str id."""
    if not isinstance(request_id, str) or not request_id:
        raise ConfigError(f"request_id={request_id!r} must be a non-empty str")
    digest = hashlib.blake2b(request_id.encode(), digest_size=8, person=b"te-room-id").digest()
    return int.from_bytes(digest, "big") & _MASK
