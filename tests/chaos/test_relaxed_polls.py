"""The closing group's coming hurries its chunk's relaxed WRITEs: the poller looks at them at once
instead of after ``poll_relaxed``. Here ``poll_relaxed`` is 30 s and the groups before the closing one
end 0.2 s after their post (a DELAY rule on the real transport); the decode counts them while the
closing group is still held for its layers, so only a hurried look can have sent their notifications."""

from __future__ import annotations

import threading

import anyio
import numpy as np
import pytest

from tests.integration.harness import layers_landed, open_layerwise
from transfer_engine.protocol import messages as m
from transfer_engine.testing import patterns
from transfer_engine.transport.faults import Fault, FaultyTransport, Rule

from .helpers import engines, faulty_factory


def _before_the_last(payload: bytes) -> bool:
    notif = m.decode(payload)
    return isinstance(notif, m.ChunkLanded) and notif.layers is not None and notif.layers[1] < 3


@pytest.mark.anyio
async def test_the_closing_group_hurries_the_relaxed_writes_of_its_chunk() -> None:
    wrapped: list[FaultyTransport] = []
    rule = Rule(Fault.DELAY, match=_before_the_last, times=None, delay_s=0.2)
    async with engines(
        1, 1, prefill_transport=faulty_factory(wrapped, writes=[rule]), layers_per_write=1, poll_relaxed=30.0
    ) as c:
        prefill, decode = c.prefill[0], c.decode[0]
        pages = np.arange(4)
        sender, receiver = await open_layerwise(c, 70, pages, 2)
        counters = prefill.poller.counters
        with anyio.fail_after(5):
            while counters["writes_relaxed"] < 2:  # noqa: ASYNC110 - engine state, no event
                await anyio.sleep(0.002)
        written = threading.Event()
        await sender.layers_ready(2, 3, ready=written)  # held: its layers are "not written yet"
        await layers_landed(c, 70, 2, limit_s=3.0)  # far less than poll_relaxed
        assert counters["writes_hurried"] == 2 and counters["writes_posted"] == 2
        assert rule.fired == 2
        written.set()
        with anyio.fail_after(5):
            await sender.wait()
            await receiver.wait()
        tokens = patterns.received_tokens(len(pages), 4, len(pages), 4)
        assert patterns.mismatches(decode.pool, 70, pages, tokens) == 0
        c.assert_no_leaks()
