"""Heartbeat leases: when a peer is dead, when the silence is our own, and which rooms a heartbeat
renews.

Pure decisions on monotonic times; the engine's heartbeat loop applies them every quarter
``heartbeat_interval``. Two leases: a peer's (its heartbeats; silent for ``LEASE_SILENCE`` intervals
it is dead and its rooms fail), and a room's (``room_lease``: a room waiting on its peer lives while
the peer's heartbeats list it as held live; :meth:`~transfer_engine.protocol.rooms.Deadlines.due`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

LEASE_SILENCE = 2.0
"""Heartbeat intervals of silence after which a peer is dead (checked every quarter interval, so a
dead peer's rooms fail within 2.25 intervals of its last heartbeat). 1.75 met the original bound of
2 intervals but declared live peers dead on a loaded 2-core machine (one late heartbeat), which
costs rooms (docs/DECISIONS.md, "Leases"). Heartbeats go out every half interval, so a lease
survives two heartbeats lost in a row (protocol.retransmit)."""


def stalled(last_tick: float, now: float, tick: float, interval: float) -> float | None:
    """How long the loop itself was stalled (seconds), or None when it ran on time.

    A tick late by more than half an interval means a blocking call held the event loop: the
    peers' heartbeats are queued unread, so their silence is ours.
    """
    late = now - last_tick - tick
    return late if now - last_tick > tick + 0.5 * interval else None


def extended(last_seen: float, now: float, interval: float) -> float:
    """A peer's ``last_seen`` after our own stall: as if it had beaten one interval ago."""
    return max(last_seen, now - interval)


def dead(last_seen: Mapping[str, float], now: float, interval: float) -> list[str]:
    """The peers (by agent) silent for more than ``LEASE_SILENCE`` intervals at ``now``."""
    return [agent for agent, seen in last_seen.items() if now - seen > LEASE_SILENCE * interval]


def held_rooms(holders: Iterable[tuple[int, Iterable[str]]], limit: int) -> dict[str, list[int]]:
    """Per peer agent, the rooms a heartbeat to it lists: those held live with it, at most ``limit``.

    ``holders`` gives each live room once, with the peer agents it waits on or holds blocks for (a decode
    room: every prefill rank it asked; a prefill room or stashed request: every decode rank that
    asked). A room listed in a heartbeat renews the receiver's lease on it (:func:`renews`).
    """
    listed: dict[str, list[int]] = {}
    for room, agents in holders:
        for agent in agents:
            rooms = listed.setdefault(agent, [])
            if len(rooms) < limit:
                rooms.append(room)
    return listed


def renews(listed_by: str, room_peers: Collection[str], *, unasked: bool = False) -> bool:
    """Whether a heartbeat of ``listed_by`` listing a room renews that room's lease here: one from a
    peer of the room (a decode rank that asked for it; a prefill rank it asked), or, for a prefill
    room no decode rank asked for yet (``unasked``), one from any peer: a decode whose request for
    it is queued there announces it (``TransferEngine.announce``)."""
    return unasked or listed_by in room_peers


ROOM_LEASE_FLOOR = LEASE_SILENCE + 1.0
"""Heartbeat intervals a room lease lasts at least: one more than a peer may stay silent. Renewals
ride on the peer's heartbeats, so a lease no longer than the silence allowed raced the peer's own
death check: a peer late by a stall (seen up to 6.5 s on a loaded 2-core box under vLLM) was
still alive when its rooms' leases had already lapsed. With the interval more, a room held by a
live peer never lapses first; a room whose peer is silent ends with the peer (declared dead)."""


def room_lease(configured: float, interval: float) -> float:
    """The room lease in force: ``room_lease`` as configured, but never shorter than
    :data:`ROOM_LEASE_FLOOR` intervals, since renewals ride on the peer's heartbeats."""
    return max(configured, ROOM_LEASE_FLOOR * interval)
