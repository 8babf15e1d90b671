"""A threaded program with no asyncio of its own moving rooms through the blocking facade.

One thread per TP rank on each side, all in this process, each with its own
:class:`~transfer_engine.facade.BlockingEngine` (its own NIXL agent and event-loop thread). Rooms
are named by string request ids. Each room follows the order SGLang's scheduler uses:

- decode: ``receiver(request_id, bootstrap)`` handshakes first; once ``poll()`` says
  WaitingForInput it takes pages from its allocator and calls ``request(pages, aux_slot)``;
- prefill: ``sender(request_id)``; once ``poll()`` says WaitingForInput (every decode rank asked)
  it declares the room's size with ``expect(total_pages, aux_slot)`` and sends it chunk by chunk;
- both poll until Success (which means no WRITE can still land), then free the pages.

Every byte of every room is checked on every decode rank. Run::

    python examples/threaded.py                    # P=2 -> D=1, then P=1 -> D=2
    python examples/threaded.py --setups 4:2 --rooms 20

It prints one line per setup and exits 1 if any room failed or any byte differs.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from transfer_engine import EngineConfig, KVLayout, KVPool, RoomStatus, room_id
from transfer_engine.facade import BlockingEngine
from transfer_engine.testing import patterns
from transfer_engine.testing.cluster import free_port

POLL_S = 0.0002
ROOM_TIMEOUT_S = 30.0


@dataclass
class Plan:
    """The rooms both sides walk, in order: request id, page count and chunk split of each."""

    request_ids: list[str]
    pages: list[int]
    chunks: list[list[int]]
    aux_slots: list[int]


@dataclass
class Outcome:
    errors: list[str] = field(default_factory=list)
    bytes_checked: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, what: str) -> None:
        with self.lock:
            self.errors.append(what)


def make_plan(rooms: int, max_pages: int, seed: int, aux_slots: int) -> Plan:
    rng = random.Random(seed)
    ids, pages, chunks, aux = [], [], [], []
    for i in range(rooms):
        n = rng.randint(1, max_pages)
        cuts = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(0, 3)))) if n > 1 else []
        bounds = [0, *cuts, n]
        ids.append(f"threaded-{seed}-{i}")
        pages.append(n)
        chunks.append([b - a for a, b in zip(bounds, bounds[1:], strict=False)])
        aux.append(i % aux_slots)
    return Plan(ids, pages, chunks, aux)


def wait_for(handle: object, want: RoomStatus, what: str) -> RoomStatus:
    """Poll ``handle`` (a BlockingSender/Receiver) until ``want`` or Failed; the status seen last."""
    deadline = time.monotonic() + ROOM_TIMEOUT_S
    while True:
        status: RoomStatus = handle.poll()  # type: ignore[attr-defined]
        if status is want or status is RoomStatus.FAILED:
            return status
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: still {status.name} after {ROOM_TIMEOUT_S} s")
        time.sleep(POLL_S)


def prefill_rank(engine: BlockingEngine, plan: Plan, out: Outcome) -> None:
    rng = np.random.default_rng(engine.config.tp_rank)
    for rid, n, chunks, aux_slot in zip(
        plan.request_ids, plan.pages, plan.chunks, plan.aux_slots, strict=True
    ):
        room = room_id(rid)
        pages = rng.permutation(engine.pool.num_pages)[:n].astype(np.int64)
        patterns.fill(engine.pool, room, pages)
        patterns.fill_aux(engine.pool, room, aux_slot)
        sender = engine.sender(rid)
        if wait_for(sender, RoomStatus.WAITING_FOR_INPUT, f"prefill {rid}") is RoomStatus.FAILED:
            out.fail(f"prefill {rid}: {sender.failure}")
            continue
        sender.expect(n, aux_slot)
        start = 0
        for k in chunks:
            sender.send(pages[start : start + k])
            start += k
        if wait_for(sender, RoomStatus.SUCCESS, f"prefill {rid}") is not RoomStatus.SUCCESS:
            out.fail(f"prefill {rid}: {sender.failure}")


def decode_rank(
    engine: BlockingEngine, bootstrap: str, plan: Plan, out: Outcome, prefill_page_size: int
) -> None:
    rng = np.random.default_rng(100 + engine.config.tp_rank)
    page_size = engine.pool.layout.page_size
    for rid, n, aux_slot in zip(plan.request_ids, plan.pages, plan.aux_slots, strict=True):
        room = room_id(rid)
        receiver = engine.receiver(rid, bootstrap)
        if wait_for(receiver, RoomStatus.WAITING_FOR_INPUT, f"decode {rid}") is RoomStatus.FAILED:
            out.fail(f"decode {rid}: {receiver.failure}")
            continue
        tokens = n * prefill_page_size
        pages = rng.permutation(engine.pool.num_pages)[: -(-tokens // page_size)].astype(np.int64)
        receiver.request(pages, aux_slot)
        if wait_for(receiver, RoomStatus.SUCCESS, f"decode {rid}") is not RoomStatus.SUCCESS:
            out.fail(f"decode {rid}: {receiver.failure}")
            continue
        bad = patterns.mismatches(engine.pool, room, pages, tokens)
        if bad or not patterns.aux_ok(engine.pool, room, aux_slot):
            out.fail(f"decode rank {engine.config.tp_rank} room {rid}: {bad} elements differ or aux wrong")
        with out.lock:
            out.bytes_checked += tokens * engine.pool.slot_bytes * engine.pool.layout.num_kv_tensors


def run_setup(P: int, D: int, rooms: int, seed: int) -> Outcome:
    layout = KVLayout(num_layers=4, num_heads=8, head_dim=16, dtype=torch.bfloat16, page_size=4)
    port = free_port()
    plan = make_plan(rooms, max_pages=12, seed=seed, aux_slots=4)
    out = Outcome()
    engines: list[BlockingEngine] = []

    def start(role: str, tp: int, rank: int) -> BlockingEngine:
        cfg = EngineConfig(role=role, tp_size=tp, tp_rank=rank, bootstrap_port=port, num_workers=2)  # type: ignore[arg-type]
        pool = KVPool.allocate(layout, tp, rank, 64, aux_slots=4, aux_item_bytes=16)
        engine = BlockingEngine(cfg, pool)
        engines.append(engine)
        return engine

    try:
        prefill = [start("prefill", P, 0)]  # rank 0 hosts the bootstrap registry the others join
        prefill += [start("prefill", P, r) for r in range(1, P)]
        decode = [start("decode", D, r) for r in range(D)]
        threads = [threading.Thread(target=prefill_rank, args=(e, plan, out)) for e in prefill]
        threads += [
            threading.Thread(
                target=decode_rank, args=(e, f"tcp://127.0.0.1:{port}", plan, out, layout.page_size)
            )
            for e in decode
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for engine in engines:
            leaks = engine.leaks()
            if any(leaks.values()):
                out.fail(f"{engine.agent_name} leaked {leaks}")
    finally:
        for engine in reversed(engines):
            engine.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--setups", default="2:1,1:2", help="comma-separated P:D pairs (default 2:1,1:2)")
    parser.add_argument("--rooms", type=int, default=12, help="rooms per setup (default 12)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    ok = True
    for setup in args.setups.split(","):
        P, D = (int(x) for x in setup.split(":"))
        started = time.monotonic()
        out = run_setup(P, D, args.rooms, args.seed)
        took = time.monotonic() - started
        status = "ok" if not out.errors else "FAILED"
        print(
            f"threaded P={P} -> D={D}: {args.rooms} rooms, {out.bytes_checked} bytes checked, "
            f"{len(out.errors)} errors, {took:.2f} s: {status}",
            flush=True,
        )
        for error in out.errors:
            print(f"  {error}", flush=True)
        ok = ok and not out.errors
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
