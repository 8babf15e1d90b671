"""Room leases and progress deadlines, as pure decisions: tables of (state, clocks) -> deadline, the
stash's lease, and which rooms a heartbeat lists (docs/CONFIGURATION.md: the timeouts and ``room_lease``)."""

from __future__ import annotations

import pytest

from transfer_engine.errors import FailureReason
from transfer_engine.protocol import leases
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.receiver_room import ReceiverRoom
from transfer_engine.protocol.rooms import Clocks, Deadlines, RoomStatus, SenderRoom
from transfer_engine.protocol.stash import EarlyRequests

B, W, T, S, F = (
    RoomStatus.BOOTSTRAPPING,
    RoomStatus.WAITING_FOR_INPUT,
    RoomStatus.TRANSFERRING,
    RoomStatus.SUCCESS,
    RoomStatus.FAILED,
)
BOOT, INPUT, XFER = (
    FailureReason.BOOTSTRAP_TIMEOUT,
    FailureReason.INPUT_TIMEOUT,
    FailureReason.TRANSFER_TIMEOUT,
)
DL = Deadlines(bootstrap=10.0, waiting=100.0, transfer=5.0, lease=30.0)
NO_WAIT = Deadlines(bootstrap=10.0, waiting=None, transfer=5.0, lease=30.0)
NO_LEASE = Deadlines(bootstrap=10.0, waiting=None, transfer=5.0, lease=None)

# (deadlines, state, entered_at, progress_at, held_at) -> (deadline, reason) or None
DUE_TABLE = [
    # Bootstrapping: unleased (a decode reaching its peer) runs on bootstrap; leased (a prefill room
    # waiting for its decode's requests) runs on the lease alone, however old the room is.
    (DL, B, 0.0, 0.0, None, (10.0, BOOT)),
    (DL, B, 0.0, 0.0, 0.0, (30.0, BOOT)),
    (DL, B, 0.0, 0.0, 200.0, (230.0, BOOT)),
    (NO_LEASE, B, 0.0, 0.0, 200.0, (10.0, BOOT)),
    # WaitingForInput: the earlier of the hard cap (waiting) and the lease; neither: no deadline.
    (DL, W, 0.0, 0.0, None, (100.0, INPUT)),
    (DL, W, 0.0, 0.0, 50.0, (80.0, INPUT)),
    (DL, W, 0.0, 0.0, 90.0, (100.0, INPUT)),
    (NO_WAIT, W, 0.0, 0.0, 500.0, (530.0, INPUT)),
    (NO_WAIT, W, 0.0, 0.0, None, None),
    (NO_LEASE, W, 0.0, 0.0, 500.0, None),
    # Transferring: from the last progress, whatever the lease and the time in the state.
    (DL, T, 0.0, 0.0, None, (5.0, XFER)),
    (DL, T, 0.0, 400.0, None, (405.0, XFER)),
    (DL, T, 0.0, 400.0, 1000.0, (405.0, XFER)),
    (Deadlines(transfer=None), T, 0.0, 400.0, None, None),
    # Final: nothing.
    (DL, S, 0.0, 0.0, 0.0, None),
    (DL, F, 0.0, 0.0, 0.0, None),
]


@pytest.mark.parametrize(("deadlines", "state", "entered", "progress", "held", "expected"), DUE_TABLE)
def test_due_table(
    deadlines: Deadlines,
    state: RoomStatus,
    entered: float,
    progress: float,
    held: float | None,
    expected: tuple[float, FailureReason] | None,
) -> None:
    due = deadlines.due(state, Clocks(entered, progress, held))
    assert (None if due is None else (due.at, due.reason)) == expected


def test_a_slow_receiver_that_keeps_moving_never_times_out() -> None:
    """Chunks landing every 4 s against transfer=5: past 40 s in Transferring, still live."""
    room = ReceiverRoom(room=1, deadlines=DL, now=0.0)
    room.bootstrapped((0,), None, now=0.0)
    for i in range(10):
        now = 1.0 + 4.0 * i
        assert room.expired(now) is None
        room.on_chunk(0, i, False, now=now)
        assert room.deadline == now + 5.0
    failure = room.expired(37.0 + 5.0)  # the last progress at 37: stopped, it fails 5 s later
    assert failure is not None and failure.reason is XFER
    assert "made no progress for more than 5.0 s in TRANSFERRING" in failure.detail


def test_layer_groups_are_progress() -> None:
    from transfer_engine.protocol.layers import LayerTally

    room = ReceiverRoom(room=2, deadlines=DL, now=0.0)
    room.layer_tally = LayerTally(4)
    room.bootstrapped((0,), None, now=0.0)
    room.on_layers(0, 0, (0, 1), now=1.0)
    room.on_layers(0, 0, (1, 2), now=4.0)
    assert room.status is T and room.deadline == 9.0


def test_a_sender_moves_its_deadline_with_each_write_done() -> None:
    room = SenderRoom(room=3, deadlines=DL, now=0.0)
    room.on_request(0, 1, sends=True, sends_aux=False, now=0.0)
    for i in range(4):
        room.queue_chunk(1, i == 3, None, now=0.0)
    for i in range(3):
        room.write_done(i, 0, now=4.0 * (i + 1))
        assert room.deadline == 4.0 * (i + 1) + 5.0
    room.write_done(3, 0, now=16.0)
    assert room.status is S and room.deadline is None


def test_a_prefill_room_is_leased_from_its_opening_and_renewed_by_its_decode() -> None:
    """The sequential router's case: the prefill finished, no decode ever asks: it ends at the lease."""
    room = SenderRoom(room=4, deadlines=DL, now=0.0)
    assert room.held_at == 0.0
    failure = room.expired(30.0)
    assert failure is not None and failure.reason is BOOT
    assert "room_lease=30 s" in failure.detail and "BOOTSTRAPPING" in failure.detail
    room.hold(25.0)  # a decode's heartbeat listed it
    assert room.expired(30.0) is None and room.deadline == 55.0
    room.hold(10.0)  # a late, reordered renewal never moves it back
    assert room.deadline == 55.0
    room.on_request(0, 2, sends=True, sends_aux=False, now=40.0)  # a request renews it too
    assert room.deadline == 70.0


def test_a_decode_room_is_unleased_until_its_requests_go_out() -> None:
    room = ReceiverRoom(room=5, deadlines=NO_WAIT, now=0.0)
    room.bootstrapped((0,), None, now=0.0)
    room.hold(5.0)  # nothing to renew: it waits on its own application
    assert room.held_at is None and room.deadline is None
    room.lease(100.0)
    assert room.deadline == 130.0
    room.lease(120.0)  # starting again is a no-op
    assert room.deadline == 130.0
    for beat in range(110, 310, 20):  # a prefill that holds it queued, for minutes
        assert room.expired(beat) is None
        room.hold(float(beat))
    assert room.deadline == 320.0
    failure = room.expired(320.0)
    assert failure is not None and failure.reason is INPUT


def _request(room: int, agent: str, rank: int = 0) -> m.TransferRequest:
    return m.TransferRequest(
        room=room, agent=agent, decode_rank=rank, decode_tp=2, path="direct", dst_pages=[1], aux_slot=None,
        slices=[],
    )  # fmt: skip


def test_stash_lease_is_renewed_by_its_askers_only() -> None:
    stash = EarlyRequests()
    stash.add(7, _request(7, "d0"), 0.0)
    stash.add(7, _request(7, "d1", 1), 0.0)
    stash.add(8, _request(8, "d0"), 0.0)
    stash.hold(7, "d1", 20.0)
    stash.hold(7, "stranger", 25.0)
    stash.hold(9, "d0", 25.0)  # no such room: nothing kept
    assert sorted(stash.rooms()) == [7, 8]
    assert stash.stale(29.0, lease=10.0) == [8]  # room 7 renewed by d1 at 20
    assert stash.stale(31.0, lease=10.0) == [7, 8]
    assert sorted(stash.held("d0")) == [7, 8] and stash.held("d1") == [7]


def test_stash_repeat_renews_and_keeps_one() -> None:
    stash = EarlyRequests()
    assert stash.add(7, _request(7, "d0"), 0.0)
    assert not stash.add(7, _request(7, "d0"), 8.0)
    assert len(stash) == 1
    assert stash.stale(15.0, lease=10.0) == []
    assert stash.stale(18.5, lease=10.0) == [7]


def test_stash_forgets_a_dead_askers_requests() -> None:
    stash = EarlyRequests()
    stash.add(7, _request(7, "d0"), 0.0)
    stash.add(7, _request(7, "d1", 1), 0.0)
    stash.add(8, _request(8, "d0"), 0.0)
    assert stash.forget("d0") == [8]
    assert [r.agent for r in stash.take(7)] == ["d1"]
    assert len(stash) == 0


HELD_TABLE = [
    ([], 10, {}),
    ([(1, {"p0", "p1"}), (2, {"p0"}), (3, set())], 10, {"p0": [1, 2], "p1": [1]}),
    ([(r, {"p0"}) for r in range(5)], 3, {"p0": [0, 1, 2]}),
]


@pytest.mark.parametrize(("holders", "limit", "expected"), HELD_TABLE)
def test_held_rooms_per_peer(
    holders: list[tuple[int, set[str]]], limit: int, expected: dict[str, list[int]]
) -> None:
    assert leases.held_rooms(holders, limit) == expected


@pytest.mark.parametrize(
    ("agent", "peers", "renews"), [("p0", {"p0", "p1"}, True), ("p2", {"p0"}, False), ("p0", set(), False)]
)
def test_only_a_peer_of_the_room_renews_it(agent: str, peers: set[str], renews: bool) -> None:
    assert leases.renews(agent, peers) is renews


@pytest.mark.parametrize("agent", ["d0", "d9"])
def test_a_prefill_room_nobody_asked_for_is_renewed_by_any_peer_that_announces_it(agent: str) -> None:
    assert leases.renews(agent, set(), unasked=True) is True


def test_heartbeat_carries_rooms_compactly() -> None:
    beat = m.Heartbeat(agent="d0", rank=0, side="decode", seq=1, rooms=[3, 2**62])
    assert m.decode(m.encode(beat)) == beat
    bare = m.Heartbeat(agent="d0", rank=0, side="decode", seq=1)
    assert bare.rooms is None and len(m.encode(beat)) - len(m.encode(bare)) <= 2 * 9


@pytest.mark.parametrize(
    ("configured", "interval", "lease"),
    [(30.0, 1.0, 30.0), (0.6, 0.2, 0.6), (0.1, 0.2, 0.6), (0.5, 0.2, 0.6), (30.0, 30.0, 90.0)],
)
def test_the_lease_in_force_outlasts_a_live_peers_silence(
    configured: float, interval: float, lease: float
) -> None:
    assert leases.room_lease(configured, interval) == pytest.approx(lease)
