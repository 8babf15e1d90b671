"""What reporting a layer costs the forward: ``layers_ready`` per call, old code against new, one run.

    python tools/bench_layer_calls.py [--base main|none] [--device cpu|cuda] [--layers 64] [--per-write 0,1,4]
                                      [--rooms 20] [--work-us 200]

A prefill and a decode engine in one process (real NIXL, ZMQ), KV pool on ``--device``, one-page
rooms of ``--layers`` layers. Per room the forward opens the chunk (``begin_chunk``), then per layer
does ``--work-us`` of Python work holding the GIL (a GPU forward's thread mostly launches kernels)
and, on CUDA, one small kernel, then reports the layer: ``layers_ready(l, l + 1)`` without ``ready``
(on CUDA: the work queued on the caller's stream). Two ways of calling, as the two kinds of caller do:

- ``facade``: a ``BlockingEngine`` (the loop on its own thread); the forward is the main thread;
- ``async``: a ``TransferEngine`` in the forward's own loop (as ``examples/serving``): the forward
  awaits ``layers_ready`` and yields one checkpoint per layer.

Measured per mode: the call's time on the forward's thread (median, p90 and mean over every call),
the loop's wake-ups from other threads per chunk (``call_soon_threadsafe``, facade only), and the
forward's wall time per chunk against ``layers x work`` (what the engine's work on the forward's
thread, or its GIL, added). ``--per-write 0`` is the chunk-level baseline: the same forward with no
per-layer call and one ``send()`` after it (its "call" is that send). On CUDA the run also times the
CUDA calls a call without ``ready`` may make (the stream lookup, an event recorded).

Old against new: the same measurement runs in child processes whose ``PYTHONPATH`` is a detached
worktree of ``--base`` (made and removed here) or this tree, alternating ``--rounds`` times (old,
new, old, new...); each row shows, per code, the round with the lowest median call (the least
disturbed by other load on the machine). Compare the rows of one run only. Needs a git checkout; ``--base none`` measures
this tree only (a machine with a copy of the tree and no git, as the GPU machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _spin(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def _summary(calls_ns: list[int], forwards_s: list[float], args: argparse.Namespace) -> dict[str, float]:
    calls = sorted(c / 1e3 for c in calls_ns)
    return {
        "call_median_us": statistics.median(calls),
        "call_p90_us": calls[int(0.9 * (len(calls) - 1))],
        "call_mean_us": statistics.fmean(calls),
        "forward_ms": statistics.median(forwards_s) * 1e3,
        "forward_ideal_ms": args.layers * args.work_us / 1e3,
    }


def _layout(args: argparse.Namespace) -> Any:
    import torch

    from transfer_engine.memory.layout import KVLayout

    return KVLayout(args.layers, 2, 64, torch.bfloat16, 16)


def _kernel(device: Any) -> Any:
    """One small kernel on the current stream (CUDA), standing in for a layer's launches."""
    import torch

    if device.type != "cuda":
        return lambda: None
    x = torch.zeros(1024, device=device)
    return lambda: x.add_(1.0)


def child_facade(args: argparse.Namespace, per_write: int) -> dict[str, float]:
    import numpy as np
    import torch

    from transfer_engine.config import EngineConfig
    from transfer_engine.facade import BlockingEngine
    from transfer_engine.memory.layout import KVPool
    from transfer_engine.protocol.rooms import RoomStatus
    from transfer_engine.testing.cluster import free_port

    device = torch.device(args.device)
    port = free_port()

    def make(role: str) -> BlockingEngine:
        cfg = EngineConfig(role=role, bootstrap_port=port, num_workers=1, layers_per_write=max(per_write, 1))  # type: ignore[arg-type]
        return BlockingEngine(cfg, KVPool.allocate(_layout(args), 1, 0, 4, device=device))

    def until(handle: Any, want: RoomStatus) -> None:
        deadline = time.monotonic() + 30
        while (status := handle.poll()) is not want:
            if status is RoomStatus.FAILED or time.monotonic() > deadline:
                raise RuntimeError(f"room {handle.room}: {status.name} {handle.failure}")
            time.sleep(0.0005)

    calls: list[int] = []
    forwards: list[float] = []
    kernel = _kernel(device)
    with make("prefill") as prefill, make("decode") as decode:
        loop = prefill._loop
        wakeups = 0
        plain = loop.call_soon_threadsafe

        def counted(*a: Any, **k: Any) -> Any:
            nonlocal wakeups
            wakeups += 1
            return plain(*a, **k)

        for room in range(1, args.rooms + 2):
            receiver = decode.receiver(room, f"tcp://127.0.0.1:{port}", np.arange(1))
            sender = prefill.sender(room)
            until(sender, RoomStatus.WAITING_FOR_INPUT)
            if per_write:
                sender.begin_chunk(np.arange(1), last=True)
            loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
            timed: list[int] = []
            start = time.perf_counter()
            for layer in range(args.layers):
                _spin(args.work_us)
                kernel()
                if per_write:
                    t0 = time.perf_counter_ns()
                    sender.layers_ready(layer, layer + 1)
                    timed.append(time.perf_counter_ns() - t0)
            forward = time.perf_counter() - start
            if not per_write:  # chunk-level: one send() after the forward
                t0 = time.perf_counter_ns()
                sender.send(np.arange(1), last=True)
                timed.append(time.perf_counter_ns() - t0)
            loop.call_soon_threadsafe = plain  # type: ignore[method-assign]
            receiver.wait(30)
            sender.wait(30)
            if room > 1:  # the first room warms up
                calls += timed
                forwards.append(forward)
            else:
                wakeups = 0
        leaks = {**prefill.leaks(), **decode.leaks()}
    if any(leaks.values()):
        raise RuntimeError(f"leaked: {leaks}")
    out = _summary(calls, forwards, args)
    out["wakeups_per_chunk"] = wakeups / args.rooms
    return out


def child_async(args: argparse.Namespace, per_write: int) -> dict[str, float]:
    import anyio
    import anyio.lowlevel
    import numpy as np
    import torch

    from transfer_engine.config import EngineConfig
    from transfer_engine.engine import TransferEngine
    from transfer_engine.memory.layout import KVPool
    from transfer_engine.testing.cluster import open_cluster

    device = torch.device(args.device)

    def make(role: str, rank: int, port: int) -> TransferEngine:
        cfg = EngineConfig(role=role, bootstrap_port=port, num_workers=1, layers_per_write=max(per_write, 1))  # type: ignore[arg-type]
        return TransferEngine(cfg, KVPool.allocate(_layout(args), 1, 0, 4, device=device))

    calls: list[int] = []
    forwards: list[float] = []
    kernel = _kernel(device)

    async def run() -> None:
        async with open_cluster(make, 1, 1) as c:
            for room in range(1, args.rooms + 2):
                receiver = await c.decode[0].receiver(room, c.bootstrap, np.arange(1))
                sender = c.prefill[0].sender(room)
                if per_write:
                    await sender.begin_chunk(np.arange(1), last=True)
                timed: list[int] = []
                start = time.perf_counter()
                for layer in range(args.layers):
                    _spin(args.work_us)
                    kernel()
                    if per_write:
                        t0 = time.perf_counter_ns()
                        await sender.layers_ready(layer, layer + 1)
                        timed.append(time.perf_counter_ns() - t0)
                    await anyio.lowlevel.checkpoint()
                forward = time.perf_counter() - start
                if not per_write:  # chunk-level: one send() after the forward
                    t0 = time.perf_counter_ns()
                    await sender.send(np.arange(1), last=True)
                    timed.append(time.perf_counter_ns() - t0)
                await receiver.wait()
                await sender.wait()
                if room > 1:
                    calls.extend(timed)
                    forwards.append(forward)
            c.assert_no_leaks()

    anyio.run(run)
    return _summary(calls, forwards, args)


def cuda_primitives(args: argparse.Namespace) -> dict[str, float]:
    """Median us of the CUDA calls a ``layers_ready`` without ``ready`` may make (CUDA only)."""
    import torch

    device = torch.device(args.device)
    stream = torch.cuda.current_stream(device)

    def median_us(fn: Any, n: int = 2000) -> float:
        times = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            fn()
            times.append(time.perf_counter_ns() - t0)
        return statistics.median(times) / 1e3

    def record() -> None:
        torch.cuda.Event().record(stream)

    out = {
        "current_stream_us": median_us(lambda: torch.cuda.current_stream(device)),
        "event_record_us": median_us(record),
        "stream_compare_us": median_us(lambda: stream != torch.cuda.current_stream(device)),
    }
    torch.cuda.synchronize(device)
    return out


def child(args: argparse.Namespace) -> int:
    rows = []
    for per_write in args.per_write:
        rows.append({"mode": "facade", "per_write": per_write, **child_facade(args, per_write)})
        rows.append({"mode": "async", "per_write": per_write, **child_async(args, per_write)})
    if args.device == "cuda":
        rows.append({"mode": "cuda-primitives", **cuda_primitives(args)})
    print(json.dumps(rows))
    return 0


def run_tree(tree: Path, argv: list[str]) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_layer_calls.py"), "--child", *argv],
        env=env, capture_output=True, text=True, timeout=900, cwd=tree,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the run on {tree} failed:\n{done.stderr[-3000:]}")
    rows: list[dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--base", default="main", help="git revision of the old code ('none': measure this tree only)"
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument(
        "--per-write",
        default="0,1,4",
        help="layers_per_write values, comma-separated (0: chunk-level send())",
    )
    parser.add_argument("--rooms", type=int, default=20, help="rooms per mode, after one warm-up room")
    parser.add_argument("--work-us", type=float, default=200.0, help="the forward's Python work per layer")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs per code (best kept)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    raw = sys.argv[1:] if argv is None else argv
    args.per_write = [int(n) for n in str(args.per_write).split(",")]
    if args.child:
        return child(args)
    forwarded = [a for a in raw if a != "--child"]
    if args.base == "none":
        new = _best([run_tree(ROOT, forwarded) for _ in range(args.rounds)])
        old = new
    else:
        old, new = _old_and_new(args, forwarded)
    load = os.getloadavg()
    print(
        f"layers_ready per call: {args.device}, {args.layers} layers, {args.work_us:.0f} us of work per layer, "
        f"{args.rooms} rooms per row, best of {args.rounds} alternating rounds; old = {args.base}, new = this "
        f"tree; load average {load[0]:.1f}"
    )
    head = f"{'mode':>7} {'x':>3} {'code':>4} {'median us':>10} {'p90 us':>8} {'mean us':>8} {'wakeups':>8} {'forward ms':>11} {'ideal ms':>9}"
    print(head)
    for o, n in zip(old, new, strict=True):
        for code, r in (("old", o), ("new", n)) if args.base != "none" else (("new", n),):
            if r["mode"] == "cuda-primitives":
                print(f"{code}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items() if k != "mode"))
                continue
            wake = f"{r['wakeups_per_chunk']:8.1f}" if "wakeups_per_chunk" in r else f"{'':>8}"
            print(
                f"{r['mode']:>7} {r['per_write']:>3} {code:>4} {r['call_median_us']:10.2f} {r['call_p90_us']:8.2f} "
                f"{r['call_mean_us']:8.2f} {wake} {r['forward_ms']:11.2f} {r['forward_ideal_ms']:9.2f}"
            )
    print(json.dumps({"old": old if args.base != "none" else None, "new": new, "load": load[0]}))
    return 0


def _old_and_new(
    args: argparse.Namespace, forwarded: list[str]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Both measurements: ``--base`` in a detached worktree made for it (removed after), then this tree."""
    with tempfile.TemporaryDirectory(prefix="bench-layer-calls-") as tmp:
        base = Path(tmp) / "base"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(base), args.base], check=True
        )
        try:
            link = base / "transfer_engine" / "kernels"
            if not link.exists():
                link.symlink_to(Path("..") / "kernels")
            olds, news = [], []
            for _ in range(args.rounds):
                olds.append(run_tree(base, forwarded))
                news.append(run_tree(ROOT, forwarded))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
    return _best(olds), _best(news)


def _best(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per row, the round with the lowest median call (the CUDA primitives: the lowest first figure)."""
    return [
        min(rows, key=lambda r: r.get("call_median_us", r.get("current_stream_us", 0.0)))
        for rows in zip(*rounds, strict=True)
    ]


if __name__ == "__main__":
    sys.exit(main())
