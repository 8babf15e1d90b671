"""The loop-thread bridge and the bootstrap server on it: real threads, a real loop, real ZMQ."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import anyio
import anyio.lowlevel
import pytest
import zmq

from transfer_engine.errors import AddressInUseError, LocalProtocolError
from transfer_engine.facade import BootstrapServer, LoopThread
from transfer_engine.protocol import messages as m


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    thread = LoopThread("te-test-bridge")
    thread.start()
    yield thread
    thread.close()


def test_call_returns_the_result_on_the_loop_thread(loop_thread: LoopThread) -> None:
    async def where(x: int) -> tuple[int, str]:
        await anyio.lowlevel.checkpoint()
        return x * 2, threading.current_thread().name

    assert loop_thread.call(where, 21) == (42, "te-test-bridge")
    assert loop_thread.loop.is_running()


def test_call_raises_the_function_error(loop_thread: LoopThread) -> None:
    async def bad() -> None:
        raise ValueError("bad value 7")

    with pytest.raises(ValueError, match="bad value 7"):
        loop_thread.call(bad)
    assert loop_thread.call(anyio.sleep, 0) is None  # the loop goes on after an error


def test_call_soon_runs_in_order_and_an_error_does_not_stop_the_rest(loop_thread: LoopThread) -> None:
    seen: list[int] = []

    def boom() -> None:
        raise RuntimeError("one callback fails")

    for i in range(100):
        loop_thread.call_soon(seen.append, i)
        if i == 50:
            loop_thread.call_soon(boom)
    loop_thread.call(anyio.sleep, 0)  # a call queued after them runs after them
    assert seen == list(range(100))


def test_spawn_starts_a_task_that_close_cancels() -> None:
    thread = LoopThread("te-test-spawn")
    thread.start()
    started, cancelled = threading.Event(), threading.Event()

    async def forever() -> None:
        started.set()
        try:
            await anyio.sleep_forever()
        finally:
            cancelled.set()

    thread.spawn(forever)
    assert started.wait(5)
    thread.close()
    assert cancelled.is_set()
    thread.close()  # idempotent
    with pytest.raises(LocalProtocolError, match="closed"):
        thread.call(anyio.sleep, 0)
    with pytest.raises(LocalProtocolError, match="closed"):
        thread.call_soon(print)


def test_a_call_blocked_when_the_loop_closes_raises() -> None:
    thread = LoopThread("te-test-blocked")
    thread.start()
    errors: list[BaseException] = []

    def caller() -> None:
        try:
            thread.call(anyio.sleep_forever)
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=caller)
    worker.start()
    time.sleep(0.2)
    thread.close()
    worker.join(5)
    assert not worker.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], LocalProtocolError)


def test_call_from_the_loop_itself_is_refused(loop_thread: LoopThread) -> None:
    async def reenter() -> None:
        loop_thread.call(anyio.sleep, 0)

    with pytest.raises(LocalProtocolError, match="from the loop itself"):
        loop_thread.call(reenter)


def test_a_failing_spawned_task_leaves_the_loop_running(loop_thread: LoopThread) -> None:
    async def fails() -> None:
        raise RuntimeError("a task fails")

    loop_thread.spawn(fails)
    assert loop_thread.call(anyio.sleep, 0.01) is None


def _ask(endpoint: str, message: m.Message) -> m.AnyMessage:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    try:
        sock.connect(endpoint)
        sock.send(m.encode(message))
        return m.decode(sock.recv())
    finally:
        sock.close(0)
        ctx.term()


def test_bootstrap_server_registers_and_answers() -> None:
    with BootstrapServer("127.0.0.1", 0) as server:
        assert server.port > 0
        endpoint = f"tcp://127.0.0.1:{server.port}"
        layout = m.LayoutInfo(3, 8, 16, "bfloat16", 4, False, 64, 16, 8)
        register = m.RegisterRank(rank=0, tp_size=2, endpoint="tcp://a:1", layout=layout, compat=5)
        assert _ask(endpoint, register) == m.RegisterAck(ok=True)
        topo = _ask(endpoint, m.TopologyQuery())
        assert isinstance(topo, m.Topology)
        assert (topo.tp_size, topo.complete, [r.endpoint for r in topo.ranks]) == (2, False, ["tcp://a:1"])
    server.stop()  # idempotent
    with pytest.raises(LocalProtocolError):
        server.start()


def test_bootstrap_server_on_a_taken_port_raises_and_leaves_no_thread() -> None:
    with BootstrapServer("127.0.0.1", 0) as first:
        before = threading.active_count()
        second = BootstrapServer("127.0.0.1", first.port)
        with pytest.raises(AddressInUseError, match=str(first.port)):
            second.start()
        assert threading.active_count() == before
