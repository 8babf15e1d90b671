"""The SGLang adapter driven as SGLang's schedulers drive a transfer backend (see scheduler.py).

SGLang's real base classes are imported (``sglang.srt.disaggregation.base.conn``, installed by
``make setup``); NIXL and ZMQ are real; one thread per TP rank on each side, poll() every step
combined with MIN across the group. Every byte of every successful room is checked on every decode
rank, aux buffers included; pages are freed on Success or Failed and reused at once by the next
request; nothing is leaked at the end. Budget: about 15 s for the module on the 2-core box.
"""

from __future__ import annotations

import dataclasses
import random
import threading

import pytest

from tests.sglang.scheduler import (
    SMALL,
    Group,
    Memory,
    Request,
    Stats,
    manager,
    run_decode_rank,
    run_prefill_rank,
)
from transfer_engine.integrations.sglang import KVBootstrapServer, KVManager
from transfer_engine.memory.layout import KVLayout
from transfer_engine.testing.cluster import free_port

pytestmark = pytest.mark.timeout(90)


def requests(seed: int, n: int, prefixes: tuple[int, ...] = (0, 0, 1, 2)) -> list[Request]:
    """``n`` requests of 1-10 pages in 1-3 chunks; some with a decode prefix, some aborted."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        pages = rng.randint(1, 10)
        cuts = sorted(rng.sample(range(1, pages), min(pages - 1, rng.randint(0, 2)))) if pages > 1 else []
        bounds = [0, *cuts, pages]
        req = Request(
            room=rng.getrandbits(63),
            pages=pages,
            chunks=[b - a for a, b in zip(bounds, bounds[1:], strict=False)],
            aux_index=i,  # SGLang gives every live request its own metadata slot
            prefix_pages=rng.choice(prefixes),
        )
        # Aborts only of rooms that cannot have succeeded yet (their last chunk is not sent), so
        # that every rank of both sides must end them Failed.
        if i % 5 == 3 and len(req.chunks) > 1:
            req.abort_by, req.abort_step = "prefill", req.chunks[0]
        elif i % 5 == 4 and len(req.chunks) > 1:
            req.abort_by, req.abort_step = "decode", 0
        out.append(req)
    return out


def run_group(
    P: int, D: int, reqs: list[Request], decode_layout: KVLayout = SMALL, **config: object
) -> tuple[Stats, Stats, list[KVManager]]:
    lay = SMALL
    port = free_port()
    server = KVBootstrapServer("127.0.0.1", port)
    managers: list[KVManager] = []
    threads_before = threading.active_count()
    try:
        pmem = [Memory.allocate(lay, P, 48, len(reqs)) for _ in range(P)]
        dmem = [Memory.allocate(decode_layout, D, 48, len(reqs)) for _ in range(D)]
        prefill = [manager("prefill", lay, P, r, pmem[r], port, **config) for r in range(P)]
        managers += prefill
        decode = [manager("decode", decode_layout, D, r, dmem[r], port, **config) for r in range(D)]
        managers += decode
        pstats, dstats = Stats(), Stats()
        pgroup, dgroup = Group(P), Group(D)
        threads = [
            threading.Thread(target=run_prefill_rank, args=(prefill[r], pmem[r], pgroup, r, reqs, pstats))
            for r in range(P)
        ]
        threads += [
            threading.Thread(
                target=run_decode_rank,
                args=(decode[r], dmem[r], dgroup, r, f"127.0.0.1:{port}", reqs, dstats, lay.page_size),
            )
            for r in range(D)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=80)
            assert not t.is_alive(), "a scheduler thread is stuck"
        for mgr in managers:
            leaks = mgr.engine.leaks()
            assert not any(leaks.values()), f"{mgr.engine.agent_name} leaked {leaks}"
    finally:
        for mgr in reversed(managers):
            mgr.close()
        server.close()
    assert threading.active_count() <= threads_before, "the engines' loop threads outlived close()"
    return pstats, dstats, managers


@pytest.mark.parametrize(("P", "D"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_scheduler_order_every_byte(P: int, D: int) -> None:
    reqs = requests(seed=10 * P + D, n=12)
    pstats, dstats, _ = run_group(P, D, reqs)
    assert not pstats.errors and not dstats.errors, pstats.errors + dstats.errors
    aborted = sum(1 for r in reqs if r.abort_by)
    assert dstats.succeeded == D * (len(reqs) - aborted)
    assert pstats.succeeded == P * (len(reqs) - aborted)
    # an aborted room ends Failed on every rank of both sides, seen by poll() alone
    assert dstats.failed == D * aborted
    assert pstats.failed == P * aborted
    assert dstats.bytes_checked > 0


@pytest.mark.parametrize(("P", "D"), [(1, 1), (2, 1)])
def test_decode_pages_twice_as_large(P: int, D: int) -> None:
    """Decode pages of 8 tokens against prefill pages of 4: the staged path, prefixes of 8 tokens."""
    reqs = requests(seed=100 + P, n=8, prefixes=(0, 2))
    decode_layout = dataclasses.replace(SMALL, page_size=8)
    pstats, dstats, _ = run_group(P, D, reqs, decode_layout)
    assert not pstats.errors and not dstats.errors, pstats.errors + dstats.errors
    aborted = sum(1 for r in reqs if r.abort_by)
    assert dstats.succeeded == D * (len(reqs) - aborted) and dstats.failed == D * aborted
    assert pstats.succeeded == P * (len(reqs) - aborted) and pstats.failed == P * aborted
