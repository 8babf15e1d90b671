"""The direct path posts from prepared page lists; every other WRITE stays one-shot."""

from __future__ import annotations

import random

import numpy as np
import pytest

from .harness import cluster, run_room, shuffled_pages, small_layout


@pytest.mark.anyio
async def test_direct_writes_are_prepared_and_exact() -> None:
    rng = random.Random(7)
    async with cluster(small_layout(), 1, 1, path="direct") as c:
        stats = c.prefill[0].poller.transport.stats
        # shuffled pages (one-page runs) and a contiguous run (one multi-page range per tensor)
        await run_room(c, 1, shuffled_pages(rng, 64, 9), shuffled_pages(rng, 64, 9), [4, 5], aux_slot=2)
        await run_room(c, 2, np.arange(10, 18), np.arange(30, 38), [8])
        assert stats["prepared"] == 3  # one WRITE per chunk, all from the prepared lists
        assert stats["one_shot"] == 1  # the aux item is not a KV page
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_staged_writes_stay_one_shot() -> None:
    rng = random.Random(8)
    async with cluster(small_layout(), 2, 1, path="staged") as c:
        await run_room(c, 3, shuffled_pages(rng, 64, 6), shuffled_pages(rng, 64, 6), [3, 3])
        for engine in c.prefill:
            stats = engine.poller.transport.stats
            assert stats["prepared"] == 0 and stats["one_shot"] == 2  # staging buffer -> ring
        c.assert_no_leaks()
