"""Layer-wise sending against chunk-level sending: the transfer tail and the forward time, one run.

    python tools/bench_layerwise.py --device cuda [--path direct|host|staged|slice]
                                    [--tokens 1024,4096,16384] [--per-write 1,4] [--reps 3]
                                    [--page-table contiguous|scattered|realistic]
    python tools/bench_layerwise.py --device cpu --kv-heads 2 --tokens 1024 --hidden 256 --ffn 1024
    python tools/bench_layerwise.py --tiny      # CPU, tiny sizes: checks that it runs

Two processes (prefill, decode; with ``--device cuda`` GPU 0 and GPU 1, or both on GPU 0 when there
is one), each a blocking-facade engine (``transfer_engine.facade``) as a threaded scheduler uses it,
on a Qwen3-32B-shaped KV layout by default (64 layers, 8 KV heads, head_dim 128, bf16, pages of 16
tokens), each room's pages in a page table of ``--page-table``'s shape
(``transfer_engine.testing.pagetables``; the prefill's and the decode's from unrelated allocators,
the pools at least 8 rooms large for ``scattered`` and ``realistic``). Per room the prefill runs a
simulated forward on a thread of its own (on CUDA, on a stream of its own), so the engine's loop
thread runs beside it as in a real server: per layer one
``[tokens, hidden] @ [hidden, ffn]`` matmul (about the FLOPs of a 32B model's layer at the defaults),
then

- ``chunk``: after the last layer, ``send(pages, last=True)`` from the forward's thread (an event on
  its stream orders the WRITE after the forward);
- ``layers xN``: ``begin_chunk(pages)`` before the forward, ``layers_ready(l, l + 1)`` after each
  layer's matmul is enqueued (``layers_per_write`` = N groups them).

Measured per room (medians over ``--reps`` rooms, after one warm-up room per mode), on the one
host's monotonic clock:

- ``done``: when the last layer's work completed, not when Python got to it. On CUDA an anchor event
  is recorded on the forward's stream while it is idle, with the host clock read on both sides of its
  completion (retried until they are within 50 us); the last layer completed at the anchor plus the
  GPU's elapsed time between the anchor and an event recorded after the last layer. On CPU, the
  forward thread's clock right after the last matmul returned;
- ``landed``: the decode room's step mark ``SUCCESS`` (``EngineConfig.trace_steps``): its loop saw
  every byte in place (on the staged and host paths: scattered into the KV pool);
- ``tail`` = landed - done, split into ``react`` (done -> the prefill's worker posted the room's
  last WRITE, step mark ``posted``) and ``last WRITE`` (posted -> landed);
- ``wake`` (layer-wise): done -> the worker's loop learnt that the last group's layers completed
  (step mark ``reached``, set by the completion waiter's wake-up): the part of ``react`` spent
  observing the GPU. ``started``: done -> the worker started the last group's job (mark
  ``started``); ``react`` - ``started`` is the NIXL post. Both are nan when the group's job reached
  the worker after its layers had completed (nothing was waited for). With ``early_start`` (the
  default) the completion waiter's thread starts the WRITE itself and marks ``started`` and
  ``posted``; ``wake`` then comes after them (the loop hears of the layers once the thread has
  started the WRITE and, with ``early_drive``, seen it end);
- ``last WRITE`` split, from ``posted``: ``seen``, the prefill got the last WRITE's end from its
  poller (its room's ``room:WriteEnded``; staged and host: the worker's ``write_ended``); ``notif``, the decode's poller drained the room's last
  notification (``notif``); ``applied`` = landed - that notification: the decode's actors;
- ``forward``: forward start -> done; layer-wise sending must not slow it. With ``--launch-us`` the
  forward's thread also runs that much Python before each layer, as a model's kernel launches do,
  and the engine's threads then compete with it for the GIL (a GPU-bound forward hides that).
  ``fwd/chunk`` is the median,
  over reps, of a layer-wise room's forward over the chunk-level room's of the same rep (``chunk``
  sends nothing during its forward). The modes are interleaved: each rep runs every mode once, in
  turn, in reverse order on odd reps, so a drift of the machine (clocks, heat) falls on all alike;
- ``peer copy`` (CUDA): the yardstick for ``fwd/chunk``: no engine, and after each layer's matmul its K
  and V bytes of the room copied by torch to the decode's GPU on a stream of their own. Its
  ``fwd/chunk`` is what moving those bytes during the forward costs it with nothing else around (the
  copies share the GPU's power and memory with the matmuls); layer-wise sending adds to the forward
  only what its ``fwd/chunk`` reads above this one;
- ``group``: a raw NIXL WRITE of one layer group's bytes between the same two processes, laid out
  as the engine's (:class:`RawGroup`), from ``transfer()`` to the decode draining its notification
  (median of at least 5); ``over`` = tail - group. The issue's goal: ``over <= 0.3 ms``. (On CPU
  UCX copies inside ``transfer()``, so there ``react`` holds most of a WRITE.)

``--steps`` also prints each step of every layer-wise room's last group, in ms after its layers
completed: the group before's ``driven`` (when the waiter's thread stopped looking at that WRITE),
then the prefill's (``reached``, ``woken`` — the waiter's thread back from the group's event —,
``started``, ``locked`` and ``transferred`` — when the waiter's
thread held the transport's lock and when ``transfer()`` had returned —, ``transfer_cpu`` — ``locked``
plus the CPU time the thread spent inside ``transfer()``: the rest of the call it waited —, ``posted``,
``driven``, ``room:WriteEnded``) and the decode's (``d.notif``, ``d.SUCCESS``).

The heartbeat interval is 5 s here (lease 10 s): a stalled loop shows as a long tail, not as a dead
peer. KV contents are not checked (the tests check every byte: tests/integration/test_matrix.py).
The serving example's TTFT with and without ``--layerwise`` is ``tools/serving_bench.py`` (see
``tools/gpu_e2e.sh layerwise-serving`` and docs/PERF.md).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import math
import multiprocessing as mp
import pstats
import statistics
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from multiprocessing.connection import Connection

import numpy as np
import torch

from transfer_engine.config import EngineConfig
from transfer_engine.facade import BlockingEngine
from transfer_engine.memory.layout import KVLayout, KVPool
from transfer_engine.protocol.rooms import RoomStatus
from transfer_engine.testing import pagetables
from transfer_engine.testing.cluster import free_port

# tools/ is the script's folder, first on sys.path (also in the spawned children)
from bench_transfer import (  # isort: skip
    GcPauses,
    RawPair,
    add_page_table_arguments,
    gc_line,
    raw_transfer,
    raw_wait_notifs,
)

TRACE = 1 << 16
ANCHOR_WITHIN_S = 50e-6


def _layout(args: argparse.Namespace) -> KVLayout:
    return KVLayout(args.layers, args.kv_heads, args.head_dim, torch.bfloat16, args.page_size)


def _pool(args: argparse.Namespace, device: torch.device) -> KVPool:
    pages = pagetables.pool_pages(args.page_table, -(-max(args.tokens) // args.page_size), 1)
    return KVPool.allocate(_layout(args), 1, 0, pages, device=device, aux_slots=1, aux_item_bytes=8)


def _pages(args: argparse.Namespace, tokens: int, side: str) -> np.ndarray:
    """The page table of a room of ``tokens`` on ``side`` (one room in flight: the same every rep)."""
    count = -(-tokens // args.page_size)
    seed = pagetables.side_seed(args.page_seed, side)
    return pagetables.room_tables(args.page_table, count, 1, seed=seed)[0]


def _config(args: argparse.Namespace, role: str, port: int, per_write: int = 4) -> EngineConfig:
    """The benchmark's settings over ``TE_*`` variables (``TE_POLL_SPIN=0.002`` for an A/B run)."""
    return EngineConfig.from_env(
        role=role, bootstrap_port=port, path=args.path, layers_per_write=per_write,
        staging_chunk_pages=-(-max(args.tokens) // args.page_size), transfer_timeout=120.0,
        heartbeat_interval=5.0, trace_steps=TRACE, nixl_params=dict(args.nixl_param) or None,
    )  # fmt: skip


def _mark(marks: list[tuple[int, int, str]], room: int, step: str) -> float:
    """The time (s) of ``room``'s last ``step`` mark; RuntimeError naming them when there is none."""
    times = [ns for ns, r, s in marks if r == room and s == step]
    if not times:
        raise RuntimeError(
            f"room {room}: no {step!r} mark among {sorted({s for _, r, s in marks if r == room})}"
        )
    return max(times) / 1e9


class RawGroup(RawPair):
    """The raw agent and buffer of ``tools/bench_transfer.py`` (one per process), as the yardstick
    for a layer group.

    The prefill writes a group's bytes as the engine's WRITE of it lies: on the direct and slice
    paths one descriptor per KV tensor of the group (2 x layers_per_write, gapped as separate
    tensors are), on the staged and host paths one descriptor (its gathered region; host: pinned
    DRAM). Timed from the prefill's ``transfer()`` to the decode draining the notification, on the
    machine's monotonic clock: what the group's own transfer takes with no engine around it.
    """

    def __init__(self, args: argparse.Namespace, device: torch.device, name: str) -> None:
        host = args.path == "host" or device.type == "cpu"
        self.gapped = args.path not in ("staged", "host")
        desc = max(args.tokens) * args.kv_heads * args.head_dim * 2
        size = 2 * max(args.per_write) * desc * 2  # every descriptor followed by a gap of its size
        cpu = torch.device("cpu")
        super().__init__(name, size, cpu if host else device, pinned=host and device.type == "cuda")

    def layout(self, count: int, nbytes: int, base: int, dev: int) -> np.ndarray:
        """``count`` descriptors of ``nbytes`` (gapped) or one of their sum, from ``base`` on ``dev``."""
        if not self.gapped:
            return np.array([[base, count * nbytes, dev]], dtype=np.uint64)
        return np.array([[base + 2 * i * nbytes, nbytes, dev] for i in range(count)], dtype=np.uint64)


def _raw_target(raw: RawGroup, pipe: Connection) -> None:
    """Decode side of :func:`_raw_group`: per sample, say armed, poll until a notification came."""
    pipe.send((raw.agent.get_agent_metadata(), raw.buf.data_ptr(), raw.dev))
    while (msg := pipe.recv()) != "end":
        assert msg == "arm", msg
        pipe.send("armed")
        raw_wait_notifs(raw, 1)
        pipe.send(time.monotonic())


def _raw_group(
    raw: RawGroup, pipe: Connection, tokens: int, per_write: int, reps: int, args: argparse.Namespace
) -> float:
    """Median ms of a raw WRITE of one group of ``per_write`` layers of ``tokens``: ``transfer()`` ->
    the decode drained its notification (the first sample, which connects, is dropped)."""
    pipe.send(("raw", tokens, per_write))
    metadata, addr, remote_dev = pipe.recv()
    peer = raw.agent.add_remote_agent(metadata)
    nbytes = tokens * args.kv_heads * args.head_dim * 2
    count = 2 * per_write
    src = raw.layout(count, nbytes, raw.buf.data_ptr(), raw.dev)
    dst = raw.layout(count, nbytes, addr, remote_dev)
    local = raw.agent.prep_xfer_dlist("NIXL_INIT_AGENT", raw.agent.get_xfer_descs(src, raw.mem))
    remote = raw.agent.prep_xfer_dlist(peer, raw.agent.get_xfer_descs(dst, raw.mem))
    indices = list(range(len(src)))
    times = []
    for _ in range(reps + 1):
        handle = raw.agent.make_prepped_xfer("WRITE", local, indices, remote, indices, b"raw")
        pipe.send("arm")
        assert pipe.recv() == "armed"
        time.sleep(0.001)  # the decode is polling
        posted = time.monotonic()
        raw_transfer(raw, handle)
        times.append(pipe.recv() - posted)
        raw.agent.release_xfer_handle(handle)
    pipe.send("end")
    raw.agent.release_dlist_handle(local)
    raw.agent.release_dlist_handle(remote)
    raw.agent.remove_remote_agent(peer)
    return statistics.median(times[1:]) * 1e3


def decode_main(args: argparse.Namespace, port: int, pipe: Connection) -> None:
    device = (
        torch.device("cuda", 1 % torch.cuda.device_count()) if args.device == "cuda" else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    pool = _pool(args, device)
    raw: RawGroup | None = None
    with BlockingEngine(_config(args, "decode", port), pool) as engine:
        if args.gc_freeze:
            gc.freeze()
        pauses = GcPauses().start()
        while True:
            job = pipe.recv()
            if job is None:
                pauses.stop()
                print(f"gc, whole run (gc_freeze={args.gc_freeze}): {gc_line('decode', pauses.summary())}")
                return
            if job[0] == "raw":
                raw = raw or RawGroup(args, device, "raw-decode")
                _raw_target(raw, pipe)
                continue
            room, tokens = job
            pages = _pages(args, tokens, "decode")
            receiver = engine.receiver(room, f"tcp://127.0.0.1:{port}", pages)
            receiver.wait(120)
            marks = engine.take_trace()
            # a NIXL notification is marked by the poller; the copy kernel's ChunkLanded comes over control
            seen = "d.notif" if any(r == room and s == "d.notif" for _, r, s in marks) else "d.in:ChunkLanded"
            pipe.send((_mark(marks, room, "d.SUCCESS"), _mark(marks, room, seen)))


def _anchor(stream: torch.cuda.Stream) -> tuple[torch.cuda.Event, float]:
    """An event completed on the idle ``stream`` and the host time it completed (within 25 us)."""
    stream.synchronize()
    for _ in range(1000):
        event = torch.cuda.Event(enable_timing=True)
        before = time.monotonic()
        event.record(stream)
        event.synchronize()
        after = time.monotonic()
        if after - before < ANCHOR_WITHIN_S:
            return event, (before + after) / 2
    raise RuntimeError(f"no event on an idle stream completed within {ANCHOR_WITHIN_S * 1e6:.0f} us")


def _python_for(seconds: float) -> None:
    """Run Python for ``seconds`` holding the GIL, as a model's per-layer kernel launches do (``--launch-us``)."""
    if seconds <= 0:
        return
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


class Forward:
    """The simulated forward: one matmul per layer on its own thread (and CUDA stream), each after
    ``--launch-us`` of Python (a real model's launch work; 0 by default)."""

    def __init__(self, args: argparse.Namespace, device: torch.device, tokens: int) -> None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.layers = args.layers
        self.launch_s = args.launch_us / 1e6
        self.weight = torch.randn(args.hidden, args.ffn, device=device, dtype=dtype)
        self.x = torch.randn(tokens, args.hidden, device=device, dtype=dtype)
        self.out = torch.empty(tokens, args.ffn, device=device, dtype=dtype)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.torch_threads = args.torch_threads
        self.thread_cpu = 0.0
        """The CPU time of the forward's thread in its latest :meth:`run`, s."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def run(self, on_layer: Callable[[int], None], after: Callable[[], None]) -> tuple[float, float]:
        """Run it on a new thread: ``on_layer(l)`` after each layer is enqueued, ``after()`` after the
        last; returns (start, done), ``done`` when the last layer's work completed (module docstring)."""
        result: list[tuple[float, float]] = []
        failed: list[BaseException] = []

        def body() -> None:
            if self.stream is None:  # a thread's own setting: a new one would use every core, and
                torch.set_num_threads(self.torch_threads)  # OpenMP's idle workers spin on them
            cpu = time.thread_time()
            try:
                result.append(
                    self._cuda(on_layer, after) if self.stream is not None else self._cpu(on_layer, after)
                )
            except BaseException as exc:
                failed.append(exc)
            self.thread_cpu = time.thread_time() - cpu

        thread = threading.Thread(target=body, name="forward")
        thread.start()
        thread.join()
        if failed:
            raise failed[0]
        return result[0]

    def _cuda(self, on_layer: Callable[[int], None], after: Callable[[], None]) -> tuple[float, float]:
        assert self.stream is not None
        with torch.cuda.stream(self.stream):
            anchor, start = _anchor(self.stream)
            for layer in range(self.layers):
                _python_for(self.launch_s)
                torch.matmul(self.x, self.weight, out=self.out)
                on_layer(layer)
            end = torch.cuda.Event(enable_timing=True)
            end.record(self.stream)
            after()
            end.synchronize()
        return start, start + anchor.elapsed_time(end) / 1e3

    def _cpu(self, on_layer: Callable[[int], None], after: Callable[[], None]) -> tuple[float, float]:
        start = done = time.monotonic()
        for layer in range(self.layers):
            _python_for(self.launch_s)
            torch.matmul(self.x, self.weight, out=self.out)
            if layer == self.layers - 1:
                done = time.monotonic()
            on_layer(layer)
        after()
        return start, done


def _until(handle: object, want: RoomStatus, limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s
    while (status := handle.poll()) is not want:  # type: ignore[attr-defined]
        if status is RoomStatus.FAILED or time.monotonic() > deadline:
            raise RuntimeError(f"room {handle.room}: {status.name} {handle.failure}")  # type: ignore[attr-defined]
        time.sleep(0.0005)  # sleeping, not spinning: the engine's loop thread needs the GIL


Row = tuple[int, str, int, float, float, float, float, float, float, float, float, float, float, float]
"""(tokens, mode, layers_per_write, tail, react, last WRITE, forward, wake, started, seen, notif, applied,
group, fwd/chunk), medians in ms; group: the raw WRITE of one layer group (:func:`_raw_group`), NaN for
chunk; fwd/chunk: the median over reps of this mode's forward over the chunk-level room's of the same rep
(1.0 for chunk)."""

Sample = tuple[float, ...]
"""One room: (tail, react, last WRITE, forward, wake, started, seen, notif, applied), in s."""


def prefill_main(args: argparse.Namespace, port: int, pipe: Connection, out: Connection) -> None:
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(args.torch_threads)
    pool = _pool(args, device)
    modes = [("chunk", 0)] + [("layers", n) for n in args.per_write]
    if device.type == "cuda":
        modes.append(("peer", 1))
    rows: list[Row] = []
    room = 1
    posts: list[str] = []
    profile = cProfile.Profile() if args.profile else None
    profiled = 0
    raw: RawGroup | None = None
    last_steps: dict[tuple[int, int], list[dict[str, float]]] = defaultdict(list)
    engine_cpu: dict[tuple[int, str, int], list[tuple[float, int]]] = defaultdict(list)
    with BlockingEngine(_config(args, "prefill", port), pool) as engine:
        if args.gc_freeze:
            gc.freeze()
        pauses = GcPauses().start()

        def one_room(forward: Forward, tokens: int, mode: str, per_write: int, measured: bool) -> Sample:
            nonlocal room, profiled
            if mode == "peer":
                return _peer_room(forward, pool, tokens)
            pages = _pages(args, tokens, "prefill")
            sender = engine.sender(room, layers_per_write=max(per_write, 1))
            pipe.send((room, tokens))
            _until(sender, RoomStatus.WAITING_FOR_INPUT)
            profiling = profile is not None and mode != "chunk" and measured
            polls = _polls(engine)
            cpu = time.process_time()
            if mode == "chunk":
                start, done = forward.run(lambda layer: None, lambda: sender.send(pages, last=True))
            else:
                if profiling:  # on the loop's thread: it profiles that thread
                    engine._call(profile.enable)  # type: ignore[union-attr]
                    profiled += 1
                sender.begin_chunk(pages, last=True)
                start, done = forward.run(lambda layer: sender.layers_ready(layer, layer + 1), lambda: None)
            try:
                sender.wait(args.room_timeout)
            except TimeoutError:
                print(f"room {room} did not end: {_stuck(engine)}", file=sys.stderr, flush=True)
                raise
            if measured:  # the process's CPU time over the room, but the forward's own thread
                cpu = time.process_time() - cpu - forward.thread_cpu
                engine_cpu[(tokens, mode, per_write)].append((cpu, _polls(engine) - polls))
            if profiling:
                engine._call(profile.disable)  # type: ignore[union-attr]
            landed, notified = pipe.recv()
            marks = engine.take_trace()
            posted = _mark(marks, room, "p.posted")
            # the poller's reply goes to the room (direct, slice) or to the worker (staged, host); the copy
            # kernel's worker answers the room itself (WriteDone) once its copy completed
            steps_of = {s for _, r, s in marks if r == room}
            ended = next(
                (s for s in ("p.write_ended", "p.room:WriteEnded") if s in steps_of), "p.room:WriteDone"
            )
            seen = _mark(marks, room, ended)
            # the last group's steps at the worker (layer-wise): its loop learnt that the layers completed
            # (reached; absent when the job came after they had), the job was started: s after done,
            # NaN when absent
            steps = [
                max((ns / 1e9 for ns, r, s in marks if r == room and s == f"p.{step}"), default=0.0)
                for step in ("reached", "started")
            ]
            if args.steps and mode == "layers" and measured:
                last_steps[(tokens, per_write)].append(_last_group_steps(marks, room, done, notified, landed))
            room += 1
            after = [t - done if t > done else math.nan for t in steps]
            split = (seen - posted, notified - posted, landed - notified)
            return (landed - done, posted - done, landed - posted, done - start, *after, *split)

        for tokens in args.tokens:
            forward = Forward(args, device, tokens)
            samples: dict[tuple[str, int], list[Sample]] = {m: [] for m in modes}
            spent: dict[tuple[str, int], Counter[str]] = {m: Counter() for m in modes}
            # Interleaved: each rep runs every mode once, in turn, reversed on odd reps, so a drift of
            # the machine over the run (clocks, heat) falls on every mode alike. Rep 0 warms them up.
            for rep in range(args.reps + 1):
                for mode, per_write in modes if rep % 2 == 0 else modes[::-1]:
                    before = _post_ns(engine)
                    sample = one_room(forward, tokens, mode, per_write, rep > 0)
                    spent[(mode, per_write)] += _post_ns(engine) - before
                    if rep:
                        samples[(mode, per_write)].append(sample)
            chunk_fwd = [s[3] for s in samples[("chunk", 0)]]
            for mode, per_write in modes:
                got = samples[(mode, per_write)]
                medians = [statistics.median(s[i] for s in got) * 1e3 for i in range(9)]
                fwd_ratio = statistics.median(s[3] / c for s, c in zip(got, chunk_fwd, strict=True))
                group = math.nan
                if mode == "layers":
                    raw = raw or RawGroup(args, device, "raw-prefill")
                    group = _raw_group(raw, pipe, tokens, per_write, max(args.reps, 5), args)
                rows.append((tokens, mode, per_write, *medians, group, fwd_ratio))
                used = spent[(mode, per_write)]
                writes = max(used.pop("writes", 0), 1)
                if mode == "peer":  # no engine
                    continue
                posts.append(
                    f"{tokens} {mode} x{per_write}: {writes} WRITEs, us per WRITE "
                    + ", ".join(f"{k} {v / writes / 1e3:.1f}" for k, v in sorted(used.items()))
                )
        pipe.send(None)
        pauses.stop()
    print(f"gc, whole run (gc_freeze={args.gc_freeze}): {gc_line('prefill', pauses.summary())}", flush=True)
    print("prefill post_write, per mode (the transport's own clocks):", *posts, sep="\n  ", flush=True)
    _print_engine_cpu(engine_cpu, args.layers)
    if last_steps:
        _print_last_steps(last_steps)
    if profile is not None and profiled:
        _print_profile(profile, profiled, args.profile)
    out.send(rows)


LAST_STEPS = (
    "reached",
    "woken",
    "started",
    "locked",
    "transfer_cpu",
    "transferred",
    "posted",
    "driven",
    "room:WriteEnded",
)
"""The prefill's step marks of a layer-wise room's last group, in the order they come (``--steps``)."""


def _last_group_steps(
    marks: list[tuple[int, int, str]], room: int, done: float, notified: float, landed: float
) -> dict[str, float]:
    """The last layer group's steps of ``room``, in s after ``done``: each prefill step's latest mark
    (absent steps left out), then the decode's notification and SUCCESS."""
    out: dict[str, float] = {}
    for step in LAST_STEPS:
        latest = max((ns for ns, r, s in marks if r == room and s == f"p.{step}"), default=None)
        if latest is not None:
            out[step] = latest / 1e9 - done
    driven = sorted(ns for ns, r, s in marks if r == room and s == "p.driven")
    if len(driven) > 1:  # the group before the last: when the waiter's thread stopped looking at it
        out["driven before"] = driven[-2] / 1e9 - done
    out["d.notif"], out["d.SUCCESS"] = notified - done, landed - done
    return out


def _print_engine_cpu(engine_cpu: dict[tuple[int, str, int], list[tuple[float, int]]], layers: int) -> None:
    """Per room, medians over the rooms: the prefill's CPU time in all its threads but the forward's
    (the engine's, and what else the process runs while a room is out: nothing, in this benchmark),
    and its poller's looks, from the forward's start to the room's end."""
    print(
        "prefill per room, from the forward's start: CPU time of threads other than the forward's; poller looks"
    )
    for (tokens, mode, per_write), got in sorted(engine_cpu.items()):
        if mode == "peer":
            continue
        cpu = statistics.median(c for c, _ in got)
        polls = statistics.median(p for _, p in got)
        groups = -(-layers // per_write) if mode == "layers" else 1
        print(
            f"  {tokens} {mode} x{per_write}: CPU {cpu * 1e3:.2f} ms ({cpu / groups * 1e6:.0f} us per group); "
            f"looks {polls:.0f} ({polls / groups:.1f} per group)"
        )


def _print_last_steps(last_steps: dict[tuple[int, int], list[dict[str, float]]]) -> None:
    """``--steps``: per size and ``layers_per_write``, each step's median and range over the rooms,
    in ms after the last layer completed."""
    print("the last layer group's steps, ms after its layers completed: median [min, max] (rooms)")
    for (tokens, per_write), rooms in sorted(last_steps.items()):
        cells = []
        for step in ("driven before", *LAST_STEPS, "d.notif", "d.SUCCESS"):
            got = [r[step] * 1e3 for r in rooms if step in r]
            if got:
                cells.append(
                    f"{step} {statistics.median(got):.3f} [{min(got):.3f}, {max(got):.3f}] ({len(got)})"
                )
        print(f"  {tokens} x{per_write}: " + "; ".join(cells), flush=True)


def _peer_room(forward: Forward, pool: KVPool, tokens: int) -> Sample:
    """The yardstick for the forward (CUDA): no engine, each layer's K and V bytes of the room copied
    by torch to the decode's GPU (on one GPU: to another buffer on it) on a stream of their own, after
    that layer's matmul: what moving those bytes during the forward costs it, with nothing else around.
    Only ``forward`` is measured (the other fields are NaN)."""
    assert forward.stream is not None
    slots = -(-tokens // pool.layout.page_size) * pool.layout.page_size
    layers = pool.layout.num_layers
    target = torch.device("cuda", 1 % torch.cuda.device_count())
    side = torch.cuda.Stream(pool.device)
    dst = [torch.empty_like(pool.tensors[0][:slots], device=target) for _ in range(2)]

    def on_layer(layer: int) -> None:
        side.wait_stream(forward.stream)  # type: ignore[arg-type]
        with torch.cuda.stream(side):
            for i, tensor in enumerate((pool.tensors[layer], pool.tensors[layers + layer])):
                dst[i].copy_(tensor[:slots], non_blocking=True)

    start, done = forward.run(on_layer, lambda: None)
    side.synchronize()
    nan = math.nan
    return (nan, nan, nan, done - start, nan, nan, nan, nan, nan)


def _stuck(engine: BlockingEngine) -> str:
    """What a prefill engine holds when a room did not end: its leaks, each worker's held and made
    jobs, the poller's WRITEs in flight and their states."""
    inner = engine._engine
    poller = inner.poller
    assert poller is not None

    def look() -> str:
        workers = [(*w.held.stuck(), w.depth) for w in inner.workers]
        posted = [(p.handle, poller.transport.state(p.handle).name) for p in poller._posted]
        waiters = [dict(w.completions.counters) for w in inner.workers]
        return (
            f"leaks {inner.leaks()}; workers (held, made, failed starts, inbox) {workers}; "
            f"WRITEs in flight {posted}; waiters {waiters}; poller {dict(poller.counters)}"
        )

    return str(engine._call(look))


def _polls(engine: BlockingEngine) -> int:
    """The prefill poller's looks so far."""
    poller = engine._engine.poller
    assert poller is not None
    return int(engine._call(lambda: poller.counters["polls"]))


def _post_ns(engine: BlockingEngine) -> Counter[str]:
    """The prefill transport's post_write clocks so far (``NixlTransport.post_ns``)."""
    poller = engine._engine.poller
    assert poller is not None
    return Counter(engine._call(lambda: dict(getattr(poller.transport, "post_ns", {}))))


def _print_profile(profile: cProfile.Profile, rooms: int, top: int) -> None:
    """The prefill loop thread's functions with the most own time over the layer-wise rooms."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    print(f"-- prefill loop thread, layer-wise rooms ({rooms}): top {top} by own time, us per room (calls)")
    for (filename, line, name), (_cc, calls, own, _cum, _callers) in rows:
        where = filename.split("transfer_engine/")[-1] if "transfer_engine" in filename else filename[-40:]
        print(f"  {own / rooms * 1e6:9.1f}  ({calls / rooms:7.1f})  {where}:{line} {name}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--path", default="auto", help="engine path (direct, host, staged, slice; auto: direct)"
    )
    parser.add_argument("--tokens", default="1024,4096,16384", help="room sizes in tokens, comma-separated")
    parser.add_argument("--per-write", default="1,4", help="layers_per_write values, comma-separated")
    parser.add_argument("--reps", type=int, default=3, help="rooms per (size, mode), after one warm-up")
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    add_page_table_arguments(parser)
    parser.add_argument(
        "--hidden", type=int, default=5120, help="simulated layer: [tokens, hidden] @ [hidden, ffn]"
    )
    parser.add_argument(
        "--ffn", type=int, default=97280, help="(5120 x 97280 bf16: about a Qwen3-32B layer's weights)"
    )
    parser.add_argument(
        "--room-timeout", type=float, default=120.0, help="s a room may take before the run stops"
    )
    parser.add_argument("--torch-threads", type=int, default=1, help="CPU: the forward's torch threads")
    parser.add_argument(
        "--nixl-param",
        action="append",
        default=[],
        type=lambda kv: tuple(kv.split("=", 1)),
        metavar="K=V",
        help="a NIXL backend parameter for both engines (EngineConfig.nixl_params), e.g. num_threads=0",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="TOP",
        help="cProfile the prefill's loop thread over the layer-wise rooms; print the TOP functions",
    )
    parser.add_argument(
        "--launch-us",
        type=float,
        default=0.0,
        help="Python run by the forward's thread before each layer's matmul, in us (a model's launch "
        "work, holding the GIL): with more of it than the layer's GPU time the forward is CPU-bound",
    )
    parser.add_argument(
        "--steps",
        action="store_true",
        help="print the step marks of each layer-wise room's last group, ms after its layers completed",
    )
    parser.add_argument(
        "--gc-freeze", action="store_true", help="gc.freeze() in both processes once their engine has started"
    )
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny sizes (checks that the script runs)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.device, args.reps, args.layers, args.kv_heads, args.head_dim = "cpu", 2, 4, 2, 16
        args.hidden, args.ffn, args.tokens, args.per_write = 64, 128, "64,256", "1,2"
    args.tokens = [int(t) for t in str(args.tokens).split(",")]
    args.per_write = [int(n) for n in str(args.per_write).split(",")]
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        print("note: one GPU: prefill and decode share it", file=sys.stderr)
    ctx = mp.get_context("spawn")
    port = free_port()
    to_decode, decode_end = ctx.Pipe()
    results, results_end = ctx.Pipe(duplex=False)
    decode = ctx.Process(target=decode_main, args=(args, port, decode_end))
    prefill = ctx.Process(target=prefill_main, args=(args, port, to_decode, results_end))
    prefill.start()
    decode.start()
    for end in (to_decode, decode_end, results_end):  # the children hold them: a dead child is an EOF
        end.close()
    try:
        rows: list[Row] = results.recv()
    except EOFError:
        print("the prefill process died before it reported (its error is above)", file=sys.stderr)
        rows = []
    prefill.join(60)
    decode.join(60)
    layout = _layout(args)
    per_token = 2 * layout.num_layers * layout.num_heads * layout.head_dim * 2
    print(
        f"layer-wise vs chunk-level: {args.device}, path={args.path}, page_table={args.page_table}, "
        f"{args.layers} layers x {args.kv_heads} "
        f"KV heads x {args.head_dim}, bf16, {args.reps} rooms each (medians, ms)"
    )
    print(
        f"{'tokens':>7} {'MB':>8} {'mode':>10} {'tail':>8} {'react':>8} {'last WRITE':>10} "
        f"{'group':>7} {'over':>7} {'forward':>9} {'fwd/chunk':>9} {'wake':>7} {'started':>7} {'seen':>7} {'notif':>7} "
        f"{'applied':>7} {'pages':>10}"
    )
    for row in rows:
        tokens, mode, per_write = row[:3]
        tail, react, last_write, fwd, wake, started, seen, notif, applied, raw, fwd_ratio = row[3:]
        mb = tokens * per_token / 1e6
        if mode == "chunk":
            group, label, ratio = "", "chunk", ""
        elif mode == "peer":
            group, label, ratio = "", "peer copy", f"{fwd_ratio:9.3f}"
        else:
            group = f"{raw:7.3f} {tail - raw:7.3f}"
            label, ratio = f"layers x{per_write}", f"{fwd_ratio:9.3f}"
        print(
            f"{tokens:7d} {mb:8.1f} {label:>10} {tail:8.3f} {react:8.3f} {last_write:10.3f} {group:>15} "
            f"{fwd:9.2f} {ratio:>9} {'' if mode != 'layers' else f'{wake:7.3f} {started:7.3f}':>15} "
            f"{seen:7.3f} {notif:7.3f} {applied:7.3f} {args.page_table:>10}"
        )
    return 0 if prefill.exitcode == 0 and decode.exitcode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
