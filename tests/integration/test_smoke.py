import random

import pytest

from .harness import cluster, run_room, shuffled_pages, small_layout


@pytest.mark.anyio
async def test_one_room_1_1() -> None:
    rng = random.Random(0)
    async with cluster(small_layout(), 1, 1) as c:
        await run_room(c, 1, shuffled_pages(rng, 64, 6), shuffled_pages(rng, 64, 6), [2, 4], aux_slot=3)
        c.assert_no_leaks()
