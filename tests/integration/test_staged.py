"""The staged paths under pressure: a tiny ring, differing page sizes, chunks that cannot be placed."""

from __future__ import annotations

import functools
import random
import threading

import anyio
import numpy as np
import pytest
import torch

from transfer_engine.actors.scatter import ScatterActor
from transfer_engine.errors import FailureReason, TransferFailed
from transfer_engine.kernels import as_kv_table, gather_heads
from transfer_engine.memory.layout import KVLayout
from transfer_engine.memory.staging import allocate_staging
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.staging import writer_block_bytes
from transfer_engine.runtime.mail import Mailbox, RoomMail, RoomOpened, Scattered, ScatterJob
from transfer_engine.runtime.ports import RoomBoard
from transfer_engine.testing import patterns

from .harness import DEVICE, cluster, make_pool, run_room, shuffled_pages, small_layout

# small_layout(): 3 layers, 8 heads of 16 bf16 -> one token of all 8 heads over K and V is 1536 B.
TOKEN_BYTES = 6 * 8 * 16 * 2


async def _rooms(c, rng: random.Random, rooms: int, max_pages: int, first_room: int = 100) -> None:  # type: ignore[no-untyped-def]
    src_free = shuffled_pages(rng, 64, 64).tolist()
    dst_free = shuffled_pages(rng, 64, 64).tolist()
    async with anyio.create_task_group() as tg:
        for room in range(rooms):
            n = rng.randint(1, max_pages)
            chunks: list[int] = []
            left = n
            while left:
                chunks.append(rng.randint(1, min(left, 3)))
                left -= chunks[-1]
            src, dst = np.array(src_free[:n]), np.array(dst_free[:n])
            del src_free[:n], dst_free[:n]
            tg.start_soon(functools.partial(run_room, c, first_room + room, src, dst, chunks, aux_slot=room))


@pytest.mark.anyio
@pytest.mark.parametrize(("P", "D"), [(2, 1), (4, 2), (1, 2)])
async def test_tiny_ring_parks_chunks_and_completes(P: int, D: int) -> None:
    """A ring of two chunks, many rooms and writers interleaved: chunks wait on the watermark, all finish."""
    page_size = 4
    ring = 2 * 3 * page_size * TOKEN_BYTES // D  # two chunks of 3 pages for this decode rank's heads
    rng = random.Random(P * 10 + D)
    async with cluster(small_layout(), P, D, path="staged", ring_bytes=ring) as c:
        await _rooms(c, rng, rooms=6, max_pages=9)
        c.assert_no_leaks()
        waits = sum(w.counters["watermark_waits"] for e in c.prefill for w in e.workers)
        assert waits > 0, "the tiny ring never made a chunk wait for the watermark"
        for engine in c.decode:
            assert engine.ring is not None and engine.ring.allocator.round > 1


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("P", "D", "path", "layers"),
    [(2, 1, "staged", 0), (1, 2, "staged", 0), (1, 1, "staged", 0)]
    + [(2, 1, "staged", 1), (1, 2, "host", 2), (1, 1, "slice", 1)],
)
async def test_page_sizes_differ(P: int, D: int, path: str, layers: int) -> None:
    """Prefill pages of 16 tokens, decode pages of 64: the staged path moves token slots (also
    layer-wise, ``layers`` per ``layers_ready``, one layer per WRITE)."""
    rng = random.Random(7)
    async with cluster(
        small_layout(page_size=16),
        P,
        D,
        path=path,
        decode_layout=small_layout(page_size=64),
        num_pages=32,
        layers_per_write=1,
    ) as c:
        for room in range(3):
            n = rng.randint(1, 12)  # prefill pages; the decode needs ceil(n / 4) of its pages
            src = shuffled_pages(rng, 32, n)
            dst = shuffled_pages(rng, 32, -(-n // 4))
            chunks = [n // 2, n - n // 2] if n > 1 else [1]
            await run_room(c, 10 + room, src, dst, chunks, aux_slot=room, layers=layers)
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_chunk_larger_than_ring_fails_naming_ring_bytes() -> None:
    ring = 2 * 4 * TOKEN_BYTES  # two pages' worth
    async with cluster(small_layout(), 2, 1, path="staged", ring_bytes=ring) as c:
        src, dst = np.arange(5), np.arange(5)
        for engine in c.prefill:
            patterns.fill(engine.pool, 1, src)
        receiver = await c.decode[0].receiver(1, c.bootstrap, dst)
        senders = [engine.sender(1) for engine in c.prefill]
        for s in senders:
            await s.send(src, last=True)
        with anyio.fail_after(10):
            for handle in [receiver, *senders]:
                with pytest.raises(TransferFailed, match="ring_bytes") as info:
                    await handle.wait()
                assert info.value.reason is FailureReason.STAGING
        # the ring still serves chunks that fit
        await run_room(c, 2, np.arange(2), np.arange(2), [1, 1])
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_chunk_larger_than_staging_buffer_fails_naming_staging_bytes() -> None:
    async with cluster(small_layout(), 2, 1, path="staged", staging_bytes=4 * TOKEN_BYTES) as c:
        src, dst = np.arange(4), np.arange(4)
        receiver = await c.decode[0].receiver(3, c.bootstrap, dst)
        senders = [engine.sender(3) for engine in c.prefill]
        for s in senders:
            await s.send(src, last=True)
        with anyio.fail_after(10):
            for s in senders:
                with pytest.raises(TransferFailed, match="staging_bytes") as info:
                    await s.wait()
                assert info.value.reason is FailureReason.STAGING
            with pytest.raises(TransferFailed, match="staging_bytes"):
                await receiver.wait()
        c.assert_no_leaks()


@pytest.mark.anyio
@pytest.mark.parametrize("grant", [True, False])
async def test_first_chunk_takes_the_region_granted_with_the_request(grant: bool) -> None:
    """Chunk 0 of a staged room is written into the region its TransferRequest carried, without a
    StagingRequest: a whole-room chunk, a chunk smaller than the room (the region is sized for the
    room), a layer-wise one. Later chunks ask. With ``grant_with_request=False`` every chunk asks."""
    async with cluster(small_layout(), 2, 1, path="staged", grant_with_request=grant) as c:
        await run_room(c, 1, np.arange(4), np.arange(4), [4], aux_slot=1)
        await run_room(c, 2, np.arange(4, 10), np.arange(4, 10), [2, 2, 2])
        await run_room(c, 3, np.arange(10, 13), np.arange(10, 13), [3], layers=1)
        ahead = sum(w.counters["granted_ahead"] for e in c.prefill for w in e.workers)
        asked = sum(w.counters["staging_requests"] for e in c.prefill for w in e.workers)
        assert (ahead, asked) == ((6, 4) if grant else (0, 10))
        c.assert_no_leaks()


def _waiter_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("te-completion-")]


@pytest.mark.anyio
async def test_held_layer_jobs_wake_through_the_completion_waiter() -> None:
    """A layer-wise chunk whose layers are written only once the workers hold its job: the
    ``threading.Event`` wakes them through their completion waiter's thread. Bytes checked."""
    async with cluster(small_layout(), 2, 1, path="staged") as c:
        # one per worker (2 per prefill engine), and the decode's scatter actor when it has a CUDA stream
        assert len(_waiter_threads()) == 2 * 2 + (DEVICE == "cuda")
        src, dst = np.arange(3), np.arange(3)
        receiver = await c.decode[0].receiver(4, c.bootstrap, dst)
        written = threading.Event()
        for engine in c.prefill:
            sender = engine.sender(4)
            await sender.begin_chunk(src, last=True)
            await sender.layers_ready(0, engine.pool.layout.num_layers, ready=written)
        workers = [w for e in c.prefill for w in e.workers]
        with anyio.fail_after(10):
            while sum(w.layer_jobs for w in workers) < 2:  # noqa: ASYNC110 - observing the workers
                await anyio.sleep(0.001)
        for engine in c.prefill:
            patterns.fill(engine.pool, 4, src)
        written.set()
        with anyio.fail_after(30):
            await receiver.wait()
        assert patterns.mismatches(c.decode[0].pool, 4, dst, 3 * 4) == 0
        counters = [w.completions.counters for w in workers]
        handed, polled = sum(k["handed"] for k in counters), sum(k["polled"] for k in counters)
        assert handed > 0 and polled == 0
        c.assert_no_leaks()
    assert not _waiter_threads()


@pytest.mark.anyio
async def test_region_granted_with_the_request_is_freed_when_the_room_fails_first() -> None:
    """A room aborted before its prefill sends anything frees the region its request carried; the
    ring then serves the next rooms."""
    async with cluster(small_layout(), 2, 1, path="staged") as c:
        ring = c.decode[0].ring
        assert ring is not None
        receiver = await c.decode[0].receiver(5, c.bootstrap, np.arange(4))
        assert ring.live() == 1  # chunk 0's region, placed when the room opened
        # a writer that asks for chunk 0 anyway is refused: it must write where its request said
        ask = m.StagingRequest(
            agent=c.prefill[0].agent_name, room=5, chunk_id=0, sender=0, page_start=0, num_pages=4, tokens=16
        )
        granted, _, detail = await ring._place(ask)
        assert granted is None and "granted with the TransferRequest" in detail
        assert ring.live() == 1
        await receiver.abort("the scheduler dropped the request")
        with anyio.fail_after(10), pytest.raises(TransferFailed):
            await receiver.wait()
        assert ring.live() == 0  # wait() returns once the room's regions are freed
        await run_room(c, 6, np.arange(4), np.arange(4), [4])
        c.assert_no_leaks()


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("path", "P", "D", "offset", "match"),
    [
        ("direct", 1, 1, 0, "the path is not staged"),
        ("staged", 2, 4, 0, "this rank writes nothing there"),  # prefill rank 1 writes nothing to decode 0
        ("staged", 1, 1, 1 << 40, "outside its ring"),
    ],
)
async def test_a_bad_region_granted_with_the_request_fails_the_room_naming_it(
    path: str, P: int, D: int, offset: int, match: str
) -> None:
    async with cluster(small_layout(), P, D, path="staged") as c:
        decode, prefill = c.decode[0], c.prefill[P - 1]
        await decode.connect(c.bootstrap)
        sender = prefill.sender(7)
        spec = [m.SliceSpec(0, 0, 0, 8 // D)] if P == 1 else []
        request = m.TransferRequest(
            agent=decode.agent_name, room=7, decode_rank=0, decode_tp=D, path=path, dst_pages=[0, 1],
            aux_slot=None, slices=spec, first_region=m.FirstRegion(0, 0, offset, 1024, 0, 1024, 8),
        )  # fmt: skip
        decode.control.send(prefill.endpoint, request)
        with anyio.fail_after(10), pytest.raises(TransferFailed, match=match) as info:
            await sender.wait()
        assert info.value.reason is FailureReason.PROTOCOL
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_slow_staging_allocation_does_not_stall_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill worker allocates its staging buffer on first use; pinning GBs takes seconds (5.2 s
    seen for 8.6 GB), longer than a peer's lease. The allocation (here the real one, made 1.5 s slow)
    must not stall the event loop: a task ticking every 10 ms on it never waits long, and the room
    succeeds."""
    import time

    from transfer_engine.actors.worker import staged

    real = staged.allocate_staging
    calls: list[int] = []

    def slow(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(1.5)
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(staged, "allocate_staging", slow)
    gaps: list[float] = []

    async def tick(stop: anyio.Event) -> None:
        last = time.monotonic()
        while not stop.is_set():
            await anyio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    async with cluster(small_layout(), 2, 1, path="staged") as c:
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(tick, stop)
            await run_room(c, 70, np.arange(4), np.arange(4), [2, 2])
            stop.set()
        assert calls, "no staging buffer was allocated: the test did not exercise the slow allocation"
        assert max(gaps) < 1.0, f"the loop stalled {max(gaps):.2f} s"
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_host_writes_spread_over_posting_threads_land_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """With NIXL posting threads (``num_threads`` x ``split_batch_size``), a staged WRITE out of host
    memory is cut into pieces listed out of memory order (transport.nixl.spread): every byte lands,
    the notification comes once, after the last piece. (On the GPU machine the threads copy the
    pieces side by side; this box's NIXL build posts them in turn, which checks the cut, not the
    speed: docs/PERF.md has the figures.)"""
    from transfer_engine.transport import nixl

    real, cuts = nixl.spread, []

    def spread(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = real(*args, **kwargs)
        cuts.append((len(args[2]), len(out[2])))
        return out

    monkeypatch.setattr(nixl, "spread", spread)
    layout = KVLayout(num_layers=4, num_heads=8, head_dim=128, dtype=torch.bfloat16, page_size=16)
    params = {"num_threads": "2", "split_batch_size": "2"}
    async with cluster(layout, 1, 1, path="host", nixl_params=params) as c:  # staging in host memory
        prefill = c.prefill[0]
        assert prefill.poller is not None and prefill.poller.transport._host_pieces == 4  # type: ignore[attr-defined]
        for room in (80, 81):  # chunks of 1 MiB: four pieces each
            await run_room(c, room, np.arange(8) + 8 * (room - 80), np.arange(8), [4, 4])
        assert (1, 4) in cuts, f"no WRITE was cut into the threads' pieces: {cuts}"
        c.assert_no_leaks()


@pytest.mark.anyio
@pytest.mark.skipif(
    DEVICE != "cuda", reason="a chunk's ready event is a CUDA event (CPU chunks are written at send())"
)
@pytest.mark.parametrize("path", ["direct", "staged"])
async def test_a_chunk_whose_kv_is_not_written_yet_does_not_hold_the_next_one(path: str) -> None:
    """Room 1's chunk is ready only after a ~0.2 s kernel; room 2 goes to the same decode peer,
    hence the same worker, and is ready at once. Room 2 must be posted while room 1 waits for its
    KV: neither the worker's task nor (staged) its stream may wait for room 1 first (the old worker
    waited for room 1's event, or for a gather ordered after it). Every byte checked."""
    layout = small_layout()
    async with cluster(layout, 1, 1, path=path, trace_steps=10_000) as c:
        engine = c.prefill[0]
        slow, fast = torch.cuda.Stream(engine.pool.device), torch.cuda.Stream(engine.pool.device)
        receivers = [
            await c.decode[0].receiver(r, c.bootstrap, np.arange(10 * r, 10 * r + 3)) for r in (1, 2)
        ]
        with torch.cuda.stream(slow):
            patterns.fill(engine.pool, 1, np.arange(3))  # (its uploads wait for this stream)
            torch.cuda._sleep(300_000_000)  # send() records its ready event after this kernel
            await engine.sender(1).send(np.arange(3), last=True)
        with torch.cuda.stream(fast):
            patterns.fill(engine.pool, 2, np.arange(3, 6))
            await engine.sender(2).send(np.arange(3, 6), last=True)
        with anyio.fail_after(30):
            for receiver in receivers:
                await receiver.wait()
        marks = engine.me.trace.take()
        first = {(room, step): t for t, room, step in reversed(marks)}
        t0 = min(t for t, _, _ in marks)
        steps = "; ".join(f"{(t - t0) / 1e6:.3f} {room} {step}" for t, room, step in marks if room in (1, 2))
        assert first[(2, "p.posted")] < first[(1, "p.posted")] - 100_000_000, steps  # 0.1 s before
        for r in (1, 2):
            assert (
                patterns.mismatches(c.decode[0].pool, r, np.arange(10 * r, 10 * r + 3), 3 * layout.page_size)
                == 0
            )
        c.assert_no_leaks()


class _FreedRegions:
    """The scatter actor's ring port, recording what it frees (the ring actor is not what is tested)."""

    def __init__(self) -> None:
        self.freed: list[int] = []

    def open_room(self, opened: RoomOpened) -> None:
        raise AssertionError("the scatter actor opens no room")

    def free_regions(self, alloc_ids: tuple[int, ...]) -> None:
        self.freed.extend(alloc_ids)


@pytest.mark.anyio
async def test_the_scatter_actor_launches_the_next_copy_without_waiting_for_the_last() -> None:
    """The decode's scatter actor launches each job's copy behind the previous one on its stream and
    answers each once its copy completed, in launch order (docs/DECISIONS.md, "The decode scatters
    without waiting on each job"): on CUDA, while the first copy is held behind a long kernel, every
    job has been taken from the mailbox and none answered. Every region freed, every byte in place."""
    layout = small_layout()
    pool = make_pool("contiguous", layout, 1, 0, 16)
    tokens, jobs = 4, 3
    nbytes = writer_block_bytes(
        layout.num_kv_tensors, tokens, layout.num_heads, layout.head_dim, pool.itemsize
    )
    memory = allocate_staging(pool, jobs * nbytes, host=False)
    source = torch.randint(0, 256, (jobs * nbytes,), dtype=torch.uint8)
    memory.tensor.copy_(source)
    ring, board = _FreedRegions(), RoomBoard()
    boxes = {room: Mailbox[RoomMail](8) for room in range(jobs)}
    for room, box in boxes.items():
        board.open(room, box)
    actor = ScatterActor(pool, memory, ring, board, capacity=8)
    async with anyio.create_task_group() as tg:
        await tg.start(actor.run)
        if actor.stream is not None:
            with torch.cuda.stream(actor.stream):
                torch.cuda._sleep(300_000_000)  # the first copy waits behind it
        for i in range(jobs):
            slots = np.arange(tokens * i, tokens * (i + 1))
            blocks = [(0, 0, layout.num_heads)]
            actor.inbox.post(ScatterJob(i, 0, 100 + i, i * nbytes, nbytes, blocks, slots))
        if actor.stream is not None:
            await anyio.sleep(0.05)
            assert len(actor.inbox) == 0, "the mailbox task waited for a copy before launching the next"
            assert all(len(box) == 0 for box in boxes.values()), "answered before its copy completed"
        with anyio.fail_after(30):
            answers = [await boxes[i].receive() for i in range(jobs)]
        actor.inbox.close()
    assert all(isinstance(a, Scattered) and a.ok and a.freed for a in answers), answers
    assert ring.freed == [100, 101, 102]
    for i in range(jobs):
        back = torch.empty(nbytes, dtype=torch.uint8, device=pool.device)
        gather_heads(
            as_kv_table(pool.kv_views), torch.arange(tokens * i, tokens * (i + 1)), 0, layout.num_heads, back
        )
        assert torch.equal(back.cpu(), source[i * nbytes : (i + 1) * nbytes]), f"job {i}'s bytes"
