"""The pieces the layering introduced, tested without sockets: the mailbox, the room core's
lifecycle decisions, the early-request stash, leases and the handshake's refusal."""

from __future__ import annotations

import anyio
import pytest
import torch

from transfer_engine.errors import FailureReason, LocalProtocolError
from transfer_engine.memory.layout import KVLayout, KVPool
from transfer_engine.protocol import handshake, leases
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.layers import LayerTally
from transfer_engine.protocol.receiver_room import ReceiverRoom
from transfer_engine.protocol.rooms import (
    Deadlines,
    RoomStatus,
    SenderRoom,
    abort_reason,
    remote_failure_reason,
)
from transfer_engine.protocol.stash import EarlyRequests
from transfer_engine.runtime.mail import Mailbox, MailboxOverflow

pytestmark = pytest.mark.timeout(10)

DEADLINES = Deadlines(5.0, None, 5.0)


# --- mailbox --------------------------------------------------------------------------------------


def test_post_uses_the_reserve_then_overflows() -> None:
    box: Mailbox[int] = Mailbox(2, reserve=1)
    box.send_nowait(1)
    box.send_nowait(2)
    with pytest.raises(anyio.WouldBlock):
        box.send_nowait(3)
    box.post(3)  # into the reserve
    with pytest.raises(MailboxOverflow, match="capacity 2 \\+ reserve 1"):
        box.post(4)
    assert [box.receive_nowait() for _ in range(3)] == [1, 2, 3]
    assert box.high_water == 3


@pytest.mark.anyio
async def test_send_waits_while_full_and_resumes_when_read() -> None:
    box: Mailbox[int] = Mailbox(1)
    await box.send(1)
    sent = anyio.Event()

    async def second() -> None:
        await box.send(2)
        sent.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(second)
        await anyio.wait_all_tasks_blocked()
        assert not sent.is_set()  # full: the sender waits
        assert await box.receive() == 1
        await sent.wait()
    assert box.receive_nowait() == 2


@pytest.mark.anyio
async def test_close_keeps_queued_mail_then_ends() -> None:
    box: Mailbox[str] = Mailbox(4)
    box.send_nowait("a")
    box.close()
    with pytest.raises(anyio.ClosedResourceError):
        box.send_nowait("b")
    with pytest.raises(anyio.ClosedResourceError):
        box.post("b")
    assert [mail async for mail in box] == ["a"]
    with pytest.raises(anyio.EndOfStream):
        await box.receive()


def test_mailbox_refuses_a_bad_size() -> None:
    with pytest.raises(ValueError, match="capacity=0"):
        Mailbox(0)


# --- room core lifecycle --------------------------------------------------------------------------


def test_sender_is_quiescent_only_with_no_job_out() -> None:
    room = SenderRoom(1, DEADLINES, 0.0)
    assert room.quiescent
    room.job_started()
    room.job_started()
    room.fail(FailureReason.ABORTED, "x", 1.0)
    assert room.status.final and not room.quiescent
    room.job_ended()
    room.job_ended()
    assert room.quiescent
    with pytest.raises(LocalProtocolError, match="none was in flight"):
        room.job_ended()


def test_receiver_quiescence_table() -> None:
    room = ReceiverRoom(2, DEADLINES, 0.0)
    room.bootstrapped([0, 1], None, 0.0)
    room.scatter_started()
    room.fail(FailureReason.TRANSFER_TIMEOUT, "late", 1.0)
    assert not room.quiescent  # a scatter is running and no abort went out
    assert room.start_abort([0, 1])
    assert not room.start_abort([0, 1])  # once
    room.scatter_ended(0, ok=False, now=1.0)
    assert not room.quiescent  # two writers owe an AbortAck
    room.on_abort_ack(0)
    room.on_writer_dead(1)
    assert room.quiescent
    with pytest.raises(LocalProtocolError, match="none was running"):
        room.scatter_ended(0, ok=True, now=2.0)


def test_heard_from_a_writer_once_anything_of_it_landed() -> None:
    room = ReceiverRoom(4, DEADLINES, 0.0)
    room.bootstrapped([0, 1], 1, 0.0)
    assert not room.heard_from(0) and not room.heard_from(1)
    room.on_chunk(0, 0, False, 0.1)
    room.on_aux(1, 0.1)
    assert room.heard_from(0) and room.heard_from(1)
    assert not room.heard_from(2)  # not a writer of this room


def test_a_successful_receiver_is_quiescent_once_scatters_end() -> None:
    room = ReceiverRoom(3, DEADLINES, 0.0)
    room.staged = True
    room.bootstrapped([0], None, 0.0)
    assert room.on_chunk(0, 0, True, 0.1)
    room.scatter_started()
    room.scatter_ended(0, ok=True, now=0.2)
    assert room.status is RoomStatus.SUCCESS and room.quiescent


def test_a_layer_group_scatter_does_not_count_the_chunk() -> None:
    """Layer-wise staged chunks are scattered a group at a time; only the copy that freed the region
    (the chunk's last) counts the chunk as in the pages."""
    room = ReceiverRoom(5, DEADLINES, 0.0)
    room.staged = True
    room.layer_tally = LayerTally(2)
    room.bootstrapped([0], None, 0.0)
    assert not room.on_layers(0, 0, (0, 1), 0.1)
    room.scatter_started()
    assert room.on_layers(0, 0, (1, 2), 0.2) and room.on_chunk(0, 0, True, 0.2)
    room.scatter_started()
    room.scatter_ended(0, ok=True, now=0.3, freed=False)
    assert room.status is RoomStatus.TRANSFERRING and not room.quiescent
    room.scatter_ended(0, ok=True, now=0.4, freed=True)
    assert room.status is RoomStatus.SUCCESS and room.quiescent


@pytest.mark.parametrize(
    ("wire", "prefill", "decode"),
    [
        (FailureReason.STAGING, FailureReason.STAGING, FailureReason.STAGING),
        (FailureReason.INTEGRITY, FailureReason.INTEGRITY, FailureReason.REMOTE),
        (FailureReason.ABORTED, FailureReason.ABORTED, FailureReason.ABORTED),
        (FailureReason.BOOTSTRAP_TIMEOUT, FailureReason.ABORTED, FailureReason.BOOTSTRAP_TIMEOUT),
        (FailureReason.TRANSPORT, FailureReason.ABORTED, FailureReason.REMOTE),
        (FailureReason.PEER_DEAD, FailureReason.ABORTED, FailureReason.REMOTE),
        (99, FailureReason.ABORTED, FailureReason.REMOTE),
    ],
)
def test_failure_reason_mapping(wire: int, prefill: FailureReason, decode: FailureReason) -> None:
    assert abort_reason(wire) is prefill
    assert remote_failure_reason(wire) is decode


# --- early requests -------------------------------------------------------------------------------


def _request(room: int, agent: str, rank: int = 0) -> m.TransferRequest:
    return m.TransferRequest(
        room=room, agent=agent, decode_rank=rank, decode_tp=2, path="direct", dst_pages=[1], aux_slot=None,
        slices=[],
    )  # fmt: skip


def test_stash_replays_in_order_and_forgets() -> None:
    stash = EarlyRequests()
    stash.add(7, _request(7, "d0"), 1.0)
    stash.add(7, _request(7, "d1", 1), 2.0)
    assert len(stash) == 2
    assert [r.agent for r in stash.take(7)] == ["d0", "d1"]
    assert len(stash) == 0 and stash.take(7) == []


def test_stash_abort_tells_the_other_askers() -> None:
    stash = EarlyRequests()
    stash.add(7, _request(7, "d0"), 1.0)
    stash.add(7, _request(7, "d1", 1), 1.0)
    abort = m.Abort(room=7, agent="d0", rank=0, reason=int(FailureReason.STAGING), detail="ring")
    answers = stash.abort(7, abort, agent="p0", rank=0)
    assert [(agent, msg.reason) for agent, msg in answers] == [("d1", FailureReason.STAGING)]
    assert len(stash) == 0


def test_stash_expiry_tells_every_asker() -> None:
    stash = EarlyRequests()
    stash.add(7, _request(7, "d0"), 1.0)
    stash.add(8, _request(8, "d0"), 5.0)
    assert stash.stale(now=4.0, lease=2.0) == [7]
    answers = stash.expire(7, agent="p0", rank=1, lease=2.0)
    assert [(agent, msg.reason) for agent, msg in answers] == [("d0", FailureReason.BOOTSTRAP_TIMEOUT)]
    assert "room_lease=2 s" in answers[0][1].detail
    assert stash.stale(now=4.0, lease=2.0) == []


# --- leases ---------------------------------------------------------------------------------------


def test_leases() -> None:
    assert leases.dead({"a": 0.0, "b": 1.5}, now=2.1, interval=1.0) == ["a"]
    assert leases.stalled(last_tick=0.0, now=0.25, tick=0.25, interval=1.0) is None
    assert leases.stalled(last_tick=0.0, now=1.0, tick=0.25, interval=1.0) == pytest.approx(0.75)
    assert leases.extended(0.0, now=5.0, interval=1.0) == 4.0
    assert leases.extended(4.5, now=5.0, interval=1.0) == 4.5


# --- handshake ------------------------------------------------------------------------------------


def _info(heads: int = 8, mla: bool = False, aux: int = 16) -> m.LayoutInfo:
    layout = KVLayout(num_layers=2, num_heads=heads, head_dim=16, dtype=torch.float16, page_size=4, mla=mla)
    return KVPool.allocate(layout, 1, 0, 4, aux_slots=2 if aux else 0, aux_item_bytes=aux).info()


def _hello(info: m.LayoutInfo, tp: int = 1) -> m.PeerHello:
    return m.PeerHello(
        rank=0, tp_size=tp, endpoint="tcp://x:1", agent_name="d", agent_metadata=b"", mem_type="DRAM",
        regions=[], aux=None, ring=None, ring_mem_type="", layout=info, compat=m.compat_hash(info),
    )  # fmt: skip


def test_handshake_refusals() -> None:
    mine = _info()
    compat = m.compat_hash(mine)
    assert handshake.refusal(_hello(mine), mine, compat, tp_size=1) is None
    assert "layout mismatch" in (handshake.refusal(_hello(_info(heads=4)), mine, compat, 1) or "")
    assert "aux item bytes differ" in (handshake.refusal(_hello(_info(aux=32)), mine, compat, 1) or "")
    assert handshake.refusal(_hello(mine, tp=3), mine, compat, tp_size=1) is not None  # 8 heads over 3
