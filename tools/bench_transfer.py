"""Engine transfer throughput and added latency against raw NIXL, between two processes, in one run.

    python tools/bench_transfer.py [--path direct|slice] [--prefill-tp 1 --decode-tp 1] [--rooms 24]

One prefill process and one decode process per rank pair (here P = D = 1 unless given). In the SAME
two processes (prefill rank 0, decode rank 0) a second, raw NIXL agent pair is set up, and

1. raw ceiling: one WRITE of the same bytes as one room, one descriptor, repeated;
2. engine throughput: ``--rooms`` rooms of ``--tokens`` tokens, ``--concurrency`` in flight, each
   sent in ``--chunks`` chunks, every byte verified on the decode side after the clock stops;
3. small-room latency: ``--lat-rooms`` one-page rooms, one at a time (the prefill has already sent
   when the decode asks), against a raw one-page WRITE plus its notification.

It prints the engine's figure, the raw ceiling and their ratio, and descriptors posted per room.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import queue
import socket
import statistics
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import anyio
import numpy as np
import torch

from transfer_engine import patterns
from transfer_engine.config import EngineConfig
from transfer_engine.engine import TransferEngine
from transfer_engine.layout import KVLayout, KVPool


def _layout(args: argparse.Namespace) -> KVLayout:
    return KVLayout(args.layers, args.heads, args.head_dim, torch.bfloat16, args.page_size)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _room_pages(args: argparse.Namespace, slot: int) -> np.ndarray:
    per_room = math.ceil(args.tokens / args.page_size)
    return np.arange(slot * per_room, (slot + 1) * per_room, dtype=np.int64)


class RawPair:
    """A raw NIXL agent on each side of the benchmark, with one registered buffer each."""

    def __init__(self, name: str, nbytes: int) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        self.buf = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        self.agent.register_memory(self.buf, "DRAM")

    def descs(self, nbytes: int) -> Any:
        return self.agent.get_xfer_descs(
            np.array([[self.buf.data_ptr(), nbytes, 0]], dtype=np.uint64), "DRAM"
        )


def _raw_write(raw: RawPair, peer: str, dst: Any, nbytes: int, notif: bytes) -> None:
    handle = raw.agent.initialize_xfer("WRITE", raw.descs(nbytes), dst, peer, notif)
    state = raw.agent.transfer(handle)
    while state == "PROC":
        state = raw.agent.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError(f"raw WRITE ended {state}")
    raw.agent.release_xfer_handle(handle)


def prefill_main(args: argparse.Namespace, rank: int, port: int, conn: Connection | None) -> None:
    anyio.run(_prefill, args, rank, port, conn)


async def _prefill(args: argparse.Namespace, rank: int, port: int, conn: Connection | None) -> None:
    layout = _layout(args)
    pool = KVPool.allocate(
        layout, args.prefill_tp, rank, args.concurrency * math.ceil(args.tokens / args.page_size) + 4
    )
    cfg = EngineConfig(role="prefill", tp_size=args.prefill_tp, tp_rank=rank, bootstrap_port=port)
    room_bytes = pool.page_bytes * math.ceil(args.tokens / args.page_size) * layout.num_kv_tensors
    raw = RawPair(f"raw-prefill-{os.getpid()}", room_bytes) if conn else None
    if conn is not None and raw is not None:
        conn.send(raw.agent.get_agent_metadata())
        md, addr = conn.recv()
        peer = raw.agent.add_remote_agent(md)
        dst = raw.agent.get_xfer_descs(np.array([[addr, room_bytes, 0]], dtype=np.uint64), "DRAM")
        small = pool.page_bytes * layout.num_kv_tensors
        dst_small = raw.agent.get_xfer_descs(np.array([[addr, small, 0]], dtype=np.uint64), "DRAM")
        _raw_write(raw, peer, dst, room_bytes, b"warm")
        t0 = time.perf_counter()
        for i in range(args.raw_reps):
            _raw_write(raw, peer, dst, room_bytes, f"raw{i}".encode())
        conn.send(("raw_gbps", room_bytes * args.raw_reps / (time.perf_counter() - t0) / 1e9))
        conn.recv()  # decode drained them
        for i in range(args.lat_rooms):  # latency: decode times post-to-notification
            conn.recv()
            _raw_write(raw, peer, dst_small, small, f"lat{i}".encode())
    for slot in range(args.concurrency):
        patterns.fill(pool, 0, _room_pages(args, slot))
    async with TransferEngine(cfg, pool) as engine:
        if conn is not None:
            conn.send("engine_up")
        sem = anyio.Semaphore(args.concurrency)
        slots = list(range(args.concurrency))

        async def one(room: int, pages_count_chunks: int) -> None:
            async with sem:
                slot = slots.pop()
                pages = _room_pages(args, slot)
                sender = engine.sender(room)
                bounds = np.linspace(0, len(pages), pages_count_chunks + 1).astype(int)
                for i in range(pages_count_chunks):
                    await sender.send(pages[bounds[i] : bounds[i + 1]], last=i == pages_count_chunks - 1)
                await sender.wait()
                slots.append(slot)

        async with anyio.create_task_group() as tg:
            for room in range(args.rooms):
                tg.start_soon(one, room, args.chunks)
        lat_page = _room_pages(args, 0)[:1]
        for i in range(args.lat_rooms):
            sender = engine.sender(1_000_000 + i)
            await sender.send(lat_page, last=True)
            await sender.wait()
        if conn is not None:
            conn.send(("descriptors", engine.poller.counters["descriptors_posted"]))
            await anyio.to_thread.run_sync(conn.recv)


def decode_main(args: argparse.Namespace, rank: int, port: int, conn: Connection | None, out: Any) -> None:
    anyio.run(_decode, args, rank, port, conn, out)


async def _decode(args: argparse.Namespace, rank: int, port: int, conn: Connection | None, out: Any) -> None:
    layout = _layout(args)
    pages_per_room = math.ceil(args.tokens / args.page_size)
    pool = KVPool.allocate(layout, args.decode_tp, rank, args.concurrency * pages_per_room + 4)
    room_bytes = pool.page_bytes * pages_per_room * layout.num_kv_tensors
    raw = (
        RawPair(f"raw-decode-{os.getpid()}", room_bytes * (args.prefill_tp // args.decode_tp or 1))
        if conn
        else None
    )
    result: dict[str, Any] = {}
    if conn is not None and raw is not None:
        md = conn.recv()
        raw.agent.add_remote_agent(md)
        conn.send((raw.agent.get_agent_metadata(), raw.buf.data_ptr()))
        result["raw_gbps"] = conn.recv()[1]
        got = 0
        while got < args.raw_reps + 1:
            got += sum(len(v) for v in raw.agent.get_new_notifs().values())
        conn.send("drained")
        lat = []
        for _ in range(args.lat_rooms):
            t0 = time.perf_counter()
            conn.send("go")
            while not raw.agent.get_new_notifs():
                pass
            lat.append(time.perf_counter() - t0)
        result["raw_lat_p50_ms"] = statistics.median(lat) * 1e3
        assert conn.recv() == "engine_up"  # before this process's engine exists: blocking is fine
    cfg = EngineConfig(
        role="decode", tp_size=args.decode_tp, tp_rank=rank, bootstrap_port=port, path=args.path
    )
    bootstrap = f"tcp://127.0.0.1:{port}"
    async with TransferEngine(cfg, pool) as engine:
        await engine.connect(bootstrap)  # handshake before the clock starts
        sem = anyio.Semaphore(args.concurrency)
        slots = list(range(args.concurrency))
        bad = 0

        async def one(room: int) -> None:
            nonlocal bad
            async with sem:
                slot = slots.pop()
                pages = _room_pages(args, slot)
                receiver = await engine.receiver(room, bootstrap, pages)
                await receiver.wait()
                slots.append(slot)

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for room in range(args.rooms):
                tg.start_soon(one, room)
        elapsed = time.perf_counter() - t0
        lat = []
        for i in range(args.lat_rooms):
            t1 = time.perf_counter()
            receiver = await engine.receiver(1_000_000 + i, bootstrap, _room_pages(args, 0)[:1])
            await receiver.wait()
            lat.append(time.perf_counter() - t1)
        result.update(
            room_bytes=room_bytes,
            engine_gbps=room_bytes * args.rooms / elapsed / 1e9,
            engine_lat_p50_ms=statistics.median(lat) * 1e3,
            engine_lat_p99_ms=sorted(lat)[int(0.99 * (len(lat) - 1))] * 1e3,
        )
        if conn is not None:
            posted = (await anyio.to_thread.run_sync(conn.recv))[1]
            result["descriptors_per_room"] = posted / (args.rooms + args.lat_rooms)
            conn.send("bye")
    # verified after the engine is closed: a long CPU-bound check would stall its heartbeats
    for slot in range(args.concurrency):  # every room wrote the same pattern into its slot's pages
        bad += patterns.mismatches(pool, 0, _room_pages(args, slot), pages_per_room * args.page_size)
    result["mismatches"] = bad
    if conn is not None:
        out.put(result)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--path", default="direct", choices=["auto", "direct", "slice"])
    parser.add_argument("--prefill-tp", type=int, default=1)
    parser.add_argument("--decode-tp", type=int, default=1)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=2)
    parser.add_argument("--rooms", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--raw-reps", type=int, default=10)
    parser.add_argument("--lat-rooms", type=int, default=50)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    port = _free_port()
    ctx = mp.get_context("spawn")
    procs = []
    p_conn, d_conn = ctx.Pipe()  # rank 0 of each side coordinate the raw phases through it
    out = ctx.Queue()
    for rank in range(args.prefill_tp):
        procs.append(ctx.Process(target=prefill_main, args=(args, rank, port, p_conn if rank == 0 else None)))
    for rank in range(args.decode_tp):
        procs.append(
            ctx.Process(target=decode_main, args=(args, rank, port, d_conn if rank == 0 else None, out))
        )
    for p in procs:
        p.start()
    r = None
    deadline = time.monotonic() + 900
    while r is None and time.monotonic() < deadline and not any(p.exitcode for p in procs):
        try:
            r = out.get(timeout=1)
        except queue.Empty:
            pass
    if r is None:
        print(f"benchmark failed: exit codes {[p.exitcode for p in procs]}", file=sys.stderr)
        for p in procs:
            p.kill()
        return 1
    for p in procs:
        p.join(timeout=60)
    r.update(path=args.path, P=args.prefill_tp, D=args.decode_tp, tokens=args.tokens, rooms=args.rooms,
             concurrency=args.concurrency, chunks=args.chunks)  # fmt: skip
    r["throughput_ratio"] = r["engine_gbps"] / r["raw_gbps"]
    r["added_latency_p50_ms"] = r["engine_lat_p50_ms"] - r["raw_lat_p50_ms"]
    if args.json:
        print(json.dumps(r))
    print(
        f"path={args.path} P={args.prefill_tp} D={args.decode_tp} room={r['room_bytes'] / 1e6:.1f} MB "
        f"x{args.rooms} conc={args.concurrency}: engine {r['engine_gbps']:.2f} GB/s, raw NIXL "
        f"{r['raw_gbps']:.2f} GB/s, ratio {r['throughput_ratio']:.2f}; descriptors/room "
        f"{r['descriptors_per_room']:.0f}; small room p50 {r['engine_lat_p50_ms']:.3f} ms (p99 "
        f"{r['engine_lat_p99_ms']:.3f}) vs raw {r['raw_lat_p50_ms']:.3f} ms: added {r['added_latency_p50_ms']:.3f} ms; "
        f"mismatches {r['mismatches']}"
    )
    ok = r["mismatches"] == 0 and all(p.exitcode == 0 for p in procs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
