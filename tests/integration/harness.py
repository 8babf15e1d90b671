"""Shared set-up for integration tests: P prefill and D decode engines in one process, real NIXL and ZMQ.

The cluster itself comes from :mod:`transfer_engine.testing.cluster` (shared with tools/ and examples/);
this module adds the tests' pools, room runner and layouts.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
from collections.abc import AsyncIterator

import anyio
import numpy as np
import torch

from transfer_engine.config import EngineConfig
from transfer_engine.engine import Receiver, Sender, TransferEngine
from transfer_engine.memory.layout import KVLayout, KVPool, views_flash_hnd, views_flash_nhd, views_vllm_cpu
from transfer_engine.testing import patterns
from transfer_engine.testing.cluster import Cluster, free_port, open_cluster

__all__ = ["Cluster", "cluster", "free_port", "make_pool", "run_room", "shuffled_pages", "small_layout"]

DEVICE = os.environ.get("TE_TEST_DEVICE", "cpu")
"""Where the integration tests put their KV pools: ``cpu`` (CI), or ``cuda`` on a GPU machine."""


@contextlib.asynccontextmanager
async def cluster(
    layout: KVLayout,
    P: int,
    D: int,
    *,
    num_pages: int = 64,
    decode_layout: KVLayout | None = None,
    aux: int = 8,
    kinds: tuple[str, str] = ("contiguous", "contiguous"),
    **config: object,
) -> AsyncIterator[Cluster]:
    """``kinds``: the prefill's and the decode's KV layouts (see :func:`make_pool`)."""

    def make(role: str, rank: int, port: int) -> TransferEngine:
        tp = P if role == "prefill" else D
        extra = {"num_workers": 2} if role == "prefill" else {}
        cfg = EngineConfig(role=role, tp_size=tp, tp_rank=rank, bootstrap_port=port, **extra, **config)  # type: ignore[arg-type]
        kind = kinds[0] if role == "prefill" else kinds[1]
        pool = make_pool(
            kind, (decode_layout or layout) if role == "decode" else layout, tp, rank, num_pages, aux
        )
        return TransferEngine(cfg, pool)

    async with open_cluster(make, P, D) as c:
        yield c


def make_pool(kind: str, layout: KVLayout, tp: int, rank: int, num_pages: int, aux: int = 0) -> KVPool:
    """A zeroed pool on ``DEVICE`` laid out as ``kind``: "contiguous" (ours, ``KVPool.allocate``),
    or a serving system's layout through ``KVPool.from_views``: "vllm_cpu" (per layer ``[blocks, H,
    block_size, 2D]``), "flash_nhd" / "flash_hnd" (per layer ``(2, blocks, block_size, H, D)`` /
    ``(2, blocks, H, block_size, D)``)."""
    aux_args = {"aux_slots": aux, "aux_item_bytes": 16 if aux else 0}
    if kind == "contiguous":
        return KVPool.allocate(layout, tp, rank, num_pages, device=DEVICE, **aux_args)  # type: ignore[arg-type]
    heads, bs, d = layout.heads_local(tp), layout.page_size, layout.head_dim
    shape, views = {
        "vllm_cpu": ((num_pages, heads, bs, 2 * d), lambda m: views_vllm_cpu(m, d)),
        "flash_nhd": ((2, num_pages, bs, heads, d), views_flash_nhd),
        "flash_hnd": ((2, num_pages, heads, bs, d), views_flash_hnd),
    }[kind]
    memory = [torch.zeros(shape, dtype=layout.dtype, device=DEVICE) for _ in range(layout.num_layers)]
    aux_buf = torch.zeros(aux, 16, dtype=torch.uint8, device=DEVICE) if aux else None
    return KVPool.from_views(layout, tp, rank, views(memory), memory, aux_buf)


async def run_room(
    c: Cluster,
    room: int,
    prefill_pages: np.ndarray,
    decode_pages: np.ndarray,
    chunks: list[int],
    *,
    aux_slot: int | None = None,
    layers: int = 0,
) -> None:
    """Fill, transfer in ``chunks`` (page counts), wait on both sides, verify every byte on every decode rank.

    ``layers`` > 0 sends layer-wise: each chunk is opened with ``begin_chunk`` and its layers reported
    ready ``layers`` at a time, each range's KV written only after ``layers_ready`` was called (the
    engine must wait for the range's ``threading.Event``, set once the range is written).
    """
    if aux_slot is not None:
        for engine in c.prefill:
            patterns.fill_aux(engine.pool, room, aux_slot)
    if not layers:
        for engine in c.prefill:
            patterns.fill(engine.pool, room, prefill_pages)
    receivers = [
        await engine.receiver(room, c.bootstrap, decode_pages, aux_slot=aux_slot) for engine in c.decode
    ]
    senders = [engine.sender(room) for engine in c.prefill]
    num_layers = c.prefill[0].pool.layout.num_layers
    for sender, engine in zip(senders, c.prefill, strict=True):
        start = 0
        for i, n in enumerate(chunks):
            last = i == len(chunks) - 1
            pages = prefill_pages[start : start + n]
            start += n
            if not layers:
                await sender.send(pages, last=last, aux_slot=aux_slot if last else None)
                continue
            await sender.begin_chunk(pages, last=last, aux_slot=aux_slot if last else None)
            for a in range(0, num_layers, layers):
                b = min(a + layers, num_layers)
                written = threading.Event()
                await sender.layers_ready(a, b, ready=written)
                await anyio.sleep(0.001)  # the engine runs (and polls) while these layers are not written yet
                patterns.fill(engine.pool, room, prefill_pages[:start], layers=(a, b))
                written.set()
    with anyio.fail_after(30):
        for s in senders:
            await s.wait()
        for r in receivers:
            await r.wait()
    p_ps = c.prefill[0].pool.layout.page_size
    for engine in c.decode:
        d_ps = engine.pool.layout.page_size
        tokens = patterns.received_tokens(len(prefill_pages), p_ps, len(decode_pages), d_ps)
        assert patterns.mismatches(engine.pool, room, decode_pages, tokens) == 0
        if aux_slot is not None:
            assert patterns.aux_ok(engine.pool, room, aux_slot)


async def open_layerwise(c: Cluster, room: int, pages: np.ndarray, ready: int) -> tuple[Sender, Receiver]:
    """P=D=1: fill ``room``'s KV, open it on both sides as one layer-wise chunk of ``pages`` (the
    last), and report its first ``ready`` layers written, one at a time."""
    patterns.fill(c.prefill[0].pool, room, pages)
    receiver = await c.decode[0].receiver(room, c.bootstrap, pages)
    sender = c.prefill[0].sender(room)
    await sender.begin_chunk(pages, last=True)
    for layer in range(ready):
        await sender.layers_ready(layer, layer + 1)
    return sender, receiver


async def layers_landed(c: Cluster, room: int, n: int, limit_s: float = 10.0) -> None:
    """Until decode rank 0's ``room`` counted ``n`` layers of its chunk 0 from writer 0."""
    core = c.decode[0].rooms[room].core
    with anyio.fail_after(limit_s):
        while core.layer_tally is None or core.layer_tally.layers((0, 0)) < n:  # noqa: ASYNC110 - engine state, no event
            await anyio.sleep(0.002)


def shuffled_pages(rng: random.Random, num_pages: int, n: int) -> np.ndarray:
    return np.array(rng.sample(range(num_pages), n), dtype=np.int64)


def small_layout(num_heads: int = 8, mla: bool = False, page_size: int = 4) -> KVLayout:
    return KVLayout(
        num_layers=3,
        num_heads=num_heads,
        head_dim=64 if mla else 16,
        dtype=torch.bfloat16,
        page_size=page_size,
        mla=mla,
    )
