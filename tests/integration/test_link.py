"""The link probe over real NIXL on this CPU box: two agents, host memory, one timed WRITE each.

Over UCX's defaults between two agents of one process the WRITE goes by shared memory (``cma``),
no byte on a TCP socket; with UCX held to TCP (``TLS=tcp`` through NIXL's ``engine_config``) the
probe sees the bytes on this process's sockets and names ``tcp``. A floor above what the box
moves refuses with SlowLinkError naming the transport and the fix; the dump shows the report.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from transfer_engine.errors import SlowLinkError
from transfer_engine.observe import LinkReport, decode_snapshot, encode_snapshot, render_table
from transfer_engine.observe.schema import Counters, NixlSnapshot, Snapshot
from transfer_engine.protocol.messages import MemRegion
from transfer_engine.transport.interface import RemotePeer
from transfer_engine.transport.nixl import NixlTransport
from transfer_engine.transport.probe import (
    LinkProbe,
    check_floor,
    classify,
    configured_devices,
    probe_link,
    tcp_socket_bytes,
)

N = 1 << 20


@contextmanager
def pair(params: dict[str, str]) -> Iterator[tuple[NixlTransport, NixlTransport, np.ndarray, np.ndarray]]:
    """Two transports; the first may WRITE into the second's buffer. Yields (writer, target, src, dst)."""
    a = NixlTransport("probe-a", params=dict(params))
    b = NixlTransport("probe-b", params=dict(params))
    src = np.arange(N, dtype=np.uint8)
    dst = np.zeros(N, dtype=np.uint8)
    try:
        a.register([MemRegion(src.ctypes.data, N, 0)], "DRAM")
        b.register([MemRegion(dst.ctypes.data, N, 0)], "DRAM")
        a.add_peer(RemotePeer("probe-b", "DRAM", [MemRegion(dst.ctypes.data, N, 0)]), b.metadata())
        yield a, b, src, dst
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(
    ("params", "transport"),
    [({"engine_config": "NET_DEVICES=lo"}, "shm"), ({"engine_config": "NET_DEVICES=lo,TLS=tcp"}, "tcp")],
)
def test_probe_over_dram(params: dict[str, str], transport: str) -> None:
    with pair(params) as (a, b, src, dst):
        peer = b.name
        probe_link(a, peer, src.ctypes.data, dst.ctypes.data, N, same_host=True, between_polls=b.drain_notifs)
        dst[:] = 0  # the first WRITE also connected the pair: the second one is the measure
        devices = configured_devices(a.params, {})
        probe = probe_link(
            a, peer, src.ctypes.data, dst.ctypes.data, N, same_host=True, devices=devices, between_polls=b.drain_notifs
        )  # fmt: skip
        assert np.array_equal(src, dst), "the probe's bytes landed"
        assert a.live_handles() == 0
    assert (probe.peer, probe.nbytes, probe.transport, probe.devices) == (peer, N, transport, "lo")
    assert probe.seconds > 0 and probe.gbps > 0
    if transport == "tcp":
        assert probe.tcp_bytes >= N
    else:
        assert probe.tcp_bytes < N // 2


def test_a_floor_above_the_link_refuses() -> None:
    with pair({"engine_config": "NET_DEVICES=lo,TLS=tcp"}) as (a, b, src, dst):
        peer = b.name
        probe = probe_link(
            a, peer, src.ctypes.data, dst.ctypes.data, N, same_host=True, devices="lo", between_polls=b.drain_notifs
        )  # fmt: skip
    check_floor(probe, 0)  # no floor
    check_floor(probe, probe.gbps / 2)
    with pytest.raises(SlowLinkError) as caught:
        check_floor(probe, 1e6)
    err = caught.value
    assert (err.peer, err.transport) == (peer, "tcp")
    assert "below min_link_gbps=1e+06 (lo)" in str(err) and "UCX_NET_DEVICES" in str(err)
    with pytest.raises(SlowLinkError, match="TCP where RDMA or NVLink was expected"):
        check_floor(probe, 0, refuse_tcp=True)


@pytest.mark.parametrize(
    ("tcp_bytes", "mem", "same_host", "expected"),
    [
        (N, "DRAM", True, "tcp"),
        (N // 2, "VRAM", False, "tcp"),
        (N // 2 - 1, "DRAM", True, "shm"),
        (0, "VRAM", True, "cuda_ipc"),
        (0, "VRAM", False, "rdma"),
        (0, "DRAM", False, "rdma"),
    ],
)
def test_classify(tcp_bytes: int, mem: str, same_host: bool, expected: str) -> None:
    assert classify(N, tcp_bytes, mem_type=mem, same_host=same_host) == expected


def test_configured_devices() -> None:
    assert configured_devices({}, {}) == "all"
    assert configured_devices({"engine_config": "RNDV_THRESH=8k,NET_DEVICES=eth0"}, {}) == "eth0"
    assert configured_devices({"ucx_devices": "mlx5_0:1"}, {}) == "mlx5_0:1"
    assert (
        configured_devices({"engine_config": "NET_DEVICES=lo"}, {"UCX_NET_DEVICES": "mlx5_1:1"}) == "mlx5_1:1"
    )


def test_tcp_socket_bytes_sees_this_process_sockets() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    payload = b"x" * 300_000
    before = tcp_socket_bytes()

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            got = 0
            while got < len(payload):
                got += len(conn.recv(65536))

    t = threading.Thread(target=serve)
    t.start()
    with socket.create_connection(server.getsockname()) as client:
        client.sendall(payload)
        t.join(10)
        moved = tcp_socket_bytes() - before
    server.close()
    assert moved >= len(payload)  # acked on the client's socket (the server's closed before the count)


def test_the_dump_shows_the_link() -> None:
    probe = LinkProbe("te-decode-0-1", N, 0.004, "tcp", "lo", N)
    report = LinkReport(
        peer=probe.peer,
        transport=probe.transport,
        devices=probe.devices,
        nbytes=probe.nbytes,
        latency_s=probe.seconds,
        gbps=probe.gbps,
        tcp_bytes=probe.tcp_bytes,
    )
    snapshot = Snapshot(
        role="prefill", tp_rank=0, tp_size=1, agent="te-prefill-0-1", control_endpoint="tcp://127.0.0.1:1",
        introspect_endpoint="tcp://127.0.0.1:2", metrics_endpoint=None, taken_at=0.0, uptime_s=1.0,
        rooms=[], ended=[], workers=[], ring=None, peers=[], nixl=NixlSnapshot(writes_in_flight=0, handles_live=0),
        counters=Counters(
            bytes_written=0, writes_posted=0, writes_done=0, writes_failed=0, notifications=0, rooms_opened=0,
            rooms_by_outcome={}, failures_by_reason={}, dropped_by_kind={}, raw={},
        ),
        links=[report],
    )  # fmt: skip
    assert decode_snapshot(encode_snapshot(snapshot)).links == [report]
    table = render_table(snapshot)
    assert "links (1, probed at connection)" in table
    row = next(line for line in table.splitlines() if "te-decode-0-1" in line and "tcp" in line)
    assert row.split()[:4] == ["te-decode-0-1", "tcp", "lo", "0.262"]
