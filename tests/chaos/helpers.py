"""Shared set-up of the chaos tests: engines in one process with chosen transports and configs.

Everything is real: NIXL (UCX over loopback) moves the bytes and ZMQ carries the control plane.
Faults come only from :mod:`transfer_engine.transport.faults` wrapped around the real transport.
Pools are on the CPU unless a test asks for ``device``: the integrity tests pass
``tests.integration.harness.DEVICE`` (``TE_TEST_DEVICE=cuda`` on the GPU machine, as the
integration tests do).
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import zmq.auth

from tests.integration.harness import Cluster, small_layout
from transfer_engine.config import EngineConfig
from transfer_engine.engine import TransferEngine
from transfer_engine.memory.layout import KVLayout, KVPool
from transfer_engine.testing.cluster import open_cluster
from transfer_engine.transport.nixl import NixlTransport, Transport

TransportFactory = Callable[[str], Transport]
"""Builds the transport of an engine from its NIXL agent name."""

_names = itertools.count()


def agent_name(role: str, rank: int) -> str:
    return f"chaos-{role}-{rank}-{os.getpid()}-{next(_names)}"


def faulty_factory(store: list[Any], **faults: Any) -> TransportFactory:
    """A factory of ``FaultyTransport(NixlTransport(name), **faults)``; each one is appended to ``store``."""
    from transfer_engine.transport.faults import FaultyTransport

    def make(name: str) -> Transport:
        transport = FaultyTransport(NixlTransport(name), **faults)
        store.append(transport)
        return transport

    return make


def make_engine(
    role: str,
    tp: int,
    rank: int,
    port: int,
    layout: KVLayout | None = None,
    *,
    transport: TransportFactory | None = None,
    num_pages: int = 64,
    aux: int = 8,
    device: str = "cpu",
    **config: Any,
) -> TransferEngine:
    """One engine (not entered) of ``role`` with a small pool on ``device``; ``config`` overrides
    EngineConfig fields."""
    name = agent_name(role, rank)
    fields = ({"num_workers": 2} if role == "prefill" else {}) | config
    cfg = EngineConfig(role=role, tp_size=tp, tp_rank=rank, bootstrap_port=port, agent_name=name, **fields)  # type: ignore[arg-type]
    pool = KVPool.allocate(
        layout or small_layout(),
        tp,
        rank,
        num_pages,
        aux_slots=aux,
        aux_item_bytes=16 if aux else 0,
        device=device,
    )
    return TransferEngine(cfg, pool, transport=None if transport is None else transport(name))


@contextlib.asynccontextmanager
async def engines(
    P: int = 1,
    D: int = 1,
    *,
    layout: KVLayout | None = None,
    prefill_transport: TransportFactory | None = None,
    decode_transport: TransportFactory | None = None,
    prefill_config: dict[str, Any] | None = None,
    decode_config: dict[str, Any] | None = None,
    device: str = "cpu",
    **config: Any,
) -> AsyncIterator[Cluster]:
    """P prefill and D decode engines, entered (prefill rank 0 first, it hosts the bootstrap), their
    pools on ``device``.

    ``config`` goes to every engine, ``prefill_config``/``decode_config`` to one side.
    """
    p_cfg, d_cfg = config | (prefill_config or {}), config | (decode_config or {})

    def make(role: str, rank: int, port: int) -> TransferEngine:
        if role == "prefill":
            return make_engine(
                role, P, rank, port, layout, transport=prefill_transport, device=device, **p_cfg
            )
        return make_engine(role, D, rank, port, layout, transport=decode_transport, device=device, **d_cfg)

    async with open_cluster(make, P, D) as c:
        yield c


def certificate(directory: Path, name: str) -> tuple[Path, Path]:
    """A CURVE certificate made by ``zmq.auth.create_certificates``: ``(public .key, .key_secret)``."""
    directory.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(directory, name)
    return Path(public), Path(secret)
