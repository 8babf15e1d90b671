"""What this backend reads of SGLang's environment and ``ServerArgs``: roles, addresses, timeouts."""

from __future__ import annotations

import os
from typing import Any

from transfer_engine import ConfigError

__all__ = [
    "WILDCARD_LOOPBACK",
    "deferred_release_enabled",
    "disaggregation_role",
    "local_ip",
    "registry_endpoint",
    "registry_host",
    "sglang_timeouts",
    "te_overrides",
]


def disaggregation_role(disaggregation_mode: Any) -> str:
    mode = str(getattr(disaggregation_mode, "value", disaggregation_mode)).lower()
    if mode not in ("prefill", "decode"):
        raise ConfigError(f"disaggregation_mode={disaggregation_mode!r} must be prefill or decode")
    return mode


# --- addresses and timeouts -----------------------------------------------------------------------

WILDCARD_LOOPBACK = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def registry_host(server_args: Any) -> str:
    """Where prefill ranks find the bootstrap registry, as SGLang's backends resolve it.

    ``--dist-init-addr``'s host when set (multi-node: the registry runs on node 0), else ``--host``,
    a wildcard bind address being the same family's loopback.
    """
    dist = getattr(server_args, "dist_init_addr", None)
    if dist:
        from sglang.srt.utils.network import NetworkAddress

        return str(NetworkAddress.parse(str(dist)).resolved().host)
    host = str(getattr(server_args, "host", "127.0.0.1") or "")
    return WILDCARD_LOOPBACK.get(host, host)


def local_ip() -> str:
    """This rank's address for peers, as SGLang's own backends pick it (``SGLANG_HOST_IP`` first)."""
    from sglang.srt.utils.network import get_local_ip_auto

    return str(get_local_ip_auto("127.0.0.1"))


def sglang_timeouts() -> dict[str, float]:
    """The engine's room deadlines from SGLang's variables and defaults (its ``environ`` module).

    ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` bounds the handshake (``bootstrap_timeout``);
    ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` bounds a decode's wait for its KV once its pages are
    sent, which here spans the prefill's queueing (``waiting_timeout``) and the transfer itself
    (``transfer_timeout``).
    """
    from sglang.srt.environ import envs

    bootstrap = float(envs.SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT.get())
    waiting = float(envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get())
    return {"bootstrap_timeout": bootstrap, "waiting_timeout": waiting, "transfer_timeout": waiting}


def deferred_release_enabled() -> bool:
    from sglang.srt.environ import envs

    return bool(envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE.get())


def te_overrides(defaults: dict[str, Any]) -> dict[str, Any]:
    """The ``TE_*`` variables set for fields given defaults here: they win over SGLang's values."""
    return {
        name: os.environ["TE_" + name.upper()]
        for name in defaults
        if "TE_" + name.upper() in os.environ and name not in ("role", "tp_size", "tp_rank")
    }


def registry_endpoint(bootstrap_addr: str) -> str:
    addr = bootstrap_addr.removeprefix("tcp://")
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"bootstrap_addr={bootstrap_addr!r} must be host:port")
    host = host.strip("[]")
    return f"tcp://{WILDCARD_LOOPBACK.get(host, host)}:{port}"
