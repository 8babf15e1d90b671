"""Layer-wise rooms fail as chunk-level rooms do: an abort between layers (from either side) or a
layer event that never completes ends the room on both sides, nothing lands afterwards, nothing leaks.

Each test stops a room after its first layer group went out and before the rest is ready, lets both
sides end, then makes the remaining layers ready and checks that the decode pages did not change.
"""

from __future__ import annotations

import threading

import anyio
import numpy as np
import pytest
import torch

from transfer_engine.errors import ConfigError, FailureReason, LocalProtocolError, TransferFailed
from transfer_engine.protocol.rooms import RoomStatus
from transfer_engine.testing import patterns

from .harness import Cluster, cluster, layers_landed, run_room, small_layout

PATHS = ["direct", "staged"]


async def _first_layer_landed(c: Cluster, room: int, pages: np.ndarray) -> tuple[list, list, threading.Event]:
    """Open ``room`` P=D=1, send layer 0 of its only chunk; return (senders, receivers, the event of
    layers [1, 3), not set) once layer 0 has landed on the decode."""
    prefill = c.prefill[0].pool
    patterns.fill(prefill, room, pages, layers=(0, 1))
    receivers = [await e.receiver(room, c.bootstrap, pages) for e in c.decode]
    senders = [e.sender(room) for e in c.prefill]
    later = threading.Event()
    await senders[0].begin_chunk(pages, last=True)
    await senders[0].layers_ready(0, 1)
    await senders[0].layers_ready(1, 3, ready=later)  # never set before the room ends
    await layers_landed(c, room, 1)  # the decode room counted layer 0 (staged: it is in the ring region)
    return senders, receivers, later


async def _nothing_lands_after(c: Cluster, room: int, pages: np.ndarray, later: threading.Event) -> None:
    decode = c.decode[0].pool
    before = [t.clone() for t in decode.tensors]
    patterns.fill(c.prefill[0].pool, room, pages)
    later.set()
    await anyio.sleep(0.3)
    assert all(_same(a, b) for a, b in zip(before, decode.tensors, strict=True))
    # layer 1 never landed (direct: layer 0 did, straight into the pages)
    assert not _same(decode.tensors[1][: len(pages) * 4], c.prefill[0].pool.tensors[1][: len(pages) * 4])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality (the pattern's bf16 bits include NaNs, which torch.equal calls unequal)."""
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.anyio
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("side", ["prefill", "decode"])
async def test_abort_between_layers_ends_both_sides(path: str, side: str) -> None:
    async with cluster(small_layout(), 1, 1, path=path, layers_per_write=1) as c:
        pages = np.arange(4)
        senders, receivers, later = await _first_layer_landed(c, 30, pages)
        with anyio.fail_after(10):
            await (senders[0] if side == "prefill" else receivers[0]).abort()
            for handle in (*senders, *receivers):
                with pytest.raises(TransferFailed) as info:
                    await handle.wait()
                assert info.value.reason is FailureReason.ABORTED
        assert receivers[0].poll() is RoomStatus.FAILED and senders[0].poll() is RoomStatus.FAILED
        with pytest.raises(LocalProtocolError, match="layers_ready"):
            await senders[0].layers_ready(1, 3)
        await _nothing_lands_after(c, 30, pages, later)
        await run_room(c, 31, pages, pages, [2, 2], aux_slot=0, layers=1)  # the pages serve the next room
        c.assert_no_leaks()


@pytest.mark.anyio
@pytest.mark.parametrize("path", PATHS)
async def test_layer_event_that_never_completes_times_out_on_both_sides(path: str) -> None:
    async with cluster(small_layout(), 1, 1, path=path, layers_per_write=1, transfer_timeout=1.0) as c:
        pages = np.arange(4)
        senders, receivers, later = await _first_layer_landed(c, 40, pages)
        with anyio.fail_after(10):
            with pytest.raises(TransferFailed) as info:
                await senders[0].wait()
            assert info.value.reason is FailureReason.TRANSFER_TIMEOUT
            with pytest.raises(TransferFailed):
                await receivers[0].wait()
        await _nothing_lands_after(c, 40, pages, later)
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_bad_layer_calls_raise_and_queue_nothing() -> None:
    async with cluster(small_layout(), 1, 1, path="direct", layers_per_write=2) as c:
        pages = np.arange(4)
        patterns.fill(c.prefill[0].pool, 50, pages)
        receiver = await c.decode[0].receiver(50, c.bootstrap, pages)
        sender = c.prefill[0].sender(50)
        with pytest.raises(LocalProtocolError, match="no layer-wise chunk is open"):
            await sender.layers_ready(0, 1)
        await sender.begin_chunk(pages[:2])
        with pytest.raises(LocalProtocolError, match="chunk 0 is still open"):
            await sender.send(pages[2:], last=True)
        with pytest.raises(ConfigError, match=r"layers \[0, 4\)"):
            await sender.layers_ready(0, 4)
        with pytest.raises(ConfigError, match="ready="):
            await sender.layers_ready(0, 1, ready=object())  # type: ignore[arg-type]
        await sender.layers_ready(0, 1)
        with pytest.raises(LocalProtocolError, match="must start at layer 1"):
            await sender.layers_ready(0, 2)
        await sender.layers_ready(1, 3)
        await sender.send(pages[2:], last=True)  # a chunk-level send after a closed layer-wise chunk
        with anyio.fail_after(10):
            await sender.wait()
            await receiver.wait()
        assert patterns.mismatches(c.decode[0].pool, 50, pages, 16) == 0
        c.assert_no_leaks()


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["staged", "host"])
async def test_staged_group_is_scattered_before_the_chunk_is_complete(path: str) -> None:
    """On the staged paths a landed layer group is copied out of the ring at once: layer 0 is in the
    decode pages while layers 1-2 are not ready yet; then the chunk completes, every byte right."""
    async with cluster(small_layout(), 1, 1, path=path, layers_per_write=1) as c:
        pages, room = np.arange(4), 60
        senders, receivers, later = await _first_layer_landed(c, room, pages)
        decode, prefill = c.decode[0].pool, c.prefill[0].pool
        rows = len(pages) * prefill.layout.page_size
        k0, v0, k1 = 0, prefill.layout.num_layers, 1
        with anyio.fail_after(10):
            while not all(_same(decode.tensors[t][:rows], prefill.tensors[t][:rows]) for t in (k0, v0)):  # noqa: ASYNC110 - engine state, no event
                await anyio.sleep(0.005)
        assert receivers[0].poll() is RoomStatus.TRANSFERRING
        patterns.fill(prefill, room, pages)  # layers 1-2 written now, but not reported ready yet
        await anyio.sleep(0.05)
        assert not _same(decode.tensors[k1][:rows], prefill.tensors[k1][:rows])
        later.set()
        with anyio.fail_after(10):
            await senders[0].wait()
            await receivers[0].wait()
        assert patterns.mismatches(decode, room, pages, rows) == 0
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_held_group_write_is_made_before_its_layers_and_started_after() -> None:
    """Direct path: a group whose layers are not ready has its WRITE made at once (descriptors checked
    and prepared: one NIXL handle, nothing posted), and only started once they are; every byte lands."""
    async with cluster(small_layout(), 1, 1, path="direct", layers_per_write=1) as c:
        pages = np.arange(4)
        senders, receivers, later = await _first_layer_landed(c, 60, pages)
        prefill = c.prefill[0]
        assert prefill.poller is not None
        with anyio.fail_after(10):  # the worker took the held job and made its WRITE
            while prefill.leaks()["nixl_handles"] < 1:  # noqa: ASYNC110 - engine state, no event
                await anyio.sleep(0.005)
        posted = prefill.poller.counters["writes_posted"]
        await anyio.sleep(0.1)
        assert prefill.poller.counters["writes_posted"] == posted  # made, not started
        assert receivers[0].poll() is RoomStatus.TRANSFERRING
        patterns.fill(prefill.pool, 60, pages)
        later.set()
        with anyio.fail_after(10):
            await senders[0].wait()
            await receivers[0].wait()
        assert prefill.poller.counters["writes_posted"] == posted + 1  # the group [1, 3): the prepared one
        assert patterns.mismatches(c.decode[0].pool, 60, pages, 16) == 0
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_group_whose_layers_complete_while_its_write_is_made_is_started() -> None:
    """Direct path: the layers of a held group complete while the worker makes its WRITE (the window
    between the worker seeing them pending and asking to be woken). The group must still be started:
    before the fix the worker held it with nothing left to wake it, and the room never ended (seen on
    cold GPU machines, where making a WRITE is slow)."""
    async with cluster(small_layout(), 1, 1, path="direct", layers_per_write=1) as c:
        pages = np.arange(4)
        prefill = c.prefill[0]
        assert prefill.poller is not None
        patterns.fill(prefill.pool, 62, pages)
        receivers = [await e.receiver(62, c.bootstrap, pages) for e in c.decode]
        sender = prefill.sender(62)
        later = threading.Event()
        make = prefill.poller.prepare_from_table  # a direct layer group is made from its pair's tables
        made: list[int] = []

        def make_then_complete(table, src_index, dst_index, spec):  # the real make, then the layers complete
            handle = make(table, src_index, dst_index, spec)
            made.append(handle)
            later.set()
            return handle

        prefill.poller.prepare_from_table = make_then_complete  # type: ignore[method-assign]
        await sender.begin_chunk(pages, last=True)
        await sender.layers_ready(0, 3, ready=later)
        with anyio.fail_after(10):
            await sender.wait()
            await receivers[0].wait()
        assert made, "the group was not held: the test did not reach the window it checks"
        assert patterns.mismatches(c.decode[0].pool, 62, pages, 16) == 0
        c.assert_no_leaks()
