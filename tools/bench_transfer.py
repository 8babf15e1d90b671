"""Engine transfer throughput and added latency against raw NIXL, between processes, in one run.

    python tools/bench_transfer.py [--path direct|staged|host|slice|kernel] [--prefill-tp 1 --decode-tp 1]
                                   [--rooms 24] [--device cpu|cuda]
                                   [--page-table contiguous|scattered|realistic]
                                   [--pool-layout tensors|page-major]

One process per prefill rank and per decode rank (spawned, as in production). In the SAME processes
as prefill rank 0 and decode rank 0 a second, raw NIXL agent pair is set up, and

1. throughput, in ``--rounds`` rounds: each round first measures the raw ceiling (``--raw-reps``
   WRITEs of one room's bytes, prefill rank 0 -> decode rank 0, one descriptor each), then the
   engine (all of a room's bytes, over every decode rank, per second) on its share of ``--rooms``
   rooms of ``--tokens`` tokens, ``--concurrency`` in flight, each sent in ``--chunks`` chunks. The
   ratio printed is the median of the rounds' ratios: on a small, shared machine the ceiling itself
   moves by 2x between minutes, so each engine figure is held against the ceiling of its own round.
   p50/p99 room latency (decode ``receiver()`` to ``wait()``) is taken under that load; every byte
   is verified on the decode side after the clock stops;
2. small-room latency: ``--lat-rooms`` samples, each a raw one-page WRITE plus its notification
   (the decode asks over a pipe, the prefill writes) directly followed by a one-page engine room
   (the prefill has already sent when the decode asks). The added latency is the median of the
   per-sample differences.

Each of the ``--concurrency`` room slots of a side holds one page table of ``--page-table``'s shape
(``transfer_engine.testing.pagetables``: the prefill's and the decode's from unrelated allocators,
so the direct path's descriptors are the runs consecutive on both sides); the pools are sized for
that shape (at least 8 rooms for ``scattered`` and ``realistic``). ``--pool-layout page-major`` allocates
both sides' pools page-major (``KVPool.allocate(page_major=True)``: a page holds every layer's K and
V), so a run of pages consecutive on both sides is one descriptor.

It prints the engine's figure, the raw ceiling and their ratio, and descriptors posted per room, and
the CPython collections of prefill rank 0's and decode rank 0's processes over the timed phases
(:class:`GcPauses`: count, total and longest pause, full collections apart); with ``--gc-freeze``
each process calls ``gc.freeze()`` once its engine has started and run the warm-up rooms.
With ``--device cuda`` prefill rank r uses GPU ``r % n`` and decode rank r GPU ``(P + r) % n`` (ranks
share GPUs when P + D > n: the output says so), and a device peer copy of one room's bytes (GPU of
prefill 0 -> GPU of decode 0) is printed as a second ceiling.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import math
import multiprocessing as mp
import os
import pstats
import queue
import statistics
import sys
import time
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Barrier
from typing import Any

import anyio
import numpy as np
import torch

from transfer_engine.config import EngineConfig
from transfer_engine.engine import TransferEngine
from transfer_engine.errors import PeerUnreachableError
from transfer_engine.memory.layout import KVLayout, KVPool
from transfer_engine.protocol.layers import ChunkCut
from transfer_engine.testing import pagetables, patterns
from transfer_engine.testing.cluster import free_port


def _layout(args: argparse.Namespace) -> KVLayout:
    return KVLayout(args.layers, args.heads, args.head_dim, torch.bfloat16, args.page_size)


def _device(args: argparse.Namespace, side: str, rank: int) -> torch.device:
    if args.device == "cpu":
        return torch.device("cpu")
    n = torch.cuda.device_count()
    index = rank if side == "prefill" else args.prefill_tp + rank
    return torch.device("cuda", index % n)


WARMUP_ROOM = 2_000_000
SMALL_ROOM = 1_000_000
TRACE_CAPACITY = 1_000_000


def step_table(marks: list[tuple[int, int, str]], rooms: set[int]) -> list[tuple[str, float, float, int]]:
    """Per step: (name, median ms of its first mark after the room's decode ``receiver()``, of its
    last mark, rooms that reached it), over ``rooms``, in order of the median first mark."""
    start: dict[int, int] = {}
    first: dict[tuple[int, str], int] = {}
    last: dict[tuple[int, str], int] = {}
    for t, room, step in sorted(marks):
        if room not in rooms:
            continue
        if step == "d.receiver":
            start.setdefault(room, t)
        first.setdefault((room, step), t)
        last[(room, step)] = t
    by_step: dict[str, tuple[list[float], list[float]]] = {}
    for (room, step), t in first.items():
        if room in start:
            f, lst = by_step.setdefault(step, ([], []))
            f.append((t - start[room]) / 1e6)
            lst.append((last[(room, step)] - start[room]) / 1e6)
    rows = [
        (step, statistics.median(f), statistics.median(lst), len(f)) for step, (f, lst) in by_step.items()
    ]
    return sorted(rows, key=lambda row: row[1])


class GcPauses:
    """Every CPython collection of this process between :meth:`start` and :meth:`stop`, timed through
    ``gc.callbacks``.

    The callbacks run on whichever thread triggered the collection, with the GIL held; collections
    never overlap, so one start time suffices.
    """

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []  # (generation, seconds)
        self.spans: list[tuple[int, int, int]] = []
        """(start, end in ``time.monotonic_ns``, generation) of each: the step trace's clock, machine-wide."""
        self._start = 0.0
        self._start_ns = 0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            self._start_ns = time.monotonic_ns()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._start))
            self.spans.append((self._start_ns, time.monotonic_ns(), info["generation"]))

    def start(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def stop(self) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, float]:
        """Collections, their total and longest pause in ms, and the same for full (generation 2) ones."""
        full = [t for g, t in self.pauses if g == 2]
        every = [t for _, t in self.pauses]
        return {
            "collections": len(every),
            "total_ms": round(sum(every) * 1e3, 3),
            "max_ms": round(max(every, default=0.0) * 1e3, 3),
            "full": len(full),
            "full_total_ms": round(sum(full) * 1e3, 3),
        }


def tail_samples(
    windows: list[tuple[int, int, int]], spans: dict[str, list[tuple[int, int, int]]], count: int
) -> list[dict[str, Any]]:
    """The ``count`` slowest small-room samples (``windows``: room, start and end in
    ``time.monotonic_ns``), slowest first, each with the CPython collections of each side that
    overlapped it (``spans``: side -> :attr:`GcPauses.spans`): what a tail sample waited for."""
    rows = []
    for room, start, end in sorted(windows, key=lambda w: w[1] - w[2])[:count]:
        row: dict[str, Any] = {"room": room, "ms": round((end - start) / 1e6, 3)}
        for side, side_spans in spans.items():
            inside = [(min(e, end) - max(s, start), g) for s, e, g in side_spans if s < end and e > start]
            row[f"gc_{side}_ms"] = round(sum(t for t, _ in inside) / 1e6, 3)
            row[f"gc_{side}_full"] = sum(1 for _, g in inside if g == 2)
        rows.append(row)
    return rows


def gc_line(side: str, got: dict[str, float]) -> str:
    """One side's :meth:`GcPauses.summary` as printed."""
    return (
        f"{side} {got['collections']:.0f} collections {got['total_ms']:.1f} ms (longest {got['max_ms']:.1f}), "
        f"full {got['full']:.0f} ({got['full_total_ms']:.1f} ms)"
    )


def _chunk_pages(args: argparse.Namespace) -> int:
    return math.ceil(math.ceil(args.tokens / args.page_size) / args.chunks)


_TABLES: dict[str, list[np.ndarray]] = {}


def _room_pages(args: argparse.Namespace, slot: int, side: str) -> np.ndarray:
    """The page table of room slot ``slot`` on ``side`` (the same in every rank of that side)."""
    if side not in _TABLES:
        _TABLES[side] = pagetables.room_tables(
            args.page_table, _room_pages_count(args), args.concurrency,
            seed=pagetables.side_seed(args.page_seed, side),
        )  # fmt: skip
    return _TABLES[side][slot]


def _room_pages_count(args: argparse.Namespace) -> int:
    return math.ceil(args.tokens / args.page_size)


def _pool_pages(args: argparse.Namespace) -> int:
    return pagetables.pool_pages(args.page_table, _room_pages_count(args), args.concurrency)


def _side_pool(args: argparse.Namespace, side: str, rank: int) -> KVPool:
    """The pool of ``side``'s rank ``rank``: ``_pool_pages`` pages in ``--pool-layout``, on the rank's
    device (with CUDA, made this process's current device first)."""
    device = _device(args, side, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return KVPool.allocate(
        _layout(args),
        args.prefill_tp if side == "prefill" else args.decode_tp,
        rank,
        _pool_pages(args),
        device=device,
        page_major=args.pool_layout == "page-major",
    )


class RawPair:
    """A raw NIXL agent on each side of the benchmark, with one registered buffer each."""

    def __init__(self, name: str, nbytes: int, device: torch.device, *, pinned: bool = False) -> None:
        """``pinned``: host memory pinned by CUDA, as the engine's host staging (``device`` is the CPU)."""
        from nixl._api import nixl_agent, nixl_agent_config

        self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.buf = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
        if pinned:
            self.buf = self.buf.pin_memory()
        self.mem = "VRAM" if device.type == "cuda" else "DRAM"
        self.dev = (device.index or 0) if device.type == "cuda" else 0
        self.agent.register_memory(self.buf, self.mem)

    def descs(self, nbytes: int) -> Any:
        return self.agent.get_xfer_descs(
            np.array([[self.buf.data_ptr(), nbytes, self.dev]], dtype=np.uint64), self.mem
        )


def raw_transfer(raw: RawPair, handle: Any) -> None:
    """Post the raw WRITE ``handle`` and spin on its state until it is done; RuntimeError if it fails."""
    state = raw.agent.transfer(handle)
    while state == "PROC":
        state = raw.agent.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError(f"raw WRITE ended {state}")


def _raw_write(raw: RawPair, peer: str, dst: Any, nbytes: int, notif: bytes) -> None:
    handle = raw.agent.initialize_xfer("WRITE", raw.descs(nbytes), dst, peer, notif)
    raw_transfer(raw, handle)
    raw.agent.release_xfer_handle(handle)


def raw_wait_notifs(raw: RawPair, count: int) -> None:
    """Poll the raw agent until ``count`` notifications came, yielding the CPU between polls.

    A bare spin here can starve the writer: with few cores the woken writer may be queued behind this
    loop until the scheduler's next tick (4-16 ms seen on the 2-core box), which measures the kernel,
    not NIXL.
    """
    got = 0
    while got < count:
        got += sum(len(v) for v in raw.agent.get_new_notifs().values())
        if got < count:
            os.sched_yield()


def _config(args: argparse.Namespace, role: str, rank: int, port: int) -> EngineConfig:
    tp = args.prefill_tp if role == "prefill" else args.decode_tp
    return EngineConfig.from_env(  # TE_* variables tune the rest (TE_POLL_SPIN=0, ...)
        role=role,
        tp_size=tp,
        tp_rank=rank,
        bootstrap_port=port,
        path="auto" if args.path == "kernel" else args.path,  # kernel: auto, which takes it on one host
        staging_chunk_pages=_chunk_pages(args),
        transfer_timeout=600.0,
        heartbeat_interval=args.heartbeat_interval,
        trace_steps=TRACE_CAPACITY if args.trace else 0,
        # --ab integrity switches the engines' checksums off in its odd halves: they must exist first
        integrity=True if args.ab == "integrity" else None,
    )


def _round_rooms(args: argparse.Namespace, rnd: int) -> range:
    """Round ``rnd``'s share of the rooms (``main`` keeps ``rounds <= rooms``: none is empty)."""
    per, extra = divmod(args.rooms, args.rounds)
    start = rnd * per + min(rnd, extra)
    return range(start, start + per + (rnd < extra))


def _cpu_halves() -> tuple[list[int], list[int]]:
    """The CPUs this process may use, split in two: the prefill's and the decode's."""
    cpus = sorted(os.sched_getaffinity(0))
    half = len(cpus) // 2
    return cpus[:half], cpus[half:]


def _pin(args: argparse.Namespace, side: str) -> None:
    """Keep the prefill and decode processes on disjoint CPU halves (``--pin``).

    In production they run on different hosts. Left to the scheduler on a 2-core box, a woken process
    is often queued on the CPU of the one that woke it and waits for the next tick: the raw
    WRITE-plus-notification latency then reads 0.3, 4, 12 or 20 ms from one run to the next.
    """
    if not args.pin:
        return
    os.sched_setaffinity(0, _cpu_halves()[0 if side == "prefill" else 1])


def prefill_main(
    args: argparse.Namespace, rank: int, port: int, conn: Connection | None, barrier: Barrier
) -> None:
    _pin(args, "prefill")
    anyio.run(_prefill, args, rank, port, conn, barrier)


async def _prefill(
    args: argparse.Namespace, rank: int, port: int, conn: Connection | None, barrier: Barrier
) -> None:
    pool = _side_pool(args, "prefill", rank)
    device, pages_per_room = pool.device, _room_pages_count(args)
    cfg = _config(args, "prefill", rank, port)
    raw: RawPair | None = None
    peer = ""
    dst = dst_small = None
    small = 0
    if conn is not None:  # the raw pair is made first: its agent creation must not stall the engine
        md, addr, dev, mem, room_bytes = conn.recv()
        raw = RawPair(f"raw-prefill-{os.getpid()}", room_bytes, device)
        peer = raw.agent.add_remote_agent(md)
        dst = raw.agent.get_xfer_descs(np.array([[addr, room_bytes, dev]], dtype=np.uint64), mem)
        small = room_bytes // pages_per_room
        dst_small = raw.agent.get_xfer_descs(np.array([[addr, small, dev]], dtype=np.uint64), mem)
        conn.send(raw.agent.get_agent_metadata())
        conn.recv()  # the decode loaded our metadata
        _raw_write(raw, peer, dst, room_bytes, b"warm")
    for slot in range(args.concurrency):
        patterns.fill(pool, 0, _room_pages(args, slot, "prefill"))
    async with TransferEngine(cfg, pool) as engine:
        sem = anyio.Semaphore(args.concurrency)
        slots = list(range(args.concurrency))

        async def one(room: int, pages_count_chunks: int) -> None:
            async with sem:
                slot = slots.pop()
                pages = _room_pages(args, slot, "prefill")
                sender = engine.sender(room)
                bounds = np.linspace(0, len(pages), pages_count_chunks + 1).astype(int)
                for i in range(pages_count_chunks):
                    await sender.send(pages[bounds[i] : bounds[i + 1]], last=i == pages_count_chunks - 1)
                await sender.wait()
                slots.append(slot)

        async def rooms(ids: Any) -> None:
            async with anyio.create_task_group() as tg:
                for room in ids:
                    tg.start_soon(one, room, args.chunks)

        await rooms(range(WARMUP_ROOM, WARMUP_ROOM + args.warmup))  # JIT, staging buffers, mappings
        if args.gc_freeze:
            gc.freeze()
        pauses = GcPauses().start()
        cpu = CpuSpent(profile=args.profile == "prefill" and rank == 0)
        round_writes: list[int] = []  # WRITEs this rank posted in each round (--ab cut: groups or chunks)
        for rnd in range(args.rounds):
            # Each round: the raw ceiling, then the engine's rooms, so both see the same machine.
            # Every rank waits at both barriers: no rank's rooms run while the ceiling is taken.
            await anyio.to_thread.run_sync(barrier.wait)
            if raw is not None and conn is not None:
                t0 = time.perf_counter()
                for i in range(args.raw_reps):
                    _raw_write(raw, peer, dst, room_bytes, f"raw{rnd}.{i}".encode())
                conn.send(room_bytes * args.raw_reps / (time.perf_counter() - t0) / 1e9)
            await anyio.to_thread.run_sync(barrier.wait)
            _ab(args, engine, rnd)
            before = engine.poller.counters["writes_posted"]
            with cpu:
                await rooms(_round_rooms(args, rnd))
            round_writes.append(engine.poller.counters["writes_posted"] - before)
        cpu.print_profile("prefill", args.rooms)
        lat_page = _room_pages(args, 0, "prefill")[:1]
        rooms_posted = engine.poller.counters["descriptors_posted"]  # the warm-up's and the rounds'
        for i in range(args.lat_rooms):
            # One raw sample, then one engine sample, alternating; the decode times both.
            if raw is not None and conn is not None:
                conn.recv()  # "go": blocking, as a raw user's writer would wait
                _raw_write(raw, peer, dst_small, small, f"lat{i}".encode())
            _ab(args, engine, i)
            sender = engine.sender(SMALL_ROOM + i)
            await sender.send(lat_page, last=True)  # the prefill has sent before the decode asks
            if conn is not None:
                conn.send("ready")
            await sender.wait()
        if conn is not None:
            pauses.stop()
            post_ns = dict(getattr(engine.poller.transport, "post_ns", {}))
            conn.send(
                (
                    (rooms_posted, engine.poller.counters["descriptors_posted"] - rooms_posted),
                    engine.me.trace.take(),
                    post_ns,
                    pauses.summary(),
                    round_writes,
                    pauses.spans,
                    cpu.per_room(args.rooms),
                )  # fmt: skip
            )
            await anyio.to_thread.run_sync(conn.recv)


def decode_main(
    args: argparse.Namespace, rank: int, port: int, conn: Connection | None, barrier: Barrier, out: Any
) -> None:
    _pin(args, "decode")
    anyio.run(_decode, args, rank, port, conn, barrier, out)


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[math.ceil(q * (len(ordered) - 1))]


async def _decode(
    args: argparse.Namespace, rank: int, port: int, conn: Connection | None, barrier: Barrier, out: Any
) -> None:
    pool = _side_pool(args, "decode", rank)
    layout, device, pages_per_room = pool.layout, pool.device, _room_pages_count(args)
    if args.path == "kernel" and device.type == "cpu":  # host memory the prefill can map: shared
        for t in pool.tensors:
            t.share_memory_()
    # The whole room: decode rank 0 receives 1/D of it (non-MLA), and every decode rank the same share.
    room_bytes = pool.page_bytes * pages_per_room * layout.num_kv_tensors * args.decode_tp
    result: dict[str, Any] = {}
    raw = None
    if conn is not None:
        raw = RawPair(f"raw-decode-{os.getpid()}", room_bytes, device)
        conn.send((raw.agent.get_agent_metadata(), raw.buf.data_ptr(), raw.dev, raw.mem, room_bytes))
        raw.agent.add_remote_agent(conn.recv())
        conn.send("loaded")
        raw_wait_notifs(raw, 1)  # the warm-up WRITE
    cfg = _config(args, "decode", rank, port)
    bootstrap = f"tcp://127.0.0.1:{port}"
    async with TransferEngine(cfg, pool) as engine:
        deadline = time.monotonic() + 120
        while True:  # handshake before the clock starts; the prefill engines may still be starting
            try:
                await engine.connect(bootstrap)
                break
            except PeerUnreachableError:
                if time.monotonic() > deadline:
                    raise
        sem = anyio.Semaphore(args.concurrency)
        slots = list(range(args.concurrency))
        room_lat: list[float] = []
        paths: set[str] = set()
        reasons: set[str] = set()  # why each room took its path (the decode's choice under auto)
        used: set[int] = {0}  # slot 0 also takes the small rooms

        async def one(room: int) -> None:
            async with sem:
                slot = slots.pop()
                used.add(slot)
                pages = _room_pages(args, slot, "decode")
                t1 = time.perf_counter()
                receiver = await engine.receiver(room, bootstrap, pages)
                paths.add(receiver._actor.path)  # type: ignore[attr-defined]
                reasons.add(getattr(receiver._actor, "path_reason", ""))
                await receiver.wait()
                room_lat.append(time.perf_counter() - t1)
                slots.append(slot)

        async def rooms(ids: Any) -> float:
            t0 = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for room in ids:
                    tg.start_soon(one, room)
            return time.perf_counter() - t0

        await rooms(range(WARMUP_ROOM, WARMUP_ROOM + args.warmup))  # off the clock
        if args.gc_freeze:
            gc.freeze()
        pauses = GcPauses().start()
        cpu = CpuSpent(profile=args.profile == "decode" and rank == 0)
        room_lat.clear()
        engine_s = 0.0
        raw_rounds: list[float] = []
        ratios: list[float] = []
        round_lat: list[list[float]] = []  # the latencies of each round's rooms
        for rnd in range(args.rounds):
            ids = _round_rooms(args, rnd)
            _ab(args, engine, rnd)
            await anyio.to_thread.run_sync(barrier.wait)
            if raw is not None and conn is not None:
                raw_wait_notifs(raw, args.raw_reps)  # progress here: UCX may need the target's calls
                raw_gbps = conn.recv()
                raw_rounds.append(raw_gbps)
            await anyio.to_thread.run_sync(barrier.wait)
            first = len(room_lat)
            with cpu:
                elapsed = await rooms(ids)
            round_lat.append(room_lat[first:])
            engine_s += elapsed
            if raw_rounds:
                ratios.append(room_bytes * len(ids) / elapsed / 1e9 / raw_rounds[-1])
        cpu.print_profile("decode", args.rooms)
        lat: list[float] = []
        raw_lat: list[float] = []
        windows: list[tuple[int, int, int]] = []  # (room, start, end): each small room's monotonic_ns
        for i in range(args.lat_rooms):
            if raw is not None and conn is not None:
                t1 = time.perf_counter()
                conn.send("go")
                raw_wait_notifs(raw, 1)
                raw_lat.append(time.perf_counter() - t1)
                while not conn.poll():  # "ready": the prefill has sent this sample's room
                    raw.agent.get_new_notifs()  # keep the raw agent progressing meanwhile
                conn.recv()
            _ab(args, engine, i)
            t1, started = time.perf_counter(), time.monotonic_ns()
            receiver = await engine.receiver(SMALL_ROOM + i, bootstrap, _room_pages(args, 0, "decode")[:1])
            await receiver.wait()
            lat.append(time.perf_counter() - t1)
            windows.append((SMALL_ROOM + i, started, time.monotonic_ns()))
        result.update(
            room_bytes=room_bytes,
            engine_gbps=room_bytes * args.rooms / engine_s / 1e9,
            rooms_per_s=args.rooms / engine_s,
            room_p50_ms=statistics.median(room_lat) * 1e3,
            room_p99_ms=_p(room_lat, 0.99) * 1e3,
            engine_lat_p50_ms=statistics.median(lat) * 1e3,
            engine_lat_p99_ms=_p(lat, 0.99) * 1e3,
            engine_path=",".join(sorted(paths)),
            engine_path_reasons=sorted(reasons),
        )
        if conn is not None:
            result.update(
                raw_gbps=statistics.median(raw_rounds),
                round_ratios=[round(r, 3) for r in ratios],
                throughput_ratio=statistics.median(ratios),
                raw_lat_p50_ms=statistics.median(raw_lat) * 1e3,
                added_latency_p50_ms=statistics.median([e - r for e, r in zip(lat, raw_lat, strict=True)])
                * 1e3,
            )
            if args.ab != "none":  # even rounds and samples on, odd ones off
                added = [e - r for e, r in zip(lat, raw_lat, strict=True)]
                result["ab"] = {
                    half: {
                        "ratio": round(statistics.median(ratios[k::2]), 3) if ratios[k::2] else None,
                        "added_ms": round(statistics.median(added[k::2]) * 1e3, 3) if added[k::2] else None,
                        "small_p50_ms": round(statistics.median(lat[k::2]) * 1e3, 3) if lat[k::2] else None,
                        "room_p50_ms": _half_p50(round_lat[k::2]),
                        "rounds": [round(r, 3) for r in ratios[k::2]],
                    }
                    for k, half in ((0, "on"), (1, "off"))
                }
            pauses.stop()
            (
                posted,
                prefill_marks,
                post_ns,
                prefill_gc,
                round_writes,
                prefill_spans,
                prefill_cpu,
            ) = await anyio.to_thread.run_sync(conn.recv)
            result["cpu_ms_per_room"] = {"prefill": prefill_cpu, "decode": cpu.per_room(args.rooms)}
            if args.ab == "integrity":  # what decode rank 0 judged over the run, warm-up included
                result["integrity_counters"] = {
                    k: engine.counters[k]
                    for k in (
                        "integrity_match",
                        "integrity_mismatch",
                        "integrity_unchecked",
                        "failed_integrity",
                    )
                }
            if "ab" in result:  # WRITEs prefill rank 0 posted per room of each half (a cut room posts more)
                for k, half in ((0, "on"), (1, "off")):
                    rooms_of = sum(len(_round_rooms(args, r)) for r in range(k, args.rounds, 2))
                    result["ab"][half]["writes_per_room"] = (
                        round(sum(round_writes[k::2]) / rooms_of, 1) if rooms_of else None
                    )
            result["gc"] = {"prefill": prefill_gc, "decode": pauses.summary()}
            tail = tail_samples(
                windows, {"prefill": prefill_spans, "decode": pauses.spans}, max(2, args.lat_rooms // 50)
            )
            result["small_tail"] = tail
            result["post_us"] = {
                k: round(v / 1e3 / max(post_ns.get("writes", 1), 1), 1)
                for k, v in post_ns.items()
                if k != "writes"
            }
            if args.trace:
                marks = prefill_marks + engine.me.trace.take()
                result["trace_rooms"] = step_table(marks, set(range(args.rooms)))
                result["trace_small"] = step_table(marks, set(range(SMALL_ROOM, SMALL_ROOM + args.lat_rooms)))
                result["trace_tail"] = step_table(marks, {row["room"] for row in tail})
            # descriptors posted by prefill rank 0 per room of the rounds (and warm-up), and per small room
            result["descriptors_per_room"] = posted[0] / (args.warmup + args.rooms)
            result["descriptors_per_small_room"] = posted[1] / max(args.lat_rooms, 1)
            conn.send("bye")
    # verified after the engine is closed: a long check would stall its heartbeats
    bad = 0
    for slot in sorted(used):  # every room wrote the same pattern into its slot's pages
        bad += patterns.mismatches(
            pool, 0, _room_pages(args, slot, "decode"), pages_per_room * args.page_size
        )
    result["mismatches"] = bad
    if conn is not None:
        out.put(result)


class CpuSpent:
    """CPU time spent inside ``with`` blocks, summed: the process's (every thread: NIXL's, UCX's, the
    completion waiters') and the calling thread's (the engine's loop: the bench runs on it). With
    ``profile`` the loop's thread runs under cProfile inside the blocks (``--profile``)."""

    def __init__(self, profile: bool = False) -> None:
        self.process = self.loop = 0.0
        self._at = (0.0, 0.0)
        self.profile = cProfile.Profile() if profile else None

    def __enter__(self) -> None:
        self._at = (time.process_time(), time.thread_time())
        if self.profile is not None:
            self.profile.enable()

    def __exit__(self, *exc: object) -> None:
        if self.profile is not None:
            self.profile.disable()
        self.process += time.process_time() - self._at[0]
        self.loop += time.thread_time() - self._at[1]

    def per_room(self, rooms: int) -> dict[str, float]:
        """ms per room over ``rooms`` rooms."""
        n = max(rooms, 1)
        return {"process": round(self.process * 1e3 / n, 3), "loop": round(self.loop * 1e3 / n, 3)}

    def print_profile(self, side: str, rooms: int, top: int = 30) -> None:
        """The profiled functions with the most own time and time under them, us per room."""
        if self.profile is None:
            return
        stats = pstats.Stats(self.profile).stats  # type: ignore[attr-defined]
        for column, title in ((2, "own time"), (3, "time under")):
            rows = sorted(stats.items(), key=lambda kv: kv[1][column], reverse=True)[:top]
            print(f"{side} rank 0 loop under cProfile, top {top} by {title}, us per room (calls per room):")
            for (filename, line, name), values in rows:
                where = (
                    filename.split("transfer_engine/")[-1]
                    if "transfer_engine" in filename
                    else filename[-40:]
                )
                print(
                    f"  {values[column] * 1e6 / rooms:9.1f} ({values[1] / rooms:6.1f})  {where}:{line} {name}"
                )


def _half_p50(rounds: list[list[float]]) -> float | None:
    """Median room latency (ms) over the rooms of ``rounds``; None when they hold none."""
    values = [v for lat in rounds for v in lat]
    return round(statistics.median(values) * 1e3, 2) if values else None


def _ab(args: argparse.Namespace, engine: TransferEngine, index: int) -> None:
    """``--ab``: what the rooms opened next run with, on iff ``index`` is even (flipped between rounds
    and between small-room samples, on both sides: both halves run in the same processes).

    ``grant``: the decode ring grants chunk 0's region with the request (``EngineConfig.
    grant_with_request``). ``integrity``: the prefill's workers seal chunks with their checksums and
    the decode's rooms verify them (``EngineConfig.integrity``: off, no checksum is taken or compared).
    ``cut``: the prefill rooms write whole chunks as layer groups as the config says
    (``TE_STAGED_PIPELINE_LAYERS``, ``TE_HOST_PIPELINE_LAYERS``, ``TE_PIPELINE_MIN_BYTES``), against every
    chunk whole (docs/DECISIONS.md, "Staged-path chunks cut by the prefill room").
    """
    on = index % 2 == 0
    if args.ab == "grant" and engine.ring is not None:
        engine.ring.grant_ahead = on
    if args.ab == "integrity":
        checksums = engine.checksums if on else None
        for worker in engine.workers:
            worker.checksums = checksums
        if engine.room_ports is not None:
            engine.room_ports.checksums = checksums
    if args.ab == "cut" and engine.room_ports is not None:
        cfg = engine.config
        configured = {"host": cfg.host_pipeline_layers, "staged": cfg.staged_pipeline_layers}
        engine.room_ports.chunk_cut = ChunkCut(configured if on else {}, cfg.pipeline_min_bytes)


def _peer_copy_gbps(args: argparse.Namespace, nbytes: int) -> float | None:
    """A device copy of ``nbytes`` from prefill rank 0's GPU to decode rank 0's GPU (median of 10)."""
    if args.device != "cuda":
        return None
    src_dev, dst_dev = _device(args, "prefill", 0), _device(args, "decode", 0)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=src_dev)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_dev)
    times = []
    for _ in range(11):
        torch.cuda.synchronize(src_dev)
        torch.cuda.synchronize(dst_dev)
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(dst_dev)
        torch.cuda.synchronize(src_dev)
        times.append(time.perf_counter() - t0)
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / statistics.median(times[1:]) / 1e9


def add_page_table_arguments(parser: argparse.ArgumentParser) -> None:
    """``--page-table`` and ``--page-seed``: how each room's pages lie in the pools of both sides."""
    parser.add_argument(
        "--page-table",
        default="contiguous",
        choices=[s.value for s in pagetables.PageTableShape],
        help="how each room's pages lie in the pools (transfer_engine.testing.pagetables)",
    )
    parser.add_argument("--page-seed", type=int, default=0, help="seed of the page tables")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--path",
        default="direct",
        choices=["auto", "direct", "staged", "host", "slice", "kernel"],
        help="kernel: auto between the two processes of this host, where the kernel path is taken "
        '(docs/DECISIONS.md, "One kernel between the GPUs of a host"); the result line names the path rooms took',
    )
    parser.add_argument("--prefill-tp", type=int, default=1)
    parser.add_argument("--decode-tp", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=2)
    parser.add_argument("--rooms", type=int, default=24)
    add_page_table_arguments(parser)
    parser.add_argument(
        "--pool-layout",
        default="tensors",
        choices=["tensors", "page-major"],
        help="both sides' pools: one tensor per K and V of a layer (tensors), or one buffer where a page "
        "holds every layer's K and V (page-major: KVPool.allocate(page_major=True), a run of pages one "
        "descriptor)",
    )
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--raw-reps", type=int, default=4, help="raw WRITEs of one room's bytes per round")
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of (raw ceiling, then rooms): the ratio is their median"
    )
    parser.add_argument(
        "--warmup", type=int, default=-1, help="untimed rooms first (default -1: as many as --concurrency)"
    )
    parser.add_argument(
        "--heartbeat-interval", type=float, default=1.0, help="engine lease (slice posts can stall the loop)"
    )
    parser.add_argument("--lat-rooms", type=int, default=50)
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prefill and decode processes on disjoint CPU halves (default: on for --device cpu)",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--gc-freeze",
        action="store_true",
        help="gc.freeze() in every process once its engine has started and run the warm-up rooms",
    )
    parser.add_argument(
        "--profile",
        choices=["none", "prefill", "decode"],
        default="none",
        help="run that side's rank 0 loop under cProfile over the rounds and print where its time goes "
        "(per room); its CPU figures then include the profiler's cost",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="mark every room's steps (EngineConfig.trace_steps) and print, per step, the median time "
        "from the decode's receiver(): for the rooms of the rounds and for the small rooms",
    )
    parser.add_argument(
        "--ab",
        default="none",
        choices=["none", "grant", "integrity", "cut"],
        help="even rounds and small-room samples with this on, odd ones with it off; prints both halves "
        "(use an even --rounds). grant: chunk 0's ring region granted with the request (staged paths); "
        "integrity: chunks checksummed and verified (docs/INTEGRITY.md; the engines start with it on, "
        "whatever TE_INTEGRITY says); cut: whole chunks written as layer "
        "groups as TE_STAGED_PIPELINE_LAYERS / TE_HOST_PIPELINE_LAYERS say, against whole",
    )
    args = parser.parse_args()
    if args.warmup < 0:
        args.warmup = args.concurrency
    args.rounds = max(1, min(args.rounds, args.rooms))
    if args.pin is None:
        args.pin = args.device == "cpu" and len(os.sched_getaffinity(0)) >= 2
    port = free_port()
    layout = _layout(args)
    room_bytes = (
        math.ceil(args.tokens / args.page_size) * args.page_size * layout.heads_local(args.decode_tp)
        * args.decode_tp * args.head_dim * 2 * layout.num_kv_tensors
    )  # fmt: skip
    peer_copy = _peer_copy_gbps(args, room_bytes)
    ctx = mp.get_context("spawn")
    procs = []
    p_conn, d_conn = ctx.Pipe()  # rank 0 of each side coordinate the raw phases through it
    barrier = ctx.Barrier(args.prefill_tp + args.decode_tp)  # every rank, at each round's start
    out = ctx.Queue()
    for rank in range(args.prefill_tp):
        procs.append(
            ctx.Process(target=prefill_main, args=(args, rank, port, p_conn if rank == 0 else None, barrier))
        )
    for rank in range(args.decode_tp):
        procs.append(
            ctx.Process(
                target=decode_main, args=(args, rank, port, d_conn if rank == 0 else None, barrier, out)
            )
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
    placement = ""
    if args.device == "cuda":
        gpus = [str(_device(args, "prefill", i).index) for i in range(args.prefill_tp)]
        dgpus = [str(_device(args, "decode", i).index) for i in range(args.decode_tp)]
        shared = len(set(gpus) | set(dgpus)) < len(gpus) + len(dgpus)
        placement = f" gpus prefill={','.join(gpus)} decode={','.join(dgpus)}{' (shared)' if shared else ''}"
    if args.pin:
        pre, dec = _cpu_halves()
        placement += f" cpus prefill={pre[0]}-{pre[-1]} decode={dec[0]}-{dec[-1]}"
    r.update(path=args.path, page_table=args.page_table, gc_freeze=args.gc_freeze, P=args.prefill_tp, D=args.decode_tp, tokens=args.tokens, rooms=args.rooms,
             concurrency=args.concurrency, chunks=args.chunks, device=args.device, peer_copy_gbps=peer_copy,
             placement=placement.strip(), loadavg=[round(x, 1) for x in os.getloadavg()],
             grant_with_request=_config(args, "decode", 0, 0).grant_with_request)  # fmt: skip
    if args.json:
        print(json.dumps(r))
    copy = (
        ""
        if peer_copy is None
        else f", device copy {peer_copy:.1f} GB/s (ratio {r['engine_gbps'] / peer_copy:.2f})"
    )
    print(
        f"path={args.path}({r['engine_path']}) page_table={args.page_table} pool={args.pool_layout} P={args.prefill_tp} D={args.decode_tp} {args.device}{placement} "
        f"room={r['room_bytes'] / 1e6:.1f} MB x{args.rooms} conc={args.concurrency} chunks={args.chunks}: "
        f"engine {r['engine_gbps']:.2f} GB/s, raw NIXL {r['raw_gbps']:.2f} GB/s, ratio "
        f"{r['throughput_ratio']:.2f} (rounds {r['round_ratios']}){copy}; {r['rooms_per_s']:.0f} rooms/s; room p50 {r['room_p50_ms']:.2f} ms p99 {r['room_p99_ms']:.2f} ms; "
        f"descriptors/room {r['descriptors_per_room']:.0f} (small room {r['descriptors_per_small_room']:.0f}); small room p50 {r['engine_lat_p50_ms']:.3f} ms "
        f"(p99 {r['engine_lat_p99_ms']:.3f}) vs raw {r['raw_lat_p50_ms']:.3f} ms: added (median of pairs) "
        f"{r['added_latency_p50_ms']:.3f} ms; mismatches {r['mismatches']}; "
        f"grant_with_request={r['grant_with_request']}; load average {r['loadavg']}"
    )
    print(
        "  CPU per room of the rounds, ms (the process's, of which the engine loop's thread): "
        + "; ".join(
            f"{side} {got['process']:.3f} ({got['loop']:.3f})" for side, got in r["cpu_ms_per_room"].items()
        )
    )
    print(
        f"  gc over the timed phases (page_table={args.page_table}, gc_freeze={args.gc_freeze}): "
        f"{gc_line('prefill', r['gc']['prefill'])}; {gc_line('decode', r['gc']['decode'])}"
    )
    if "ab" in r:
        for half, got in r["ab"].items():
            print(
                f"  --ab {args.ab} {half:3s}: ratio {got['ratio']} (median of its rounds {got['rounds']}), room "
                f"p50 {got['room_p50_ms']} ms, WRITEs/room {got['writes_per_room']}, small room "
                f"p50 {got['small_p50_ms']} ms, added {got['added_ms']} ms (median of its pairs)"
            )
    if "integrity_counters" in r:
        print(f"  --ab integrity: decode rank 0's checks {r['integrity_counters']}")
    if r.get("small_tail"):
        print(
            "  small-room tail, the slowest samples (ms; CPython collections inside each, ms, full ones): "
            + "; ".join(
                f"{row['ms']:.2f} (gc prefill {row['gc_prefill_ms']:.1f}/{row['gc_prefill_full']}, "
                f"decode {row['gc_decode_ms']:.1f}/{row['gc_decode_full']})"
                for row in r["small_tail"]
            )
        )
    if args.trace:
        print(f"prefill rank 0, post_write per WRITE (us): {r['post_us']}")
    for key, what in (
        ("trace_rooms", "rooms of the rounds"),
        ("trace_small", "small rooms"),
        ("trace_tail", "slowest small rooms"),
    ):
        if key in r:
            print(
                f"steps of the {what}: ms from the decode's receiver(), median (first mark / last mark, rooms)"
            )
            for step, first, last, n in r[key]:
                print(f"  {step:28s} {first:9.3f} {last:9.3f} {n:5d}")
    ok = r["mismatches"] == 0 and all(p.exitcode == 0 for p in procs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
