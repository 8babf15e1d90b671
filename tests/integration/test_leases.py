"""Room leases and progress deadlines with real engines (real NIXL, real ZMQ; docs/CONFIGURATION.md).

Timeouts are shrunk (transfer and bootstrap 1 s, heartbeats every 0.2 s, room lease 0.6 s) so that
each test crosses them by far; every byte that arrives is checked, and nothing may leak after each.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import numpy as np
import pytest

from tests.chaos.helpers import engines, faulty_factory
from tests.chaos.rank_process import BOUND, HEARTBEAT, expect_peer_dead, rank_processes
from transfer_engine.errors import FailureReason, TransferFailed
from transfer_engine.testing import patterns
from transfer_engine.transport.faults import Fault, Rule, matching

from .harness import Cluster, cluster, small_layout

pytestmark = pytest.mark.timeout(60)

SHORT: dict[str, Any] = {
    "bootstrap_timeout": 1.0,
    "transfer_timeout": 1.0,
    "heartbeat_interval": 0.2,
    "room_lease": 0.6,
}


def _verify(c: Cluster, room: int, src: np.ndarray, dst: np.ndarray) -> None:
    for engine in c.decode:
        d_ps = engine.pool.layout.page_size
        tokens = patterns.received_tokens(len(src), c.prefill[0].pool.layout.page_size, len(dst), d_ps)
        assert patterns.mismatches(engine.pool, room, dst, tokens) == 0


@pytest.mark.anyio
async def test_a_decode_queued_longer_than_every_timeout_on_a_live_prefill_succeeds() -> None:
    """The prefill opens the room 2.6 s after the decode asked (transfer + bootstrap = 2 s, lease 0.6 s):
    the stashed request and the waiting decode room renew each other's lease by heartbeats."""
    async with cluster(small_layout(), 2, 1, **SHORT) as c:
        src, dst = np.arange(6), np.arange(10, 16)
        for engine in c.prefill:
            patterns.fill(engine.pool, 21, src)
        receiver = await c.decode[0].receiver(21, c.bootstrap, dst)
        await anyio.sleep(2.6)
        assert all(e.leaks()["stashed"] == 1 for e in c.prefill)  # still held, queued on the prefill
        senders = [engine.sender(21) for engine in c.prefill]
        for sender in senders:
            await sender.send(src[:3], last=False)
            await sender.send(src[3:], last=True)
        with anyio.fail_after(10):
            await receiver.wait()
            for sender in senders:
                await sender.wait()
        _verify(c, 21, src, dst)
        assert not any(e.counters["stash_expired"] for e in c.prefill)
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_a_slow_room_that_keeps_moving_succeeds() -> None:
    """Eight chunks, each sent 0.3 s after the last and its WRITE's completion held 0.25 s: 2.4 s
    in Transferring against transfer_timeout=1 s, never 1 s without progress on either side."""
    rule = Rule(Fault.DELAY, match=matching(room=22), times=None, delay_s=0.25)
    async with engines(1, 1, prefill_transport=faulty_factory([], writes=[rule]), **SHORT) as c:
        src, dst = np.arange(8), np.arange(20, 28)
        patterns.fill(c.prefill[0].pool, 22, src)
        receiver = await c.decode[0].receiver(22, c.bootstrap, dst)
        sender = c.prefill[0].sender(22)
        started = time.monotonic()
        for i in range(8):
            await sender.send(src[i : i + 1], last=i == 7)
            await anyio.sleep(0.3)
        with anyio.fail_after(10):
            await receiver.wait()
            await sender.wait()
        assert time.monotonic() - started > 2 * SHORT["transfer_timeout"]
        assert rule.fired == 8
        _verify(c, 22, src, dst)
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_a_room_that_stops_moving_fails_transfer_timeout_after_its_last_progress() -> None:
    """Chunk 0 at t0, chunk 1 at t0 + 0.7, then nothing: the decode fails about 1 s after the second
    landing (a window from entering Transferring would have ended it at t0 + 1 s). The prefill's own
    transfer_timeout is 5 s here, so that the decode's deadline is the one judged."""
    async with engines(1, 1, prefill_config={"transfer_timeout": 5.0}, **SHORT) as c:
        src, dst = np.arange(6), np.arange(30, 36)
        patterns.fill(c.prefill[0].pool, 23, src)
        receiver = await c.decode[0].receiver(23, c.bootstrap, dst)
        sender = c.prefill[0].sender(23)
        await sender.send(src[:2], last=False)
        await anyio.sleep(0.7)
        await sender.send(src[2:4], last=False)
        last_progress = time.monotonic()
        with anyio.fail_after(10):
            with pytest.raises(TransferFailed) as info:
                await receiver.wait()
        failed_after = time.monotonic() - last_progress
        assert info.value.reason is FailureReason.TRANSFER_TIMEOUT, info.value
        assert "made no progress for more than 1.0 s in TRANSFERRING" in str(info.value)
        assert 1.0 - 0.1 <= failed_after < 4.0, failed_after  # from the last landing, not the first
        with anyio.fail_after(10), pytest.raises(TransferFailed):
            await sender.wait()  # told by the decode, long before its own 5 s
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_a_prefill_room_no_decode_asks_for_ends_at_its_lease() -> None:
    """The sequential router's prefill finished and the router died: its room holds blocks until
    room_lease runs out unrenewed, then fails, and the same pages serve the next room."""
    async with cluster(small_layout(), 1, 1, **SHORT) as c:
        src = np.arange(4)
        patterns.fill(c.prefill[0].pool, 24, src)
        sender = c.prefill[0].sender(24)
        opened = time.monotonic()
        await sender.send(src, last=True)
        with anyio.fail_after(10), pytest.raises(TransferFailed) as info:
            await sender.wait()
        lived = time.monotonic() - opened
        assert info.value.reason is FailureReason.BOOTSTRAP_TIMEOUT, info.value
        assert "room_lease=0.6 s" in str(info.value)
        assert SHORT["room_lease"] - 0.05 <= lived < 5.0, lived
        c.assert_no_leaks()
        dst = np.arange(40, 44)
        patterns.fill(c.prefill[0].pool, 25, src)
        receiver = await c.decode[0].receiver(25, c.bootstrap, dst)
        sender = c.prefill[0].sender(25)
        await sender.send(src, last=True)
        with anyio.fail_after(10):
            await receiver.wait()
            await sender.wait()
        _verify(c, 25, src, dst)
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_a_decode_room_waiting_for_its_pages_holds_the_prefill_s_room() -> None:
    """SGLang's order: the decode opens the room when the request arrives (the handshake) and gives
    its pages only once memory frees up, while the prefill has finished and holds the KV. The decode
    room, pages or not, lists the room in its heartbeats: the prefill's room outlives every window
    (2.6 s against bootstrap 1 s and lease 0.6 s), then the pages come and every byte lands."""
    async with cluster(small_layout(), 1, 1, **SHORT) as c:
        src, dst = np.arange(4), np.arange(20, 24)
        patterns.fill(c.prefill[0].pool, 26, src)
        receiver = await c.decode[0].receiver(26, c.bootstrap)  # no pages yet
        sender = c.prefill[0].sender(26)
        await sender.send(src, last=True)
        await anyio.sleep(2.6)
        assert not sender.status.final and not receiver.status.final
        receiver.request(dst)
        with anyio.fail_after(10):
            await receiver.wait()
            await sender.wait()
        _verify(c, 26, src, dst)
        c.assert_no_leaks()


@pytest.mark.slow
def test_a_killed_prefill_fails_the_waiting_decode_rooms_within_two_heartbeats() -> None:
    """Decode rooms waiting on a prefill that holds their requests stashed (never opened): SIGKILL the
    prefill, and they fail PEER_DEAD within the bound, leaving nothing held on the decode."""
    with rank_processes() as ranks:
        prefill, decode = ranks.start("prefill"), ranks.start("decode")
        for room, first in ((31, 0), (32, 4)):
            decode.send(cmd="recv", room=room, pages=list(range(first, first + 4)))
            decode.expect("opened", room=room)
        time.sleep(3 * HEARTBEAT)  # waiting, well past a heartbeat or two: the leases are renewed
        killed_at = prefill.kill()
        expect_peer_dead(decode, (31, 32), killed_at)
        assert all(v == 0 for v in decode.quit().values())


@pytest.mark.slow
def test_a_killed_decode_frees_its_stashed_requests_on_the_prefill() -> None:
    """Requests of a decode killed while the prefill held them stashed are dropped at its death, not
    kept for room_lease: the prefill quits with nothing held."""
    with rank_processes() as ranks:
        prefill, decode = ranks.start("prefill"), ranks.start("decode")
        decode.send(cmd="recv", room=33, pages=[0, 1, 2, 3])
        decode.expect("opened", room=33)
        time.sleep(2 * HEARTBEAT)
        decode.kill()
        time.sleep(BOUND)
        assert all(v == 0 for v in prefill.quit().values())
