"""The example scripts, run as a user would: separate processes, real NIXL and ZMQ, every byte verified.

Each test starts ``examples/prefill.py`` and ``examples/decode.py`` (or ``pd_demo.py``) with
``sys.executable`` on a small schedule (4 layers, rooms of at most 128 tokens) and checks exit
statuses, the summary lines, and that no process of theirs outlives them.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from transfer_engine.testing.cluster import free_port

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SMALL = ["--layers", "4", "--min-tokens", "16", "--max-tokens", "128", "--inflight", "8", "--seed", "7"]
TIMEOUT = 60.0


def start(script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(EXAMPLES / script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: the rank processes can be found and killed
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def finish(proc: subprocess.Popen[str], timeout: float) -> str:
    """Wait for ``proc`` and return its output; kill its whole group on timeout. Asserts no orphans."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{proc.args} did not finish in {timeout} s:\n{tail(out)}")
    deadline = time.monotonic() + 5
    while group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if group_alive(proc.pid):
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"{proc.args} left processes behind after exiting:\n{tail(out)}")
    return out


def tail(out: str, n: int = 40) -> str:
    return "\n".join([ln for ln in out.splitlines() if "NIXL INFO" not in ln][-n:])


def kill_all(*procs: subprocess.Popen[str]) -> None:
    for proc in procs:
        if group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


@pytest.mark.parametrize(("P", "D"), [(2, 1), (1, 2)])
def test_prefill_and_decode_scripts(P: int, D: int) -> None:
    rooms = 20
    port = free_port()
    schedule = [*SMALL, "--rooms", str(rooms)]
    prefill = start("prefill.py", "--tp", str(P), "--bootstrap-port", str(port), *schedule)
    decode = start("decode.py", "--tp", str(D), "--bootstrap", f"tcp://127.0.0.1:{port}", *schedule)
    try:
        decode_out = finish(decode, TIMEOUT)
        if P == 2:
            # A server runs until told to stop: SIGTERM is a graceful shutdown (exit 0 if every room
            # succeeded). With P=1 the prefill stops by itself once its decode peers are gone.
            os.killpg(prefill.pid, signal.SIGTERM)
        prefill_out = finish(prefill, 20)
    finally:
        kill_all(prefill, decode)
    assert decode.returncode == 0, tail(decode_out)
    assert prefill.returncode == 0, tail(prefill_out)
    assert re.search(rf"^decode summary: rooms verified {rooms}/{rooms}, failed 0", decode_out, re.M), tail(
        decode_out
    )
    for out, side, n in ((prefill_out, "prefill", P), (decode_out, "decode", D)):
        for rank in range(n):
            assert re.search(rf"^{side} rank {rank}/{n}: control endpoint tcp://127\.0\.0\.1:\d+", out, re.M)
            assert re.search(rf"^{side} rank {rank}/{n}: introspect tcp://127\.0\.0\.1:\d+$", out, re.M)
            assert re.search(rf"^{side} rank {rank}/{n}: rooms ok={rooms} failed=0 not-run=0", out, re.M), (
                tail(out)
            )
    assert f"prefill summary: rooms ok {rooms}/{rooms} on every rank" in prefill_out


def test_pd_demo_small() -> None:
    rooms = 12
    demo = start(
        "pd_demo.py",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "2",
        "--rooms",
        str(rooms),
        "--timeout",
        "50",
        *SMALL,
    )
    try:
        out = finish(demo, TIMEOUT)
    finally:
        kill_all(demo)
    assert demo.returncode == 0, tail(out)
    summary = [ln for ln in out.splitlines() if ln.startswith("pd_demo: rooms verified")]
    assert len(summary) == 1, tail(out)
    assert re.match(
        rf"pd_demo: rooms verified {rooms}/{rooms}, [\d.]+ MB, [\d.]+ GB/s, room latency p50 ([\d.]+|nan) ms "
        rf"p99 ([\d.]+|nan) ms; the first \d+ rooms, opened at once at start, queue behind each other: up to "
        rf"[\d.]+ ms \(all rooms: p50 [\d.]+ ms p99 [\d.]+ ms\) "
        rf"\(prefill TP 2 -> decode TP 2, cpu, path auto, wall [\d.]+ s\)$",
        summary[0],
    ), summary[0]


def test_mismatched_schedules_fail_cleanly() -> None:
    """Sides that disagree on the rooms fail them on timeouts, report it, and exit non-zero."""
    port = free_port()
    timeouts = ["--bootstrap-timeout", "2", "--waiting-timeout", "2", "--room-lease", "2"]
    quick = ["--rooms", "3", *timeouts, *SMALL]
    prefill = start("prefill.py", "--tp", "1", "--bootstrap-port", str(port), *quick, "--seed", "1")
    decode = start("decode.py", "--tp", "1", "--bootstrap", f"tcp://127.0.0.1:{port}", *quick, "--seed", "2")
    try:
        decode_out = finish(decode, TIMEOUT)
        prefill_out = finish(prefill, 30)
    finally:
        kill_all(prefill, decode)
    assert decode.returncode != 0, tail(decode_out)
    assert prefill.returncode != 0, tail(prefill_out)
    assert re.search(r"^decode summary: rooms verified 0/3, failed 3", decode_out, re.M), tail(decode_out)
    assert "INPUT_TIMEOUT" in decode_out, tail(decode_out)
    assert "BOOTSTRAP_TIMEOUT" in prefill_out, tail(prefill_out)


def test_decode_without_prefill_gives_up() -> None:
    decode = start(
        "decode.py", "--bootstrap", f"tcp://127.0.0.1:{free_port()}", "--rooms", "2",
        "--wait-for-prefill", "1", "--connect-timeout", "1", *SMALL,
    )  # fmt: skip
    try:
        out = finish(decode, 30)
    finally:
        kill_all(decode)
    assert decode.returncode != 0, tail(out)
    assert "cannot connect to the prefill instance" in out, tail(out)
    assert re.search(r"^decode summary: rooms verified 0/2", out, re.M), tail(out)
