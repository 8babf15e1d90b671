"""The poller's sleep between looks (``nixl_poller.poll_delay``): a pure table."""

from __future__ import annotations

import pytest

from transfer_engine.actors.nixl_poller import (
    BACKOFF_POLLS,
    IDLE_FACTOR,
    IDLE_LOOK_S,
    QUICK_DIVISOR,
    poll_delay,
)

IV = 0.0002  # poll_interval
R = 0.001  # poll_relaxed


def delay(**kw: object) -> tuple[float, bool]:
    args: dict[str, object] = {
        "posted": 0,
        "urgent": 0,
        "busy": False,
        "quick": False,
        "idle": 0,
        "relaxed": R,
    }
    return poll_delay(IV, **(args | kw))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("case", "kw", "want"),
    [
        ("nothing can come", {}, (IDLE_LOOK_S, False)),
        ("nothing can come, even in a quick window", {"quick": True}, (IDLE_LOOK_S, False)),
        (
            "nothing can come, a peer added lately (its link probe)",
            {"idle_look": IV * IDLE_FACTOR},
            (IV * IDLE_FACTOR, False),
        ),
        (
            "an urgent WRITE, quick window",
            {"posted": 1, "urgent": 1, "quick": True},
            (IV / QUICK_DIVISOR, False),
        ),
        ("an urgent WRITE, backing off", {"posted": 1, "urgent": 1}, (IV, True)),
        ("an urgent WRITE, backed off", {"posted": 1, "urgent": 1, "idle": BACKOFF_POLLS}, (IV * 2.5, True)),
        ("only relaxed WRITEs", {"posted": 3}, (R, False)),
        ("only relaxed WRITEs, long backed off", {"posted": 3, "idle": 99}, (R, False)),
        (
            "relaxed WRITEs in a quick window (a room started)",
            {"posted": 3, "quick": True},
            (IV / QUICK_DIVISOR, False),
        ),
        ("relaxed and urgent WRITEs", {"posted": 3, "urgent": 1}, (IV, True)),
        ("relaxed WRITEs on a busy rank", {"posted": 3, "busy": True}, (IV, True)),
        ("a relaxed period below poll_interval", {"posted": 3, "relaxed": IV / 10}, (IV, False)),
        ("a decode rank waiting, nothing posted", {"busy": True, "quick": True}, (IV / QUICK_DIVISOR, False)),
        ("only kernel-path rooms live (their news comes over control)", {"listening": True}, (R, False)),
        (
            "only kernel-path rooms live, in a quick window: not quick",
            {"listening": True, "quick": True},
            (R, False),
        ),
        ("a kernel-path room beside one that hears over NIXL", {"listening": True, "busy": True}, (IV, True)),
    ],
)
def test_poll_delay(case: str, kw: dict[str, object], want: tuple[float, bool]) -> None:
    assert delay(**kw) == pytest.approx(want), case


def test_relaxed_looks_are_sparser_than_every_other_cadence_with_a_write_out() -> None:
    """While only relaxed WRITEs are out the poller looks less often than at any other time a WRITE
    is out (the point of relaxing them), and no less often than ``poll_relaxed`` asks."""
    out = [delay(posted=1, urgent=1, idle=i)[0] for i in range(2 * BACKOFF_POLLS)]
    out.append(delay(posted=1, urgent=1, quick=True)[0])
    assert delay(posted=2)[0] == R > max(out)


def test_an_idle_poller_looks_far_less_often_than_a_waiting_one() -> None:
    """Nothing can come: the look is hundreds of times sparser than any cadence with a WRITE out or
    a room waiting (a rank with no work costs a few looks a second)."""
    waiting = [delay(busy=True, idle=i)[0] for i in range(2 * BACKOFF_POLLS)]
    waiting += [delay(posted=1, urgent=1, idle=i)[0] for i in range(2 * BACKOFF_POLLS)]
    waiting.append(delay(posted=1)[0])
    assert delay()[0] >= 100 * max(waiting)
