"""The snapshot Structs: what ``transfer-engine dump`` shows, and their msgpack encoding.

The Structs are the published format of ``transfer-engine dump --json``: decode that output with
``msgspec.json.decode(data, type=Snapshot)``. Fields are only ever added (with defaults), and
``version`` is bumped on any incompatible change.

Times: ages and durations are seconds measured with the engine's monotonic clock; ``taken_at``
and ``ended_at`` are Unix times, for display.
"""

from __future__ import annotations

import msgspec

from transfer_engine.errors import RemoteProtocolError

SNAPSHOT_VERSION = 1
"""Bumped on any incompatible change to the Structs below."""

ENDED_ROOMS_KEPT = 64
"""How many ended rooms (with their history) an engine keeps for ``dump``, newest first."""


class _Struct(msgspec.Struct, frozen=True, kw_only=True):
    pass


class HistoryEntry(_Struct, frozen=True):
    """One status change of a room: when (seconds after the room opened) and to what."""

    at_s: float
    event: str
    """The new status, e.g. ``TRANSFERRING``; a failure reads ``FAILED:Fail(reason=..., detail=...)``."""


class PeerProgress(_Struct, frozen=True):
    """A room's progress with one peer rank.

    On a decode rank: one per writer (the global prefill rank), ``chunks_done`` = chunks landed from
    it. On a prefill rank: one per decode rank it writes to, ``chunks_done`` = chunk WRITEs to it
    that finished.
    """

    rank: int
    chunks_done: int
    chunks_expected: int | None
    """None until the room's chunk count is known (the last chunk was sent, or seen landing)."""
    done: bool
    waiting_for: str
    """What is still missing from this peer, e.g. ``chunks 2-3`` or ``chunk 0 onward``; empty when done."""


class RoomSnapshot(_Struct, frozen=True):
    """One room on this rank, live or ended."""

    room: int
    side: str
    """``prefill`` or ``decode``."""
    state: str
    """A ``RoomStatus`` name: BOOTSTRAPPING, WAITING_FOR_INPUT, TRANSFERRING, SUCCESS or FAILED."""
    age_s: float
    """Seconds since the room opened (for an ended room: its whole lifetime)."""
    in_state_s: float
    """Seconds since the room entered ``state``."""
    bytes_done: int | None
    """KV bytes moved so far, counted in whole pages (a last partial page counts whole). Prefill: the
    chunk WRITEs that finished. Decode: an estimate that takes the room's chunks as equal in size
    (landed chunks / chunk count, weighted by each writer's heads), exact once the room succeeded;
    None while the chunk count is unknown."""
    bytes_expected: int | None
    """KV bytes the room will move, in whole pages. Prefill: None until the last chunk is queued.
    Decode: the room's pages; None if the room actor does not expose them."""
    progress: list[PeerProgress]
    waiting_for: str
    """What the room waits for now, in words; empty once it needs nothing more."""
    writes_in_flight: int = 0
    """Prefill: WRITEs of this room posted and not finished (the room ends only at 0)."""
    failure_reason: str | None = None
    failure_detail: str | None = None
    ended_at: float | None = None
    """Unix time the room left the engine; None while it is live."""
    history: list[HistoryEntry] = msgspec.field(default_factory=list)
    """Every status change; filled only in a dump that asked for this room (``--room``)."""
    path: str = ""
    """The path the room's KV takes (direct, slice, staged, host). Decode: chosen per room; prefill: as
    its decode ranks' requests named it (comma-separated when they differ); empty while unknown."""
    path_reason: str = ""
    """Why: decode, the reason of ``path="auto"`` (``protocol.paths.choose_path``) or the configured
    policy; prefill: empty (the decode chose)."""


class WorkerSnapshot(_Struct, frozen=True):
    """One prefill TransferWorker."""

    index: int
    queue_depth: int
    """Jobs waiting in its mailbox."""
    mailbox_size: int
    parked: int
    """Chunks parked until the decode ring's watermark admits them."""
    awaiting_grant: int = 0
    """Staged chunks waiting for the decode ring to grant them a region."""
    counters: dict[str, int] = msgspec.field(default_factory=dict)


class AllocationSnapshot(_Struct, frozen=True):
    """One live region of a decode staging ring."""

    alloc_id: int
    round: int
    offset: int
    length: int


class RingSnapshot(_Struct, frozen=True):
    """The staging ring of a decode rank."""

    size: int
    live: int
    live_bytes: int
    """Sum of the live regions' lengths; may exceed ``size`` while an overcommitted round waits."""
    round: int
    head: int
    watermark_round: int
    watermark_tail: int
    allocations: list[AllocationSnapshot]
    """Live regions, oldest first."""


class PeerSnapshot(_Struct, frozen=True):
    """A rank on the other side that this rank has shaken hands with."""

    agent: str
    rank: int
    endpoint: str
    alive: bool
    last_heartbeat_s: float
    """Seconds since the peer was last heard from."""
    writes_in_flight: int


class NixlSnapshot(_Struct, frozen=True):
    """The NIXL agent's outstanding work."""

    writes_in_flight: int
    handles_live: int


class Counters(_Struct, frozen=True):
    """Totals since the engine started."""

    bytes_written: int
    """Bytes of the WRITEs this rank posted that finished (prefill)."""
    writes_posted: int
    writes_done: int
    """WRITEs (one per chunk, or aux item, and decode rank) that finished successfully."""
    writes_failed: int
    notifications: int
    """NIXL notifications received (decode): one per chunk or aux item landed."""
    rooms_opened: int
    rooms_by_outcome: dict[str, int]
    """Ended rooms by final status (``SUCCESS``, ``FAILED``)."""
    failures_by_reason: dict[str, int]
    """Failed rooms by ``FailureReason`` name."""
    dropped_by_kind: dict[str, int]
    """Messages dropped: malformed or refused control frames (by kind or message type), malformed or
    unroutable notifications, late messages for ended rooms, and the introspection endpoint's own."""
    raw: dict[str, int]
    """Every engine and poller counter as kept (poller ones prefixed ``poller.``)."""


class PeerCostSnapshot(_Struct, frozen=True):
    """A decode rank's transfer cost with one prefill instance (docs/INTEGRITY.md, "The cost signal")."""

    instance: str
    """The prefill instance's bootstrap address."""
    queued_rooms: int
    queued_bytes: int
    inflight_rooms: int
    inflight_bytes: int
    rate: float | None
    """Measured bytes/s while busy (a moving average); None before a room with it ended."""
    backlog_s: float
    """Seconds until a new room's bytes would start moving: the queued and in-flight bytes at the rate."""


class LinkReport(_Struct, frozen=True):
    """The link probe of one peer pair, taken when the two engines first connected
    (``transfer_engine.transport.probe``)."""

    peer: str
    """The peer's NIXL agent."""
    transport: str
    """What carried the probe's WRITE: ``tcp`` (observed on this process's TCP sockets), else
    ``cuda_ipc``, ``shm`` or ``rdma`` by where the peer is and the memory."""
    devices: str
    """The network devices UCX was given (``NET_DEVICES``), or ``all``."""
    nbytes: int
    latency_s: float
    """From posting the probe's WRITE to its DONE."""
    gbps: float
    tcp_bytes: int = 0
    """Bytes on this process's TCP sockets while the probe's WRITE was out."""


class Snapshot(_Struct, frozen=True):
    """The state of one rank's engine at ``taken_at``: what ``transfer-engine dump`` shows."""

    role: str
    tp_rank: int
    tp_size: int
    agent: str
    control_endpoint: str
    introspect_endpoint: str
    metrics_endpoint: str | None
    taken_at: float
    """Unix time of the snapshot."""
    uptime_s: float
    rooms: list[RoomSnapshot]
    """Live rooms, oldest first (only the asked-for room when the dump named one)."""
    ended: list[RoomSnapshot]
    """Rooms that ended, newest first, at most ``ENDED_ROOMS_KEPT``."""
    workers: list[WorkerSnapshot]
    ring: RingSnapshot | None
    """None on prefill ranks (and on decode ranks without a staging ring)."""
    peers: list[PeerSnapshot]
    nixl: NixlSnapshot
    counters: Counters
    costs: list[PeerCostSnapshot] = msgspec.field(default_factory=list)
    """Decode: per prefill instance, the cost a new room would have now."""
    links: list[LinkReport] = msgspec.field(default_factory=list)
    """Per peer pair probed, what its link measured (the link probe)."""
    version: int = SNAPSHOT_VERSION


_snapshot_decoder = msgspec.msgpack.Decoder(Snapshot)


def encode_snapshot(snapshot: Snapshot) -> bytes:
    """The msgpack bytes carried in ``DumpReply.snapshot``."""
    return msgspec.msgpack.encode(snapshot)


def decode_snapshot(data: bytes) -> Snapshot:
    """Decode ``DumpReply.snapshot``; RemoteProtocolError when it is not a Snapshot."""
    try:
        return _snapshot_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RemoteProtocolError(f"undecodable snapshot ({len(data)} bytes): {exc}") from None
