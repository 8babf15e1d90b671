"""The link probe at the handshake, and the leaving message, with real engines (real NIXL over DRAM,
real ZMQ; docs/PERF.md, "The link probe"; docs/RELIABILITY.md).

A decode rank's first handshake with a prefill instance probes the link to each prefill rank that
writes to it: the dump, the metrics and one log line show the transport and its GB/s, and the cost
signal of that instance starts from the measured rate. A floor the link does not clear
(``min_link_gbps``, or ``refuse_tcp_link`` with UCX held to TCP) fails the handshake with
SlowLinkError, before any room opens, and both sides forget the pair. An engine that closes says
PeerLeaving: its peers forget it at once, without declaring it dead.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import pytest

from transfer_engine.config import EngineConfig
from transfer_engine.engine import TransferEngine
from transfer_engine.engine.snapshot import build_snapshot
from transfer_engine.errors import FailureReason, SlowLinkError, TransferFailed
from transfer_engine.observe import render_table
from transfer_engine.observe.cli import fetch_snapshot
from transfer_engine.testing import patterns
from transfer_engine.testing.cluster import free_port
from transfer_engine.transport.probe import PROBE_BYTES

from .harness import DEVICE, cluster, make_pool, small_layout

pytestmark = pytest.mark.timeout(60)

TCP_ONLY = {"engine_config": "NET_DEVICES=lo,TLS=tcp"}
"""UCX held to TCP over loopback (NIXL's ``engine_config``), as tests/integration/test_link.py does."""
ONE_HOST = "tcp" if DEVICE.startswith("cuda") else "shm"
"""What carries a WRITE between two agents of this process by UCX's defaults: shared memory for
host pools (inferred); TCP over loopback for GPU pools (observed), since UCX does not use
``cuda_ipc`` between two agents of one process. Two processes on one GPU do use ``cuda_ipc``:
tests/gpu/test_link_gpu.py."""


async def probed(decode: TransferEngine, n: int = 1, limit_s: float = 10.0) -> None:
    """Wait until ``decode`` has probed ``n`` links (the probe runs in the background without a floor)."""
    with anyio.fail_after(limit_s):
        while len(decode.links) < n:  # noqa: ASYNC110 - engine state, no event
            await anyio.sleep(0.01)


async def one_room(prefill: TransferEngine, decode: TransferEngine, bootstrap: str, room: int) -> None:
    src, dst = np.arange(4), np.arange(8, 12)
    patterns.fill(prefill.pool, room, src)
    receiver = await decode.receiver(room, bootstrap, dst)
    sender = prefill.sender(room)
    await sender.send(src, last=True)
    with anyio.fail_after(10):
        await sender.wait()
        await receiver.wait()
    tokens = patterns.received_tokens(4, prefill.pool.layout.page_size, 4, decode.pool.layout.page_size)
    assert patterns.mismatches(decode.pool, room, dst, tokens) == 0


@pytest.mark.anyio
async def test_the_first_handshake_probes_the_link(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="transfer_engine.engine")
    async with cluster(small_layout(), 1, 1, metrics_port=0) as c:
        prefill, decode = c.prefill[0], c.decode[0]
        await decode.connect(c.bootstrap)
        await probed(decode)
        (probe,) = decode.links.values()
        assert probe.peer == prefill.agent_name and probe.nbytes == PROBE_BYTES
        assert probe.transport in (ONE_HOST, "tcp") and probe.devices == "lo" and probe.gbps > 0

        # the dump, over the introspection endpoint as `transfer-engine dump` reads it
        snapshot = await anyio.to_thread.run_sync(fetch_snapshot, decode.introspect_endpoint)
        (link,) = snapshot.links
        assert (link.peer, link.transport, link.nbytes) == (prefill.agent_name, probe.transport, PROBE_BYTES)
        assert link.gbps == pytest.approx(probe.gbps) and link.latency_s == pytest.approx(probe.seconds)
        table = render_table(snapshot)
        assert "links (1, probed at connection)" in table, table
        row = next(line.split() for line in table.splitlines() if line.split()[:1] == [prefill.agent_name])
        assert row[1:3] == [probe.transport, "lo"], table
        assert not build_snapshot(prefill).links  # the decode probes: the prefill only offers a target

        # one INFO line (and a warning for a GPU pool's link over TCP), the metrics gauge
        about = [r for r in caplog.records if f"link to {prefill.agent_name}:" in r.getMessage()]
        lines = [r.getMessage() for r in about if r.levelno == logging.INFO]
        assert len(lines) == 1 and f"{probe.transport} " in lines[0] and " GB/s " in lines[0], lines
        warned = [r.getMessage() for r in about if r.levelno == logging.WARNING]
        tcp_on_gpu = probe.transport == "tcp" and DEVICE != "cpu"
        assert len(warned) == tcp_on_gpu and all("TCP where RDMA or NVLink was expected" in t for t in warned)
        assert decode.metrics is not None
        text = decode.metrics.render()[0].decode()
        gauge = f'transfer_engine_link_gbps{{peer="{prefill.agent_name}",transport="{probe.transport}"}}'
        assert gauge in text, text

        # the cost signal starts from the probe's rate, until rooms measure one
        n = 1 << 20
        rate = probe.nbytes / probe.seconds
        assert decode.estimate_transfer(c.bootstrap, n) == pytest.approx(n / rate)
        assert decode.transfer_costs()[c.bootstrap].rate is None

        # the probe wrote into scratch only: rooms move byte-exact, the prefill heard no notification
        await one_room(prefill, decode, c.bootstrap, 7)
        assert (
            not prefill.poller.counters["notifs_dropped"] and not prefill.poller.counters["notifs_unrouted"]
        )
        await decode.connect(c.bootstrap)  # connected already: no second probe
        assert len(decode.links) == 1
        c.assert_no_leaks()


def forgotten(prefill: TransferEngine, decode: TransferEngine) -> None:
    """Neither side holds the other: peers, instances, links, stashed requests."""
    assert not decode.peers and not decode.instances and not decode.links
    assert not prefill.peers
    assert prefill.counters["peers_left"] == 1 and not prefill.counters["peers_dead"]


@pytest.mark.anyio
async def test_a_floor_above_the_link_fails_the_handshake(caplog: pytest.LogCaptureFixture) -> None:
    async with cluster(small_layout(), 1, 1, min_link_gbps=1e6) as c:
        prefill, decode = c.prefill[0], c.decode[0]
        with pytest.raises(SlowLinkError) as caught:
            await decode.receiver(9, c.bootstrap, np.arange(4))
        err = caught.value
        assert err.peer == prefill.agent_name and err.transport in (ONE_HOST, "tcp") and 0 < err.gbps < 1e6
        assert "below min_link_gbps=1e+06 (lo)" in str(err), err
        forgotten(prefill, decode)
        assert not decode.rooms and decode.counters["rooms_opened"] == 0  # no room opened on the link
        # the next receiver() connects and probes again, and is refused again
        with pytest.raises(SlowLinkError):
            await decode.receiver(9, c.bootstrap, np.arange(4))
        assert not decode.peers and not prefill.peers
        c.assert_no_leaks()
    assert not [r for r in caplog.records if "declared dead" in r.getMessage()]


@pytest.mark.anyio
@pytest.mark.parametrize(("params", "refused"), [(TCP_ONLY, True), ({}, False)], ids=["tcp", "default"])
async def test_refuse_tcp_link(params: dict[str, str], refused: bool) -> None:
    """UCX held to TCP on the decode (its WRITE then goes over TCP) is refused, naming the fix; UCX's
    default between two agents of one process is not for host pools (shared memory), and is for GPU
    pools (TCP over loopback, see ``ONE_HOST``)."""
    if refused and DEVICE != "cpu":
        pytest.skip("UCX held to TCP is tried with host pools only")
    refused = refused or ONE_HOST == "tcp"
    async with cluster(small_layout(), 1, 1, refuse_tcp_link=True, nixl_params=params) as c:
        prefill, decode = c.prefill[0], c.decode[0]
        if refused:
            with pytest.raises(SlowLinkError, match="TCP where RDMA or NVLink was expected") as caught:
                await decode.connect(c.bootstrap)
            assert caught.value.transport == "tcp" and "UCX_NET_DEVICES" in str(caught.value)
            forgotten(prefill, decode)
        else:
            await decode.connect(c.bootstrap)
            (probe,) = decode.links.values()  # the handshake waited for it: a floor is set
            assert probe.transport == ONE_HOST
            await one_room(prefill, decode, c.bootstrap, 11)
        c.assert_no_leaks()


@contextlib.asynccontextmanager
async def engine(role: str, port: int, **config: Any) -> AsyncIterator[TransferEngine]:
    extra = {"num_workers": 2} if role == "prefill" else {}
    cfg = EngineConfig(role=role, bootstrap_port=port, **extra, **config)  # type: ignore[arg-type]
    async with TransferEngine(cfg, make_pool("contiguous", small_layout(), 1, 0, 64, 8)) as e:
        yield e


@pytest.mark.anyio
async def test_a_closing_decode_is_forgotten_at_once(caplog: pytest.LogCaptureFixture) -> None:
    """Heartbeats every 10 s: the prefill forgets the decode as it closes, not 20 s later."""
    caplog.set_level(logging.INFO, logger="transfer_engine.engine")
    port = free_port()
    bootstrap = f"tcp://127.0.0.1:{port}"
    async with engine("prefill", port, heartbeat_interval=10.0) as prefill:
        async with engine("decode", port, heartbeat_interval=10.0) as decode:
            await one_room(prefill, decode, bootstrap, 3)
            assert list(prefill.peers) == [decode.agent_name]
        assert not prefill.peers  # at once: the decode waited for the answer to its PeerLeaving
        assert prefill.counters["peers_left"] == 1 and not prefill.counters["peers_dead"]
        assert not any(prefill.leaks().values())
    messages = [r.getMessage() for r in caplog.records]
    assert any(f"peer {decode.agent_name} (decode rank 0) left: its engine closed" in t for t in messages)
    assert not [t for t in messages if "declared dead" in t]


@pytest.mark.anyio
async def test_a_closing_prefill_fails_the_rooms_waiting_on_it_at_once() -> None:
    """A decode room whose request waits in the prefill's stash (no sender() yet) fails PEER_DEAD as
    the prefill closes, as for a dead peer, long before heartbeats could tell."""
    port = free_port()
    bootstrap = f"tcp://127.0.0.1:{port}"
    async with engine("decode", port, heartbeat_interval=10.0, room_lease=60.0) as decode:
        async with engine("prefill", port, heartbeat_interval=10.0, room_lease=60.0) as prefill:
            receiver = await decode.receiver(5, bootstrap, np.arange(4))
            with anyio.fail_after(5):
                while not prefill.leaks()["stashed"]:  # noqa: ASYNC110 - engine state, no event
                    await anyio.sleep(0.01)
            closed = time.monotonic()
        with anyio.fail_after(5), pytest.raises(TransferFailed) as caught:
            await receiver.wait()
        assert time.monotonic() - closed < 2.0
        assert caught.value.reason is FailureReason.PEER_DEAD
        assert f"peer {prefill.agent_name} left: its engine closed" in caught.value.detail
        assert not decode.peers and not decode.instances and not decode.counters["peers_dead"]
        assert not any(decode.leaks().values())
