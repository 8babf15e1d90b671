"""Repeats of lost control messages and how they are answered (protocol.retransmit; sync, no I/O)."""

from __future__ import annotations

import itertools

import pytest

from transfer_engine.errors import FailureReason
from transfer_engine.protocol.retransmit import (
    Backoff,
    Ended,
    Late,
    Repeat,
    RequestAnswer,
    Tombstones,
    answer_late_request,
    answer_request,
    decode_repeat,
)
from transfer_engine.protocol.rooms import RoomStatus

S = RoomStatus


@pytest.mark.parametrize(
    ("status", "aborting", "awaiting", "expected"),
    [
        *[
            (s, a, w, Repeat.REQUESTS)
            for s in (S.BOOTSTRAPPING, S.WAITING_FOR_INPUT, S.TRANSFERRING)
            for a in (False, True)
            for w in (set(), {0})
        ],  # fmt: skip
        (S.FAILED, True, {0, 1}, Repeat.ABORTS),
        (S.FAILED, True, set(), Repeat.NOTHING),  # every writer acknowledged
        (S.FAILED, False, {0}, Repeat.NOTHING),  # not yet aborting: the Abort goes out first
        (S.SUCCESS, False, set(), Repeat.NOTHING),
        (S.SUCCESS, True, {0}, Repeat.NOTHING),
    ],
)
def test_decode_room_repeats_requests_until_final_then_aborts_until_acknowledged(
    status: RoomStatus, aborting: bool, awaiting: set[int], expected: Repeat
) -> None:
    assert decode_repeat(status, aborting, awaiting) is expected


def test_backoff_doubles_to_its_cap_and_resets() -> None:
    b = Backoff.start(0.5, 2.0, now=10.0)
    assert not b.due(10.4) and b.due(10.5)
    gaps = []
    now = 10.5
    for _ in range(5):
        b.sent(now)
        gaps.append(b.next_at - now)
        now = b.next_at
    assert gaps == [1.0, 2.0, 2.0, 2.0, 2.0]
    b.reset(100.0)
    assert b.next_at == 100.5


@pytest.mark.parametrize(("base", "cap"), [(0.0, 1.0), (2.0, 1.0), (-1.0, -1.0)])
def test_backoff_refuses_bad_bounds(base: float, cap: float) -> None:
    with pytest.raises(ValueError, match="base"):
        Backoff.start(base, cap, 0.0)


CASES = {
    # (status, held_is_same, told_us) -> answer; every combination is listed
    (S.FAILED, None, False): RequestAnswer.TELL_FAILURE,
    (S.FAILED, True, False): RequestAnswer.TELL_FAILURE,
    (S.FAILED, False, False): RequestAnswer.TELL_FAILURE,
    (S.FAILED, None, True): RequestAnswer.IGNORE,
    (S.FAILED, True, True): RequestAnswer.IGNORE,
    (S.FAILED, False, True): RequestAnswer.IGNORE,
    (S.SUCCESS, None, False): RequestAnswer.IGNORE,
    (S.SUCCESS, None, True): RequestAnswer.IGNORE,
    (S.SUCCESS, True, False): RequestAnswer.DUPLICATE,
    (S.SUCCESS, True, True): RequestAnswer.DUPLICATE,
    (S.SUCCESS, False, False): RequestAnswer.CONFLICT,
    (S.SUCCESS, False, True): RequestAnswer.CONFLICT,
}
for live in (S.BOOTSTRAPPING, S.WAITING_FOR_INPUT, S.TRANSFERRING):
    for told in (False, True):
        CASES[(live, None, told)] = RequestAnswer.ACCEPT
        CASES[(live, True, told)] = RequestAnswer.DUPLICATE
        CASES[(live, False, told)] = RequestAnswer.CONFLICT


def test_the_table_covers_every_input() -> None:
    assert set(CASES) == set(itertools.product(RoomStatus, (None, True, False), (False, True)))


@pytest.mark.parametrize(("key", "expected"), sorted(CASES.items(), key=str))
def test_live_prefill_room_answers_a_request(
    key: tuple[RoomStatus, bool | None, bool], expected: RequestAnswer
) -> None:
    assert answer_request(*key) is expected


def _ended(
    status: RoomStatus,
    *,
    at: float = 0.0,
    opened: bool = True,
    by: frozenset[str] = frozenset(),
    askers: dict[int, str] | None = None,
) -> Ended:
    reason = None if status is S.SUCCESS else FailureReason.ABORTED
    askers = {0: "d0", 1: "d1"} if askers is None else askers
    return Ended(status, reason, "why", at, opened=opened, aborted_by=by, askers=askers)


@pytest.mark.parametrize(
    ("ended", "agent", "rank", "expected"),
    [
        (None, "d0", 0, Late.STASH),
        (_ended(S.SUCCESS), "d0", 0, Late.DROP),
        (_ended(S.FAILED), "d0", 0, Late.TELL_FAILURE),
        (_ended(S.FAILED, by=frozenset({"d0"})), "d0", 0, Late.DROP),
        (_ended(S.FAILED, by=frozenset({"d0"})), "d1", 1, Late.TELL_FAILURE),
        (_ended(S.FAILED, opened=False, by=frozenset({"d0"})), "d1", 1, Late.TELL_FAILURE),
        # another agent asks as a rank that was asked for in the ended room: a new room, same id
        (_ended(S.FAILED), "d9", 0, Late.STASH),
        (_ended(S.SUCCESS), "d9", 1, Late.STASH),
        # a rank whose request had not arrived when the room failed (decode TP 4, two ranks asked)
        (_ended(S.FAILED), "d2", 2, Late.TELL_FAILURE),
        # a room that ended before any decode asked: every request is late for it
        (_ended(S.FAILED, askers={}), "d9", 3, Late.TELL_FAILURE),
    ],
)
def test_request_for_a_room_not_live_here(ended: Ended | None, agent: str, rank: int, expected: Late) -> None:
    assert answer_late_request(ended, agent, rank) is expected


def test_tombstones_expire_by_age_and_are_bounded_in_count() -> None:
    t = Tombstones(keep_s=10.0, limit=3)
    for room in range(5):
        t.put(room, _ended(S.SUCCESS, at=float(room)))
    assert len(t) == 3 and t.get(0, 5.0) is None and t.get(1, 5.0) is None
    assert t.get(2, 5.0) is not None
    assert t.get(2, 12.0) is None  # 10 s old
    assert t.get(4, 12.0) is not None
    assert t.get(4, 14.0) is None and len(t) == 0


def test_reopening_a_room_forgets_its_outcome_but_not_an_abort_before_open() -> None:
    t = Tombstones(keep_s=10.0)
    t.put(1, _ended(S.FAILED))
    assert t.reopen(1) and t.get(1, 0.0) is None
    t.put(2, _ended(S.FAILED, opened=False, by=frozenset({"d0"})))
    assert not t.reopen(2) and t.get(2, 0.0) is not None
    assert t.reopen(3)  # nothing to forget


@pytest.mark.parametrize(("keep_s", "limit"), [(0.0, 1), (1.0, 0)])
def test_tombstones_refuse_bad_bounds(keep_s: float, limit: int) -> None:
    with pytest.raises(ValueError, match="keep_s"):
        Tombstones(keep_s, limit)
