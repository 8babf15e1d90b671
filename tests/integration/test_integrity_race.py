"""Integrity never fails a good transfer into a busy destination (docs/INTEGRITY.md, "Which fence").

Long rooms (16K tokens on CUDA, 1K on CPU, in chunks of 64 pages), four at a time, direct and
staged, whole chunks and layer-wise, integrity on both sides. On CUDA the decode's GPU is kept busy the way a serving
system's forward keeps it: long kernels on the current (default) stream for the rooms' whole life,
while the prefill writes its KV on a side stream and hands its events to ``send`` /
``layers_ready``. A sum that used the current stream anywhere (its kernel, the upload of its slots,
the copy of its value to the host) would be read before it was taken: the decode saw 0 and failed
every block of a good room with INTEGRITY (the vLLM core at 16K tokens did). Every chunk must match,
every byte must arrive, nothing may leak. On CPU the same rooms run with nothing held: a plain
check of long concurrent rooms with integrity on.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import anyio
import numpy as np
import pytest
import torch

from transfer_engine.testing import patterns

from .harness import DEVICE, Cluster, cluster, small_layout

pytestmark = pytest.mark.timeout(180)

CUDA = DEVICE == "cuda"
PAGE = 16
TOKENS = 16384 if CUDA else 1024
PAGES = TOKENS // PAGE
CHUNK = 64
"""Pages per chunk (``EngineConfig.staging_chunk_pages``: one staged chunk fits a ring region)."""
ROOMS = 4


@contextlib.contextmanager
def busy_current_stream(seconds: float) -> Iterator[None]:
    """CUDA: keep the current stream busy with long kernels for about ``seconds`` (a forward that
    runs while the rooms land), and wait for it at the end; CPU: nothing."""
    if not CUDA:
        yield
        return
    for _ in range(int(seconds / 0.05)):
        torch.cuda._sleep(100_000_000)  # about 50 ms each on an H100/H200
    try:
        yield
    finally:
        torch.cuda.current_stream().synchronize()


async def send_room(
    c: Cluster, room: int, pages: np.ndarray, side: torch.cuda.Stream | None, layers: int
) -> None:
    """Write ``room``'s KV (on ``side`` on CUDA, an event recorded after it) and send it in chunks of
    ``CHUNK`` pages as chunked prefill does, each whole or one layer at a time, every chunk and
    group ready at that event."""
    engine = c.prefill[0]
    sender = engine.sender(room)
    num_layers = engine.pool.layout.num_layers
    ready = None
    if side is None:
        patterns.fill(engine.pool, room, pages)
    else:
        with torch.cuda.stream(side):
            patterns.fill(engine.pool, room, pages)
            ready = torch.cuda.Event()
            ready.record(side)
    for start in range(0, len(pages), CHUNK):
        chunk = pages[start : start + CHUNK]
        last = start + CHUNK >= len(pages)
        if not layers:
            await sender.send(chunk, last=last, ready=ready)
            continue
        await sender.begin_chunk(chunk, last=last)
        for a in range(0, num_layers, layers):
            await sender.layers_ready(a, min(a + layers, num_layers), ready=ready)
    with anyio.fail_after(60):
        await sender.wait()


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["direct", "staged"])
@pytest.mark.parametrize("layers", [0, 1], ids=["chunks", "layers"])
async def test_long_rooms_into_a_busy_decode_never_fail_integrity(path: str, layers: int) -> None:
    rng = random.Random(TOKENS + layers)
    num_pages = ROOMS * PAGES
    async with cluster(
        small_layout(page_size=PAGE), 1, 1, num_pages=num_pages, path=path, layers_per_write=1, integrity=True
    ) as c:
        side = torch.cuda.Stream() if CUDA else None
        src = np.array(rng.sample(range(num_pages), num_pages), dtype=np.int64).reshape(ROOMS, PAGES)
        dst = np.array(rng.sample(range(num_pages), num_pages), dtype=np.int64).reshape(ROOMS, PAGES)
        decode = c.decode[0]
        receivers = [await decode.receiver(room, c.bootstrap, dst[room]) for room in range(ROOMS)]
        with busy_current_stream(2.0):
            async with anyio.create_task_group() as tg:
                for room in range(ROOMS):
                    tg.start_soon(send_room, c, room, src[room], side, layers)
                with anyio.fail_after(60):
                    for receiver in receivers:
                        await receiver.wait()
        landed = decode.poller.counters["notifs"]
        assert landed >= ROOMS
        assert decode.counters["integrity_match"] == landed
        assert decode.counters["integrity_mismatch"] == decode.counters["integrity_unchecked"] == 0
        for room in range(ROOMS):
            assert patterns.mismatches(decode.pool, room, dst[room], TOKENS) == 0
        c.assert_no_leaks()
