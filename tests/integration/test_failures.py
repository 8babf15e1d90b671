"""Failures reach every rank of a room promptly: no decode rank waits for a prefill that gave up."""

from __future__ import annotations

import contextlib

import anyio
import numpy as np
import pytest

from transfer_engine.errors import FailureReason, LocalProtocolError, TransferFailed
from transfer_engine.protocol.rooms import RoomStatus
from transfer_engine.testing import patterns

from .harness import cluster, run_room, small_layout


@pytest.mark.anyio
async def test_room_never_opened_by_prefill_fails_the_decode() -> None:
    """The decode asks for a room the live prefill never opens: its request stays leased in the prefill's
    stash (a queued request waits, docs/CONFIGURATION.md ``room_lease``), and ``waiting_timeout`` ends
    it, not never; its abort clears the prefill's stash."""
    async with cluster(
        small_layout(), 2, 1, waiting_timeout=0.6, room_lease=0.4, heartbeat_interval=0.2
    ) as c:
        receiver = await c.decode[0].receiver(5, c.bootstrap, np.arange(3))
        with anyio.fail_after(5):
            waited = "room 5 spent more than 0.6 s in WAITING_FOR_INPUT"
            with pytest.raises(TransferFailed, match=waited) as info:
                await receiver.wait()
        assert info.value.reason is FailureReason.INPUT_TIMEOUT
        assert not any(e.counters["stash_expired"] for e in c.prefill)  # renewed past room_lease
        await run_room(c, 6, np.arange(3), np.arange(3), [2, 1])  # the same pages serve the next room
        c.assert_no_leaks()


@pytest.mark.anyio
@pytest.mark.parametrize("requested", [True, False], ids=["requested", "no-request"])
async def test_a_room_the_decode_aborted_before_the_prefill_opened_it_fails_once_opened(
    requested: bool,
) -> None:
    """The decode aborts a room (after asking for it, or without ever asking) before the prefill
    opens it: sender() then fails the room at once, ABORTED, instead of holding the prefill's pages
    until bootstrap_timeout for a request that can no longer come (vLLM's prefill once kept a
    cancelled request's blocks that long)."""
    async with cluster(small_layout(), 2, 1, bootstrap_timeout=120) as c:
        receiver = await c.decode[0].receiver(7, c.bootstrap, np.arange(3) if requested else None)
        if requested:
            with anyio.fail_after(30):
                while not all(e.leaks()["stashed"] == 1 for e in c.prefill):  # noqa: ASYNC110 (no event for it)
                    await anyio.sleep(0.01)
        await receiver.abort()  # returns once every prefill rank acknowledged the Abort
        senders = [e.sender(7) for e in c.prefill]
        with anyio.fail_after(30):  # a hang guard far below bootstrap_timeout
            for rank, sender in enumerate(senders):
                with pytest.raises(TransferFailed, match=f"before prefill rank {rank} opened") as info:
                    await sender.wait()
                assert info.value.reason is FailureReason.ABORTED
        assert not any(e.counters["stash_expired"] for e in c.prefill)
        await run_room(c, 8, np.arange(3), np.arange(3), [2, 1])
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_layer_wise_sends_into_a_room_that_opened_failed_leave_the_engine_running() -> None:
    """A layer-wise chunk begun and reported on a room that fails at once (its decode aborted first):
    the chunk's layers, queued behind the refused chunk, are refused too. (Regression: the room
    actor raised KeyError on them, which stopped the whole prefill engine: vLLM's worker died.)"""
    async with cluster(small_layout(), 1, 1, bootstrap_timeout=120) as c:
        layers = c.prefill[0].pool.layout.num_layers
        for room in range(20, 30):  # the room actor may run before, between or after the two calls
            receiver = await c.decode[0].receiver(room, c.bootstrap)
            await receiver.abort()
            sender = c.prefill[0].sender(room)
            with contextlib.suppress(LocalProtocolError):  # refused if the room already ended
                await sender.begin_chunk(np.arange(2), last=True)
                await sender.layers_ready(0, layers)
            with anyio.fail_after(30), pytest.raises(TransferFailed) as info:
                await sender.wait()
            assert info.value.reason is FailureReason.ABORTED
        await run_room(c, 40, np.arange(3), np.arange(3), [2, 1])
        c.assert_no_leaks()


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["slice", "staged"])
async def test_one_decode_rank_aborting_fails_the_other(path: str) -> None:
    """D=2: decode rank 0 aborts; decode rank 1 learns it from the prefill instead of waiting."""
    async with cluster(small_layout(), 2, 2, path=path) as c:
        pages = np.arange(4)
        r0 = await c.decode[0].receiver(9, c.bootstrap, pages)
        r1 = await c.decode[1].receiver(9, c.bootstrap, pages)
        senders = [e.sender(9) for e in c.prefill]
        await r0.abort()
        with anyio.fail_after(5):
            with pytest.raises(TransferFailed) as info:
                await r1.wait()
            assert info.value.reason is FailureReason.ABORTED
            for s in senders:
                with pytest.raises(TransferFailed):
                    await s.wait()
        assert r0.poll() is RoomStatus.FAILED
        # after abort() returned, the same pages take another room and every byte verifies
        for e in c.prefill:
            patterns.fill(e.pool, 10, pages)
        await run_room(c, 10, pages, pages, [1, 3], aux_slot=1)
        c.assert_no_leaks()
