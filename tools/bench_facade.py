"""The blocking facade's added latency per small room, against the asyncio API, in one run.

    python tools/bench_facade.py [--samples 200] [--pages 1] [--device cpu|cuda] [--busy]

One prefill and one decode process (spawned; pinned to disjoint CPU halves, as
``tools/bench_transfer.py`` does on the CPU box). Each process runs ONE engine through
:class:`~transfer_engine.facade.BlockingEngine`, so both APIs drive the same engine, loop thread,
sockets and NIXL agent. Samples go round-robin over three modes:

- ``asyncio``: the room is driven by coroutines run on the engine's own loop (through the portal,
  outside the timed span): ``sender()``/``send()``/``wait()`` and ``receiver()``/``wait()``;
- ``facade-poll``: the room is driven from the process's main thread with the facade, polling as a
  scheduler does (``poll()`` every ``--poll-us`` microseconds, sleeping in between);
- ``facade-wait``: the same, but ``wait()`` blocks until the room ended.

One sample: the prefill opens its sender and tells the decode over a pipe; the decode opens its
receiver with its pages; the prefill waits for WaitingForInput (the request arrived), takes ``t0``
and sends the room's ``--pages`` pages as one chunk; the decode takes ``t1`` when its side of the
room is seen ended (Success). The latency is ``t1 - t0`` (``time.monotonic`` is one clock for every
process of the machine). The added latency of a facade mode is the median, over rounds, of its
sample minus the asyncio sample of the same round. Every room's bytes are checked afterwards.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from transfer_engine import EngineConfig, KVLayout, KVPool, RoomStatus, patterns
from transfer_engine.facade import BlockingEngine
from transfer_engine.testing.cluster import free_port

MODES = ("asyncio", "facade-poll", "facade-wait")
ROOM_BASE = 1000


def _pin(args: argparse.Namespace, side: str) -> None:
    if not args.pin:
        return
    cpus = sorted(os.sched_getaffinity(0))
    half = max(1, len(cpus) // 2)
    os.sched_setaffinity(0, cpus[:half] if side == "prefill" else cpus[half:] or cpus)


def _contend(args: argparse.Namespace) -> None:
    """After the engine started: ``--switch-interval`` over the facade's own, and with ``--busy`` a
    thread running Python without pause, as a scheduler's thread between its waits. That thread
    holds the GIL whenever it can, so every call of the engine's loop thread that releases the GIL
    may wait for it to be handed back."""
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    if not args.busy:
        return

    def spin() -> None:
        while True:
            sum(range(100))

    threading.Thread(target=spin, name="busy", daemon=True).start()


def _engine(args: argparse.Namespace, role: str, port: int) -> BlockingEngine:
    layout = KVLayout(args.layers, args.heads, args.head_dim, torch.bfloat16, args.page_size)
    device = "cuda:0" if args.device == "cuda" and role == "prefill" else args.device
    if args.device == "cuda" and role == "decode":
        device = f"cuda:{min(1, torch.cuda.device_count() - 1)}"
    pool = KVPool.allocate(layout, 1, 0, max(8, 2 * args.pages), device=device)
    cfg = EngineConfig.from_env(
        role=role, bootstrap_port=port, transfer_timeout=600.0, heartbeat_interval=args.heartbeat_interval
    )
    return BlockingEngine(cfg, pool)


def _poll_until(handle: Any, want: RoomStatus, poll_s: float) -> RoomStatus:
    while True:
        status: RoomStatus = handle.poll()
        if status is want or status is RoomStatus.FAILED:
            return status
        time.sleep(poll_s)


def prefill_main(args: argparse.Namespace, port: int, conn: Connection) -> None:
    _pin(args, "prefill")
    engine = _engine(args, "prefill", port)
    _contend(args)
    pages = np.arange(args.pages, dtype=np.int64)
    poll_s = args.poll_us / 1e6
    conn.send("up")
    try:
        for i in range(args.samples * len(MODES)):
            room, mode = ROOM_BASE + i, MODES[i % len(MODES)]
            patterns.fill(engine.pool, room, pages)
            if args.device == "cuda":
                torch.cuda.synchronize()
            if mode == "asyncio":
                opened = engine._call(_async_open, engine, room)
                conn.send(("go", room, mode))
                t0 = engine._call(_async_send, opened, pages)
            else:
                sender = engine.sender(room)
                conn.send(("go", room, mode))
                _poll_until(sender, RoomStatus.WAITING_FOR_INPUT, poll_s)
                t0 = time.monotonic()
                sender.send(pages, last=True)
                if mode == "facade-wait":
                    sender.wait(60)
                elif _poll_until(sender, RoomStatus.SUCCESS, poll_s) is not RoomStatus.SUCCESS:
                    raise RuntimeError(f"room {room} failed: {sender.failure}")
            conn.send(("t0", t0))
            conn.recv()  # the decode checked the room
    finally:
        engine.close()


async def _async_open(engine: BlockingEngine, room: int) -> Any:
    return engine._engine.sender(room)


async def _async_send(sender: Any, pages: np.ndarray) -> float:
    import anyio

    while sender.poll() is RoomStatus.BOOTSTRAPPING:  # noqa: ASYNC110 (the engine has no event for it)
        await anyio.sleep(0.0001)
    t0 = time.monotonic()
    await sender.send(pages, last=True)
    await sender.wait()
    return t0


async def _async_receive(engine: BlockingEngine, room: int, bootstrap: str, pages: np.ndarray) -> float:
    receiver = await engine._engine.receiver(room, bootstrap, pages)
    await receiver.wait()
    return time.monotonic()


def decode_main(args: argparse.Namespace, port: int, conn: Connection) -> None:
    _pin(args, "decode")
    engine = _engine(args, "decode", port)
    _contend(args)
    bootstrap = f"tcp://127.0.0.1:{port}"
    engine.connect(bootstrap)
    pages = np.arange(args.pages, dtype=np.int64)[::-1].copy()
    poll_s = args.poll_us / 1e6
    tokens = args.pages * args.page_size
    conn.send("up")
    try:
        for _ in range(args.samples * len(MODES)):
            _, room, mode = conn.recv()
            if mode == "asyncio":
                t1 = engine._call(_async_receive, engine, room, bootstrap, pages)
            else:
                receiver = engine.receiver(room, bootstrap, pages)
                if mode == "facade-wait":
                    receiver.wait(60)
                elif _poll_until(receiver, RoomStatus.SUCCESS, poll_s) is not RoomStatus.SUCCESS:
                    raise RuntimeError(f"room {room} failed: {receiver.failure}")
                t1 = time.monotonic()
            bad = patterns.mismatches(engine.pool, room, pages, tokens)
            conn.send(("t1", t1, bad))
    finally:
        engine.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    port = free_port()
    p_conn, p_child = ctx.Pipe()
    d_conn, d_child = ctx.Pipe()
    procs = [
        ctx.Process(target=prefill_main, args=(args, port, p_child)),
        ctx.Process(target=decode_main, args=(args, port, d_child)),
    ]
    procs[0].start()
    assert p_conn.recv() == "up"
    procs[1].start()
    assert d_conn.recv() == "up"
    lat: dict[str, list[float]] = {mode: [] for mode in MODES}
    mismatches = 0
    try:
        for _ in range(args.samples * len(MODES)):
            go = p_conn.recv()
            d_conn.send(go)
            _, t0 = p_conn.recv()
            _, t1, bad = d_conn.recv()
            p_conn.send("next")
            lat[go[2]].append(1e3 * (t1 - t0))
            mismatches += bad
    finally:
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
    rounds = list(zip(*(lat[mode] for mode in MODES), strict=True))
    skip = min(args.warmup, len(rounds) - 1)
    rounds = rounds[skip:]
    out: dict[str, Any] = {"samples": len(rounds), "pages": args.pages, "mismatches": mismatches}
    for k, mode in enumerate(MODES):
        values = [r[k] for r in rounds]
        out[f"{mode}_p50_ms"] = statistics.median(values)
        out[f"{mode}_p90_ms"] = statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]
        if k:
            out[f"{mode}_added_p50_ms"] = statistics.median([r[k] - r[0] for r in rounds])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=200, help="rounds (one sample of each mode per round)")
    parser.add_argument("--warmup", type=int, default=10, help="rounds left out at the start")
    parser.add_argument("--pages", type=int, default=1, help="pages per room (default 1: a small room)")
    parser.add_argument("--poll-us", type=float, default=20.0, help="facade-poll: sleep between polls")
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--busy", action="store_true", help="a Python thread busy without pause in each process"
    )
    parser.add_argument(
        "--switch-interval",
        type=float,
        default=0.0,
        help="sys.setswitchinterval in each process, after the engine started (0: the facade's own, gil_switch_interval)",
    )
    parser.add_argument(
        "--heartbeat-interval", type=float, default=5.0, help="engine lease (the shared 2-core box stalls)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"small room ({result['pages']} page, {result['samples']} rounds): asyncio p50 "
            f"{result['asyncio_p50_ms']:.3f} ms; facade-poll p50 {result['facade-poll_p50_ms']:.3f} ms "
            f"(added {result['facade-poll_added_p50_ms']:+.3f} ms); facade-wait p50 "
            f"{result['facade-wait_p50_ms']:.3f} ms (added {result['facade-wait_added_p50_ms']:+.3f} ms); "
            f"mismatches {result['mismatches']}"
        )
    return 0 if result["mismatches"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
