"""Helpers shared by the tests, tools and examples: free ports and in-process clusters.

Real engines over real NIXL and ZMQ, P prefill and D decode ranks in one process. Not a mock of
anything: a cluster is what a deployment runs, minus the process boundaries.
"""

from __future__ import annotations

import contextlib
import random
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from transfer_engine.engine import TransferEngine
from transfer_engine.errors import AddressInUseError

EngineMaker = Callable[[str, int, int], TransferEngine]
"""``make(role, rank, bootstrap_port)``: a not yet entered engine of that role and rank."""


_EPHEMERAL = "/proc/sys/net/ipv4/ip_local_port_range"
_ports = random.Random()


def _below_ephemeral() -> int:
    """The first port of the kernel's ephemeral range (Linux's default when it cannot be read)."""
    try:
        with open(_EPHEMERAL) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now, picked below the kernel's ephemeral range.

    It is bound later (by an engine, or by a process started with it), and meanwhile a port of the
    ephemeral range may be handed to an outgoing connection (every ZMQ peer makes some), which then
    holds it: a clean-clone test run failed so, "Address already in use". The kernel hands out no
    port below that range by itself, so only another explicit pick could take one. Where the range
    starts too low to leave room (some containers), a port the kernel picks (``bind(0)``).
    """
    low = _below_ephemeral()
    for _ in range(200 if low > 20000 else 0):
        port = _ports.randrange(20000, low)
        with contextlib.suppress(OSError), socket.socket() as s:
            s.bind((host, port))
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class Cluster:
    """Entered engines: ``prefill`` ranks (rank 0 hosts the bootstrap) and ``decode`` ranks."""

    prefill: list[TransferEngine]
    decode: list[TransferEngine]
    bootstrap: str

    @property
    def engines(self) -> list[TransferEngine]:
        return self.prefill + self.decode

    def leaks(self) -> dict[str, dict[str, int]]:
        """Each engine's non-zero leak counters, by agent name (empty when nothing is held)."""
        found = {}
        for engine in self.engines:
            held = {k: v for k, v in engine.leaks().items() if v}
            if held:
                found[engine.agent_name] = held
        return found

    def assert_no_leaks(self) -> None:
        leaks = self.leaks()
        assert not leaks, f"leaked: {leaks}"


@contextlib.asynccontextmanager
async def open_cluster(make: EngineMaker, P: int, D: int) -> AsyncIterator[Cluster]:
    """Enter P prefill engines (rank 0 first: it hosts the bootstrap) then D decode engines.

    The bootstrap port is picked free and retried (up to three times) when another socket took it
    between the pick and the bind.
    """
    async with contextlib.AsyncExitStack() as stack:
        for attempt in range(3):
            port = free_port()
            try:
                prefill = [await stack.enter_async_context(make("prefill", 0, port))]
                break
            except AddressInUseError:
                if attempt == 2:
                    raise
        for rank in range(1, P):
            prefill.append(await stack.enter_async_context(make("prefill", rank, port)))
        decode = [await stack.enter_async_context(make("decode", rank, port)) for rank in range(D)]
        yield Cluster(prefill, decode, f"tcp://127.0.0.1:{port}")
