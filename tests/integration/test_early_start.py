"""A held WRITE is started by the worker's completion waiter thread the moment its KV is written
(docs/DECISIONS.md, "A held WRITE is started by the completion waiter's
thread"), and the loop adopts it afterwards. Every test checks the bytes or the failure on both sides,
and that nothing leaked.

The races it opens are pinned here: an abort that reaches the worker while the thread is starting the
WRITE (the room must wait for that WRITE before it ends, on both sides), and a start the transport
refuses on the thread (the room fails with the refusal, and the handle is not leaked).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import anyio
import numpy as np
import pytest

from transfer_engine.errors import FailureReason, TransferFailed, TransportError
from transfer_engine.protocol.rooms import RoomStatus
from transfer_engine.testing import patterns

from .harness import cluster, run_room, small_layout
from .test_layerwise_failures import _first_layer_landed


def _record_starts(poller: object, starts: list[str]) -> None:
    """Wrap the poller's two ways to start a WRITE so that each start records its thread's name."""
    for name in ("start_early", "start_write"):
        real: Callable[..., object] = getattr(poller, name)

        def recorded(*args: object, _real: Callable[..., object] = real, **kwargs: object) -> object:
            starts.append(threading.current_thread().name)
            return _real(*args, **kwargs)

        setattr(poller, name, recorded)


@pytest.mark.anyio
async def test_held_group_is_started_by_the_waiter_thread() -> None:
    """Direct, layer-wise: the group held for its layers is started on the waiter's thread, which then
    looks at its WRITE until it ended; every byte lands."""
    async with cluster(small_layout(), 1, 1, path="direct", layers_per_write=1, trace_steps=4096) as c:
        pages = np.arange(4)
        senders, receivers, later = await _first_layer_landed(c, 80, pages)
        prefill = c.prefill[0]
        assert prefill.poller is not None
        with anyio.fail_after(10):  # the worker holds the group, its WRITE made
            while prefill.leaks()["nixl_handles"] < 1:  # noqa: ASYNC110 - engine state, no event
                await anyio.sleep(0.005)
        starts: list[str] = []
        _record_starts(prefill.poller, starts)
        drives: list[tuple[str, float, bool]] = []
        real_drive = prefill.poller.drive

        def drive(handle: int, limit_s: float) -> bool:
            ended = real_drive(handle, limit_s)
            drives.append((threading.current_thread().name, limit_s, ended))
            return ended

        prefill.poller.drive = drive  # type: ignore[method-assign]
        patterns.fill(prefill.pool, 80, pages)
        later.set()
        with anyio.fail_after(10):
            await senders[0].wait()
            await receivers[0].wait()
        assert patterns.mismatches(c.decode[0].pool, 80, pages, 16) == 0
        assert len(starts) == 1, starts
        early_starts = sum(w.counters["early_starts"] for w in prefill.workers)
        marks = prefill.me.trace.take()
        steps = [step for _, room, step in marks if room == 80]
        assert starts[0].startswith("te-completion-worker-"), starts
        assert early_starts == 1
        # then the same thread looked at the group's WRITE until it ended (early_drive), so that
        # NIXL sent its notification from there (within the limit or not: timing, not checked)
        assert [(name, limit) for name, limit, _ in drives] == [(starts[0], prefill.config.early_drive)]
        assert steps.count("p.driven") == sum(ended for _, _, ended in drives), steps
        # the thread's start, split by the transport's own times: the lock held, transfer() back
        at = {step: ns for ns, room, step in marks if room == 80}
        # and the thread's CPU time inside transfer(), which is part of that call's wall time
        assert at["p.woken"] <= at["p.started"] <= at["p.locked"] <= at["p.transfer_cpu"], at
        assert at["p.transfer_cpu"] <= at["p.transferred"], at
        assert at["p.transferred"] <= at["p.posted"], at
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_only_the_group_that_closes_the_chunk_is_driven() -> None:
    """Two held groups, [0, 1) and [1, 3): the waiter's thread starts both, and looks at the WRITE of
    the closing one only (``early_drive``); every byte lands."""
    async with cluster(small_layout(), 1, 1, path="direct", layers_per_write=1) as c:
        pages = np.arange(4)
        prefill = c.prefill[0]
        assert prefill.poller is not None
        starts: list[str] = []
        _record_starts(prefill.poller, starts)
        drives: list[str] = []
        real_drive = prefill.poller.drive

        def drive(handle: int, limit_s: float) -> bool:
            drives.append(threading.current_thread().name)
            return real_drive(handle, limit_s)

        prefill.poller.drive = drive  # type: ignore[method-assign]
        receiver = await c.decode[0].receiver(81, c.bootstrap, pages)
        sender = prefill.sender(81)
        first, rest = threading.Event(), threading.Event()
        await sender.begin_chunk(pages, last=True)
        await sender.layers_ready(0, 1, ready=first)
        await sender.layers_ready(1, 3, ready=rest)
        with anyio.fail_after(10):  # both held, their WRITEs made
            while prefill.leaks()["nixl_handles"] < 2:  # noqa: ASYNC110 - engine state, no event
                await anyio.sleep(0.005)
        patterns.fill(prefill.pool, 81, pages, layers=(0, 1))
        first.set()
        with anyio.fail_after(10):  # the first group's WRITE started on the thread, and not driven
            while not starts:  # noqa: ASYNC110 - engine state, no event
                await anyio.sleep(0.005)
        patterns.fill(prefill.pool, 81, pages)
        rest.set()
        with anyio.fail_after(10):
            await sender.wait()
            await receiver.wait()
        assert patterns.mismatches(c.decode[0].pool, 81, pages, 16) == 0
        assert len(starts) == 2 and all(name.startswith("te-completion-worker-") for name in starts), starts
        assert drives == [starts[1]], (drives, starts)  # the closing group's only
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_held_chunk_is_started_by_the_waiter_thread() -> None:
    """Direct, a whole chunk sent before its ready event completed: the waiter's thread starts it."""
    async with cluster(small_layout(), 1, 1, path="direct") as c:
        pages = np.arange(6)
        prefill = c.prefill[0]
        patterns.fill(prefill.pool, 81, pages)
        receiver = await c.decode[0].receiver(81, c.bootstrap, pages)
        sender = prefill.sender(81)
        starts: list[str] = []
        _record_starts(prefill.poller, starts)
        written = threading.Event()
        await sender.send(pages, last=True, ready=written)
        with anyio.fail_after(10):  # held, its WRITE made and not started
            while prefill.leaks()["nixl_handles"] < 1:  # noqa: ASYNC110 - engine state, no event
                await anyio.sleep(0.005)
        assert starts == [] and receiver.poll() is not RoomStatus.SUCCESS
        written.set()
        with anyio.fail_after(10):
            await sender.wait()
            await receiver.wait()
        assert patterns.mismatches(c.decode[0].pool, 81, pages, 16) == 0
        assert len(starts) == 1 and starts[0].startswith("te-completion-worker-"), starts
        c.assert_no_leaks()


@pytest.mark.anyio
@pytest.mark.parametrize("side", ["prefill", "decode"])
async def test_abort_while_the_thread_starts_a_group_waits_for_its_write(side: str) -> None:
    """The room is aborted after the waiter's thread claimed a group's WRITE and before its start
    returned. The worker must not answer that job as cancelled (its WRITE goes out): both rooms end
    only after it has ended, ABORTED, and the pages serve the next room."""
    async with cluster(small_layout(), 1, 1, path="direct", layers_per_write=1) as c:
        pages = np.arange(4)
        senders, receivers, later = await _first_layer_landed(c, 82, pages)
        prefill, decode = c.prefill[0], c.decode[0]
        assert prefill.poller is not None
        with anyio.fail_after(10):
            while prefill.leaks()["nixl_handles"] < 1:  # noqa: ASYNC110 - engine state, no event
                await anyio.sleep(0.005)
        entered, gate = threading.Event(), threading.Event()
        real = prefill.poller.start_early

        def gated(handle: int) -> None:  # on the waiter's thread
            entered.set()
            assert gate.wait(10)
            real(handle)

        prefill.poller.start_early = gated  # type: ignore[method-assign]
        patterns.fill(prefill.pool, 82, pages)
        later.set()
        async with anyio.create_task_group() as tg:
            with anyio.fail_after(10):
                while not entered.is_set():  # noqa: ASYNC110 - a thread's event
                    await anyio.sleep(0.005)
                # (a prefill's abort() returns once its room ended: here only after the gate opens)
                tg.start_soon((senders[0] if side == "prefill" else receivers[0]).abort)
            await anyio.sleep(0.3)
            # the WRITE is still being started: neither room may have ended
            assert 82 in prefill.rooms and 82 in decode.rooms
            assert sum(w.layer_jobs for w in prefill.workers) == 1  # held, not answered as cancelled
            assert senders[0].failure is not None  # failed, and not ended: it waits for that WRITE
            gate.set()
            with anyio.fail_after(10):
                for handle in (*senders, *receivers):
                    with pytest.raises(TransferFailed) as info:
                        await handle.wait()
                    assert info.value.reason is FailureReason.ABORTED
        assert sum(w.counters["early_starts"] for w in prefill.workers) == 1
        assert prefill.poller.counters["writes_done"] >= 2  # layer 0's, and the one the thread started
        await run_room(c, 83, pages, pages, [2, 2], aux_slot=0, layers=1)
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_start_refused_on_the_thread_fails_the_room() -> None:
    """The transport refuses the thread's start: the room fails with that refusal on both sides, the
    refusal is counted on the loop, and no handle is left."""
    async with cluster(small_layout(), 1, 1, path="direct", layers_per_write=1) as c:
        pages = np.arange(4)
        senders, receivers, later = await _first_layer_landed(c, 84, pages)
        prefill = c.prefill[0]
        assert prefill.poller is not None
        transport = prefill.poller.transport

        def refused(handle: int) -> None:  # as the transport refuses: the handle released, then raise
            transport.release(handle)
            raise TransportError("injected: WRITE refused at its start")

        prefill.poller.start_early = refused  # type: ignore[method-assign]
        patterns.fill(prefill.pool, 84, pages)
        later.set()
        with anyio.fail_after(10):
            with pytest.raises(TransferFailed, match="injected: WRITE refused") as info:
                await senders[0].wait()
            assert info.value.reason is FailureReason.TRANSPORT
            with pytest.raises(TransferFailed):
                await receivers[0].wait()
        assert prefill.poller.counters["writes_refused"] == 1
        assert sum(w.counters["early_starts"] for w in prefill.workers) == 0
        c.assert_no_leaks()
