"""Where the data plane listens: UCX's network devices chosen from the control plane's ``host``.

UCX's TCP transport opens one listening socket per network interface it may use, and by default
it may use every interface: an engine whose control plane is bound to 127.0.0.1 would still
accept TCP on the machine's external addresses. The engine therefore hands UCX (through NIXL's
``engine_config`` backend parameter, which NIXL turns into ``ucp_config_modify`` calls) the
devices that match ``host``:

- ``host`` a loopback address (the default): ``NET_DEVICES=lo``. Every peer is on this machine,
  and UCX's transports between processes of one machine (shared memory, ``cuda_ipc``) are not
  network devices, so they stay; what goes is TCP on the external interfaces and RDMA loopback
  through a NIC (the link probe, :mod:`transfer_engine.transport.probe`, says which transport a
  peer pair got).
- ``host`` a specific address: the interface holding it when the machine has no RDMA device
  (UCX names RDMA ports ``mlx5_0:1``, and a list of several cannot be passed through
  ``engine_config``, whose values cannot hold a comma). With RDMA devices present, ``^OTHER`` when
  exactly one other interface exists; otherwise UCX's default, which ``UCX_NET_DEVICES`` narrows.
- ``host`` a wildcard (``0.0.0.0``, ``::``, ``*``): UCX's default (every device).

A choice of the user's always wins: ``UCX_NET_DEVICES`` in the environment (NIXL never overrides
an environment variable), or ``NET_DEVICES`` in ``engine_config``, ``ucx_devices`` or
``device_list`` among the backend parameters. :func:`net_devices` is the decision, pure;
:func:`local_interfaces` reads the machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field

IFF_LOOPBACK = 0x8
SIOCGIFADDR = 0x8915
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "*", ""})
USER_KEYS = ("ucx_devices", "device_list")
"""Backend parameters through which a user already chose NIXL's UCX devices."""


@dataclass(frozen=True)
class Interfaces:
    """The machine's network interfaces, as far as the choice needs them."""

    names: tuple[str, ...]
    loopback: frozenset[str]
    addresses: Mapping[str, str] = field(default_factory=dict)
    """IPv4 address -> the interface holding it."""
    rdma: bool = False
    """Whether the machine has RDMA devices (``/sys/class/infiniband``)."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def net_devices(host: str, interfaces: Interfaces) -> str | None:
    """The ``NET_DEVICES`` value that keeps UCX's listeners where ``host`` is, or None to leave UCX's
    default (the module docstring says when)."""
    if host in WILDCARD_HOSTS:
        return None
    if is_loopback(host):
        loopback = sorted(interfaces.loopback)
        return loopback[0] if loopback else None
    try:
        address = str(ipaddress.ip_address(host))
    except ValueError:
        try:
            address = socket.gethostbyname(host)
        except OSError:
            return None
        if is_loopback(address):
            return net_devices(address, interfaces)
    own = interfaces.addresses.get(address)
    if own is None:
        return None
    others = [name for name in interfaces.names if name != own and name not in interfaces.loopback]
    if not interfaces.rdma:
        return own
    if len(others) == 1:
        return f"^{others[0]}"
    return None


def user_chose_devices(params: Mapping[str, str], environ: Mapping[str, str]) -> bool:
    """Whether the user already chose UCX's network devices (environment or backend parameters)."""
    if environ.get("UCX_NET_DEVICES"):
        return True
    if any(params.get(key, "").strip() for key in USER_KEYS):
        return True
    entries = params.get("engine_config", "").split(",")
    return any(
        entry.split("=", 1)[0].strip().upper() in ("NET_DEVICES", "UCX_NET_DEVICES") for entry in entries
    )


def with_net_devices(params: Mapping[str, str], devices: str | None) -> dict[str, str]:
    """``params`` with ``NET_DEVICES=devices`` added to NIXL's ``engine_config`` (kept as given when
    ``devices`` is None)."""
    out = dict(params)
    if devices is None:
        return out
    entry = f"NET_DEVICES={devices}"
    existing = out.get("engine_config", "").strip()
    out["engine_config"] = f"{existing},{entry}" if existing else entry
    return out


def local_interfaces() -> Interfaces:
    """This machine's interfaces: names, which are loopback, their IPv4 addresses, RDMA devices."""
    names: list[str] = []
    loopback: set[str] = set()
    addresses: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            names.append(name)
            with contextlib.suppress(OSError, ValueError):
                with open(f"/sys/class/net/{name}/flags") as f:
                    if int(f.read().strip(), 16) & IFF_LOOPBACK:
                        loopback.add(name)
            with contextlib.suppress(OSError):
                packed = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                addresses[socket.inet_ntoa(packed[20:24])] = name
    try:
        rdma = bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        rdma = False
    return Interfaces(tuple(names), frozenset(loopback), addresses, rdma)


def bound_params(
    backend: str, params: Mapping[str, str], host: str, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The backend parameters with UCX's devices matched to ``host`` (UCX backends only, and only
    where the user chose none)."""
    if backend != "UCX" or user_chose_devices(params, os.environ if environ is None else environ):
        return dict(params)
    return with_net_devices(params, net_devices(host, local_interfaces()))
