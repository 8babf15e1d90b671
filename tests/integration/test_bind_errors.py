"""An engine that cannot bind its own sockets says so: a typed local error naming the address and
the setting to change, never an unreachable peer; and nothing of it is left behind."""

from __future__ import annotations

import socket
import threading

import pytest

from transfer_engine.config import EngineConfig
from transfer_engine.engine import TransferEngine
from transfer_engine.errors import AddressInUseError, BindError, PeerUnreachableError
from transfer_engine.memory.layout import KVPool

from .harness import free_port, small_layout

NOT_HERE = "203.0.113.7"
"""An address of no interface of this machine (TEST-NET-3)."""


def held_port() -> socket.socket:
    """A socket listening on a free loopback port (the caller closes it)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", free_port()))
    sock.listen()
    return sock


def pool() -> KVPool:
    return KVPool.allocate(small_layout(), 1, 0, 8)


@pytest.mark.anyio
@pytest.mark.parametrize("field", ["bootstrap_port", "introspect_port"])
async def test_a_port_in_use_is_named(field: str) -> None:
    threads = set(threading.enumerate())
    with held_port() as held:
        port = held.getsockname()[1]
        cfg = EngineConfig(role="prefill", **{"bootstrap_port": free_port(), field: port})  # type: ignore[arg-type]
        with pytest.raises(AddressInUseError) as caught:
            async with TransferEngine(cfg, pool()):
                pytest.fail("the engine started on a port in use")
    err = caught.value
    assert not isinstance(err, PeerUnreachableError)
    assert err.address == f"tcp://127.0.0.1:{port}"
    assert str(err) == (
        f"cannot bind tcp://127.0.0.1:{port}: Address already in use: another engine or process "
        f"listens there (set {field} to another port, or stop it)"
    )
    assert not {t for t in threading.enumerate() if t.is_alive()} - threads


@pytest.mark.anyio
async def test_an_address_not_of_this_machine() -> None:
    cfg = EngineConfig(role="prefill", host=NOT_HERE, bootstrap_host=NOT_HERE, bootstrap_port=free_port())
    with pytest.raises(BindError) as caught:
        async with TransferEngine(cfg, pool()):
            pytest.fail(f"the engine bound {NOT_HERE}")
    assert type(caught.value) is BindError
    assert caught.value.address.startswith(f"tcp://{NOT_HERE}:")
    assert "Cannot assign requested address" in str(caught.value)
