"""Bits flipped in flight (``Fault.FLIP`` around the real transport): integrity catches every one.

The prefill's WRITE carries the checksum of its bytes, taken as it starts; the fault then flips one
random bit of those bytes in the source memory (put back once the WRITE ended), so the decode
receives a corrupted byte over real NIXL. On every path, whole chunks and layer-wise: the decode
fails the room with INTEGRITY and never counts the chunk, a prefill room still live fails with
INTEGRITY too (the decode's Abort says why), no flipped room succeeds, clean rooms beside them do
with every byte right, and nothing leaks (docs/INTEGRITY.md).

The pools are on ``TE_TEST_DEVICE`` (``tests.integration.harness.DEVICE``): the CPU in CI, CUDA on
the GPU machine (``tools/gpu_e2e.sh cuda``), where the flipped bit is in VRAM (or in the staging
lease the gather kernel summed as it wrote it) and the sums are the CUDA kernels'.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator

import anyio
import numpy as np
import pytest
import torch

from tests.integration.harness import DEVICE, Cluster, shuffled_pages
from transfer_engine.engine import Receiver, Sender
from transfer_engine.errors import FailureReason, LocalProtocolError
from transfer_engine.protocol import messages as m
from transfer_engine.testing import patterns
from transfer_engine.transport.faults import Fault, FaultyTransport, Rule, matching

from .helpers import engines, faulty_factory
from .test_faults import failure_of, outcome, run_rooms

pytestmark = pytest.mark.timeout(90)

PATHS = [
    pytest.param("direct", 1, 1, id="direct"),
    pytest.param("slice", 2, 1, id="slice"),
    pytest.param("staged", 2, 1, id="staged"),
    pytest.param("staged", 1, 2, id="staged-D2"),
    pytest.param("host", 1, 1, id="host"),
]


@contextlib.asynccontextmanager
async def flipping(
    P: int, D: int, path: str, rule: Rule, wrapped: list[FaultyTransport] | None = None
) -> AsyncIterator[Cluster]:
    """P -> D engines on ``path`` with their pools on ``DEVICE``, integrity on, layer groups of one
    layer, each prefill's real NIXL transport wrapped in the fault transport with ``rule`` (the
    wrappers appended to ``wrapped``)."""
    transport = faulty_factory([] if wrapped is None else wrapped, writes=[rule])
    async with engines(
        P, D, path=path, layers_per_write=1, prefill_transport=transport, integrity=True, device=DEVICE
    ) as c:
        assert {e.pool.device.type for e in c.engines} == {torch.device(DEVICE).type}
        yield c


async def send_first_chunk(
    c: Cluster, room: int, pages: np.ndarray, dst: np.ndarray, layerwise: bool
) -> tuple[list[Sender], list[Receiver]]:
    """Open ``room`` on every rank and send its first chunk only (not the last): the prefill rooms
    stay live, waiting for more, when the decode judges that chunk."""
    for engine in c.prefill:
        patterns.fill(engine.pool, room, pages)
    receivers = [await engine.receiver(room, c.bootstrap, dst) for engine in c.decode]
    senders = [engine.sender(room) for engine in c.prefill]
    layers = c.prefill[0].pool.layout.num_layers
    for sender in senders:
        if not layerwise:
            await sender.send(pages[:2], last=False)
            continue
        await sender.begin_chunk(pages[:2], last=False)
        for layer in range(layers):
            with contextlib.suppress(LocalProtocolError):  # the room failed meanwhile
                await sender.layers_ready(layer, layer + 1)
    return senders, receivers


@pytest.mark.anyio
@pytest.mark.parametrize("layerwise", [False, True], ids=["chunks", "layers"])
@pytest.mark.parametrize(("path", "P", "D"), PATHS)
async def test_a_flipped_bit_fails_the_room_with_integrity_on_both_sides(
    path: str, P: int, D: int, layerwise: bool
) -> None:
    wrapped: list[FaultyTransport] = []
    rule = Rule(Fault.FLIP, match=matching(m.ChunkLanded, room=61))  # the room's first chunk WRITE
    rng = random.Random(61)
    async with flipping(P, D, path, rule, wrapped) as c:
        pages, dst = shuffled_pages(rng, 64, 4), shuffled_pages(rng, 64, 4)
        senders, receivers = await send_first_chunk(c, 61, pages, dst, layerwise)
        failures = [await failure_of(receiver) for receiver in receivers]
        # the rank the flipped WRITE went to: INTEGRITY; another decode rank hears of it from the prefill
        caught = [f for f in failures if f.reason is FailureReason.INTEGRITY]
        assert len(caught) == 1 and all(f.reason is FailureReason.REMOTE for f in failures if f not in caught)
        assert caught[0].detail.startswith("integrity: ") and "checksum" in caught[0].detail
        assert [await outcome(sender) for sender in senders] == ["INTEGRITY"] * P
        assert rule.fired == 1 and sum(t.fired["flip"] for t in wrapped) == 1
        assert sum(e.counters["integrity_mismatch"] for e in c.decode) >= 1
        assert sum(e.counters["failed_integrity"] for e in c.decode) == 1
        assert sum(e.counters["failed_integrity"] for e in c.prefill) == P
        await run_rooms(c, [62], [2, 2], seed=62, aux=False, layers=1 if layerwise else 0)
        assert all(e.counters["rooms_success"] == 1 for e in c.decode)
        c.assert_no_leaks()


@pytest.mark.anyio
@pytest.mark.parametrize("layerwise", [False, True], ids=["chunks", "layers"])
@pytest.mark.parametrize(("path", "P", "D"), [PATHS[0], PATHS[2]])
async def test_every_flipped_room_is_caught_and_none_succeeds(
    path: str, P: int, D: int, layerwise: bool
) -> None:
    """Eight rooms at once, every chunk WRITE of four of them flipped: those four fail with
    INTEGRITY on the decode (wherever their flips landed), the other four succeed byte-exact."""
    rooms = list(range(70, 78))
    flipped = set(rooms[::2])

    def of_flipped_rooms(payload: bytes) -> bool:
        return any(matching(m.ChunkLanded, room=room)(payload) for room in flipped)

    rule = Rule(Fault.FLIP, match=of_flipped_rooms, times=None)
    rng = random.Random(70)
    async with flipping(P, D, path, rule) as c:
        src = rng.sample(range(64), 4 * len(rooms))
        dst = rng.sample(range(64), 4 * len(rooms))
        receivers: dict[int, Receiver] = {}
        senders: dict[int, list[Sender]] = {}
        for i, room in enumerate(rooms):
            pages, pages_dst = np.array(src[4 * i : 4 * i + 4]), np.array(dst[4 * i : 4 * i + 4])
            for engine in c.prefill:
                patterns.fill(engine.pool, room, pages)
            receivers[room] = await c.decode[0].receiver(room, c.bootstrap, pages_dst)
            senders[room] = [engine.sender(room) for engine in c.prefill]
            for sender in senders[room]:
                # a flipped room may have failed before its later calls: they are refused then
                with contextlib.suppress(*((LocalProtocolError,) if room in flipped else ())):
                    for first, last in ((0, False), (2, True)):
                        if not layerwise:
                            await sender.send(pages[first : first + 2], last=last)
                            continue
                        await sender.begin_chunk(pages[first : first + 2], last=last)
                        for layer in range(c.prefill[0].pool.layout.num_layers):
                            await sender.layers_ready(layer, layer + 1)
        ended: dict[int, str] = {}
        async with anyio.create_task_group() as tg:
            for room, receiver in receivers.items():

                async def judge(room: int = room, receiver: Receiver = receiver) -> None:
                    ended[room] = await outcome(receiver)

                tg.start_soon(judge)
        assert {room for room, how in ended.items() if how == "INTEGRITY"} == flipped, ended
        assert {room for room, how in ended.items() if how == "SUCCESS"} == set(rooms) - flipped, ended
        tokens = patterns.received_tokens(
            4, c.prefill[0].pool.layout.page_size, 4, c.decode[0].pool.layout.page_size
        )
        for i, room in enumerate(rooms):
            if room not in flipped:
                assert (
                    patterns.mismatches(c.decode[0].pool, room, np.array(dst[4 * i : 4 * i + 4]), tokens) == 0
                )
        for room in rooms:
            for sender in senders[room]:
                await outcome(sender)  # every prefill room ended
        assert c.decode[0].counters["failed_integrity"] == len(flipped)
        assert c.decode[0].counters["integrity_mismatch"] >= len(flipped)
        assert rule.fired >= len(flipped)
        c.assert_no_leaks()


@pytest.mark.anyio
@pytest.mark.parametrize(("path", "P", "D"), [PATHS[0], PATHS[2], PATHS[4]])
async def test_a_flip_in_the_last_layer_group_fails_the_room_at_its_last_check(
    path: str, P: int, D: int
) -> None:
    """Layer-wise, only the room's very last group (prefill rank 0's) is flipped, and it is sent only
    once every other group matched (each checked as it landed; separate WRITEs may land in any order,
    so the test orders them): the mismatch is found at the room's last check, the one left when
    every other byte has landed and matched. The room still fails with INTEGRITY, its pages are not
    reported loaded, and nothing leaks."""
    layers = 3

    def last_group(payload: bytes) -> bool:
        if not matching(m.ChunkLanded, room=63)(payload):
            return False
        landed = m.decode(payload)
        assert isinstance(landed, m.ChunkLanded)
        return landed.sender == 0 and landed.last and landed.layers is not None and landed.layers[1] == layers

    rule = Rule(Fault.FLIP, match=last_group)
    rng = random.Random(63)
    async with flipping(P, D, path, rule) as c:
        assert c.prefill[0].pool.layout.num_layers == layers
        pages, dst = shuffled_pages(rng, 64, 4), shuffled_pages(rng, 64, 4)
        for engine in c.prefill:
            patterns.fill(engine.pool, 63, pages)
        receivers = [await engine.receiver(63, c.bootstrap, dst) for engine in c.decode]
        senders = [engine.sender(63) for engine in c.prefill]
        decode = c.decode[0]
        for rank, sender in enumerate(senders):
            await sender.begin_chunk(pages[:2], last=False)
            for layer in range(layers):
                await sender.layers_ready(layer, layer + 1)
            await sender.begin_chunk(pages[2:], last=True)
            for layer in range(layers if rank else layers - 1):
                await sender.layers_ready(layer, layer + 1)
        with anyio.fail_after(10):  # no event says a check matched
            while decode.counters["integrity_match"] < 2 * layers * P - 1:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        with contextlib.suppress(LocalProtocolError):  # the room failed meanwhile
            await senders[0].layers_ready(layers - 1, layers)
        failures = [await failure_of(receiver) for receiver in receivers]
        assert [f.reason for f in failures] == [FailureReason.INTEGRITY] * D
        assert f"layers [{layers - 1}, {layers})" in failures[0].detail
        assert rule.fired == 1
        assert decode.counters["integrity_mismatch"] == 1
        # every group but the flipped one matched: two chunks of three groups from each writer
        assert decode.counters["integrity_match"] == 2 * layers * P - 1
        for sender in senders:
            assert await outcome(sender) in ("SUCCESS", "INTEGRITY")  # its WRITEs may all have ended
        c.assert_no_leaks()
