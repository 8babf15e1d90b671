"""The README's blocking quick start, whole: a scheduler with no asyncio of its own, one thread per
rank, each polling its room once per scheduler step, as SGLang's scheduler does. A prefill instance
of TP 2 moves one request's KV to a decode instance of TP 1 over real NIXL (UCX) and ZMQ; all
three threads run in this one process, each with a :class:`~transfer_engine.facade.BlockingEngine`
(its own NIXL agent and event-loop thread) and a pool of its own.

    python examples/quickstart_blocking.py

It needs no GPU and prints ``quickstart_blocking: ok`` once the decode rank holds the prefill's
bytes, KV and aux; it exits 1 otherwise. The prefill hosts its bootstrap server on 127.0.0.1:8998
(``EngineConfig``'s default).
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import torch

from transfer_engine import EngineConfig, KVLayout, KVPool, RoomStatus
from transfer_engine.facade import BlockingEngine

layout = KVLayout(num_layers=36, num_heads=8, head_dim=128, dtype=torch.bfloat16, page_size=16)
NUM_PAGES = 16
STEP_S = 0.001
"""One scheduler step (a forward pass, in a real scheduler)."""
STEP_LIMIT = 30_000
"""Steps a room may take before this program gives up on it (30 s)."""


def kv_pool(tp_size: int, rank: int) -> KVPool:
    """One rank's KV cache: a K and a V tensor per layer, ``[pages * page_size, heads / TP, head_dim]``,
    and 8 aux slots of 64 bytes."""
    shape = (NUM_PAGES * layout.page_size, layout.num_heads // tp_size, layout.head_dim)
    tensors = [torch.zeros(shape, dtype=layout.dtype) for _ in range(2 * layout.num_layers)]
    return KVPool(layout, tp_size, rank, tensors, aux=torch.zeros(8, 64, dtype=torch.uint8))


def step() -> None:
    time.sleep(STEP_S)


def poll_until(handle: object, *wanted: RoomStatus) -> RoomStatus:
    """Poll ``handle`` once per scheduler step until it is in one of ``wanted`` or FAILED."""
    for _ in range(STEP_LIMIT):
        status: RoomStatus = handle.poll()  # type: ignore[attr-defined]
        if status in wanted or status is RoomStatus.FAILED:
            return status
        step()
    raise TimeoutError(f"the room is still {status} after {STEP_LIMIT} steps")


def decode_scheduler(pool: KVPool, decode_done: threading.Event, result: list[bool]) -> None:
    try:
        # the decode rank's scheduler thread
        with BlockingEngine(EngineConfig(role="decode"), pool) as engine:
            receiver = engine.receiver("cmpl-42", bootstrap="tcp://127.0.0.1:8998")  # handshake starts
            status = poll_until(receiver, RoomStatus.WAITING_FOR_INPUT)
            print(f"decode: room {status}")
            if status is RoomStatus.WAITING_FOR_INPUT:
                pages = np.array([0, 1, 2, 5, 6])  # from the decode's page allocator
                receiver.request(pages, aux_slot=7, decode_prefix_len=0)
                status = poll_until(receiver, RoomStatus.SUCCESS)
                print(f"decode: room {status}")
                # SUCCESS or FAILED: no WRITE of the room can land any more; the pages are ours again
                result.append(status is RoomStatus.SUCCESS and landed(pool, pages))
    finally:
        decode_done.set()


def prefill_scheduler(rank: int, decode_done: threading.Event) -> None:
    pages = np.array([3, 4, 9, 10, 11])  # where the request's KV sits in this rank's pool
    pool = kv_pool(tp_size=2, rank=rank)
    for i, tensor in enumerate(pool.tensors):  # the prefill's forward wrote it
        tensor.view(NUM_PAGES, layout.page_size, -1)[pages] = i + 1
    assert pool.aux is not None
    pool.aux[3] = 42
    # prefill rank `rank` of 2: its scheduler thread
    with BlockingEngine(EngineConfig(role="prefill", tp_size=2, tp_rank=rank), pool) as engine:
        sender = engine.sender("cmpl-42")
        status = poll_until(sender, RoomStatus.WAITING_FOR_INPUT)  # every decode rank asked
        if status is RoomStatus.WAITING_FOR_INPUT:
            skip = sender.decode_prefix_len // layout.page_size  # pages the decode already holds
            pages = pages[skip:]
            total_pages = len(pages)
            sender.expect(total_pages, aux_slot=3)
            for chunk_pages in (pages[:2], pages[2:]):
                sender.send(chunk_pages)  # per chunk; the one reaching total_pages is the last
            status = poll_until(sender, RoomStatus.SUCCESS)
        print(f"prefill rank {rank}: room {status}")
        decode_done.wait(60)  # a serving prefill stays up; this one until the decode is done


def landed(pool: KVPool, pages: np.ndarray) -> bool:
    """Whether the decode's pages hold what both prefill ranks wrote (each its half of the heads)."""
    assert pool.aux is not None
    kv_ok = all(
        bool((tensor.view(NUM_PAGES, layout.page_size, -1)[pages] == i + 1).all())
        for i, tensor in enumerate(pool.tensors)
    )
    return kv_ok and bool((pool.aux[7] == 42).all())


def main() -> int:
    decode_done = threading.Event()
    result: list[bool] = []
    threads = [threading.Thread(target=prefill_scheduler, args=(rank, decode_done)) for rank in range(2)]
    threads.append(threading.Thread(target=decode_scheduler, args=(kv_pool(1, 0), decode_done, result)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ok = result == [True]
    print("quickstart_blocking: ok" if ok else "quickstart_blocking: FAILED, the decode's KV differs")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
