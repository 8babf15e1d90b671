import random

import anyio
import anyio.lowlevel
import pytest

from transfer_engine.errors import FailureReason, TransferFailed
from transfer_engine.protocol.rooms import RoomStatus
from transfer_engine.testing import patterns

from .harness import cluster, run_room, shuffled_pages, small_layout


@pytest.mark.anyio
async def test_one_room_1_1() -> None:
    rng = random.Random(0)
    async with cluster(small_layout(), 1, 1) as c:
        await run_room(c, 1, shuffled_pages(rng, 64, 6), shuffled_pages(rng, 64, 6), [2, 4], aux_slot=3)
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_wait_bootstrapped_returns_when_every_decode_rank_asked() -> None:
    """A prefill room opened before its decode ranks ask: ``wait_bootstrapped`` returns only once
    both have asked, then the room is WaitingForInput; a decode handle has left Bootstrapping when
    ``receiver()`` returns."""
    rng = random.Random(1)
    async with cluster(small_layout(), 1, 2) as c:
        sender = c.prefill[0].sender(5)
        returned = anyio.Event()

        async def waiter() -> None:
            await sender.wait_bootstrapped()
            returned.set()

        src, dst = shuffled_pages(rng, 64, 3), shuffled_pages(rng, 64, 3)
        patterns.fill(c.prefill[0].pool, 5, src)
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            receivers = [await c.decode[0].receiver(5, c.bootstrap, dst)]
            await receivers[0].wait_bootstrapped()  # at once: receiver() returned past Bootstrapping
            for _ in range(50):  # the first decode rank's request lands; the room still needs the second
                await anyio.lowlevel.checkpoint()
            assert sender.poll() is RoomStatus.BOOTSTRAPPING and not returned.is_set()
            receivers.append(await c.decode[1].receiver(5, c.bootstrap, dst))
            with anyio.fail_after(10):
                await returned.wait()
        assert sender.poll() is RoomStatus.WAITING_FOR_INPUT
        await sender.send(src, last=True)
        with anyio.fail_after(10):
            await sender.wait()
            for r in receivers:
                await r.wait()
        tokens = len(dst) * small_layout().page_size
        assert all(patterns.mismatches(e.pool, 5, dst, tokens) == 0 for e in c.decode)
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_wait_bootstrapped_raises_the_failure_of_a_room_aborted_while_bootstrapping() -> None:
    async with cluster(small_layout(), 1, 1) as c:
        sender = c.prefill[0].sender(6)
        async with anyio.create_task_group() as tg:

            async def abort_soon() -> None:
                await anyio.lowlevel.checkpoint()
                await sender.abort("the request was cancelled")

            tg.start_soon(abort_soon)
            with anyio.fail_after(10), pytest.raises(TransferFailed) as failed:
                await sender.wait_bootstrapped()
        assert failed.value.reason is FailureReason.ABORTED
        assert "the request was cancelled" in failed.value.detail
        c.assert_no_leaks()
