"""Inspection of live engines: ``transfer-engine dump`` mid-transfer and after, and Prometheus metrics.

Real NIXL and ZMQ. The slow link is a transport that holds a prefill rank's WRITEs back (they are
posted to NIXL only once the test opens the gate), so the dump sees a room waiting for that rank
for as long as the test looks at it, with no timing assumptions.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import anyio
import msgspec
import numpy as np
import pytest
import zmq
import zmq.asyncio
import zmq.auth
from prometheus_client.parser import text_string_to_metric_families

from transfer_engine.actors.introspect import Introspect
from transfer_engine.config import EngineConfig
from transfer_engine.engine import TransferEngine
from transfer_engine.memory.layout import KVPool
from transfer_engine.observe import Counters, NixlSnapshot, Snapshot, cli, decode_snapshot
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.rooms import RoomStatus
from transfer_engine.testing import patterns
from transfer_engine.transport.nixl import NixlTransport, XferState

from .harness import Cluster, cluster, free_port, run_room, shuffled_pages, small_layout


class GatedTransport(NixlTransport):
    """The real NIXL transport, except that WRITEs wait behind a gate: a link that is very slow.

    While the gate is shut, ``start_write`` only records the (made) WRITE and its state reads PROC;
    the first poll after ``open()`` starts it in NIXL for real, and from then on it is an ordinary
    WRITE.
    """

    def __init__(self, name: str) -> None:
        super().__init__(name, progress_thread=False)
        self.gate_open = False
        self._held: dict[int, bytes] = {}
        """Held WRITEs and the notification each was started with."""

    def start_write(self, handle: int, notif: bytes = b"") -> int:
        if self.gate_open:
            return super().start_write(handle, notif)
        self._held[handle] = notif
        return handle

    def state(self, handle: int) -> XferState:
        if handle in self._held:
            if not self.gate_open:
                return XferState.PROC
            super().start_write(handle, self._held.pop(handle))
        return super().state(handle)

    def release(self, handle: int) -> None:
        self._held.pop(handle, None)
        super().release(handle)

    def close(self) -> None:
        self._held.clear()
        super().close()


async def dump(engine: TransferEngine, *args: str) -> tuple[int, str, str]:
    """Run ``transfer-engine dump`` against ``engine`` in a thread (the engine's loop keeps serving)."""

    def run() -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        code = cli.main(["dump", "--endpoint", engine.introspect_endpoint, *args], stdout=out, stderr=err)
        return code, out.getvalue(), err.getvalue()

    return await anyio.to_thread.run_sync(run)


async def snapshot(engine: TransferEngine, *args: str) -> Snapshot:
    code, out, err = await dump(engine, "--json", *args)
    assert code == 0, err
    return msgspec.json.decode(out, type=Snapshot)


async def wait_for(predicate: Any, what: str) -> None:
    """Poll engine state (no event exists for these conditions) until ``predicate()``; 10 s at most."""
    with anyio.fail_after(10):
        while not predicate():  # noqa: ASYNC110
            await anyio.sleep(0.01)


@pytest.mark.anyio
async def test_dump_shows_a_room_waiting_for_its_slow_writer_then_done() -> None:
    """P=2 -> D=1 (slice path): prefill rank 1's WRITEs are held; the dumps say so, then say done."""
    layout = small_layout()  # 8 heads: prefill rank p writes heads [4p, 4p+4) of the decode rank
    port, room, n_pages = free_port(), 77, 4
    gated = GatedTransport(f"te-test-gated-prefill-1-{os.getpid()}")
    rng = np.random.default_rng(0)
    src = rng.permutation(16)[:n_pages].astype(np.int64)
    dst = rng.permutation(16)[:n_pages].astype(np.int64)
    async with contextlib.AsyncExitStack() as stack:
        prefill = []
        for rank in range(2):
            cfg = EngineConfig(role="prefill", tp_size=2, tp_rank=rank, bootstrap_port=port, num_workers=1,
                               agent_name=gated.name if rank == 1 else "")  # fmt: skip
            pool = KVPool.allocate(layout, 2, rank, 16)
            engine = TransferEngine(cfg, pool, transport=gated if rank == 1 else None)
            prefill.append(await stack.enter_async_context(engine))
        decode_cfg = EngineConfig(role="decode", bootstrap_port=port, path="slice")
        decode = await stack.enter_async_context(
            TransferEngine(decode_cfg, KVPool.allocate(layout, 1, 0, 16))
        )
        c = Cluster(prefill, [decode], f"tcp://127.0.0.1:{port}")

        for engine in prefill:
            patterns.fill(engine.pool, room, src)
        receiver = await decode.receiver(room, c.bootstrap, dst)
        senders = [engine.sender(room) for engine in prefill]
        for sender in senders:
            await sender.send(src, last=True)
        with anyio.fail_after(10):
            await senders[0].wait()
        await wait_for(lambda: receiver.poll() is RoomStatus.TRANSFERRING, "decode room TRANSFERRING")
        await wait_for(lambda: prefill[1].poller.in_flight() == 1, "prefill rank 1's WRITE held at the gate")

        # Decode: the room waits for prefill rank 1, and only for it.
        snap = await snapshot(decode)
        assert (snap.role, snap.introspect_endpoint) == ("decode", decode.introspect_endpoint)
        (r,) = snap.rooms
        assert (r.room, r.side, r.state) == (room, "decode", "TRANSFERRING")
        assert [(p.rank, p.chunks_done, p.chunks_expected, p.done, p.waiting_for) for p in r.progress] == [
            (0, 1, 1, True, ""),
            (1, 0, 1, False, "chunk 0"),
        ]
        assert r.waiting_for == "prefill rank 1 (chunk 0)"
        assert r.history == []  # only a dump that names the room carries histories
        assert sorted(p.rank for p in snap.peers) == [0, 1] and all(p.alive for p in snap.peers)
        code, table, _ = await dump(decode)
        assert code == 0
        assert "TRANSFERRING (1)" in table and "prefill rank 1 (chunk 0)" in table

        # Prefill rank 1: its WRITE is in flight, held at the gate.
        snap = await snapshot(prefill[1])
        (r,) = snap.rooms
        assert (r.room, r.side, r.state, r.writes_in_flight) == (room, "prefill", "TRANSFERRING", 1)
        assert [(p.rank, p.chunks_done, p.done, p.waiting_for) for p in r.progress] == [
            (0, 0, False, "chunk 0")
        ]
        assert r.waiting_for == "decode rank 0 (chunk 0)"
        token_bytes = 4 * 16 * 2 * 2 * 3  # 4 heads x head_dim 16 x bf16, K and V of 3 layers
        assert (r.bytes_done, r.bytes_expected) == (0, n_pages * 4 * token_bytes)  # page_size 4
        assert (snap.nixl.writes_in_flight, snap.nixl.handles_live) == (1, 1)
        assert [(p.agent, p.writes_in_flight) for p in snap.peers] == [(decode.agent_name, 1)]
        assert len(snap.workers) == 1

        gated.gate_open = True
        with anyio.fail_after(10):
            await senders[1].wait()
            await receiver.wait()
        tokens = patterns.received_tokens(n_pages, 4, n_pages, 4)
        assert patterns.mismatches(decode.pool, room, dst, tokens) == 0

        # After: nothing live, the room among the ended ones with its history, counters moved.
        snap = await snapshot(decode, "--room", str(room))
        assert snap.rooms == []
        (r,) = snap.ended
        assert (r.room, r.state, r.failure_reason, r.waiting_for) == (room, "SUCCESS", None, "")
        assert [h.event for h in r.history] == [
            "BOOTSTRAPPING",
            "WAITING_FOR_INPUT",
            "TRANSFERRING",
            "SUCCESS",
        ]
        assert r.ended_at is not None and r.bytes_done == r.bytes_expected
        assert snap.counters.rooms_by_outcome == {"SUCCESS": 1}
        assert snap.counters.failures_by_reason == {}
        assert snap.counters.notifications == 2
        code, table, _ = await dump(decode, "--room", str(room))
        assert code == 0 and f"room {room} (decode): ended SUCCESS" in table and "+" in table

        snap = await snapshot(prefill[1])
        assert snap.rooms == [] and snap.ended[0].state == "SUCCESS"
        assert snap.ended[0].bytes_done == snap.ended[0].bytes_expected == n_pages * 4 * token_bytes
        assert snap.counters.writes_done == 1 and snap.counters.bytes_written == n_pages * 4 * token_bytes
        assert (snap.nixl.writes_in_flight, snap.nixl.handles_live) == (0, 0)

        code, _, err = await dump(decode, "--room", "123456")
        assert code == 1, "a room that is neither live nor kept is an error"
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_introspection_drops_malformed_frames_and_keeps_answering() -> None:
    layout = small_layout()
    engine_cfg = EngineConfig(role="decode", bootstrap_port=free_port())
    async with TransferEngine(engine_cfg, KVPool.allocate(layout, 1, 0, 8)) as engine:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        try:
            sock.connect(engine.introspect_endpoint)
            for frames in (
                [b"\x93not msgpack of a message"],
                [b"two", b"frames"],
                [m.encode(m.Heartbeat(agent="x", rank=0, side="prefill", seq=1))],
                [m.encode(m.DumpRequest())],
            ):
                await sock.send_multipart(frames)
            with anyio.fail_after(10):
                reply = m.decode(await sock.recv())
        finally:
            sock.close(linger=0)
            ctx.term()
        assert isinstance(reply, m.DumpReply)
        dropped = decode_snapshot(reply.snapshot).counters.dropped_by_kind  # the frames before it were read
        assert dropped == {"introspect.bad_frames": 1, "introspect.malformed": 1, "introspect.unexpected": 1}

        code, out, err = await dump(engine, "--json", "--watch", "--count", "2", "--interval", "0.05")
        assert code == 0, err
        first, second = (msgspec.json.decode(line, type=Snapshot) for line in out.splitlines())
        assert second.taken_at >= first.taken_at
        assert first.counters.dropped_by_kind == dropped
        ring = getattr(engine, "ring", None)
        assert (first.ring is None) == (ring is None)
        if ring is not None and first.ring is not None:
            assert first.ring.size == ring.allocator.size and first.ring.live == 0
        assert engine.leaks() == dict.fromkeys(engine.leaks(), 0)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@pytest.mark.anyio
async def test_metrics_endpoint_counts_rooms_and_sizes() -> None:
    rng = random.Random(3)
    async with cluster(small_layout(), 1, 1, metrics_port=0) as c:
        prefill, decode = c.prefill[0], c.decode[0]
        assert prefill.metrics_endpoint is not None and decode.metrics_endpoint is not None
        await run_room(c, 5, shuffled_pages(rng, 64, 6), shuffled_pages(rng, 64, 6), [2, 4], aux_slot=1)
        await wait_for(lambda: not prefill.rooms and not decode.rooms, "rooms to end")
        p = await anyio.to_thread.run_sync(scrape, prefill.metrics_endpoint)
        d = await anyio.to_thread.run_sync(scrape, decode.metrics_endpoint)
        room_bytes = 6 * 4 * (8 * 16 * 2) * 6  # 6 pages of 4 tokens, 8 heads x 16 x bf16, 6 KV tensors
        for samples in (p, d):
            assert samples[("transfer_engine_rooms_total", (("outcome", "success"),))] == 1
            assert samples[("transfer_engine_rooms_opened_total", ())] == 1
            assert samples[("transfer_engine_transfer_latency_seconds_count", (("outcome", "success"),))] == 1
            assert samples[("transfer_engine_writes_in_flight", ())] == 0
        assert p[("transfer_engine_transfer_size_bytes_count", ())] == 1
        assert p[("transfer_engine_transfer_size_bytes_sum", ())] == room_bytes
        assert p[("transfer_engine_bytes_written_total", ())] == room_bytes + 16  # and the aux item
        assert p[("transfer_engine_writes_total", (("result", "done"),))] == 3
        assert ("transfer_engine_worker_queue_depth", (("worker", "0"),)) in p
        assert d[("transfer_engine_notifications_total", ())] == 3
        info = [k for k in d if k[0] == "transfer_engine_info"]
        assert dict(info[0][1])["role"] == "decode"
        if getattr(decode, "ring", None) is not None:
            assert d[("transfer_engine_ring_occupancy_ratio", ())] == 0
        missing = decode.metrics_endpoint.replace("/metrics", "/nope")
        with pytest.raises(urllib.error.HTTPError) as info:
            await anyio.to_thread.run_sync(scrape, missing)
        info.value.close()
        assert info.value.code == 404
        c.assert_no_leaks()


def tiny_snapshot(room: int | None) -> Snapshot:
    return Snapshot(
        role="decode", tp_rank=0, tp_size=1, agent="a", control_endpoint="", introspect_endpoint="",
        metrics_endpoint=None, taken_at=0.0, uptime_s=1.0, rooms=[], ended=[], workers=[], ring=None,
        peers=[], nixl=NixlSnapshot(writes_in_flight=0, handles_live=0),
        counters=Counters(bytes_written=0, writes_posted=0, writes_done=0, writes_failed=0, notifications=0,
                          rooms_opened=room or 0, rooms_by_outcome={}, failures_by_reason={},
                          dropped_by_kind={}, raw={}),
    )  # fmt: skip


@pytest.mark.anyio
async def test_dump_over_curve(tmp_path: Path) -> None:
    """The actor applies ``secure`` before binding; the CLI talks CURVE with the certificate flags."""
    server_public, server_secret = zmq.auth.create_certificates(str(tmp_path), "server")
    _, client_secret = zmq.auth.create_certificates(str(tmp_path), "client")

    def secure(sock: zmq.asyncio.Socket) -> None:
        public, secret = zmq.auth.load_certificate(server_secret)
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True

    actor = Introspect("127.0.0.1", 0, tiny_snapshot, secure=secure)
    async with anyio.create_task_group() as tg:
        await tg.start(actor.run)

        def run(*flags: str) -> tuple[int, str, str]:
            out, err = io.StringIO(), io.StringIO()
            argv = ["dump", "--endpoint", actor.endpoint, "--json", "--room", "3", "--timeout", "0.5", *flags]
            return cli.main(argv, stdout=out, stderr=err), out.getvalue(), err.getvalue()

        code, out, err = await anyio.to_thread.run_sync(
            run, "--curve-secret-key-file", client_secret, "--curve-server-key-file", server_public
        )
        assert code == 1, "room 3 is not in the snapshot"  # but the snapshot came, over CURVE
        assert msgspec.json.decode(out, type=Snapshot).counters.rooms_opened == 3
        code, out, err = await anyio.to_thread.run_sync(run)
        assert (code, out) == (1, "") and "no answer within 0.5 s" in err, "a plain client gets nothing"
        tg.cancel_scope.cancel()
    assert actor.served == 1


def test_console_script_reports_an_unreachable_endpoint() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "transfer_engine.observe.cli",
            "dump",
            "--endpoint",
            endpoint,
            "--timeout",
            "0.3",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 1 and done.stdout == ""
    assert f"peer {endpoint} unreachable: no answer within 0.3 s" in done.stderr
