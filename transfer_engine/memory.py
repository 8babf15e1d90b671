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

from transfer_engine.layout import KVPool
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
