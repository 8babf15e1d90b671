"""The timerfd ticker that lets the NIXL poller sleep less than epoll's millisecond."""

from __future__ import annotations

import sys

import anyio
import pytest

from transfer_engine.ticker import Ticker, open_ticker

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timerfd is Linux-only")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_fires_once_per_arm() -> None:
    fired = anyio.Event()
    count = 0

    def on_fire() -> None:
        nonlocal count
        count += 1
        fired.set()

    ticker = open_ticker(on_fire)
    assert isinstance(ticker, Ticker)
    try:
        ticker.arm(0.0002)
        with anyio.fail_after(5):
            await fired.wait()
        await anyio.sleep(0.05)  # a one-shot timer: nothing more comes
        assert count == 1
    finally:
        ticker.close()


@pytest.mark.anyio
async def test_rearm_replaces_the_deadline() -> None:
    fired = anyio.Event()
    ticker = open_ticker(fired.set)
    assert ticker is not None
    try:
        ticker.arm(3600)
        ticker.arm(0.0005)  # the hour-long deadline is gone
        with anyio.fail_after(5):
            await fired.wait()
    finally:
        ticker.close()


@pytest.mark.anyio
async def test_close_stops_it() -> None:
    calls: list[int] = []
    ticker = open_ticker(lambda: calls.append(1))
    assert ticker is not None
    ticker.arm(0.001)
    ticker.close()
    ticker.close()  # idempotent
    await anyio.sleep(0.05)
    assert calls == []


def test_no_ticker_without_an_asyncio_loop() -> None:
    assert open_ticker(lambda: None) is None
