"""One engine per process for the kill tests: commands in on stdin, events out on stdout, JSON lines.

    python -m tests.chaos.rank --role prefill --bootstrap-port 8998 [--heartbeat 0.5]
    python -m tests.chaos.rank --role decode --bootstrap-port 8998
    [--host 10.0.0.2 --bootstrap-host 10.0.0.1]   (default 127.0.0.1 for both)

Real NIXL and real ZMQ, as in a deployment; the test that starts the process decides the rooms.

Commands (one JSON object a line):

- ``{"cmd": "send", "room": R, "pages": [...], "chunks": [k, ...], "hold": false}`` (prefill): fill
  the pages with the room's pattern, open ``sender(R)`` and, once every decode request is in,
  ``send()`` the chunks; with ``hold`` the last chunk is never sent, so the room stays live. With
  ``"layers": true`` each chunk goes layer-wise instead (``begin_chunk``, then ``layers_ready`` one
  layer at a time, one WRITE per layer); with ``hold`` too, the last chunk is opened and only its
  first layer reported, so the room stays live between two layers.
- ``{"cmd": "recv", "room": R, "pages": [...]}`` (decode): ``receiver(R, ...)``; on success every
  byte is verified against the pattern.
- ``{"cmd": "quit"}``: wait for the open rooms to end, report leaks, leave the engine, exit 0.

Events: ``{"event": "up", "endpoint": ...}``, ``{"event": "opened", "room": R}``, ``{"event": "room",
"room": R, "ok": bool, "reason": "PEER_DEAD" | null, "detail": ..., "t": monotonic}``, ``{"event":
"leaks", "leaks": {...}}``. ``t`` is ``time.monotonic()``, which is one clock for every process of
the machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import torch
from anyio.abc import TaskGroup

from tests.integration.harness import small_layout
from transfer_engine.config import EngineConfig
from transfer_engine.engine import Receiver, Sender, TransferEngine
from transfer_engine.errors import TransferError, TransferFailed
from transfer_engine.memory.layout import KVPool
from transfer_engine.protocol.rooms import RoomStatus
from transfer_engine.testing import patterns

NUM_PAGES = 64


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, "t": time.monotonic(), **fields}) + "\n")
    sys.stdout.flush()


async def prefill_room(
    sender: Sender, pages: np.ndarray, chunks: list[int], hold: bool, layers: int | None
) -> None:
    """Send ``chunks`` of ``pages`` (``layers``: layer-wise, the room's layer count); see ``hold``.

    Emits ``asked`` once the room has its decode's request (it left Bootstrapping): a test that kills
    a peer mid-room waits for it, since a room nobody asked for yet waits for any decode until its
    bootstrap deadline instead of failing with one that died."""
    delay = 0.001
    while sender.poll() is RoomStatus.BOOTSTRAPPING:  # noqa: ASYNC110 (the engine has no event for it)
        await anyio.sleep(delay)
        delay = min(2 * delay, 0.01)
    if sender.poll() is not RoomStatus.FAILED:
        emit("asked", room=sender.room)
        start = 0
        for i, k in enumerate(chunks):
            last = i == len(chunks) - 1
            chunk = pages[start : start + k]
            start += k
            if layers is None:
                if not (hold and last):
                    await sender.send(chunk, last=last)
                continue
            await sender.begin_chunk(chunk, last=last)
            for layer in range(1 if hold and last else layers):
                await sender.layers_ready(layer, layer + 1)
    await sender.wait()


async def serve_commands(
    engine: TransferEngine,
    pool: KVPool,
    rooms: TaskGroup,
    bootstrap: str,
    room_fields: Callable[[int, Sender | Receiver], dict[str, Any]] | None = None,
) -> None:
    """Run the commands of stdin (this module's docstring) until ``quit`` or its end, each room's work a
    task of ``rooms``; then wait, 30 s at most, until ``engine`` holds no room.

    Emits ``opened`` (or ``error``) for each command and ``room`` once its room ended;
    ``room_fields(room, handle)``, called then, gives more fields of that ``room`` event."""
    pages_of: dict[int, np.ndarray] = {}

    async def finish(room: int, handle: Sender | Receiver, work: Any) -> None:
        try:
            await work
            ok, reason, detail = True, None, ""
            if isinstance(handle, Receiver):
                tokens = len(pages_of[room]) * pool.layout.page_size
                bad = patterns.mismatches(pool, room, pages_of[room], tokens)
                ok, detail = bad == 0, f"{bad} wrong elements"
        except TransferFailed as exc:
            ok, reason, detail = False, exc.reason.name, exc.detail
        more = room_fields(room, handle) if room_fields is not None else {}
        emit("room", room=room, ok=ok, reason=reason, detail=detail, **more)

    while True:
        line = await anyio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
        if not line or json.loads(line)["cmd"] == "quit":
            break
        cmd = json.loads(line)
        room, pages = int(cmd["room"]), np.array(cmd["pages"], dtype=np.int64)
        pages_of[room] = pages
        try:
            if cmd["cmd"] == "send":
                patterns.fill(pool, room, pages)
                if pool.device.type == "cuda":
                    torch.cuda.synchronize()  # the WRITE reads this memory: it must be written first
                sender = engine.sender(room)
                layers = pool.layout.num_layers if cmd.get("layers") else None
                work = prefill_room(sender, pages, cmd["chunks"], cmd["hold"], layers)
                rooms.start_soon(finish, room, sender, work)
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


def rank_parser(description: str) -> argparse.ArgumentParser:
    """The flags every rank process of this kind takes: ``--role``, ``--bootstrap-port``, ``--heartbeat``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--role", choices=["prefill", "decode"], required=True)
    parser.add_argument("--bootstrap-port", type=int, required=True)
    parser.add_argument("--heartbeat", type=float, default=0.5)
    return parser


def rank_config(args: argparse.Namespace, **fields: Any) -> EngineConfig:
    """The engine of a rank process of this kind (flags of :func:`rank_parser`; ``fields``: more)."""
    return EngineConfig(
        role=args.role,
        bootstrap_port=args.bootstrap_port,
        heartbeat_interval=args.heartbeat,
        connect_timeout=2.0,
        num_workers=1,
        layers_per_write=1,
        **fields,
    )


async def serve(args: argparse.Namespace) -> int:
    cfg = rank_config(args, host=args.host, bootstrap_host=args.bootstrap_host)
    pool = KVPool.allocate(small_layout(), 1, 0, NUM_PAGES, aux_slots=0, aux_item_bytes=0)
    bootstrap = f"tcp://{args.bootstrap_host}:{args.bootstrap_port}"
    async with TransferEngine(cfg, pool) as engine, anyio.create_task_group() as rooms:
        emit("up", endpoint=engine.endpoint, agent=engine.agent_name)
        await serve_commands(engine, pool, rooms, bootstrap)
        emit("leaks", leaks=engine.leaks())
    return 0


def main() -> int:
    parser = rank_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address this rank binds and is reached at")
    parser.add_argument("--bootstrap-host", default="127.0.0.1", help="address of the prefill's bootstrap")
    return anyio.run(serve, parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
