"""Room state machines: every (state, event) pair of both tables, bookkeeping, deadlines.

The expected transitions below are written out by hand from the room states (docs/states.md) and the KVPoll states, never
read from the tables under test. Every test is synchronous and passes ``now`` explicitly.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer_engine.errors import FailureReason, LocalProtocolError, RemoteProtocolError
from transfer_engine.protocol.receiver_room import ReceiverRoom
from transfer_engine.protocol.rooms import (
    RECEIVER_TRANSITIONS,
    SENDER_TRANSITIONS,
    Bootstrapped,
    Completed,
    Deadlines,
    Event,
    Fail,
    InputReady,
    Landed,
    RoomStatus,
    SenderRoom,
    transition,
)

B = RoomStatus.BOOTSTRAPPING
W = RoomStatus.WAITING_FOR_INPUT
T = RoomStatus.TRANSFERRING
S = RoomStatus.SUCCESS
F = RoomStatus.FAILED

EVENTS: dict[type, Event] = {
    Bootstrapped: Bootstrapped(),
    InputReady: InputReady(),
    Landed: Landed(),
    Completed: Completed(),
    Fail: Fail(FailureReason.ABORTED, "test"),
}

# state -> {event type -> next state}; pairs not listed are illegal.
EXPECTED_SENDER: dict[RoomStatus, dict[type, RoomStatus]] = {
    B: {Bootstrapped: W, Fail: F},
    W: {InputReady: T, Completed: S, Fail: F},
    T: {Landed: T, Completed: S, Fail: F},
    S: {},
    F: {},
}
EXPECTED_RECEIVER: dict[RoomStatus, dict[type, RoomStatus]] = {
    B: {Bootstrapped: W, Fail: F},
    W: {Landed: T, Fail: F},
    T: {Landed: T, Completed: S, Fail: F},
    S: {},
    F: {},
}

TABLES = {
    "sender": (SENDER_TRANSITIONS, EXPECTED_SENDER),
    "receiver": (RECEIVER_TRANSITIONS, EXPECTED_RECEIVER),
}

ALL_PAIRS = [
    pytest.param(side, state, event, id=f"{side}-{state.name}-{event.__name__}")
    for side in TABLES
    for state in RoomStatus
    for event in EVENTS
]


# ---------------------------------------------------------------- transition tables


def test_status_values_are_sglang_kvpoll() -> None:
    assert {s.name: int(s) for s in RoomStatus} == {
        "FAILED": 0,
        "BOOTSTRAPPING": 1,
        "WAITING_FOR_INPUT": 2,
        "TRANSFERRING": 3,
        "SUCCESS": 4,
    }
    assert {s for s in RoomStatus if s.final} == {S, F}


@pytest.mark.parametrize("side", TABLES)
def test_tables_cover_every_state_and_only_known_events(side: str) -> None:
    table, _ = TABLES[side]
    assert set(table) == set(RoomStatus)
    for events in table.values():
        assert set(events) <= set(EVENTS)


@pytest.mark.parametrize(("side", "state", "event"), ALL_PAIRS)
def test_every_state_event_pair(side: str, state: RoomStatus, event: type) -> None:
    table, expected = TABLES[side]
    nxt = expected[state].get(event)
    if nxt is not None:
        assert transition(table, state, EVENTS[event]) is nxt
    else:
        with pytest.raises(LocalProtocolError) as info:
            transition(table, state, EVENTS[event])
        assert state.name in str(info.value)
        assert event.__name__ in str(info.value)


@pytest.mark.parametrize("side", TABLES)
def test_final_states_have_no_exits(side: str) -> None:
    table, _ = TABLES[side]
    assert table[S] == {} and table[F] == {}
    for state, events in table.items():
        if not state.final:
            assert events[Fail] is F, f"{state.name} must be failable"


# ---------------------------------------------------------------- helpers


def sender(
    decode_tp: int = 2,
    targets: tuple[int, ...] = (0, 1),
    aux_targets: tuple[int, ...] = (),
    deadlines: Deadlines | None = None,
    now: float = 0.0,
) -> SenderRoom:
    """A sender room that received every decode rank's TransferRequest at ``now``."""
    room = SenderRoom(room=7, deadlines=deadlines or Deadlines(), now=now)
    for d in range(decode_tp):
        room.on_request(d, decode_tp, sends=d in targets, sends_aux=d in aux_targets, now=now)
    return room


def receiver(
    writers: tuple[int, ...] = (0, 1),
    staged: bool = False,
    aux_from: int | None = None,
    deadlines: Deadlines | None = None,
    now: float = 0.0,
) -> ReceiverRoom:
    """A receiver room bootstrapped at ``now`` with the given writers."""
    room = ReceiverRoom(room=9, deadlines=deadlines or Deadlines(), now=now, staged=staged)
    room.bootstrapped(writers, aux_from, now)
    return room


def snapshot(room: ReceiverRoom) -> tuple[object, ...]:
    return (
        room.status,
        {w: set(s) for w, s in room.landed.items()},
        dict(room.last_chunk),
        set(room.scattered),
        room.aux_landed,
        len(room.history),
    )


# ---------------------------------------------------------------- final states stay final


def _finished_rooms() -> list[SenderRoom | ReceiverRoom]:
    done_sender = sender(targets=())
    done_sender.queue_chunk(1, True, None, now=1.0)
    assert done_sender.status is S
    failed_sender = sender()
    assert failed_sender.fail(FailureReason.PEER_DEAD, "gone", now=1.0)
    done_receiver = receiver(writers=(3,))
    done_receiver.on_chunk(3, 0, True, now=1.0)
    assert done_receiver.status is S
    failed_receiver = receiver()
    assert failed_receiver.fail(FailureReason.TRANSPORT, "boom", now=1.0)
    return [done_sender, failed_sender, done_receiver, failed_receiver]


@pytest.mark.parametrize(
    "index", range(4), ids=["sender-success", "sender-failed", "receiver-success", "receiver-failed"]
)
def test_final_rooms_refuse_fail(index: int) -> None:
    room = _finished_rooms()[index]
    status, failure, history = room.status, room.failure, list(room.history)
    assert room.fail(FailureReason.ABORTED, "late abort", now=5.0) is False
    assert (room.status, room.failure, room.history) == (status, failure, history)
    assert room.deadline is None
    assert room.expired(1e12) is None


def test_fail_records_reason_and_history() -> None:
    room = receiver()
    assert room.fail(FailureReason.PEER_DEAD, "lease expired", now=3.0) is True
    assert room.status is F
    assert room.failure == Fail(FailureReason.PEER_DEAD, "lease expired")
    assert room.history[-1][0] == 3.0
    assert room.history[-1][1].startswith("FAILED")


# ---------------------------------------------------------------- receiver bookkeeping


@settings(max_examples=60, deadline=None)
@given(
    writers=st.sets(st.integers(0, 15), min_size=1, max_size=4),
    num_chunks=st.integers(1, 4),
    data=st.data(),
)
def test_receiver_chunks_land_in_any_order(writers: set[int], num_chunks: int, data: st.DataObject) -> None:
    landings = data.draw(st.permutations(list(itertools.product(sorted(writers), range(num_chunks)))))
    room = receiver(tuple(writers))
    for i, (w, c) in enumerate(landings):
        everyone = room.on_chunk(w, c, c == num_chunks - 1, now=float(i + 1))
        landed_so_far = landings[: i + 1]
        assert everyone == all((x, c) in landed_so_far for x in writers)
        for x in writers:
            assert room.writer_done(x) == all((x, k) in landed_so_far for k in range(num_chunks))
        if i < len(landings) - 1:
            assert room.status is T
    assert room.status is S
    assert room.chunks_expected() == num_chunks
    assert room.history[-1] == (float(len(landings)), "SUCCESS")


@settings(max_examples=40, deadline=None)
@given(
    writers=st.sets(st.integers(0, 15), min_size=1, max_size=3),
    num_chunks=st.integers(1, 4),
    data=st.data(),
)
def test_staged_receiver_needs_every_chunk_scattered(
    writers: set[int], num_chunks: int, data: st.DataObject
) -> None:
    landings = data.draw(st.permutations(list(itertools.product(sorted(writers), range(num_chunks)))))
    room = receiver(tuple(writers), staged=True)
    scattered = 0
    for w, c in landings:
        if room.on_chunk(w, c, c == num_chunks - 1, now=1.0):
            assert room.status is T  # every writer landed, but the scatter has not run yet
            room.on_scattered(c, now=2.0)
            scattered += 1
            assert (room.status is S) == (scattered == num_chunks)
    assert room.status is S


def test_staged_receiver_scatter_order_does_not_matter() -> None:
    room = receiver((0,), staged=True)
    for c in (2, 0, 1):
        room.on_chunk(0, c, c == 2, now=1.0)
    assert room.status is T
    room.on_scattered(1, now=2.0)
    room.on_scattered(2, now=2.0)
    assert room.status is T
    room.on_scattered(0, now=2.0)
    assert room.status is S


def test_receiver_last_chunk_need_not_land_last() -> None:
    room = receiver((4,))
    room.on_chunk(4, 2, True, now=1.0)
    assert room.status is T
    room.on_chunk(4, 0, False, now=2.0)
    assert room.status is T
    room.on_chunk(4, 1, False, now=3.0)
    assert room.status is S


def test_receiver_completion_is_counted_per_writer() -> None:
    room = receiver((0, 1))
    room.on_chunk(0, 0, False, now=1.0)
    room.on_chunk(0, 1, True, now=1.0)
    assert room.writer_done(0) and not room.writer_done(1)
    assert room.status is T
    room.on_chunk(1, 1, True, now=2.0)
    assert not room.writer_done(1)
    room.on_chunk(1, 0, False, now=3.0)
    assert room.writer_done(1)
    assert room.status is S


def test_receiver_first_landing_leaves_waiting_for_input() -> None:
    room = receiver((0, 1))
    assert room.status is W
    room.on_chunk(1, 0, False, now=1.0)
    assert room.status is T


@pytest.mark.parametrize(
    ("landings", "bad", "needle"),
    [
        pytest.param([], (5, 0, True), "prefill rank 5", id="unknown-sender"),
        pytest.param([(0, 0, False)], (0, 0, False), "twice", id="duplicate"),
        pytest.param([(0, 0, True)], (0, 0, True), "twice", id="duplicate-last"),
        pytest.param([(0, 1, True)], (0, 2, False), "after last", id="after-own-last"),
        pytest.param([(0, 1, True)], (0, 0, True), "after last", id="second-last"),
        pytest.param([(0, 3, False)], (0, 1, True), "after chunk 3", id="last-below-landed"),
        pytest.param([(0, 1, True)], (1, 2, False), "after last", id="after-other-writers-last"),
        pytest.param([(0, 1, True)], (1, 0, True), "after last", id="writers-disagree-on-last"),
        pytest.param([(0, 3, False)], (1, 1, True), "after chunk 3", id="last-below-other-writer"),
        pytest.param([], (0, -1, False), "-1", id="negative-chunk"),
    ],
)
def test_receiver_rejects_bad_chunks(
    landings: list[tuple[int, int, bool]], bad: tuple[int, int, bool], needle: str
) -> None:
    room = receiver((0, 1))
    for w, c, last in landings:
        room.on_chunk(w, c, last, now=1.0)
    before = snapshot(room)
    with pytest.raises(RemoteProtocolError, match="room 9") as info:
        room.on_chunk(*bad, now=2.0)
    assert needle in str(info.value)
    assert snapshot(room) == before


def test_receiver_chunk_before_bootstrap_is_refused() -> None:
    room = ReceiverRoom(room=9, deadlines=Deadlines(), now=0.0)
    with pytest.raises(RemoteProtocolError, match="not a writer"):
        room.on_chunk(0, 0, True, now=1.0)
    assert room.status is B


def test_receiver_bootstrapped_twice_changes_nothing() -> None:
    room = receiver((0, 1))
    room.on_chunk(0, 0, False, now=1.0)
    before = snapshot(room)
    with pytest.raises(LocalProtocolError, match="Bootstrapped"):
        room.bootstrapped((5,), 5, now=2.0)
    assert snapshot(room) == before
    assert room.writers == frozenset({0, 1})


def test_receiver_chunks_after_failure_are_recorded_without_transition() -> None:
    room = receiver((0,))
    room.fail(FailureReason.ABORTED, "user", now=1.0)
    room.on_chunk(0, 0, True, now=2.0)  # a WRITE posted before the abort may still land
    assert room.status is F
    assert room.writer_done(0)


def test_receiver_waits_for_expected_aux() -> None:
    room = receiver((0, 1), aux_from=1)
    room.on_chunk(0, 0, True, now=1.0)
    room.on_chunk(1, 0, True, now=1.0)
    assert room.status is T
    room.on_aux(1, now=2.0)
    assert room.status is S


def test_receiver_aux_may_land_before_the_chunks() -> None:
    room = receiver((0,), aux_from=0)
    room.on_aux(0, now=1.0)
    assert room.status is W
    room.on_chunk(0, 0, True, now=2.0)
    assert room.status is S


def test_receiver_without_aux_completes_on_chunks() -> None:
    room = receiver((0,))
    room.on_chunk(0, 0, True, now=1.0)
    assert room.status is S
    assert not room.aux_landed


@pytest.mark.parametrize(
    ("aux_from", "landed_first", "sender", "needle"),
    [
        pytest.param(None, False, 0, "expected None", id="not-expected"),
        pytest.param(1, False, 0, "prefill rank 0, expected 1", id="wrong-sender"),
        pytest.param(1, True, 1, "twice", id="twice"),
    ],
)
def test_receiver_rejects_bad_aux(aux_from: int | None, landed_first: bool, sender: int, needle: str) -> None:
    room = receiver((0, 1), aux_from=aux_from)
    if landed_first:
        room.on_aux(1, now=1.0)
    with pytest.raises(RemoteProtocolError, match=needle):
        room.on_aux(sender, now=2.0)


# ---------------------------------------------------------------- sender bookkeeping


def test_sender_bootstraps_once_every_decode_rank_asked() -> None:
    room = SenderRoom(room=7, deadlines=Deadlines(), now=0.0)
    room.on_request(1, 3, sends=True, sends_aux=False, now=1.0)
    room.on_request(0, 3, sends=False, sends_aux=False, now=2.0)
    assert room.status is B
    room.on_request(2, 3, sends=True, sends_aux=True, now=3.0)
    assert room.status is W
    assert room.targets == {1, 2}
    assert room.aux_targets == {2}
    assert room.decode_tp == 3


@pytest.mark.parametrize(
    ("requests", "bad", "needle"),
    [
        pytest.param([], (2, 2), "decode rank 2 of tp 2", id="rank-out-of-range"),
        pytest.param([], (-1, 2), "decode rank -1", id="negative-rank"),
        pytest.param([], (0, 0), "tp 0", id="zero-tp"),
        pytest.param([(0, 2)], (1, 4), "earlier requests said 2", id="tp-mismatch"),
        pytest.param([(0, 2)], (0, 2), "second TransferRequest", id="duplicate"),
    ],
)
def test_sender_rejects_bad_requests(
    requests: list[tuple[int, int]], bad: tuple[int, int], needle: str
) -> None:
    room = SenderRoom(room=7, deadlines=Deadlines(), now=0.0)
    for d, tp in requests:
        room.on_request(d, tp, sends=True, sends_aux=False, now=0.0)
    with pytest.raises(RemoteProtocolError, match=needle):
        room.on_request(*bad, sends=True, sends_aux=False, now=1.0)
    assert room.status is B


def test_sender_ignores_requests_once_final() -> None:
    room = SenderRoom(room=7, deadlines=Deadlines(), now=0.0)
    room.fail(FailureReason.ABORTED, "x", now=1.0)
    room.on_request(0, 1, sends=True, sends_aux=False, now=2.0)
    assert room.status is F
    assert room.requested == set()


def test_sender_chunks_queued_before_bootstrap_start_the_transfer() -> None:
    room = SenderRoom(room=7, deadlines=Deadlines(), now=0.0)
    first = room.queue_chunk(3, False, None, now=1.0)
    second = room.queue_chunk(2, True, 5, now=1.0)
    assert room.status is B
    assert (first.chunk_id, first.page_start, first.num_pages) == (0, 0, 3)
    assert (second.chunk_id, second.page_start, second.num_pages, second.aux_slot) == (1, 3, 2, 5)
    assert room.next_page == 5 and room.sealed and room.aux_slot == 5
    room.on_request(0, 1, sends=True, sends_aux=False, now=2.0)
    assert room.status is T
    assert [name for _, name in room.history] == ["BOOTSTRAPPING", "WAITING_FOR_INPUT", "TRANSFERRING"]


@settings(max_examples=60, deadline=None)
@given(
    decode_tp=st.integers(1, 4),
    num_chunks=st.integers(1, 4),
    data=st.data(),
)
def test_sender_writes_finish_in_any_order(decode_tp: int, num_chunks: int, data: st.DataObject) -> None:
    targets = data.draw(st.sets(st.integers(0, decode_tp - 1), min_size=1))
    room = sender(decode_tp, tuple(targets))
    for c in range(num_chunks):
        room.queue_chunk(1, c == num_chunks - 1, None, now=1.0)
    assert room.status is T
    writes = data.draw(st.permutations(list(itertools.product(range(num_chunks), sorted(targets)))))
    for i, (c, d) in enumerate(writes):
        assert room.status is T
        room.write_done(c, d, now=2.0 + i)
    assert room.status is S


def test_sender_is_not_done_until_sealed() -> None:
    room = sender(1, (0,))
    room.queue_chunk(4, False, None, now=1.0)
    room.write_done(0, 0, now=2.0)
    assert room.status is T  # every WRITE so far is done, but more chunks may come
    room.queue_chunk(4, True, None, now=3.0)
    assert room.status is T
    room.write_done(1, 0, now=4.0)
    assert room.status is S


def test_sender_waits_for_every_aux_write() -> None:
    room = sender(2, (0, 1), aux_targets=(0, 1))
    room.queue_chunk(1, True, 3, now=1.0)
    room.write_done(0, 0, now=2.0)
    room.write_done(0, 1, now=2.0)
    assert room.status is T
    room.aux_written(1, now=3.0)
    assert room.status is T
    room.aux_written(0, now=4.0)
    assert room.status is S


def test_sender_aux_may_finish_before_the_chunks() -> None:
    room = sender(1, (0,), aux_targets=(0,))
    room.queue_chunk(1, True, 3, now=1.0)
    room.aux_written(0, now=2.0)
    assert room.status is T
    room.write_done(0, 0, now=3.0)
    assert room.status is S


@pytest.mark.parametrize(
    ("first", "bad"),
    [pytest.param(None, 0, id="not-an-aux-target"), pytest.param(1, 1, id="twice")],
)
def test_sender_rejects_bad_aux_written(first: int | None, bad: int) -> None:
    room = sender(2, (0, 1), aux_targets=(1,))
    room.queue_chunk(1, True, 3, now=1.0)
    if first is not None:
        room.aux_written(first, now=2.0)
    done = set(room.aux_done)
    with pytest.raises(LocalProtocolError, match=f"unexpected aux completion for decode rank {bad}"):
        room.aux_written(bad, now=3.0)
    assert room.aux_done == done


def test_sender_that_writes_nowhere_completes_from_waiting_once_sealed() -> None:
    room = sender(2, targets=())
    assert room.status is W
    room.queue_chunk(2, False, None, now=1.0)
    assert room.status is W
    room.queue_chunk(2, True, None, now=2.0)
    assert room.status is S
    assert [name for _, name in room.history] == ["BOOTSTRAPPING", "WAITING_FOR_INPUT", "SUCCESS"]


def test_sender_queue_after_last_raises() -> None:
    room = sender()
    room.queue_chunk(1, True, None, now=1.0)
    with pytest.raises(LocalProtocolError, match="last chunk"):
        room.queue_chunk(1, False, None, now=2.0)
    assert len(room.chunks) == 1


def test_sender_queue_on_final_room_raises() -> None:
    room = sender()
    room.fail(FailureReason.SHUTDOWN, "closing", now=1.0)
    with pytest.raises(LocalProtocolError, match="FAILED"):
        room.queue_chunk(1, True, None, now=2.0)


@pytest.mark.parametrize(
    ("chunk_id", "decode_rank", "needle"),
    [
        pytest.param(0, 0, "done twice", id="twice"),
        pytest.param(1, 1, "1 chunks", id="unknown-chunk"),
        pytest.param(-1, 1, "1 chunks", id="negative-chunk"),
        pytest.param(0, 2, r"decode ranks \[0, 1\]", id="not-a-target"),
    ],
)
def test_sender_rejects_bad_write_done(chunk_id: int, decode_rank: int, needle: str) -> None:
    room = sender(3, (0, 1))
    room.queue_chunk(1, False, None, now=1.0)
    room.write_done(0, 0, now=2.0)
    with pytest.raises(LocalProtocolError, match=needle):
        room.write_done(chunk_id, decode_rank, now=3.0)
    assert room.done == {(0, 0)}
    assert room.status is T


def test_sender_write_done_after_failure_keeps_failed() -> None:
    room = sender(1, (0,))
    room.queue_chunk(1, True, None, now=1.0)
    room.fail(FailureReason.ABORTED, "decode aborted", now=2.0)
    room.write_done(0, 0, now=3.0)  # a WRITE in flight at the abort still finishes
    assert room.status is F
    assert room.done == {(0, 0)}


# ---------------------------------------------------------------- deadlines

DL = Deadlines(bootstrap=10.0, waiting=20.0, transfer=30.0)


def test_deadlines_per_state() -> None:
    assert DL.for_state(B) == (10.0, FailureReason.BOOTSTRAP_TIMEOUT)
    assert DL.for_state(W) == (20.0, FailureReason.INPUT_TIMEOUT)
    assert DL.for_state(T) == (30.0, FailureReason.TRANSFER_TIMEOUT)


def _assert_times_out_at(room: SenderRoom | ReceiverRoom, at: float, reason: FailureReason) -> None:
    assert room.deadline == at
    assert room.expired(at - 1e-6) is None
    for now in (at, at + 1.0, at + 1e6):
        failure = room.expired(now)
        assert failure is not None
        assert failure.reason is reason
        assert room.status.name in failure.detail
        assert str(room.room) in failure.detail


def test_receiver_deadline_per_phase_rearmed_on_entry() -> None:
    room = ReceiverRoom(room=9, deadlines=DL, now=100.0)
    _assert_times_out_at(room, 110.0, FailureReason.BOOTSTRAP_TIMEOUT)
    room.bootstrapped((0,), None, now=105.0)
    _assert_times_out_at(room, 125.0, FailureReason.INPUT_TIMEOUT)
    room.on_chunk(0, 0, False, now=120.0)
    _assert_times_out_at(room, 150.0, FailureReason.TRANSFER_TIMEOUT)
    room.on_chunk(0, 1, False, now=140.0)  # progress in Transferring re-arms from the landing
    _assert_times_out_at(room, 170.0, FailureReason.TRANSFER_TIMEOUT)
    room.on_chunk(0, 2, True, now=169.0)
    assert room.status is S
    assert room.deadline is None and room.expired(1e9) is None


def test_sender_deadline_per_phase_rearmed_on_entry() -> None:
    leased = Deadlines(bootstrap=10.0, waiting=20.0, transfer=30.0, lease=50.0)
    room = SenderRoom(room=7, deadlines=leased, now=0.0)
    _assert_times_out_at(room, 50.0, FailureReason.BOOTSTRAP_TIMEOUT)  # leased from its opening
    room.on_request(0, 1, sends=True, sends_aux=False, now=4.0)
    _assert_times_out_at(room, 24.0, FailureReason.INPUT_TIMEOUT)
    room.queue_chunk(1, True, None, now=6.0)
    _assert_times_out_at(room, 36.0, FailureReason.TRANSFER_TIMEOUT)
    room.write_done(0, 0, now=35.0)
    assert room.status is S
    assert room.deadline is None and room.expired(1e9) is None


def test_no_input_deadline_unless_waiting_is_set() -> None:
    room = receiver((0,), deadlines=Deadlines(bootstrap=1.0, waiting=None, transfer=1.0), now=0.0)
    assert room.status is W
    assert room.deadline is None
    assert room.expired(1e9) is None


def test_disabled_deadlines_never_fire() -> None:
    never = Deadlines(bootstrap=None, waiting=None, transfer=None, lease=None)
    room = SenderRoom(room=7, deadlines=never, now=0.0)
    assert room.deadline is None and room.expired(1e12) is None
    room.on_request(0, 1, sends=True, sends_aux=False, now=1.0)
    room.queue_chunk(1, True, None, now=1.0)
    assert room.status is T
    assert room.deadline is None and room.expired(1e12) is None


def test_timeouts_fire_only_after_pending_events_are_applied() -> None:
    """A landing stamped before the deadline but read after it counts; then nothing times out."""
    room = receiver((0,), deadlines=DL, now=0.0)
    room.on_chunk(0, 0, False, now=1.0)
    assert room.deadline == 31.0
    # The actor wakes at 40.0 with the last chunk's notification (stamped 30.5) still queued.
    # Checked first, the room would wrongly time out:
    early = room.expired(40.0)
    assert early is not None and early.reason is FailureReason.TRANSFER_TIMEOUT
    # Applied first, as the actor does, the room is complete and has no deadline left.
    room.on_chunk(0, 1, True, now=30.5)
    assert room.status is S
    assert room.expired(40.0) is None
    assert room.history[-1] == (30.5, "SUCCESS")


def test_failed_room_has_no_deadline() -> None:
    room = sender(deadlines=DL)
    room.fail(FailureReason.ABORTED, "user", now=1.0)
    assert room.deadline is None
    assert room.expired(1e9) is None


def test_write_done_while_other_decode_ranks_still_bootstrap() -> None:
    """A WRITE to decode rank 0 may finish before decode rank 1's request arrives (D=2)."""
    from transfer_engine.protocol.rooms import Deadlines, RoomStatus, SenderRoom

    room = SenderRoom(5, Deadlines(), 0.0)
    room.queue_chunk(2, True, None, 0.0)
    room.on_request(0, 2, True, False, 0.0)
    room.write_done(0, 0, 0.1)
    assert room.status is RoomStatus.BOOTSTRAPPING
    room.on_request(1, 2, True, False, 0.2)
    assert room.status is RoomStatus.TRANSFERRING
    room.write_done(0, 1, 0.3)
    assert room.status is RoomStatus.SUCCESS


def test_transfer_timeout_says_what_the_sender_still_waits_for() -> None:
    room = sender(decode_tp=2, targets=(0, 1), aux_targets=(0,), deadlines=Deadlines(transfer=5.0))
    room.queue_chunk(2, False, None, now=0.0)
    room.queue_chunk(2, True, 0, now=0.0)
    for _ in range(4):
        room.job_started()
    room.write_done(0, 0, now=1.0)
    room.job_ended()
    room.write_done(0, 1, now=1.0)
    room.job_ended()
    room.write_done(1, 0, now=1.0)
    room.job_ended()
    assert room.status is RoomStatus.TRANSFERRING
    failure = room.expired(10.0)
    assert failure is not None and failure.reason is FailureReason.TRANSFER_TIMEOUT
    assert failure.detail == (
        "room 7 made no progress for more than 5.0 s in TRANSFERRING (2 chunk(s) queued, the last; "
        "3 of 4 chunk WRITEs done; aux 0 of 1; 1 job(s) at the workers)"
    )
