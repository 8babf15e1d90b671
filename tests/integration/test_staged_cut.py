"""Whole chunks the prefill room writes as layer groups on the staged path (``staged_pipeline_layers``;
docs/DECISIONS.md, "Staged-path chunks cut by the prefill room"): every byte lands, on hetero TP both
ways, with aux and several chunks a room; the cut is per path; a staging buffer smaller than a chunk
serves a cut chunk; an abort while a chunk's groups land ends both sides; nothing leaks.

Real NIXL (UCX over DRAM), real ZMQ; a fault-injecting wrapper around the real transport holds back
notifications where a test needs a room caught between two groups.
"""

from __future__ import annotations

import random
from typing import Any

import anyio
import numpy as np
import pytest

from tests.chaos.helpers import engines, faulty_factory
from transfer_engine.errors import FailureReason, TransferFailed
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.receiver_room import ReceiverRoom
from transfer_engine.protocol.rooms import RoomStatus
from transfer_engine.testing import patterns
from transfer_engine.transport.faults import Fault, Rule, matching

from .harness import Cluster, cluster, layers_landed, run_room, shuffled_pages, small_layout
from .test_matrix import _matrix

pytestmark = pytest.mark.timeout(60)

CUT: dict[str, Any] = {"path": "staged", "staged_pipeline_layers": 1, "pipeline_min_bytes": 0}
"""Every whole chunk to a staged decode rank goes as one group per layer."""
ROOM_CUT: dict[str, Any] = {k: v for k, v in CUT.items() if k != "path"}
""":data:`CUT` without the path (for helpers that take it apart)."""


def _tensor_bytes(pages: int, heads: int = 8) -> int:
    """Bytes of one KV tensor's ``heads`` heads over ``pages`` pages of :func:`small_layout`."""
    layout = small_layout()
    return pages * layout.page_size * heads * layout.head_dim * 2


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("heads", "mla", "P", "D", "per_group"),
    [(8, False, 1, 1, 1), (8, False, 1, 1, 2), (8, False, 2, 1, 1), (8, False, 1, 2, 1), (1, True, 2, 1, 2)],
    ids=["H8-P1-D1-1", "H8-P1-D1-2", "H8-P2-D1-1", "H8-P1-D2-1", "mla-P2-D1-2"],
)
async def test_matrix_staged_chunks_cut_by_the_room(
    heads: int, mla: bool, P: int, D: int, per_group: int
) -> None:
    """Four concurrent rooms of random chunks, each with aux; every chunk to every staged decode rank
    goes as groups of ``per_group`` layers (of 3: groups 1+1+1 or 2+1); every byte checked."""
    await _matrix(heads, mla, P, D, "staged", **(ROOM_CUT | {"staged_pipeline_layers": per_group}))


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["staged", "host", "direct"])
async def test_the_cut_is_per_path(path: str) -> None:
    """``staged_pipeline_layers=2`` with ``host_pipeline_layers=0``: a 3-page chunk to a staged decode
    rank is two WRITEs (layers 0-1, 2), on the host and direct paths one; a 2-page chunk is under
    ``pipeline_min_bytes`` and goes whole everywhere. Each room also WRITEs its aux item."""
    layout = small_layout()
    three_pages = _tensor_bytes(3) * layout.num_kv_tensors
    config: dict[str, Any] = {
        "staged_pipeline_layers": 2,
        "host_pipeline_layers": 0,
        "pipeline_min_bytes": three_pages,
    }
    async with cluster(layout, 1, 1, path=path, **config) as c:
        counters = c.prefill[0].poller.counters
        await run_room(c, 5, np.arange(3), np.arange(10, 13), [3], aux_slot=1)
        posted = counters["writes_posted"]
        assert posted == (2 if path == "staged" else 1) + 1
        await run_room(c, 6, np.arange(2), np.arange(20, 22), [2], aux_slot=2)
        assert counters["writes_posted"] - posted == 1 + 1
        c.assert_no_leaks()


def _worker_counter(c: Cluster, name: str) -> int:
    return sum(w.counters[name] for e in c.prefill for w in e.workers)


@pytest.mark.anyio
async def test_a_staging_buffer_smaller_than_a_chunk_serves_cut_chunks() -> None:
    """Each group is gathered into a lease of its own: a prefill staging buffer of one group's bytes
    (K and V of one layer of a 4-page chunk) moves the room group after group, every byte right;
    sent whole, the same chunk cannot be leased and the room fails with STAGING on both sides."""
    one_group = 2 * _tensor_bytes(4)
    pages = np.arange(4)
    async with cluster(small_layout(), 1, 1, **CUT, staging_bytes=one_group) as c:
        await run_room(c, 7, pages, pages + 8, [4], aux_slot=0)
        assert _worker_counter(c, "lease_waits") > 0  # the groups queued for the one lease
        c.assert_no_leaks()
    async with cluster(
        small_layout(), 1, 1, **(CUT | {"staged_pipeline_layers": 0}), staging_bytes=one_group
    ) as c:
        reasons = await fails_naming(c, 8, pages, pages + 8, "staging_bytes")
        assert reasons[0] is FailureReason.STAGING and reasons[1] in (
            FailureReason.STAGING,
            FailureReason.REMOTE,
        )
        c.assert_no_leaks()


async def fails_naming(
    c: Cluster, room: int, src: np.ndarray, dst: np.ndarray, option: str
) -> list[FailureReason]:
    """Send ``room`` whole from prefill rank 0 to decode rank 0: it must fail on both sides with a
    detail naming ``option``; the reasons, the prefill's first."""
    patterns.fill(c.prefill[0].pool, room, src)
    receiver = await c.decode[0].receiver(room, c.bootstrap, dst)
    sender = c.prefill[0].sender(room)
    await sender.send(src, last=True)
    reasons = []
    with anyio.fail_after(10):
        for handle in (sender, receiver):
            with pytest.raises(TransferFailed, match=option) as info:
                await handle.wait()
            reasons.append(info.value.reason)
    return reasons


@pytest.mark.anyio
async def test_a_cut_chunk_takes_one_ring_region_for_all_its_groups() -> None:
    """The groups of a cut chunk share the chunk's region: chunk 0 takes the region granted with the
    request (no StagingRequest), each later chunk asks once, not once per group; on a ring of two
    chunks, rooms of several chunks wait on the watermark and all complete."""
    async with cluster(small_layout(), 2, 1, **CUT) as c:
        await run_room(c, 1, np.arange(4), np.arange(4), [4], aux_slot=1)
        await run_room(c, 2, np.arange(4, 10), np.arange(4, 10), [2, 2, 2])
        ahead, asked = _worker_counter(c, "granted_ahead"), _worker_counter(c, "staging_requests")
        assert (ahead, asked) == (2 * 2, 2 * 2)  # two writers: chunk 0 of each room ahead, 2 asked
        assert c.prefill[0].poller.counters["writes_posted"] == 3 + 3 * 3 + 1  # a WRITE per group, aux
        c.assert_no_leaks()
    ring = 2 * _tensor_bytes(3) * small_layout().num_kv_tensors  # two chunks of 3 pages
    async with cluster(small_layout(), 2, 1, **CUT, ring_bytes=ring) as c:
        rng = random.Random(3)
        src, dst = shuffled_pages(rng, 64, 36), shuffled_pages(rng, 64, 36)
        async with anyio.create_task_group() as tg:
            for room in range(4):
                part = slice(9 * room, 9 * room + 9)
                tg.start_soon(run_room, c, 20 + room, src[part], dst[part], [3, 3, 3])
        assert _worker_counter(c, "watermark_waits") > 0
        assert c.decode[0].ring is not None and c.decode[0].ring.allocator.round > 1
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_a_ring_smaller_than_a_chunk_still_refuses_a_cut_chunk() -> None:
    """A cut chunk's groups land in one region of the whole chunk: a ring smaller than that refuses
    it as it refuses a whole chunk, naming ``ring_bytes``, and the room fails on both sides."""
    ring = 2 * _tensor_bytes(2) * small_layout().num_kv_tensors  # two pages' worth
    async with cluster(small_layout(), 1, 1, **CUT, ring_bytes=ring) as c:
        pages = np.arange(5)
        reasons = await fails_naming(c, 1, pages, pages, "ring_bytes")
        assert reasons == [FailureReason.STAGING, FailureReason.STAGING]
        await run_room(c, 2, np.arange(2), np.arange(2), [1, 1])  # chunks that fit still go
        c.assert_no_leaks()


@pytest.mark.anyio
@pytest.mark.parametrize("side", ["prefill", "decode"])
async def test_abort_while_a_chunks_groups_land_ends_both_sides(side: str) -> None:
    """The decode has counted the first group of chunk 0 and the notifications of the others are
    held back; an abort from either side ends the room ABORTED on both, the held notifications
    that come later change nothing, and the next room on the same pages is exact."""
    room, pages = 30, np.arange(4)
    held = Rule(Fault.STALL, match=matching(m.ChunkLanded, room=room), skip=1, delay_s=0.5)
    async with engines(1, 1, decode_transport=faulty_factory([], notifs=[held]), **CUT) as c:
        patterns.fill(c.prefill[0].pool, room, pages)
        receiver = await c.decode[0].receiver(room, c.bootstrap, pages)
        sender = c.prefill[0].sender(room)
        await sender.send(pages[:2])  # chunk 0 of two: the room cannot end before the abort
        await layers_landed(c, room, 1)
        with anyio.fail_after(10):
            while not held.fired:  # noqa: ASYNC110 - the wrapper's count, no event
                await anyio.sleep(0.002)
        core = c.decode[0].rooms[room].core
        assert isinstance(core, ReceiverRoom) and core.layer_tally is not None
        assert core.layer_tally.layers((0, 0)) == 1  # group 2 went, its notification is held
        assert receiver.poll() is RoomStatus.TRANSFERRING
        with anyio.fail_after(10):
            await (sender if side == "prefill" else receiver).abort()
            for handle in (sender, receiver):
                with pytest.raises(TransferFailed) as info:
                    await handle.wait()
                assert info.value.reason is FailureReason.ABORTED
        await anyio.sleep(0.6)  # the held notifications are delivered to a room that ended
        await run_room(c, room + 1, pages, pages, [2, 2], aux_slot=0)
        c.assert_no_leaks()
