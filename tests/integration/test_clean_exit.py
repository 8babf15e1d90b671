"""Processes that opened engines end quietly: no leak report, traceback or warning at exit.

Each test runs a real program to its normal end (a script of threads with four engines, the
prefill and decode example scripts with their rank processes, ``make demo``'s launcher) and reads
everything it wrote. What is allowed on stderr: NIXL's own ``NIXL INFO`` lines as each agent is
created, the demo's progress bar and summary. A ``nanobind: leaked ...`` report at teardown (what
freezing the collector's objects without unfreezing them at exit produced:
``engine.supervisor.freeze_gc_once``) fails them, as does output whose last line has no newline. A
decode that ends says PeerLeaving to the prefill, which forgets it at once (an INFO line): a serving
prefill's log holds no ``declared dead`` warning either.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from transfer_engine.testing.cluster import free_port

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SMALL = ["--layers", "4", "--min-tokens", "16", "--max-tokens", "64", "--seed", "3"]
NOISE = ("nanobind", "leaked", "Traceback", "Warning", "WARNING", "Error", "ERROR", "Exception ignored")


def noise(text: str, allowed: tuple[str, ...] = ()) -> list[str]:
    """The lines of ``text`` that a clean exit does not write (``allowed``: substrings of lines that
    may appear anyway)."""
    return [
        ln
        for ln in text.splitlines()
        if "NIXL INFO" not in ln and any(w in ln for w in NOISE) and not any(a in ln for a in allowed)
    ]


def assert_quiet(text: str, what: str, allowed: tuple[str, ...] = ()) -> None:
    found = noise(text, allowed)
    assert not found, f"{what} wrote at exit:\n" + "\n".join(found[:30])
    assert not text or text.endswith("\n"), f"{what}'s output does not end with a newline: {text[-200:]!r}"


def run(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{argv} did not finish in {timeout} s:\n{out[-2000:]}\n{err[-2000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def test_threaded_script_exits_cleanly() -> None:
    """Four BlockingEngines in one process (P=1 -> D=1, then P=2 -> D=1), closed, then a normal exit."""
    done = run([sys.executable, str(EXAMPLES / "threaded.py"), "--setups", "1:1,2:1", "--rooms", "3"], 120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert_quiet(done.stderr, "threaded.py")
    assert_quiet(done.stdout, "threaded.py")


def test_example_rank_processes_exit_cleanly() -> None:
    """prefill.py and decode.py (one rank process each) end through the interpreter's teardown: the
    decode when its rooms are done, the prefill (a server) on SIGTERM."""
    port = free_port()
    rooms = ["--rooms", "4", *SMALL]
    prefill = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "prefill.py"), "--tp", "1", "--bootstrap-port", str(port), *rooms],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        decode = run(
            [sys.executable, str(EXAMPLES / "decode.py"), "--bootstrap", f"tcp://127.0.0.1:{port}", *rooms],
            90,
        )
        os.killpg(prefill.pid, signal.SIGTERM)  # a server's normal end: a graceful shutdown
        out, err = prefill.communicate(timeout=30)
    finally:
        if prefill.poll() is None:
            os.killpg(prefill.pid, signal.SIGKILL)
            prefill.wait(5)
    assert decode.returncode == 0, decode.stdout + decode.stderr
    assert prefill.returncode == 0, out + err
    assert_quiet(decode.stderr, "decode.py")
    assert_quiet(err, "prefill.py")


def test_demo_exits_cleanly(tmp_path: Path) -> None:
    """``make demo``'s launcher and both sides' logs (their rank processes' stderr included)."""
    argv = [sys.executable, str(EXAMPLES / "pd_demo.py"), "--rooms", "6", "--log-dir", str(tmp_path), *SMALL]
    done = run(argv, 120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("pd_demo: rooms verified 6/6"), done.stdout
    assert_quiet(done.stderr, "pd_demo.py")
    for side in ("prefill", "decode"):
        assert_quiet((tmp_path / f"{side}.log").read_text(), f"the demo's {side} side")
