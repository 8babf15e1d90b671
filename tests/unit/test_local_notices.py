"""The landing-notice datagram socket alone (transport/local.py): names, the three answers of a send,
and what is remembered of a peer that is not on this host."""

from __future__ import annotations

import os

import anyio
import pytest

from transfer_engine.transport import local

pytestmark = pytest.mark.skipif(not local.supported(), reason="abstract Unix socket names are Linux's")


def endpoint(tag: str) -> str:
    return f"tcp://127.0.0.1:{os.getpid()}-{tag}"


def test_names_follow_the_endpoint_and_fit_a_socket_address() -> None:
    a, b = local.name_of("tcp://10.0.0.1:5000"), local.name_of("tcp://10.0.0.1:5001")
    assert a != b and a == local.name_of("tcp://10.0.0.1:5000")
    assert a.startswith(b"\0") and len(a) < 108  # sun_path's size
    assert len(local.name_of("tcp://" + "h" * 500 + ":1")) == len(a)


@pytest.mark.anyio
async def test_a_datagram_reaches_the_bound_rank_whole() -> None:
    here, there = endpoint("recv"), endpoint("send")
    receiver, sender = local.LocalNotices(here, bind=True), local.LocalNotices(there, bind=False)
    try:
        assert receiver.bound and not sender.bound
        assert receiver.receive() is None
        assert sender.send(here, b"notice one") is True
        with anyio.fail_after(2):
            await receiver.readable()
        assert receiver.receive() == b"notice one"
        assert receiver.receive() is None
    finally:
        receiver.close()
        sender.close()


def test_a_name_nobody_bound_is_not_on_this_host_and_is_remembered_until_forgotten() -> None:
    sender = local.LocalNotices(endpoint("lonely"), bind=False)
    gone = endpoint("elsewhere")
    try:
        assert sender.send(gone, b"x") is None
        assert gone in sender._not_here  # not tried again per message
        receiver = local.LocalNotices(gone, bind=True)  # a restarted peer, now on this host
        try:
            assert sender.send(gone, b"x") is None  # still remembered as elsewhere
            sender.forget(gone)
            assert sender.send(gone, b"x") is True
        finally:
            receiver.close()
    finally:
        sender.close()


def test_a_full_queue_says_false_without_blocking_and_a_taken_name_is_not_bound() -> None:
    here = endpoint("busy")
    receiver = local.LocalNotices(here, bind=True)
    sender = local.LocalNotices(endpoint("burst"), bind=False)
    second = local.LocalNotices(here, bind=True)  # the name is taken: this one receives nothing
    try:
        assert not second.bound
        answers = []
        while len(answers) < 100_000 and False not in answers[-1:]:
            answers.append(sender.send(here, b"n" * 100))
        assert answers[0] is True and answers[-1] is False  # the receiver never read: its queue filled
        taken = len(answers) - 1
        assert all(answers[:taken])
        while receiver.receive() is not None:
            taken -= 1
        assert taken == 0  # every datagram that was taken is read, whole
    finally:
        receiver.close()
        sender.close()
        second.close()
