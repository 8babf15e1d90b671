"""SIGKILL a rank process in the middle of live rooms: the survivor fails them with PEER_DEAD, in time.

Each engine runs in its own process (``tests/chaos/rank.py``: real NIXL, real ZMQ), driven over
stdin/stdout with JSON lines. Rooms are held live on purpose (the prefill sends every chunk but the
last), so the kill always lands mid-transfer.

Bound: a peer silent for 2 heartbeat intervals is dead and leases are checked every quarter
interval, so a room fails within 2.25 intervals of the peer's last heartbeat, which precedes the
kill, plus scheduling slack (see ``BOUND``).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

ROOT = Path(__file__).resolve().parents[2]
HEARTBEAT = 0.5
BOUND = 2.25 * HEARTBEAT + 0.3
"""2 intervals of silence + a quarter-interval check + scheduling and delivery slack on 2 cores."""


class Rank:
    """One ``rank.py`` process: send commands, wait for events."""

    def __init__(self, role: str, port: int) -> None:
        self.role = role
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.chaos.rank",
                "--role",
                role,
                "--bootstrap-port",
                str(port),
                "--heartbeat",
                str(HEARTBEAT),
            ],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            start_new_session=True,
        )
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.stderr: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.events.put(json.loads(line))

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if "NIXL INFO" not in line:
                self.stderr.append(line)

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def expect(self, event: str, timeout: float = 30.0, **match: Any) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None and self.events.empty():
                tail = "".join(self.stderr[-20:])
                pytest.fail(f"{self.role}: no {event} {match} (exit {self.proc.poll()}):\n{tail}")
            try:
                got = self.events.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if got["event"] == "error":
                pytest.fail(f"{self.role}: {got}")
            if got["event"] == event and all(got.get(k) == v for k, v in match.items()):
                return got

    def kill(self) -> float:
        """SIGKILL now; returns the monotonic time of the kill."""
        at = time.monotonic()
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        return at

    def quit(self) -> dict[str, int]:
        """Graceful exit; returns the engine's leaks once every room ended."""
        self.send(cmd="quit")
        leaks = self.expect("leaks")["leaks"]
        assert self.proc.wait(30) == 0, "".join(self.stderr[-20:])
        return dict(leaks)

    def close(self) -> None:
        """Kill the process if it still runs, and close its pipes."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for reader in self._readers:
            reader.join(5)
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


def pages(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def open_rooms(prefill: Rank, decode: Rank, rooms: dict[int, int], *, hold: bool) -> None:
    """Open each room (id -> first page) of 4 pages on both sides, in 2 chunks; held ones never finish."""
    for room, first in rooms.items():
        decode.send(cmd="recv", room=room, pages=pages(first, 4))
        decode.expect("opened", room=room)
        prefill.send(cmd="send", room=room, pages=pages(first, 4), chunks=[2, 2], hold=hold)
        prefill.expect("opened", room=room)


def test_killed_decode_fails_its_rooms_and_a_new_decode_is_served() -> None:
    port = free_port()
    prefill = Rank("prefill", port)
    ranks = [prefill]
    try:
        prefill.expect("up")
        decode = Rank("decode", port)
        ranks.append(decode)
        decode.expect("up")
        open_rooms(prefill, decode, {1: 0, 2: 4}, hold=False)
        for room in (1, 2):
            assert prefill.expect("room", room=room)["ok"] and decode.expect("room", room=room)["ok"]
        open_rooms(prefill, decode, {3: 8, 4: 12, 5: 16}, hold=True)
        time.sleep(0.2)  # the first chunks are written: the rooms are mid-transfer
        killed_at = decode.kill()
        for room in (3, 4, 5):
            failed = prefill.expect("room", timeout=10, room=room)
            assert not failed["ok"] and failed["reason"] == "PEER_DEAD", failed
            assert 0 < failed["t"] - killed_at <= BOUND, (failed["t"] - killed_at, failed)
        # A fresh decode process registers and is served, every byte verified.
        fresh = Rank("decode", port)
        ranks.append(fresh)
        fresh.expect("up")
        open_rooms(prefill, fresh, {3: 20, 6: 24}, hold=False)
        for room in (3, 6):
            assert prefill.expect("room", room=room)["ok"]
            result = fresh.expect("room", room=room)
            assert result["ok"], result
        assert all(v == 0 for v in fresh.quit().values())
        assert all(v == 0 for v in prefill.quit().values())
    finally:
        for rank in ranks:
            rank.close()


def test_killed_prefill_fails_the_decode_rooms_instead_of_hanging() -> None:
    port = free_port()
    prefill = Rank("prefill", port)
    ranks = [prefill]
    try:
        prefill.expect("up")
        decode = Rank("decode", port)
        ranks.append(decode)
        decode.expect("up")
        open_rooms(prefill, decode, {7: 0, 8: 4}, hold=True)
        time.sleep(0.2)
        killed_at = prefill.kill()
        for room in (7, 8):
            failed = decode.expect("room", timeout=10, room=room)
            assert not failed["ok"] and failed["reason"] == "PEER_DEAD", failed
            assert 0 < failed["t"] - killed_at <= BOUND, (failed["t"] - killed_at, failed)
        assert all(v == 0 for v in decode.quit().values())
    finally:
        for rank in ranks:
            rank.close()
