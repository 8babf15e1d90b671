"""Two hosts, simulated by two network namespaces joined by a veth pair; then the link is cut.

The prefill rank runs in one namespace, the decode rank in the other (``tests/chaos/rank.py``
started with ``ip netns exec``), each addressed by its namespace's IP: the control plane (ZMQ) and
NIXL (UCX restricted to TCP over the veth, ``UCX_TLS=tcp UCX_NET_DEVICES=<veth>``, so no shared-memory
transport bypasses the link) both cross it. Rooms complete with every byte verified on the decode.
One room of each kind goes layer-wise (one WRITE per layer; the held one stops between two
layers). Then rooms are held mid-transfer and the link is set down: the heartbeat lease fails them
on both sides with PEER_DEAD, and both engines end with nothing leaked.

Needs root and ``ip`` (iproute2) with network namespaces; skipped with the reason otherwise. The
namespaces (and with them the veth pair) are deleted whatever happens.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.chaos.rank_process import RankProcess, open_rooms

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

HEARTBEAT = 0.5
BOUND = 2 * HEARTBEAT + 1.0
"""The lease bound, 2 heartbeat intervals after the cut (docs/DECISIONS.md, "Leases"),, plus slack for two processes on 2 cores."""
PORT = 18998
ROOM_BYTES = 4 * 4 * 6 * 8 * 16 * 2
"""One room of rank.py: 4 pages of 4 tokens, small_layout (3 layers, K and V, 8 heads of 16 bf16)."""
TAG = f"te{os.getpid() % 100000}"
PREFILL_NS, DECODE_NS = f"{TAG}p", f"{TAG}d"
PREFILL_DEV, DECODE_DEV = f"{TAG}vp", f"{TAG}vd"
SUBNET = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
PREFILL_IP, DECODE_IP = f"{SUBNET}.1", f"{SUBNET}.2"


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def rx_bytes(ns: str, dev: str) -> int:
    """Bytes received so far on ``dev`` in namespace ``ns`` (``ip -s``'s counter, read from sysfs)."""
    out = subprocess.run(
        ["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/rx_bytes"],
        capture_output=True, text=True, check=True, timeout=30,
    )  # fmt: skip
    return int(out.stdout)


def netns_unavailable() -> str | None:
    """Why this machine cannot make network namespaces, or None when it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs the `ip` command (iproute2)"
    probe = f"{TAG}probe"
    result = ip("netns", "add", probe, check=False)
    if result.returncode != 0:
        return f"`ip netns add` is not allowed here: {result.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None


@pytest.fixture(scope="module")
def link() -> Iterator[None]:
    """Two namespaces joined by a veth pair, addressed PREFILL_IP / DECODE_IP; deleted afterwards."""
    why = netns_unavailable()
    if why is not None:
        pytest.skip(why)
    try:
        ip("netns", "add", PREFILL_NS)
        ip("netns", "add", DECODE_NS)
        ip("link", "add", PREFILL_DEV, "type", "veth", "peer", "name", DECODE_DEV)
        for ns, dev, addr in ((PREFILL_NS, PREFILL_DEV, PREFILL_IP), (DECODE_NS, DECODE_DEV, DECODE_IP)):
            ip("link", "set", dev, "netns", ns)
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield
    finally:
        for ns in (PREFILL_NS, DECODE_NS):  # deleting a namespace deletes its end of the veth pair
            ip("netns", "del", ns, check=False)
        ip("link", "del", PREFILL_DEV, check=False)  # only if it never moved into its namespace


def netns_rank(role: str, ns: str, dev: str, host: str) -> RankProcess:
    """One rank process inside namespace ``ns``; UCX confined to TCP over its veth end ``dev``."""
    argv = ["ip", "netns", "exec", ns, sys.executable, "-m", "tests.chaos.rank", "--role", role,
            "--bootstrap-port", str(PORT), "--heartbeat", str(HEARTBEAT), "--host", host,
            "--bootstrap-host", PREFILL_IP]  # fmt: skip
    return RankProcess(role, argv, {"UCX_TLS": "tcp", "UCX_NET_DEVICES": dev})


def test_two_hosts_transfer_then_a_cut_link_fails_both_sides(link: None) -> None:
    prefill = netns_rank("prefill", PREFILL_NS, PREFILL_DEV, PREFILL_IP)
    ranks = [prefill]
    try:
        up = prefill.expect("up")
        assert PREFILL_IP in up["endpoint"], up
        decode = netns_rank("decode", DECODE_NS, DECODE_DEV, DECODE_IP)
        ranks.append(decode)
        assert DECODE_IP in decode.expect("up")["endpoint"]
        received_before = rx_bytes(DECODE_NS, DECODE_DEV)
        open_rooms(prefill, decode, {1: 0, 2: 4}, hold=False)
        open_rooms(prefill, decode, {3: 8}, hold=False, layers=True)  # one WRITE per layer
        for room in (1, 2, 3):  # the decode verified every byte of each ("ok")
            assert prefill.expect("room", room=room)["ok"]
            got = decode.expect("room", room=room)
            assert got["ok"], got
        # the KV crossed the veth (UCX has no other way): at least 3 rooms' bytes came in on it
        assert rx_bytes(DECODE_NS, DECODE_DEV) - received_before >= 3 * ROOM_BYTES
        open_rooms(prefill, decode, {4: 12}, hold=True)
        open_rooms(prefill, decode, {5: 16}, hold=True, layers=True)  # held between two layers
        time.sleep(0.3)  # the first chunks are written: the rooms are mid-transfer
        cut_at = time.monotonic()
        ip("-n", PREFILL_NS, "link", "set", PREFILL_DEV, "down")
        for side in (prefill, decode):
            for room in (4, 5):
                failed = side.expect("room", timeout=10, room=room)
                assert not failed["ok"] and failed["reason"] == "PEER_DEAD", (side.role, failed)
                assert 0 < failed["t"] - cut_at <= BOUND, (side.role, failed["t"] - cut_at)
        assert all(v == 0 for v in decode.quit().values())
        assert all(v == 0 for v in prefill.quit().values())
    finally:
        for rank in ranks:
            rank.close()
