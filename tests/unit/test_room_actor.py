"""A prefill room actor driven alone through its ports: an in-memory outbox, a worker mailbox the
test reads, no sockets, no NIXL. Shows what the room decides and posts, message by message."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter

import anyio
import numpy as np
import pytest
import torch

from transfer_engine.actors.room import ReceiverRoomActor, SenderRoomActor
from transfer_engine.errors import FailureReason
from transfer_engine.memory.layout import KVLayout, KVPool
from transfer_engine.protocol import heads
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.rooms import Deadlines, RoomStatus
from transfer_engine.runtime.mail import (
    CancelRoom,
    Drained,
    LocalAbort,
    Mailbox,
    QueueChunk,
    RequestPages,
    WriteDone,
    WriteJob,
)
from transfer_engine.runtime.peers import Peer
from transfer_engine.runtime.ports import (
    JOBS_PER_ROOM,
    PeerBook,
    RankIdentity,
    RoomBoard,
    RoomPorts,
    WorkerShards,
)

pytestmark = [pytest.mark.timeout(20), pytest.mark.anyio]


class Outbox:
    """Keeps what the room sends."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, m.Message]] = []

    def send(self, endpoint: str, message: m.Message) -> bool:
        self.sent.append((endpoint, message))
        return True

    def count_drop(self, kind: str, ident: bytes, detail: str) -> None:
        raise AssertionError(f"unexpected drop of {kind}: {detail}")


class NoDrain:
    def request_drain(self, room: int) -> None:
        raise AssertionError("no deadline should expire in this test")

    def listen(self) -> None:
        raise AssertionError("no room here takes the kernel path")


def _ports() -> tuple[RoomPorts, Outbox, Mailbox[object], Peer]:
    layout = KVLayout(num_layers=1, num_heads=2, head_dim=8, dtype=torch.float16, page_size=4)
    pool = KVPool.allocate(layout, 1, 0, 64)
    peer = Peer("decode-0", "tcp://decode:1", 0, 1, pool.info())
    peers = PeerBook({peer.agent_name: peer})
    outbox = Outbox()
    worker: Mailbox[object] = Mailbox(4, reserve=JOBS_PER_ROOM + 1)
    ports = RoomPorts(
        RankIdentity("prefill-0", "prefill", 0, 1), pool, outbox, peers, RoomBoard(), NoDrain(), Counter(),
        workers=WorkerShards([worker]),
    )  # fmt: skip
    return ports, outbox, worker, peer


def _request(room: int) -> m.TransferRequest:
    return m.TransferRequest(
        room=room, agent="decode-0", decode_rank=0, decode_tp=1, path="direct", dst_pages=list(range(64)),
        aux_slot=None, slices=[m.SliceSpec(0, 0, 0, 2)],
    )  # fmt: skip


def _jobs(box: Mailbox[object]) -> list[WriteJob]:
    out: list[WriteJob] = []
    while True:
        try:
            mail = box.receive_nowait()
        except anyio.WouldBlock:
            return out
        assert isinstance(mail, WriteJob)
        out.append(mail)


async def test_jobs_beyond_the_bound_wait_in_the_room_then_abort_waits_for_every_job() -> None:
    ports, outbox, worker, peer = _ports()
    room = SenderRoomActor(ports, 5, Deadlines(5.0, None, 5.0))
    ports.rooms.open(5, room.inbox)
    chunks = JOBS_PER_ROOM + 8
    async with anyio.create_task_group() as tg:
        tg.start_soon(room.run)
        await room.inbox.send(_request(5))
        for i in range(chunks):
            await room.inbox.send(
                QueueChunk(np.array([i], dtype=np.int64), last=i == chunks - 1, aux_slot=None)
            )
        await anyio.wait_all_tasks_blocked()
        first = _jobs(worker)
        assert [j.chunk_id for j in first] == list(range(JOBS_PER_ROOM))  # the rest wait in the room
        assert room.core.in_flight == JOBS_PER_ROOM and len(room.backlog) == 8

        await room.inbox.send(WriteDone(0, 0, True, ""))
        await anyio.wait_all_tasks_blocked()
        assert [j.chunk_id for j in _jobs(worker)] == [JOBS_PER_ROOM]  # one answer, one more job

        await room.inbox.send(LocalAbort("test"))
        await anyio.wait_all_tasks_blocked()
        assert room.status is RoomStatus.FAILED and not room.backlog
        assert worker.receive_nowait() == CancelRoom(5)
        failed = [msg for _, msg in outbox.sent if isinstance(msg, m.RoomFailed)]
        assert [(f.room, f.reason) for f in failed] == [(5, int(FailureReason.ABORTED))]
        assert not room.done.is_set()  # JOBS_PER_ROOM jobs are still out: not quiescent

        await room.inbox.send(m.Abort(room=5, agent=peer.agent_name, rank=0, reason=3, detail="decode too"))
        for chunk_id in range(1, JOBS_PER_ROOM + 1):
            await room.inbox.send(WriteDone(chunk_id, 0, True, ""))
        with anyio.fail_after(5):
            await room.done.wait()
    assert 5 not in ports.rooms
    acks = [(endpoint, msg) for endpoint, msg in outbox.sent if isinstance(msg, m.AbortAck)]
    assert acks == [(peer.endpoint, m.AbortAck(room=5, agent="prefill-0", rank=0))]  # only once quiescent
    assert worker.high_water <= JOBS_PER_ROOM + 1


class Drains:
    """Records the rooms that asked for a drain (their deadline passed), and when."""

    def __init__(self) -> None:
        self.asked: list[tuple[int, float]] = []
        self.event = anyio.Event()

    def request_drain(self, room: int) -> None:
        self.asked.append((room, time.monotonic()))
        self.event.set()

    def listen(self) -> None:
        raise AssertionError("no room here takes the kernel path")


async def test_a_room_asks_for_a_drain_at_its_deadline_and_fails_on_the_reply() -> None:
    """The room's one timer wakes it at its phase's deadline (not before); the Drained reply judges it."""
    ports, _, _, _ = _ports()
    drains = Drains()
    ports = dataclasses.replace(ports, drain=drains)
    room = SenderRoomActor(ports, 7, Deadlines(0.05, None, 5.0, lease=0.05))  # a prefill room: its lease
    ports.rooms.open(7, room.inbox)
    async with anyio.create_task_group() as tg:
        tg.start_soon(room.run)
        with anyio.fail_after(5):
            await drains.event.wait()
        assert [r for r, _ in drains.asked] == [7]
        assert drains.asked[0][1] >= room.core.deadline  # type: ignore[operator]
        assert room.status is RoomStatus.BOOTSTRAPPING  # judged only on the reply
        await room.inbox.send(Drained())
        with anyio.fail_after(5):
            await room.done.wait()
    assert room.status is RoomStatus.FAILED
    assert room.core.failure is not None and room.core.failure.reason is FailureReason.BOOTSTRAP_TIMEOUT


async def test_a_leased_room_judged_right_after_its_loop_stalled_renews_itself_first() -> None:
    """The drain reply can come before the liveness task wakes from a stall of the loop (the stall
    inside the poller's own call): the room renews its lease as the liveness task will
    (``stall_renewal``) instead of failing for heartbeats queued unread; once the loop runs on time
    again, the same deadline fails it."""
    ports, _, _, _ = _ports()
    drains = Drains()
    stalled: list[float | None] = [None]
    ports = dataclasses.replace(ports, drain=drains, stall_renewal=lambda now: stalled[0])
    room = SenderRoomActor(ports, 8, Deadlines(5.0, None, 5.0, lease=0.05))
    ports.rooms.open(8, room.inbox)
    room.core.hold(time.monotonic())  # a decode announced it: the room is leased
    async with anyio.create_task_group() as tg:
        tg.start_soon(room.run)
        with anyio.fail_after(5):
            await drains.event.wait()
        stalled[0] = time.monotonic()  # the loop was held until now: renewed from now
        await room.inbox.send(Drained())
        await anyio.wait_all_tasks_blocked()
        assert room.status is RoomStatus.BOOTSTRAPPING
        assert room.core.held_at == stalled[0]
        drains.event = anyio.Event()
        stalled[0] = None  # on time again: the renewed lease runs out, and fails the room
        with anyio.fail_after(5):
            await drains.event.wait()
        await room.inbox.send(Drained())
        with anyio.fail_after(5):
            await room.done.wait()
    assert room.core.failure is not None and room.core.failure.reason is FailureReason.BOOTSTRAP_TIMEOUT


async def test_mailbox_next_gives_queued_mail_before_a_nudge_and_the_nudge_once() -> None:
    box: Mailbox[int] = Mailbox(4)
    box.post(1)
    box.nudge()
    box.post(2)
    assert [await box.next(), await box.next(), await box.next()] == [1, 2, None]
    got: list[int | None] = []
    async with anyio.create_task_group() as tg:

        async def reader() -> None:
            got.append(await box.next())

        tg.start_soon(reader)
        await anyio.wait_all_tasks_blocked()
        assert got == []  # the nudge was used: it waits
        box.nudge()
    assert got == [None]


def _decode_room(request: RequestPages | None) -> tuple[ReceiverRoomActor, Outbox, list[Peer]]:
    """A decode room of rank 0 (TP 1) over a prefill instance of TP 2: both prefill ranks write here."""
    layout = KVLayout(num_layers=1, num_heads=2, head_dim=8, dtype=torch.float16, page_size=4)
    pool = KVPool.allocate(layout, 1, 0, 64)
    prefill = [Peer(f"prefill-{r}", f"tcp://prefill:{r}", r, 2, pool.info()) for r in range(2)]
    outbox = Outbox()
    ports = RoomPorts(
        RankIdentity("decode-0", "decode", 0, 1), pool, outbox, PeerBook({p.agent_name: p for p in prefill}),
        RoomBoard(), NoDrain(), Counter(),
    )  # fmt: skip
    writers = heads.writers_of(layout.num_heads, 2, 1, 0)
    room = ReceiverRoomActor(
        ports, 9, Deadlines(5.0, None, 5.0), {w.prefill_rank: prefill[w.prefill_rank] for w in writers},
        everyone=prefill, slices=list(writers), path="direct", request=request,
    )  # fmt: skip
    ports.rooms.open(9, room.inbox)
    return room, outbox, prefill


def _requests(outbox: Outbox) -> list[tuple[str, m.TransferRequest]]:
    return [(endpoint, msg) for endpoint, msg in outbox.sent if isinstance(msg, m.TransferRequest)]


@pytest.mark.parametrize("at_creation", [False, True])
async def test_a_decode_room_sends_its_requests_once_it_has_its_pages(at_creation: bool) -> None:
    """Pages given by mail, or when the room is made (then sent once it runs): one TransferRequest
    per prefill rank, the aux slot to the first writer only; pages given again are ignored."""
    pages = RequestPages(np.array([3, 1, 2], dtype=np.int64), aux_slot=5, decode_prefix_len=8)
    room, outbox, prefill = _decode_room(pages if at_creation else None)
    assert room.status is RoomStatus.WAITING_FOR_INPUT and room.requested is at_creation
    async with anyio.create_task_group() as tg:
        tg.start_soon(room.run)
        await anyio.wait_all_tasks_blocked()
        if not at_creation:
            assert _requests(outbox) == []
            await room.inbox.send(pages)
            await anyio.wait_all_tasks_blocked()
        sent = _requests(outbox)
        assert [endpoint for endpoint, _ in sent] == [p.endpoint for p in prefill]
        for (_, req), writer in zip(sent, room.slices, strict=True):
            assert (req.room, req.agent, req.decode_rank, req.decode_tp, req.path) == (
                9,
                "decode-0",
                0,
                1,
                "direct",
            )
            assert req.pages.tolist() == [3, 1, 2] and req.decode_prefix_len == 8
            spec = (writer.prefill_rank, writer.src_head_start, writer.dst_head_start, writer.num_heads)
            assert req.slices == [m.SliceSpec(*spec)]
        assert [req.aux_slot for _, req in sent] == [5, None]
        assert room.core.wants_aux_from == room.slices[0].prefill_rank
        await room.inbox.send(RequestPages(np.array([4], dtype=np.int64), None, 0))
        await anyio.wait_all_tasks_blocked()
        assert len(_requests(outbox)) == 2 and room.pages.tolist() == [3, 1, 2]
        tg.cancel_scope.cancel()
