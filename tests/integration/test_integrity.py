"""Integrity (``integrity=True``; docs/INTEGRITY.md): every chunk (or layer group) that lands is verified
against the checksum its writer carried, on every path and shape; off on a side only when asked.

The decode counts one result per chunk notification it received: ``integrity_match`` here (the
chaos tests make them mismatch), ``integrity_unchecked`` when the writer carried nothing. Every
byte is checked against the pattern as in the matrix, and nothing leaks.
"""

from __future__ import annotations

import random

import anyio
import pytest

from tests.chaos.helpers import engines

from .harness import Cluster, cluster, run_room, shuffled_pages, small_layout
from .test_inspection import scrape, wait_for

pytestmark = pytest.mark.timeout(60)

SHAPES = [
    pytest.param(8, False, 1, 1, "direct", 0, id="H8-P1-D1-direct"),
    pytest.param(8, False, 1, 1, "direct", 1, id="H8-P1-D1-direct-layers"),
    pytest.param(8, False, 2, 1, "slice", 0, id="H8-P2-D1-slice"),
    pytest.param(8, False, 1, 2, "slice", 1, id="H8-P1-D2-slice-layers"),
    pytest.param(8, False, 2, 1, "staged", 0, id="H8-P2-D1-staged"),
    pytest.param(8, False, 1, 2, "staged", 1, id="H8-P1-D2-staged-layers"),
    pytest.param(8, False, 1, 1, "host", 0, id="H8-P1-D1-host"),
    pytest.param(1, True, 2, 1, "staged", 1, id="mla-P2-D1-staged-layers"),
    pytest.param(1, True, 1, 1, "direct", 0, id="mla-P1-D1-direct"),
]


def checked(c: Cluster, result: str) -> int:
    return sum(engine.counters[f"integrity_{result}"] for engine in c.decode)


def chunk_notifications(c: Cluster) -> int:
    """Chunk notifications the decode ranks received (the rooms here send no aux item)."""
    return sum(engine.poller.counters["notifs"] for engine in c.decode)


@pytest.mark.anyio
@pytest.mark.parametrize(("heads", "mla", "P", "D", "path", "layers"), SHAPES)
async def test_every_landed_chunk_is_verified(
    heads: int, mla: bool, P: int, D: int, path: str, layers: int
) -> None:
    rng = random.Random(heads * 100 + P * 10 + D)
    async with cluster(small_layout(heads, mla), P, D, path=path, layers_per_write=2, integrity=True) as c:
        for room in (1, 2):
            await run_room(
                c, room, shuffled_pages(rng, 64, 7), shuffled_pages(rng, 64, 7), [3, 4], layers=layers
            )
        landed = chunk_notifications(c)
        assert landed > 0
        assert checked(c, "match") == landed
        assert checked(c, "unchecked") == checked(c, "mismatch") == 0
        c.assert_no_leaks()


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("off", "path"), [("prefill", "direct"), ("prefill", "staged"), ("decode", "direct")]
)
async def test_integrity_off_on_one_side_is_counted_unchecked(off: str, path: str) -> None:
    """Off on the prefill: no checksum travels; off on the decode: none is compared. Either way the
    chunks count (the bytes are still checked here), each as unchecked."""
    rng = random.Random(9)
    side = (
        {"prefill_config": {"integrity": False}}
        if off == "prefill"
        else {"decode_config": {"integrity": False}}
    )
    async with engines(1, 1, path=path, integrity=True, **side) as c:  # type: ignore[arg-type]
        await run_room(c, 3, shuffled_pages(rng, 64, 5), shuffled_pages(rng, 64, 5), [2, 3])
        landed = chunk_notifications(c)
        assert landed > 0 and checked(c, "unchecked") == landed
        assert checked(c, "match") == checked(c, "mismatch") == 0
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_metrics_count_the_checks() -> None:
    rng = random.Random(4)
    async with cluster(small_layout(), 1, 1, metrics_port=0, integrity=True) as c:
        decode = c.decode[0]
        assert decode.metrics_endpoint is not None
        await run_room(c, 5, shuffled_pages(rng, 64, 6), shuffled_pages(rng, 64, 6), [2, 4])
        await wait_for(lambda: not c.prefill[0].rooms and not decode.rooms, "rooms to end")
        d = await anyio.to_thread.run_sync(scrape, decode.metrics_endpoint)
        assert d[("transfer_engine_integrity_checks_total", (("result", "match"),))] == 2
        assert d[("transfer_engine_integrity_checks_total", (("result", "mismatch"),))] == 0
        assert d[("transfer_engine_integrity_checks_total", (("result", "unchecked"),))] == 0
        c.assert_no_leaks()
