"""The link probe: one timed WRITE to a peer, what carried it, and a floor it must clear.

NIXL's UCX backend picks a transport per peer pair (``cuda_ipc`` over NVLink, ``rc``/``dc`` over an
RDMA NIC, shared memory or ``cma`` between processes of one host, TCP as the last resort) and says
nothing about it: a pair that fell back to TCP, or to a wrong NIC, just moves KV slowly.
:func:`probe_link` posts one WRITE of a small registered buffer (a few MiB: large enough for a
rate, small enough to take milliseconds) through the engine's own transport, times it from the
post to DONE, and reads what carried it from this process's TCP sockets: each socket's
``bytes_acked``/``bytes_received`` (the kernel's ``TCP_INFO``) summed before and after. UCX's TCP
transport moves a WRITE's bytes through sockets; shared memory, ``cma``, ``cuda_ipc`` and RDMA do
not. So ``tcp`` is observed; otherwise the transport is named from where the peer is and the
memory: ``cuda_ipc`` (same host, GPU memory), ``shm`` (same host, host memory: UCX's ``cma``,
``posix`` or ``sysv``), ``rdma`` (another host). :func:`check_floor` raises
:class:`~transfer_engine.errors.SlowLinkError` below ``min_link_gbps`` or for TCP where it is not
accepted, naming the transport, the devices UCX was given and the fix.

The probe runs where the engine has the peer's registered regions (after the handshake); it must
not write where a room's KV lives: the caller hands it a scratch range of its own on both sides.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from transfer_engine.errors import SlowLinkError, TransportError
from transfer_engine.transport.interface import Transport, WriteSpec, XferState

__all__ = [
    "PROBE_BYTES",
    "LinkProbe",
    "check_floor",
    "classify",
    "configured_devices",
    "probe_link",
    "tcp_socket_bytes",
]

PROBE_BYTES = 4 << 20
"""What the probe writes: 4 MiB, about 2 ms at 2 GB/s, 0.1 ms on NVLink."""
TCP_SHARE = 0.5
"""A WRITE whose bytes went at least this share through TCP sockets went over TCP."""
_TCP_INFO_BYTES = 136
_BYTES_ACKED = 120
"""Offsets in Linux's ``struct tcp_info``: ``tcpi_bytes_acked`` then ``tcpi_bytes_received`` (u64)."""


@dataclass(frozen=True)
class LinkProbe:
    """One probe of a peer pair (:func:`probe_link`)."""

    peer: str
    nbytes: int
    seconds: float
    """From posting the WRITE to its DONE."""
    transport: str
    """``tcp`` (observed), else ``cuda_ipc``, ``shm`` or ``rdma`` (:func:`classify`)."""
    devices: str
    """The network devices UCX was given (``NET_DEVICES``), or ``all``."""
    tcp_bytes: int
    """Bytes this process's TCP sockets sent and received while the WRITE was out."""

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def tcp_socket_bytes(pid: int | str = "self") -> int:
    """Bytes sent (acked) plus received by every TCP socket of process ``pid``, from ``TCP_INFO``."""
    total = 0
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return 0
    for name in fds:
        try:
            if not os.readlink(f"{fd_dir}/{name}").startswith("socket:"):
                continue
            dup = os.dup(int(name))
        except (OSError, ValueError):
            continue
        try:
            with socket.socket(fileno=dup) as sock:
                if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                    continue
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
        except OSError:
            continue
        if len(info) >= _BYTES_ACKED + 16:
            acked, received = struct.unpack_from("=QQ", info, _BYTES_ACKED)
            total += acked + received
    return total


def classify(nbytes: int, tcp_bytes: int, *, mem_type: str, same_host: bool) -> str:
    """The transport that carried a WRITE of ``nbytes`` while ``tcp_bytes`` crossed TCP sockets."""
    if nbytes > 0 and tcp_bytes >= TCP_SHARE * nbytes:
        return "tcp"
    if same_host:
        return "cuda_ipc" if mem_type == "VRAM" else "shm"
    return "rdma"


def configured_devices(params: Mapping[str, str], environ: Mapping[str, str] | None = None) -> str:
    """The network devices UCX was given: ``UCX_NET_DEVICES``, else ``NET_DEVICES`` in NIXL's
    ``engine_config`` or its ``ucx_devices``/``device_list``, else ``all``."""
    env = os.environ if environ is None else environ
    if env.get("UCX_NET_DEVICES"):
        return env["UCX_NET_DEVICES"]
    for entry in params.get("engine_config", "").split(","):
        key, _, value = entry.partition("=")
        if key.strip().upper() in ("NET_DEVICES", "UCX_NET_DEVICES") and value.strip():
            return value.strip()
    for key in ("ucx_devices", "device_list"):
        if params.get(key, "").strip():
            return params[key].strip()
    return "all"


def probe_link(
    transport: Transport,
    peer: str,
    src: int,
    dst: int,
    nbytes: int = PROBE_BYTES,
    *,
    mem_type: str = "DRAM",
    device: int = 0,
    same_host: bool,
    devices: str = "all",
    notif: bytes = b"",
    timeout: float = 10.0,
    clock: Callable[[], float] = time.perf_counter,
    between_polls: Callable[[], object] | None = None,
) -> LinkProbe:
    """WRITE ``nbytes`` from this side's ``src`` to ``peer``'s ``dst`` (both registered scratch, of
    ``mem_type`` on ``device``), wait for DONE, and report it. Blocking: it polls the transport,
    so call it off the event loop or where a few milliseconds do not matter (once per peer pair).

    ``between_polls`` runs between two polls of the WRITE's state: a peer in this same process
    (tests) needs its own agent progressed there (its ``drain_notifs``); a peer in another process
    progresses itself.

    Raises TransportError when the WRITE fails or is not DONE within ``timeout`` seconds (it is
    released either way).
    """
    spec = WriteSpec(
        peer=peer,
        local_mem=mem_type,
        src=np.array([src], dtype=np.uint64),
        dst=np.array([dst], dtype=np.uint64),
        length=np.array([nbytes], dtype=np.uint64),
        local_devices=device,
        notif=notif,
    )
    before = tcp_socket_bytes()
    started = clock()
    handle = transport.post_write(spec)
    try:
        deadline = started + timeout
        while True:
            state = transport.state(handle)
            if state is XferState.DONE:
                break
            if state is XferState.ERR:
                raise TransportError(f"link probe to {peer}: the WRITE of {nbytes} bytes failed")
            if between_polls is not None:
                between_polls()
            if clock() > deadline:
                raise TransportError(
                    f"link probe to {peer}: the WRITE of {nbytes} bytes not done in {timeout:g} s"
                )
        seconds = clock() - started
    finally:
        transport.release(handle)
    moved = max(0, tcp_socket_bytes() - before)
    kind = classify(nbytes, moved, mem_type=mem_type, same_host=same_host)
    return LinkProbe(peer, nbytes, seconds, kind, devices, moved)


def check_floor(probe: LinkProbe, min_gbps: float, *, refuse_tcp: bool = False) -> None:
    """Raise SlowLinkError when ``probe`` is below ``min_gbps`` (0: no floor), or went over TCP
    with ``refuse_tcp`` (where RDMA or NVLink was expected)."""
    slow = min_gbps > 0 and probe.gbps < min_gbps
    if not slow and not (refuse_tcp and probe.transport == "tcp"):
        return
    why = f"below min_link_gbps={min_gbps:g}" if slow else "TCP where RDMA or NVLink was expected"
    if probe.transport == "tcp":
        fix = (
            "UCX fell back to TCP: set UCX_NET_DEVICES to the RDMA NIC ports (e.g. mlx5_0:1, see "
            "ibv_devinfo) or check that the NIC is up and GPUDirect RDMA is on"
        )
    elif probe.transport == "cuda_ipc":
        fix = "check NVLink (nvidia-smi topo -m) and that the KV is not in expandable segments"
    elif probe.transport == "rdma":
        fix = "check UCX_NET_DEVICES names the NIC nearest each GPU, and the NIC's link speed"
    else:
        fix = "check the host's load and UCX_TLS"
    raise SlowLinkError(probe.peer, probe.transport, probe.gbps, f"{why} ({probe.devices}); {fix}")
