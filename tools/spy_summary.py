"""Summarize a py-spy raw profile of a benchmark by side: each rank's loop thread, its other threads,
the benchmark's own work, and the engine's start and stop set apart.

    py-spy record --subprocesses --threads -r 250 -f raw -o spy.txt -- \\
        python3 tools/bench_transfer.py ... --concurrency 8 --rooms 2000 --rounds 1 --lat-rooms 5
    python tools/spy_summary.py spy.txt [--top 25]

A stack goes to "startup / shutdown" when it passes through the engine's start or stop or an import;
to "bench" when it is the benchmark's fill, check or raw NIXL ceiling; to a rank's loop when it runs
under ``prefill_main`` / ``decode_main`` (tools/bench_transfer.py and tools/bench_layerwise.py name
their rank bodies so); else to "other", named by the first frame of its thread. For each side it
prints the frames with the most samples at the top of the stack (own), then the engine's, NIXL's
and the loop's frames with the most samples anywhere in the stack (inclusive), as shares of that
side's samples.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict

STARTUP = ("__aenter__", "__aexit__", "_find_and_load", "TransferEngine._start")
BENCH = ("patterns.py", "_raw_write", "raw_wait_notifs", "RawPair")
SHOWN = ("transfer_engine", "nixl", "select", "epoll", "_run_once")


def short(frame: str) -> str:
    """A frame without its site-packages or standard library directory."""
    frame = re.sub(r"\(/[^)]*/(site-packages|dist-packages|lib/python3\.\d+)/", "(", frame)
    return re.sub(r"\(/\S*?/transfer_engine/", "(transfer_engine/", frame)[:120]


def side_of(frames: list[str]) -> str:
    stack = ";".join(frames)
    if any(k in stack for k in STARTUP):
        return "startup / shutdown"
    if any(k in stack for k in BENCH):
        return "bench (fill, check, raw)"
    if "prefill_main" in stack:
        return "prefill rank, loop thread"
    if "decode_main" in stack:
        return "decode rank, loop thread"
    body = [f for f in frames if not f.startswith(("process ", "thread ")) and "threading.py" not in f]
    return f"other: {short(body[0]) if body else '?'}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    total: Counter[str] = Counter()
    own: defaultdict[str, Counter[str]] = defaultdict(Counter)
    incl: defaultdict[str, Counter[str]] = defaultdict(Counter)
    with open(args.path) as lines:
        for line in lines:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not count.isdigit():
                continue
            n = int(count)
            frames = stack.split(";")
            side = side_of(frames)
            total[side] += n
            body = [short(f) for f in frames if not f.startswith(("process ", "thread "))]
            if body:
                own[side][body[-1]] += n
            for frame in set(body):
                incl[side][frame] += n
    for side, samples in total.most_common(10):
        print(f"=== {side}: {samples} samples")
        print("  own:")
        for frame, n in own[side].most_common(args.top):
            print(f"    {100 * n / samples:5.1f}%  {frame}")
        print("  inclusive:")
        shown = [(f, n) for f, n in incl[side].most_common() if any(k in f for k in SHOWN)]
        for frame, n in shown[: args.top]:
            print(f"    {100 * n / samples:5.1f}%  {frame}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
