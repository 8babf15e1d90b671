"""The kernel path on CUDA (issue 40 item 2), run by the lead on the GPU machine
(``tools/gpu_e2e.sh kernelpath``; skipped without CUDA): the prefill maps the decode's pool through CUDA
IPC (``memory/ipc.py``: ``cuIpcGetMemHandle`` / ``cuIpcOpenMemHandle``) and copies each chunk or layer
group with one Triton launch on its side stream.

Two real processes on this host (both on ``cuda:0`` when one GPU is visible): bytes exact, the path
``kernel`` with its reason, a decode killed mid-room (the prefill's mapping closed once no copy is in
flight) and a prefill killed mid-room; the same cases the CPU suite runs through ``/dev/shm``
(``tests/integration/test_kernel_path_processes.py``). And the driver calls themselves: an export
from a child process mapped here, written by the kernel, read back there.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.connection import Connection

import numpy as np
import pytest
import torch

from tests.integration import test_kernel_path_processes as cases
from transfer_engine.kernels.copy import copy_entries, entry_table
from transfer_engine.memory import ipc
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


def _exporter(conn: Connection) -> None:
    """A child process: two regions inside one caching-allocator block, exported; then their sums."""
    torch.cuda.set_device(0)
    block = torch.zeros(3 << 20, dtype=torch.uint8, device="cuda")
    regions = [
        MemRegion(block.data_ptr() + 4096, 1 << 20, 0),
        MemRegion(block.data_ptr() + (2 << 20), 1 << 20, 0),
    ]
    conn.send((ipc.export_pool(regions, torch.device("cuda:0")), regions))
    conn.recv()  # the parent wrote
    torch.cuda.synchronize()
    conn.send(
        [int(block[r.addr - block.data_ptr() : r.addr - block.data_ptr() + r.length].sum()) for r in regions]
    )
    conn.recv()


def test_cuda_ipc_export_map_copy_close() -> None:
    """Regions at offsets inside one allocation: exported once (one handle), mapped here, written by the
    copy kernel, seen by the exporter; closing the mapping leaves nothing open."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_exporter, args=(child,))
    proc.start()
    try:
        share, regions = parent.recv()
        assert share.kind == "cuda_ipc" and len(share.memories) == 1 and len(share.device) == 16
        assert [r.offset for r in share.regions] == [4096, 2 << 20]
        mapping = ipc.map_pool(share, regions, torch.device("cuda:0"))
        assert mapping.how == "cuda_ipc" and ipc.open_mappings() == 1
        src = torch.full((2 << 20,), 3, dtype=torch.uint8, device="cuda")
        entries = 1 << 20 >> 12  # 4 KiB entries per region
        s_table = entry_table(src.data_ptr() + np.arange(2 * entries, dtype=np.uint64) * 4096, 4096, "cuda")
        d_addr = np.concatenate([b + np.arange(entries, dtype=np.uint64) * 4096 for b in mapping.bases])
        d_table = entry_table(d_addr, 4096, "cuda")
        idx = np.arange(2 * entries, dtype=np.int32)
        assert mapping.acquire()
        stream = torch.cuda.Stream()
        copy_entries(s_table, d_table, idx, idx[::-1].copy(), stream=stream)
        stream.synchronize()
        mapping.release()
        parent.send("written")
        assert parent.recv() == [3 << 20, 3 << 20]
        mapping.close_when_idle()
        assert mapping.closed and ipc.open_mappings() == 0
        parent.send("done")
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
