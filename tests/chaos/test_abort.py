"""Aborts at every point of a room, from either side, on the direct, slice and staged paths.

The points: before bootstrap (the other side has not opened the room), between two chunks, during a
WRITE (the prefill's transport reports the WRITE's completion late and the decode's notifications
come late, so the WRITE is in flight when the abort comes), and after the last chunk. After the
aborted room ended on the decode, its pages and aux slot are reused at once by another room whose
every byte must verify: nothing of the aborted room may land there any more. Nothing leaks.
Layer-wise rooms (one WRITE per layer) go through the same points; their between-chunks abort lands
between two layers of a chunk.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable

import anyio
import numpy as np
import pytest

from tests.integration.harness import Cluster, run_room
from transfer_engine.engine import Receiver, Sender
from transfer_engine.errors import FailureReason, LocalProtocolError, TransferFailed
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.rooms import RoomStatus
from transfer_engine.runtime.mail import LocalAbort
from transfer_engine.testing import patterns
from transfer_engine.transport.faults import ControlFaults, Fault, FaultyTransport, Rule, matching

from .helpers import engines, faulty_factory

pytestmark = pytest.mark.timeout(60)

POINTS = ("before_bootstrap", "between_chunks", "during_write", "after_last")
TOPOLOGY = {"direct": (2, 2), "slice": (2, 1), "staged": (1, 2)}
"""(P, D) per path: the direct path needs P == D; slice and staged go both ways between them."""
WRITE_HELD_S = 0.4
"""During-write rooms: the prefill hears of each WRITE's end this late..."""
NOTIF_HELD_S = 0.6
"""... and the decode of its landing later still, so the room is mid-transfer on both sides."""
BOOTSTRAP_S = 0.5
AUX_SLOT = 5


def room_id(path: str, side: str, point: str) -> int:
    return 1000 * (1 + list(TOPOLOGY).index(path)) + 100 * (side == "prefill") + 10 * POINTS.index(point)


async def ended(handle: Sender | Receiver) -> FailureReason | None:
    """None when the room succeeded, else its failure reason (bounded wait)."""
    try:
        with anyio.fail_after(10):
            await handle.wait()
    except TransferFailed as exc:
        return exc.reason
    return None


async def reasons(handles: list[Sender] | list[Receiver]) -> list[FailureReason | None]:
    return [await ended(handle) for handle in handles]


async def send(
    senders: list[Sender],
    src: np.ndarray,
    chunks: list[int],
    first: int,
    stop: int,
    layers: tuple[int, int] | None = None,
) -> None:
    """Send chunks ``[first, stop)`` on every sender still live (a room that failed refuses).

    ``layers=(a, b)``: layer-wise, layers ``[a, b)`` of each chunk one at a time (``begin_chunk``
    first when ``a`` is 0), so a chunk may be sent in two calls with something in between.
    """
    start = sum(chunks[:first])
    for i in range(first, stop):
        last = i == len(chunks) - 1
        pages, aux_slot = src[start : start + chunks[i]], AUX_SLOT if last else None
        for sender in senders:
            with contextlib.suppress(LocalProtocolError):
                if layers is None:
                    await sender.send(pages, last=last, aux_slot=aux_slot)
                    continue
                if layers[0] == 0:
                    await sender.begin_chunk(pages, last=last, aux_slot=aux_slot)
                for layer in range(*layers):
                    await sender.layers_ready(layer, layer + 1)
        start += chunks[i]


async def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 5
    while not condition():  # noqa: ASYNC110 (state the engine has no event for)
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within 5 s")
        await anyio.sleep(0.002)


async def aborted_room(
    c: Cluster,
    room: int,
    side: str,
    point: str,
    rng: random.Random,
    wrapped: list[FaultyTransport],
    layerwise: bool = False,
) -> np.ndarray:
    """Run ``room`` until ``side`` aborted it at ``point`` and its decode handles ended; its decode pages.

    ``wrapped``: the prefill ranks' transports, then the decode ranks'. ``layerwise``: chunks go
    layer by layer, and the between-chunks abort lands between two layers of the third chunk.
    """
    every = (0, c.prefill[0].pool.layout.num_layers) if layerwise else None
    n = rng.randint(4, 8)
    chunks = [1, 1, n - 2]
    src = np.array(rng.sample(range(32), n))
    dst = np.array(rng.sample(range(64), n))
    for engine in c.prefill:
        patterns.fill(engine.pool, room, src)
        patterns.fill_aux(engine.pool, room, AUX_SLOT)
    senders: list[Sender] = []
    receivers: list[Receiver] = []

    async def open_receivers() -> None:
        for engine in c.decode:
            receivers.append(await engine.receiver(room, c.bootstrap, dst, aux_slot=AUX_SLOT))

    async def abort(handles: list[Sender] | list[Receiver]) -> float:
        started = time.monotonic()
        with anyio.fail_after(10):
            for handle in handles:
                await handle.abort()
        return time.monotonic() - started

    if point == "before_bootstrap":
        if side == "decode":  # the prefill never opens the room: its stashed requests are dropped
            await open_receivers()
            assert await abort(receivers) < 2.0
            assert set(await reasons(receivers)) == {FailureReason.ABORTED}
            assert not any(e.leaks()["stashed"] for e in c.prefill)
        else:  # the decode asks after the prefill gave up: the room's tombstone answers at once
            senders = [engine.sender(room) for engine in c.prefill]
            await abort(senders)
            assert set(await reasons(senders)) == {FailureReason.ABORTED}
            await open_receivers()
            assert set(await reasons(receivers)) == {FailureReason.ABORTED}
        return dst

    await open_receivers()
    senders = [engine.sender(room) for engine in c.prefill]
    # Past bootstrap: every decode rank's request is in (a prefill room that fails before a request
    # arrives cannot answer it; the request then waits in the stash until bootstrap_timeout).
    await until(lambda: all(s.poll() is not RoomStatus.BOOTSTRAPPING for s in senders), "the requests")
    aborting: list[Sender] | list[Receiver] = receivers if side == "decode" else senders
    if point == "between_chunks":
        await send(senders, src, chunks, 0, 2, every)
        if layerwise:  # the third chunk's first layer goes out too: the abort lands between layers
            await send(senders, src, chunks, 2, 3, (0, 1))
        await until(
            lambda: all(r.poll() is RoomStatus.TRANSFERRING for r in receivers), "first chunks landed"
        )
        await abort(aborting)
        # the application does not know yet; refused or dropped
        await send(senders, src, chunks, 2, 3, (1, every[1]) if every else None)
    elif point == "during_write":
        await send(senders, src, chunks, 0, 3, every)
        held = [rule for t in wrapped[: len(c.prefill)] for rule in t.write_rules.rules]
        await until(lambda: any(rule.fired for rule in held), "a chunk's WRITE posted")
        took = await abort(aborting)
        # abort() returned only once the WRITEs in flight had ended
        assert not any(e.poller.in_flight() for e in c.prefill)
        assert took > WRITE_HELD_S / 2, took
    else:
        await send(senders, src, chunks, 0, 3, every)
        await abort(aborting)
    outcomes = await reasons(receivers) + await reasons(senders)
    if point == "after_last":  # the room may have completed before the abort came
        assert set(outcomes) <= {None, FailureReason.ABORTED}, outcomes
        if all(outcome is None for outcome in outcomes[: len(receivers)]):
            for engine in c.decode:
                assert patterns.mismatches(engine.pool, room, dst, n * engine.pool.layout.page_size) == 0
    else:
        assert set(outcomes) == {FailureReason.ABORTED}, outcomes
    return dst


@pytest.mark.anyio
@pytest.mark.parametrize("layerwise", [False, True], ids=["chunks", "layers"])
@pytest.mark.parametrize("side", ["decode", "prefill"])
@pytest.mark.parametrize("path", list(TOPOLOGY))
async def test_abort_then_the_pages_take_another_room(path: str, side: str, layerwise: bool) -> None:
    """``layers``: the aborted rooms go layer-wise (one WRITE per layer), the others as chunks."""
    P, D = TOPOLOGY[path]
    during = room_id(path, side, "during_write")
    writes = [Rule(Fault.DELAY, match=matching(m.ChunkLanded, room=during), times=None, delay_s=WRITE_HELD_S)]
    notifs = [Rule(Fault.DELAY, match=matching(m.ChunkLanded, room=during), times=None, delay_s=NOTIF_HELD_S)]
    wrapped: list[FaultyTransport] = []
    rng = random.Random(f"{path}-{side}")
    async with engines(
        P,
        D,
        path=path,
        bootstrap_timeout=BOOTSTRAP_S,
        layers_per_write=1,
        prefill_transport=faulty_factory(wrapped, writes=writes),
        decode_transport=faulty_factory(wrapped, notifs=notifs),
    ) as c:
        for point in POINTS:
            room = room_id(path, side, point)
            dst = await aborted_room(c, room, side, point, rng, wrapped, layerwise)
            # at once: the same decode pages and aux slot, every byte verified
            n = len(dst)
            src = np.array(rng.sample(range(32, 64), n))
            await run_room(c, room + 1, src, dst, [n // 2, n - n // 2], aux_slot=AUX_SLOT)
        assert any(t.fired["delay"] for t in wrapped[:P]) and any(t.fired["delay"] for t in wrapped[P:])
        # the held notifications of the during-write room come in late; then everything is idle
        await until(lambda: not any(t.held() for t in wrapped), "held notifications delivered")
        await until(lambda: not any(any(e.leaks().values()) for e in c.prefill + c.decode), "idle engines")
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_decode_rank_asking_after_the_prefill_aborted_is_told() -> None:
    """D=2: the prefill aborts while a WRITE to decode rank 0 is in flight and decode rank 1's request is
    still on its way: rank 1 hears of the failure at once instead of waiting for chunks forever.

    (Regression: a TransferRequest reaching a Failed room that was still live was ignored.)
    """
    room = 77
    # The WRITE's completion is reported late on the prefill, and its notification reaches the
    # decode late: the bytes move at once, so without the second rule decode rank 0 could land and
    # scatter the chunk before the abort reaches it (and rightly succeed).
    writes = [Rule(Fault.DELAY, match=matching(m.ChunkLanded, room=room), times=None, delay_s=0.5)]
    notifs = [Rule(Fault.DELAY, match=matching(m.ChunkLanded, room=room), times=None, delay_s=0.5)]
    async with engines(
        1,
        2,
        prefill_transport=faulty_factory([], writes=writes),
        decode_transport=faulty_factory([], notifs=notifs),
        waiting_timeout=5.0,
    ) as c:
        src, dst = np.arange(4), np.arange(4)
        for engine in c.prefill:
            patterns.fill(engine.pool, room, src)
        await c.decode[1].connect(c.bootstrap)
        late = Rule(Fault.DELAY, match=matching(m.TransferRequest, room=room), delay_s=0.2)
        c.decode[1].control.faults = ControlFaults([late])
        (sender,) = [engine.sender(room) for engine in c.prefill]
        r0 = await c.decode[0].receiver(room, c.bootstrap, dst)
        r1 = await c.decode[1].receiver(room, c.bootstrap, dst)
        await sender.send(src, last=True)
        await until(lambda: c.prefill[0].poller.in_flight() > 0, "the WRITE to decode rank 0 in flight")
        await sender.abort()
        with anyio.fail_after(3):
            assert await ended(r0) is FailureReason.ABORTED
            assert await ended(r1) is FailureReason.ABORTED
        assert late.fired == 1
        c.decode[1].control.faults = None
        await run_room(c, room + 1, np.arange(4, 8), dst, [2, 2])
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_abort_queued_behind_the_mail_that_ended_the_room_is_acknowledged() -> None:
    """An Abort already in a prefill room's mailbox when the room became final and quiescent still gets
    its AbortAck (the decode rank that sent it waits for that ack before it frees its pages).

    (Regression: the room left with the mail still queued, so the ack was never sent and the decode
    room waited forever; the soak found it.)
    """
    room = 88
    async with engines(1, 1) as c:
        acks = Rule(Fault.DELAY, match=matching(m.AbortAck, room=room), probability=0.0, times=None)
        c.prefill[0].control.faults = ControlFaults([acks])  # counts the AbortAcks, delays none
        receiver = await c.decode[0].receiver(room, c.bootstrap, np.arange(2))
        sender = c.prefill[0].sender(room)
        await until(lambda: sender.poll() is RoomStatus.WAITING_FOR_INPUT, "the TransferRequest")
        actor = c.prefill[0].rooms[room]
        decode = c.decode[0]
        # Both in the mailbox before the room runs again: the first ends it, the second waits behind.
        actor.inbox.send_nowait(LocalAbort("application abort"))
        actor.inbox.send_nowait(
            m.Abort(room=room, agent=decode.agent_name, rank=0, reason=int(FailureReason.ABORTED), detail="x")
        )
        assert await ended(sender) is FailureReason.ABORTED
        assert await ended(receiver) is FailureReason.ABORTED
        await until(lambda: acks.seen >= 2, "two AbortAcks")
        # one for the queued Abort (sent by the room as it ended), one for the decode's own Abort
        # (which reached the prefill after the room had gone)
        c.prefill[0].control.faults = None
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_decode_rank_aborting_a_room_the_prefill_never_opened_fails_its_siblings() -> None:
    """D=2, the prefill has not opened the room: decode rank 0 aborts, decode rank 1 is told at once.

    (Regression: the Abort dropped every request stashed for the room, rank 1's too, without a word,
    and rank 1 waited for chunks forever; the soak found it.)
    """
    room = 99
    async with engines(1, 2) as c:
        r0 = await c.decode[0].receiver(room, c.bootstrap, np.arange(3))
        r1 = await c.decode[1].receiver(room, c.bootstrap, np.arange(3))
        await until(lambda: c.prefill[0].leaks()["stashed"] == 2, "both requests stashed")
        await r0.abort()
        with anyio.fail_after(3):
            assert await ended(r1) is FailureReason.ABORTED
        assert r1.failure is not None and "before prefill rank 0 opened the room" in r1.failure[1]
        await run_room(c, room + 1, np.arange(3), np.arange(3), [1, 2], aux_slot=1)
        c.assert_no_leaks()
