"""Building a :class:`~transfer_engine.observe.Snapshot` from an engine's state, and recording rooms
as they end. It reads the engine and its actors, so it sits with the engine, over them; ``observe/``
(the published format, the table, the metrics, the CLI) sits below the actors on one layer.

- :func:`build_snapshot` reads the state (rooms, workers, ring, peers, poller, counters) on the
  event-loop thread and copies it into immutable Structs. It performs no I/O, awaits nothing and
  changes nothing, so it may run between any two awaits of the engine.
- :func:`record_ended` keeps the final snapshot of each room that ends (bounded) and hands it to
  the Prometheus metrics when they are on.

The state is read through :class:`EngineState`, the narrow view of the engine this needs.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

import msgspec

from transfer_engine.actors.introspect import Introspect
from transfer_engine.actors.nixl_poller import NixlPoller
from transfer_engine.actors.ring import RingActor
from transfer_engine.actors.room import ReceiverRoomActor, RoomActor, SenderRoomActor
from transfer_engine.actors.worker import TransferWorker
from transfer_engine.config import EngineConfig
from transfer_engine.memory.layout import KVPool
from transfer_engine.observe.render import chunks_text, ranks_text
from transfer_engine.observe.schema import (
    AllocationSnapshot,
    Counters,
    HistoryEntry,
    LinkReport,
    NixlSnapshot,
    PeerCostSnapshot,
    PeerProgress,
    PeerSnapshot,
    RingSnapshot,
    RoomSnapshot,
    Snapshot,
    WorkerSnapshot,
)
from transfer_engine.protocol.cost import CostBook
from transfer_engine.protocol.receiver_room import ReceiverRoom
from transfer_engine.protocol.rooms import RoomStatus, SenderRoom
from transfer_engine.runtime.peers import Peer
from transfer_engine.transport.probe import LinkProbe

log = logging.getLogger(__name__)


class DropCounts(Protocol):
    @property
    def dropped(self) -> Mapping[str, int]: ...


class ControlCounts(DropCounts, Protocol):
    @property
    def counters(self) -> Mapping[str, int]: ...


class EngineState(Protocol):
    """What building a snapshot reads of an engine (TransferEngine satisfies it); read-only."""

    @property
    def config(self) -> EngineConfig: ...
    @property
    def agent_name(self) -> str: ...
    @property
    def pool(self) -> KVPool: ...
    @property
    def started_at(self) -> float: ...
    @property
    def rooms(self) -> Mapping[int, RoomActor]: ...
    @property
    def ended_rooms(self) -> Iterable[RoomSnapshot]: ...
    @property
    def workers(self) -> Sequence[TransferWorker]: ...
    @property
    def ring(self) -> RingActor | None: ...
    @property
    def peers(self) -> Mapping[str, Peer]: ...
    @property
    def poller(self) -> NixlPoller: ...
    @property
    def counters(self) -> Mapping[str, int]: ...
    @property
    def costs(self) -> CostBook: ...
    @property
    def links(self) -> Mapping[str, LinkProbe]: ...
    @property
    def control(self) -> ControlCounts: ...
    @property
    def introspect(self) -> Introspect | None: ...
    @property
    def bootstrap(self) -> DropCounts | None: ...
    @property
    def metrics_server(self) -> DropCounts | None: ...
    @property
    def room_ended(self) -> Callable[[RoomSnapshot], None] | None: ...
    @property
    def endpoint(self) -> str: ...
    @property
    def introspect_endpoint(self) -> str: ...
    @property
    def metrics_endpoint(self) -> str | None: ...


def build_snapshot(engine: EngineState, room: int | None = None) -> Snapshot:
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
    ended = list(reversed(list(engine.ended_rooms)))
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
        ring=_ring_snapshot(engine.ring),
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
        costs=[
            PeerCostSnapshot(
                instance=name,
                queued_rooms=load.queued_rooms,
                queued_bytes=load.queued_bytes,
                inflight_rooms=load.inflight_rooms,
                inflight_bytes=load.inflight_bytes,
                rate=load.rate,
                backlog_s=engine.costs.estimate(name, 0),
            )
            for name, load in engine.costs.loads().items()
        ],
        links=[
            LinkReport(
                peer=probe.peer,
                transport=probe.transport,
                devices=probe.devices,
                nbytes=probe.nbytes,
                latency_s=probe.seconds,
                gbps=probe.gbps,
                tcp_bytes=probe.tcp_bytes,
            )
            for _, probe in sorted(engine.links.items())
        ],
    )


def room_snapshot(engine: EngineState, actor: RoomActor, now: float, *, history: bool) -> RoomSnapshot:
    """One room's snapshot at ``now`` (monotonic); ``history`` includes its status changes."""
    core = actor.core
    if isinstance(actor, SenderRoomActor):
        progress, waiting, done, expected = _sender_progress(engine.pool, actor, actor.core)
        path, why = ",".join(sorted({req.path for req in actor.requests.values()})), ""
    elif isinstance(actor, ReceiverRoomActor):
        progress, waiting, done, expected = _receiver_progress(engine.pool, actor, actor.core)
        path, why = actor.path, actor.path_reason
    else:  # pragma: no cover - there are two sides
        raise TypeError(f"unknown room actor {type(actor).__name__}")
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
        path=path,
        path_reason=why,
    )


def record_ended(engine: EngineState, actor: RoomActor, kept: deque[RoomSnapshot]) -> None:
    """Called by the engine as a room leaves it: keep its final snapshot, feed the metrics.

    Never raises: a fault in introspection must not keep a room from ending (the caller runs in the
    room's shielded cleanup), so it is logged instead.
    """
    try:
        record = msgspec.structs.replace(
            room_snapshot(engine, actor, time.monotonic(), history=True), ended_at=time.time()
        )
        kept.append(record)
        if engine.room_ended is not None:
            engine.room_ended(record)
    except Exception:
        log.exception("%s room %d: recording its end for introspection failed", actor.side, actor.room)


def _sender_progress(
    pool: KVPool, actor: SenderRoomActor, core: SenderRoom
) -> tuple[list[PeerProgress], str, int | None, int | None]:
    requests = actor.requests
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
        parts = [chunks_text(missing)] if missing else []
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
        return f"TransferRequest from decode {ranks_text(missing)}"
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
    pool: KVPool, actor: ReceiverRoomActor, core: ReceiverRoom
) -> tuple[list[PeerProgress], str, int | None, int | None]:
    expected_chunks = core.chunks_expected()
    progress: list[PeerProgress] = []
    for w in sorted(core.writers):
        landed = core.landed.get(w, set())
        parts: list[str] = []
        if expected_chunks is not None:
            missing = [c for c in range(expected_chunks) if c not in landed]
            if missing:
                parts.append(chunks_text(missing))
        elif not core.writer_done(w):
            highest = max(landed, default=-1)
            gaps = [c for c in range(highest + 1) if c not in landed]
            if gaps:
                parts.append(chunks_text(gaps))
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
    done, expected = _receiver_bytes(pool, actor, core, progress)
    return progress, _receiver_waiting(core, progress), done, expected


def _receiver_bytes(
    pool: KVPool, actor: ReceiverRoomActor, core: ReceiverRoom, progress: Sequence[PeerProgress]
) -> tuple[int | None, int | None]:
    """``(done, expected)`` of a decode room; see ``RoomSnapshot.bytes_done`` for the estimate."""
    pages = actor.pages
    expected = len(pages) * pool.page_bytes * pool.layout.num_kv_tensors
    if core.status is RoomStatus.SUCCESS:
        return expected, expected
    heads = {s.prefill_rank: s.num_heads for s in actor.slices}
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
                parts.append(f"scatter of {chunks_text(unscattered)}")
        return "; ".join(parts)
    if status is RoomStatus.FAILED and core.awaiting_acks:
        return f"AbortAck from prefill {ranks_text(sorted(core.awaiting_acks))}"
    return ""


def _worker_snapshot(worker: TransferWorker) -> WorkerSnapshot:
    return WorkerSnapshot(
        index=worker.index,
        queue_depth=worker.depth,
        mailbox_size=worker.inbox.capacity,
        parked=worker.parked,
        awaiting_grant=worker.awaiting_grant,
        counters=dict(sorted(worker.counters.items())),
    )


def _ring_snapshot(ring: RingActor | None) -> RingSnapshot | None:
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


def _counters(engine: EngineState) -> Counters:
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
    if engine.introspect is not None:
        dropped.update({f"introspect.{kind}": n for kind, n in engine.introspect.dropped.items()})
    if engine.bootstrap is not None:
        dropped.update({f"bootstrap.{kind}": n for kind, n in engine.bootstrap.dropped.items()})
    if engine.metrics_server is not None:
        dropped.update({f"metrics.{kind}": n for kind, n in engine.metrics_server.dropped.items()})
    for key, kind, source in (
        ("notifs_dropped", "notification.malformed", poller),
        ("notifs_unrouted", "notification.unrouted", poller),
        ("late_messages", "control.late", counters),
        ("stash_expired", "control.stash_expired", counters),
    ):
        if source.get(key):
            dropped[kind] += source[key]
    raw = {
        **counters,
        **{f"poller.{name}": n for name, n in poller.items()},
        **{f"control.{name}": n for name, n in engine.control.counters.items()},
    }
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
