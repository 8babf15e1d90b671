"""Failed means safe: poll() reports a final status only once no WRITE of the room can land.

A poll-only caller (SGLang frees a request's pages the moment poll() says Failed) must never see
Failed while a WRITE of the room may still land in its pages. The real transport is wrapped to
report one WRITE's completion late (its bytes land at once), so the prefill room cannot end, and
the decode room waits for its AbortAck, for that long after an abort.
"""

from __future__ import annotations

import time

import anyio
import numpy as np
import pytest

from tests.chaos.helpers import engines, faulty_factory
from transfer_engine import RoomStatus
from transfer_engine.protocol.polling import polled
from transfer_engine.transport.faults import Fault, Rule, matching

pytestmark = pytest.mark.timeout(60)

LIVE = [RoomStatus.BOOTSTRAPPING, RoomStatus.WAITING_FOR_INPUT, RoomStatus.TRANSFERRING]


@pytest.mark.parametrize("status", list(RoomStatus))
@pytest.mark.parametrize("ended", [False, True])
@pytest.mark.parametrize("last_live", LIVE)
def test_polled_table(status: RoomStatus, ended: bool, last_live: RoomStatus) -> None:
    got = polled(status, ended, last_live)
    if not status.final:
        assert got is status
    elif ended:
        assert got is status
    else:
        assert got is last_live


@pytest.mark.parametrize("final", [RoomStatus.SUCCESS, RoomStatus.FAILED])
def test_polled_refuses_a_final_last_live(final: RoomStatus) -> None:
    with pytest.raises(ValueError, match=final.name):
        polled(RoomStatus.FAILED, False, final)


@pytest.mark.anyio
async def test_failed_room_polls_live_until_no_write_can_land() -> None:
    delay = 0.8
    rule = Rule(Fault.DELAY, match=matching(room=301), times=None, delay_s=delay)
    async with engines(1, 1, prefill_transport=faulty_factory([], writes=[rule])) as c:
        receiver = await c.decode[0].receiver(301, c.bootstrap)
        assert receiver.poll() is RoomStatus.WAITING_FOR_INPUT and not receiver.requested
        receiver.request(np.arange(4), aux_slot=None)
        sender = c.prefill[0].sender(301)
        with anyio.fail_after(10):
            while sender.poll() is RoomStatus.BOOTSTRAPPING:  # noqa: ASYNC110 (no event for it)
                await anyio.sleep(0.005)
        await sender.send(np.arange(2), last=False)
        with anyio.fail_after(10):
            while receiver.poll() is not RoomStatus.TRANSFERRING:  # noqa: ASYNC110
                await anyio.sleep(0.005)
        async with anyio.create_task_group() as tg:
            aborted = time.monotonic()
            tg.start_soon(receiver.abort)
            with anyio.fail_after(5):
                while receiver.failure is None or sender.failure is None:  # noqa: ASYNC110
                    await anyio.sleep(0.002)
            # both rooms failed; the WRITE is still "in flight", so neither may look final yet
            assert receiver.poll() is RoomStatus.TRANSFERRING
            # the last status this handle saw: its caller never polled it in Transferring
            assert sender.poll() is RoomStatus.WAITING_FOR_INPUT
            seen_final = None
            with anyio.fail_after(10):
                while receiver.poll() is not RoomStatus.FAILED:  # noqa: ASYNC110
                    await anyio.sleep(0.002)
                seen_final = time.monotonic()
        assert seen_final - aborted >= delay * 0.8, "Failed was reported before the WRITE completed"
        assert sender.poll() is RoomStatus.FAILED
        assert rule.fired >= 1
        c.assert_no_leaks()
