"""Rooms whose pages lie as a serving system's allocator hands them out (scattered over a pool eight
rooms large, and an allocator's realistic tables), on every path, several rooms in flight, each
room's prefill and decode tables from unrelated allocators: every byte checked, nothing leaked."""

from __future__ import annotations

import functools
import gc

import anyio
import numpy as np
import pytest

from transfer_engine.engine.snapshot import build_snapshot
from transfer_engine.observe.render import render_table
from transfer_engine.protocol.descriptors import page_runs
from transfer_engine.testing.pagetables import pool_pages, room_tables, side_seed

from .harness import cluster, run_room, small_layout

ROOMS = 3
PAGES = 24
"""Pages per room (page size 4: 96 tokens), sent in the chunks of :data:`CHUNKS`."""
CHUNKS = [10, 1, 13]
SHAPES = ("scattered", "realistic")

CASES = [
    pytest.param(8, False, 1, 1, path, id=f"H8-P1-D1-{path}")
    for path in ("direct", "slice", "staged", "host")
] + [
    pytest.param(8, False, 2, 1, "staged", id="H8-P2-D1-staged"),
    pytest.param(8, False, 1, 2, "host", id="H8-P1-D2-host"),
    pytest.param(8, False, 2, 1, "slice", id="H8-P2-D1-slice"),
    pytest.param(1, True, 1, 2, "direct", id="mla-P1-D2-direct"),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("heads", "mla", "P", "D", "path"), CASES)
async def test_scattered_and_realistic_pages(heads: int, mla: bool, P: int, D: int, path: str) -> None:
    layout = small_layout(heads, mla)
    num_pages = max(pool_pages(shape, PAGES, ROOMS) for shape in SHAPES)
    async with cluster(layout, P, D, path=path, num_pages=num_pages) as c:
        posted = 0
        for round_, shape in enumerate(SHAPES):
            src = room_tables(shape, PAGES, ROOMS, seed=side_seed(round_, "prefill"))
            dst = room_tables(shape, PAGES, ROOMS, seed=side_seed(round_, "decode"))
            # the tables are what the test means: far from one run per room on either side
            assert all(len(page_runs(s, d)) > PAGES // 3 for s, d in zip(src, dst, strict=True))
            async with anyio.create_task_group() as tg:
                for i in range(ROOMS):
                    room = 100 * (round_ + 1) + i
                    tg.start_soon(functools.partial(run_room, c, room, src[i], dst[i], CHUNKS, aux_slot=i))
            c.assert_no_leaks()
            if (path, P, D) == ("direct", 1, 1):  # one descriptor per (tensor, run of a chunk), no more
                tensors = layout.num_kv_tensors
                want = sum(
                    len(page_runs(s[a:b], d[a:b])) * tensors
                    for s, d in zip(src, dst, strict=True)
                    for a, b in zip(np.cumsum([0, *CHUNKS[:-1]]), np.cumsum(CHUNKS), strict=True)
                )
                got = c.prefill[0].poller.counters["descriptors_posted"] - posted
                assert got == want + ROOMS, (got, want)  # and each room's aux item: one descriptor
            posted = c.prefill[0].poller.counters["descriptors_posted"]


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["direct", "staged"])
async def test_layerwise_rooms_on_realistic_pages(path: str) -> None:
    """Layer-wise chunks (``begin_chunk``/``layers_ready``) over realistic tables, three rooms in flight."""
    layout = small_layout()
    num_pages = pool_pages("realistic", PAGES, ROOMS)
    async with cluster(layout, 1, 1, path=path, num_pages=num_pages, layers_per_write=2) as c:
        src = room_tables("realistic", PAGES, ROOMS, seed=side_seed(5, "prefill"))
        dst = room_tables("realistic", PAGES, ROOMS, seed=side_seed(5, "decode"))
        async with anyio.create_task_group() as tg:
            for i in range(ROOMS):
                tg.start_soon(functools.partial(run_room, c, 300 + i, src[i], dst[i], CHUNKS, layers=1))
        c.assert_no_leaks()
    assert np.unique(np.concatenate(dst)).size == ROOMS * PAGES


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("P", "D", "path", "why"), [(1, 1, "direct", "descriptors for"), (2, 1, "staged", "unequal TP")]
)
async def test_auto_path_and_why_in_the_dump(P: int, D: int, path: str, why: str) -> None:
    """``path="auto"`` chooses per room; the decode's dump (live or ended) shows the path and why,
    the prefill's the path its request named. On CPU pools a scattered room stays direct (the CPU
    crossover); on GPU pools these small rooms are under the GPU one's allowance too."""
    layout = small_layout()
    # NIXL's choice is under test: with the kernel path on, a CUDA pool in this one process is mapped
    # as it is ("process") and auto takes the kernel path (test_kernel_path.py asserts that choice)
    num_pages = pool_pages("scattered", PAGES, 1)
    async with cluster(layout, P, D, path="auto", num_pages=num_pages, kernel_path=False) as c:
        src = room_tables("scattered", PAGES, 1, seed=side_seed(9, "prefill"))[0]
        dst = room_tables("scattered", PAGES, 1, seed=side_seed(9, "decode"))[0]
        await run_room(c, 500, src, dst, CHUNKS)
        (ended,) = [r for r in build_snapshot(c.decode[0]).ended if r.room == 500]
        assert ended.path == path and why in ended.path_reason, (ended.path, ended.path_reason)
        assert f"path: {path} ({ended.path_reason})" in render_table(build_snapshot(c.decode[0], 500), 500)
        table = render_table(build_snapshot(c.decode[0]))  # the ended rooms' table has a PATH column
        assert "PATH" in table and f"{path} ({ended.path_reason})" in table
        (sent,) = [r for r in build_snapshot(c.prefill[0]).ended if r.room == 500]
        assert sent.path == path and sent.path_reason == ""
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_started_engine_froze_the_process_objects() -> None:
    """Once an engine has started, the process's objects of that moment are out of CPython's
    collections (``gc.freeze``, once per process: engine.supervisor.freeze_gc_once)."""
    async with cluster(small_layout(), 1, 1) as c:
        assert gc.get_freeze_count() > 0
        c.assert_no_leaks()
