"""Where `make demo`'s slow rooms spend their time: run pd_demo with step tracing, merge both sides.

    python tools/demo_trace.py [--keep DIR] [-- PD_DEMO_ARGS...]

Runs ``examples/pd_demo.py`` (its defaults: CPU, prefill TP 2 -> decode TP 1, 200 rooms) with
``TE_TRACE_STEPS`` on and ``TE_TRACE_OUT`` set, so every rank writes its engine's step marks and the
example's own (``x.fill``/``x.filled``/``x.sender``/``x.bootstrapped``/``x.done`` on the prefill,
``x.window``/``x.opened``/``x.waited``/``x.verified`` on the decode: examples/common.py
``ExampleTrace``). One machine, one monotonic clock: the marks merge into one timeline per room.

For every room, latency is the decode's ``x.opened`` -> ``x.waited`` (the demo's room latency, as
measured by the slowest decode rank). The report prints, for the median rooms and for the slowest
rooms after the first window, the median time of each step from ``x.opened`` (first occurrence
over all ranks), and, for each of the slowest rooms, the largest gap between two consecutive marks
of its timeline: the step that the tail waits in.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
Mark = tuple[int, int, str]


def load(folder: Path) -> dict[int, list[tuple[int, str, str]]]:
    """Every room's marks, ``(ns, who, step)`` sorted by time; ``who`` is the file (side-rank)."""
    rooms: dict[int, list[tuple[int, str, str]]] = defaultdict(list)
    for path in sorted(folder.glob("*.json")):
        who = path.stem
        for ns, room, step in json.loads(path.read_text()):
            rooms[int(room)].append((int(ns), who, str(step)))
    for marks in rooms.values():
        marks.sort()
    return rooms


def room_order(rooms: dict[int, list[tuple[int, str, str]]]) -> list[int]:
    """Rooms in the order the decode opened them (the schedule's order)."""
    opened = {
        r: min(ns for ns, _, s in m if s == "x.opened")
        for r, m in rooms.items()
        if any(s == "x.opened" for _, _, s in m)
    }
    return sorted(opened, key=opened.__getitem__)


def latency_ms(marks: list[tuple[int, str, str]]) -> float | None:
    """x.opened -> x.waited of the slowest decode rank (ms)."""
    per_rank: dict[str, list[int]] = defaultdict(list)
    for ns, who, step in marks:
        if step in ("x.opened", "x.waited"):
            per_rank[who].append(ns)
    spans = [(max(v) - min(v)) / 1e6 for v in per_rank.values() if len(v) == 2]
    return max(spans) if spans else None


def offsets(marks: list[tuple[int, str, str]]) -> dict[str, float]:
    """First time (ms from the first x.opened) of each step of the room, over all ranks."""
    t0 = min(ns for ns, _, s in marks if s == "x.opened")
    first: dict[str, float] = {}
    for ns, _, step in marks:
        first.setdefault(step, (ns - t0) / 1e6)
    return first


def table(rooms: list[list[tuple[int, str, str]]]) -> list[tuple[str, float]]:
    steps: dict[str, list[float]] = defaultdict(list)
    for marks in rooms:
        for step, ms in offsets(marks).items():
            steps[step].append(ms)
    rows = [(step, statistics.median(v)) for step, v in steps.items() if len(v) >= len(rooms) // 2]
    return sorted(rows, key=lambda r: r[1])


def largest_gap(marks: list[tuple[int, str, str]]) -> tuple[float, str, str]:
    t0 = min(ns for ns, _, s in marks if s == "x.opened")
    timeline = [(ns, f"{who}:{step}") for ns, who, step in marks if ns >= t0]
    best = (0.0, "", "")
    for (a, sa), (b, sb) in zip(timeline, timeline[1:], strict=False):
        if (b - a) / 1e6 > best[0]:
            best = ((b - a) / 1e6, sa, sb)
    return best


def report(folder: Path, inflight: int, slowest: int) -> None:
    rooms = load(folder)
    order = room_order(rooms)
    lat = {r: latency_ms(rooms[r]) for r in order}
    steady = [r for r in order[inflight:] if lat[r] is not None]
    by_latency = sorted(steady, key=lambda r: lat[r])  # type: ignore[arg-type,return-value]
    values = [lat[r] for r in by_latency]
    print(f"{len(order)} rooms traced, {len(steady)} after the first window ({inflight} rooms)")
    if not values:
        return
    print(
        f"latency after the first window: p50 {statistics.median(values):.1f} ms, "
        f"p90 {values[int(0.9 * (len(values) - 1))]:.1f}, p99 {values[int(0.99 * (len(values) - 1))]:.1f}, "
        f"max {values[-1]:.1f}"
    )
    mid = len(by_latency) // 2
    groups = {
        "median rooms": by_latency[max(0, mid - 10) : mid + 10],
        f"slowest {slowest}": by_latency[-slowest:],
    }
    for name, group in groups.items():
        print(f"\n{name}: median ms from the decode's x.opened")
        for step, ms in table([rooms[r] for r in group]):
            print(f"  {ms:9.2f}  {step}")
    print(f"\nthe slowest {slowest} rooms: latency, index in the schedule, largest gap between two marks")
    for r in reversed(by_latency[-slowest:]):
        gap, a, b = largest_gap(rooms[r])
        print(f"  {lat[r]:8.1f} ms  #{order.index(r):3d}  {gap:8.1f} ms  {a} -> {b}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--keep", type=Path, default=None, help="write the traces here and keep them")
    parser.add_argument("--analyze", type=Path, default=None, help="only report on traces written before")
    parser.add_argument("--inflight", type=int, default=16, help="pd_demo's --inflight (the first window)")
    parser.add_argument("--slowest", type=int, default=10, help="how many of the slowest rooms to show")
    parser.add_argument("demo_args", nargs="*", help="pd_demo.py arguments, after --")
    args = parser.parse_args(argv)
    if args.analyze is not None:
        report(args.analyze, args.inflight, args.slowest)
        return 0
    folder = args.keep or Path(tempfile.mkdtemp(prefix="demo_trace-"))
    env = {**os.environ, "TE_TRACE_STEPS": "2000000", "TE_TRACE_OUT": str(folder)}
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "pd_demo.py"),
        "--inflight",
        str(args.inflight),
        *args.demo_args,
    ]
    done = subprocess.run(cmd, env=env, check=False)
    if done.returncode != 0:
        print(f"pd_demo exited with status {done.returncode}", file=sys.stderr)
    report(folder, args.inflight, args.slowest)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
