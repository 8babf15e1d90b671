"""The README's quick starts run as written: each is a complete program under ``examples/`` that the
README shows in part, and every part it shows is in the program, character for character.

Each program runs as a user runs it (``python examples/quickstart_*.py``) and must move its room,
check the bytes, exit 0 and say ``ok``; write nothing but NIXL's ``NIXL INFO`` lines on stderr (no
leak report, traceback or warning at exit); and listen only on 127.0.0.1, its UCX listeners
included (the README's security section): a thread of its own process reads its sockets while
it runs (``tests/docs/listeners.py``).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
LISTENERS = Path(__file__).with_name("listeners.py")
QUICK_STARTS = {
    "Quick start: the asyncio API": "examples/quickstart_async.py",
    "Quick start: the blocking facade": "examples/quickstart_blocking.py",
}
OWN_LISTENERS = 1 + 3 + 3
"""The bootstrap registry, and a control socket and an introspection endpoint per rank (3 ranks)."""


def section(markdown: str, heading: str) -> str:
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", markdown, re.M | re.S)
    assert match, f"README has no section {heading!r}"
    return match.group(1)


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)


def parts(block: str) -> list[list[str]]:
    """The block's runs of lines between ``...`` lines."""
    runs: list[list[str]] = [[]]
    for line in block.splitlines():
        if line.strip() == "...":
            runs.append([])
        else:
            runs[-1].append(line)
    return [run for run in runs if any(line.strip() for line in run)]


def contained(run: list[str], source: list[str]) -> bool:
    """Whether ``run`` is lines of ``source`` in a row, all shifted right by the same indentation."""
    first = run[0]
    for i, line in enumerate(source):
        if not line.endswith(first) or line[: len(line) - len(first)].strip():
            continue
        indent = line[: len(line) - len(first)]
        if source[i : i + len(run)] == [indent + r if r else "" for r in run]:
            return True
    return False


@pytest.mark.parametrize("heading", list(QUICK_STARTS))
def test_readme_shows_parts_of_the_program(heading: str) -> None:
    text = section(README.read_text(), heading)
    program = QUICK_STARTS[heading]
    assert f"]({program})" in text, f"the section does not link {program}"
    blocks = python_blocks(text)
    assert len(blocks) == 1, f"{heading}: expected one python block, found {len(blocks)}"
    source = (ROOT / program).read_text().splitlines()
    runs = parts(blocks[0])
    assert len(runs) >= 3
    for run in runs:
        assert contained(run, source), f"{heading}: these lines are not in {program}:\n" + "\n".join(run)


def test_contained_is_strict() -> None:
    source = ["def f():", "    a = 1", "    b = 2", "c = 3"]
    assert contained(["a = 1", "b = 2"], source)
    assert contained(["def f():", "    a = 1"], source)
    assert not contained(["a = 1", "c = 3"], source)
    assert not contained(["a = 1", "b = 3"], source)
    assert not contained(["b = 2", "a = 1"], source)


@contextmanager
def bootstrap_port_held() -> Iterator[None]:
    """The quick starts bind the default bootstrap port (8998): one of them at a time on this machine."""
    with open("/tmp/transfer-engine-8998.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("program", sorted(QUICK_STARTS.values()))
def test_quick_start_runs_as_written(program: str, tmp_path: Path) -> None:
    out = tmp_path / "listeners.json"
    with bootstrap_port_held():
        done = subprocess.run(
            [sys.executable, str(LISTENERS), str(out), program],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=150,
            env={k: v for k, v in os.environ.items() if not k.startswith(("UCX_", "TE_"))},
        )
    name = Path(program).stem
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{name}: ok" in done.stdout.splitlines(), done.stdout
    assert "decode: room WAITING_FOR_INPUT" in done.stdout  # statuses print by name
    # A loaded machine may hold the loop a second or more: the engine says so ("heartbeat loop stalled
    # ..."), and the run still has to end ok; that line is the load's, not the quick start's.
    noise = [
        ln
        for ln in done.stderr.splitlines()
        if ln.strip() and "NIXL INFO" not in ln and "heartbeat loop stalled" not in ln
    ]
    assert not noise, "stderr:\n" + "\n".join(noise[:30])
    assert not done.stderr or done.stderr.endswith("\n")
    seen = json.loads(out.read_text())
    listening = seen["listening"]
    assert "127.0.0.1:8998" in listening, seen
    assert len(listening) > OWN_LISTENERS, f"no UCX listener seen: {seen}"
    elsewhere = [a for a in listening if not a.startswith("127.0.0.1:")]
    assert not elsewhere, f"{program} listened beyond the loopback interface: {elsewhere}"
