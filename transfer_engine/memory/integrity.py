"""Checksums of the KV a chunk covers, over a rank's own pool (docs/INTEGRITY.md).

Both sides call :meth:`PoolChecksums.chunk` over their own pages: the prefill with its token slots
and source head slice when a chunk's (or layer group's) WRITE starts, through the notification
:func:`sealed` builds; the decode with its slots and destination head slice once the bytes are in
its pages (landed, or scattered out of the ring). Equal bytes give equal sums whatever the two page
layouts, paths or TP sizes (``protocol/integrity.py``).

On CUDA the sum runs on this object's own stream, ordered after nothing but the caller's
promise that the bytes are final (their event completed, or the WRITE landed), and the caller's
thread waits for it (a read of the chunk's bytes at HBM speed). On CPU it runs on the caller's
thread with torch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import msgspec
import numpy as np
import torch

from transfer_engine.errors import ConfigError
from transfer_engine.kernels import KVTable, as_kv_table
from transfer_engine.kernels.checksum import WORD, checksum_heads, checksum_value
from transfer_engine.memory.layout import KVPool
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.layers import group_tensors

__all__ = ["PoolChecksums", "sealed"]


class PoolChecksums:
    """Checksums over one pool's KV: every tensor, or a layer group's, of some slots and a head slice.

    Thread-safe: the prefill calls it from the loop or from a worker's completion waiter thread."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self._all = as_kv_table(pool.kv_views)
        if self._all.byte_gcd % WORD:
            raise ConfigError(
                f"integrity sums whole {WORD}-byte words, and this KV's rows, strides or addresses are "
                f"{self._all.byte_gcd}-byte aligned (head_dim={self._all.head_dim}, {self._all.dtype}); "
                "set integrity=False (TE_INTEGRITY=0) for it"
            )
        self._groups: dict[tuple[int, int], KVTable] = {}
        self._lock = threading.Lock()
        self.stream = torch.cuda.Stream(pool.device) if pool.device.type == "cuda" else None

    def _table(self, layers: tuple[int, int] | None) -> KVTable:
        if layers is None:
            return self._all
        with self._lock:
            table = self._groups.get(layers)
            if table is None:
                layout = self.pool.layout
                rows = group_tensors(layout.num_layers, layout.mla, *layers).tolist()
                table = self._groups[layers] = as_kv_table([self.pool.kv_views[i] for i in rows])
            return table

    def chunk(
        self, slots: np.ndarray, head_start: int, num_heads: int, layers: tuple[int, int] | None
    ) -> int:
        """The checksum of heads ``[head_start, head_start + num_heads)`` of ``slots`` (this pool's token
        slots, in the chunk's order) over every tensor, or layers ``[start, end)``'s: the gather
        layout ``kernels.checksum`` defines. Blocks the calling thread until it is known."""
        index = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64))
        result = checksum_heads(self._table(layers), index, head_start, num_heads, stream=self.stream)
        if self.stream is None:
            return checksum_value(result)
        with torch.cuda.stream(self.stream):  # the read waits for this stream only, not the default one
            return checksum_value(result)


def sealed(notif: bytes, checksum: Callable[[], int]) -> Callable[[], bytes]:
    """The notification of a WRITE as it starts: ``notif`` (an encoded ``ChunkLanded``) carrying
    ``checksum()``, taken then (the WRITE's bytes are final when it starts)."""
    landed = m.decode_notification(notif)
    if not isinstance(landed, m.ChunkLanded):
        raise TypeError(f"only a chunk's notification carries a checksum, not {type(landed).__name__}")

    def seal() -> bytes:
        return m.encode(msgspec.structs.replace(landed, checksum=checksum()))

    return seal
