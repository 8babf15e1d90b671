"""The cost signal (docs/INTEGRITY.md, "The cost signal"): a decode rank's estimate of a new room
from a prefill instance, and a router's choice by it.

One prefill instance and two decode instances (each TP 1, its own engine); one decode's
notifications come late (a DELAY rule of the fault-injecting transport around its real one), as a
congested link would make them. After a few rooms each, the slowed instance's estimate for a new
room is the larger; new requests routed by ``protocol.cost.choose`` over the two estimates go to
the other while they are in flight together; every room on both is byte-exact, and nothing leaks.
"""

from __future__ import annotations

import random

import anyio
import numpy as np
import pytest

from tests.chaos.helpers import faulty_factory, make_engine
from transfer_engine.engine import Receiver, Sender, TransferEngine
from transfer_engine.engine.snapshot import build_snapshot
from transfer_engine.errors import ConfigError
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.cost import DEFAULT_PRIOR_RATE, choose
from transfer_engine.testing import patterns
from transfer_engine.testing.cluster import Cluster, open_cluster
from transfer_engine.transport.faults import Fault, FaultyTransport, Rule, matching

pytestmark = pytest.mark.timeout(60)

DELAY_S = 0.25
PAGES = 4


class Pair:
    """The cluster: ``slow`` and ``fast`` are two decode instances of one prefill instance."""

    def __init__(self, c: Cluster) -> None:
        self.c = c
        self.prefill = c.prefill[0]
        self.slow, self.fast = c.decode
        self.rng = random.Random(5)
        self.free = {id(d): list(range(64)) for d in c.decode}
        self.src_free = list(range(64))
        self.open: list[tuple[TransferEngine, int, np.ndarray, np.ndarray, Sender, Receiver]] = []

    def room_bytes(self) -> int:
        return PAGES * self.fast.pool.page_bytes

    async def start(self, decode: TransferEngine, room: int) -> None:
        """Open ``room`` from the prefill to ``decode`` and send it whole (not waited for)."""
        src = np.array([self.src_free.pop(self.rng.randrange(len(self.src_free))) for _ in range(PAGES)])
        free = self.free[id(decode)]
        dst = np.array([free.pop(self.rng.randrange(len(free))) for _ in range(PAGES)])
        patterns.fill(self.prefill.pool, room, src)
        receiver = await decode.receiver(room, self.c.bootstrap, dst)
        sender = self.prefill.sender(room)
        await sender.send(src, last=True)
        self.open.append((decode, room, src, dst, sender, receiver))

    async def finish(self) -> None:
        """Wait for every open room; check each decode's bytes; give the pages back."""
        with anyio.fail_after(30):
            for decode, room, src, dst, sender, receiver in self.open:
                await sender.wait()
                await receiver.wait()
                tokens = patterns.received_tokens(
                    PAGES, self.prefill.pool.layout.page_size, PAGES, decode.pool.layout.page_size
                )
                assert patterns.mismatches(decode.pool, room, dst, tokens) == 0, room
                self.free[id(decode)].extend(dst.tolist())
                self.src_free.extend(src.tolist())
        self.open.clear()


@pytest.mark.anyio
async def test_new_requests_go_to_the_decode_instance_that_is_not_slowed() -> None:
    wrapped: list[FaultyTransport] = []
    late = Rule(Fault.DELAY, match=matching(m.ChunkLanded), times=None, delay_s=DELAY_S)
    slowed = faulty_factory(wrapped, notifs=[late])

    def make(role: str, rank: int, port: int) -> TransferEngine:
        if role == "prefill":
            return make_engine("prefill", 1, 0, port)
        return make_engine("decode", 1, 0, port, transport=slowed if rank == 0 else None)  # own instances

    async with open_cluster(make, 1, 2) as c:
        pair = Pair(c)
        n = pair.room_bytes()
        # nothing measured yet: both are the prior, and a tie goes to the first named
        assert pair.slow.estimate_transfer(c.bootstrap, n) == pair.fast.estimate_transfer(c.bootstrap, n)
        assert pair.fast.estimate_transfer(c.bootstrap, n) == pytest.approx(n / DEFAULT_PRIOR_RATE)
        room = 100
        for _ in range(3):  # rooms to both, one at a time: each instance measures its rate
            for decode in (pair.slow, pair.fast):
                await pair.start(decode, room)
                room += 1
                await pair.finish()
        slow_rate = pair.slow.transfer_costs()[c.bootstrap].rate
        fast_rate = pair.fast.transfer_costs()[c.bootstrap].rate
        assert slow_rate is not None and fast_rate is not None and slow_rate < fast_rate / 2, (
            slow_rate,
            fast_rate,
        )
        assert late.fired >= 3

        chosen = []
        for _ in range(3):  # three new requests in flight together, each routed by the estimates then
            estimates = {
                "slow": pair.slow.estimate_transfer(c.bootstrap, n),
                "fast": pair.fast.estimate_transfer(c.bootstrap, n),
            }
            name = choose(estimates)
            chosen.append(name)
            await pair.start(pair.slow if name == "slow" else pair.fast, room)
            room += 1
        assert chosen == ["fast"] * 3, chosen
        load = pair.fast.transfer_costs()[c.bootstrap]
        assert load.queued_rooms + load.inflight_rooms >= 1  # the backlog is counted while they are open
        await pair.finish()

        costs = {cost.instance: cost for cost in build_snapshot(pair.fast).costs}
        assert costs[c.bootstrap].rate == pytest.approx(pair.fast.transfer_costs()[c.bootstrap].rate)
        assert costs[c.bootstrap].queued_rooms == costs[c.bootstrap].inflight_rooms == 0
        with pytest.raises(ConfigError, match="nbytes=-1"):
            pair.fast.estimate_transfer(c.bootstrap, -1)
        c.assert_no_leaks()
