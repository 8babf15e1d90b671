"""Every mailbox shrunk to a tiny bound, and still no deadlock (docs/ARCHITECTURE.md, "Mail without deadlock").

Rooms hold at most 2 mails before their senders wait, have at most 2 jobs at the workers and 1
chunk at the scatter actor; workers, ring and scatter hold 2 before waiting. Concurrent rooms of
many one-page chunks then fill every room mailbox and push the rooms' posts into the reserves,
while one room's input deadline expires in the middle of it (its check waits for the poller's
Drained reply, not on the poller). Every room still ends: the transfers bit-exact, the expired one
Failed with INPUT_TIMEOUT, nothing leaked.
"""

from __future__ import annotations

import gc
from typing import Any

import anyio
import numpy as np
import pytest

from transfer_engine.actors.room import common as room_common
from transfer_engine.actors.room import receiver as room_receiver
from transfer_engine.actors.room import sender as room_sender
from transfer_engine.engine import supervisor as engine_supervisor
from transfer_engine.errors import FailureReason, TransferTimeout
from transfer_engine.runtime.mail import Mailbox
from transfer_engine.runtime.ports import ROOM_RESERVE

from .harness import cluster, run_room, small_layout

pytestmark = [pytest.mark.timeout(120), pytest.mark.anyio]

ROOMS = 6
CHUNKS = 24


@pytest.mark.parametrize(("P", "D", "path"), [(1, 1, "direct"), (2, 1, "staged")])
async def test_tiny_mailboxes_do_not_deadlock(
    monkeypatch: pytest.MonkeyPatch, P: int, D: int, path: str
) -> None:
    made: list[Mailbox[Any]] = []
    init = Mailbox.__init__

    def recording(self: Mailbox[Any], capacity: int, reserve: int = 0) -> None:
        init(self, capacity, reserve)
        made.append(self)

    monkeypatch.setattr(Mailbox, "__init__", recording)
    monkeypatch.setattr(room_common, "ROOM_MAILBOX", 2)
    monkeypatch.setattr(room_sender, "JOBS_PER_ROOM", 2)
    monkeypatch.setattr(room_receiver, "SCATTERS_PER_ROOM", 1)
    monkeypatch.setattr(engine_supervisor, "ACTOR_MAILBOX", 2)
    layout = small_layout()
    async with cluster(layout, P, D, num_pages=ROOMS * CHUNKS + 8, path=path, max_rooms=ROOMS + 1,
                       waiting_timeout=2.0) as c:  # fmt: skip
        results: dict[int, BaseException | None] = {}

        async def one(room: int) -> None:
            pages = np.arange(room * CHUNKS, (room + 1) * CHUNKS, dtype=np.int64)
            try:
                await run_room(c, room, pages, pages, [1] * CHUNKS)
                results[room] = None
            except BaseException as exc:  # noqa: BLE001 - reported below
                results[room] = exc

        async def starved() -> None:
            """A room no prefill ever opens: its input deadline passes while the others run."""
            page = np.array([ROOMS * CHUNKS], dtype=np.int64)
            receiver = await c.decode[0].receiver(ROOMS, c.bootstrap, page)
            with pytest.raises(TransferTimeout):
                await receiver.wait()
            assert receiver.failure is not None and receiver.failure[0] is FailureReason.INPUT_TIMEOUT

        with anyio.fail_after(90):
            async with anyio.create_task_group() as tg:
                for room in range(ROOMS):
                    tg.start_soon(one, room)
                tg.start_soon(starved)
        assert results == dict.fromkeys(range(ROOMS)), results
        c.assert_no_leaks()
    room_boxes = [box for box in made if box.capacity == 2 and box.reserve == ROOM_RESERVE]
    assert max(box.high_water for box in room_boxes) == 2  # room mailboxes were full: senders waited
    actor_boxes = [
        box for box in made if box.capacity == 2 and box.reserve != ROOM_RESERVE and box.reserve > 0
    ]
    assert actor_boxes and max(box.high_water for box in actor_boxes) > 2  # rooms' posts used the reserve


@pytest.mark.parametrize("path", ["direct", "staged"])
async def test_an_ended_room_is_freed_without_the_cycle_collector(path: str) -> None:
    """A room's actor holds its mailbox and the mailbox held the actor's bound taker: every ended
    room was cyclic garbage (86 objects a room), freed only by CPython's full collections, whose
    pauses grew with it (docs/DECISIONS.md, "A closed mailbox lets go of its taker"). Closed, the
    mailbox lets go of it, and reference counting frees the room the moment it ends."""
    async with cluster(small_layout(), 1, 1, path=path) as c:
        for room in range(3):  # warm: what the first rooms make once (lists, tables) is not garbage
            await run_room(c, room, np.array([room]), np.array([room]), [1])
        gc.collect()
        gc.disable()
        try:
            for room in range(10, 20):
                await run_room(c, room, np.array([room % 8]), np.array([room % 8]), [1])
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            rooms = [o for o in gc.garbage if isinstance(o, room_common.RoomActor)]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
        assert rooms == [], f"{len(rooms)} ended room actors were cyclic garbage"
        c.assert_no_leaks()
