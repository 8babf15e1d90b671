"""GroupCadence: quick-poll windows predicted from a sender's spacing of layer groups (pure)."""

from __future__ import annotations

import pytest

from transfer_engine.protocol.cadence import GroupCadence


def test_no_window_until_a_senders_second_group() -> None:
    c = GroupCadence()
    assert not c.landed(("p0", 1), 10.0, more=True)
    assert not c.quick(10.0) and c.next_start(10.0) is None
    assert c.landed(("p0", 1), 10.1, more=True)  # spacing 0.1 s: next at 10.2, margin 0.01 s
    assert c.next_start(10.1) == pytest.approx(10.19)
    assert not c.quick(10.18)
    assert c.quick(10.19) and c.quick(10.2) and c.quick(10.2099)
    assert not c.quick(10.21)  # the window ended: dropped
    assert c.next_start(10.0) is None


def test_the_margin_has_a_floor() -> None:
    c = GroupCadence(fraction=0.1, min_margin=0.001)
    c.landed("k", 1.0, more=True)
    c.landed("k", 1.002, more=True)  # spacing 2 ms: a tenth is 0.2 ms, the floor 1 ms wins
    assert c.next_start(1.002) == pytest.approx(1.003)
    assert c.quick(1.0045) and not c.quick(1.0051)


def test_the_last_group_forgets_the_sender_and_opens_nothing() -> None:
    c = GroupCadence()
    c.landed("k", 1.0, more=True)
    assert not c.landed("k", 1.1, more=False)
    assert c.keys == 0
    assert not c.landed("k", 5.0, more=True)  # a next chunk's spacing starts anew
    assert c.next_start(5.0) is None


def test_senders_keep_their_own_spacing() -> None:
    c = GroupCadence(min_margin=0.0)
    c.landed(("p0", 7), 0.0, more=True)
    c.landed(("p1", 7), 0.001, more=True)  # the other rank's first group, 1 ms later: no window
    assert c.next_start(0.001) is None
    c.landed(("p0", 7), 0.1, more=True)
    c.landed(("p1", 7), 0.201, more=True)
    assert c.quick(0.2) and not c.quick(0.3)  # p0: 0.2 +- 0.01; p1: 0.401 +- 0.02
    assert c.quick(0.401)
    assert c.keys == 2


def test_a_group_at_or_before_the_last_opens_nothing() -> None:
    c = GroupCadence()
    c.landed("k", 2.0, more=True)
    assert not c.landed("k", 2.0, more=True)
    assert not c.landed("k", 1.5, more=True)
    assert c.next_start(0.0) is None


def test_the_oldest_sender_is_forgotten_past_the_bound() -> None:
    c = GroupCadence(max_keys=2)
    for room in range(3):
        c.landed(room, float(room), more=True)
    assert c.keys == 2
    assert not c.landed(0, 10.0, more=True)  # room 0 was forgotten: this is a first group again
    assert c.landed(2, 10.0, more=True)


@pytest.mark.parametrize(
    ("field", "value"), [("fraction", -0.1), ("fraction", 0.5), ("min_margin", -1.0), ("max_keys", 0)]
)
def test_bad_settings_are_refused_by_name(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"{field}={value}"):
        GroupCadence(**{field: value})  # type: ignore[arg-type]
