"""Faults injected around the real transport and into the control sockets.

WRITEs fail or finish late, notifications come late, in bursts, out of order or twice, control
messages are delayed, reordered or lost. Every room ends (Success, or Failed on both sides with a
reason), surviving engines keep serving, and nothing leaks.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections import Counter

import anyio
import numpy as np
import pytest

from tests.integration.harness import Cluster, run_room, shuffled_pages
from transfer_engine.engine import Receiver, Sender
from transfer_engine.errors import FailureReason, LocalProtocolError, TransferAborted, TransferFailed
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.rooms import RoomStatus
from transfer_engine.testing import patterns
from transfer_engine.transport.faults import (
    ControlFaults,
    DeliveryQueue,
    Fault,
    FaultyTransport,
    Rule,
    matching,
)

from .helpers import engines, faulty_factory

pytestmark = pytest.mark.timeout(60)


async def run_rooms(
    c: Cluster, rooms: list[int], chunks: list[int], seed: int, *, aux: bool = True, layers: int = 0
) -> None:
    """Transfer ``rooms`` concurrently (disjoint pages), each verified like ``run_room`` (``layers``:
    layer-wise, that many layers a call)."""
    rng = random.Random(seed)
    n = sum(chunks)
    src, dst = rng.sample(range(64), n * len(rooms)), rng.sample(range(64), n * len(rooms))

    async def one(i: int, room: int) -> None:
        prefill_pages, decode_pages = np.array(src[i * n : (i + 1) * n]), np.array(dst[i * n : (i + 1) * n])
        await run_room(
            c, room, prefill_pages, decode_pages, chunks, aux_slot=i if aux else None, layers=layers
        )

    async with anyio.create_task_group() as tg:
        for i, room in enumerate(rooms):
            tg.start_soon(one, i, room)


async def open_room(
    c: Cluster, room: int, chunks: list[int], seed: int, layerwise: bool = False
) -> tuple[list[Sender], Receiver]:
    """Start a room on every prefill rank and the (one) decode rank, every chunk sent (``layerwise``:
    layer by layer, ``begin_chunk`` then ``layers_ready`` per layer)."""
    rng = random.Random(seed)
    src, dst = shuffled_pages(rng, 64, sum(chunks)), shuffled_pages(rng, 64, sum(chunks))
    for engine in c.prefill:
        patterns.fill(engine.pool, room, src)
    receiver = await c.decode[0].receiver(room, c.bootstrap, dst)
    senders = [engine.sender(room) for engine in c.prefill]
    layers = c.prefill[0].pool.layout.num_layers
    for sender in senders:
        start = 0
        for i, k in enumerate(chunks):
            pages, last = src[start : start + k], i == len(chunks) - 1
            start += k
            if not layerwise:
                await sender.send(pages, last=last)
                continue
            await sender.begin_chunk(pages, last=last)
            for layer in range(layers):
                with contextlib.suppress(LocalProtocolError):  # the room failed meanwhile
                    await sender.layers_ready(layer, layer + 1)
    return senders, receiver


async def failure_of(handle: Sender | Receiver) -> TransferFailed:
    with anyio.fail_after(10), pytest.raises(TransferFailed) as info:
        await handle.wait()
    return info.value


async def outcome(handle: Sender | Receiver) -> str:
    """``SUCCESS`` or the failure reason's name, once the room ended."""
    try:
        with anyio.fail_after(10):
            await handle.wait()
    except TransferFailed as exc:
        return exc.reason.name
    return "SUCCESS"


@pytest.mark.anyio
@pytest.mark.parametrize(
    "layerwise", [False, True, "host-cut", "staged-cut"], ids=["chunks", "layers", "host-cut", "staged-cut"]
)
@pytest.mark.parametrize(("P", "D"), [(1, 1), (2, 1)], ids=["direct", "staged"])
@pytest.mark.parametrize(
    ("fault", "detail"), [(Fault.ERROR, "ended in error"), (Fault.FAIL_POST, "injected fault")]
)
async def test_one_failed_write_fails_the_room_on_both_sides(
    fault: Fault, detail: str, P: int, D: int, layerwise: bool | str
) -> None:
    """The prefill rank whose WRITE failed: TRANSPORT; the decode: REMOTE; the other writers stop.
    ``layers``: the room goes layer-wise (one WRITE per layer), and the failed one is a layer's.
    ``host-cut``: whole chunks on the host path, which the prefill room cuts into one-layer groups
    itself (``host_pipeline_layers``): the failed WRITE is one group's. ``staged-cut``: the same on
    the staged path (``staged_pipeline_layers``)."""
    wrapped: list[FaultyTransport] = []
    landed = matching(m.ChunkLanded, room=51)
    groups: list[tuple[int, int] | None] = []  # the layers of every WRITE of the room the rule saw

    def match(payload: bytes) -> bool:
        if not landed(payload):
            return False
        notif = m.decode(payload)
        assert isinstance(notif, m.ChunkLanded)
        groups.append(notif.layers)
        return True

    rule = Rule(fault, match=match, skip=1)  # the room's second WRITE
    transport = faulty_factory(wrapped, writes=[rule])
    cut = {
        "host-cut": {"path": "host", "host_pipeline_layers": 1, "pipeline_min_bytes": 0},
        "staged-cut": {"path": "staged", "staged_pipeline_layers": 1, "pipeline_min_bytes": 0},
    }.get(str(layerwise), {})
    layerwise = layerwise is True
    async with engines(P, D, prefill_transport=transport, layers_per_write=1, **cut) as c:
        senders, receiver = await open_room(c, 51, [2, 2, 2], seed=51, layerwise=layerwise)
        received = await failure_of(receiver)
        outcomes = [await outcome(sender) for sender in senders]
        assert received.reason is FailureReason.REMOTE and "TRANSPORT" in received.detail
        assert outcomes.count("TRANSPORT") == 1 and set(outcomes) <= {"TRANSPORT", "ABORTED", "SUCCESS"}
        failed = senders[outcomes.index("TRANSPORT")]
        assert failed.failure is not None and detail in failed.failure[1]
        assert rule.fired == 1 and sum((t.fired for t in wrapped), Counter()) == {fault.value: 1}
        assert sum(e.counters["failed_transport"] for e in c.prefill) == 1
        assert c.decode[0].counters["failed_remote"] == 1
        # layer-wise, or cut by the room: every WRITE was one layer's; else each a whole chunk's
        assert groups and all((g is not None) == (layerwise or bool(cut)) for g in groups), groups
        await run_rooms(c, [52], [3, 3], seed=52)
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_late_write_completion_only_delays_the_sender() -> None:
    rule = Rule(Fault.DELAY, match=matching(room=53), times=None, delay_s=0.3)
    async with engines(1, 1, prefill_transport=faulty_factory([], writes=[rule])) as c:
        (sender,), receiver = await open_room(c, 53, [1, 2], seed=53)
        started = time.monotonic()
        with anyio.fail_after(10):
            await receiver.wait()
            landed = time.monotonic()
            await sender.wait()
        assert landed - started < 0.3 <= time.monotonic() - started + 0.05
        assert rule.fired == 2
        c.assert_no_leaks()


@pytest.mark.anyio
@pytest.mark.parametrize(("P", "D"), [(1, 1), (2, 1)], ids=["direct", "staged"])
async def test_late_bursty_and_reordered_notifications_still_complete(P: int, D: int) -> None:
    wrapped: list[FaultyTransport] = []
    notifs = [
        Rule(Fault.STALL, skip=3, delay_s=0.2),
        Rule(Fault.REORDER, probability=0.4, times=None, delay_s=0.2),
        Rule(Fault.DELAY, probability=0.4, times=None, delay_s=0.05),
    ]
    transport = faulty_factory(wrapped, notifs=notifs, seed=7)
    async with engines(P, D, decode_transport=transport, layers_per_write=1) as c:
        await run_rooms(c, [61, 62, 63, 64], [1, 2, 1, 3], seed=6)
        await run_rooms(c, [65, 66], [4, 4], seed=7, aux=False)
        await run_rooms(c, [67, 68, 69], [2, 1, 3], seed=8, layers=1)  # one WRITE per layer
        assert all(rule.fired > 0 for rule in notifs), [(r.fault, r.fired) for r in notifs]
        assert wrapped[0].held() == 0
        assert c.decode[0].poller.counters["notifs_unrouted"] == 0
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_duplicate_notification_after_the_room_ended_is_ignored() -> None:
    rule = Rule(Fault.DUPLICATE, match=matching(m.AuxLanded, room=71))
    async with engines(1, 1, decode_transport=faulty_factory([], notifs=[rule])) as c:
        await run_room(c, 71, np.arange(4), np.arange(4), [2, 2], aux_slot=3)
        await run_room(c, 72, np.arange(4), np.arange(4), [4], aux_slot=3)
        assert rule.fired == 1
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_duplicate_notification_of_a_live_room_is_dropped() -> None:
    rule = Rule(Fault.DUPLICATE, match=matching(m.ChunkLanded, room=73))
    async with engines(1, 1, decode_transport=faulty_factory([], notifs=[rule])) as c:
        try:
            await run_room(c, 73, np.arange(6), np.arange(6), [2, 2, 2])
        finally:
            assert rule.fired == 1
            c.assert_no_leaks()


@pytest.mark.anyio
async def test_delayed_and_reordered_control_messages_still_complete() -> None:
    """Requests, aborts, acks and heartbeats (every 0.25 s, lease 0.5 s) held up to 0.1 s: no effect.

    A TransferRequest overtaken by the Abort of its room reaches a prefill whose room already ended;
    it waits in the early-request stash until ``bootstrap_timeout`` like any request for a room not
    opened yet, then expires.
    """
    async with engines(1, 1, heartbeat_interval=0.25, bootstrap_timeout=1.0) as c:
        for seed, engine in enumerate(c.prefill + c.decode):
            engine.control.faults = ControlFaults(
                [
                    Rule(Fault.REORDER, probability=0.3, times=None, delay_s=0.1),
                    Rule(Fault.DELAY, probability=0.5, times=None, delay_s=0.05),
                ],
                seed=seed,
            )
        await run_rooms(c, [81, 82, 83, 84, 85], [2, 1, 1], seed=8)
        (sender,), receiver = await open_room(c, 86, [2], seed=86)
        await receiver.abort()
        await anyio.sleep(0.6)  # heartbeats go through the faults too
        await run_rooms(c, [87, 88], [2, 2], seed=9)
        fired = [engine.control.faults.fired for engine in c.prefill + c.decode]  # type: ignore[union-attr]
        assert fired[0].total() > 0 and fired[1]["delay"] > 0 and fired[1]["reorder"] > 0, fired
        for engine in c.prefill + c.decode:
            engine.control.faults = None
        assert not c.prefill[0].counters["peers_dead"] and not c.decode[0].counters["peers_dead"]
        with contextlib.suppress(TransferAborted):  # its WRITE may have finished before the abort came
            await sender.wait()
        with anyio.fail_after(3):
            while c.prefill[0].leaks()["stashed"]:  # noqa: ASYNC110 (expiry is a heartbeat-loop chore)
                await anyio.sleep(0.05)
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_a_request_that_arrives_after_its_room_failed_is_told_the_failure() -> None:
    """Decode TP 2: rank 1's TransferRequest is held until after the prefill room failed (its writer
    aborted it once rank 0 asked). The late request is for the failed room, not a new room under the
    same id: rank 1 is told the failure at once, not left waiting for input until its deadline."""
    room = 63
    async with engines(1, 2, bootstrap_timeout=30.0) as c:
        c.decode[1].control.faults = ControlFaults(
            [Rule(Fault.DELAY, match=matching(m.TransferRequest, room=room), times=None, delay_s=1.0)], seed=0
        )
        pages = np.arange(4)
        for engine in c.prefill:
            patterns.fill(engine.pool, room, pages)
        receivers = [await engine.receiver(room, c.bootstrap, pages) for engine in c.decode]
        sender = c.prefill[0].sender(room)
        with anyio.fail_after(5):
            while not c.prefill[0].rooms.get(room) or 0 not in c.prefill[0].rooms[room].requests:  # noqa: ASYNC110
                await anyio.sleep(0.02)
        assert 1 not in c.prefill[0].rooms[room].requests  # rank 1's request is still held
        await sender.abort()
        with pytest.raises(TransferAborted):
            await sender.wait()
        failures = [await failure_of(receiver) for receiver in receivers]  # within 10 s, not 30
        assert [f.reason for f in failures] == [FailureReason.ABORTED] * 2, failures
        assert c.decode[1].control.faults.fired["delay"] >= 1  # type: ignore[union-attr]
        c.decode[1].control.faults = None
        assert not c.prefill[0].leaks()["stashed"]
        await run_rooms(c, [64], [2, 2], seed=64, aux=False)
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_abort_during_delayed_notifications_waits_for_the_writes() -> None:
    """An abort while notifications are held: the room ends only once no WRITE can land, then the id is free."""
    rule = Rule(Fault.DELAY, match=matching(m.ChunkLanded, room=91), times=None, delay_s=0.3)
    wrapped: list[FaultyTransport] = []
    async with engines(1, 1, decode_transport=faulty_factory(wrapped, notifs=[rule])) as c:
        (sender,), receiver = await open_room(c, 91, [1, 1], seed=91)
        await anyio.sleep(0.05)
        with anyio.fail_after(10):
            await receiver.abort()
        assert receiver.poll() is RoomStatus.FAILED
        with anyio.fail_after(10):
            await sender.wait()  # its WRITEs were done before the abort came
        await anyio.sleep(0.4)  # the held notifications of the ended room arrive now
        assert wrapped[0].held() == 0
        assert c.decode[0].poller.counters["notifs_unrouted"] == 2
        await run_room(c, 92, np.arange(4), np.arange(4), [4])
        c.assert_no_leaks()


# --- the fault rules themselves (sans-IO, no engine) -------------------------------------------------


def test_delivery_queue_semantics() -> None:
    q = DeliveryQueue()
    drop, dup = Rule(Fault.DROP), Rule(Fault.DUPLICATE)
    delay, reorder, stall = (
        Rule(Fault.DELAY, delay_s=1.0),
        Rule(Fault.REORDER, delay_s=5.0),
        Rule(Fault.STALL, delay_s=2.0),
    )
    assert q.put("a", b"1", None, 0.0) == [("a", b"1")]
    assert q.put("a", b"2", drop, 0.0) == []
    assert q.put("a", b"3", dup, 0.0) == [("a", b"3"), ("a", b"3")]
    assert q.put("a", b"4", delay, 0.0) == [] and q.next_due() == 1.0
    assert q.put("a", b"5", reorder, 0.0) == [] and len(q) == 2
    assert q.put("b", b"6", None, 0.1) == [("b", b"6")]  # another key does not release a's held one
    assert q.put("a", b"7", None, 0.2) == [("a", b"7"), ("a", b"5")]  # 7 overtook 5
    assert q.due(0.9) == [] and q.due(1.0) == [("a", b"4")] and len(q) == 0
    assert q.due(6.0) == []  # the released REORDER entry is not delivered twice
    assert q.put("a", b"8", stall, 10.0) == [] and q.put("b", b"9", None, 11.0) == []
    assert q.put("a", b"10", delay, 11.5) == []
    assert q.due(11.9) == [] and q.due(12.0) == [("a", b"8"), ("b", b"9")]
    assert q.due(12.5) == [("a", b"10")] and q.next_due() is None
    assert q.put("a", b"11", reorder, 20.0) == [] and q.due(25.0) == [("a", b"11")]  # nobody overtook


def test_rules_are_seeded_and_counted() -> None:
    def run(seed: int) -> list[bool]:
        rng = random.Random(seed)
        rule = Rule(Fault.DROP, probability=0.5, skip=2, times=10)
        out = [rule.fires(b"x", rng) for _ in range(40)]
        assert rule.seen == 40 and rule.fired == sum(out) <= 10 and not any(out[:2])
        return out

    assert run(1) == run(1) and run(1) != run(2)
    only = Rule(Fault.DROP, match=matching(m.Heartbeat), times=None)
    beat = m.encode(m.Heartbeat(agent="a", rank=0, side="decode", seq=1))
    assert only.fires(beat, random.Random(0)) and not only.fires(b"\xc1", random.Random(0))
    assert not only.fires(m.encode(m.TopologyQuery()), random.Random(0)) and only.seen == 1
    with pytest.raises(ValueError, match="STALL does not apply to WRITEs"):
        FaultyTransport(object(), writes=[Rule(Fault.STALL)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="FAIL_POST does not apply to control messages"):
        ControlFaults([Rule(Fault.FAIL_POST)])
    with pytest.raises(ValueError, match="probability"):
        Rule(Fault.DROP, probability=2)
