"""A prefill's poller looks at the WRITEs of layer groups before their chunk's closing group only every
``poll_relaxed`` (relaxed WRITEs), and their ends still reach both sides: the decode counts the groups
before the closing one has even been reported ready."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from transfer_engine.testing import patterns

from .harness import cluster, layers_landed, open_layerwise, run_room, small_layout


@pytest.mark.anyio
async def test_groups_before_the_closing_one_are_relaxed_and_still_land() -> None:
    async with cluster(small_layout(), 1, 1, path="direct", layers_per_write=1) as c:
        prefill, decode = c.prefill[0], c.decode[0]
        pages = np.arange(4)
        sender, receiver = await open_layerwise(c, 60, pages, 2)
        await layers_landed(c, 60, 2)  # no closing group yet: nothing hurried them
        counters = prefill.poller.counters
        assert counters["writes_relaxed"] == 2
        assert counters["writes_hurried"] == 0
        await sender.layers_ready(2, 3)  # the closing group
        with anyio.fail_after(10):
            await sender.wait()
            await receiver.wait()
        assert counters["writes_posted"] == 3 and counters["writes_done"] == 3
        assert counters["writes_relaxed"] == 2  # the closing group's is urgent
        assert decode.poller.counters["writes_relaxed"] == 0
        tokens = patterns.received_tokens(len(pages), 4, len(pages), 4)
        assert patterns.mismatches(decode.pool, 60, pages, tokens) == 0
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_a_chunk_level_room_is_never_relaxed() -> None:
    async with cluster(small_layout(), 1, 1, path="direct") as c:
        pages = np.arange(6)
        await run_room(c, 61, pages, pages, [3, 3])  # every byte checked
        assert c.prefill[0].poller.counters["writes_posted"] == 2
        assert c.prefill[0].poller.counters["writes_relaxed"] == 0
        c.assert_no_leaks()
