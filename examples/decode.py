"""Decode side of the example: D rank processes that request the schedule's rooms and verify every byte.

    python examples/decode.py --tp 1 --bootstrap tcp://127.0.0.1:8998 [--rooms 200 --seed 0 ...]

Each rank holds a synthetic KV pool of the same model as the prefill (its own TP split) and walks
the room schedule of ``common.py`` (same ``--seed``/``--rooms``/shape flags as the prefill!): it
takes the room's pages from its own allocator, calls ``engine.receiver(room, bootstrap, pages,
aux_slot)``, and once ``wait()`` returns checks every element of every page with
``patterns.mismatches`` and the aux item with ``patterns.aux_ok``. Room latency is measured from
``receiver()`` to ``wait()`` returning, and a room's latency is that of its slowest decode rank.
Before the first room each rank calls ``engine.connect(bootstrap)`` (retried until
``--wait-for-prefill`` seconds have passed, so both sides may start in any order); the GB/s clock
starts once it is connected.

Each rank prints its control and introspection endpoints at start (``transfer-engine dump
--endpoint`` shows its state) and one line at the end; the launcher prints one summary line
(``decode summary: rooms verified N/M ...``) and exits non-zero if any room failed or any byte was
wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import common
import side

DEFAULT_WAITING_TIMEOUT = 120.0
ENGINE_SKIP = (
    "role",
    "tp_size",
    "tp_rank",
    "agent_name",
    "bootstrap_host",
    "bootstrap_port",
    "host_bootstrap",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Decode ranks of the transfer_engine example.", allow_abbrev=False
    )
    parser.add_argument("--tp", type=int, default=1, help="decode TP size: rank processes to start")
    parser.add_argument(
        "--bootstrap", default="tcp://127.0.0.1:8998", help="the prefill instance's bootstrap server"
    )
    parser.add_argument(
        "--wait-for-prefill",
        type=float,
        default=60.0,
        help="keep trying to reach the prefill instance this long before giving up (s, default 60)",
    )
    parser.add_argument(
        "--progress",
        choices=["auto", "bar", "lines", "none"],
        default="auto",
        help="bar: one updating line on stderr (auto: when stderr is a terminal); lines: 'progress ...' "
        "lines on stdout, for pd_demo",
    )
    parser.add_argument("--json-out", default="", help="also write the summary as JSON to this file")
    return side.parse_args(parser, argv, "decode", ENGINE_SKIP)


def decode_rank(rank: int, args: argparse.Namespace, events: Any) -> None:
    """Entry point of one rank process."""
    side.run_rank(serve, "decode", rank, args, events)


async def serve(rank: int, args: argparse.Namespace, events: Any) -> int:
    import anyio
    import numpy as np

    from transfer_engine.config import EngineConfig
    from transfer_engine.engine import Receiver, TransferEngine
    from transfer_engine.errors import PeerUnreachableError, TransferError, TransferFailed
    from transfer_engine.testing import patterns

    overrides = {}
    if args.waiting_timeout is None and "TE_WAITING_TIMEOUT" not in os.environ:
        # A room whose prefill side ended before our request arrived is never answered; without an
        # input deadline it would wait forever. The schedule keeps the prefill close behind us.
        overrides["waiting_timeout"] = DEFAULT_WAITING_TIMEOUT
    overrides.update(common.staging_defaults(args))
    cfg = EngineConfig.from_args(args, role="decode", tp_size=args.tp, tp_rank=rank, **overrides)
    plans = common.make_schedule(args)
    kv = side.RankPool("decode", rank, args)
    name, pool = kv.name, kv.pool
    stand_in = common.stand_in_executor(args)  # one verify at a time, off the event loop
    stats: dict[str, Any] = {"ok": 0, "failed": 0, "bytes": 0, "start": 0.0, "end": 0.0}
    trace = common.ExampleTrace("decode", rank)

    def verify(room: int, pages: np.ndarray, slot: int | None) -> str | None:
        tokens = len(pages) * pool.layout.page_size  # whole pages: every byte the prefill wrote
        bad = patterns.mismatches(pool, room, pages, tokens)
        if bad:
            return f"{bad} wrong elements in {tokens} tokens"
        if slot is not None and not patterns.aux_ok(pool, room, slot):
            return f"aux item in slot {slot} is wrong"
        return None

    async def finish_room(
        plan: common.RoomPlan, receiver: Receiver, pages: np.ndarray, slot: int | None, t0: float
    ) -> None:
        ok, latency, nbytes = False, 0.0, 0
        try:
            await receiver.wait()
            latency = time.monotonic() - t0
            trace.mark(plan.room, "waited")
            problem = await common.on_stand_in(stand_in, verify, plan.room, pages, slot)
            trace.mark(plan.room, "verified")
            if problem is None:
                ok = True
                nbytes = kv.room_bytes(plan)
            else:
                common.say(f"{name}: room {plan.room} (#{plan.index}): {problem}")
        except TransferFailed as exc:  # wait() raises only once the room is quiescent
            if stats["failed"] < 5:
                common.say(f"{name}: room {plan.room} (#{plan.index}) failed: {exc}")
        finally:
            kv.give_back(pages, slot)
        stats["ok" if ok else "failed"] += 1
        stats["bytes"] += nbytes
        stats["end"] = time.time()
        events.put(("room", rank, (plan.index, ok, nbytes, latency)))

    async def connect(engine: TransferEngine) -> None:
        """Handshake with the prefill instance before the first room; it may still be starting."""
        give_up = time.monotonic() + args.wait_for_prefill
        while True:
            try:
                await engine.connect(args.bootstrap)
                return
            except PeerUnreachableError as exc:
                if time.monotonic() > give_up:
                    raise
                if not warned:
                    warned.append(str(exc))
                    common.say(f"{name}: waiting for the prefill instance at {args.bootstrap} ({exc})")
                await anyio.sleep(0.5)

    warned: list[str] = []

    async with TransferEngine(cfg, pool) as engine:
        kv.say_up(engine, events)
        async with common.STOP.cancel_on_signal():
            try:
                await connect(engine)
            except TransferError as exc:
                common.say(f"{name}: cannot connect to the prefill instance at {args.bootstrap}: {exc}")
                plans_to_run: list[common.RoomPlan] = []
            else:
                stats["start"] = time.time()  # the clock of GB/s starts once connected
                plans_to_run = plans
            async with anyio.create_task_group() as tg:
                for plan in plans_to_run:
                    pages, slot = await kv.take(plan, trace)
                    t0 = time.monotonic()
                    trace.mark(plan.room, "opened")
                    try:
                        receiver = await engine.receiver(plan.room, args.bootstrap, pages, aux_slot=slot)
                    except TransferError as exc:  # nothing was registered: stop the schedule here
                        common.say(f"{name}: cannot open room {plan.room} (#{plan.index}): {exc}; stopping")
                        kv.give_back(pages, slot)
                        break
                    tg.start_soon(finish_room, plan, receiver, pages, slot, t0)
        trace.dump(engine.me.trace.take())
    stand_in.shutdown(wait=False)
    total = len(plans)
    elapsed = max(0.0, stats["end"] - stats["start"]) if stats["start"] else 0.0
    kv.say_end(stats, total, f"verified in {elapsed:.2f} s")
    events.put(("done", rank, {**stats, "rooms": total}))
    return 0 if stats["ok"] == total else 1


class Progress:
    """Aggregates the ranks' per-room events: a room is verified once every decode rank verified it."""

    def __init__(self, total: int, ranks: int, mode: str) -> None:
        self.total, self.ranks, self.mode = total, ranks, mode
        self.reports: dict[int, list[tuple[bool, int, float]]] = {}
        self.verified = self.failed = self.bytes = 0
        self.latencies: list[float] = []
        self.latency_by_index: dict[int, float] = {}
        self.done: dict[int, dict[str, Any]] = {}
        self.started = time.monotonic()
        self._shown = 0.0

    def on_event(self, kind: str, rank: int, payload: Any) -> None:
        if kind == "done":
            self.done[rank] = payload
            return
        if kind != "room":
            return
        index, ok, nbytes, latency = payload
        got = self.reports.setdefault(index, [])
        got.append((ok, nbytes, latency))
        self.bytes += nbytes
        if len(got) == self.ranks:
            if all(r[0] for r in got):
                self.verified += 1
                self.latencies.append(max(r[2] for r in got))  # ready once every rank has it
                self.latency_by_index[index] = self.latencies[-1]
            else:
                self.failed += 1
        self.show()

    def show(self, final: bool = False) -> None:
        now = time.monotonic()
        if self.mode == "none" or (not final and now - self._shown < 0.1):
            return
        self._shown = now
        if self.mode == "lines":
            common.say(
                f"progress verified={self.verified} failed={self.failed} total={self.total} bytes={self.bytes}"
            )
            return
        width = 30
        done = self.verified + self.failed
        filled = width * done // max(self.total, 1)
        bar = "#" * filled + "." * (width - filled)
        sys.stderr.write(
            f"\r[{bar}] {done}/{self.total} rooms, {self.failed} failed, "
            f"{common.human_bytes(self.bytes)}, {now - self.started:.1f} s "
        )
        if final:
            sys.stderr.write("\n")
        sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plans = common.make_schedule(args)
    common.say(
        f"decode: {args.tp} rank(s), prefill at {args.bootstrap}, {len(plans)} rooms, "
        f"{common.layout_text(args)}, schedule {common.fingerprint(plans, common.layout_text(args))}"
    )
    mode = args.progress
    if mode == "auto":
        mode = "bar" if sys.stderr.isatty() else "none"
    progress = Progress(len(plans), args.tp, mode)
    codes = common.run_ranks("decode", args.tp, decode_rank, args, progress.on_event)
    progress.show(final=True)
    starts = [d["start"] for d in progress.done.values() if d["start"]]
    ends = [d["end"] for d in progress.done.values() if d["end"]]
    seconds = max(ends) - min(starts) if starts and ends else 0.0
    p50 = common.percentile(progress.latencies, 50)
    p99 = common.percentile(progress.latencies, 99)
    # The first window's rooms are all opened at once and queue behind each other; later rooms open
    # one at a time as earlier ones end. The two are reported apart (docs/PERF.md, "make demo's tail").
    first = [v for i, v in progress.latency_by_index.items() if i < args.inflight]
    steady = [v for i, v in progress.latency_by_index.items() if i >= args.inflight]
    gbps = progress.bytes / seconds / 1e9 if seconds > 0 else 0.0
    good = all(c == 0 for c in codes) and progress.verified == len(plans)
    summary = {
        "rooms": len(plans),
        "verified": progress.verified,
        "failed": len(plans) - progress.verified,
        "bytes": progress.bytes,
        "seconds": seconds,
        "gbps": gbps,
        "latency_p50_ms": p50 * 1e3,
        "latency_p99_ms": p99 * 1e3,
        "first_window_rooms": len(first),
        "first_window_max_ms": max(first, default=0.0) * 1e3,
        "steady_p50_ms": common.percentile(steady, 50) * 1e3,
        "steady_p99_ms": common.percentile(steady, 99) * 1e3,
        "exit_codes": codes,
        "latency_ms_by_room": {i: round(v * 1e3, 3) for i, v in sorted(progress.latency_by_index.items())},
        "ok": good,
    }
    common.say(
        f"decode summary: rooms verified {progress.verified}/{len(plans)}, failed {summary['failed']}, "
        f"{common.human_bytes(progress.bytes)} in {seconds:.2f} s = {gbps:.3f} GB/s, "
        f"room latency p50 {p50 * 1e3:.1f} ms p99 {p99 * 1e3:.1f} ms, exit codes {codes}"
    )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(summary, f)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
