"""The layer groups of a chunk share descriptor lists prepared once for the chunk.

The transport's part (``prepare_lists`` / ``prepare_indexed`` / ``close_lists``) on real NIXL: the
WRITEs made from an index move exactly those descriptors, the lists outlive ``close_lists`` until
the last WRITE made from them is released, and a bad index is refused with nothing made. The
worker's part: a direct or slice layer-wise room prepares lists once per chunk and decode rank,
every byte lands, nothing is left open (the leak check counts lists as live handles).
"""

from __future__ import annotations

import dataclasses
import threading

import anyio
import numpy as np
import pytest
import torch

from transfer_engine.errors import TransportError
from transfer_engine.testing import patterns
from transfer_engine.transport.nixl import WriteSpec, XferState

from .harness import cluster, run_room, small_layout

pytestmark = pytest.mark.timeout(60)

PIECE = 256
"""Bytes of each descriptor in the transport test."""


@pytest.mark.anyio
async def test_writes_made_from_an_index_move_those_descriptors_and_release_the_lists_last() -> None:
    async with cluster(small_layout(), 1, 1) as c:
        prefill, decode = c.prefill[0], c.decode[0]
        await decode.connect(c.bootstrap)  # the handshake gives the prefill the decode's regions
        transport = prefill.poller.transport
        src_t, dst_t = prefill.pool.tensors[0], decode.pool.tensors[0]
        src_bytes = src_t.view(-1).view(torch.uint8)  # on the pool's device (CPU or CUDA)
        dst_bytes = dst_t.view(-1).view(torch.uint8)
        # four pieces of distinct bytes at gapped offsets, to four other gapped offsets
        n = 4
        src_off = np.array([0, 3, 6, 9], dtype=np.uint64) * np.uint64(PIECE)
        dst_off = np.array([10, 1, 7, 4], dtype=np.uint64) * np.uint64(PIECE)
        payload = ((torch.arange(n * PIECE) % 251).to(torch.uint8) ^ 0x5A).reshape(n, PIECE)
        for i in range(n):
            src_bytes[int(src_off[i]) : int(src_off[i]) + PIECE] = payload[i].to(src_bytes.device)
        dst_bytes.zero_()
        if dst_bytes.is_cuda:
            torch.cuda.synchronize()
        whole = WriteSpec(
            decode.agent_name,
            prefill.pool.mem_type,
            np.uint64(src_t.data_ptr()) + src_off,
            np.uint64(dst_t.data_ptr()) + dst_off,
            np.full(n, PIECE, dtype=np.uint64),
            prefill.pool.device_id,
            b"",
        )
        lists = transport.prepare_lists(whole)
        assert transport.live_handles() == 1  # the lists alone

        def part(index: list[int], peer: str = decode.agent_name) -> tuple[np.ndarray, WriteSpec]:
            at = np.array(index, dtype=np.int64)
            return at, dataclasses.replace(
                whole, peer=peer, src=whole.src[at], dst=whole.dst[at], length=whole.length[at]
            )

        for bad in ([4], [-1], []):
            with pytest.raises(TransportError, match="outside lists"):
                transport.prepare_indexed(lists, np.array(bad, dtype=np.int64), part([0])[1])
            assert transport.live_handles() == 1, bad
        with pytest.raises(TransportError, match="were prepared for"):
            transport.prepare_indexed(lists, *part([0], peer="another-agent"))
        assert transport.live_handles() == 1
        handles = [transport.prepare_indexed(lists, *part(idx)) for idx in ([0, 2], [3])]
        transport.close_lists(lists)  # given up while WRITEs made from it still exist
        assert transport.live_handles() == 3
        with pytest.raises(TransportError, match="no open shared lists"):
            transport.prepare_indexed(lists, *part([1]))
        assert transport.live_handles() == 3
        for h in handles:
            transport.start_write(h)
        with anyio.fail_after(5):
            for h in handles:
                while (state := transport.state(h)) is XferState.PROC:  # noqa: ASYNC110 (NIXL has no event)
                    await anyio.sleep(0.001)
                assert state is XferState.DONE
        transport.release(handles[0])
        assert transport.live_handles() == 2  # one WRITE and the lists it was made from
        transport.release(handles[1])
        assert transport.live_handles() == 0
        for i in range(n):
            got = dst_bytes[int(dst_off[i]) : int(dst_off[i]) + PIECE].cpu()
            if i == 1:  # descriptor 1 was in no WRITE
                assert not got.any()
            else:
                assert torch.equal(got, payload[i]), i
        c.assert_no_leaks()


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("path", "P", "D"), [("direct", 1, 1), ("direct", 2, 2), ("slice", 1, 2), ("slice", 2, 1)]
)
async def test_a_layerwise_room_prepares_lists_once_per_chunk_and_decode_rank(
    path: str, P: int, D: int
) -> None:
    """Without descriptor tables (a cap of one descriptor refuses every pair's: the per-WRITE planning
    they fall back to)."""
    async with cluster(small_layout(), P, D, path=path, layers_per_write=1, table_max_descriptors=1) as c:
        rng = np.random.default_rng(7)
        src, dst = rng.permutation(64)[:6], rng.permutation(64)[:6]
        await run_room(c, 71, src, dst, [2, 4], layers=1)  # two chunks of three one-layer groups
        lists = sum(e.poller.counters["lists_prepared"] for e in c.prefill)
        posted = sum(e.poller.counters["writes_posted"] for e in c.prefill)
        # one set of lists per chunk and decode rank written to, each made into its 3 one-layer groups
        assert lists >= 2 and lists % 2 == 0
        assert posted == 3 * lists
        assert sum(e.poller.counters["tables_prepared"] for e in c.prefill) == 0
        assert all(
            w.counters["tables_refused"] >= 1 for e in c.prefill for w in e.workers if w.direct.tables.reasons
        )
        c.assert_no_leaks()


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("path", "P", "D"), [("direct", 1, 1), ("direct", 2, 2), ("slice", 1, 2), ("slice", 2, 1)]
)
async def test_a_layerwise_room_is_made_from_tables_prepared_once_per_decode_rank(
    path: str, P: int, D: int
) -> None:
    """With descriptor tables (the default): no chunk prepares lists of its own; each (prefill rank,
    decode rank) pair written to prepares its tables once, for both rooms' every group."""
    async with cluster(small_layout(), P, D, path=path, layers_per_write=1) as c:
        rng = np.random.default_rng(7)
        for room in (74, 75):
            src, dst = rng.permutation(64)[:6], rng.permutation(64)[:6]
            await run_room(c, room, src, dst, [2, 4], layers=1)  # two chunks of three one-layer groups
        posted = sum(e.poller.counters["writes_posted"] for e in c.prefill)
        pairs = sum(e.poller.transport.table_stats["prepared"] for e in c.prefill)
        assert sum(e.poller.counters["lists_prepared"] for e in c.prefill) == 0
        assert sum(e.poller.counters["tables_prepared"] for e in c.prefill) == pairs
        assert pairs == sum(e.poller.transport.live_tables() for e in c.prefill)
        assert pairs >= max(P, D)  # every prefill rank writes to some decode rank, every decode rank hears
        assert posted == 2 * 2 * 3 * pairs  # two rooms of two chunks of three groups, per pair
        c.assert_no_leaks()
    assert all(e.poller.transport.live_tables() == 0 for e in c.prefill)


@pytest.mark.anyio
async def test_the_decode_poller_predicts_each_senders_next_layer_group() -> None:
    """From a sender's second group of a chunk on, the decode's poller opens a quick window around the
    next one's expected landing (:mod:`transfer_engine.protocol.cadence`); the chunk's last group
    forgets the sender's room. Two prefill ranks: each has its own spacing. Each group is reported
    written only once the one before it was heard by the decode, so the groups land in order (the
    prediction is made for groups that do: two WRITEs in flight may land either way round, which
    changes the count, not the bytes). Rooms are byte-checked."""
    async with cluster(small_layout(), 2, 1, layers_per_write=1) as c:
        rng = np.random.default_rng(5)
        src, dst = rng.permutation(64)[:4], rng.permutation(64)[:4]
        room, poller = 73, c.decode[0].poller
        receiver = await c.decode[0].receiver(room, c.bootstrap, dst)
        senders = [engine.sender(room) for engine in c.prefill]
        num_layers = c.prefill[0].pool.layout.num_layers
        heard = poller.counters["notifs"]
        for sender, engine in zip(senders, c.prefill, strict=True):
            for pages, last in ((src[:1], False), (src[1:], True)):  # two chunks of three one-layer groups
                await sender.begin_chunk(pages, last=last)
                for layer in range(num_layers):
                    written = threading.Event()
                    await sender.layers_ready(layer, layer + 1, ready=written)
                    upto = src[: 1 if not last else 4]
                    patterns.fill(engine.pool, room, upto, layers=(layer, layer + 1))
                    written.set()
                    heard += 1
                    with anyio.fail_after(10):
                        while poller.counters["notifs"] < heard:  # noqa: ASYNC110 - engine state, no event
                            await anyio.sleep(0.001)
        with anyio.fail_after(30):
            for s in senders:
                await s.wait()
            await receiver.wait()
        assert patterns.mismatches(c.decode[0].pool, room, dst, 4 * c.decode[0].pool.layout.page_size) == 0
        # per chunk and prefill rank: group [1, 2) opens the window for [2, 3), which closes the chunk
        assert poller.counters["cadence_windows"] == 2 * 2
        assert poller.cadence is not None and poller.cadence.keys == 0
        assert c.prefill[0].poller.cadence is None  # a prefill rank hears no layer groups
        c.assert_no_leaks()
