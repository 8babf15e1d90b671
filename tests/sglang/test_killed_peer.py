"""A prefill rank killed mid-room: the decode's poll() turns Failed, its pages are reused at once.

The prefill rank is a real process (``prefill_proc.py``) killed with SIGKILL after its first WRITE.
The decode (this process, one TP rank) learns it from the missing heartbeats; only then does its
poll() say Failed, and SGLang frees the pages: the next request, from a live prefill instance,
lands in exactly those pages and every byte is checked. Budget: about 5 s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.sglang.rank_memory import SMALL, Memory, manager
from transfer_engine import FailureReason, RoomStatus
from transfer_engine.errors import TransferFailed
from transfer_engine.integrations.sglang import KVBootstrapServer, KVReceiver, KVSender
from transfer_engine.testing import patterns
from transfer_engine.testing.cluster import free_port

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def poll_until(handle: KVSender | KVReceiver, want: RoomStatus, limit_s: float = 15.0) -> RoomStatus:
    deadline = time.monotonic() + limit_s
    while True:
        status = handle.poll()
        if status in (want, RoomStatus.FAILED) or time.monotonic() > deadline:
            return status
        time.sleep(0.001)


def test_killed_prefill_fails_the_room_and_its_pages_are_reused() -> None:
    dead_port, live_port = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.sglang.prefill_proc", str(dead_port), "501"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    server = KVBootstrapServer("127.0.0.1", live_port)
    dmem, pmem = Memory.allocate(SMALL, 1, 16, 4), Memory.allocate(SMALL, 1, 16, 4)
    decode = manager("decode", SMALL, 1, 0, dmem, live_port, heartbeat_interval=0.2)
    prefill = None
    try:
        assert proc.stdout is not None
        # The decode's handshake gives a silent peer 5 s; on a loaded 2-core box the prefill process
        # can take longer than that to import torch and NIXL and bind its bootstrap port.
        for line in proc.stdout:
            if line.startswith("READY"):
                break
        else:
            pytest.fail(f"prefill process exited {proc.wait()} before it was ready")
        receiver = KVReceiver(decode, f"127.0.0.1:{dead_port}", 501)
        receiver.init(0)
        assert poll_until(receiver, RoomStatus.WAITING_FOR_INPUT) is RoomStatus.WAITING_FOR_INPUT
        pages = np.array([9, 2, 11, 5], dtype=np.int32)
        receiver.send_metadata(pages, 1, None, 0)
        for line in proc.stdout:
            if line.startswith("SENT"):
                break
        else:
            pytest.fail(f"prefill process exited {proc.wait()} before sending")
        assert poll_until(receiver, RoomStatus.TRANSFERRING, 5) is RoomStatus.TRANSFERRING
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        assert poll_until(receiver, RoomStatus.SUCCESS) is RoomStatus.FAILED
        assert time.monotonic() - killed < 3.0
        with pytest.raises(TransferFailed) as info:
            receiver.failure_exception()
        assert info.value.reason is FailureReason.PEER_DEAD
        # SGLang frees the pages now; the next request takes the same ones
        prefill = manager("prefill", SMALL, 1, 0, pmem, live_port, heartbeat_interval=0.2)
        nxt = KVReceiver(decode, f"127.0.0.1:{live_port}", 502)
        nxt.init(0)
        sender = KVSender(prefill, f"127.0.0.1:{live_port}", 502)
        assert poll_until(nxt, RoomStatus.WAITING_FOR_INPUT) is RoomStatus.WAITING_FOR_INPUT
        nxt.send_metadata(pages, 1, None, 0)
        assert poll_until(sender, RoomStatus.WAITING_FOR_INPUT) is RoomStatus.WAITING_FOR_INPUT
        src = np.array([0, 1, 2, 3])
        patterns.fill(prefill.pool, 502, src)
        sender.init(4, 1)
        sender.send(src[:3].astype(np.int32))
        sender.send(src[3:].astype(np.int32))
        assert poll_until(sender, RoomStatus.SUCCESS) is RoomStatus.SUCCESS
        assert poll_until(nxt, RoomStatus.SUCCESS) is RoomStatus.SUCCESS
        assert patterns.mismatches(decode.pool, 502, pages.astype(np.int64), 4 * SMALL.page_size) == 0
        for mgr in (decode, prefill):
            assert not any(mgr.engine.leaks().values()), mgr.engine.leaks()
    finally:
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
        for mgr in (prefill, decode):
            if mgr is not None:
                mgr.close()
        server.close()
