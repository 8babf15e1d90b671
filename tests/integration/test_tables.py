"""Direct and slice WRITEs made from descriptor tables prepared once per peer (real NIXL over UCX).

Every direct and slice WRITE (whole chunks and layer groups) is made from two index arrays into
tables the prefill's transport prepared once per (decode rank, spec) (docs/DECISIONS.md, "Descriptor
tables made once per peer"). Checked here over real NIXL on every layout the engine moves (its own
contiguous tensors, vLLM-like strided views, hetero-TP head slices, MLA, pages of 1 and 16 tokens):
every byte lands where it should and nothing else is written; the tables are prepared once per
pair, counted by the transport itself, and released when the peer dies and when the engine closes
(nothing leaked); a pair over ``EngineConfig.table_max_descriptors`` plans its WRITEs one by one, and
says why once; a NIXL that takes no strided lists gets each entry listed.
"""

from __future__ import annotations

import functools
import logging
import random

import anyio
import numpy as np
import pytest
import torch

from transfer_engine import EngineConfig, TransferEngine
from transfer_engine.memory.layout import KVLayout, KVPool
from transfer_engine.testing.cluster import Cluster, open_cluster

from .harness import DEVICE, cluster, make_pool, run_room, shuffled_pages, small_layout
from .test_matrix_strided import assert_untouched_is_zero

pytestmark = pytest.mark.timeout(120)

NUM_PAGES = 48


def tables_used(c: Cluster) -> tuple[int, int]:
    """(pairs' tables prepared, refusals) over every prefill rank, from the transports' own counts."""
    prepared = sum(e.poller.transport.table_stats["prepared"] for e in c.prefill)
    refused = sum(w.counters["tables_refused"] for e in c.prefill for w in e.workers)
    return prepared, refused


CASES = [
    # (prefill kind, decode kind, P, D, prefill page size, decode page size, mla, path)
    ("contiguous", "contiguous", 1, 1, 16, 16, False, "direct"),
    ("contiguous", "contiguous", 1, 1, 1, 1, False, "direct"),  # SGLang's default page size
    ("flash_nhd", "flash_nhd", 1, 1, 16, 16, False, "direct"),  # vLLM's FlashAttention layout
    ("flash_hnd", "vllm_cpu", 1, 1, 4, 4, False, "direct"),
    ("contiguous", "contiguous", 2, 1, 4, 4, False, "slice"),  # hetero TP: head slices
    ("contiguous", "contiguous", 1, 2, 4, 4, False, "slice"),
    ("flash_nhd", "flash_nhd", 2, 1, 16, 16, False, "slice"),
    ("flash_hnd", "flash_hnd", 1, 2, 4, 4, False, "slice"),
    ("contiguous", "flash_nhd", 1, 1, 1, 16, False, "slice"),  # page size 1 into pages of 16
    ("contiguous", "contiguous", 1, 1, 16, 4, False, "slice"),  # pages of 16 into pages of 4
    ("contiguous", "contiguous", 2, 1, 4, 4, True, "direct"),  # MLA: one latent per layer
    ("contiguous", "contiguous", 1, 1, 1, 1, True, "direct"),
]
PARAMS = [
    pytest.param(*case, layers, id=f"{case[0]}-P{case[2]}p{case[4]}-to-{case[1]}-D{case[3]}p{case[5]}"
                 f"{'-mla' if case[6] else ''}-{case[7]}{'-layers' if layers else ''}")
    for case in CASES
    for layers in (0, 1)
]  # fmt: skip


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("src_kind", "dst_kind", "P", "D", "src_page", "dst_page", "mla", "path", "layers"), PARAMS
)
async def test_table_writes_are_bit_exact(
    src_kind: str,
    dst_kind: str,
    P: int,
    D: int,
    src_page: int,
    dst_page: int,
    mla: bool,
    path: str,
    layers: int,
) -> None:
    rng = random.Random(f"{src_kind} {dst_kind} {P} {D} {src_page} {dst_page} {mla} {layers}")
    layout = small_layout(mla=mla, page_size=src_page)
    decode_layout = small_layout(mla=mla, page_size=dst_page)
    async with cluster(
        layout, P, D, num_pages=NUM_PAGES, decode_layout=decode_layout, kinds=(src_kind, dst_kind), path=path
    ) as c:
        src_free = shuffled_pages(rng, NUM_PAGES, NUM_PAGES).tolist()
        dst_free = shuffled_pages(rng, NUM_PAGES, NUM_PAGES).tolist()
        written: list[tuple[np.ndarray, int]] = []
        async with anyio.create_task_group() as tg:
            for room in range(3):
                src_pages = rng.randint(1, 5)
                tokens = src_pages * src_page
                dst_pages = -(-tokens // dst_page)
                if dst_pages > len(dst_free) or src_pages > len(src_free):
                    break
                src, dst = np.array(src_free[:src_pages]), np.array(dst_free[:dst_pages])
                del src_free[:src_pages], dst_free[:dst_pages]
                chunks = [1, src_pages - 1] if src_pages > 1 else [1]
                written.append((dst, tokens))
                tg.start_soon(
                    functools.partial(run_room, c, 300 + room, src, dst, chunks, aux_slot=room, layers=layers)
                )
        prepared, refused = tables_used(c)
        assert refused == 0 and prepared >= (1 if mla else max(P, D))  # MLA: one writer per decode rank
        assert sum(e.poller.counters["lists_prepared"] for e in c.prefill) == 0  # no per-chunk lists
        assert_untouched_is_zero(c, written)
        c.assert_no_leaks()
    assert all(e.poller.transport.live_tables() == 0 for e in c.prefill)


@pytest.mark.anyio
@pytest.mark.parametrize("pages", [1, 1024], ids=["one-page", "16K-tokens"])
async def test_a_one_page_room_and_a_16k_token_room(pages: int) -> None:
    """Pages of 16 tokens, a Qwen-like KV of 8 layers (2 KV heads of 128): one page, and 16,384 tokens
    on scattered pages, whole and layer-wise; every byte checked."""
    layout = KVLayout(num_layers=8, num_heads=2, head_dim=128, dtype=torch.bfloat16, page_size=16)
    async with cluster(layout, 1, 1, num_pages=2048, path="direct", aux=0) as c:
        rng = np.random.default_rng(pages)
        for room, layers in ((1, 0), (2, 2)):
            src, dst = rng.permutation(2048)[:pages], rng.permutation(2048)[:pages]
            chunks = [pages] if pages == 1 else [256, 768]
            await run_room(c, room, src, dst, chunks, layers=layers)
        # whole chunks and groups of 2 layers take the same (tensor, page) entries: one spec, one table
        assert tables_used(c) == (1, 0)
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_tables_are_prepared_once_per_pair_and_released_at_close() -> None:
    async with cluster(small_layout(), 1, 2, path="slice") as c:
        transport = c.prefill[0].poller.transport
        await run_room(c, 1, np.arange(4), np.arange(4), [2, 2])
        first = transport.table_stats["prepared"]
        assert first == 2 and transport.live_tables() == 2  # one pair per decode rank
        for room in range(2, 8):
            await run_room(c, room, np.arange(4 * room, 4 * room + 4), np.arange(40 - room, 44 - room), [4])
        assert transport.table_stats["prepared"] == first  # never again
        assert transport.table_stats["descriptors"] <= 2 * 2 * 2 * 3 * 4  # strided rows, not entries
        c.assert_no_leaks()
    assert transport.live_tables() == 0 and transport.table_stats["released"] == first


@pytest.mark.anyio
async def test_a_dead_peers_tables_are_released() -> None:
    """A decode rank that leaves: once the prefill declares it dead, its tables are released and no
    NIXL handle is left; a new decode rank gets tables of its own."""
    layout = small_layout()

    def make(role: str, rank: int, port: int) -> TransferEngine:
        cfg = EngineConfig(role=role, bootstrap_port=port, heartbeat_interval=0.2, path="direct")
        return TransferEngine(cfg, make_pool("contiguous", layout, 1, 0, 64, 8))

    async with open_cluster(make, 1, 0) as c:
        prefill = c.prefill[0]
        transport = prefill.poller.transport
        port = int(c.bootstrap.rsplit(":", 1)[1])
        for round_ in range(2):
            async with make("decode", 0, port) as decode:
                await run_room(
                    Cluster(c.prefill, [decode], c.bootstrap), 10 + round_, np.arange(4), np.arange(4), [4]
                )
                assert transport.live_tables() == 1
            with anyio.fail_after(5):
                while prefill.peers:  # noqa: ASYNC110 - the heartbeat lease runs out
                    await anyio.sleep(0.05)
            assert transport.live_tables() == 0 and transport.live_handles() == 0
            assert transport.table_stats["released"] == transport.table_stats["prepared"] == round_ + 1
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_over_the_cap_a_pair_plans_each_write_and_says_why_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="transfer_engine.actors.worker.direct")
    async with cluster(small_layout(), 2, 1, path="slice", table_max_descriptors=4) as c:
        for room in range(3):
            await run_room(
                c, room, np.arange(4 * room, 4 * room + 4), np.arange(8 * room, 8 * room + 4), [1, 3]
            )
            await run_room(c, 10 + room, np.arange(4), np.arange(4), [2, 2], layers=1)
        prepared, refused = tables_used(c)
        assert prepared == 0
        reasons = [r for e in c.prefill for w in e.workers for r in w.direct.tables.reasons.values()]
        assert reasons and all("over the cap of 4" in r for r in reasons)
        said = [r for r in caplog.records if "no descriptor tables" in r.getMessage()]
        assert len(said) == refused == len(reasons)  # once per pair (whole chunks and groups share one spec)
        assert sum(e.poller.counters["lists_prepared"] for e in c.prefill) > 0  # the old shared lists
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_tables_listed_entry_by_entry_where_nixl_takes_no_strided_lists() -> None:
    async with cluster(small_layout(), 1, 1, path="direct") as c:
        transport = c.prefill[0].poller.transport
        transport._strided_tables = False  # as a NIXL older than strided lists leaves it
        await run_room(c, 1, np.array([5, 9, 10, 11]), np.array([30, 2, 3, 4]), [1, 3])
        await run_room(c, 2, np.array([1, 2]), np.array([7, 8]), [2], layers=1)
        assert transport.table_stats["prepared"] == 1
        # every entry listed: (tensor, page) entries of 6 tensors over 64 pages, both sides
        assert transport.table_stats["descriptors"] == 2 * 6 * 64
        c.assert_no_leaks()


# --- page-major pools: a page holds every layer's K and V (KVPool.allocate(page_major=True)) --------


def page_major_maker(
    layout: KVLayout, P: int, D: int, kinds: tuple[bool, bool], num_pages: int = NUM_PAGES, **config: object
):  # noqa: ANN201
    """Engines whose pools are page-major (True) or one tensor per K and V (False), prefill then decode."""

    def make(role: str, rank: int, port: int) -> TransferEngine:
        tp = P if role == "prefill" else D
        extra = {"num_workers": 2} if role == "prefill" else {}
        cfg = EngineConfig(role=role, tp_size=tp, tp_rank=rank, bootstrap_port=port, **extra, **config)  # type: ignore[arg-type]
        page_major = kinds[0] if role == "prefill" else kinds[1]
        pool = KVPool.allocate(
            layout, tp, rank, num_pages, device=DEVICE, aux_slots=8, aux_item_bytes=16, page_major=page_major
        )
        return TransferEngine(cfg, pool)

    return make


@pytest.mark.anyio
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
async def test_page_major_pools_move_a_page_in_one_descriptor(mla: bool) -> None:
    """Both pools page-major: the tables' entry is (every layer, page); a one-page room, and a room of
    pages consecutive on both sides, is one WRITE of one descriptor; scattered pages one per run."""
    layout = small_layout(mla=mla, page_size=16)
    async with open_cluster(page_major_maker(layout, 1, 1, (True, True), path="direct"), 1, 1) as c:
        poller = c.prefill[0].poller
        cases = [(np.array([7]), np.array([30])), (np.arange(10, 14), np.arange(2, 6))]
        cases.append((np.array([1, 2, 9, 20]), np.array([40, 41, 3, 4])))  # runs of 2, 1, 1
        for room, (src, dst) in enumerate(cases):
            before = poller.counters["descriptors_posted"], poller.counters["writes_posted"]
            await run_room(c, 50 + room, src, dst, [len(src)])
            posted = (
                poller.counters["descriptors_posted"] - before[0],
                poller.counters["writes_posted"] - before[1],
            )
            runs = 1 + int(np.count_nonzero((np.diff(src) != 1) | (np.diff(dst) != 1)))
            assert posted == (runs, 1), (src, dst, posted)
        (worker,) = [w for w in c.prefill[0].workers if w.direct.tables._pairs]
        (pair,) = [p for p in worker.direct.tables._pairs.values() if p is not None]
        assert pair.spec.granularity == "(every layer, page)"
        assert pair.src.rows.rows == pair.dst.rows.rows == 1  # one strided row a side: the whole pool
        c.assert_no_leaks()


PAGE_MAJOR_CASES = [
    # (prefill page-major, decode page-major, P, D, path, layers)
    (True, True, 1, 1, "direct", 1),  # layer groups: (1 layer, page) entries of the page-major pools
    (True, True, 1, 1, "direct", 2),
    (True, False, 1, 1, "direct", 0),  # page-major into one tensor per K and V
    (False, True, 1, 1, "direct", 1),
    (True, True, 2, 1, "slice", 0),  # hetero TP between page-major pools
    (True, False, 1, 2, "slice", 1),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("src_pm", "dst_pm", "P", "D", "path", "layers"), PAGE_MAJOR_CASES)
async def test_page_major_pools_are_bit_exact(
    src_pm: bool, dst_pm: bool, P: int, D: int, path: str, layers: int
) -> None:
    rng = random.Random(f"{src_pm} {dst_pm} {P} {D} {layers}")
    make = page_major_maker(small_layout(page_size=4), P, D, (src_pm, dst_pm), path=path)
    async with open_cluster(make, P, D) as c:
        for room in range(3):
            src, dst = shuffled_pages(rng, NUM_PAGES, 5), shuffled_pages(rng, NUM_PAGES, 5)
            await run_room(c, 60 + room, src, dst, [2, 3], aux_slot=room, layers=layers)
            # nothing but the room's slots was written (and they are zero again for the next room)
            assert_untouched_is_zero(c, [(dst, 5 * 4)])
        prepared, refused = tables_used(c)
        assert refused == 0 and prepared >= max(P, D)
        c.assert_no_leaks()
