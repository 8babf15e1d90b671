"""The cost signal's pure part (protocol/cost.py): the moving average, the estimate, one peer's
bookkeeping over a room's life, and a router's choice. Tables; no clock, no sockets."""

from __future__ import annotations

import math

import pytest

from transfer_engine.protocol.cost import (
    MIN_SAMPLE_S,
    CostBook,
    PeerCost,
    PeerLoad,
    choose,
    estimate_seconds,
)

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize(
    ("backlog", "nbytes", "rate", "prior", "expected"),
    [
        (0, 1000, 1000.0, 1.0, 1.0),
        (3000, 1000, 1000.0, 1.0, 4.0),
        (0, 1000, None, 500.0, 2.0),  # nothing measured yet: the prior
        (0, 0, 1000.0, 1.0, 0.0),
        (10, 10, 0.0, 1.0, math.inf),  # only failures measured
    ],
)
def test_estimate_seconds(
    backlog: int, nbytes: int, rate: float | None, prior: float, expected: float
) -> None:
    assert estimate_seconds(backlog, nbytes, rate, prior) == expected


def test_estimate_refuses_negative_bytes() -> None:
    with pytest.raises(ValueError, match="nbytes=-1"):
        estimate_seconds(0, -1, 1.0, 1.0)


def test_a_room_life_moves_its_bytes_from_queued_to_in_flight_to_gone() -> None:
    peer = PeerCost(prior_rate=100.0, horizon_s=2.0)
    peer.queued(1, 400)
    assert peer.load() == PeerLoad(1, 400, 0, 0, None)
    assert peer.estimate(100) == pytest.approx(5.0)  # (400 + 100) / prior
    peer.started(1, now=10.0)
    peer.started(1, now=10.5)  # again: no change
    assert peer.load() == PeerLoad(0, 0, 1, 400, None)
    peer.grew(1, 100)
    peer.moved(1, 200, now=11.0)  # 200 bytes over 1 busy second
    assert peer.load() == PeerLoad(0, 0, 1, 300, pytest.approx(200.0))
    assert peer.estimate(100) == pytest.approx(2.0)  # (300 + 100) / 200
    peer.ended(1, now=12.0, ok=True)  # the 300 left moved in the next second; the first weighs e^-0.5
    keep = math.exp(-0.5)
    assert peer.load() == PeerLoad(0, 0, 0, 0, pytest.approx((200 * keep + 300) / (keep + 1)))


def test_the_rate_is_the_instance_throughput_not_a_room_s() -> None:
    """Four rooms of 100 bytes in flight together for 1 s: 400 B/s, not 100 B/s."""
    peer = PeerCost(prior_rate=1.0)
    for room in range(4):
        peer.queued(room, 100)
        peer.started(room, now=0.0)
    for room in range(4):
        peer.ended(room, now=1.0, ok=True)
    assert peer.rate == pytest.approx(400.0)


def test_a_steady_rate_is_measured_exactly() -> None:
    peer = PeerCost(prior_rate=1.0, horizon_s=0.7)
    for room in range(10):
        peer.queued(room, 50)
        peer.started(room, now=room * 0.5)
        peer.moved(room, 25, now=room * 0.5 + 0.25)
        peer.ended(room, now=room * 0.5 + 0.5, ok=True)
    assert peer.rate == pytest.approx(100.0)


def test_idle_time_does_not_count() -> None:
    """Busy 1 s, idle 9 s, busy 1 s: 100 bytes each time, 100 B/s."""
    peer = PeerCost(prior_rate=1.0)
    peer.queued(1, 100)
    peer.started(1, now=0.0)
    peer.ended(1, now=1.0, ok=True)
    peer.queued(2, 100)
    peer.started(2, now=10.0)
    peer.ended(2, now=11.0, ok=True)
    assert peer.rate == pytest.approx(100.0)


KEEP = math.exp(-0.5)


@pytest.mark.parametrize(
    ("events", "rate"),
    [
        # a failed room moves no bytes: no rate yet
        ([("q", 1, 100), ("s", 1, 0.0), ("e", 1, 1.0, False)], None),
        # ...but its busy time is the link's
        ([("q", 1, 100), ("s", 1, 0.0), ("e", 1, 1.0, False), ("q", 2, 100), ("s", 2, 1.0), ("e", 2, 2.0, True)],
         100 / (KEEP + 1)),
        # a room that never started leaves no trace
        ([("q", 1, 100), ("e", 1, 5.0, True)], None),
        # under MIN_SAMPLE_S of busy time: no rate yet
        ([("q", 1, 100), ("s", 1, 0.0), ("e", 1, MIN_SAMPLE_S / 10, True)], None),
        # moved before started: it starts then (and those bytes age by the second that follows)
        ([("q", 1, 100), ("m", 1, 100, 0.0), ("e", 1, 1.0, True)], 100 * KEEP),
        # ended for a room never counted here (failed early): ignored
        ([("e", 9, 1.0, True)], None),
    ],
)  # fmt: skip
def test_rate_table(events: list[tuple], rate: float | None) -> None:
    peer = PeerCost(prior_rate=1.0, horizon_s=2.0)
    for event in events:
        match event:
            case ("q", room, nbytes):
                peer.queued(room, nbytes)
            case ("s", room, now):
                peer.started(room, now)
            case ("m", room, nbytes, now):
                peer.moved(room, nbytes, now)
            case ("e", room, now, ok):
                peer.ended(room, now, ok)
    assert peer.rate == (None if rate is None else pytest.approx(rate))
    assert peer.load().backlog_bytes == 0


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda p: p.queued(1, 10), "room 1 is already counted"),
        (lambda p: p.started(2, 0.0), "room 2 is not counted"),
        (lambda p: p.grew(2, 5), "room 2 is not counted"),
        (lambda p: p.grew(1, -5), "nbytes=-5"),
        (lambda p: p.queued(3, -1), "nbytes=-1"),
        (lambda p: p.moved(1, -1, 0.0), "nbytes=-1"),
        (lambda p: p.moved(4, 1, 0.0), "room 4 is not counted"),
    ],
)
def test_bookkeeping_errors_name_the_room(call: object, message: str) -> None:
    peer = PeerCost(prior_rate=1.0)
    peer.queued(1, 10)
    with pytest.raises(ValueError, match=message):
        call(peer)  # type: ignore[operator]


@pytest.mark.parametrize(
    ("horizon", "prior", "message"),
    [(0.0, 1.0, "horizon_s=0.0"), (1.0, 0.0, "prior_rate=0.0"), (1.0, -3.0, "-3.0")],
)
def test_bad_settings(horizon: float, prior: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PeerCost(horizon_s=horizon, prior_rate=prior)


@pytest.mark.parametrize(
    ("estimates", "chosen"),
    [
        ({"a": 1.0, "b": 0.5}, "b"),
        ({"a": 0.5, "b": 0.5}, "a"),  # a tie: the first given
        ([("b", 0.5), ("a", 0.5)], "b"),
        ({"a": math.inf, "b": 9.0}, "b"),
        ({"a": math.inf}, "a"),
        ({"slow": 2.0, "idle": 0.0, "busy": 1.0}, "idle"),
    ],
)
def test_choose(estimates: dict[str, float] | list[tuple[str, float]], chosen: str) -> None:
    assert choose(estimates) == chosen


@pytest.mark.parametrize(
    ("estimates", "message"),
    [({}, "no instance"), ({"a": math.nan}, "'a' has estimate nan"), ({"a": 1.0, "b": -1.0}, "'b'")],
)
def test_choose_refuses(estimates: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        choose(estimates)


def test_the_book_keeps_each_instance_apart() -> None:
    book = CostBook(prior_rate=100.0)
    book.queued(1, "slow", 100)
    book.queued(2, "fast", 100)
    book.moved(1, 100, now=0.0)  # starts room 1
    book.moved(2, 100, now=0.0)
    book.queued(3, "slow", 300)
    book.ended(1, now=10.0, ok=True)  # 100 bytes in 10 s
    book.ended(2, now=0.5, ok=True)  # 100 bytes in 0.5 s
    assert book.loads()["slow"] == PeerLoad(1, 300, 0, 0, pytest.approx(100 * math.exp(-5) / 10))
    assert book.loads()["fast"].rate == pytest.approx(100 * math.exp(-0.25) / 0.5)
    assert choose({name: book.estimate(name, 1000) for name in ("slow", "fast")}) == "fast"
    assert book.estimate("never-seen", 1000) == pytest.approx(10.0)  # the prior, no backlog
    book.moved(99, 5, now=1.0)  # a room the book does not hold: ignored
    book.ended(99, now=1.0, ok=False)
    with pytest.raises(ValueError, match="room 3 is already counted"):
        book.queued(3, "fast", 1)


def test_the_book_starts_a_room_once() -> None:
    book = CostBook(prior_rate=1.0)
    book.queued(1, "a", 100)
    book.started(1, now=0.0)
    book.started(1, now=0.5)  # again: no change
    book.started(2, now=0.5)  # not held: ignored
    assert book.loads()["a"] == PeerLoad(0, 0, 1, 100, None)
    book.ended(1, now=1.0, ok=True)
    assert book.loads()["a"].rate == pytest.approx(100.0)
