"""One engine per process for the kernel path's two-process tests (``test_kernel_path_processes.py``):
the decode's pool in shared memory (``share_memory_()``), so that the prefill maps it through
``/dev/shm`` (CPU) or CUDA IPC (``--device cuda``). Commands and events as ``tests/chaos/rank.py``'s
(JSON lines: ``send``, ``recv``, ``quit``), plus in each ``room`` event the decode's path and its
reason, and in ``leaks`` the mappings still open and the kernel part's counters.

    python -m tests.integration.kernel_rank --role prefill --bootstrap-port 8998 [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import torch

from tests.chaos.rank import NUM_PAGES, emit, prefill_room
from tests.integration.harness import small_layout
from transfer_engine.config import EngineConfig
from transfer_engine.engine import Receiver, Sender, TransferEngine
from transfer_engine.engine.snapshot import build_snapshot
from transfer_engine.errors import TransferError, TransferFailed
from transfer_engine.memory import ipc
from transfer_engine.memory.layout import KVPool
from transfer_engine.testing import patterns


async def serve(args: argparse.Namespace) -> int:
    cfg = EngineConfig(
        role=args.role,
        bootstrap_port=args.bootstrap_port,
        heartbeat_interval=args.heartbeat,
        connect_timeout=2.0,
        num_workers=1,
        layers_per_write=1,
    )
    pool = KVPool.allocate(small_layout(), 1, 0, NUM_PAGES, device=args.device, aux_slots=0, aux_item_bytes=0)
    if args.role == "decode" and args.device == "cpu":
        for t in pool.tensors:
            t.share_memory_()
    bootstrap = f"tcp://127.0.0.1:{args.bootstrap_port}"
    async with TransferEngine(cfg, pool) as engine, anyio.create_task_group() as rooms:
        emit("up", endpoint=engine.endpoint, agent=engine.agent_name)
        pages_of: dict[int, np.ndarray] = {}

        async def finish(room: int, handle: Sender | Receiver, work: Any) -> None:
            path, why = "", ""
            try:
                await work
                ok, reason, detail = True, None, ""
                if isinstance(handle, Receiver):
                    tokens = len(pages_of[room]) * pool.layout.page_size
                    bad = patterns.mismatches(pool, room, pages_of[room], tokens)
                    ok, detail = bad == 0, f"{bad} wrong elements"
            except TransferFailed as exc:
                ok, reason, detail = False, exc.reason.name, exc.detail
            if isinstance(handle, Receiver):
                ended = [r for r in build_snapshot(engine).ended if r.room == room]
                if ended:
                    path, why = ended[0].path, ended[0].path_reason
            emit("room", room=room, ok=ok, reason=reason, detail=detail, path=path, why=why)

        while True:
            line = await anyio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
            if not line:
                break
            cmd = json.loads(line)
            if cmd["cmd"] == "quit":
                break
            room, pages = int(cmd["room"]), np.array(cmd["pages"], dtype=np.int64)
            pages_of[room] = pages
            try:
                if cmd["cmd"] == "send":
                    patterns.fill(pool, room, pages)
                    if pool.device.type == "cuda":
                        torch.cuda.synchronize()
                    sender = engine.sender(room)
                    layers = pool.layout.num_layers if cmd.get("layers") else None
                    rooms.start_soon(
                        finish, room, sender, prefill_room(sender, pages, cmd["chunks"], cmd["hold"], layers)
                    )
                else:
                    receiver = await engine.receiver(room, bootstrap, pages)
                    rooms.start_soon(finish, room, receiver, receiver.wait())
            except TransferError as exc:
                emit("error", room=room, error=f"{type(exc).__name__}: {exc}")
                continue
            emit("opened", room=room)
        with anyio.fail_after(30):
            while engine.rooms:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        counters = {k: v for w in engine.workers for k, v in w.counters.items() if k.startswith("kernel")}
        mapped = sorted({p.mapped for p in engine.peers.values() if p.mapped})
        leaks = engine.leaks()
    emit("leaks", leaks=leaks, mappings=ipc.open_mappings(), counters=counters, mapped=mapped)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=["prefill", "decode"], required=True)
    parser.add_argument("--bootstrap-port", type=int, required=True)
    parser.add_argument("--heartbeat", type=float, default=0.5)
    parser.add_argument("--device", default="cpu")
    return anyio.run(serve, parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
