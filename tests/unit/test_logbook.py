"""The bounded drop log: first event of a kind in full, then one summary per window (sync, fake clock)."""

from __future__ import annotations

import logging

import pytest

from transfer_engine.runtime.logbook import LogBook, Summarizer, Summary


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_first_event_of_each_kind_is_written_the_rest_counted() -> None:
    s = Summarizer(interval=10.0)
    assert s.note("malformed", 0.0)
    assert not s.note("malformed", 1.0)
    assert s.note("bad_frames", 1.0)  # kinds are independent
    assert not s.note("malformed", 9.9)
    assert s.due(9.99) == []
    assert s.due(10.0) == [Summary("malformed", 2, 10.0, 3)]
    assert s.next_due() is None  # bad_frames' window holds nothing unwritten
    assert s.note("malformed", 10.5)  # a new window opens with a full line
    assert s.total == {"malformed": 4, "bad_frames": 1}


def test_a_window_without_suppressed_events_closes_silently() -> None:
    s = Summarizer(interval=1.0)
    assert s.note("x", 0.0)
    assert s.due(5.0) == []
    assert s.note("x", 5.0)


def test_close_summarises_open_windows_early() -> None:
    s = Summarizer(interval=10.0)
    s.note("x", 0.0)
    s.note("x", 0.1)
    assert s.next_due() == 10.0
    assert s.close(2.0) == [Summary("x", 1, 2.0, 2)]
    assert s.close(3.0) == []


@pytest.mark.parametrize("interval", [0.0, -1.0])
def test_interval_must_be_positive(interval: float) -> None:
    with pytest.raises(ValueError, match="interval"):
        Summarizer(interval)


@pytest.mark.parametrize(
    ("events", "seconds", "kinds"), [(100_000, 60.0, 1), (100_000, 60.0, 3), (10, 0.5, 2)]
)
def test_lines_stay_within_the_stated_bound(
    caplog: pytest.LogCaptureFixture, events: int, seconds: float, kinds: int
) -> None:
    clock = Clock()
    book = LogBook(logging.getLogger("test.logbook"), "ep", interval=10.0, clock=clock)
    start = clock.now
    with caplog.at_level(logging.WARNING, logger="test.logbook"):
        for i in range(events):
            clock.now = start + seconds * i / events
            book.note(f"kind{i % kinds}", "dropped %d", i)
        clock.now = start + seconds
        book.close()
    bound = kinds * 2 * (seconds / 10.0 + 1)
    assert len(caplog.records) <= bound
    assert sum(book.total.values()) == events
    # every event is accounted for in the lines: written ones plus the "N more" of the summaries
    written = sum(1 for r in caplog.records if r.getMessage().startswith("dropped"))
    summarised = sum(int(r.getMessage().split()[1]) for r in caplog.records if "more" in r.getMessage())
    assert written + summarised == events


def test_summary_line_names_endpoint_kind_count_and_total(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    book = LogBook(logging.getLogger("test.logbook"), "decode0", interval=5.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.logbook"):
        assert book.note("malformed", "first %s", "in full")
        clock.now += 1
        assert not book.note("malformed", "second")
        clock.now += 5
        book.flush()
    assert [r.getMessage() for r in caplog.records] == [
        "first in full",
        "decode0: 1 more malformed in the last 6 s (2 in all)",
    ]
