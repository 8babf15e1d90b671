"""Prometheus metrics of one engine: the optional ``metrics`` extra (``prometheus-client``).

Imported only when ``EngineConfig.metrics_port`` is set (see
:func:`transfer_engine.actors.metrics.load_metrics`, which turns a missing package into a
ConfigError). Each engine has its own registry, served by the MetricsServer actor at
``http://{host}:{metrics_port}/metrics``.

Two kinds of series:

- histograms observed once per room as it ends (:meth:`Metrics.room_ended`, fed by
  :func:`transfer_engine.engine.snapshot.record_ended`): latency and size;
- everything else read at scrape time from the same :class:`~transfer_engine.observe.Snapshot`
  ``transfer-engine dump`` shows, so the two never disagree: counters by outcome and failure
  reason, bytes and WRITEs, dropped messages, live rooms, queues, ring occupancy and the links probed.

The names are listed in README.md ("Inspection and metrics"). Label values are lower case.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from transfer_engine.observe import RoomSnapshot, Snapshot

__all__ = ["INTEGRITY_RESULTS", "LATENCY_BUCKETS", "SIZE_BUCKETS", "Metrics"]

PREFIX = "transfer_engine"

INTEGRITY_RESULTS = ("match", "mismatch", "unchecked")
"""Results of a decode's integrity check; the engine counts each as ``integrity_{result}``."""

LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
"""Seconds: from 0.5 ms (a small room on loopback) to the default transfer timeout and beyond."""

SIZE_BUCKETS = tuple(float(1024 * 4**k) for k in range(12))
"""Bytes: 1 KiB, 4 KiB, ... 4 GiB."""


class Metrics:
    """One engine's Prometheus registry. Called on the event-loop thread only."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self.registry = CollectorRegistry()
        self.latency = Histogram(
            f"{PREFIX}_transfer_latency_seconds",
            "Lifetime of a room on this rank, from sender()/receiver() until it ended, by outcome.",
            ["outcome"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.size = Histogram(
            f"{PREFIX}_transfer_size_bytes",
            "KV bytes a successful room moved from this rank (prefill ranks; decode rooms do not know it).",
            buckets=SIZE_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_SnapshotCollector(snapshot))

    def room_ended(self, room: RoomSnapshot) -> None:
        """Observe a room that just ended (its final snapshot)."""
        self.latency.labels(outcome=room.state.lower()).observe(room.age_s)
        if room.state == "SUCCESS" and room.bytes_done is not None:
            self.size.observe(room.bytes_done)

    def render(self) -> tuple[bytes, str]:
        """The exposition text of every series, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _SnapshotCollector:
    """Reads the engine's snapshot at each scrape (on the event-loop thread: the HTTP actor's)."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        c = s.counters

        info = GaugeMetricFamily(
            f"{PREFIX}_info",
            "This rank: role, TP rank and size, NIXL agent.",
            labels=["role", "rank", "tp_size", "agent"],
        )
        info.add_metric([s.role, str(s.tp_rank), str(s.tp_size), s.agent], 1)
        yield info

        live = GaugeMetricFamily(f"{PREFIX}_rooms_live", "Live rooms by state.", labels=["state"])
        states: dict[str, int] = {}
        for room in s.rooms:
            states[room.state] = states.get(room.state, 0) + 1
        for state, n in sorted(states.items()):
            live.add_metric([state.lower()], n)
        yield live

        yield CounterMetricFamily(f"{PREFIX}_rooms_opened", "Rooms opened on this rank.", c.rooms_opened)
        rooms = CounterMetricFamily(f"{PREFIX}_rooms", "Rooms ended, by outcome.", labels=["outcome"])
        for outcome, n in c.rooms_by_outcome.items():
            rooms.add_metric([outcome.lower()], n)
        yield rooms
        failures = CounterMetricFamily(
            f"{PREFIX}_room_failures", "Failed rooms by reason.", labels=["reason"]
        )
        for reason, n in c.failures_by_reason.items():
            failures.add_metric([reason.lower()], n)
        yield failures

        yield CounterMetricFamily(
            f"{PREFIX}_bytes_written", "Bytes of finished WRITEs posted by this rank.", c.bytes_written
        )
        writes = CounterMetricFamily(f"{PREFIX}_writes", "Finished WRITEs by result.", labels=["result"])
        writes.add_metric(["done"], c.writes_done)
        writes.add_metric(["failed"], c.writes_failed)
        yield writes
        yield CounterMetricFamily(
            f"{PREFIX}_notifications", "NIXL notifications received (chunks landed).", c.notifications
        )
        integrity = CounterMetricFamily(
            f"{PREFIX}_integrity_checks",
            "Landed chunks (or layer groups) whose checksum was compared, by result: match, mismatch "
            "(the room failed with reason integrity), unchecked (no checksum carried or integrity off).",
            labels=["result"],
        )
        for result in INTEGRITY_RESULTS:
            integrity.add_metric([result], c.raw.get(f"integrity_{result}", 0))
        yield integrity
        dropped = CounterMetricFamily(
            f"{PREFIX}_dropped_messages", "Messages dropped, by kind.", labels=["kind"]
        )
        for kind, n in c.dropped_by_kind.items():
            dropped.add_metric([kind.lower()], n)
        yield dropped

        yield GaugeMetricFamily(
            f"{PREFIX}_writes_in_flight", "WRITEs posted and not finished.", s.nixl.writes_in_flight
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_nixl_handles_live", "NIXL transfer handles not released.", s.nixl.handles_live
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_peers_alive",
            "Peer ranks whose heartbeat lease holds.",
            sum(1 for p in s.peers if p.alive),
        )

        if s.costs:
            labels = ["instance"]
            backlog = GaugeMetricFamily(
                f"{PREFIX}_peer_backlog_seconds",
                "Decode: seconds until a new room's bytes from this prefill instance would start moving "
                "(its rooms' queued and in-flight bytes at the measured rate); a router adds "
                "bytes / rate for the room itself (TransferEngine.estimate_transfer).",
                labels=labels,
            )
            rate = GaugeMetricFamily(
                f"{PREFIX}_peer_rate_bytes_per_second",
                "Decode: the measured rate from this prefill instance while busy (moving average).",
                labels=labels,
            )
            queued = GaugeMetricFamily(
                f"{PREFIX}_peer_queued_bytes",
                "Decode: bytes of rooms opened, none of it landed yet.",
                labels=labels,
            )
            inflight = GaugeMetricFamily(
                f"{PREFIX}_peer_inflight_bytes",
                "Decode: bytes of rooms in flight, not landed yet.",
                labels=labels,
            )
            rooms_by = GaugeMetricFamily(
                f"{PREFIX}_peer_rooms",
                "Decode: rooms with this instance, by phase.",
                labels=["instance", "phase"],
            )
            for cost in s.costs:
                backlog.add_metric([cost.instance], cost.backlog_s)
                if cost.rate is not None:
                    rate.add_metric([cost.instance], cost.rate)
                queued.add_metric([cost.instance], cost.queued_bytes)
                inflight.add_metric([cost.instance], cost.inflight_bytes)
                rooms_by.add_metric([cost.instance, "queued"], cost.queued_rooms)
                rooms_by.add_metric([cost.instance, "in_flight"], cost.inflight_rooms)
            yield from (backlog, rate, queued, inflight, rooms_by)

        if s.links:
            link = GaugeMetricFamily(
                f"{PREFIX}_link_gbps",
                "Decode: GB/s of the link probe to this prefill rank at the handshake, by what carried it.",
                labels=["peer", "transport"],
            )
            for report in s.links:
                link.add_metric([report.peer, report.transport], report.gbps)
            yield link

        if s.workers:
            depth = GaugeMetricFamily(
                f"{PREFIX}_worker_queue_depth", "Jobs waiting in a worker's mailbox.", labels=["worker"]
            )
            parked = GaugeMetricFamily(
                f"{PREFIX}_worker_parked_chunks",
                "Chunks a worker parked until the ring watermark admits them.",
                labels=["worker"],
            )
            for w in s.workers:
                depth.add_metric([str(w.index)], w.queue_depth)
                parked.add_metric([str(w.index)], w.parked)
            yield depth
            yield parked

        if s.ring is not None:
            ring = s.ring
            yield GaugeMetricFamily(
                f"{PREFIX}_ring_size_bytes", "Size of the decode staging ring.", ring.size
            )
            yield GaugeMetricFamily(
                f"{PREFIX}_ring_live_bytes", "Bytes of live ring allocations.", ring.live_bytes
            )
            yield GaugeMetricFamily(f"{PREFIX}_ring_live_allocations", "Live ring allocations.", ring.live)
            yield GaugeMetricFamily(
                f"{PREFIX}_ring_occupancy_ratio",
                "Live ring bytes / ring size (above 1 while an overcommitted round waits).",
                ring.live_bytes / ring.size if ring.size else 0.0,
            )
