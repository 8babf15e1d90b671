"""The narrow interface the engine uses to talk to NIXL, and its one implementation.

Only the NixlPoller actor holds a :class:`Transport`; every NIXL call goes through it (one owner
keeps the bookkeeping of handles in one place). The agent runs in NIXL's thread-sync mode NONE (no
locks of its own), so :class:`NixlTransport` serializes its calls with one lock of ours: every call
is made on the event loop's thread except :meth:`~NixlTransport.start_write`, which the completion
waiter's thread may also make (docs/DECISIONS.md, "A held WRITE is started by the completion
waiter's thread"). NIXL's exceptions are translated here into
:class:`~transfer_engine.errors.TransportError`.

A WRITE is described by three uint64 arrays ``(src_addr, dst_addr, length)``; the transport turns
them into NIXL descriptor lists without Python loops, prepares them for that one WRITE and posts
one prepared transfer carrying one notification (a one-shot ``initialize_xfer`` costs NIXL 2-6 us
per descriptor on H200s; the prepared lists are released with the transfer). The groups of a
layer-wise chunk share lists prepared once for the whole chunk (:meth:`NixlTransport.prepare_lists`):
each group's WRITE is made from an index into them, with no range check or list preparation of its
own. Remote ranges are checked against the regions the peer registered *before* posting
(:class:`~transfer_engine.errors.AddressRangeError`).
"""

from __future__ import annotations

import enum
import functools
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

import numpy as np

from transfer_engine.errors import AddressRangeError, TransportError
from transfer_engine.protocol.messages import MemRegion

log = logging.getLogger(__name__)

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _serialized(
    method: Callable[Concatenate[NixlTransport, _P], _R],
) -> Callable[Concatenate[NixlTransport, _P], _R]:
    """Run ``method`` holding the transport's lock: one caller of the agent at a time."""

    @functools.wraps(method)
    def call(self: NixlTransport, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            return method(self, *args, **kwargs)

    return call


class XferState(enum.Enum):
    """State of a posted WRITE, as NIXL reports it."""

    PROC = "PROC"
    DONE = "DONE"
    ERR = "ERR"


@dataclass(frozen=True, slots=True)
class WriteSpec:
    """One WRITE: uint64 ``(src, dst, length)`` descriptor arrays from local memory into ``peer``'s.

    ``local_devices`` is one device id for every descriptor or one per descriptor; ``notif`` is the
    encoded notification NIXL delivers to the peer once the bytes have landed.
    """

    peer: str
    local_mem: str
    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray
    local_devices: np.ndarray | int
    notif: bytes

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())


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
    def start_write(self, handle: int) -> int: ...
    def state(self, handle: int) -> XferState: ...
    def release(self, handle: int) -> None: ...
    def drain_notifs(self) -> dict[str, list[bytes]]: ...
    def live_handles(self) -> int: ...
    def close(self) -> None: ...


POST_THREADS = 4
"""UCX posting threads of an agent whose KV is in GPU memory (NIXL's ``num_threads``). UCX's cuda_ipc
pays about 8 us per descriptor inside ``transfer()`` on an H100 host, so a one-page room of 128 KV
tensors (128 descriptors) posted for 1.06 ms; four threads that each post a batch cut it to 0.33 ms
and the small room's latency by 0.57 ms (docs/PERF.md, "Posting on threads"). Idle threads cost
nothing (measured: no CPU while no transfer is out)."""
POST_SPLIT = 16
"""Descriptors per batch handed to a posting thread (NIXL's ``split_batch_size``). Its own default
is far above a room's descriptors, so without it no WRITE of ours was ever split."""


def default_params(backend: str, params: dict[str, str], device_type: str) -> dict[str, str]:
    """The backend parameters an engine's agent is made with: ``params`` as given, plus, for UCX with
    KV in GPU memory and no ``num_threads`` given, POST_THREADS threads splitting WRITEs in batches of
    POST_SPLIT descriptors. ``num_threads=0`` in ``params`` (``TE_NIXL_PARAMS``) keeps one thread.
    CPU pools keep NIXL's defaults: there UCX copies the bytes inside ``transfer()`` and the engine's
    CPU figures were measured without threads."""
    if backend != "UCX" or device_type != "cuda" or "num_threads" in params:
        return dict(params)
    return {**params, "num_threads": str(POST_THREADS), "split_batch_size": str(POST_SPLIT)}


HOST_PIECE_MIN = 256 << 10
"""Smallest piece a host-memory WRITE is cut into for the posting threads (:func:`spread`)."""


def host_pieces(params: dict[str, str]) -> int:
    """How many pieces a host-memory (DRAM) WRITE is spread over: NIXL's ``num_threads`` x
    ``split_batch_size`` when the backend has both, else 0 (never cut).

    UCX copies a DRAM -> DRAM WRITE between processes on one host inside ``transfer()``, on the
    caller's thread, unless the WRITE has more descriptors than one posting batch, and NIXL merges
    descriptors that follow each other in memory. Measured on the GPU machine with this transport
    (docs/PERF.md, "Host WRITEs spread over the posting threads"), 1 GiB of pinned memory: one
    descriptor, or 64 adjacent pieces, posted for 190-290 ms at 3.7-5.6 GB/s; 64 pieces listed
    as :func:`spread` lists them posted in 0.3-0.6 ms and were DONE at 9.8-15.7 GB/s."""
    try:
        threads, batch = int(params.get("num_threads", 0)), int(params.get("split_batch_size", 0))
    except ValueError:
        return 0  # NIXL itself refuses such params when the agent is made
    return threads * batch if threads > 0 and batch > 0 else 0


def spread(
    src: np.ndarray,
    dst: np.ndarray,
    length: np.ndarray,
    devices: np.ndarray | int,
    pieces: int,
    min_piece: int = HOST_PIECE_MIN,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | int]:
    """The same bytes as about ``pieces`` descriptors of equal size (each at least ``min_piece``,
    the last of each descriptor shorter): every descriptor is cut at multiples of that size, and the
    pieces are listed so that no two neighbours in the list are neighbours in memory. Returns the
    inputs unchanged when nothing needs cutting."""
    total = int(length.sum())
    if pieces <= 1 or total == 0:
        return src, dst, length, devices
    size = np.uint64(max(min_piece, -(-total // pieces)))
    counts = np.maximum((length + size - np.uint64(1)) // size, np.uint64(1)).astype(np.int64)
    if (counts == 1).all():
        return src, dst, length, devices
    which = np.repeat(np.arange(len(length)), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    offset = (np.arange(len(which)) - first).astype(np.uint64) * size
    # The odd pieces, then the even ones: NIXL merges a descriptor that starts where the one before
    # it in the list ends back into one (which one thread copies inside transfer()); here none does.
    order = np.concatenate([np.arange(1, len(which), 2), np.arange(0, len(which), 2)])
    which, offset = which[order], offset[order]
    cut = np.minimum(size, length[which] - offset)
    cut_devices = devices[which] if isinstance(devices, np.ndarray) else devices
    return src[which] + offset, dst[which] + offset, cut, cut_devices


@dataclass
class _SharedLists:
    """Both sides' descriptor lists prepared once for several WRITEs (``NixlTransport.prepare_lists``)."""

    peer: str
    local: Any
    remote: Any
    count: int
    users: int = 0
    """WRITEs made from them and not released."""
    open: bool = True
    """More WRITEs may be made from them (until ``close_lists``)."""


def _descs(addr: np.ndarray, length: np.ndarray, devices: np.ndarray | int) -> np.ndarray:
    out = np.empty((len(addr), 3), dtype=np.uint64)
    out[:, 0] = addr
    out[:, 1] = length
    out[:, 2] = devices
    return out


class NixlTransport:
    """One NIXL agent with the UCX (or another) backend. Its calls are serialized by one lock (the
    module docstring): any thread may call it, one at a time."""

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
        self._lock = threading.RLock()
        """Held by every call that touches the agent or the handle tables (:func:`_serialized`)."""
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
        self._handles: dict[int, tuple[Any, list[Any]]] = {}
        """Each posted or prepared WRITE: its NIXL handle and the two descriptor lists prepared for it
        (none when it was made from shared lists: see ``_made_from``)."""
        self._lists: dict[int, _SharedLists] = {}
        """Descriptor lists prepared once for several WRITEs (:meth:`prepare_lists`)."""
        self._made_from: dict[int, int] = {}
        """WRITE handle -> the id of the shared lists it was made from (:meth:`prepare_indexed`)."""
        self._peer_of: dict[int, tuple[str, int]] = {}
        """Prepared, not started WRITEs: (peer, descriptors), for :meth:`start_write`'s errors."""
        self._ids = itertools.count(1)
        self._host_pieces = host_pieces(params or {})
        """Pieces a DRAM WRITE is spread over for the posting threads (0: none; :func:`host_pieces`)."""
        self._started = threading.local()
        """This thread's latest :meth:`start_write`, for step traces (:attr:`last_start`)."""
        self.post_ns: Counter[str] = Counter()
        """Nanoseconds spent in each step of :meth:`post_write`, summed, and ``writes`` posted."""

    @_serialized
    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    @_serialized
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

    @_serialized
    def deregister(self, reg: int) -> None:
        self._agent.deregister_memory(self._regs.pop(reg))

    @_serialized
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

    @_serialized
    def remove_peer(self, agent_name: str) -> None:
        if self._peers.pop(agent_name, None) is not None:
            try:
                self._agent.remove_remote_agent(agent_name)
            except Exception as exc:
                log.warning("remove_remote_agent(%s) failed: %s", agent_name, exc)

    def has_peer(self, agent_name: str) -> bool:
        return agent_name in self._peers

    @_serialized
    def post_write(self, spec: WriteSpec) -> int:
        """Post one WRITE of ``len(spec.src)`` descriptors with ``spec.notif`` riding on it; returns a handle.

        Raises AddressRangeError (nothing posted) when a destination range is outside the peer's
        registered regions, and TransportError when NIXL refuses the transfer.
        """
        return self.start_write(self.prepare_write(spec))

    @_serialized
    def prepare_write(self, spec: WriteSpec) -> int:
        """Everything of :meth:`post_write` but starting it: the ranges checked, both sides' lists
        prepared and the transfer made. Returns a handle that :meth:`start_write` starts, or
        :meth:`release` drops (no byte moves before the start). Raises as :meth:`post_write`."""
        peer, src, dst, length = spec.peer, spec.src, spec.dst, spec.length
        local_devices, local_mem, notif = spec.local_devices, spec.local_mem, spec.notif
        if local_mem == "DRAM" and self._host_pieces:  # copied by the posting threads, not in transfer()
            src, dst, length, local_devices = spread(src, dst, length, local_devices, self._host_pieces)
        # Both sides' ranges as lists prepared for this one WRITE, then a prepared transfer over all
        # of them: on H200s a one-shot initialize_xfer pays 2-6 us per descriptor inside transfer(),
        # a prepared one about nothing, and preparing two lists costs ~15 us (docs/PERF.md).
        lists = self._prepare_pair(peer, src, dst, length, local_devices, local_mem)
        t0 = time.perf_counter_ns()
        try:
            every = np.arange(len(src))
            handle = self._agent.make_prepped_xfer("WRITE", lists[0], every, lists[1], every, notif)
        except Exception as exc:
            self._release_lists(lists)
            raise TransportError(f"cannot create WRITE to {peer} ({len(src)} descriptors): {exc}") from exc
        hid = next(self._ids)
        self._handles[hid] = (handle, lists)
        self._peer_of[hid] = (peer, len(src))
        self.post_ns["make"] += time.perf_counter_ns() - t0
        return hid

    def _prepare_pair(
        self,
        peer: str,
        src: np.ndarray,
        dst: np.ndarray,
        length: np.ndarray,
        local_devices: np.ndarray | int,
        local_mem: str,
    ) -> list[Any]:
        """Check ``dst`` against ``peer``'s registered ranges and prepare both sides' descriptor lists
        (local, then remote). Raises AddressRangeError / TransportError; nothing is left prepared
        then. Times the steps into ``post_ns`` (``check``, ``prep_local``, ``prep_remote``)."""
        remote = self._peers.get(peer)
        if remote is None:
            raise TransportError(f"no NIXL peer named {peer!r}")
        t0 = time.perf_counter_ns()
        remote_devices, remote_mem = remote.check(dst, length)
        lists: list[Any] = []
        try:
            t1 = time.perf_counter_ns()
            lists.append(self._agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", self._agent.get_xfer_descs(_descs(src, length, local_devices), local_mem)
            ))  # fmt: skip
            t2 = time.perf_counter_ns()
            lists.append(self._agent.prep_xfer_dlist(
                peer, self._agent.get_xfer_descs(_descs(dst, length, remote_devices), remote_mem)
            ))  # fmt: skip
            t3 = time.perf_counter_ns()
        except Exception as exc:
            self._release_lists(lists)
            raise TransportError(f"cannot prepare lists for {peer} ({len(src)} descriptors): {exc}") from exc
        spent = self.post_ns
        spent["check"] += t1 - t0
        spent["prep_local"] += t2 - t1
        spent["prep_remote"] += t3 - t2
        return lists

    @_serialized
    def prepare_lists(self, spec: WriteSpec) -> int:
        """Check ``spec``'s ranges and prepare both sides' descriptor lists once, for several WRITEs
        that each move some of its descriptors (:meth:`prepare_indexed`): a layer-wise chunk's
        groups. ``spec.notif`` is not used. Returns the lists' id; :meth:`close_lists` gives it up,
        and the lists are released once no WRITE made from them is left. Raises as :meth:`post_write`.

        A DRAM WRITE is not spread over the posting threads here (:func:`spread` cuts a WRITE's own
        descriptors; an index into the chunk's list must name the same ones).
        """
        lists = self._prepare_pair(
            spec.peer, spec.src, spec.dst, spec.length, spec.local_devices, spec.local_mem
        )
        lid = next(self._ids)
        self._lists[lid] = _SharedLists(spec.peer, lists[0], lists[1], len(spec.src))
        return lid

    @_serialized
    def prepare_indexed(self, lists: int, index: np.ndarray, spec: WriteSpec) -> int:
        """Make a WRITE of the descriptors ``index`` of the shared ``lists`` (:meth:`prepare_lists`),
        with ``spec.notif``; ``spec`` is the WRITE those descriptors describe (its peer must be the
        lists'). Returns a handle as :meth:`prepare_write` does. TransportError when an index is
        outside the lists or NIXL refuses; nothing is made then."""
        shared = self._lists.get(lists)
        if shared is None or not shared.open:
            raise TransportError(f"no open shared lists {lists} (never prepared, or closed)")
        if shared.peer != spec.peer:
            raise TransportError(f"lists {lists} were prepared for {shared.peer!r}, not {spec.peer!r}")
        if len(index) == 0 or int(index.min()) < 0 or int(index.max()) >= shared.count:
            raise TransportError(
                f"descriptor index [{int(index.min()) if len(index) else '-'}, "
                f"{int(index.max()) if len(index) else '-'}] outside lists {lists} of {shared.count}"
            )
        t0 = time.perf_counter_ns()
        try:
            handle = self._agent.make_prepped_xfer(
                "WRITE", shared.local, index, shared.remote, index, spec.notif
            )
        except Exception as exc:
            raise TransportError(
                f"cannot create WRITE to {spec.peer} ({len(index)} descriptors): {exc}"
            ) from exc
        hid = next(self._ids)
        self._handles[hid] = (handle, [])
        self._peer_of[hid] = (spec.peer, len(index))
        self._made_from[hid] = lists
        shared.users += 1
        self.post_ns["make"] += time.perf_counter_ns() - t0
        return hid

    @_serialized
    def close_lists(self, lists: int) -> None:
        """Make no more WRITEs from ``lists``; they are released with the last WRITE made from them."""
        shared = self._lists[lists]
        shared.open = False
        self._drop_lists(lists, shared)

    def _drop_lists(self, lid: int, shared: _SharedLists) -> None:
        if not shared.open and shared.users == 0:
            del self._lists[lid]
            self._release_lists([shared.local, shared.remote])

    def start_write(self, handle: int) -> int:
        """Start a WRITE made by :meth:`prepare_write`; returns ``handle``. On TransportError the
        handle is released (nothing was posted).

        Serialized as every agent call; ``post_ns["start_wait"]`` sums the time from the call to
        holding the lock (on another thread than the loop's: the wait for the loop's NIXL call and
        for the GIL after it), ``post_ns["transfer"]`` NIXL's ``transfer()``, and
        ``post_ns["transfer_cpu"]`` the CPU time the calling thread spent inside it."""
        entered = time.monotonic_ns()
        with self._lock:
            locked = time.monotonic_ns()
            self.post_ns["start_wait"] += locked - entered
            xfer = self._handles[handle][0]
            peer, count = self._peer_of.pop(handle)
            cpu0 = time.thread_time_ns()
            try:
                state = self._agent.transfer(xfer)
            except Exception as exc:
                self.release(handle)
                raise TransportError(f"WRITE to {peer} failed to start: {exc}") from exc
            cpu = time.thread_time_ns() - cpu0
            returned = time.monotonic_ns()
            self.post_ns["transfer"] += returned - locked
            self.post_ns["transfer_cpu"] += cpu
            self.post_ns["writes"] += 1
            self._started.at = (locked, returned, cpu)
            if state == "ERR":
                self.release(handle)
                raise TransportError(f"WRITE to {peer} failed to start ({count} descriptors)")
            return handle

    @property
    def last_start(self) -> tuple[int, int, int] | None:
        """The calling thread's latest :meth:`start_write`: when it held the lock and when its
        ``transfer()`` had returned (with the GIL back), in monotonic ns, and the CPU time the thread
        spent inside ``transfer()`` (ns; the rest of that call it waited); None before its first."""
        at: tuple[int, int, int] | None = getattr(self._started, "at", None)
        return at

    @_serialized
    def state(self, handle: int) -> XferState:
        try:
            return XferState(self._agent.check_xfer_state(self._handles[handle][0]))
        except Exception as exc:
            log.warning("check_xfer_state failed: %s", exc)
            return XferState.ERR

    @_serialized
    def release(self, handle: int) -> None:
        """Drop a WRITE's handle: one that ended, or one prepared and never started."""
        self._peer_of.pop(handle, None)
        h, lists = self._handles.pop(handle)
        try:
            self._agent.release_xfer_handle(h)
        except Exception as exc:
            log.warning("release_xfer_handle failed: %s", exc)
        self._release_lists(lists)
        lid = self._made_from.pop(handle, None)
        if lid is not None:
            shared = self._lists[lid]
            shared.users -= 1
            self._drop_lists(lid, shared)

    def _release_lists(self, lists: list[Any]) -> None:
        for dlist in lists:
            try:
                self._agent.release_dlist_handle(dlist)
            except Exception as exc:
                log.warning("release_dlist_handle failed: %s", exc)

    @_serialized
    def drain_notifs(self) -> dict[str, list[bytes]]:
        notifs: dict[str, list[bytes]] = self._agent.get_new_notifs()
        return notifs

    @_serialized
    def live_handles(self) -> int:
        """WRITEs made and not released, and shared lists not released (0 when idle: the leak check)."""
        return len(self._handles) + len(self._lists)

    @_serialized
    def close(self) -> None:
        for hid in list(self._handles):
            self.release(hid)
        for lid in list(self._lists):
            self.close_lists(lid)
        for name in list(self._peers):
            self.remove_peer(name)
        for rid in list(self._regs):
            self.deregister(rid)
