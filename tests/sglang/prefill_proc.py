"""A prefill TP rank in its own process, for the killed-peer test: opens one room and stops mid-way.

Usage: ``python -m tests.sglang.prefill_proc PORT ROOM``. It runs the bootstrap server and one
prefill rank (tp 1), waits for the decode's request, sends the first 2 of the room's 4 pages,
prints ``SENT`` and waits to be killed.
"""

from __future__ import annotations

import sys
import time

import numpy as np

import tests.sglang.conftest  # noqa: F401  # SGLang's modules and plugins, as under pytest
from tests.sglang.rank_memory import SMALL, Memory, manager
from transfer_engine import RoomStatus
from transfer_engine.integrations.sglang import KVBootstrapServer, KVSender
from transfer_engine.testing import patterns


def main() -> None:
    port, room = int(sys.argv[1]), int(sys.argv[2])
    server = KVBootstrapServer("127.0.0.1", port)
    memory = Memory.allocate(SMALL, 1, 16, 4)
    mgr = manager("prefill", SMALL, 1, 0, memory, port, heartbeat_interval=0.2)
    sender = KVSender(mgr, f"127.0.0.1:{port}", room)
    print("READY", flush=True)
    deadline = time.monotonic() + 30
    while sender.poll() is not RoomStatus.WAITING_FOR_INPUT:
        if time.monotonic() > deadline:
            raise SystemExit("no request from the decode")
        time.sleep(0.002)
    pages = [4, 5, 6, 7]
    patterns.fill(mgr.pool, room, np.array(pages))
    sender.init(4, 0)
    sender.send(np.array(pages[:2], dtype=np.int32))
    print("SENT", flush=True)
    time.sleep(600)
    server.close()


if __name__ == "__main__":
    main()
