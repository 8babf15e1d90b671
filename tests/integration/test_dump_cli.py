"""``transfer-engine dump``: a room named by its request id, and an endpoint that is the wrong port.

A serving system knows its requests by string ids; ``--room`` takes one and finds the room the
integrations made of it (``room_id``). ``--endpoint`` pointed at a prefill's bootstrap server (the
port users know) gets an answer naming what it reached, and the server logs and drops nothing.
"""

from __future__ import annotations

import io
import logging

import anyio
import numpy as np
import pytest

from transfer_engine import room_id
from transfer_engine.errors import ConfigError
from transfer_engine.observe import cli

from .harness import cluster, run_room, small_layout


def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(["dump", *args], stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize(
    ("text", "request_id", "room"),
    [
        ("42", False, 42),
        (" 42 ", False, 42),
        ("42", True, room_id("42")),
        ("cmpl-8e1f", False, room_id("cmpl-8e1f")),
        ("chatcmpl-1#0", False, room_id("chatcmpl-1#0")),
    ],
)
def test_parse_room(text: str, request_id: bool, room: int) -> None:
    assert cli.parse_room(text, request_id=request_id) == room


def test_parse_room_refuses_an_empty_id() -> None:
    with pytest.raises(ConfigError):
        cli.parse_room("  ")
    code, _, err = run_cli("--endpoint", "tcp://127.0.0.1:1", "--room", " ")
    assert code == cli.EXIT_USAGE and "--room" in err
    code, _, err = run_cli("--endpoint", "tcp://127.0.0.1:1", "--room", "1", "--request-id", "x")
    assert code == cli.EXIT_USAGE


@pytest.mark.anyio
async def test_room_by_request_id_and_the_bootstrap_port(caplog: pytest.LogCaptureFixture) -> None:
    request = "cmpl-quick-7"
    async with cluster(small_layout(), 1, 1) as c:
        prefill, decode = c.prefill[0], c.decode[0]
        await run_room(c, room_id(request), np.array([1, 2]), np.array([3, 4]), [2])

        def by_request() -> tuple[int, str, str]:
            return run_cli("--endpoint", decode.introspect_endpoint, "--room", request)

        code, out, err = await anyio.to_thread.run_sync(by_request)
        assert code == cli.EXIT_OK, err
        assert out.startswith(f"request id {request!r} is room {room_id(request)}\n")
        assert f"room {room_id(request)} (decode): ended SUCCESS" in out

        def digits_as_request_id() -> tuple[int, str, str]:
            return run_cli("--endpoint", decode.introspect_endpoint, "--request-id", str(room_id(request)))

        code, _, _ = await anyio.to_thread.run_sync(digits_as_request_id)
        assert code == cli.EXIT_FAILED  # the digits were hashed: no such room

        assert prefill.bootstrap is not None
        dropped_before = sum(prefill.bootstrap.dropped.values())
        caplog.clear()
        with caplog.at_level(logging.INFO):

            def at_bootstrap() -> tuple[int, str, str]:
                return run_cli("--endpoint", c.bootstrap, "--timeout", "5")

            code, out, err = await anyio.to_thread.run_sync(at_bootstrap)
        assert code == cli.EXIT_USAGE
        assert out == ""
        assert err == (
            f"transfer-engine dump: {c.bootstrap} is the bootstrap server of a prefill instance (TP 1; "
            f"control sockets: rank 0 {prefill.endpoint}), not an introspection endpoint: each engine "
            "logs its own at start ('transfer-engine dump --endpoint tcp://...'), and "
            "engine.introspect_endpoint names it\n"
        )
        assert sum(prefill.bootstrap.dropped.values()) == dropped_before
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        c.assert_no_leaks()
