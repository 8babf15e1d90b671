"""The worker's descriptor tables (``actors/worker/plan.py``: ``side_table``, ``table_indices``,
``merged_runs``) against ``protocol/tables.py``'s, on every layout case of ``test_tables.py``.

The worker lays a side's table out as NIXL's strided rows (one row per entry of page 0, or per unit
where pages run token for token) and indexes it in its own order; ``protocol/tables.py`` lists every
entry page-major. Both must name the same bytes in the same order for every WRITE: each case's
chunks and layer groups are planned both ways and their address lists compared, and each index
must pick, from the rows listed flat, the address it comes with. ``test_tables.py`` holds
``protocol/tables.py`` to the old planner on the same cases, so this holds the worker's WRITEs to it.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from tests.unit.test_tables import (
    CASES,
    Case,
    chunk_of,
    pairs_of,
    rank,
    request,
    spec_of,
)
from transfer_engine.actors.worker.plan import merged_runs, side_table, table_indices
from transfer_engine.errors import ConfigError
from transfer_engine.memory.layout import KVLayout, KVPool
from transfer_engine.protocol import descriptors
from transfer_engine.protocol.layers import group_tensors
from transfer_engine.protocol.tables import chunk_groups, decide_table, side_entries, units_of, write_indices
from transfer_engine.transport.interface import TableRows

pytestmark = pytest.mark.timeout(60)


def check_case(case: Case, shape: str, seed: int, chunks: list[tuple[int, int]], pages: int = 6) -> list[int]:
    """Every pair and chunk (and layer group) of ``case`` planned from the worker's rows and from
    ``protocol/tables.py``'s entries; returns each pair's rows a side (src + dst)."""
    src_total, dst_total, src_req, dst_req = request(case.src, case.dst, pages, shape, seed)
    rows_seen = []
    for s, src_heads, dst_heads in pairs_of(case):
        src = rank(case.src, case.num_layers, src_total, src_heads, case.hb, case.mla, 1 << 48)
        dst = rank(case.dst, case.num_layers, dst_total, dst_heads, case.hb, case.mla, 1 << 52)
        spec = spec_of(src, dst, case.hb, s, case.mla, case.group_layers)
        src_t = side_table(spec, "src", src.bases, src.lengths, src.rows, src.num_pages)
        dst_t = side_table(spec, "dst", dst.bases, dst.lengths, dst.rows, dst.num_pages)
        rows_seen.append(src_t.rows.rows + dst_t.rows.rows)
        src_all = side_entries(spec, "src", src.bases, src.lengths, src.rows, src.num_pages)[0]
        dst_all = side_entries(spec, "dst", dst.bases, dst.lengths, dst.rows, dst.num_pages)[0]
        for side, table, every in (("src", src_t, src_all), ("dst", dst_t, dst_all)):
            assert table.rows.entries == spec.table_entries(
                side, src.num_pages if side == "src" else dst.num_pages
            )
            assert table.rows.length == spec.entry_bytes
            assert np.array_equal(np.sort(table.rows.flat()), np.sort(every))  # the same entries
        per = case.group_layers
        groups = [None] if per is None else [
            group_tensors(case.num_layers, case.mla, a, min(a + per, case.num_layers))
            for a in range(0, case.num_layers, per)
        ]  # fmt: skip
        for first, count in chunks:
            chunk = chunk_of(src_req, dst_req, src.page_size, dst.page_size, first, count)
            slot_groups = chunk_groups(
                spec, chunk.src_pages, chunk.dst_pages, dst_start_token=chunk.start, num_tokens=chunk.tokens
            )
            for rows in groups:
                units = units_of(spec, rows)
                si, sa = table_indices(src_t, slot_groups[0], units)
                di, da = table_indices(dst_t, slot_groups[1], units)
                assert si.dtype == di.dtype == np.int32 and sa.dtype == da.dtype == np.uint64
                # each index picks the address it comes with
                assert np.array_equal(src_t.rows.flat()[si], sa)
                assert np.array_equal(dst_t.rows.flat()[di], da)
                # the same bytes, in the same order, as protocol/tables.py's WRITE
                old_si, old_di = write_indices(
                    spec, chunk.src_pages, chunk.dst_pages, rows, dst_start_token=chunk.start,
                    num_tokens=chunk.tokens,
                )  # fmt: skip
                assert np.array_equal(sa, src_all[old_si]) and np.array_equal(da, dst_all[old_di])
                # merged, the same bytes as one run per descriptor
                ms, md, ml = merged_runs(sa, da, spec.entry_bytes)
                assert int(ml.sum()) == len(sa) * spec.entry_bytes
                assert len(ms) <= len(sa)
                expand = np.repeat(np.arange(len(ms)), (ml // np.uint64(spec.entry_bytes)).astype(np.int64))
                within = np.arange(len(sa)) - np.repeat(
                    np.cumsum(ml // np.uint64(spec.entry_bytes)) - ml // np.uint64(spec.entry_bytes),
                    (ml // np.uint64(spec.entry_bytes)).astype(np.int64),
                ).astype(np.int64)
                step = within.astype(np.uint64) * np.uint64(spec.entry_bytes)
                assert np.array_equal(ms[expand] + step, sa) and np.array_equal(md[expand] + step, da)
    return rows_seen


@pytest.mark.parametrize("shape", ["realistic", "scattered"])
@pytest.mark.parametrize("name", list(CASES))
def test_worker_tables_write_what_protocol_tables_write(name: str, shape: str) -> None:
    case = CASES[name]
    rows = check_case(case, shape, seed=len(name), chunks=[(0, 6), (0, 2), (2, 3), (5, 1)])
    # strided rows: a handful per pair, whatever the pool's size
    assert all(r <= 2 * 2 * case.num_layers * case.num_heads * 16 for r in rows)
    if case.group_layers is None and not case.mla:  # and as layer groups of one layer
        check_case(replace(case, group_layers=1), shape, seed=3, chunks=[(1, 4)])


def test_rows_do_not_grow_with_the_pool() -> None:
    """A side's rows depend on the layout, not on the pool's pages: 8 or 8,000 pages, the same rows."""
    case = CASES["nhd-direct"]
    counts = []
    for pages in (8, 8000):
        src = rank(case.src, case.num_layers, pages, case.num_heads, case.hb, False, 1 << 48)
        s = pairs_of(case)[0][0]
        spec = spec_of(src, src, case.hb, s, False, None)
        table = side_table(spec, "src", src.bases, src.lengths, src.rows, src.num_pages)
        counts.append((table.rows.rows, table.rows.count))
    assert counts == [(case.num_layers, 8), (case.num_layers, 8000)]  # (layer, page): K and V in one entry


def test_pages_that_run_token_for_token_are_one_row_per_unit() -> None:
    """Contiguous tensors with pages twice the entries' tokens (16-token pages to 8-token pages): one
    row per tensor over every 8-token group of the pool, so consecutive pages stay one run of
    entries (one descriptor once merged, as the old planner's page runs)."""
    case = CASES["ours-pages-16to8"]
    src = rank(case.src, case.num_layers, 32, case.num_heads, case.hb, False, 1 << 48)
    dst = rank(case.dst, case.num_layers, 64, case.num_heads, case.hb, False, 1 << 52)
    s = pairs_of(case)[0][0]
    spec = spec_of(src, dst, case.hb, s, False, None)
    src_t = side_table(spec, "src", src.bases, src.lengths, src.rows, src.num_pages)
    assert (src_t.token_groups, src_t.rows.rows, src_t.rows.count) == (1, 2 * case.num_layers, 64)
    pages = np.arange(4, 12)
    groups = chunk_groups(spec, pages, np.arange(16, 32), num_tokens=8 * 16)
    units = units_of(spec, None)
    sa = table_indices(src_t, groups[0], units)[1]
    da = table_indices(
        side_table(spec, "dst", dst.bases, dst.lengths, dst.rows, dst.num_pages), groups[1], units
    )[1]
    merged = merged_runs(sa, da, spec.entry_bytes)
    old = descriptors.strided_descriptors(
        src.bases, src.lengths, src.rows, dst.bases, dst.lengths, dst.rows, case.hb,
        descriptors.slots_of(pages, 16, 0, 128), descriptors.slots_of(np.arange(16, 32), 8, 0, 128),
        16, 8, 0, 0, case.num_heads, case.num_heads, case.num_heads,
    )  # fmt: skip
    assert len(merged[0]) == len(old[0]) == 2 * case.num_layers  # one run per tensor, both ways


def test_contiguous_pages_merge_to_the_old_direct_plan() -> None:
    """Equal layouts, a chunk of pages consecutive on both sides: the merged WRITE is the old direct
    planner's page runs (one per tensor and run)."""
    case = CASES["ours-direct"]
    src = rank(case.src, case.num_layers, 64, case.num_heads, case.hb, False, 1 << 48)
    dst = rank(case.dst, case.num_layers, 64, case.num_heads, case.hb, False, 1 << 52)
    spec = spec_of(src, dst, case.hb, pairs_of(case)[0][0], False, None)
    tables = [
        side_table(spec, side, r.bases, r.lengths, r.rows, 64) for side, r in (("src", src), ("dst", dst))
    ]
    src_pages = np.array([3, 4, 5, 9, 10, 40])
    dst_pages = np.array([7, 8, 9, 20, 21, 22])
    groups = chunk_groups(spec, src_pages, dst_pages)
    units = units_of(spec, None)
    sa, da = (table_indices(t, g, units)[1] for t, g in zip(tables, groups, strict=True))
    merged = merged_runs(sa, da, spec.entry_bytes)
    page_bytes = 16 * case.num_heads * case.hb
    old = descriptors.direct_descriptors(src.bases, dst.bases, page_bytes, src_pages, dst_pages)
    assert np.array_equal(merged[0], old[0]) and np.array_equal(merged[1], old[1])
    assert np.array_equal(merged[2], old[2])


def test_a_last_page_outside_its_region_is_refused() -> None:
    case = CASES["nhd-direct"]
    src = rank(case.src, case.num_layers, 16, case.num_heads, case.hb, False, 1 << 48)
    spec = spec_of(src, src, case.hb, pairs_of(case)[0][0], False, None)
    short = src.lengths - np.uint64(1)
    with pytest.raises(ConfigError, match="last page's entry ends"):
        side_table(spec, "dst", src.bases, short, src.rows, 16)


def test_table_rows_strided_and_flat_agree() -> None:
    rows = TableRows(np.array([1000, 5000], dtype=np.uint64), np.array([64, 128], dtype=np.uint64), 3, 32)
    assert rows.entries == 6
    assert rows.flat().tolist() == [1000, 1064, 1128, 5000, 5128, 5256]
    assert rows.spans().tolist() == [2 * 64 + 32, 2 * 128 + 32]
    strided = rows.strided(np.array([0, 1], dtype=np.uint64))
    assert strided.tolist() == [[1000, 32, 0, 64, 3], [5000, 32, 1, 128, 3]]
    one = TableRows(np.array([7], dtype=np.uint64), np.array([0], dtype=np.uint64), 1, 32)
    assert one.strided(0).tolist() == [[7, 32, 0, 32, 1]]  # a one-entry row's stride: the entry's length


def test_merged_runs_merge_only_runs_that_follow_on_both_sides() -> None:
    src = np.array([0, 8, 16, 40, 48], dtype=np.uint64)
    dst = np.array([100, 108, 200, 208, 216], dtype=np.uint64)
    s, d, n = merged_runs(src, dst, 8)
    assert s.tolist() == [0, 16, 40] and d.tolist() == [100, 200, 208] and n.tolist() == [16, 8, 16]
    empty = merged_runs(src[:0], dst[:0], 8)
    assert [len(a) for a in empty] == [0, 0, 0]


@pytest.mark.parametrize("mla", [False, True])
def test_a_page_major_pool_is_one_entry_per_page_of_every_layer(mla: bool) -> None:
    """``KVPool.allocate(page_major=True)``: page ``p`` of every layer's K and V (or latent) is the
    buffer's ``[p]``; the tables between two such pools take (every layer, page) entries, one row a
    side, and groups of 2 layers (2 layers, page) entries."""
    layout = KVLayout(num_layers=4, num_heads=4, head_dim=8, dtype=torch.float16, page_size=4, mla=mla)
    pool = KVPool.allocate(layout, 1, 0, 6, page_major=True)
    (memory,) = pool.tensors
    for i, view in enumerate(pool.kv_views):
        view.copy_(torch.full_like(view, i + 1))
        view[3].copy_(torch.full_like(view[3], 100 + i))
    page = memory[3].reshape(-1)
    assert sorted(set(page.tolist())) == [100 + i for i in range(len(pool.kv_views))]  # page 3: every tensor
    heads = pool.heads_local
    args = (pool.stride_rows, pool.stride_rows, pool.head_bytes, 4, 4, 0, 0, heads, heads, heads)
    spec = decide_table(*args, mla=mla)
    assert spec.granularity == "(every layer, page)" and spec.entry_bytes == memory[0].numel() * 2
    bases = np.array([memory.data_ptr()], dtype=np.uint64)
    table = side_table(spec, "src", bases, pool.region_lengths, pool.stride_rows, 6)
    assert table.rows.rows == 1 and table.rows.count == 6 and table.runs
    assert decide_table(*args, mla=mla, group_layers=2).granularity == "(2 layers, page)"
