"""Every remote address is checked against the peer's registered regions before a WRITE is posted.

A WRITE aimed anywhere else is refused by the real transport with AddressRangeError: nothing is
posted, the refusal is counted (``poller.counters["writes_refused_address"]``), and the room fails
on both sides with a reason that names the bad range.
"""

from __future__ import annotations

import random

import anyio
import numpy as np
import pytest

from tests.integration.harness import run_room, shuffled_pages
from transfer_engine.errors import AddressRangeError, FailureReason, TransferFailed
from transfer_engine.protocol import messages as m
from transfer_engine.testing import patterns
from transfer_engine.transport.faults import Fault, FaultyTransport, Rule, matching
from transfer_engine.transport.nixl import WriteSpec, XferState

from .helpers import engines, faulty_factory

pytestmark = pytest.mark.timeout(60)


@pytest.mark.anyio
async def test_write_outside_the_peer_regions_fails_the_room_before_posting() -> None:
    wrapped: list[FaultyTransport] = []
    bad = Rule(Fault.BAD_ADDRESS, match=matching(m.ChunkLanded, room=31))
    rng = random.Random(31)
    async with engines(1, 1, prefill_transport=faulty_factory(wrapped, writes=[bad])) as c:
        prefill, decode = c.prefill[0], c.decode[0]
        src, dst = shuffled_pages(rng, 64, 4), shuffled_pages(rng, 64, 4)
        patterns.fill(prefill.pool, 31, src)
        receiver = await decode.receiver(31, c.bootstrap, dst)
        sender = prefill.sender(31)
        await sender.send(src[:2])
        await sender.send(src[2:], last=True)
        with anyio.fail_after(10):
            with pytest.raises(TransferFailed) as sent:
                await sender.wait()
            with pytest.raises(TransferFailed) as received:
                await receiver.wait()
        assert sent.value.reason is FailureReason.TRANSPORT
        assert "lies outside every region registered by peer" in sent.value.detail
        assert received.value.reason is FailureReason.REMOTE
        assert "TRANSPORT" in received.value.detail
        assert bad.fired == 1 and wrapped[0].fired == {"bad_address": 1}
        assert prefill.poller.counters["writes_refused_address"] == 1
        assert prefill.counters["failed_transport"] == 1 and decode.counters["failed_remote"] == 1
        # Nothing of the refused WRITE reached the decode's pages.
        assert patterns.mismatches(decode.pool, 31, dst[:2], 2 * decode.pool.layout.page_size) > 0
        await run_room(c, 32, shuffled_pages(rng, 64, 4), shuffled_pages(rng, 64, 4), [1, 3], aux_slot=0)
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_transport_range_check_at_every_edge() -> None:
    async with engines(1, 1) as c:
        prefill, decode = c.prefill[0], c.decode[0]
        await decode.connect(c.bootstrap)  # the handshake gives the prefill the decode's regions
        transport = prefill.poller.transport
        regions = sorted(decode.pool.regions(), key=lambda r: r.addr)
        first, last = regions[0], regions[-1]
        local = prefill.pool.regions()[0]

        def post(dst: list[int], length: list[int]) -> int:
            n = len(dst)
            src = np.full(n, local.addr, dtype=np.uint64)
            return transport.post_write(
                WriteSpec(
                    decode.agent_name,
                    prefill.pool.mem_type,
                    src,
                    np.array(dst, dtype=np.uint64),
                    np.array(length, dtype=np.uint64),
                    prefill.pool.device_id,
                    b"",
                )
            )

        refused = {
            "one byte before the first region": ([first.addr - 1], [8]),
            "straddling the end of the last region": ([last.end - 8], [16]),
            "one byte past the last region": ([last.end], [1]),
            "far away": ([1 << 56], [64]),
            "only the last descriptor is bad": ([first.addr, first.addr + 64, last.end], [64, 64, 64]),
        }
        for what, (dst, length) in refused.items():
            with pytest.raises(AddressRangeError, match="outside every region"):
                post(dst, length)
            assert transport.live_handles() == 0, what
        # Exactly the first and last bytes of the registered memory are fine (a real WRITE, no notification).
        handle = post([first.addr, last.end - 64], [64, 64])
        with anyio.fail_after(5):
            while (state := transport.state(handle)) is XferState.PROC:  # noqa: ASYNC110 (NIXL has no event)
                await anyio.sleep(0.001)
        transport.release(handle)
        assert state is XferState.DONE
        await run_room(c, 33, np.arange(4), np.arange(4), [4])
        c.assert_no_leaks()
