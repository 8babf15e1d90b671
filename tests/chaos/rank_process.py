"""Drive one ``tests/chaos/rank.py`` process: JSON-line commands on stdin, events on stdout.

Shared by the tests that need an engine in a process of its own (``test_kill`` and
``tests/integration/test_leases.py``: SIGKILL it; ``test_netns``: run it inside a network namespace).
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
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from transfer_engine.testing.cluster import free_port

ROOT = Path(__file__).resolve().parents[2]

HEARTBEAT = 0.5
"""The heartbeat interval of the rank processes the kill tests start (:func:`start_rank`)."""
BOUND = 2.25 * HEARTBEAT + 0.3
"""How soon a killed peer's rooms fail: 2 intervals of silence + a quarter-interval check +
scheduling and delivery slack on 2 cores."""


def child_pythonpath() -> str:
    """A rank process's ``PYTHONPATH``: this checkout first, then every entry the parent was given
    (where the dependencies live when they are not in the interpreter's own site-packages, as on the
    GPU machine)."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join([str(ROOT), *inherited])


class RankProcess:
    """One ``rank.py`` process started with ``argv`` (its own session, so a kill takes it whole)."""

    def __init__(self, role: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.role = role
        self.proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": child_pythonpath(), **(env or {})},
            start_new_session=True,
        )
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.backlog: list[dict[str, Any]] = []
        """Events read while waiting for another one (a room can end while the next one opens)."""
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
        """The first event (in order) of this kind that matches; others stay for later calls."""

        def matches(got: dict[str, Any]) -> bool:
            return got["event"] == event and all(got.get(k) == v for k, v in match.items())

        for got in self.backlog:
            if matches(got):
                self.backlog.remove(got)
                return got
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
            if matches(got):
                return got
            self.backlog.append(got)

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


def open_rooms(
    prefill: RankProcess, decode: RankProcess, rooms: dict[int, int], *, hold: bool, layers: bool = False
) -> None:
    """Open each room (id -> first page) of 4 pages on both sides, in 2 chunks; held ones never finish.
    Returns once the prefill's room has the decode's request (``asked``).

    ``layers``: sent layer-wise (a held one stops between two layers of its last chunk)."""
    for room, first in rooms.items():
        pages = list(range(first, first + 4))
        decode.send(cmd="recv", room=room, pages=pages)
        decode.expect("opened", room=room)
        prefill.send(cmd="send", room=room, pages=pages, chunks=[2, 2], hold=hold, layers=layers)
        prefill.expect("opened", room=room)
        prefill.expect("asked", room=room)


def start_rank(role: str, port: int) -> RankProcess:
    """One rank process (``tests.chaos.rank``) on this host, on bootstrap ``port``, beating every
    :data:`HEARTBEAT` seconds."""
    argv = [sys.executable, "-m", "tests.chaos.rank", "--role", role, "--bootstrap-port", str(port),
            "--heartbeat", str(HEARTBEAT)]  # fmt: skip
    return RankProcess(role, argv)


class RankProcesses:
    """Rank processes of one test on one bootstrap port; :func:`rank_processes` closes them all."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.started: list[RankProcess] = []

    def start(self, role: str) -> RankProcess:
        """One more rank process (:func:`start_rank`), returned once it is up."""
        rank = start_rank(role, self.port)
        self.started.append(rank)
        rank.expect("up")
        return rank


@contextmanager
def rank_processes() -> Iterator[RankProcesses]:
    """Start rank processes on a free bootstrap port with ``.start(role)``; on leaving, whatever
    happened, each one still running is killed and every pipe is closed."""
    ranks = RankProcesses(free_port())
    try:
        yield ranks
    finally:
        for rank in ranks.started:
            rank.close()


def expect_peer_dead(rank: RankProcess, rooms: Iterable[int], killed_at: float) -> None:
    """Each of ``rooms`` on ``rank`` fails PEER_DEAD within :data:`BOUND` of the peer's SIGKILL."""
    for room in rooms:
        failed = rank.expect("room", timeout=10, room=room)
        assert not failed["ok"] and failed["reason"] == "PEER_DEAD", failed
        assert 0 < failed["t"] - killed_at <= BOUND, (failed["t"] - killed_at, failed)
