"""A tiny CPU transfer through the public API, run from an installed wheel (tests/packaging/test_wheel.py).

One prefill and one decode engine in this process, over real NIXL (UCX on DRAM) and ZMQ: 4 pages of
random bytes go prefill → decode, and every byte is compared. Prints ``ok <bytes>`` on success.
"""

from __future__ import annotations

import socket
import sys

import anyio
import numpy as np
import torch

import transfer_engine
from transfer_engine import EngineConfig, KVLayout, KVPool, TransferEngine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pool(layout: KVLayout, seed: int) -> KVPool:
    slots = 16 * layout.page_size
    gen = torch.Generator().manual_seed(seed)
    tensors = [
        torch.randint(
            0, 255, (slots, layout.num_heads, 2 * layout.head_dim), dtype=torch.uint8, generator=gen
        ).view(layout.dtype)
        for _ in range(2 * layout.num_layers)
    ]
    return KVPool(layout, tp_size=1, tp_rank=0, tensors=tensors)


async def main() -> int:
    layout = KVLayout(
        num_layers=2, num_heads=2, head_dim=16, dtype=torch.bfloat16, page_size=4
    )  # 2-byte elements
    port = _free_port()
    src_pages, dst_pages = np.array([3, 7, 1, 12]), np.array([0, 5, 9, 2])
    prefill_pool, decode_pool = _pool(layout, 1), _pool(layout, 2)
    prefill = TransferEngine(EngineConfig(role="prefill", bootstrap_port=port), prefill_pool)
    decode = TransferEngine(EngineConfig(role="decode", bootstrap_port=port), decode_pool)
    async with prefill, decode:
        receiver = await decode.receiver(1, f"tcp://127.0.0.1:{port}", dst_pages)
        sender = prefill.sender(1)
        await sender.send(src_pages, last=True)
        with anyio.fail_after(30):
            await sender.wait()
            await receiver.wait()
        leaks = {k: v for e in (prefill, decode) for k, v in e.leaks().items() if v}
    if leaks:
        print(f"leaked: {leaks}")
        return 1
    moved = 0
    for src, dst in zip(prefill_pool.tensors, decode_pool.tensors, strict=True):
        for s, d in zip(src_pages, dst_pages, strict=True):
            a = src[s * layout.page_size : (s + 1) * layout.page_size]
            b = dst[d * layout.page_size : (d + 1) * layout.page_size]
            if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                print(f"page {s} -> {d} differs")
                return 1
            moved += a.numel() * a.element_size()
    print(f"ok {moved} bytes, transfer_engine {transfer_engine.__version__} from {transfer_engine.__file__}")
    return 0


if __name__ == "__main__":
    sys.exit(anyio.run(main))
