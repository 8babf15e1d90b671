"""What an engine is doing right now (``transfer-engine dump``): a package of three jobs.

- :mod:`.schema`: the published Structs (:class:`Snapshot` and its parts) and their encoding.
  ``transfer-engine dump --json`` prints them: ``msgspec.json.decode(line, type=Snapshot)``.
- :mod:`.build`: building a snapshot from an engine's state (imported by the engine only; it sits
  above the actors, while schema and render sit below them).
- :mod:`.render`: the table the CLI prints.
"""

from .render import has_room, render_table
from .schema import (
    ENDED_ROOMS_KEPT,
    SNAPSHOT_VERSION,
    AllocationSnapshot,
    Counters,
    HistoryEntry,
    LinkReport,
    NixlSnapshot,
    PeerProgress,
    PeerSnapshot,
    RingSnapshot,
    RoomSnapshot,
    Snapshot,
    WorkerSnapshot,
    decode_snapshot,
    encode_snapshot,
)

__all__ = [
    "ENDED_ROOMS_KEPT",
    "SNAPSHOT_VERSION",
    "AllocationSnapshot",
    "Counters",
    "HistoryEntry",
    "LinkReport",
    "NixlSnapshot",
    "PeerProgress",
    "PeerSnapshot",
    "RingSnapshot",
    "RoomSnapshot",
    "Snapshot",
    "WorkerSnapshot",
    "decode_snapshot",
    "encode_snapshot",
    "has_room",
    "render_table",
]
