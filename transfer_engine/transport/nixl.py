"""The one implementation of the engine's NIXL interface (:mod:`transfer_engine.transport.interface`).

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

Descriptor tables (:meth:`NixlTransport.prepare_table`): both sides' tables of one (peer, key) pair
prepared once, as NIXL's strided rows (:class:`~transfer_engine.transport.interface.TableRows`), and
every WRITE between them made from two index arrays (:meth:`NixlTransport.prepare_from_table`). They
live as long as the peer: :meth:`~NixlTransport.remove_peer` and :meth:`~NixlTransport.close` give
them up, and each is released once the last WRITE made from it is (docs/DECISIONS.md, "Descriptor
tables made once per peer").
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

import numpy as np

from transfer_engine.errors import TransportError
from transfer_engine.protocol.messages import MemRegion
from transfer_engine.transport.binding import bound_params
from transfer_engine.transport.interface import RemotePeer, TableRows, Transport, WriteSpec, XferState
from transfer_engine.transport.posting import default_params, host_pieces, spread

__all__ = ["NixlTransport", "RemotePeer", "Transport", "WriteSpec", "XferState", "default_params"]
"""The interface's names and ``default_params`` are importable from here too, with the transport."""

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
    remote_count: int = -1
    """Descriptors of the remote list when it differs from ``count`` (a table's); -1: ``count``."""
    table: tuple[str, Hashable] | None = None
    """A descriptor table's (peer, key) (:meth:`NixlTransport.prepare_table`); None: a chunk's lists."""

    @property
    def remote_size(self) -> int:
        return self.count if self.remote_count < 0 else self.remote_count


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
        host: str | None = None,
    ) -> None:
        """``host`` is the address the engine's control plane binds to: UCX's network devices are
        matched to it (:mod:`transfer_engine.transport.binding`; loopback by default), unless the
        user chose them. None (what tests' bare transports use) leaves UCX's default: every interface."""
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as exc:  # pragma: no cover - nixl is a hard dependency
            raise TransportError(f"nixl is not importable: {exc}") from exc
        self.name = name
        if host is not None:
            params = bound_params(backend, params or {}, host)
        self.params: dict[str, str] = dict(params or {})
        """The backend parameters the agent was made with (``engine_config`` included)."""
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
        self._tables: dict[tuple[str, Hashable], int] = {}
        """(peer, key) -> the id in ``_lists`` of that pair's open descriptor tables (:meth:`prepare_table`)."""
        self._strided_tables = True
        """NIXL takes a table's rows as strided descriptors (Nx5); False once it refused them: listed flat."""
        self.table_stats: Counter[str] = Counter()
        """Descriptor tables ``prepared`` (pairs, each both sides), ``released``, ``refused``, and the
        descriptors NIXL was given for them (``descriptors``: rows when strided, entries when flat)."""
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
        """Forget ``agent_name``: its descriptor tables are given up (each released once no WRITE made
        from it is left), then its agent is removed."""
        for key in [k for k in self._tables if k[0] == agent_name]:
            self.close_lists(self._tables.pop(key))
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
    def table(self, peer: str, key: Hashable) -> int | None:
        """See :meth:`Transport.table <transfer_engine.transport.interface.Transport.table>`."""
        return self._tables.get((peer, key))

    @_serialized
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
        """See :meth:`Transport.prepare_table <transfer_engine.transport.interface.Transport.prepare_table>`
        for the contract. Here: each row is one strided NIXL descriptor; a NIXL that refuses strided
        lists gets every entry listed (once, for every table after). The remote rows are checked here,
        the local ones by NIXL as it prepares them. Also refused (TransportError): DRAM memory that
        this agent spreads over its posting threads (:func:`~transfer_engine.transport.posting.spread`
        cuts each WRITE's own descriptors; an index names a table's)."""
        if (peer, key) in self._tables:
            raise TransportError(f"tables {key!r} for {peer} are prepared already")
        remote_peer = self._peers.get(peer)
        if remote_peer is None:
            raise TransportError(f"no NIXL peer named {peer!r}")
        if local_mem == "DRAM" and self._host_pieces:
            raise TransportError(
                f"DRAM WRITEs are spread over NIXL's {self._host_pieces} posting pieces: made per WRITE"
            )
        if local.length != remote.length:
            raise TransportError(f"table entries of {local.length} and {remote.length} bytes differ")
        for name, rows in (("local", local), ("remote", remote)):
            if rows.entries >= 2**31:
                raise TransportError(f"{name} table of {rows.entries} entries exceeds NIXL's int32 indices")
            given = rows.rows if self._strided_tables else rows.entries
            if given > max_descriptors:
                raise TransportError(
                    f"{name} table of {given} descriptors ({rows.entries} entries) is over the cap of "
                    f"{max_descriptors} (EngineConfig.table_max_descriptors)"
                )
        remote_devices, remote_mem = remote_peer.check(remote.addr, remote.spans())
        lists: list[Any] = []
        try:
            for target, rows, devices, mem in (
                ("NIXL_INIT_AGENT", local, local_device, local_mem),
                (peer, remote, remote_devices, remote_mem),
            ):
                lists.append(self._prep_rows(target, rows, devices, mem))
        except TransportError:
            self._release_lists(lists)
            self.table_stats["refused"] += 1
            raise
        lid = next(self._ids)
        self._lists[lid] = _SharedLists(
            peer, lists[0], lists[1], local.entries, remote_count=remote.entries, table=(peer, key)
        )
        self._tables[(peer, key)] = lid
        self.table_stats["prepared"] += 1
        self.table_stats["descriptors"] += (
            local.rows + remote.rows if self._strided_tables else local.entries + remote.entries
        )
        return lid

    def _prep_rows(self, target: str, rows: TableRows, devices: np.ndarray | int, mem: str) -> Any:
        """One side's table as a prepared NIXL list: strided rows, or every entry where NIXL refuses those."""
        if self._strided_tables:
            try:
                return self._agent.prep_xfer_dlist(target, rows.strided(devices), mem)
            except (TypeError, ValueError) as exc:  # a NIXL without strided lists: it cannot parse them
                log.warning(
                    "NIXL refused strided descriptor lists (%s); tables are listed entry by entry", exc
                )
                self._strided_tables = False
            except Exception as exc:
                raise TransportError(
                    f"cannot prepare a table of {rows.rows} rows for {target}: {exc}"
                ) from exc
        per_entry = np.repeat(devices, rows.count) if isinstance(devices, np.ndarray) else devices
        try:
            return self._agent.prep_xfer_dlist(
                target,
                self._agent.get_xfer_descs(
                    _descs(rows.flat(), np.full(rows.entries, rows.length, dtype=np.uint64), per_entry), mem
                ),
            )
        except Exception as exc:
            raise TransportError(
                f"cannot prepare a table of {rows.entries} entries for {target}: {exc}"
            ) from exc

    @_serialized
    def prepare_from_table(
        self, table: int, src_index: np.ndarray, dst_index: np.ndarray, spec: WriteSpec
    ) -> int:
        """See :meth:`Transport.prepare_from_table
        <transfer_engine.transport.interface.Transport.prepare_from_table>`; the indices are int32 or
        int64 and the WRITE carries ``spec.notif``."""
        shared = self._lists.get(table)
        if shared is None or shared.table is None or not shared.open:
            raise TransportError(f"no open descriptor tables {table} (never prepared, or their peer is gone)")
        if shared.peer != spec.peer:
            raise TransportError(f"tables {table} were prepared for {shared.peer!r}, not {spec.peer!r}")
        if len(src_index) != len(dst_index) or len(src_index) == 0:
            raise TransportError(f"index arrays of {len(src_index)} and {len(dst_index)} entries")
        for name, index, size in (("src", src_index, shared.count), ("dst", dst_index, shared.remote_size)):
            low, high = int(index.min()), int(index.max())
            if low < 0 or high >= size:
                raise TransportError(f"{name} index [{low}, {high}] outside tables {table} of {size} entries")
        t0 = time.perf_counter_ns()
        try:
            handle = self._agent.make_prepped_xfer(
                "WRITE", shared.local, src_index, shared.remote, dst_index, spec.notif
            )
        except Exception as exc:
            raise TransportError(
                f"cannot create WRITE to {spec.peer} ({len(src_index)} table entries): {exc}"
            ) from exc
        hid = next(self._ids)
        self._handles[hid] = (handle, [])
        self._peer_of[hid] = (spec.peer, len(src_index))
        self._made_from[hid] = table
        shared.users += 1
        self.post_ns["make"] += time.perf_counter_ns() - t0
        return hid

    @_serialized
    def live_tables(self) -> int:
        """Descriptor tables not released: open ones (one per peer and key) and those given up whose
        WRITEs have not all been released (0 after the transport closed: the leak check)."""
        return sum(1 for shared in self._lists.values() if shared.table is not None)

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
            if shared.table is not None:
                self.table_stats["released"] += 1

    def start_write(self, handle: int, notif: bytes = b"") -> int:
        """Start a WRITE made by :meth:`prepare_write`; returns ``handle``. On TransportError the
        handle is released (nothing was posted). A non-empty ``notif`` replaces the notification it
        was made with (NIXL takes one per ``transfer()``).

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
                state = self._agent.transfer(xfer, notif)
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
        """WRITEs made and not released, and a chunk's shared lists not released (0 when idle: the leak
        check). Descriptor tables live as long as their peer: :meth:`live_tables`."""
        return len(self._handles) + sum(1 for shared in self._lists.values() if shared.table is None)

    @_serialized
    def close(self) -> None:
        for hid in list(self._handles):
            self.release(hid)
        self._tables.clear()
        for lid in list(self._lists):
            self.close_lists(lid)
        for name in list(self._peers):
            self.remove_peer(name)
        for rid in list(self._regs):
            self.deregister(rid)
