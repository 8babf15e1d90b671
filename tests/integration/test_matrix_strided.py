"""Staged and host paths between serving systems' KV layouts (real NIXL over UCX, real ZMQ).

The prefill gathers from its layout, the decode scatters into its own; the staging region's format
is the same whatever the layouts, so a vLLM CPU prefill feeds a contiguous decode and a
FlashAttention NHD prefill an HND decode, with hetero TP and different page sizes. Every received
byte is checked, every byte the rooms did not write is still zero, and nothing leaked.
"""

from __future__ import annotations

import functools
import random

import anyio
import numpy as np
import pytest
import torch

from transfer_engine.testing import patterns

from .harness import Cluster, cluster, run_room, shuffled_pages, small_layout

NUM_PAGES = 32
"""Pages of every pool: enough for three rooms of up to 4 prefill pages of 8 tokens on pages of 4."""

CASES = [
    # (prefill kind, decode kind, P, D, prefill page size, decode page size)
    ("vllm_cpu", "contiguous", 2, 1, 4, 8),
    ("flash_nhd", "flash_hnd", 2, 1, 8, 4),
    ("contiguous", "vllm_cpu", 1, 2, 4, 4),
]
PARAMS = [
    pytest.param(
        *case, path, 0, id=f"{case[0]}-P{case[2]}p{case[4]}-to-{case[1]}-D{case[3]}p{case[5]}-{path}"
    )
    for case in CASES
    for path in ("staged", "host")
] + [
    # auto picks staged here: the slice path would need one descriptor per (tensor, token, head)
    pytest.param("vllm_cpu", "flash_hnd", 2, 1, 4, 4, "auto", 0, id="vllm_cpu-P2-to-flash_hnd-D1-auto"),
    # layer-wise chunks gather each layer group from the strided views
    pytest.param(
        "flash_hnd", "vllm_cpu", 2, 1, 4, 8, "staged", 1, id="flash_hnd-P2-to-vllm_cpu-D1-layerwise"
    ),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("src_kind", "dst_kind", "P", "D", "src_page", "dst_page", "path", "layers"), PARAMS)
async def test_strided_staged(
    src_kind: str, dst_kind: str, P: int, D: int, src_page: int, dst_page: int, path: str, layers: int
) -> None:
    rng = random.Random(f"{src_kind} {dst_kind} {P} {D} {path}")
    layout, decode_layout = small_layout(page_size=src_page), small_layout(page_size=dst_page)
    # NIXL's staged and host paths are under test: with the kernel path on, a CUDA pool in this one
    # process is mapped as it is ("process") and auto takes the kernel path (test_kernel_path.py)
    async with cluster(
        layout,
        P,
        D,
        num_pages=NUM_PAGES,
        decode_layout=decode_layout,
        kinds=(src_kind, dst_kind),
        path=path,
        kernel_path=False,
    ) as c:
        src_free = shuffled_pages(rng, NUM_PAGES, NUM_PAGES).tolist()
        dst_free = shuffled_pages(rng, NUM_PAGES, NUM_PAGES).tolist()
        written: list[tuple[np.ndarray, int]] = []
        async with anyio.create_task_group() as tg:
            for room in range(3):
                src_pages = rng.randint(1, 4)
                tokens = src_pages * src_page
                dst_pages = -(-tokens // dst_page)
                src, dst = np.array(src_free[:src_pages]), np.array(dst_free[:dst_pages])
                assert len(dst) == dst_pages, "the test ran out of decode pages"
                del src_free[:src_pages], dst_free[:dst_pages]
                chunks = [1, src_pages - 1] if src_pages > 1 else [1]
                written.append((dst, tokens))
                tg.start_soon(
                    functools.partial(run_room, c, 200 + room, src, dst, chunks, aux_slot=room, layers=layers)
                )
        staged_writes = sum(w.counters["staged_writes"] for e in c.prefill for w in e.workers)
        assert staged_writes >= 3 * P, f"{path}: {staged_writes} staged WRITEs; the rooms took another path"
        assert_untouched_is_zero(c, written)
        c.assert_no_leaks()


def assert_untouched_is_zero(c: Cluster, written: list[tuple[np.ndarray, int]]) -> None:
    """Zero every decode slot the rooms wrote (already checked by ``run_room``); then every byte of
    the registered memory must be zero: the scatter wrote nothing beside its slots and heads."""
    for engine in c.decode:
        page_size = engine.pool.layout.page_size
        for pages, tokens in written:
            offsets = np.arange(tokens)
            slots = torch.from_numpy(pages[offsets // page_size] * page_size + offsets % page_size)
            slots = slots.to(engine.pool.device)
            for view in engine.pool.kv_views:
                view[patterns.slot_index(view, slots)] = 0
        for i, memory in enumerate(engine.pool.tensors):
            assert int(torch.count_nonzero(memory.view(torch.int16))) == 0, f"{engine.agent_name} memory {i}"
