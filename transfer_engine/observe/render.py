"""The table ``transfer-engine dump`` prints, rendered from a :class:`~.schema.Snapshot`.

Pure text: tests compare it against golden files without a socket.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence

from transfer_engine.protocol.rooms import RoomStatus

from .schema import ENDED_ROOMS_KEPT, RoomSnapshot, Snapshot

TABLE_ENDED_ROWS = 10
"""How many ended rooms the table shows (``--json`` and ``--room`` see all that are kept)."""


def _runs(ids: Iterable[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for i in sorted(ids):
        if runs and i == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


def chunks_text(ids: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``chunks 0-2, 5``; ``[3]`` -> ``chunk 3``."""
    runs = _runs(ids)
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    single = len(runs) == 1 and runs[0][0] == runs[0][1]
    return f"chunk {text}" if single else f"chunks {text}"


def ranks_text(ranks: Sequence[int]) -> str:
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
        headers = ["ROOM", "AGE", "IN STATE", "BYTES", f"CHUNKS BY {peer_word.upper()} RANK", "WAITING FOR"]
        lines += _table(*_with_paths(headers, rows, rooms))
    return lines


def _with_paths(
    headers: list[str], rows: list[list[str]], rooms: Sequence[RoomSnapshot]
) -> tuple[list[str], list[list[str]]]:
    """``headers`` and ``rows`` with a PATH column (the room's path, and why) where any room has one."""
    if not any(r.path for r in rooms):
        return headers, rows
    paths = [_path(r) for r in rooms]
    return [*headers, "PATH"], [[*row, path] for row, path in zip(rows, paths, strict=True)]


def _path(r: RoomSnapshot) -> str:
    if not r.path:
        return "-"
    return f"{r.path} ({r.path_reason})" if r.path_reason else r.path


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
    lines += _table(*_with_paths(["ROOM", "OUTCOME", "LIFETIME", "ENDED", "BYTES", "FAILURE"], rows, shown))
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
    if s.links:
        lines += ["", f"links ({len(s.links)}, probed at connection)"]
        lines += _table(
            ["PEER", "TRANSPORT", "DEVICES", "GB/S", "LATENCY", "PROBE"],
            [
                [k.peer, k.transport, k.devices, f"{k.gbps:.3g}", _secs(k.latency_s), _bytes(k.nbytes)]
                for k in s.links
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
        if r.path:
            lines.append(f"  path: {_path(r)}")
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
