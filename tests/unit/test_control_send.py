"""Control.send never blocks: a peer that stops reading costs dropped messages, counted."""

from __future__ import annotations

import socket

import anyio
import pytest

from transfer_engine.actors.control import _SEND_HWM, Control
from transfer_engine.protocol import messages as m

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _unused_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


async def test_full_queue_drops_and_counts() -> None:
    async def dispatch(message: m.AnyMessage, ident: bytes) -> None:
        raise AssertionError("nothing is sent to this rank")

    control = Control("127.0.0.1", 0, dispatch, name="test")
    async with anyio.create_task_group() as tg:
        await tg.start(control.run)
        dead = _unused_endpoint()  # nobody listens: every message stays queued in the DEALER
        sent = [
            control.send(dead, m.Heartbeat(agent="a", rank=0, side="decode", seq=1))
            for _ in range(3 * _SEND_HWM)
        ]
        assert sent[0] is True
        assert sent.count(False) > 0
        assert control.dropped["send_queue_full"] == sent.count(False)
        tg.cancel_scope.cancel()
