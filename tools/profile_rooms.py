"""Where the engine's CPU time goes per small room, or per layer group: cProfile of both sides, one loop.

    python tools/profile_rooms.py [--device cpu|cuda] [--per-write 0|1|4] [--rooms 200] [--top 25]

A prefill and a decode engine in ONE process and one event loop (``testing.open_cluster``: real
NIXL, real ZMQ), so one profile holds every actor of both sides; CUDA completions are observed by
the completion waiter's thread, which cProfile does not see (its wake-ups of the loop it does).
One-page rooms of ``--layers`` layers, one after the other: ``--per-write 0`` sends each room with
one ``send()`` (the small room of docs/PERF.md), ``N > 0`` reports the layers in groups of N with
``begin_chunk`` + ``layers_ready`` (layer-wise sending's per-group work). The first ``--warm`` rooms are not
profiled. Prints the wall time per room, then the functions with the most own time (``tottime``)
and the most time under them (``cumtime``), in microseconds per room.

Not a benchmark of latency (the two sides share one loop, so their work adds up): it says what the
loop runs and what each part costs, to choose what to remove. On the CPU box it is what it says. On
a GPU the one process holds both agents, and UCX moves a WRITE within one process by another way
than between two: there `transfer()` took 7.8 ms per one-page room and `get_new_notifs` 0.78 ms a
call (on an H100), which hides the rest. Use its CPU profile, and `bench_transfer --trace`
(two processes) for GPU steps.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import torch

from transfer_engine.config import EngineConfig
from transfer_engine.engine import TransferEngine
from transfer_engine.memory.layout import KVLayout, KVPool
from transfer_engine.testing.cluster import open_cluster


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument(
        "--per-write", type=int, default=0, help="0: one send() per room; N: groups of N layers"
    )
    parser.add_argument("--rooms", type=int, default=200)
    parser.add_argument("--warm", type=int, default=20)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--path", default="direct")
    parser.add_argument("--no-profile", action="store_true", help="the wall time per room only, unprofiled")
    parser.add_argument(
        "--gap-ms",
        type=float,
        default=0.0,
        help="idle the loop this long before each room's receiver() (a lone room finds caches cold)",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    layout = KVLayout(args.layers, 8, 128, torch.bfloat16, 16)

    def make(role: str, rank: int, port: int) -> TransferEngine:
        cfg = EngineConfig(
            role=role,  # type: ignore[arg-type]
            bootstrap_port=port,
            num_workers=1,
            layers_per_write=max(args.per_write, 1),
            path="auto" if args.path == "kernel" else args.path,  # type: ignore[arg-type]
        )
        pool = KVPool.allocate(layout, 1, 0, 64, device=device)
        if args.path == "kernel" and device.type == "cpu":  # host memory the prefill can map: shared
            for t in pool.tensors:
                t.share_memory_()
        return TransferEngine(cfg, pool)

    profile = cProfile.Profile()
    walls: list[float] = []
    opens: list[float] = []

    async def one(c: Any, room: int) -> None:
        sender = c.prefill[0].sender(room)
        t0 = time.perf_counter()
        receiver = await c.decode[0].receiver(room, c.bootstrap, np.arange(1))
        opens.append(time.perf_counter() - t0)
        if args.per_write:
            await sender.begin_chunk(np.arange(1), last=True)
            for first in range(0, args.layers, args.per_write):
                await sender.layers_ready(first, min(first + args.per_write, args.layers))
                await anyio.lowlevel.checkpoint()
        else:
            await sender.send(np.arange(1), last=True)
        await receiver.wait()
        await sender.wait()

    async def run() -> None:
        async with open_cluster(make, 1, 1) as c:
            for room in range(1, args.warm + 1):
                await one(c, room)
            if not args.no_profile:
                profile.enable()
            for room in range(args.warm + 1, args.warm + args.rooms + 1):
                if args.gap_ms:
                    await anyio.sleep(args.gap_ms / 1e3)
                t0 = time.perf_counter()
                await one(c, room)
                walls.append(time.perf_counter() - t0)
            profile.disable()
            c.assert_no_leaks()

    anyio.run(run)
    walls.sort()
    timed = sorted(opens[args.warm :])  # the profiled rooms' (the warm-up's had no gap)
    groups = -(-args.layers // args.per_write) if args.per_write else 1
    print(
        f"device={args.device} path={args.path} per_write={args.per_write} ({groups} WRITE(s) per room), "
        f"{args.rooms} rooms: wall per room p50 {walls[len(walls) // 2] * 1e3:.3f} ms, "
        f"mean {sum(walls) / len(walls) * 1e3:.3f} ms; the decode's receiver() p50 "
        f"{timed[len(timed) // 2] * 1e6:.0f} us (gap {args.gap_ms} ms){'' if args.no_profile else ' (under cProfile)'}"
    )
    if args.no_profile:
        return 0
    stats = pstats.Stats(profile)
    per_room = 1e6 / args.rooms
    for key, title in (("tottime", "own time"), ("cumtime", "time under")):
        rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2 if key == "tottime" else 3], reverse=True)  # type: ignore[attr-defined]
        print(f"-- top {args.top} by {title}, us per room (calls per room)")
        for (filename, line, name), (_cc, nc, tt, ct, _callers) in rows[: args.top]:
            where = (
                filename.split("transfer_engine/")[-1] if "transfer_engine" in filename else filename[-40:]
            )
            value = tt if key == "tottime" else ct
            print(f"  {value * per_room:9.1f}  ({nc / args.rooms:6.1f})  {where}:{line} {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
