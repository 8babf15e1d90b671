"""The lossy-network fault mode (transport.faults.Loss): what it loses, and what it records."""

from __future__ import annotations

import pytest

from transfer_engine.protocol import messages as m
from transfer_engine.transport.faults import ControlFaults, Fault, Loss


def _beat(seq: int, agent: str = "a") -> bytes:
    return m.encode(m.Heartbeat(agent=agent, rank=0, side="decode", seq=seq))


def _abort(room: int) -> bytes:
    return m.encode(m.Abort(agent="d", room=room, rank=0, reason=3, detail="x"))


def test_loses_at_its_rate_and_records_rooms_and_kinds() -> None:
    loss = Loss(0.3, seed=1)
    lost = [loss(_abort(room)) for room in range(2000)]
    assert 500 < sum(lost) < 700
    assert loss.lost == {"Abort": sum(lost)}
    assert set(loss.rooms) == {room for room, gone in enumerate(lost) if gone}
    assert all(kinds == {"Abort"} for kinds in loss.rooms.values())


def test_per_kind_rates_and_bytes_that_are_not_the_protocol() -> None:
    loss = Loss(1.0, by_kind={"Heartbeat": 0.0})
    assert not loss(_beat(1))
    assert loss(_abort(7))
    assert not loss(b"\x00not msgpack")  # never lost: not a message of the protocol
    landed = m.ChunkLanded(room=9, chunk_id=0, last=True, sender=0, page_start=0, num_pages=1, region=-1)
    assert loss(m.encode(landed))  # notifications too
    assert loss.rooms == {7: {"Abort"}, 9: {"ChunkLanded"}}


def test_lease_breaks_count_runs_of_lost_heartbeats() -> None:
    loss = Loss(1.0, lease_run=3)
    for seq in (1, 1, 2, 3, 4):  # seq 1 twice: two targets of one beat
        loss(_beat(seq))
    assert loss.lease_breaks == 1  # the run 1-2-3 (4 extends it, no second break)
    loss(_beat(6))
    loss(_beat(7))
    assert loss.lease_breaks == 1  # 5 went through: the run restarted at 6


@pytest.mark.parametrize("p", [-0.1, 1.5])
def test_refuses_bad_probabilities(p: float) -> None:
    with pytest.raises(ValueError, match="probability"):
        Loss(p)


def test_a_drop_rule_in_control_faults_sends_nothing() -> None:
    loss = Loss(1.0)
    faults = ControlFaults(loss.rules(), clock=lambda: 0.0)
    assert faults.submit("tcp://x", _abort(1)) == []
    assert faults.fired == {Fault.DROP.value: 1}
