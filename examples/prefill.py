"""Prefill side of the example: P rank processes, each a TransferEngine serving a schedule of rooms.

    python examples/prefill.py --tp 2 [--bootstrap-port 8998] [--rooms 200 --seed 0 ...]

Rank 0 hosts the bootstrap server on ``--bootstrap-port``; every rank registers with it, so decode
ranks find the whole TP group from one address. Each rank holds a synthetic KV pool (Qwen3-8B's
shape by default, few pages) and walks the room schedule of ``common.py``: it takes the room's
pages from its allocator, fills them with ``patterns.fill`` (what the model would compute), opens
``engine.sender(room)`` and ``send()``s the room's chunks. It does not wait for the decode's request:
the engine parks the room in Bootstrapping (or keeps an early request) until both are there.
``sender.wait()`` returns once every WRITE of the room is done; only then are its pages reused.

After the schedule a rank keeps serving until its decode peers are gone (or ``--linger`` seconds),
and SIGTERM/SIGINT shut it down gracefully at any time. Each rank prints its control and
introspection endpoints at start (``transfer-engine dump --endpoint`` shows its state) and one line
at the end; the exit status is non-zero if any room failed.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import common
import side

ENGINE_SKIP = ("role", "tp_size", "tp_rank", "agent_name")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Prefill ranks of the transfer_engine example.", allow_abbrev=False
    )
    parser.add_argument("--tp", type=int, default=1, help="prefill TP size: rank processes to start")
    parser.add_argument(
        "--linger",
        type=float,
        default=60.0,
        help="after the schedule, keep serving until every decode peer is gone, at most this long (s)",
    )
    parser.add_argument(
        "--send-early",
        action="store_true",
        help="send() a room's chunks right after sender(), before every decode rank's request is in. "
        "By default a rank waits for the room to leave Bootstrapping first: with decode TP >= 2 the "
        "engine fails a room whose early WRITE finishes before the last request arrives "
        "(PROTOCOL: event Landed is not allowed in state BOOTSTRAPPING)",
    )
    return side.parse_args(parser, argv, "prefill", ENGINE_SKIP)


def prefill_rank(rank: int, args: argparse.Namespace, events: Any) -> None:
    """Entry point of one rank process."""
    side.run_rank(serve, "prefill", rank, args, events)


async def serve(rank: int, args: argparse.Namespace, events: Any) -> int:
    import anyio
    import numpy as np
    import torch

    from transfer_engine.config import EngineConfig
    from transfer_engine.engine import Sender, TransferEngine
    from transfer_engine.errors import TransferError
    from transfer_engine.testing import patterns

    cfg = EngineConfig.from_args(
        args, role="prefill", tp_size=args.tp, tp_rank=rank, **common.staging_defaults(args)
    )
    plans = common.make_schedule(args)
    kv = side.RankPool("prefill", rank, args)
    name, pool = kv.name, kv.pool
    started = finished = time.monotonic()
    stand_in = common.stand_in_executor(args)  # one fill at a time, off the event loop
    stats = {"ok": 0, "failed": 0, "bytes": 0}
    trace = common.ExampleTrace("prefill", rank)

    def fill(room: int, pages: np.ndarray, slot: int | None) -> None:
        trace.mark(room, "fill")
        patterns.fill(pool, room, pages)
        if slot is not None:
            patterns.fill_aux(pool, room, slot)
        if pool.device.type == "cuda":
            torch.cuda.synchronize(pool.device)  # the WRITE reads this memory: it must be written first
        trace.mark(room, "filled")

    async def serve_room(plan: common.RoomPlan, sender: Sender, pages: np.ndarray, slot: int | None) -> None:
        nonlocal finished
        try:
            if not args.send_early:
                # As SGLang's scheduler does: send once every decode rank's request is in. (Sending
                # earlier is allowed, but see --send-early.) Raises the room's failure if it failed
                # first (a bootstrap timeout, an abort...).
                await sender.wait_bootstrapped()
            trace.mark(plan.room, "bootstrapped")
            start = 0
            for i, n in enumerate(plan.chunks):
                last = i == len(plan.chunks) - 1
                await sender.send(pages[start : start + n], last=last, aux_slot=slot if last else None)
                start += n
            await sender.wait()
            trace.mark(plan.room, "done")
            stats["ok"] += 1
            stats["bytes"] += kv.room_bytes(plan)
        except TransferError as exc:
            stats["failed"] += 1
            if stats["failed"] <= 5:
                common.say(f"{name}: room {plan.room} (#{plan.index}) failed: {exc}")
            with anyio.CancelScope(shield=True):
                await sender.abort(f"prefill rank {rank}: {exc}")  # returns once no WRITE can land
        finally:
            finished = time.monotonic()
            kv.give_back(pages, slot)

    async def prepare(plan: common.RoomPlan) -> tuple[np.ndarray, int | None]:
        """Take a window slot and pages for ``plan`` and compute its KV (the pattern fill)."""
        pages, slot = await kv.take(plan)
        await common.on_stand_in(stand_in, fill, plan.room, pages, slot)
        return pages, slot

    # The first window is computed before the engine is up, as a serving prefill is warm before it
    # takes traffic. Otherwise the decode opens its whole window at once while the rooms' KV is
    # still being computed one after another, and room k's latency includes k fills: that startup
    # queue, not the transfer, made the tail of `make demo` (docs/PERF.md, "make demo's tail").
    ready = [await prepare(plan) for plan in plans[: args.inflight]]
    async with TransferEngine(cfg, pool) as engine:
        where = f", bootstrap server {cfg.bootstrap_endpoint}" if cfg.hosts_bootstrap else ""
        kv.say_up(engine, events, where)
        async with common.STOP.cancel_on_signal():
            async with anyio.create_task_group() as tg:
                started = time.monotonic()
                for plan in plans:
                    pages, slot = ready[plan.index] if plan.index < len(ready) else await prepare(plan)
                    trace.mark(plan.room, "sender")
                    tg.start_soon(serve_room, plan, engine.sender(plan.room), pages, slot)
            # A server would go on; this one has served its schedule. Stay while decode ranks are
            # still connected (their last rooms may be finishing), so they never see us vanish.
            with anyio.move_on_after(args.linger):
                while engine.peers:  # noqa: ASYNC110 (the engine has no event for a peer leaving)
                    await anyio.sleep(0.1)
        trace.dump(engine.me.trace.take())
    stand_in.shutdown(wait=False)
    elapsed = max(0.0, finished - started)
    total = len(plans)
    kv.say_end(stats, total, f"in {elapsed:.2f} s")
    events.put(("done", rank, {**stats, "rooms": total, "seconds": elapsed}))
    return 0 if stats["ok"] == total else 1


def main(argv: list[str] | None = None) -> int:
    from transfer_engine.config import EngineConfig

    args = parse_args(argv)
    plans = common.make_schedule(args)
    cfg = EngineConfig.from_args(args, role="prefill", tp_size=args.tp, tp_rank=0)
    common.say(
        f"prefill: {args.tp} rank(s), bootstrap {cfg.bootstrap_endpoint}, {len(plans)} rooms, "
        f"{common.layout_text(args)}, schedule {common.fingerprint(plans, common.layout_text(args))}"
    )
    done: dict[int, dict[str, Any]] = {}

    def on_event(kind: str, rank: int, payload: Any) -> None:
        if kind == "done":
            done[rank] = payload

    started = time.monotonic()
    codes = common.run_ranks("prefill", args.tp, prefill_rank, args, on_event)
    ok = min((done[r]["ok"] if r in done else 0) for r in range(args.tp))
    failed = sum(d["failed"] for d in done.values())
    nbytes = sum(d["bytes"] for d in done.values())
    good = all(c == 0 for c in codes) and ok == len(plans)
    common.say(
        f"prefill summary: rooms ok {ok}/{len(plans)} on every rank, failed {failed}, "
        f"{common.human_bytes(nbytes)} served, {time.monotonic() - started:.2f} s, exit codes {codes}"
    )
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
