"""The blocking facade: threads only on the caller's side, typed errors, clean shutdown.

Real NIXL and ZMQ; engines run on their own loop threads. Budget: about 10 s on the 2-core box.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from transfer_engine import (
    ConfigError,
    EngineConfig,
    KVLayout,
    KVPool,
    LayoutError,
    LocalProtocolError,
    RoomInUseError,
    RoomStatus,
    room_id,
)
from transfer_engine.errors import PeerUnreachableError
from transfer_engine.facade import BlockingEngine
from transfer_engine.testing.cluster import free_port
from transfer_engine.transport.nixl import NixlTransport

pytestmark = pytest.mark.timeout(90)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "threaded.py"
LAYOUT = KVLayout(num_layers=2, num_heads=4, head_dim=16, dtype=torch.bfloat16, page_size=4)


def engine(role: str, port: int, **config: object) -> BlockingEngine:
    cfg = EngineConfig(role=role, bootstrap_port=port, num_workers=1, **config)  # type: ignore[arg-type]
    return BlockingEngine(cfg, KVPool.allocate(LAYOUT, 1, 0, 16, aux_slots=2, aux_item_bytes=8))


def poll_until(handle: object, want: RoomStatus, limit_s: float = 10.0) -> RoomStatus:
    deadline = time.monotonic() + limit_s
    while True:
        status: RoomStatus = handle.poll()  # type: ignore[attr-defined]
        if status in (want, RoomStatus.FAILED) or time.monotonic() > deadline:
            return status
        time.sleep(0.001)


@pytest.mark.slow
def test_threaded_example_moves_rooms_both_ways() -> None:
    run = subprocess.run(
        [sys.executable, str(EXAMPLE), "--rooms", "8"],
        capture_output=True,
        text=True,
        timeout=80,
        check=False,
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("threaded ")]
    assert run.returncode == 0, run.stdout + run.stderr
    assert len(lines) == 2 and all("0 errors" in line and line.endswith(": ok") for line in lines), lines
    assert "P=2 -> D=1" in lines[0] and "P=1 -> D=2" in lines[1]


def test_close_joins_the_loop_thread_and_refuses_later_calls() -> None:
    before = {t.ident for t in threading.enumerate()}
    prefill = engine("prefill", free_port())
    assert len({t.ident for t in threading.enumerate()} - before) >= 1  # the loop thread
    sender = prefill.sender("request-a")
    assert sender.room == room_id("request-a")
    assert sender.poll() is RoomStatus.BOOTSTRAPPING
    prefill.close()
    prefill.close()  # idempotent
    assert {t.ident for t in threading.enumerate()} - before == set()
    transport = prefill._engine._transport  # the real NixlTransport: everything of it released
    assert isinstance(transport, NixlTransport)
    assert transport.live_handles() == 0 and not transport._regs and not transport._peers
    assert sender.poll() is RoomStatus.FAILED  # ended with SHUTDOWN: no WRITE can land
    assert sender.failure is not None and sender.failure[0].name == "SHUTDOWN"
    with pytest.raises(LocalProtocolError, match="closed"):
        prefill.sender(7)
    with pytest.raises(LocalProtocolError, match="closed"):
        sender.send([0])
    with pytest.raises(LocalProtocolError, match="closed"):
        prefill.leaks()


def test_bad_input_raises_typed_errors_naming_the_value() -> None:
    port = free_port()
    with engine("prefill", port) as prefill, engine("decode", port) as decode:
        with pytest.raises(ConfigError, match="prefill"):
            decode.sender(1)
        with pytest.raises(ConfigError, match="decode"):
            prefill.receiver(1, f"tcp://127.0.0.1:{port}")
        with pytest.raises(ConfigError, match="request_id"):
            prefill.sender("")
        with pytest.raises(ConfigError, match="room=-1"):
            prefill.sender(-1)
        sender = prefill.sender(5)
        with pytest.raises(RoomInUseError):
            prefill.sender(5)
        with pytest.raises(LayoutError, match="page 99"):
            sender.send([1, 99])
        with pytest.raises(LayoutError, match="aux_slot=9"):
            sender.expect(3, aux_slot=9)
        sender.expect(3, aux_slot=1)
        with pytest.raises(ConfigError, match="total_pages=3"):
            sender.send([0, 1, 2, 3])
        with pytest.raises(LocalProtocolError, match="already expects"):
            sender.expect(4)
        with pytest.raises(LayoutError, match="page 16"):
            decode.receiver(6, f"tcp://127.0.0.1:{port}", pages=[16])
        with pytest.raises(ConfigError, match="decode_prefix_len=3"):
            decode.receiver(6, f"tcp://127.0.0.1:{port}", pages=[1], decode_prefix_len=3)
        receiver = decode.receiver(6, f"tcp://127.0.0.1:{port}")
        assert poll_until(receiver, RoomStatus.WAITING_FOR_INPUT) is RoomStatus.WAITING_FOR_INPUT
        with pytest.raises(LayoutError, match="page -1"):
            receiver.request([-1])
        receiver.request([0, 1, 2])
        with pytest.raises(LocalProtocolError, match="already requested"):
            receiver.request([3])
        sender.abort()
        receiver.abort()
        assert poll_until(sender, RoomStatus.FAILED) is RoomStatus.FAILED
        assert poll_until(receiver, RoomStatus.FAILED) is RoomStatus.FAILED
        assert not any(prefill.leaks().values()) and not any(decode.leaks().values())


def test_unreachable_bootstrap_fails_the_room_without_blocking() -> None:
    with engine("decode", free_port(), connect_timeout=0.3, bootstrap_timeout=1.0) as decode:
        started = time.monotonic()
        receiver = decode.receiver("lost", f"tcp://127.0.0.1:{free_port()}")
        assert time.monotonic() - started < 0.1  # the handshake runs on the loop
        with pytest.raises(LocalProtocolError, match="handshake"):
            receiver.request([0])
        assert poll_until(receiver, RoomStatus.FAILED) is RoomStatus.FAILED
        assert isinstance(receiver.open_error, PeerUnreachableError)
        assert receiver.failure is not None and receiver.failure[0].name == "TRANSPORT"
        with pytest.raises(PeerUnreachableError):
            receiver.wait(5)
        assert not any(decode.leaks().values())


def test_room_ids_from_strings() -> None:
    ids = [f"cmpl-{i:08x}-0" for i in range(20000)]
    rooms = {room_id(i) for i in ids}
    assert len(rooms) == len(ids)
    assert all(0 <= r < 2**63 for r in rooms)
    assert room_id("cmpl-1") == room_id("cmpl-1") != room_id("cmpl-2")
    with pytest.raises(ConfigError, match="request_id=3"):
        room_id(3)  # type: ignore[arg-type]
    assert np.int64(room_id("x")) >= 0


def test_close_during_a_handshake_fails_the_room_and_returns_promptly() -> None:
    decode = engine("decode", free_port(), connect_timeout=5.0, bootstrap_timeout=10.0)
    receiver = decode.receiver(9, f"tcp://127.0.0.1:{free_port()}")
    time.sleep(0.1)
    assert receiver.poll() is RoomStatus.BOOTSTRAPPING
    started = time.monotonic()
    decode.close()
    assert time.monotonic() - started < 3.0  # the handshake was cancelled, not waited for
    assert receiver.poll() is RoomStatus.FAILED
    assert isinstance(receiver.open_error, LocalProtocolError)


def test_layerwise_from_a_forward_thread() -> None:
    """A prefill forward on its own thread reports each layer as it writes it (threading.Event per
    layer, set after the layer's KV is written); the decode polls to Success and holds every byte."""
    from transfer_engine.testing import patterns

    port = free_port()
    with engine("prefill", port, layers_per_write=1) as prefill, engine("decode", port) as decode:
        pages = np.arange(3)
        receiver = decode.receiver("layerwise-1", bootstrap=f"tcp://127.0.0.1:{port}")
        assert poll_until(receiver, RoomStatus.WAITING_FOR_INPUT) is RoomStatus.WAITING_FOR_INPUT
        receiver.request(pages, aux_slot=1)
        sender = prefill.sender("layerwise-1")
        room = room_id("layerwise-1")
        patterns.fill_aux(prefill._engine.pool, room, 0)
        sender.expect(3, aux_slot=0)
        sender.begin_chunk(pages)
        events = [threading.Event() for _ in range(LAYOUT.num_layers)]

        def forward() -> None:
            for layer, written in enumerate(events):
                time.sleep(0.02)  # the layer's compute
                patterns.fill(prefill._engine.pool, room, pages, layers=(layer, layer + 1))
                written.set()

        for layer, written in enumerate(events):
            sender.layers_ready(layer, layer + 1, ready=written)
        thread = threading.Thread(target=forward)
        thread.start()
        thread.join()
        assert poll_until(receiver, RoomStatus.SUCCESS) is RoomStatus.SUCCESS
        assert poll_until(sender, RoomStatus.SUCCESS) is RoomStatus.SUCCESS
        assert patterns.mismatches(decode._engine.pool, room, pages, 12) == 0
        assert patterns.aux_ok(decode._engine.pool, room, 1)
        with pytest.raises(LocalProtocolError, match="layers_ready"):
            sender.layers_ready(0, 1)


def test_start_lowers_the_gil_switch_interval_and_never_raises_it() -> None:
    """A facade engine lowers the process's switch interval to ``gil_switch_interval`` (the engine's
    loop thread gets the GIL back sooner from a busy scheduler thread), never raises it, and 0 leaves
    it alone."""
    saved = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        with engine("prefill", free_port(), gil_switch_interval=0.0005):
            assert sys.getswitchinterval() == pytest.approx(0.0005)
        sys.setswitchinterval(0.0001)
        with engine("prefill", free_port(), gil_switch_interval=0.0005):
            assert sys.getswitchinterval() == pytest.approx(0.0001)  # already lower: kept
        sys.setswitchinterval(0.005)
        with engine("prefill", free_port(), gil_switch_interval=0.0):
            assert sys.getswitchinterval() == pytest.approx(0.005)
        with pytest.raises(ConfigError, match="gil_switch_interval"):
            EngineConfig(role="prefill", gil_switch_interval=-1.0)
    finally:
        sys.setswitchinterval(saved)
