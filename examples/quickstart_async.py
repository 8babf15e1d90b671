"""The README's asyncio quick start, whole: a prefill instance of TP 2 moves one request's KV to a
decode instance of TP 1, over real NIXL (UCX) and ZMQ, all three ranks in this one process as
tasks of one task group. Each rank has a pool of its own, as it would in its own process.

    python examples/quickstart_async.py

It needs no GPU (the pools are in host memory) and prints the room's status as it goes, then
``quickstart_async: ok`` once the decode rank holds the prefill's bytes, KV and aux; it exits 1
otherwise. The prefill hosts its bootstrap server on 127.0.0.1:8998 (``EngineConfig``'s default).
"""

from __future__ import annotations

import sys

import anyio
import numpy as np
import torch

from transfer_engine import EngineConfig, KVLayout, KVPool, TransferEngine, room_id

layout = KVLayout(num_layers=36, num_heads=8, head_dim=128, dtype=torch.bfloat16, page_size=16)
NUM_PAGES = 16
AUX_SLOTS, AUX_BYTES = 8, 64


def kv_pool(tp_size: int, rank: int) -> KVPool:
    """One rank's KV cache: a K and a V tensor per layer, ``[pages * page_size, heads / TP, head_dim]``,
    and aux slots (the first output token, say) as one ``[slots, bytes]`` uint8 tensor."""
    shape = (NUM_PAGES * layout.page_size, layout.num_heads // tp_size, layout.head_dim)
    k_per_layer = [torch.zeros(shape, dtype=layout.dtype) for _ in range(layout.num_layers)]
    v_per_layer = [torch.zeros(shape, dtype=layout.dtype) for _ in range(layout.num_layers)]
    aux = torch.zeros(AUX_SLOTS, AUX_BYTES, dtype=torch.uint8)
    return KVPool(layout, tp_size=tp_size, tp_rank=rank, tensors=[*k_per_layer, *v_per_layer], aux=aux)


room = room_id("cmpl-quickstart-1")  # both sides name the request the same way
pages = np.array([3, 4, 9, 10])  # the prefill's pages holding the request's KV, in token order
more_pages = np.array([11])
dst_pages = np.array([0, 1, 2, 5, 6])  # the decode's pages it goes into


def prefill_kv(tp_size: int, rank: int) -> KVPool:
    """A prefill rank's pool with the request's KV written in, as its forward would leave it: every
    element of a layer's K (or V) is that tensor's index plus 1, in its rank's heads."""
    pool = kv_pool(tp_size, rank)
    for i, tensor in enumerate(pool.tensors):
        tensor.view(NUM_PAGES, layout.page_size, -1)[np.r_[pages, more_pages]] = i + 1
    assert pool.aux is not None
    pool.aux[3] = 42
    return pool


async def prefill(rank: int, decode_done: anyio.Event) -> None:
    pool = prefill_kv(tp_size=2, rank=rank)
    # prefill rank `rank` of 2
    async with TransferEngine(EngineConfig(role="prefill", tp_size=2, tp_rank=rank), pool) as engine:
        sender = engine.sender(room)
        await sender.wait_bootstrapped()  # every decode rank asked (or raises TransferFailed)
        await sender.send(pages, last=False)  # enqueues; returns at once
        await sender.send(more_pages, last=True, aux_slot=3)
        await sender.wait()  # Success, or raises TransferFailed
        print(f"prefill rank {rank}: room {sender.poll()}")
        await decode_done.wait()  # a serving prefill stays up; this one until the decode is done


async def decode(decode_done: anyio.Event) -> bool:
    pool = kv_pool(tp_size=1, rank=0)
    # the decode rank
    async with TransferEngine(EngineConfig(role="decode", tp_size=1), pool) as engine:
        receiver = await engine.receiver(room, bootstrap="tcp://127.0.0.1:8998", pages=dst_pages, aux_slot=7)
        print(f"decode: room {receiver.poll()}")  # RoomStatus; the values are SGLang's KVPoll
        await receiver.wait()  # or: await receiver.abort(), which returns once no WRITE can land
        print(f"decode: room {receiver.poll()}")
    decode_done.set()
    return landed(pool)


def landed(pool: KVPool) -> bool:
    """Whether the decode's pages hold what both prefill ranks wrote (each its half of the heads)."""
    assert pool.aux is not None
    kv_ok = all(
        bool((tensor.view(NUM_PAGES, layout.page_size, -1)[dst_pages] == i + 1).all())
        for i, tensor in enumerate(pool.tensors)
    )
    return kv_ok and bool((pool.aux[7] == 42).all())


async def main() -> int:
    decode_done = anyio.Event()
    ok = [False]

    async def run_decode() -> None:
        ok[0] = await decode(decode_done)

    async with anyio.create_task_group() as tg:
        for rank in range(2):
            tg.start_soon(prefill, rank, decode_done)
        tg.start_soon(run_decode)
    print("quickstart_async: ok" if ok[0] else "quickstart_async: FAILED, the decode's KV differs")
    return 0 if ok[0] else 1


if __name__ == "__main__":
    sys.exit(anyio.run(main))
