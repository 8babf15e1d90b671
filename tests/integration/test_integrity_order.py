"""When integrity's checksums are known (docs/INTEGRITY.md, "Where it is taken and compared"): the
decode takes its sum off the loop and counts a chunk only once it matched; the prefill starts a
WRITE only once the checksum its notification carries is known.

The sums here are the real ones over real pages, on both sides, moved over real NIXL; a gate
around ``PoolChecksums.enqueue`` holds a sum back (as a slow GPU or a loaded core would) to make
the order visible: a room whose last check is out has not succeeded (direct path); a WRITE whose seal never
comes never starts, and its room fails at its deadline, not hangs. Nothing leaks.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import pytest

from transfer_engine.config import EngineConfig
from transfer_engine.engine import TransferEngine
from transfer_engine.errors import FailureReason, LocalProtocolError, TransferFailed
from transfer_engine.memory.integrity import PoolChecksums, Sum
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.rooms import RoomStatus
from transfer_engine.testing import patterns
from transfer_engine.testing.cluster import Cluster, open_cluster
from transfer_engine.transport.faults import Fault, FaultyTransport, Rule, matching
from transfer_engine.transport.nixl import NixlTransport

from .harness import cluster, make_pool, shuffled_pages, small_layout
from .test_inspection import wait_for

pytestmark = pytest.mark.timeout(60)

_names = itertools.count()


@contextmanager
def gated(checksums: PoolChecksums) -> Iterator[tuple[threading.Event, list[Sum]]]:
    """Hold every sum ``checksums`` starts until the gate is set: its value is read only then (the
    sum itself is the real one). Yields the gate and the sums started."""
    gate = threading.Event()
    started: list[Sum] = []
    real = checksums.enqueue

    def enqueue(*args: Any, **kwargs: Any) -> Sum:
        inner = real(*args, **kwargs)
        done = threading.Event()

        def release() -> None:
            gate.wait()
            inner.value()
            done.set()

        threading.Thread(target=release, daemon=True).start()
        held = Sum(done, inner.value)
        started.append(held)
        return held

    checksums.enqueue = enqueue  # type: ignore[method-assign]
    try:
        yield gate, started
    finally:
        gate.set()
        checksums.enqueue = real  # type: ignore[method-assign]


async def next_room_is_exact(c: Cluster, rng: random.Random, room: int) -> None:
    """A 4-page room from prefill rank 0 to decode rank 0 succeeds on both sides within 10 s,
    byte-exact, and nothing leaks after it (sums flow again after what the test did)."""
    prefill, decode = c.prefill[0], c.decode[0]
    pages, dst = shuffled_pages(rng, 64, 4), shuffled_pages(rng, 64, 4)
    patterns.fill(prefill.pool, room, pages)
    receiver = await decode.receiver(room, c.bootstrap, dst)
    sender = prefill.sender(room)
    await sender.send(pages, last=True)
    with anyio.fail_after(10):
        await receiver.wait()
        await sender.wait()
    tokens = patterns.received_tokens(4, prefill.pool.layout.page_size, 4, decode.pool.layout.page_size)
    assert patterns.mismatches(decode.pool, room, dst, tokens) == 0
    c.assert_no_leaks()


@pytest.mark.anyio
@pytest.mark.parametrize("layerwise", [False, True], ids=["chunks", "layers"])
async def test_a_room_succeeds_only_after_its_last_check(layerwise: bool) -> None:
    """Direct path: every chunk (or group) of the room landed and only the decode's checks are out:
    the room has not succeeded; once they come back it does, byte-exact. (On the staged paths the
    check is taken behind the scatter, by the scatter's stream or thread, and comes with its end.)"""
    rng = random.Random(81)
    async with cluster(small_layout(), 1, 1, path="direct", layers_per_write=2, integrity=True) as c:
        decode = c.decode[0]
        checksums = decode.checksums
        assert checksums is not None
        pages, dst = shuffled_pages(rng, 64, 4), shuffled_pages(rng, 64, 4)
        patterns.fill(c.prefill[0].pool, 81, pages)
        with gated(checksums) as (gate, started):
            receiver = await decode.receiver(81, c.bootstrap, dst)
            sender = c.prefill[0].sender(81)
            if layerwise:
                await sender.begin_chunk(pages, last=True)
                for layer in range(c.prefill[0].pool.layout.num_layers):
                    await sender.layers_ready(layer, layer + 1)
            else:
                await sender.send(pages, last=True)
            await sender.wait()  # every WRITE of the room ended: its bytes are in the decode's memory
            await wait_for(lambda: checksums.pending > 0, "a check out")
            await anyio.sleep(0.2)  # time to succeed, were the checks not awaited
            assert receiver.status is not RoomStatus.SUCCESS
            assert not receiver.status.final
            assert decode.counters["integrity_match"] == 0
        with anyio.fail_after(10):
            await receiver.wait()
        assert checksums.pending == 0 and started
        assert decode.counters["integrity_match"] == decode.poller.counters["notifs"]
        tokens = patterns.received_tokens(
            4, c.prefill[0].pool.layout.page_size, 4, decode.pool.layout.page_size
        )
        assert patterns.mismatches(decode.pool, 81, dst, tokens) == 0
        c.assert_no_leaks()


@pytest.mark.anyio
@pytest.mark.parametrize("layerwise", [False, True], ids=["chunks", "layers"])
async def test_a_seal_that_never_comes_fails_the_room_at_its_deadline(layerwise: bool) -> None:
    """The prefill's checksum of a chunk (or of a layer group, summed once its layers are written)
    never completes: its WRITE never starts (no byte moves unsealed) and the room fails at its
    deadline on both sides instead of hanging; the held WRITE is dropped, nothing leaks, and the
    next room (sums flowing again) succeeds. (Direct path: a staged chunk's seal is summed behind
    its gather, by the gather's stream or thread, and is known when the gather is.)"""
    rng = random.Random(82)
    async with cluster(
        small_layout(),
        1,
        1,
        path="direct",
        layers_per_write=2,
        integrity=True,
        transfer_timeout=1.0,
        room_lease=1.0,
    ) as c:
        prefill = c.prefill[0]
        checksums = prefill.checksums
        assert checksums is not None
        pages, dst = shuffled_pages(rng, 64, 4), shuffled_pages(rng, 64, 4)
        patterns.fill(prefill.pool, 82, pages)
        with gated(checksums) as (gate, started):
            receiver = await c.decode[0].receiver(82, c.bootstrap, dst)
            sender = prefill.sender(82)
            if layerwise:
                await sender.begin_chunk(pages, last=True)
                for layer in range(prefill.pool.layout.num_layers):
                    await sender.layers_ready(layer, layer + 1)
            else:
                await sender.send(pages, last=True)
            with anyio.fail_after(15), pytest.raises(TransferFailed) as failed:
                await receiver.wait()
            assert failed.value.reason in (FailureReason.TRANSFER_TIMEOUT, FailureReason.REMOTE), failed.value
            with anyio.fail_after(15), pytest.raises(TransferFailed):
                await sender.wait()
            assert started and not started[0].done.is_set()  # ended with its seal still out
            assert prefill.poller.counters["writes_posted"] == 0
            assert c.decode[0].poller.counters["notifs"] == 0
        c.assert_no_leaks()
        await next_room_is_exact(c, rng, 83)


@contextlib.asynccontextmanager
async def flipping(rule: Rule, path: str) -> AsyncIterator[Cluster]:
    """P=1 -> D=1 on ``DEVICE`` (CUDA under ``TE_TEST_DEVICE=cuda``), integrity on, layer groups of
    one layer; the prefill's transport is the fault-injecting wrapper around its real NIXL one."""

    def make(role: str, rank: int, port: int) -> TransferEngine:
        name = f"order-{role}-{rank}-{os.getpid()}-{next(_names)}"
        fields = {"num_workers": 2} if role == "prefill" else {}
        cfg = EngineConfig(
            role=role, tp_size=1, tp_rank=rank, bootstrap_port=port, agent_name=name, path=path,
            layers_per_write=1, integrity=True, **fields,  # type: ignore[arg-type]
        )  # fmt: skip
        transport = FaultyTransport(NixlTransport(name), writes=[rule]) if role == "prefill" else None
        return TransferEngine(cfg, make_pool("contiguous", small_layout(), 1, rank, 64), transport=transport)

    async with open_cluster(make, 1, 1) as c:
        yield c


@pytest.mark.anyio
@pytest.mark.parametrize("order", ["last", "free"])
@pytest.mark.parametrize("path", ["direct", "staged"])
async def test_a_flip_in_the_last_group_fails_the_room_beside_a_clean_one(path: str, order: str) -> None:
    """Two layer-wise rooms at once; only the first room's very last group is flipped in flight. It
    fails INTEGRITY naming that group and its pages are not reported loaded; the other room succeeds
    byte-exact; nothing leaks. (The chaos suite runs the FLIP rule on every path on CPU; this one also
    runs on CUDA pools, where the sums are the GPU kernels: the summing gather, the page sum on the
    checksum stream, the scatter's sum on the scatter stream.)

    ``last``: the flipped group is sent once every other group of both rooms matched, so the mismatch
    is the room's last check and every other check counted (exactly). ``free``: every group is sent
    at once; separate WRITEs may land in any order and a check that comes back after its room failed
    is not counted, so only the clean room's matches are certain (a race this order leaves open)."""
    layers = small_layout().num_layers

    def last_group(payload: bytes) -> bool:
        if not matching(m.ChunkLanded, room=91)(payload):
            return False
        landed = m.decode(payload)
        assert isinstance(landed, m.ChunkLanded) and landed.layers is not None
        return landed.last and landed.layers[1] == layers

    rule = Rule(Fault.FLIP, match=last_group)
    rng = random.Random(91)
    async with flipping(rule, path) as c:
        prefill, decode = c.prefill[0], c.decode[0]
        pages = {91: shuffled_pages(rng, 32, 4), 92: shuffled_pages(rng, 32, 4) + 32}
        dst = {91: shuffled_pages(rng, 32, 4), 92: shuffled_pages(rng, 32, 4) + 32}
        receivers, senders = {}, {}
        for room in (91, 92):
            patterns.fill(prefill.pool, room, pages[room])
            receivers[room] = await decode.receiver(room, c.bootstrap, dst[room])
            senders[room] = prefill.sender(room)
        for room in (91, 92):
            for first, last in ((0, False), (2, True)):
                await senders[room].begin_chunk(pages[room][first : first + 2], last=last)
                held = order == "last" and room == 91 and last  # its last group goes below
                for layer in range(layers - 1 if held else layers):
                    with contextlib.suppress(LocalProtocolError):  # free: the flipped room failed meanwhile
                        await senders[room].layers_ready(layer, layer + 1)
        if order == "last":
            await wait_for(
                lambda: decode.counters["integrity_match"] == 2 * 2 * layers - 1, "every other group"
            )
            with contextlib.suppress(LocalProtocolError):  # the flipped room failed meanwhile
                await senders[91].layers_ready(layers - 1, layers)
        with anyio.fail_after(15), pytest.raises(TransferFailed) as failed:
            await receivers[91].wait()
        assert failed.value.reason is FailureReason.INTEGRITY
        assert f"layers [{layers - 1}, {layers})" in failed.value.detail
        with anyio.fail_after(15):
            await receivers[92].wait()
        tokens = patterns.received_tokens(4, prefill.pool.layout.page_size, 4, decode.pool.layout.page_size)
        assert patterns.mismatches(decode.pool, 92, dst[92], tokens) == 0
        assert rule.fired == 1
        assert decode.counters["integrity_mismatch"] == 1
        if order == "last":
            assert decode.counters["integrity_match"] == 2 * 2 * layers - 1
        else:  # the clean room's every group, and at most every other group of the flipped one
            assert 2 * layers <= decode.counters["integrity_match"] <= 2 * 2 * layers - 1
        for room in (91, 92):
            with anyio.fail_after(15), contextlib.suppress(TransferFailed):
                await senders[room].wait()
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_a_room_cancelled_before_its_kv_was_written_does_not_hold_later_seals() -> None:
    """CPU pools take the prefill's sums on one checksum thread, each after the KV it reads is
    written. A layer-wise room aborted with layers never written must not keep that thread waiting:
    the next room's seals are taken and it succeeds at once, not at its deadline."""
    rng = random.Random(84)
    async with cluster(
        small_layout(), 1, 1, path="direct", layers_per_write=1, integrity=True, transfer_timeout=30.0
    ) as c:
        prefill = c.prefill[0]
        pages, dst = shuffled_pages(rng, 64, 4), shuffled_pages(rng, 64, 4)
        patterns.fill(prefill.pool, 84, pages)
        receiver = await c.decode[0].receiver(84, c.bootstrap, dst)
        sender = prefill.sender(84)
        await sender.begin_chunk(pages, last=True)
        await sender.layers_ready(0, 1)
        never = threading.Event()  # the thread writing the later layers never sets it
        await sender.layers_ready(1, prefill.pool.layout.num_layers, ready=never)
        await wait_for(lambda: prefill.poller.counters["writes_posted"] >= 1, "the first group's WRITE")
        await anyio.sleep(0.2)  # the later groups' seals are started and wait for their KV
        await sender.abort()
        with anyio.fail_after(10), pytest.raises(TransferFailed):
            await receiver.wait()
        await next_room_is_exact(c, rng, 85)
