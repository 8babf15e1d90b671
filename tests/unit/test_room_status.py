"""Room statuses print by name and compare, encode and format as SGLang's KVPoll numbers."""

from __future__ import annotations

import json

import msgspec
import pytest

from transfer_engine import RoomStatus

KVPOLL = {"FAILED": 0, "BOOTSTRAPPING": 1, "WAITING_FOR_INPUT": 2, "TRANSFERRING": 3, "SUCCESS": 4}


@pytest.mark.parametrize("status", list(RoomStatus))
def test_prints_by_name_and_stays_kvpoll(status: RoomStatus) -> None:
    number = KVPOLL[status.name]
    assert str(status) == status.name
    assert f"{status}" == status.name
    assert "%s" % status == status.name  # noqa: UP031 - what logging does with its arguments
    assert f"{status:>20}" == f"{status.name:>20}"
    assert f"{status:d}" == str(number)
    assert "%d" % status == str(number)  # noqa: UP031
    assert status == number and int(status) == number and hash(status) == hash(number)
    assert json.dumps(status) == str(number)
    assert msgspec.json.encode(status) == str(number).encode()
    assert repr(status) == f"<RoomStatus.{status.name}: {number}>"
