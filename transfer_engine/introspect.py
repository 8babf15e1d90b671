"""What an engine is doing right now: the snapshot Structs, how they are built, and how they read.

``transfer-engine dump`` (see :mod:`transfer_engine.cli`) asks a rank's introspection endpoint
(:mod:`transfer_engine.actors.introspect`) for a :class:`Snapshot`; the endpoint answers with
``DumpReply(snapshot=msgspec.msgpack.encode(build_snapshot(engine)))``. Everything here is pure:

- :func:`build_snapshot` reads the engine's state (rooms, workers, ring, peers, poller, counters)
  on the event-loop thread and copies it into immutable Structs. It performs no I/O, awaits
  nothing and changes nothing, so it may run between any two awaits of the engine.
- :func:`render_table` turns a snapshot into the table ``transfer-engine dump`` prints; tests
  compare it against golden files without a socket.
- :func:`record_ended` is the engine's one hook: it keeps the final snapshot of each room that
  ends in ``engine.ended_rooms`` (bounded) and hands it to the Prometheus metrics when they are on.

The Structs are the published format of ``transfer-engine dump --json``: decode that output with
``msgspec.json.decode(data, type=Snapshot)``. Fields are only ever added (with defaults), and
``version`` is bumped on any incompatible change.

Times: ages and durations are seconds measured with the engine's monotonic clock; ``taken_at``
and ``ended_at`` are Unix times, for display.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from transfer_engine.errors import RemoteProtocolError
from transfer_engine.protocol.rooms import ReceiverRoom, RoomStatus, SenderRoom

if TYPE_CHECKING:
    from transfer_engine.actors.room import _RoomActor
    from transfer_engine.engine import TransferEngine

__all__ = [
    "ENDED_ROOMS_KEPT",
    "SNAPSHOT_VERSION",
    "AllocationSnapshot",
    "Counters",
    "HistoryEntry",
    "NixlSnapshot",
    "PeerProgress",
    "PeerSnapshot",
    "RingSnapshot",
    "RoomSnapshot",
    "Snapshot",
    "WorkerSnapshot",
    "build_snapshot",
    "decode_snapshot",
    "encode_snapshot",
    "record_ended",
    "render_table",
    "room_snapshot",
]

log = logging.getLogger(__name__)

SNAPSHOT_VERSION = 1
"""Bumped on any incompatible change to the Structs below."""

ENDED_ROOMS_KEPT = 64
"""How many ended rooms (with their history) an engine keeps for ``dump``, newest first."""

TABLE_ENDED_ROWS = 10
"""How many ended rooms the table shows (``--json`` and ``--room`` see all that are kept)."""


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


# --- building -------------------------------------------------------------------------------------


def build_snapshot(engine: TransferEngine, room: int | None = None) -> Snapshot:
    """Copy ``engine``'s state into a :class:`Snapshot`. Pure: no I/O, no await, no mutation.

    With ``room``, ``rooms`` and ``ended`` hold only that room (live, and any ended rooms with that
    id still kept), with their history; everything else is the same as without.
    """
    now = time.monotonic()
    cfg = engine.config
    live = sorted(engine.rooms.values(), key=lambda actor: actor.created)
    if room is not None:
        live = [actor for actor in live if actor.room == room]
    rooms = [room_snapshot(engine, actor, now, history=room is not None) for actor in live]
    ended = list(reversed(engine.ended_rooms))
    if room is None:
        ended = [msgspec.structs.replace(r, history=[]) for r in ended]
    else:
        ended = [r for r in ended if r.room == room]
    poller = engine.poller
    return Snapshot(
        role=cfg.role,
        tp_rank=cfg.tp_rank,
        tp_size=cfg.tp_size,
        agent=engine.agent_name,
        control_endpoint=engine.endpoint,
        introspect_endpoint=engine.introspect_endpoint,
        metrics_endpoint=engine.metrics_endpoint,
        taken_at=time.time(),
        uptime_s=now - engine.started_at,
        rooms=rooms,
        ended=ended,
        workers=[_worker_snapshot(worker) for worker in engine.workers],
        ring=_ring_snapshot(getattr(engine, "ring", None)),
        peers=[
            PeerSnapshot(
                agent=peer.agent_name,
                rank=peer.rank,
                endpoint=peer.endpoint,
                alive=peer.alive,
                last_heartbeat_s=max(now - peer.last_seen, 0.0),
                writes_in_flight=poller.in_flight(peer.agent_name),
            )
            for peer in sorted(engine.peers.values(), key=lambda p: (p.rank, p.agent_name))
        ],
        nixl=NixlSnapshot(
            writes_in_flight=poller.in_flight(),
            handles_live=poller.transport.live_handles(),
        ),
        counters=_counters(engine),
    )


def room_snapshot(engine: TransferEngine, actor: _RoomActor, now: float, *, history: bool) -> RoomSnapshot:
    """One room's snapshot at ``now`` (monotonic); ``history`` includes its status changes."""
    core = actor.core
    if isinstance(core, SenderRoom):
        progress, waiting, done, expected = _sender_progress(engine, actor, core)
    elif isinstance(core, ReceiverRoom):
        progress, waiting, done, expected = _receiver_progress(engine, actor, core)
    else:  # pragma: no cover - there are two sides
        raise TypeError(f"unknown room core {type(core).__name__}")
    failure = core.failure
    return RoomSnapshot(
        room=actor.room,
        side=actor.side,
        state=core.status.name,
        age_s=max(now - actor.created, 0.0),
        in_state_s=max(now - core.entered_at, 0.0),
        bytes_done=done,
        bytes_expected=expected,
        progress=progress,
        waiting_for=waiting,
        writes_in_flight=core.in_flight if isinstance(core, SenderRoom) else 0,
        failure_reason=None if failure is None else failure.reason.name,
        failure_detail=None if failure is None else failure.detail,
        history=(
            [HistoryEntry(at_s=max(t - actor.created, 0.0), event=text) for t, text in core.history]
            if history
            else []
        ),
    )


def record_ended(engine: TransferEngine, actor: _RoomActor) -> None:
    """Called by the engine as a room leaves it: keep its final snapshot, feed the metrics.

    Never raises: a fault in introspection must not keep a room from ending (the caller runs in the
    room's shielded cleanup), so it is logged instead.
    """
    try:
        record = msgspec.structs.replace(
            room_snapshot(engine, actor, time.monotonic(), history=True), ended_at=time.time()
        )
        engine.ended_rooms.append(record)
        if engine.metrics is not None:
            engine.metrics.room_ended(record)
    except Exception:
        log.exception("%s room %d: recording its end for introspection failed", actor.side, actor.room)


def _sender_progress(
    engine: TransferEngine, actor: _RoomActor, core: SenderRoom
) -> tuple[list[PeerProgress], str, int | None, int | None]:
    requests: dict[int, Any] = getattr(actor, "requests", {})
    pool = engine.pool
    token_bytes: dict[int, int] = {}
    for d in core.targets:
        request = requests.get(d)
        heads = request.slices[0].num_heads if request is not None and request.slices else pool.heads_local
        token_bytes[d] = heads * pool.head_bytes * pool.layout.num_kv_tensors
    page_tokens = pool.layout.page_size
    chunk_bytes = {
        (chunk.chunk_id, d): chunk.num_pages * page_tokens * per_token
        for chunk in core.chunks
        for d, per_token in token_bytes.items()
    }
    done = sum(chunk_bytes.get(key, 0) for key in core.done)
    expected = sum(chunk_bytes.values()) if core.sealed else None
    n_chunks = len(core.chunks)
    progress: list[PeerProgress] = []
    for d in sorted(core.targets):
        finished = {c for c, rank in core.done if rank == d}
        missing = [c for c in range(n_chunks) if c not in finished]
        wants_aux = d in core.aux_targets and d not in core.aux_done
        parts = [_chunks_text(missing)] if missing else []
        if not core.sealed:
            parts.append(f"chunk {n_chunks} onward")
        if wants_aux:
            parts.append("aux")
        progress.append(
            PeerProgress(
                rank=d,
                chunks_done=len(finished),
                chunks_expected=n_chunks if core.sealed else None,
                done=not parts,
                waiting_for=", ".join(parts),
            )
        )
    return progress, _sender_waiting(core, progress), done, expected


def _sender_waiting(core: SenderRoom, progress: Sequence[PeerProgress]) -> str:
    status = core.status
    if status is RoomStatus.BOOTSTRAPPING:
        if core.decode_tp is None:
            return "TransferRequests from the decode ranks"
        missing = sorted(set(range(core.decode_tp)) - core.requested)
        return f"TransferRequest from decode {_ranks_text(missing)}"
    if status is RoomStatus.WAITING_FOR_INPUT:
        return "send() of the first chunk"
    if status is RoomStatus.TRANSFERRING:
        parts = [f"decode rank {p.rank} ({p.waiting_for})" for p in progress if not p.done]
        if not core.sealed:
            parts.append("send() of the next chunk")
        return "; ".join(parts)
    if status is RoomStatus.FAILED and core.in_flight:
        return f"{core.in_flight} posted WRITE(s) to end"
    return ""


def _receiver_progress(
    engine: TransferEngine, actor: _RoomActor, core: ReceiverRoom
) -> tuple[list[PeerProgress], str, int | None, int | None]:
    expected_chunks = core.chunks_expected()
    progress: list[PeerProgress] = []
    for w in sorted(core.writers):
        landed = core.landed.get(w, set())
        parts: list[str] = []
        if expected_chunks is not None:
            missing = [c for c in range(expected_chunks) if c not in landed]
            if missing:
                parts.append(_chunks_text(missing))
        elif not core.writer_done(w):
            highest = max(landed, default=-1)
            gaps = [c for c in range(highest + 1) if c not in landed]
            if gaps:
                parts.append(_chunks_text(gaps))
            parts.append(f"chunk {highest + 1} onward")
        if core.wants_aux_from == w and not core.aux_landed:
            parts.append("aux")
        progress.append(
            PeerProgress(
                rank=w,
                chunks_done=len(landed),
                chunks_expected=expected_chunks,
                done=not parts,
                waiting_for=", ".join(parts),
            )
        )
    done, expected = _receiver_bytes(engine, actor, core, progress)
    return progress, _receiver_waiting(core, progress), done, expected


def _receiver_bytes(
    engine: TransferEngine, actor: _RoomActor, core: ReceiverRoom, progress: Sequence[PeerProgress]
) -> tuple[int | None, int | None]:
    """``(done, expected)`` of a decode room; see ``RoomSnapshot.bytes_done`` for the estimate."""
    pages = getattr(actor, "pages", None)
    if pages is None:
        return None, None
    pool = engine.pool
    expected = len(pages) * pool.page_bytes * pool.layout.num_kv_tensors
    if core.status is RoomStatus.SUCCESS:
        return expected, expected
    heads = {s.prefill_rank: s.num_heads for s in getattr(actor, "slices", ())}
    total_heads = sum(heads.get(p.rank, 1) for p in progress)
    if not progress or total_heads == 0 or any(p.chunks_expected is None for p in progress):
        return None, expected
    share = sum(heads.get(p.rank, 1) * p.chunks_done / max(p.chunks_expected or 1, 1) for p in progress)
    return int(expected * share / total_heads), expected


def _receiver_waiting(core: ReceiverRoom, progress: Sequence[PeerProgress]) -> str:
    status = core.status
    if status is RoomStatus.BOOTSTRAPPING:
        return "its TransferRequests to go out"
    if status in (RoomStatus.WAITING_FOR_INPUT, RoomStatus.TRANSFERRING):
        parts = [f"prefill rank {p.rank} ({p.waiting_for})" for p in progress if not p.done]
        if core.staged:
            everywhere = set.intersection(*(core.landed[w] for w in core.writers)) if core.writers else set()
            unscattered = sorted(everywhere - core.scattered)
            if unscattered:
                parts.append(f"scatter of {_chunks_text(unscattered)}")
        return "; ".join(parts)
    if status is RoomStatus.FAILED and core.awaiting_acks:
        return f"AbortAck from prefill {_ranks_text(sorted(core.awaiting_acks))}"
    return ""


def _worker_snapshot(worker: Any) -> WorkerSnapshot:
    stats = worker.inbox.statistics()
    depth = getattr(worker, "depth", None)
    size = stats.max_buffer_size
    return WorkerSnapshot(
        index=worker.index,
        queue_depth=int(depth) if depth is not None else stats.current_buffer_used,
        mailbox_size=int(size) if size != float("inf") else -1,
        parked=int(getattr(worker, "parked", 0)),
        awaiting_grant=int(getattr(worker, "awaiting_grant", 0)),
        counters=dict(sorted(getattr(worker, "counters", {}).items())),
    )


def _ring_snapshot(ring: Any) -> RingSnapshot | None:
    if ring is None:
        return None
    allocator = ring.allocator
    allocations = [
        AllocationSnapshot(alloc_id=a.alloc_id, round=a.round, offset=a.offset, length=a.length)
        for a in allocator.allocations()
    ]
    watermark = allocator.watermark
    return RingSnapshot(
        size=allocator.size,
        live=allocator.live,
        live_bytes=sum(a.length for a in allocations),
        round=allocator.round,
        head=allocator.head,
        watermark_round=watermark.round,
        watermark_tail=watermark.tail,
        allocations=allocations,
    )


def _counters(engine: TransferEngine) -> Counters:
    counters: dict[str, int] = dict(engine.counters)
    poller: dict[str, int] = dict(engine.poller.counters)
    outcomes = {
        name.removeprefix("rooms_").upper(): n
        for name, n in counters.items()
        if name.startswith("rooms_") and name != "rooms_opened"
    }
    reasons = {
        name.removeprefix("failed_").upper(): n for name, n in counters.items() if name.startswith("failed_")
    }
    dropped: Counter[str] = Counter()
    dropped.update({f"control.{kind}": n for kind, n in engine.control.dropped.items()})
    introspect = getattr(engine, "introspect", None)
    if introspect is not None:
        dropped.update({f"introspect.{kind}": n for kind, n in introspect.dropped.items()})
    for name in ("bootstrap", "metrics_server"):  # the other endpoints this rank serves, when it does
        endpoint = getattr(engine, name, None)
        if endpoint is not None:
            dropped.update(
                {f"{name.removesuffix('_server')}.{kind}": n for kind, n in endpoint.dropped.items()}
            )
    for key, kind, source in (
        ("notifs_dropped", "notification.malformed", poller),
        ("notifs_unrouted", "notification.unrouted", counters),
        ("late_messages", "control.late", counters),
        ("stash_expired", "control.stash_expired", counters),
    ):
        if source.get(key):
            dropped[kind] += source[key]
    raw = {**counters, **{f"poller.{name}": n for name, n in poller.items()}}
    return Counters(
        bytes_written=poller.get("bytes_written", 0),
        writes_posted=poller.get("writes_posted", 0),
        writes_done=poller.get("writes_done", 0),
        writes_failed=poller.get("writes_failed", 0),
        notifications=poller.get("notifs", 0),
        rooms_opened=counters.get("rooms_opened", 0),
        rooms_by_outcome=dict(sorted(outcomes.items())),
        failures_by_reason=dict(sorted(reasons.items())),
        dropped_by_kind=dict(sorted(dropped.items())),
        raw=dict(sorted(raw.items())),
    )


def _runs(ids: Iterable[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for i in sorted(ids):
        if runs and i == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


def _chunks_text(ids: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``chunks 0-2, 5``; ``[3]`` -> ``chunk 3``."""
    runs = _runs(ids)
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    single = len(runs) == 1 and runs[0][0] == runs[0][1]
    return f"chunk {text}" if single else f"chunks {text}"


def _ranks_text(ranks: Sequence[int]) -> str:
    """``[1]`` -> ``rank 1``; ``[0, 2]`` -> ``ranks 0, 2``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


# --- rendering ------------------------------------------------------------------------------------

_STATE_ORDER = [
    s.name
    for s in (
        RoomStatus.BOOTSTRAPPING,
        RoomStatus.WAITING_FOR_INPUT,
        RoomStatus.TRANSFERRING,
        RoomStatus.FAILED,
        RoomStatus.SUCCESS,
    )
]


def render_table(snapshot: Snapshot, room: int | None = None) -> str:
    """The human-readable dump of ``snapshot`` (what ``transfer-engine dump`` prints). Pure.

    Without ``room``: a header, live rooms grouped by state (oldest first) with what each waits
    for, the latest ended rooms, workers, ring, peers, NIXL and counters. With ``room``: that
    room's details, per-peer progress and history (live and any kept ended rooms of that id).
    Ends with a newline.
    """
    lines = _header(snapshot)
    if room is None:
        lines += _rooms_section(snapshot)
        lines += _ended_section(snapshot)
        lines += _engine_sections(snapshot)
    else:
        lines += _room_detail(snapshot, room)
    return "\n".join(line.rstrip() for line in lines) + "\n"


def has_room(snapshot: Snapshot, room: int) -> bool:
    """Whether ``snapshot`` holds ``room``, live or ended."""
    return any(r.room == room for r in (*snapshot.rooms, *snapshot.ended))


def _header(s: Snapshot) -> list[str]:
    when = datetime.datetime.fromtimestamp(s.taken_at, datetime.timezone.utc).strftime(
        "%Y-%m-%d %H:%M:%S UTC"
    )
    return [
        f"{s.role} rank {s.tp_rank}/{s.tp_size}  agent {s.agent}  up {_secs(s.uptime_s)}  at {when}",
        f"  control {s.control_endpoint}  introspect {s.introspect_endpoint}  "
        f"metrics {s.metrics_endpoint or 'off'}",
    ]


def _rooms_section(s: Snapshot) -> list[str]:
    by_state: dict[str, list[RoomSnapshot]] = {}
    for r in s.rooms:
        by_state.setdefault(r.state, []).append(r)
    lines = ["", f"rooms: {len(s.rooms)} live, {len(s.ended)} ended kept"]
    peer_word = "decode" if s.role == "prefill" else "prefill"
    for state in sorted(by_state, key=lambda name: _STATE_ORDER.index(name) if name in _STATE_ORDER else 99):
        rooms = sorted(by_state[state], key=lambda r: -r.age_s)
        lines.append("")
        lines.append(f"{state} ({len(rooms)})")
        rows = [
            [
                str(r.room),
                _secs(r.age_s),
                _secs(r.in_state_s),
                _progress_bytes(r),
                " ".join(f"{p.rank}:{p.chunks_done}/{_opt(p.chunks_expected)}" for p in r.progress) or "-",
                r.waiting_for or "-",
            ]
            for r in rooms
        ]
        lines += _table(
            ["ROOM", "AGE", "IN STATE", "BYTES", f"CHUNKS BY {peer_word.upper()} RANK", "WAITING FOR"], rows
        )
    return lines


def _ended_section(s: Snapshot) -> list[str]:
    if not s.ended:
        return []
    shown = s.ended[:TABLE_ENDED_ROWS]
    rows = [
        [
            str(r.room),
            r.state,
            _secs(r.age_s),
            _ago(s.taken_at, r.ended_at),
            _progress_bytes(r),
            f"{r.failure_reason}: {r.failure_detail}" if r.failure_reason else "-",
        ]
        for r in shown
    ]
    lines = ["", "ended rooms (newest first)"]
    lines += _table(["ROOM", "OUTCOME", "LIFETIME", "ENDED", "BYTES", "FAILURE"], rows)
    if len(s.ended) > len(shown):
        lines.append(f"  ... {len(s.ended) - len(shown)} more (--json or --room N shows them)")
    return lines


def _engine_sections(s: Snapshot) -> list[str]:
    lines: list[str] = []
    if s.workers:
        lines += ["", "workers"]
        lines += _table(
            ["WORKER", "QUEUED", "PARKED", "AWAITING GRANT", "MAILBOX"],
            [
                [str(w.index), str(w.queue_depth), str(w.parked), str(w.awaiting_grant), str(w.mailbox_size)]
                for w in s.workers
            ],
        )
    if s.ring is not None:
        ring = s.ring
        share = ring.live_bytes / ring.size if ring.size else 0.0
        lines += [
            "",
            f"ring: {_bytes(ring.size)}, {ring.live} live allocation(s) = {_bytes(ring.live_bytes)} "
            f"({share:.1%}); round {ring.round}, head {ring.head}, "
            f"watermark ({ring.watermark_round}, {ring.watermark_tail})",
        ]
        if ring.allocations:
            lines += _table(
                ["ALLOC", "ROUND", "OFFSET", "LENGTH"],
                [[str(a.alloc_id), str(a.round), str(a.offset), str(a.length)] for a in ring.allocations],
            )
    lines += ["", f"peers ({len(s.peers)})"]
    if s.peers:
        lines += _table(
            ["RANK", "AGENT", "ENDPOINT", "ALIVE", "LAST HEARD", "WRITES IN FLIGHT"],
            [
                [
                    str(p.rank),
                    p.agent,
                    p.endpoint,
                    "yes" if p.alive else "no",
                    f"{_secs(p.last_heartbeat_s)} ago",
                    str(p.writes_in_flight),
                ]
                for p in s.peers
            ],
        )
    c = s.counters
    lines += [
        "",
        f"nixl: {s.nixl.writes_in_flight} WRITE(s) in flight, {s.nixl.handles_live} handle(s) live",
        "",
        "counters",
        f"  bytes written {_bytes(c.bytes_written)}; WRITEs posted {c.writes_posted}, done {c.writes_done}, "
        f"failed {c.writes_failed}; notifications {c.notifications}",
        f"  rooms opened {c.rooms_opened}; ended {_pairs(c.rooms_by_outcome)}",
        f"  failures {_pairs(c.failures_by_reason)}",
        f"  dropped messages {_pairs(c.dropped_by_kind)}",
    ]
    return lines


def _room_detail(s: Snapshot, room: int) -> list[str]:
    matches = [*s.rooms, *s.ended]
    matches = [r for r in matches if r.room == room]
    if not matches:
        return [
            "",
            f"room {room}: not live on this rank and not among its last {ENDED_ROOMS_KEPT} ended rooms",
        ]
    peer_word = "DECODE RANK" if s.role == "prefill" else "PREFILL RANK"
    lines: list[str] = []
    for r in matches:
        lines.append("")
        if r.ended_at is None:
            lines.append(
                f"room {r.room} ({r.side}): {r.state} for {_secs(r.in_state_s)}, open {_secs(r.age_s)}"
            )
        else:
            lines.append(
                f"room {r.room} ({r.side}): ended {r.state} {_ago(s.taken_at, r.ended_at)}, "
                f"after {_secs(r.age_s)}"
            )
        lines.append(f"  bytes {_progress_bytes(r)}; WRITEs in flight {r.writes_in_flight}")
        lines.append(f"  waiting for: {r.waiting_for or '-'}")
        if r.failure_reason:
            lines.append(f"  failure: {r.failure_reason}: {r.failure_detail}")
        if r.progress:
            lines += _table(
                [peer_word, "CHUNKS", "DONE", "WAITING FOR"],
                [
                    [
                        str(p.rank),
                        f"{p.chunks_done}/{_opt(p.chunks_expected)}",
                        "yes" if p.done else "no",
                        p.waiting_for or "-",
                    ]
                    for p in r.progress
                ],
            )
        lines.append("  history")
        lines += [f"    +{h.at_s:.3f}s  {h.event}" for h in r.history] or ["    (none)"]
    return lines


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(row[i]) for row in (headers, *rows)) for i in range(len(headers))]
    return [
        indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
        for row in (headers, *rows)
    ]


def _progress_bytes(r: RoomSnapshot) -> str:
    if r.bytes_done is None:
        return "-"
    return f"{_bytes(r.bytes_done)}/{_bytes(r.bytes_expected) if r.bytes_expected is not None else '?'}"


def _opt(value: int | None) -> str:
    return "?" if value is None else str(value)


def _pairs(counts: dict[str, int]) -> str:
    return ", ".join(f"{name} {n}" for name, n in counts.items()) or "none"


def _ago(taken_at: float, at: float | None) -> str:
    return "-" if at is None else f"{_secs(max(taken_at - at, 0.0))} ago"


def _secs(seconds: float) -> str:
    """``0.0125`` -> ``12.5ms``; ``2.5`` -> ``2.50s``; ``75`` -> ``1m15s``; ``4000`` -> ``1h06m``."""
    if seconds < 1:
        return f"{seconds * 1000:.1f}ms"
    if seconds < 60:
        return f"{seconds:.2f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def _bytes(n: int) -> str:
    """``512`` -> ``512 B``; ``1536`` -> ``1.5 KiB``; binary units up to TiB."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"
