"""The narrow interface the engine uses to talk to NIXL: what a WRITE is (:class:`WriteSpec`), what a
peer registered (:class:`RemotePeer`, which range-checks a WRITE's remote side before it is posted),
a posted WRITE's state (:class:`XferState`), one side's descriptor table (:class:`TableRows`, prepared
once per peer: docs/DECISIONS.md, "Descriptor tables made once per peer") and the calls the NixlPoller
makes (:class:`Transport`).

:class:`~transfer_engine.transport.nixl.NixlTransport` is its one implementation; the fault-injecting
wrapper of the chaos tests (:mod:`transfer_engine.transport.faults`) wraps it. No NIXL import here.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from transfer_engine.errors import AddressRangeError, TransportError
from transfer_engine.protocol.messages import MemRegion


class XferState(enum.Enum):
    """State of a posted WRITE, as NIXL reports it."""

    PROC = "PROC"
    DONE = "DONE"
    ERR = "ERR"


@dataclass(frozen=True, slots=True)
class WriteSpec:
    """One WRITE: uint64 ``(src, dst, length)`` descriptor arrays from local memory into ``peer``'s.

    ``local_devices`` is one device id for every descriptor or one per descriptor; ``notif`` is the
    encoded notification NIXL delivers to the peer once the bytes have landed; ``seal``, when set,
    makes the notification the WRITE starts with instead, taken as it starts (integrity: the
    checksum of its bytes rides on it; docs/INTEGRITY.md).
    """

    peer: str
    local_mem: str
    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray
    local_devices: np.ndarray | int
    notif: bytes
    seal: Callable[[], bytes] | None = None

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())


@dataclass(frozen=True, slots=True)
class TableRows:
    """One side's descriptor table as rows of evenly spaced entries: row ``r`` holds ``count``
    entries of ``length`` bytes, entry ``i`` at ``addr[r] + i * stride[r]``; the entry's index in the
    table is ``r * count + i``. NIXL (1.5) prepares such a row as one strided descriptor (an Nx5
    list), however many entries it holds; :meth:`flat` lists every entry for a NIXL that does not.
    ``addr`` and ``stride`` are uint64 arrays of one value per row."""

    addr: np.ndarray
    stride: np.ndarray
    count: int
    length: int

    @property
    def rows(self) -> int:
        return len(self.addr)

    @property
    def entries(self) -> int:
        """Entries in the table: the bound of its indices."""
        return self.rows * self.count

    def spans(self) -> np.ndarray:
        """Bytes from each row's first entry to the end of its last (uint64)."""
        return (self.stride * np.uint64(self.count - 1) + np.uint64(self.length)).astype(np.uint64)

    def strided(self, devices: np.ndarray | int) -> np.ndarray:
        """The Nx5 ``(addr, length, device, stride, count)`` rows NIXL's ``prep_xfer_dlist`` takes."""
        out = np.empty((self.rows, 5), dtype=np.uint64)
        out[:, 0] = self.addr
        out[:, 1] = self.length
        out[:, 2] = devices
        # a one-entry row's stride is never used; NIXL wants it no shorter than the entry
        out[:, 3] = self.stride if self.count > 1 else np.uint64(self.length)
        out[:, 4] = self.count
        return out

    def flat(self) -> np.ndarray:
        """Every entry's address, in index order (uint64, :attr:`entries` long)."""
        steps = np.arange(self.count, dtype=np.uint64)
        return (self.addr[:, None] + self.stride[:, None] * steps[None, :]).reshape(-1)


@dataclass
class RemotePeer:
    """A remote agent this side may WRITE into: its name, memory type and registered regions.

    ``mem_types`` gives each region its own NIXL memory type (a host-staging ring is DRAM while the
    KV is VRAM); when empty every region is ``mem_type``.
    """

    agent_name: str
    mem_type: str
    regions: list[MemRegion]
    mem_types: list[str] = field(default_factory=list)
    _starts: np.ndarray = field(init=False, repr=False)
    _ends: np.ndarray = field(init=False, repr=False)
    _devices: np.ndarray = field(init=False, repr=False)
    _kinds: list[str] = field(init=False, repr=False)
    _only_kind: str | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        kinds = self.mem_types or [self.mem_type] * len(self.regions)
        if len(kinds) != len(self.regions):
            raise TransportError(
                f"peer {self.agent_name}: {len(self.regions)} regions but {len(kinds)} memory types"
            )
        order = sorted(range(len(self.regions)), key=lambda i: self.regions[i].addr)
        self._starts = np.array([self.regions[i].addr for i in order], dtype=np.uint64)
        self._ends = np.array([self.regions[i].end for i in order], dtype=np.uint64)
        self._devices = np.array([self.regions[i].device for i in order], dtype=np.uint64)
        self._kinds = [kinds[i] for i in order]
        self._only_kind = kinds[0] if len(set(kinds)) == 1 else None

    def check(self, addr: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, str]:
        """``(device id of each range, memory type)``; AddressRangeError naming the first bad range.

        A range is bad when it lies outside every registered region; a WRITE is refused whole when
        its ranges span regions of different memory types.
        """
        if len(self._starts) == 0:
            raise AddressRangeError(f"peer {self.agent_name} registered no memory")
        idx = np.searchsorted(self._starts, addr, side="right").astype(np.int64) - 1
        safe = np.maximum(idx, 0)
        ok = (idx >= 0) & (addr + length <= self._ends[safe])
        if not ok.all():
            bad = int(np.flatnonzero(~ok)[0])
            raise AddressRangeError(
                f"WRITE of {int(length[bad])} bytes at {int(addr[bad]):#x} lies outside every region "
                f"registered by peer {self.agent_name}"
            )
        if self._only_kind is not None:  # the usual case: every region is VRAM (or every one DRAM)
            return self._devices[safe], self._only_kind
        kinds = {self._kinds[i] for i in np.unique(safe).tolist()}
        if len(kinds) != 1:
            raise AddressRangeError(
                f"WRITE to peer {self.agent_name} spans regions of memory types {sorted(kinds)}"
            )
        return self._devices[safe], kinds.pop()


class Transport(Protocol):
    """What the engine needs from a transfer library. Implemented by :class:`NixlTransport`."""

    name: str

    def metadata(self) -> bytes: ...
    def register(self, regions: Sequence[MemRegion], mem_type: str) -> int: ...
    def deregister(self, reg: int) -> None: ...
    def add_peer(self, peer: RemotePeer, metadata: bytes) -> None: ...
    def remove_peer(self, agent_name: str) -> None: ...
    def post_write(self, spec: WriteSpec) -> int: ...
    def prepare_write(self, spec: WriteSpec) -> int: ...
    def prepare_lists(self, spec: WriteSpec) -> int: ...
    def prepare_indexed(self, lists: int, index: np.ndarray, spec: WriteSpec) -> int: ...
    def close_lists(self, lists: int) -> None: ...

    def table(self, peer: str, key: Hashable) -> int | None:
        """The id of ``peer``'s descriptor tables prepared under ``key`` (:meth:`prepare_table`), while
        the peer is known; None before, and after it was removed."""
        ...

    def prepare_table(
        self,
        peer: str,
        key: Hashable,
        local: TableRows,
        remote: TableRows,
        local_mem: str,
        local_device: int,
        max_descriptors: int,
    ) -> int:
        """Prepare both sides' descriptor tables of the pair (``peer``, ``key``) once: ``local`` over
        this agent's memory (``local_mem`` on ``local_device``), ``remote`` over the peer's, for every
        WRITE between them (:meth:`prepare_from_table`). Returns their id, which :meth:`table` finds
        until the peer is removed or the transport closes; each side is released once the last WRITE
        made from it is. TransportError, nothing prepared, its text the reason the caller logs, when
        they cannot be: more than ``max_descriptors`` descriptors a side
        (``EngineConfig.table_max_descriptors``), an unknown peer, tables of the pair prepared
        already, entries of unequal lengths, the transfer library refusing, or a remote row outside
        the peer's registered regions (AddressRangeError)."""
        ...

    def prepare_from_table(
        self, table: int, src_index: np.ndarray, dst_index: np.ndarray, spec: WriteSpec
    ) -> int:
        """Make the WRITE ``spec``, entries ``src_index`` of ``table``'s local side to entries
        ``dst_index`` of its remote side (equal lengths), without starting it; a handle as
        :meth:`prepare_write` returns. ``spec`` is what those entries move, to the table's peer.
        TransportError, nothing made, when an index is outside its side, the tables are gone or
        another peer's, or the transfer library refuses."""
        ...

    def live_tables(self) -> int: ...
    def start_write(self, handle: int, notif: bytes = b"") -> int: ...
    def state(self, handle: int) -> XferState: ...
    def release(self, handle: int) -> None: ...
    def drain_notifs(self) -> dict[str, list[bytes]]: ...
    def live_handles(self) -> int: ...
    def close(self) -> None: ...
