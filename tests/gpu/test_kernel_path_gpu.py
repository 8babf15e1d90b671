"""The kernel path on CUDA (issue 40 item 2), run by the lead on the GPU machine
(``tools/gpu_e2e.sh kernelpath``; skipped without CUDA): the prefill maps the decode's pool through CUDA
IPC (``memory/ipc.py``: ``cuIpcGetMemHandle`` / ``cuIpcOpenMemHandle``) and copies each chunk or layer
group with one Triton launch on its side stream.

Two real processes on this host (both on ``cuda:0`` when one GPU is visible): bytes exact, the path
``kernel`` with its reason, a decode killed mid-room (the prefill's mapping closed once no copy is in
flight) and a prefill killed mid-room; the same cases the CPU suite runs through ``/dev/shm``
(``tests/integration/test_kernel_path_processes.py``). And the driver calls themselves: an export
from a child process mapped here, written by the kernel, read back there.

Integrity on the kernel path (issue 42 item 3), in one process on CUDA pools (``TE_TEST_DEVICE=cuda``:
the cases of ``tests/integration/test_kernel_path_integrity.py``): the copy kernel's fused sum, landed in
pinned memory on the side stream before the copy's completion event, matches the decode's check of
every chunk and layer group; a copy corrupted after it summed fails only its room, INTEGRITY.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.connection import Connection

import numpy as np
import pytest
import torch

from tests.integration import test_kernel_path_integrity as integrity
from tests.integration import test_kernel_path_processes as cases
from tests.integration.harness import DEVICE
from transfer_engine.actors.worker import warm_copy_kernel
from transfer_engine.kernels.copy import _copy_kernel, copy_entries, copy_outer, entry_table
from transfer_engine.memory import ipc
from transfer_engine.memory.layout import KVLayout, KVPool
from transfer_engine.protocol import tables
from transfer_engine.protocol.messages import MemRegion

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_rooms_copy_between_two_processes_cuda() -> None:
    cases.test_rooms_copy_between_two_processes("cuda")


def test_decode_killed_mid_room_closes_the_mapping_cuda() -> None:
    cases.test_decode_killed_mid_room_closes_the_mapping("cuda")


def test_prefill_killed_mid_room_fails_the_decode_room_cuda() -> None:
    cases.test_prefill_killed_mid_room_fails_the_decode_room("cuda")


on_cuda_pools = pytest.mark.skipif(
    DEVICE != "cuda", reason="the in-process cases make their pools on TE_TEST_DEVICE: set it to cuda"
)


@on_cuda_pools
@pytest.mark.anyio
@pytest.mark.parametrize(("P", "D", "kinds", "layers", "mla"), integrity.KEEP_CASES)
async def test_integrity_keeps_the_kernel_path_cuda(
    P: int, D: int, kinds: tuple[str, str], layers: int, mla: bool
) -> None:
    await integrity.rooms_keep_the_kernel_path(P, D, kinds, layers, mla)


@on_cuda_pools
@pytest.mark.anyio
@pytest.mark.parametrize("layers", [0, 1], ids=["chunks", "layers"])
async def test_a_flipped_copy_fails_its_room_only_cuda(layers: int, monkeypatch: pytest.MonkeyPatch) -> None:
    await integrity.a_flipped_copy_fails_its_room_only(layers, monkeypatch)


def _exporter(conn: Connection) -> None:
    """A child process: two regions inside one caching-allocator block, exported; then their sums."""
    torch.cuda.set_device(0)
    block = torch.zeros(3 << 20, dtype=torch.uint8, device="cuda")
    regions = [
        MemRegion(block.data_ptr() + 4096, 1 << 20, 0),
        MemRegion(block.data_ptr() + (2 << 20), 1 << 20, 0),
    ]
    torch.cuda.synchronize()  # the zeros are in place before the parent may write
    conn.send((ipc.export_pool(regions, torch.device("cuda:0")), regions))
    conn.recv()  # the parent wrote
    torch.cuda.synchronize()
    conn.send(
        [int(block[r.addr - block.data_ptr() : r.addr - block.data_ptr() + r.length].sum()) for r in regions]
    )
    conn.recv()


def _importer(conn: Connection) -> None:
    """A child process whose torch has not touched the GPU when it maps (as a process that maps first
    and allocates after): maps the share, copies into it with the copy kernel, reports the open
    mappings before and after closing."""
    share, regions = conn.recv()
    mapping = ipc.map_pool(share, regions, torch.device("cuda:0"))  # before any torch CUDA call here
    opened = (mapping.how, ipc.open_mappings())
    src = torch.full((2 << 20,), 3, dtype=torch.uint8, device="cuda")
    entries = 1 << 20 >> 12  # 4 KiB entries per region
    s_table = entry_table(src.data_ptr() + np.arange(2 * entries, dtype=np.uint64) * 4096, 4096, "cuda")
    d_addr = np.concatenate([b + np.arange(entries, dtype=np.uint64) * 4096 for b in mapping.bases])
    d_table = entry_table(d_addr, 4096, "cuda")
    idx = np.arange(2 * entries, dtype=np.int32)
    assert mapping.acquire()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the source was filled on the current stream
    copy_entries(s_table, d_table, idx, idx[::-1].copy(), stream=stream)
    stream.synchronize()
    mapping.release()
    conn.send(opened)
    conn.recv()  # the exporter read its pages
    mapping.close_when_idle()
    conn.send((mapping.closed, ipc.open_mappings()))


def test_cuda_ipc_export_map_copy_close() -> None:
    """Regions at offsets inside one allocation: exported once (one handle) by one process, mapped by
    another that had not used the GPU before it mapped, written there by the copy kernel, seen by the
    exporter; closing the mapping leaves nothing open. (The mapping keeps the primary context it was
    opened in: before, a first torch call after the map reset it, and the copy wrote elsewhere.)"""
    ctx = mp.get_context("spawn")
    exp, exp_child = ctx.Pipe()
    imp, imp_child = ctx.Pipe()
    procs = [
        ctx.Process(target=_exporter, args=(exp_child,)),
        ctx.Process(target=_importer, args=(imp_child,)),
    ]
    for proc in procs:
        proc.start()
    try:
        share, regions = exp.recv()
        assert share.kind == "cuda_ipc" and len(share.memories) == 1 and len(share.device) == 16
        assert [r.offset for r in share.regions] == [4096, 2 << 20]
        imp.send((share, regions))
        assert imp.recv() == ("cuda_ipc", 1)
        exp.send("written")
        assert exp.recv() == [3 << 20, 3 << 20]
        imp.send("read")
        assert imp.recv() == (True, 0)
        exp.send("done")
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()


def _compiled_copies() -> int:
    """Compiled variants of the plain copy kernel in this process (Triton's per-device caches)."""
    return sum(len(cache[0]) for cache in _copy_kernel.device_caches.values())


@pytest.mark.parametrize("layers_per_write", [1, 4])
def test_warmed_copy_kernel_is_the_one_the_first_copy_launches(layers_per_write: int) -> None:
    """The prefill's start compiles the copy its kernel path launches (``warm_copy_kernel``): a first
    copy between two pools of this layout, tables and factors made as the kernel path makes them,
    compiles nothing more, and its bytes land exactly; the warm-up touched neither pool."""
    layout = KVLayout(8, 4, 128, torch.bfloat16, 16)
    src_pool = KVPool.allocate(layout, 1, 0, 12, device="cuda")
    dst_pool = KVPool.allocate(layout, 1, 0, 12, device="cuda")
    for t in src_pool.kv_views:
        t.copy_(torch.randn(t.shape, dtype=torch.float32, device="cuda").to(t.dtype))
    before = [t.clone() for t in src_pool.kv_views]
    assert warm_copy_kernel(src_pool, layers_per_write) >= 1
    assert all(torch.equal(a, b) for a, b in zip(before, src_pool.kv_views, strict=True))
    compiled = _compiled_copies()
    heads = src_pool.heads_local
    for group in (None, layers_per_write):
        spec = tables.decide_table(
            src_pool.stride_rows, dst_pool.stride_rows, src_pool.head_bytes, 16, 16, 0, 0, heads, heads, heads,
            group_layers=group,
        )  # fmt: skip
        sides = []
        for side, pool in (("src", src_pool), ("dst", dst_pool)):
            bases = np.array([r.addr for r in pool.regions()], dtype=np.uint64)
            addr, _ = tables.side_entries(
                spec, side, bases, pool.region_lengths, pool.stride_rows, pool.num_pages
            )
            sides.append(entry_table(addr, spec.entry_bytes, "cuda"))
        layers = layout.num_layers  # a group: its layers' K rows, then their V rows
        rows = None if group is None else np.r_[np.arange(group), layers + np.arange(group)]
        copy_outer(sides[0], sides[1], *tables.write_factors(spec, [3, 7, 1], [0, 5, 9], rows))
    torch.cuda.synchronize()
    assert _compiled_copies() == compiled, "the first copy compiled a kernel the warm-up did not"
    for t in range(2 * layout.num_layers):
        got, want = (v.view(-1, 16, *v.shape[1:]) for v in (dst_pool.kv_views[t], src_pool.kv_views[t]))
        assert torch.equal(got[[0, 5, 9]], want[[3, 7, 1]]), f"tensor {t}"
