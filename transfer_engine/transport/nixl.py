"""The narrow interface the engine uses to talk to NIXL, and its one implementation.

Only the NixlPoller actor holds a :class:`Transport`; every NIXL call goes through it (the agent is
not thread-safe, and one owner keeps the bookkeeping of handles in one place). NIXL's exceptions are
translated here into :class:`~transfer_engine.errors.TransportError`.

A WRITE is described by three uint64 arrays ``(src_addr, dst_addr, length)``; the transport turns
them into NIXL descriptor lists without Python loops and posts one transfer carrying one
notification. Remote ranges are checked against the regions the peer registered *before* posting
(:class:`~transfer_engine.errors.AddressRangeError`).
"""

from __future__ import annotations

import enum
import itertools
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from transfer_engine.errors import AddressRangeError, TransportError
from transfer_engine.protocol.messages import MemRegion

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class PageGrid:
    """Every page of every KV tensor of one rank, as one prepared NIXL descriptor list.

    Entry ``t * num_pages + p`` is page ``p`` of tensor ``t`` (``bases`` in tensor order). A WRITE
    whose ranges are whole pages on the grids of both sides is posted from the prepared lists
    (``make_prepped_xfer`` with index arrays): NIXL then skips the per-descriptor work a one-shot
    transfer does inside ``transfer()``, 2-6 us per descriptor on H200s (docs/PERF.md).
    """

    bases: np.ndarray
    page_bytes: int
    num_pages: int
    device: int
    _order: np.ndarray = field(init=False, repr=False)
    _sorted: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        bases = np.asarray(self.bases, dtype=np.uint64)
        object.__setattr__(self, "bases", bases)
        object.__setattr__(self, "_order", np.argsort(bases))
        object.__setattr__(self, "_sorted", bases[self._order])

    def descs(self) -> np.ndarray:
        """The ``(tensors * num_pages, 3)`` uint64 table ``(addr, length, device)``, tensor-major."""
        pages = np.arange(self.num_pages, dtype=np.uint64) * np.uint64(self.page_bytes)
        addr = (self.bases[:, None] + pages[None, :]).ravel()
        return _descs(addr, np.full(addr.size, self.page_bytes, dtype=np.uint64), self.device)

    def indices(self, addr: np.ndarray, length: np.ndarray) -> np.ndarray | None:
        """Grid entries covering the ranges ``(addr, length)`` in order (a run of k pages gives k
        entries), or None when some range is not whole pages of one tensor of this grid."""
        if addr.size == 0 or self.bases.size == 0:
            return None
        step = np.uint64(self.page_bytes)
        if (length % step).any() or not length.all():
            return None
        pos = np.searchsorted(self._sorted, addr, side="right").astype(np.int64) - 1
        if (pos < 0).any():
            return None
        tensor = self._order[pos]
        offset = addr - self.bases[tensor]
        if (offset % step).any():
            return None
        first = (offset // step).astype(np.int64)
        count = (length // step).astype(np.int64)
        if (first + count > self.num_pages).any():
            return None
        start = tensor.astype(np.int64) * self.num_pages + first
        if (count == 1).all():
            return start
        run_of = np.repeat(np.arange(count.size), count)
        within = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
        return start[run_of] + within


class XferState(enum.Enum):
    """State of a posted WRITE, as NIXL reports it."""

    PROC = "PROC"
    DONE = "DONE"
    ERR = "ERR"


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
    grid: PageGrid | None = None
    """The peer's KV pages, to post WRITEs to them from prepared lists (None: one-shot only)."""
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
        safe = np.clip(idx, 0, None)
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
    def set_local_grid(self, grid: PageGrid, mem_type: str) -> None: ...
    def add_peer(self, peer: RemotePeer, metadata: bytes) -> None: ...
    def remove_peer(self, agent_name: str) -> None: ...
    def post_write(
        self,
        peer: str,
        local_mem: str,
        src: np.ndarray,
        dst: np.ndarray,
        length: np.ndarray,
        local_devices: np.ndarray | int,
        notif: bytes,
    ) -> int: ...
    def state(self, handle: int) -> XferState: ...
    def release(self, handle: int) -> None: ...
    def drain_notifs(self) -> dict[str, list[bytes]]: ...
    def live_handles(self) -> int: ...
    def close(self) -> None: ...


def _descs(addr: np.ndarray, length: np.ndarray, devices: np.ndarray | int) -> np.ndarray:
    out = np.empty((len(addr), 3), dtype=np.uint64)
    out[:, 0] = addr
    out[:, 1] = length
    out[:, 2] = devices
    return out


class NixlTransport:
    """One NIXL agent with the UCX (or another) backend. Not thread-safe: one owner calls it."""

    def __init__(
        self,
        name: str,
        backend: str = "UCX",
        params: dict[str, str] | None = None,
        *,
        progress_thread: bool = False,
    ) -> None:
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as exc:  # pragma: no cover - nixl is a hard dependency
            raise TransportError(f"nixl is not importable: {exc}") from exc
        self.name = name
        try:
            config = nixl_agent_config(
                enable_prog_thread=progress_thread, backends=[] if params else [backend], num_threads=0
            )
            self._agent: Any = nixl_agent(name, config)
            if params:
                self._agent.create_backend(backend, dict(params))
        except Exception as exc:
            raise TransportError(f"cannot create NIXL agent {name!r} with backend {backend}: {exc}") from exc
        self._regs: dict[int, Any] = {}
        self._peers: dict[str, RemotePeer] = {}
        self._handles: dict[int, Any] = {}
        self._ids = itertools.count(1)
        self._local_grid: tuple[PageGrid, Any] | None = None
        self._remote_grids: dict[str, tuple[PageGrid, Any]] = {}
        self.stats: Counter[str] = Counter()
        """WRITEs posted ``prepared`` (from the page grids) and ``one_shot``."""

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def register(self, regions: Sequence[MemRegion], mem_type: str) -> int:
        """Register memory ranges; returns a registration id for :meth:`deregister`."""
        triples = [(r.addr, r.length, r.device, "") for r in regions]
        try:
            reg = self._agent.register_memory(triples, mem_type)
        except Exception as exc:
            raise TransportError(
                f"NIXL register_memory of {len(triples)} {mem_type} regions failed: {exc}"
            ) from exc
        rid = next(self._ids)
        self._regs[rid] = reg
        return rid

    def deregister(self, reg: int) -> None:
        self._agent.deregister_memory(self._regs.pop(reg))

    def set_local_grid(self, grid: PageGrid, mem_type: str) -> None:
        """Prepare the local KV pages (registered already) as one descriptor list."""
        try:
            handle = self._agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", self._agent.get_xfer_descs(grid.descs(), mem_type)
            )
        except Exception as exc:
            raise TransportError(
                f"cannot prepare the local page list ({grid.num_pages} pages): {exc}"
            ) from exc
        self._release_local_grid()
        self._local_grid = (grid, handle)

    def _release_local_grid(self) -> None:
        if self._local_grid is not None:
            self._agent.release_dlist_handle(self._local_grid[1])
            self._local_grid = None

    def add_peer(self, peer: RemotePeer, metadata: bytes) -> None:
        """Load a peer's agent metadata (replacing an older one of the same name)."""
        if peer.agent_name in self._peers:
            self.remove_peer(peer.agent_name)
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as exc:
            raise TransportError(f"NIXL add_remote_agent({peer.agent_name}) failed: {exc}") from exc
        name = name.decode() if isinstance(name, bytes) else name
        if name != peer.agent_name:
            self._agent.remove_remote_agent(name)
            raise TransportError(f"peer metadata names agent {name!r}, expected {peer.agent_name!r}")
        self._peers[peer.agent_name] = peer
        grid = peer.grid
        local = self._local_grid
        if grid is not None and local is not None and grid.page_bytes == local[0].page_bytes:
            table = grid.descs()
            try:
                peer.check(table[:, 0], table[:, 1])  # the grid lies in memory the peer registered
                handle = self._agent.prep_xfer_dlist(name, self._agent.get_xfer_descs(table, peer.mem_type))
            except Exception as exc:
                self.remove_peer(peer.agent_name)
                raise TransportError(f"cannot prepare the page list of peer {name}: {exc}") from exc
            self._remote_grids[name] = (grid, handle)

    def remove_peer(self, agent_name: str) -> None:
        grid = self._remote_grids.pop(agent_name, None)
        if grid is not None:
            try:
                self._agent.release_dlist_handle(grid[1])
            except Exception as exc:
                log.warning("release_dlist_handle(%s) failed: %s", agent_name, exc)
        if self._peers.pop(agent_name, None) is not None:
            try:
                self._agent.remove_remote_agent(agent_name)
            except Exception as exc:
                log.warning("remove_remote_agent(%s) failed: %s", agent_name, exc)

    def has_peer(self, agent_name: str) -> bool:
        return agent_name in self._peers

    def post_write(
        self,
        peer: str,
        local_mem: str,
        src: np.ndarray,
        dst: np.ndarray,
        length: np.ndarray,
        local_devices: np.ndarray | int,
        notif: bytes,
    ) -> int:
        """Post one WRITE of ``len(src)`` descriptors with ``notif`` riding on it; returns a handle.

        Raises AddressRangeError (nothing posted) when a destination range is outside the peer's
        registered regions, and TransportError when NIXL refuses the transfer.
        """
        remote = self._peers.get(peer)
        if remote is None:
            raise TransportError(f"no NIXL peer named {peer!r}")
        remote_devices, remote_mem = remote.check(dst, length)
        prepared = self._on_grids(peer, src, dst, length)
        try:
            if prepared is not None:
                local_h, local_idx, remote_h, remote_idx = prepared
                handle = self._agent.make_prepped_xfer(
                    "WRITE", local_h, local_idx, remote_h, remote_idx, notif
                )
            else:
                local = self._agent.get_xfer_descs(_descs(src, length, local_devices), local_mem)
                far = self._agent.get_xfer_descs(_descs(dst, length, remote_devices), remote_mem)
                handle = self._agent.initialize_xfer("WRITE", local, far, peer, notif)
        except Exception as exc:
            raise TransportError(f"cannot create WRITE to {peer} ({len(src)} descriptors): {exc}") from exc
        self.stats["prepared" if prepared is not None else "one_shot"] += 1
        hid = next(self._ids)
        self._handles[hid] = handle
        try:
            state = self._agent.transfer(handle)
        except Exception as exc:
            self.release(hid)
            raise TransportError(f"WRITE to {peer} failed to start: {exc}") from exc
        if state == "ERR":
            self.release(hid)
            raise TransportError(f"WRITE to {peer} failed to start")
        return hid

    def _on_grids(
        self, peer: str, src: np.ndarray, dst: np.ndarray, length: np.ndarray
    ) -> tuple[Any, np.ndarray, Any, np.ndarray] | None:
        """``(local list, indices, remote list, indices)`` when both sides' ranges are whole pages
        of the prepared grids (the direct path), else None (staging buffers, token slices, aux)."""
        local, remote = self._local_grid, self._remote_grids.get(peer)
        if local is None or remote is None:
            return None
        local_idx = local[0].indices(src, length)
        if local_idx is None:
            return None
        remote_idx = remote[0].indices(dst, length)
        if remote_idx is None:
            return None
        return local[1], local_idx, remote[1], remote_idx

    def state(self, handle: int) -> XferState:
        try:
            return XferState(self._agent.check_xfer_state(self._handles[handle]))
        except Exception as exc:
            log.warning("check_xfer_state failed: %s", exc)
            return XferState.ERR

    def release(self, handle: int) -> None:
        h = self._handles.pop(handle)
        try:
            self._agent.release_xfer_handle(h)
        except Exception as exc:
            log.warning("release_xfer_handle failed: %s", exc)

    def drain_notifs(self) -> dict[str, list[bytes]]:
        notifs: dict[str, list[bytes]] = self._agent.get_new_notifs()
        return notifs

    def live_handles(self) -> int:
        return len(self._handles)

    def close(self) -> None:
        for hid in list(self._handles):
            self.release(hid)
        for name in list(self._peers):
            self.remove_peer(name)
        self._release_local_grid()
        for rid in list(self._regs):
            self.deregister(rid)
