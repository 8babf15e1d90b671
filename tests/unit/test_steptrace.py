"""StepTrace: bounded marks of rooms' steps, nothing kept when off."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from transfer_engine.runtime.steptrace import StepTrace


@dataclass
class Mail:
    room: int


def test_off_keeps_nothing() -> None:
    trace = StepTrace()
    trace.mark(1, "send")
    trace.mark_mail("room", Mail(1))
    assert not trace.enabled and trace.take() == []


def test_marks_are_named_by_side_and_bounded() -> None:
    trace = StepTrace(3, "decode")
    trace.mark(7, "receiver")
    trace.mark_mail("room", Mail(7))
    trace.mark_mail("worker", object())  # no room field and none given: not marked
    trace.mark_mail("room", object(), room=8)
    trace.mark(9, "waited")  # the oldest mark goes
    marks = trace.take()
    assert [(room, step) for _, room, step in marks] == [
        (7, "d.room:Mail"),
        (8, "d.room:object"),
        (9, "d.waited"),
    ]
    assert [t for t, _, _ in marks] == sorted(t for t, _, _ in marks)
    assert trace.take() == []


def test_negative_capacity_is_refused() -> None:
    with pytest.raises(ValueError, match="-1"):
        StepTrace(-1)


def test_mark_at_keeps_the_time_it_is_given() -> None:
    """A step timed earlier (on another thread, by the transport) is kept at that time, named as
    every other mark; off, nothing is kept."""
    trace = StepTrace(4, "prefill")
    trace.mark_at(5, "locked", 123)
    trace.mark(5, "posted")
    marks = trace.take()
    assert marks[0] == (123, 5, "p.locked")
    assert marks[1][1:] == (5, "p.posted") and marks[1][0] > 123
    off = StepTrace()
    off.mark_at(5, "locked", 123)
    assert off.take() == []
