"""A decode rank's pool shared with a prefill rank of the same host: exported once, mapped once.

The kernel path (docs/DECISIONS.md, "One kernel between the GPUs of a host") copies a chunk straight
from the prefill's pages into the decode's, inside the prefill's process. For that the decode
exports its pool's memory once, in its ``PeerHello`` (:func:`export_pool`, a
:class:`~transfer_engine.protocol.messages.PoolShare`: plain bytes and strings, no pickle), and each
prefill rank of the same host maps it once (:func:`map_pool`, a :class:`MappedPool`: the local
address of every region). Three kinds, one interface:

- ``cuda_ipc``: device memory. Each region's allocation (``cuMemGetAddressRange``: a region may sit
  inside a larger caching-allocator segment; raw pointers, as SGLang's pools are, work the same) is
  exported as its 64-byte ``CUipcMemHandle`` (``cuIpcGetMemHandle``) with the region's offset in it;
  the prefill opens it with ``cuIpcOpenMemHandle(CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)`` on its own
  GPU, which must be the decode's (found by UUID) or have peer access to it, and closes it with
  ``cuIpcCloseMemHandle``. Through the CUDA driver API (ctypes), so no tensor is needed.
- ``shm``: host memory that lives in a shared file (tensors moved to shared memory with torch's
  ``share_memory_()``, a memfd, a file in ``/dev/shm`` the pool was built on). Found in
  ``/proc/self/maps`` (a shared mapping of a file), exported as a path the peer can open (the file
  itself, or ``/proc/<pid>/fd/<n>`` for an unlinked one) with the file's ``(st_dev, st_ino)``, which
  the peer checks after opening it, and the region's offset in the file; the prefill maps the file
  with ``mmap``. Host memory of a private mapping (an ordinary ``torch.zeros``) is not exported: the
  kernel path falls back, with the reason.
- ``process``: both engines in one process (tests, one-process deployments): the addresses are
  used as they are, nothing is mapped.

Lifetime (docs/DECISIONS.md says why no copy writes into freed memory): a :class:`MappedPool` counts
the copies in flight into it (:meth:`MappedPool.acquire` / :meth:`MappedPool.release`) and closes
only once none is (:meth:`MappedPool.close_when_idle`, at the peer's death or the worker's end), or
when it is garbage collected. :func:`open_mappings` counts the mappings not closed (the leak check).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import socket
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from transfer_engine.errors import TransferError
from transfer_engine.protocol.messages import MemRegion, PoolShare, SharedMemory, SharedRegion

__all__ = ["MappedPool", "ShareError", "export_pool", "host_id", "map_pool", "open_mappings"]

CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
_OPEN = [0]
_OPEN_LOCK = threading.Lock()


class ShareError(TransferError):
    """A pool cannot be exported or mapped for the kernel path (the message says why); the path
    falls back to NIXL."""


def open_mappings() -> int:
    """Mappings of peers' pools made in this process and not closed yet (0 when idle)."""
    with _OPEN_LOCK:
        return _OPEN[0]


def _count(delta: int) -> None:
    with _OPEN_LOCK:
        _OPEN[0] += delta


def host_id() -> str:
    """This host: its name and its boot id (two containers of one machine share the boot id)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


# --- the CUDA driver, through ctypes ------------------------------------------------------------------


class _IpcHandle(ctypes.Structure):
    """``CUipcMemHandle``: 64 opaque bytes. Read and written as a whole (``bytes(handle)``,
    :meth:`from_buffer_copy`), never through the field: ctypes reads a ``c_char`` array field as a
    NUL-terminated string, so a handle with a zero byte would come out short (empty when it starts
    with one)."""

    _fields_ = [("reserved", ctypes.c_char * 64)]


class _Driver:
    """The few CUDA driver calls the kernel path needs; every failure a :class:`ShareError`."""

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise ShareError(f"the CUDA driver library cannot be loaded: {exc}") from None
        self.call("cuInit", ctypes.c_uint(0))

    def fn(self, name: str) -> Any:
        """The driver's entry point ``name`` (its ``_v2`` where the driver has one)."""
        for symbol in (f"{name}_v2", name):
            found = getattr(self.lib, symbol, None)
            if found is not None:
                return found
        raise ShareError(f"the CUDA driver has no {name}")

    def call(self, name: str, *args: object) -> None:
        self.check(name, self.fn(name)(*args))

    def check(self, name: str, rc: int) -> None:
        """A :class:`ShareError` naming the call, the error's name, its text and its code unless
        ``rc`` is ``CUDA_SUCCESS``."""
        if rc == 0:
            return
        what, text = ctypes.c_char_p(), ctypes.c_char_p()
        self.lib.cuGetErrorName(rc, ctypes.byref(what))
        self.lib.cuGetErrorString(rc, ctypes.byref(text))
        raise ShareError(
            f"{name} failed: {(what.value or b'?').decode()}, {(text.value or b'?').decode()} (CUresult {rc})"
        )

    @contextlib.contextmanager
    def context(self, ordinal: int) -> Iterator[None]:
        """Device ``ordinal``'s primary context current on this thread for the calls inside."""
        ctx = self.retain(ordinal)
        try:
            self.call("cuCtxPushCurrent", ctx)
            try:
                yield
            finally:
                self.call("cuCtxPopCurrent", ctypes.byref(ctypes.c_void_p()))
        finally:
            self.release(ordinal)

    def retain(self, ordinal: int) -> ctypes.c_void_p:
        """Hold a reference on device ``ordinal``'s primary context (until :meth:`release`); the context."""
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        self.call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(ordinal))
        self.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        return ctx

    def release(self, ordinal: int) -> None:
        dev = ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(ordinal))
        self.call("cuDevicePrimaryCtxRelease", dev)

    def uuid(self, ordinal: int) -> bytes:
        dev = ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(ordinal))
        raw = (ctypes.c_char * 16)()
        self.call("cuDeviceGetUuid", raw, dev)
        return bytes(raw)

    def ordinal_of(self, uuid: bytes) -> int | None:
        count = ctypes.c_int()
        self.call("cuDeviceGetCount", ctypes.byref(count))
        return next((i for i in range(count.value) if self.uuid(i) == uuid), None)

    def can_access_peer(self, ordinal: int, peer: int) -> bool:
        dev, other, ok = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(ordinal))
        self.call("cuDeviceGet", ctypes.byref(other), ctypes.c_int(peer))
        self.call("cuDeviceCanAccessPeer", ctypes.byref(ok), dev, other)
        return bool(ok.value)

    def address_range(self, addr: int) -> tuple[int, int]:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self.call("cuMemGetAddressRange", ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(addr))
        return base.value, size.value

    def export(self, base: int) -> bytes:
        handle = _IpcHandle()
        self.call("cuIpcGetMemHandle", ctypes.byref(handle), ctypes.c_uint64(base))
        return bytes(handle)  # all 64 bytes (see _IpcHandle)

    def open(self, handle: bytes) -> int:
        raw = _IpcHandle.from_buffer_copy(handle)
        ptr = ctypes.c_uint64()
        opener = self.fn("cuIpcOpenMemHandle")
        opener.argtypes = [ctypes.POINTER(ctypes.c_uint64), _IpcHandle, ctypes.c_uint]
        opener.restype = ctypes.c_int
        self.check("cuIpcOpenMemHandle", opener(ctypes.byref(ptr), raw, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS))
        return ptr.value

    def close(self, ptr: int) -> None:
        self.call("cuIpcCloseMemHandle", ctypes.c_uint64(ptr))


_DRIVER: _Driver | None = None


def _driver() -> _Driver:
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = _Driver()
    return _DRIVER


def _ordinal(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


# --- export (decode) ----------------------------------------------------------------------------------


def export_pool(regions: Sequence[MemRegion], device: torch.device) -> PoolShare:
    """The pool whose registered ``regions`` live on ``device``, exported for a peer of this host (see
    the module docstring). Called once per engine, at its first handshake. Raises
    :class:`ShareError` naming why it cannot be (host memory not in a shared file, an allocation CUDA
    IPC cannot export...)."""
    if not regions:
        raise ShareError("the pool has no regions")
    if device.type == "cuda":
        memories, placed, uuid = _export_cuda(regions, _ordinal(device))
        kind = "cuda_ipc"
    else:
        memories, placed = _export_shm(regions)
        kind, uuid = "shm", b""
    return PoolShare(
        kind=kind, host=host_id(), pid=os.getpid(), device=uuid, memories=memories, regions=placed
    )


def _export_cuda(
    regions: Sequence[MemRegion], ordinal: int
) -> tuple[list[SharedMemory], list[SharedRegion], bytes]:
    driver = _driver()
    memories: list[SharedMemory] = []
    placed: list[SharedRegion] = []
    index: dict[int, int] = {}
    with driver.context(ordinal):
        for i, region in enumerate(regions):
            base, size = driver.address_range(region.addr)
            if region.addr + region.length > base + size:
                raise ShareError(f"region {i} spans more than one CUDA allocation")
            if base not in index:
                index[base] = len(memories)
                memories.append(SharedMemory(handle=driver.export(base), path="", size=size))
            placed.append(SharedRegion(memory=index[base], offset=region.addr - base))
        uuid = driver.uuid(ordinal)
    return memories, placed, uuid


@dataclass(frozen=True)
class _Mapping:
    start: int
    end: int
    shared: bool
    offset: int
    dev: tuple[int, int]
    inode: int
    path: str


def _maps() -> list[_Mapping]:
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 5:
                continue
            start, end = (int(x, 16) for x in parts[0].split("-"))
            major, minor = (int(x, 16) for x in parts[3].split(":"))
            path = parts[5].rstrip("\n") if len(parts) > 5 else ""
            out.append(
                _Mapping(
                    start, end, parts[1][3] == "s", int(parts[2], 16), (major, minor), int(parts[4]), path
                )
            )
    return out


def _openable(found: _Mapping) -> tuple[str, os.stat_result]:
    """A path another process of this host opens to reach ``found``'s file, and the file's stat."""
    path = found.path.removesuffix(" (deleted)")
    candidates = [path] if path.startswith("/") and not found.path.endswith(" (deleted)") else []
    fd_dir = "/proc/self/fd"
    with contextlib.suppress(OSError):
        candidates += [f"{fd_dir}/{fd}" for fd in sorted(os.listdir(fd_dir), key=int)]
    for candidate in candidates:
        try:
            st = os.stat(candidate)
        except OSError:
            continue
        if st.st_ino == found.inode and (os.major(st.st_dev), os.minor(st.st_dev)) == found.dev:
            if candidate.startswith(fd_dir):
                candidate = f"/proc/{os.getpid()}/fd/{candidate.rsplit('/', 1)[1]}"
            return candidate, st
    raise ShareError(f"the file behind {found.path or 'an anonymous mapping'} cannot be reached by path")


def _export_shm(regions: Sequence[MemRegion]) -> tuple[list[SharedMemory], list[SharedRegion]]:
    maps = _maps()
    memories: list[SharedMemory] = []
    placed: list[SharedRegion] = []
    index: dict[tuple[int, int], int] = {}
    for i, region in enumerate(regions):
        found = next((mp for mp in maps if mp.start <= region.addr < mp.end), None)
        if found is None or region.addr + region.length > found.end:
            raise ShareError(f"region {i} is not inside one mapping of this process")
        if not found.shared or found.inode == 0:
            raise ShareError(
                f"region {i} is private host memory, not a shared file (share_memory_() or a memfd shares it)"
            )
        path, st = _openable(found)
        key = (st.st_dev, st.st_ino)
        if key not in index:
            index[key] = len(memories)
            memories.append(SharedMemory(handle=b"", path=path, size=st.st_size, file_id=key))
        placed.append(SharedRegion(memory=index[key], offset=found.offset + region.addr - found.start))
    return memories, placed


# --- map (prefill) ------------------------------------------------------------------------------------


class MappedPool:
    """A peer's pool as this process reaches it: the local address of each of its regions.

    ``how``: ``cuda_ipc``, ``shm`` or ``process``. Counts the copies in flight into it: a copy
    :meth:`acquire`\\ s it before it starts and :meth:`release`\\ s it once it completed;
    :meth:`close_when_idle` closes it (unmaps) once none is in flight, and refuses new ones from then
    on. Thread-safe."""

    def __init__(
        self, how: str, bases: np.ndarray, lengths: np.ndarray, closer: Callable[[], None] | None
    ) -> None:
        self.how = how
        self.bases = bases
        """uint64: the local address of each region, in the peer's ``PeerHello.regions`` order."""
        self.lengths = lengths
        """uint64: the bytes of each region."""
        self._lock = threading.Lock()
        self._in_flight = 0
        self._closing = False
        _count(1)
        self._finalizer = weakref.finalize(self, _close_quietly, closer)

    @property
    def usable(self) -> bool:
        """Whether new copies may start (not closing)."""
        return not self._closing

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def acquire(self) -> bool:
        """Count one more copy in flight; False (nothing counted) once closing."""
        with self._lock:
            if self._closing:
                return False
            self._in_flight += 1
            return True

    def release(self) -> None:
        """A copy :meth:`acquire` counted completed; the last one closes a closing mapping."""
        with self._lock:
            self._in_flight -= 1
            last = self._closing and self._in_flight == 0
        if last:
            self._finalizer()

    def close_when_idle(self) -> None:
        """No new copies; unmap now if none is in flight, else when the last one completes."""
        with self._lock:
            self._closing = True
            idle = self._in_flight == 0
        if idle:
            self._finalizer()


def _close_quietly(closer: Callable[[], None] | None) -> None:
    _count(-1)
    if closer is not None:
        with contextlib.suppress(Exception):  # at interpreter exit the driver may be gone already
            closer()


def map_pool(share: PoolShare, regions: Sequence[MemRegion], device: torch.device) -> MappedPool:
    """Map the peer's pool ``share`` (its ``regions``, from the same ``PeerHello``) into this process,
    for copies run on ``device`` (this rank's pool's). Raises :class:`ShareError` naming why it
    cannot be: another host, another kind of memory, a GPU this one cannot reach, a handle or file
    that does not open, regions that do not fit what was exported."""
    if share.host != host_id():
        raise ShareError(f"the decode runs on another host ({share.host})")
    if len(share.regions) != len(regions):
        raise ShareError(f"the share places {len(share.regions)} regions, the hello has {len(regions)}")
    kind = "cuda_ipc" if device.type == "cuda" else "shm"
    if share.kind != kind:
        raise ShareError(f"the decode's pool is {share.kind}, this pool's copies need {kind}")
    for i, (placed, region) in enumerate(zip(share.regions, regions, strict=True)):
        if placed.memory >= len(share.memories):
            raise ShareError(f"region {i} names memory {placed.memory} of {len(share.memories)}")
        if placed.offset + region.length > share.memories[placed.memory].size:
            raise ShareError(f"region {i} ends past its exported memory")
    lengths = np.array([r.length for r in regions], dtype=np.uint64)
    if share.pid == os.getpid():
        if kind == "cuda_ipc" and _driver().uuid(_ordinal(device)) != share.device:
            raise ShareError("the decode's pool is on another GPU of this process")
        return MappedPool("process", np.array([r.addr for r in regions], dtype=np.uint64), lengths, None)
    if kind == "cuda_ipc":
        ptrs, closer = _map_cuda(share, _ordinal(device))
    else:
        ptrs, closer = _map_shm(share)
    bases = np.array([ptrs[p.memory] + p.offset for p in share.regions], dtype=np.uint64)
    return MappedPool(kind, bases, lengths, closer)


def _map_cuda(share: PoolShare, ordinal: int) -> tuple[list[int], Callable[[], None]]:
    driver = _driver()
    peer = driver.ordinal_of(share.device)
    if peer is None:
        raise ShareError("the decode's GPU is not visible to this process")
    if peer != ordinal and not driver.can_access_peer(ordinal, peer):
        raise ShareError(f"GPU {ordinal} has no peer access to the decode's GPU {peer}")
    opened: list[int] = []
    # The handles are opened in the primary context, and a release that drops its last reference
    # resets it, unmapping them: in a process whose torch had not touched the GPU yet, the context
    # the handles were opened in was gone before the first copy, and a later context could give their
    # addresses to other memory (a copy through the mapping then wrote there, without a fault). The
    # mapping holds a reference from the first open to its close.
    driver.retain(ordinal)

    def close() -> None:
        try:
            with driver.context(ordinal):
                for ptr in opened:
                    driver.close(ptr)
        finally:
            driver.release(ordinal)

    try:
        with driver.context(ordinal):
            for memory in share.memories:
                if len(memory.handle) != 64:
                    raise ShareError(f"a CUDA IPC handle has {len(memory.handle)} bytes, not 64")
                opened.append(driver.open(memory.handle))
    except ShareError:
        close()
        raise
    return opened, close


def _map_shm(share: PoolShare) -> tuple[list[int], Callable[[], None]]:
    maps: list[tuple[mmap.mmap, ctypes.Array[ctypes.c_char]]] = []

    def close() -> None:
        pairs = maps[:]
        maps.clear()
        while pairs:
            mm, view = pairs.pop()
            del view  # the last reference to the buffer's export: the map may close now
            mm.close()

    try:
        for memory in share.memories:
            try:
                fd = os.open(memory.path, os.O_RDWR)
            except OSError as exc:
                raise ShareError(f"{memory.path} does not open: {exc.strerror}") from None
            try:
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) != tuple(memory.file_id):
                    raise ShareError(f"{memory.path} is not the file the decode exported")
                if st.st_size < memory.size:
                    raise ShareError(f"{memory.path} holds {st.st_size} bytes, {memory.size} exported")
                mm = mmap.mmap(fd, memory.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            maps.append((mm, (ctypes.c_char * memory.size).from_buffer(mm)))
    except ShareError:
        close()
        raise
    return [ctypes.addressof(view) for _, view in maps], close
