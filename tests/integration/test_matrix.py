"""The integration matrix: every (H, P, D) shape and path, several concurrent rooms, every byte checked."""

from __future__ import annotations

import contextlib
import functools
import random

import anyio
import numpy as np
import pytest
import torch

from .harness import cluster, run_room, shuffled_pages, small_layout

H8_PAIRS = [(1, 1), (2, 1), (1, 2), (4, 2), (2, 4), (4, 1), (1, 4)]
CASES = (
    [(8, False, p, d) for p, d in H8_PAIRS]
    + [(2, False, 1, 4), (2, False, 4, 1)]
    + [(1, True, 2, 1), (1, True, 1, 2)]
)


def paths_for(heads: int, mla: bool, p: int, d: int) -> list[str]:
    """Every path that serves the shape: direct needs equal TP (or MLA); staging serves all of them."""
    return (["direct"] if (p == d or mla) else []) + ["slice", "staged", "host"]


PARAMS = [
    pytest.param(h, mla, p, d, path, id=f"{'mla' if mla else f'H{h}'}-P{p}-D{d}-{path}")
    for h, mla, p, d in CASES
    for path in paths_for(h, mla, p, d)
]


LAYERWISE_CASES = [(8, False, 1, 1), (8, False, 2, 1), (8, False, 1, 2), (1, True, 2, 1)]
LAYERWISE = [
    pytest.param(
        h,
        mla,
        p,
        d,
        path,
        layers,
        per_write,
        id=f"{'mla' if mla else f'H{h}'}-P{p}-D{d}-{path}-layers{layers}x{per_write}",
    )
    for h, mla, p, d in LAYERWISE_CASES
    for path in paths_for(h, mla, p, d)
    for layers, per_write in ([(1, 1), (1, 2)] if (p, d) == (1, 1) and not mla else [(1, 2)])
]
"""Layer-wise rooms (``Sender.begin_chunk``/``layers_ready``): one layer per call, grouped one or two
layers per WRITE, on every path of a few shapes (hetero TP both ways, MLA)."""


@pytest.mark.anyio
@pytest.mark.parametrize(("heads", "mla", "P", "D", "path"), PARAMS)
async def test_matrix(heads: int, mla: bool, P: int, D: int, path: str) -> None:
    await _matrix(heads, mla, P, D, path)


@pytest.mark.anyio
@pytest.mark.parametrize(("heads", "mla", "P", "D", "path", "layers", "per_write"), LAYERWISE)
async def test_matrix_layerwise(
    heads: int, mla: bool, P: int, D: int, path: str, layers: int, per_write: int
) -> None:
    await _matrix(heads, mla, P, D, path, layers=layers, layers_per_write=per_write)


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["direct", "staged", "host"])
async def test_host_path_writes_a_whole_chunk_as_layer_groups(path: str) -> None:
    """``host_pipeline_layers``: a whole chunk sent to a decode rank on the host path goes out as one
    WRITE per group of layers (3 layers in groups of 2: two), the other paths whole; a chunk under
    ``pipeline_min_bytes`` goes whole on the host path too. Every byte checked (``run_room``)."""
    layout = small_layout()
    three_pages = 3 * layout.page_size * layout.heads_local(1) * layout.head_dim * 2 * layout.num_kv_tensors
    async with cluster(layout, 1, 1, path=path, host_pipeline_layers=2, pipeline_min_bytes=three_pages) as c:
        await run_room(c, 5, np.arange(3), np.arange(10, 13), [3], aux_slot=1)
        posted = c.prefill[0].poller.counters["writes_posted"]
        assert posted == (2 if path == "host" else 1) + 1
        await run_room(c, 6, np.arange(2), np.arange(20, 22), [2], aux_slot=2)  # 2 pages: under the bar
        assert c.prefill[0].poller.counters["writes_posted"] - posted == 1 + 1
        c.assert_no_leaks()


HOST_CUT = [
    pytest.param(h, mla, p, d, "host", id=f"{'mla' if mla else f'H{h}'}-P{p}-D{d}-host")
    for h, mla, p, d in LAYERWISE_CASES
    if "host" in paths_for(h, mla, p, d)
]
"""Host-path cases of the matrix, for chunks the prefill room cuts itself (``host_pipeline_layers``)."""


@pytest.mark.anyio
@pytest.mark.parametrize(("heads", "mla", "P", "D", "path"), HOST_CUT)
async def test_matrix_host_chunks_cut_by_the_room(heads: int, mla: bool, P: int, D: int, path: str) -> None:
    """Every whole chunk of every room goes to each host-path decode rank as groups of one layer."""
    await _matrix(heads, mla, P, D, path, host_pipeline_layers=1, pipeline_min_bytes=0)


async def _matrix(
    heads: int,
    mla: bool,
    P: int,
    D: int,
    path: str,
    layers: int = 0,
    layers_per_write: int = 4,
    **config: object,
) -> None:
    rng = random.Random(hash((heads, mla, P, D, path)))
    layout = small_layout(heads, mla)
    async with cluster(layout, P, D, path=path, layers_per_write=layers_per_write, **config) as c:
        src_free = shuffled_pages(rng, 64, 64).tolist()
        dst_free = shuffled_pages(rng, 64, 64).tolist()
        async with anyio.create_task_group() as tg:
            for room in range(4):
                n = rng.randint(1, 9)
                chunks: list[int] = []
                left = n
                while left:
                    chunks.append(rng.randint(1, left))
                    left -= chunks[-1]
                # concurrent rooms own disjoint pages on both sides
                src, dst = np.array(src_free[:n]), np.array(dst_free[:n])
                del src_free[:n], dst_free[:n]
                tg.start_soon(
                    functools.partial(run_room, c, 100 + room, src, dst, chunks, aux_slot=room, layers=layers)
                )
        # every room over: nothing live anywhere
        c.assert_no_leaks()


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["direct", "staged"])
async def test_layerwise_without_ready_waits_for_the_callers_streams(path: str) -> None:
    """``layers_ready()`` without ``ready``: the group's WRITE waits for the work queued on the
    caller's stream (one event per group and stream). On CUDA each layer is written after a ~20 ms
    delay kernel, the layers of a group alternating between two streams, so a WRITE that waited for
    fewer than both streams reads stale bytes; on CPU the KV is written before the call."""
    from transfer_engine.testing import patterns

    layout = small_layout()
    async with cluster(layout, 1, 1, path=path, layers_per_write=2) as c:
        engine = c.prefill[0]
        cuda = engine.pool.device.type == "cuda"
        streams = [torch.cuda.Stream(engine.pool.device) for _ in range(2)] if cuda else []
        pages, room = np.arange(5), 7
        receiver = await c.decode[0].receiver(room, c.bootstrap, np.arange(10, 15))
        sender = engine.sender(room)
        await sender.begin_chunk(pages, last=True)
        for layer in range(layout.num_layers):
            with torch.cuda.stream(streams[layer % 2]) if cuda else contextlib.nullcontext():
                if cuda:
                    torch.cuda._sleep(40_000_000)
                patterns.fill(engine.pool, room, pages, layers=(layer, layer + 1))
                await sender.layers_ready(layer, layer + 1)
        with anyio.fail_after(30):
            await sender.wait()
            await receiver.wait()
        assert patterns.mismatches(c.decode[0].pool, room, np.arange(10, 15), 5 * layout.page_size) == 0
        c.assert_no_leaks()
