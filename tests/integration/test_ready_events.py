"""A caller's own CUDA ``ready=`` event (non-blocking, as ``torch.cuda.Event()`` makes it) is not what
the completion waiter's thread waits on: the handle mails a blocking event recorded after it
(``transfer_engine.events.blocking``), and the room still lands every byte only after the caller's
KV was written. Needs CUDA pools (``TE_TEST_DEVICE=cuda`` on a GPU machine); skipped elsewhere.
"""

from __future__ import annotations

import anyio
import numpy as np
import pytest
import torch

from transfer_engine.events import BlockingEvent
from transfer_engine.memory.layout import KVPool
from transfer_engine.runtime.mail import LayersReady
from transfer_engine.testing import patterns

from .harness import DEVICE, cluster, small_layout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE != "cuda" or not torch.cuda.is_available(), reason="needs CUDA pools"),
]


def _written_later(
    pool: KVPool, room: int, pages: np.ndarray, layers: tuple[int, int] | None = None
) -> torch.cuda.Event:
    """Fill ``pages`` of ``room`` on a side stream behind a long kernel; the caller's non-blocking
    event recorded after it."""
    stream = torch.cuda.Stream(pool.device)
    event = torch.cuda.Event()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(20_000_000)
        patterns.fill(pool, room, pages, layers=layers)
        event.record(stream)
    return event


@pytest.mark.anyio
async def test_send_with_a_non_blocking_ready_mails_a_blocking_event() -> None:
    async with cluster(small_layout(), 1, 1, path="direct") as c:
        pages = np.arange(4)
        receiver = await c.decode[0].receiver(11, c.bootstrap, pages)
        sender = c.prefill[0].sender(11)
        theirs = _written_later(c.prefill[0].pool, 11, pages)
        chunk = sender.prepare_chunk(pages, True, None, theirs)
        assert isinstance(chunk.ready, BlockingEvent) and chunk.ready is not theirs
        await sender.deliver(chunk)
        with anyio.fail_after(30):
            await sender.wait()
            await receiver.wait()
        assert patterns.mismatches(c.decode[0].pool, 11, pages, 16) == 0
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_layers_ready_with_non_blocking_events_mails_one_blocking_event_per_group() -> None:
    async with cluster(small_layout(), 1, 1, path="direct", layers_per_write=2) as c:
        pages = np.arange(4)
        pool = c.prefill[0].pool
        receiver = await c.decode[0].receiver(12, c.bootstrap, pages)
        sender = c.prefill[0].sender(12)
        await sender.begin_chunk(pages, last=True)
        mails = []
        for layer in range(pool.layout.num_layers):
            mail = sender.prepare_layers(
                layer, layer + 1, _written_later(pool, 12, pages, (layer, layer + 1))
            )
            if mail is not None:
                assert isinstance(mail, LayersReady)
                mails.append(mail)
                await sender.deliver(mail)
        assert [len(mail.ready) for mail in mails] == [1, 1]  # layers [0, 2) and [2, 3)
        assert all(isinstance(mail.ready[0], BlockingEvent) for mail in mails)
        with anyio.fail_after(30):
            await sender.wait()
            await receiver.wait()
        assert patterns.mismatches(c.decode[0].pool, 12, pages, 16) == 0
        c.assert_no_leaks()
