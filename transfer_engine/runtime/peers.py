"""What one side knows about the ranks on the other side, learned in the PeerHello handshake."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from transfer_engine.protocol.messages import LayoutInfo, MemRegion


@dataclass
class Peer:
    """A remote rank: its control endpoint, NIXL agent, memory and layout, and its lease."""

    agent_name: str
    endpoint: str
    rank: int
    tp_size: int
    layout: LayoutInfo
    mem_type: str = "DRAM"
    regions: list[MemRegion] = field(default_factory=list)
    aux: MemRegion | None = None
    ring: MemRegion | None = None
    last_seen: float = 0.0
    alive: bool = True
    mapped: str = ""
    """Decode: how this prefill rank mapped this rank's pool for the kernel path (``PeerHelloAck.mapped``:
    ``cuda_ipc``, ``shm``, ``process``); empty: it did not, for ``unmapped``."""
    unmapped: str = "not offered"
    """Decode: why this prefill rank did not map this rank's pool (``PeerHelloAck.unmapped``)."""
    mapping: object | None = None
    """Prefill: this decode rank's pool mapped into this process (a ``memory.ipc.MappedPool``), the
    kernel path's target; None when not mapped."""

    @cached_property
    def bases(self) -> np.ndarray:
        """Base addresses of the peer's KV tensors, in tensor order (uint64; made once: every WRITE
        plan reads it, and ``regions`` is fixed by the handshake)."""
        return np.array([r.addr for r in self.regions], dtype=np.uint64)

    @property
    def heads_local(self) -> int:
        if self.layout.mla:
            return 1
        return max(self.layout.num_heads // self.tp_size, 1)

    def slot_bytes(self, itemsize: int) -> int:
        return self.heads_local * self.layout.head_dim * itemsize


@dataclass
class PrefillInstance:
    """A prefill TP group found through one bootstrap endpoint (decode side)."""

    bootstrap: str
    tp_size: int
    ranks: list[Peer]
