"""Staging memory: the prefill workers' staging buffers and the decode ring.

Both are flat uint8 tensors registered with NIXL. Device staging puts them next to the KV (VRAM on a
GPU); host staging puts them in pinned host memory, which the gather and scatter kernels read and
write directly. On a machine without CUDA the KV is in DRAM and both variants are plain DRAM.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import anyio
import torch

from transfer_engine.kernels import as_kv_table, gather_heads, scatter_heads
from transfer_engine.memory.layout import KVPool
from transfer_engine.protocol.messages import MemRegion


@dataclass(frozen=True, eq=False)
class StagingMemory:
    """One registered staging tensor: the bytes, their NIXL memory type and device id."""

    tensor: torch.Tensor
    mem_type: str
    device_id: int

    @property
    def addr(self) -> int:
        return int(self.tensor.data_ptr())

    @property
    def nbytes(self) -> int:
        return int(self.tensor.numel())

    def region(self) -> MemRegion:
        return MemRegion(self.addr, self.nbytes, self.device_id)

    def view(self, offset: int, length: int) -> torch.Tensor:
        """Bytes ``[offset, offset + length)`` as a 1-D uint8 tensor (no copy)."""
        return self.tensor[offset : offset + length]


def allocate_staging(pool: KVPool, nbytes: int, *, host: bool) -> StagingMemory:
    """``nbytes`` of staging memory beside ``pool``: on its device, or pinned host when ``host``."""
    if pool.device.type == "cuda" and not host:
        tensor = torch.empty(nbytes, dtype=torch.uint8, device=pool.device)
        return StagingMemory(tensor, "VRAM", pool.device_id)
    pinned = pool.device.type == "cuda"  # pinning needs a CUDA context; plain DRAM otherwise
    tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    return StagingMemory(tensor, "DRAM", 0)


def chunk_region_bytes(pool: KVPool, pages: int) -> int:
    """Bytes one staged chunk of ``pages`` of this pool's pages occupies with all its local heads."""
    return pages * pool.page_bytes * pool.layout.num_kv_tensors


INLINE_COPY_BYTES = 1 << 20
"""CPU copies up to this size run on the event-loop thread (tens of microseconds); larger ones in
a worker thread, so the loop keeps polling NIXL meanwhile. A thread hop costs a GIL hand-over, up
to the interpreter's 5 ms switch interval when the loop is busy: far more than a small copy."""


async def run_cpu_copy(copy: Callable[[], None], nbytes: int) -> None:
    """Run a CPU gather/scatter ``copy`` of ``nbytes``: inline when small, else in a worker thread."""
    if nbytes <= INLINE_COPY_BYTES:
        copy()
    else:
        await anyio.to_thread.run_sync(copy)


def head_counts(heads: int) -> list[int]:
    """The head-slice widths a staged copy of a pool with ``heads`` local heads may use: its
    divisors (a TP ratio cuts the heads evenly; replicated heads copy whole ones)."""
    return [n for n in range(1, heads + 1) if heads % n == 0]


def warm_staging_kernels(pool: KVPool, *, scatter: bool) -> int:
    """Compile the staging kernels a CUDA ``pool`` will launch, before any peer is connected.

    Triton compiles a kernel on its first launch for each set of compile-time constants, on the
    calling thread: the engine's loop, where 0.5-2 s without heartbeats got a peer declared dead on a
    fresh GPU machine (docs/PERF.md). The constants depend on the pool's layout and on the head-slice
    width, not on the room's size (``kernels.piece_block``), so a one-token copy per width of
    :func:`head_counts` compiles every kernel a room can need (pinned host staging runs the same
    kernels). Each width gathers slot 0's heads and, with ``scatter`` (a decode rank), scatters them
    back where they were: the pool's bytes are unchanged. Returns the launches (0 on CPU: nothing
    is compiled there).
    """
    if pool.device.type != "cuda":
        return 0
    kv = as_kv_table(pool.kv_views)
    slot = torch.zeros(1, dtype=torch.int64)
    launches = 0
    for n in head_counts(kv.heads):
        out = torch.empty(len(kv) * n * kv.head_dim * kv.itemsize, dtype=torch.uint8, device=pool.device)
        gather_heads(kv, slot, 0, n, out)
        launches += 1
        if scatter:
            scatter_heads(out, kv, slot, [(0, 0, n)])  # the same bytes back into the same place
            launches += 1
    torch.cuda.synchronize(pool.device)
    return launches
