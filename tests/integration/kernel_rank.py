"""One engine per process for the kernel path's two-process tests (``test_kernel_path_processes.py``):
the decode's pool in shared memory (``share_memory_()``), so that the prefill maps it through
``/dev/shm`` (CPU) or CUDA IPC (``--device cuda``). Commands and events as ``tests/chaos/rank.py``'s
(JSON lines: ``send``, ``recv``, ``quit``), plus in each ``room`` event the decode's path and its
reason, and in ``leaks`` the mappings still open and the kernel part's counters.

    python -m tests.integration.kernel_rank --role prefill --bootstrap-port 8998 [--device cuda]
"""

from __future__ import annotations

import argparse
import sys

import anyio

from tests.chaos.rank import NUM_PAGES, emit, rank_config, rank_parser, serve_commands
from tests.integration.harness import small_layout
from transfer_engine.engine import Receiver, Sender, TransferEngine
from transfer_engine.engine.snapshot import build_snapshot
from transfer_engine.memory import ipc
from transfer_engine.memory.layout import KVPool


async def serve(args: argparse.Namespace) -> int:
    cfg = rank_config(args)
    pool = KVPool.allocate(small_layout(), 1, 0, NUM_PAGES, device=args.device, aux_slots=0, aux_item_bytes=0)
    if args.role == "decode" and args.device == "cpu":
        for t in pool.tensors:
            t.share_memory_()
    bootstrap = f"tcp://127.0.0.1:{args.bootstrap_port}"
    async with TransferEngine(cfg, pool) as engine, anyio.create_task_group() as rooms:
        emit("up", endpoint=engine.endpoint, agent=engine.agent_name)

        def path_fields(room: int, handle: Sender | Receiver) -> dict[str, str]:
            """A decode room's path and its reason, from the engine's ended rooms ("" on the prefill)."""
            path, why = "", ""
            if isinstance(handle, Receiver):
                ended = [r for r in build_snapshot(engine).ended if r.room == room]
                if ended:
                    path, why = ended[0].path, ended[0].path_reason
            return {"path": path, "why": why}

        await serve_commands(engine, pool, rooms, bootstrap, room_fields=path_fields)
        counters = {k: v for w in engine.workers for k, v in w.counters.items() if k.startswith("kernel")}
        mapped = sorted({p.mapped for p in engine.peers.values() if p.mapped})
        leaks = engine.leaks()
    emit("leaks", leaks=leaks, mappings=ipc.open_mappings(), counters=counters, mapped=mapped)
    return 0


def main() -> int:
    parser = rank_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    return anyio.run(serve, parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
