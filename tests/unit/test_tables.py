"""Descriptor tables (``protocol/tables.py``) against the old planner, on every layout case.

Each case lays out two ranks' KV as strides tables (the engine's layouts and vLLM 0.32's, checked
against the pools ``memory/layout.py`` and ``integrations/vllm/layouts.py`` build from real
tensors), plans a chunk or a layer group both ways, and compares the exact set of
``(src byte, dst byte)`` pairs of ``head_bytes`` runs: the old planner's descriptors
(``descriptors.strided_descriptors``, and ``direct_descriptors``/``slice_descriptors`` for the
contiguous layout) against the tables' entries picked by the index arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transfer_engine.errors import ConfigError
from transfer_engine.protocol import descriptors, heads
from transfer_engine.protocol.layers import group_tensors
from transfer_engine.protocol.tables import (
    TableSpec,
    chunk_groups,
    decide_table,
    group_indices,
    side_entries,
    units_of,
    write_indices,
)
from transfer_engine.testing.pagetables import pool_pages, room_tables

pytestmark = pytest.mark.timeout(60)

VLLM = ("LBNHC", "LBHNC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
ENGINE = ("ours", "vllm_cpu", "flash_nhd", "flash_hnd")
AXES = "LBHNC"


@dataclass(frozen=True)
class Lay:
    """One rank's layout: ``kind`` (an engine layout or a vLLM ``KVCacheLayout``), its pages'
    tokens, a kernel-block ``ratio`` (vLLM blocks of ``ratio`` pages) and MLA page padding."""

    kind: str
    page_size: int = 16
    ratio: int = 1
    padded_page: int | None = None
    """Bytes per vLLM block (MLA alignment), for ``LB..`` layouts."""


@dataclass(frozen=True)
class Rank:
    bases: np.ndarray
    lengths: np.ndarray
    rows: np.ndarray
    num_pages: int
    heads_local: int
    page_size: int


def vllm_rows(lay: Lay, L: int, blocks: int, H: int, hb: int, mla: bool) -> tuple[list[int], np.ndarray]:
    """(region lengths, strides rows) of vLLM's one backing buffer ``[L, B, H, N, C]`` in ``lay.kind``
    order (``tests/gpu/vllm_kv.py``, ``allocate``), C = K then V (or the latent), in bytes."""
    N = lay.page_size * lay.ratio
    content = hb if mla else 2 * hb
    shape = dict(zip(AXES, (L, blocks, H, N, content), strict=True))
    stride, step = {}, 1
    for axis in reversed(lay.kind):
        stride[axis] = step
        step *= shape[axis]
    if lay.padded_page is not None:
        assert lay.kind.startswith("LB") and lay.padded_page >= H * N * content
        stride["B"], stride["L"] = lay.padded_page, blocks * lay.padded_page
        step = L * blocks * lay.padded_page
    rows = [
        (0, layer * stride["L"], stride["B"] // lay.ratio, stride["H"], stride["N"]) for layer in range(L)
    ]
    if not mla:
        rows += [(0, off + hb, b, h, n) for _, off, b, h, n in rows]
    return [step], np.array(rows, dtype=np.int64)


def engine_rows(lay: Lay, L: int, pages: int, H: int, hb: int, mla: bool) -> tuple[list[int], np.ndarray]:
    """(region lengths, strides rows) of the layouts ``memory/layout.py``'s ``views_*`` describe."""
    P = lay.page_size
    if lay.kind == "ours":
        n = L if mla else 2 * L
        return [pages * P * H * hb] * n, descriptors.contiguous_strides(n, H, hb, P)
    assert not mla
    if lay.kind == "vllm_cpu":  # per layer [B, H, N, 2 * hb]
        k = [(layer, 0, H * P * 2 * hb, P * 2 * hb, 2 * hb) for layer in range(L)]
        return [pages * H * P * 2 * hb] * L, np.array(k + [(r, hb, b, h, n) for r, _, b, h, n in k])
    half = pages * P * H * hb  # per layer (2, B, N, H, hb) or (2, B, H, N, hb)
    h, n = (hb, H * hb) if lay.kind == "flash_nhd" else (P * hb, hb)
    k = [(layer, 0, P * H * hb, h, n) for layer in range(L)]
    return [2 * half] * L, np.array(k + [(r, half, b, h_, n_) for r, _, b, h_, n_ in k])


def rank(lay: Lay, L: int, pages: int, H: int, hb: int, mla: bool, base: int) -> Rank:
    if lay.kind in VLLM:
        assert pages % lay.ratio == 0
        lengths, rows = vllm_rows(lay, L, pages // lay.ratio, H, hb, mla)
    else:
        lengths, rows = engine_rows(lay, L, pages, H, hb, mla)
    bases = base + (np.arange(len(lengths), dtype=np.uint64) << np.uint64(36))
    return Rank(bases, np.array(lengths, dtype=np.uint64), rows, pages, H, lay.page_size)


# ---------------------------------------------------------------- the two plans as byte-run pairs


def pairs(src: np.ndarray, dst: np.ndarray, length: np.ndarray, hb: int) -> np.ndarray:
    """Every ``(src, dst)`` of ``hb`` bytes the descriptors move, sorted: shape ``(n, 2)``."""
    src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    count = np.asarray(length, dtype=np.int64) // hb
    assert (count * hb == np.asarray(length, dtype=np.int64)).all()
    first = np.repeat(np.cumsum(count) - count, count)
    within = (np.arange(int(count.sum())) - first) * hb
    s, d = np.repeat(src, count) + within, np.repeat(dst, count) + within
    order = np.lexsort((d, s))
    return np.stack([s[order], d[order]], axis=1)


@dataclass(frozen=True)
class Chunk:
    src_pages: np.ndarray
    dst_pages: np.ndarray
    """Every page of the request on the reader."""
    start: int
    tokens: int


def chunk_of(src_req: np.ndarray, dst_req: np.ndarray, Ps: int, Pd: int, first: int, count: int) -> Chunk:
    """Request pages ``[first, first + count)`` of the writer, as the worker's ``chunk_slots`` cuts them."""
    start = first * Ps
    tokens = descriptors.chunk_tokens(start, count, Ps, len(dst_req) * Pd)
    return Chunk(src_req[first : first + count], dst_req, start, tokens)


def old_plan(
    src: Rank, dst: Rank, hb: int, chunk: Chunk, s: heads.HeadSlice, rows: np.ndarray | None
) -> np.ndarray:
    """``plan.py``'s strided path: ``strided_descriptors`` over the group's rows."""
    src_rows, dst_rows = (src.rows, dst.rows) if rows is None else (src.rows[rows], dst.rows[rows])
    triple = descriptors.strided_descriptors(
        src.bases, src.lengths, src_rows, dst.bases, dst.lengths, dst_rows, hb,
        descriptors.slots_of(chunk.src_pages, src.page_size, 0, chunk.tokens),
        descriptors.slots_of(chunk.dst_pages, dst.page_size, chunk.start, chunk.tokens),
        src.page_size, dst.page_size, s.src_head_start, s.dst_head_start, s.num_heads,
        src.heads_local, dst.heads_local,
    )  # fmt: skip
    return pairs(*triple, hb)


def spec_of(
    src: Rank, dst: Rank, hb: int, s: heads.HeadSlice, mla: bool, group_layers: int | None
) -> TableSpec:
    return decide_table(
        src.rows, dst.rows, hb, src.page_size, dst.page_size, s.src_head_start, s.dst_head_start,
        s.num_heads, src.heads_local, dst.heads_local, mla=mla, group_layers=group_layers,
    )  # fmt: skip


def new_plan(spec: TableSpec, src: Rank, dst: Rank, chunk: Chunk, rows: np.ndarray | None) -> np.ndarray:
    src_addr, src_len = side_entries(spec, "src", src.bases, src.lengths, src.rows, src.num_pages)
    dst_addr, dst_len = side_entries(spec, "dst", dst.bases, dst.lengths, dst.rows, dst.num_pages)
    assert src_addr.size == spec.table_entries("src", src.num_pages) == src_len.size
    assert dst_addr.size == spec.table_entries("dst", dst.num_pages) == dst_len.size
    si, di = write_indices(
        spec, chunk.src_pages, chunk.dst_pages, rows, dst_start_token=chunk.start, num_tokens=chunk.tokens
    )
    assert si.dtype == di.dtype == np.int32 and si.shape == di.shape
    assert (src_len[si] == spec.entry_bytes).all() and (dst_len[di] == spec.entry_bytes).all()
    return pairs(src_addr[si], dst_addr[di], np.full(si.size, spec.entry_bytes), spec.head_bytes)


def assert_same_moves(old: np.ndarray, new: np.ndarray) -> None:
    assert old.shape == new.shape, f"{len(old)} runs of the old planner, {len(new)} of the tables"
    assert np.array_equal(old, new)
    assert np.unique(new[:, 0]).size == len(new) and np.unique(new[:, 1]).size == len(new)


# ---------------------------------------------------------------- the cases


@dataclass(frozen=True)
class Case:
    src: Lay
    dst: Lay
    P: int = 1
    D: int = 1
    mla: bool = False
    hb: int = 32
    num_heads: int = 4
    num_layers: int = 4
    group_layers: int | None = None
    expected: tuple[str, ...] = ()
    """Granularity of each (writer, reader) pair's table, in ``writers_of`` order over decode ranks."""


CASES: dict[str, Case] = {
    # the contiguous layout: the direct path and hetero-TP head slices
    "ours-direct": Case(Lay("ours"), Lay("ours"), expected=("(tensor, page)",)),
    "ours-slice-1to2": Case(Lay("ours"), Lay("ours"), 1, 2, expected=("(tensor, token)",) * 2),
    "ours-slice-2to1": Case(Lay("ours"), Lay("ours"), 2, 1, expected=("(tensor, token)",) * 2),
    "ours-slice-4to2": Case(Lay("ours"), Lay("ours"), 4, 2, expected=("(tensor, token)",) * 4),
    "ours-pages-16to8": Case(Lay("ours", 16), Lay("ours", 8), expected=("(tensor, 8 tokens)",)),
    "ours-mla-2to1": Case(Lay("ours"), Lay("ours"), 2, 1, mla=True, expected=("(layer, page)",)),
    "sglang-page1-to-flash-nhd16": Case(Lay("ours", 1), Lay("flash_nhd", 16), expected=("(tensor, token)",)),
    # the engine's older strided layouts
    "vllm-cpu-2to1": Case(Lay("vllm_cpu", 4), Lay("vllm_cpu", 4), 2, 1, expected=("(layer, page)",) * 2),
    "vllm-cpu-pages-4to8": Case(
        Lay("vllm_cpu", 4), Lay("vllm_cpu", 8), expected=("(layer, 4 tokens, head)",)
    ),
    "flash-nhd-to-hnd-2to1": Case(
        Lay("flash_nhd", 8), Lay("flash_hnd", 4), 2, 1, expected=("(tensor, token, head)",) * 2
    ),
    "flash-hnd-2to1": Case(Lay("flash_hnd", 4), Lay("flash_hnd", 4), 2, 1, expected=("(tensor, page)",) * 2),
    # vLLM 0.32's layouts
    "nhd-direct": Case(Lay("LBNHC"), Lay("LBNHC"), expected=("(layer, page)",)),
    "nhd-2to1": Case(Lay("LBNHC"), Lay("LBNHC"), 2, 1, expected=("(layer, token)",) * 2),
    "nhd-1to2": Case(Lay("LBNHC"), Lay("LBNHC"), 1, 2, expected=("(layer, token)",) * 2),
    "nhd-4to2": Case(Lay("LBNHC"), Lay("LBNHC"), 4, 2, num_heads=8, expected=("(layer, token)",) * 4),
    "nhd-to-hnd": Case(Lay("LBNHC"), Lay("LBHNC"), expected=("(layer, token, head)",)),
    "hnd-to-nhd-2to1": Case(Lay("LBHNC"), Lay("LBNHC"), 2, 1, expected=("(layer, token, head)",) * 2),
    "hnd-2to1": Case(Lay("LBHNC"), Lay("LBHNC"), 2, 1, expected=("(layer, page)",) * 2),
    "hnd-pages-16to8": Case(Lay("LBHNC", 16), Lay("LBHNC", 8), expected=("(layer, 8 tokens, head)",)),
    "nhd-pages-16to8": Case(Lay("LBNHC", 16), Lay("LBNHC", 8), expected=("(layer, 8 tokens)",)),
    "lhbnc": Case(Lay("LHBNC"), Lay("LHBNC"), expected=("(layer, page, head)",)),
    "lhbnc-to-blnhc": Case(Lay("LHBNC"), Lay("BLNHC"), expected=("(layer, token, head)",)),
    "blnhc-chunk": Case(Lay("BLNHC"), Lay("BLNHC"), expected=("(every layer, page)",)),
    "blnhc-groups-of-2": Case(Lay("BLNHC"), Lay("BLNHC"), group_layers=2, expected=("(2 layers, page)",)),
    "blhnc-chunk": Case(Lay("BLHNC"), Lay("BLHNC"), expected=("(every layer, page)",)),
    "blhnc-2to1": Case(Lay("BLHNC"), Lay("BLHNC"), 2, 1, expected=("(layer, page)",) * 2),
    "bhlnc-chunk": Case(Lay("BHLNC"), Lay("BHLNC"), expected=("(every layer, page)",)),
    "bhlnc-groups-of-2": Case(
        Lay("BHLNC"), Lay("BHLNC"), group_layers=2, expected=("(2 layers, page, head)",)
    ),
    "bhlnc-to-hnd-2to1": Case(Lay("BHLNC"), Lay("LBHNC"), 2, 1, expected=("(layer, page, head)",) * 2),
    "blnhc-to-nhd": Case(Lay("BLNHC"), Lay("LBNHC"), expected=("(layer, page)",)),
    "kernel-blocks-to-hnd": Case(
        Lay("LBNHC", 8, ratio=2), Lay("LBHNC", 16), expected=("(layer, token, head)",)
    ),
    "kernel-blocks-direct": Case(
        Lay("LBNHC", 8, ratio=2), Lay("LBNHC", 8, ratio=2), expected=("(layer, page)",)
    ),
    "fp8-1to2": Case(Lay("LBNHC"), Lay("LBNHC"), 1, 2, hb=16, expected=("(layer, token)",) * 2),
    "fp8-2to1": Case(Lay("LBNHC"), Lay("LBNHC"), 2, 1, hb=16, expected=("(layer, token)",) * 2),
    "mla-2to1": Case(Lay("LBNHC"), Lay("LBNHC"), 2, 1, mla=True, hb=144, expected=("(layer, page)",)),
    "mla-1to2": Case(Lay("LBNHC"), Lay("LBNHC"), 1, 2, mla=True, hb=144, expected=("(layer, page)",) * 2),
    "mla-padded-to-hnd": Case(
        Lay("LBNHC", padded_page=4096), Lay("LBHNC"), mla=True, hb=144, expected=("(layer, page)",)
    ),
    "mla-fp8-656": Case(Lay("LBHNC"), Lay("LBHNC"), mla=True, hb=656, expected=("(layer, page)",)),
    "mla-blnhc": Case(Lay("BLNHC"), Lay("BLNHC"), mla=True, hb=144, expected=("(every layer, page)",)),
}


def pairs_of(case: Case) -> list[tuple[heads.HeadSlice, int, int]]:
    """(slice, writer heads, reader heads) of every writer of every decode rank."""
    out = []
    for d in range(case.D):
        for s in heads.writers_of(case.num_heads, case.P, case.D, d, case.mla):
            local = 1 if case.mla else case.num_heads // case.P
            out.append((s, local, 1 if case.mla else case.num_heads // case.D))
    return out


def request(
    lay_s: Lay, lay_d: Lay, pages: int, shape: str, seed: int
) -> tuple[int, int, np.ndarray, np.ndarray]:
    """(src pool pages, dst pool pages, src request pages, dst request pages) of ``shape``: a request
    of ``pages`` writer pages; the reader holds the same tokens (its last page may be partial)."""
    dst_count = -(-pages * lay_s.page_size // lay_d.page_size)

    def table(lay: Lay, count: int, side_seed: int) -> tuple[int, np.ndarray]:
        ratio = lay.ratio
        blocks = -(-count // ratio)
        total = pool_pages(shape, blocks, 8)
        block_ids = room_tables(shape, blocks, 8, seed=side_seed)[3]
        page_ids = (block_ids[:, None] * ratio + np.arange(ratio)).reshape(-1)[:count]
        return total * ratio, page_ids

    src_total, src_req = table(lay_s, pages, 2 * seed)
    dst_total, dst_req = table(lay_d, dst_count, 2 * seed + 1)
    return src_total, dst_total, src_req, dst_req


def run_case(case: Case, shape: str, seed: int, chunks: list[tuple[int, int]], pages: int = 6) -> list[str]:
    """Every (writer, reader) pair of ``case`` over ``chunks`` (request page ranges) of one request,
    whole and in ``case.group_layers`` groups; returns each pair's granularity."""
    src_total, dst_total, src_req, dst_req = request(case.src, case.dst, pages, shape, seed)
    seen = []
    for s, src_heads, dst_heads in pairs_of(case):
        src = rank(case.src, case.num_layers, src_total, src_heads, case.hb, case.mla, 1 << 48)
        dst = rank(case.dst, case.num_layers, dst_total, dst_heads, case.hb, case.mla, 1 << 52)
        spec = spec_of(src, dst, case.hb, s, case.mla, case.group_layers)
        seen.append(spec.granularity)
        per = case.group_layers
        groups = [None] if per is None else [
            group_tensors(case.num_layers, case.mla, a, min(a + per, case.num_layers))
            for a in range(0, case.num_layers, per)
        ]  # fmt: skip
        for first, count in chunks:
            chunk = chunk_of(src_req, dst_req, src.page_size, dst.page_size, first, count)
            for rows in groups:
                assert_same_moves(
                    old_plan(src, dst, case.hb, chunk, s, rows), new_plan(spec, src, dst, chunk, rows)
                )
    return seen


@pytest.mark.parametrize("shape", ["realistic", "scattered"])
@pytest.mark.parametrize("name", list(CASES))
def test_tables_move_what_the_old_planner_moves(name: str, shape: str) -> None:
    case = CASES[name]
    seen = run_case(case, shape, seed=len(name), chunks=[(0, 6), (0, 2), (2, 3), (5, 1)])
    assert tuple(seen) == case.expected
    if case.group_layers is None and not case.mla:  # and as layer groups of one layer
        run_case(replace(case, group_layers=1), shape, seed=3, chunks=[(1, 4)])


def test_block_major_groups_take_units_of_the_group() -> None:
    """A block-major layout decided for groups of 2 layers: each group's indices name whole
    (2 layers, page) entries; a group of 1 layer is not made of them."""
    case = CASES["blnhc-groups-of-2"]
    src = rank(case.src, 4, 8, 4, 32, False, 1 << 48)
    spec = spec_of(src, src, 32, heads.HeadSlice(0, 0, 0, 4), False, 2)
    assert (spec.layers_per_entry, spec.kv_fused, spec.num_units, spec.entry_bytes) == (
        2,
        True,
        2,
        2 * 2 * 16 * 4 * 32,
    )
    si, di = write_indices(spec, [3, 1], [0, 2], group_tensors(4, False, 2, 4))
    assert si.tolist() == [3 * 2 + 1, 1 * 2 + 1] and di.tolist() == [0 * 2 + 1, 2 * 2 + 1]
    with pytest.raises(ConfigError, match=r"hold part of entry unit 0 \(tensors \[0, 1, 4, 5\]\)"):
        write_indices(spec, [3], [0], group_tensors(4, False, 1, 2))


def test_contiguous_tables_match_direct_and_slice_descriptors() -> None:
    """The contiguous layout's own planners (``plan.py``'s direct and slice branches) move the same."""
    L, H, hb, P = 3, 4, 16, 4
    src_req, dst_req = np.array([7, 2, 3, 9]), np.array([1, 5, 6, 0])
    for (s_heads, d_heads), s in (
        ((H, H), heads.HeadSlice(0, 0, 0, H)),
        ((H // 2, H), heads.HeadSlice(1, 0, 2, 2)),
    ):
        src = rank(Lay("ours", P), L, 12, s_heads, hb, False, 1 << 48)
        dst = rank(Lay("ours", P), L, 12, d_heads, hb, False, 1 << 52)
        spec = spec_of(src, dst, hb, s, False, None)
        chunk = Chunk(src_req, dst_req, 0, len(src_req) * P)
        if s_heads == d_heads:
            old = descriptors.direct_descriptors(src.bases, dst.bases, P * H * hb, src_req, dst_req)
        else:
            old = descriptors.slice_descriptors(
                src.bases, dst.bases, s_heads * hb, d_heads * hb, hb,
                descriptors.slots_of(src_req, P), descriptors.slots_of(dst_req, P),
                s.src_head_start, s.dst_head_start, s.num_heads,
            )  # fmt: skip
        assert_same_moves(pairs(*old, hb), new_plan(spec, src, dst, chunk, None))


# ---------------------------------------------------------------- property: any pair of layouts

KINDS = [*ENGINE, *VLLM, "kernel-blocks"]
TP = [(1, 1), (1, 2), (2, 1), (4, 2), (2, 4)]
PAGES = [(4, 4), (8, 4), (4, 8), (1, 4), (4, 1), (2, 2)]


def lay_of(kind: str, page_size: int) -> Lay:
    if kind == "kernel-blocks":
        return Lay("LBNHC", page_size, ratio=2)
    return Lay(kind, page_size)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    src_kind=st.sampled_from(KINDS),
    dst_kind=st.sampled_from(KINDS),
    tp=st.sampled_from(TP),
    pages=st.sampled_from(PAGES),
    mla=st.booleans(),
    hb=st.sampled_from([8, 24]),
    group_layers=st.sampled_from([None, 1, 2]),
    shape=st.sampled_from(["realistic", "scattered", "contiguous"]),
    seed=st.integers(0, 1000),
    chunk=st.tuples(st.integers(0, 4), st.integers(1, 5)),
)
def test_any_layouts_any_pages(
    src_kind: str,
    dst_kind: str,
    tp: tuple[int, int],
    pages: tuple[int, int],
    mla: bool,
    hb: int,
    group_layers: int | None,
    shape: str,
    seed: int,
    chunk: tuple[int, int],
) -> None:
    if mla and ({src_kind, dst_kind} & {"vllm_cpu", "flash_nhd", "flash_hnd"}):
        src_kind = dst_kind = "ours"
    first, count = chunk[0], min(chunk[1], 5 - chunk[0])
    case = Case(
        lay_of(src_kind, pages[0]), lay_of(dst_kind, pages[1]), *tp, mla=mla, hb=hb, group_layers=group_layers
    )
    run_case(case, shape, seed, [(first, count)], pages=5)


# ---------------------------------------------------------------- the strides tables are the pools'


@pytest.mark.parametrize("kind", ENGINE)
def test_engine_rows_are_the_pools(kind: str) -> None:
    from transfer_engine.memory import layout as lay

    L, H, D, P, pages = 2, 4, 8, 4, 6
    layout = lay.KVLayout(num_layers=L, num_heads=H, head_dim=D, dtype=torch.float32, page_size=P)
    if kind == "ours":
        memory = [torch.zeros(pages * P, H, D) for _ in range(2 * L)]
        views = lay.views_contiguous(memory[:L], memory[L:], P)
    elif kind == "vllm_cpu":
        memory = [torch.zeros(pages, H, P, 2 * D) for _ in range(L)]
        views = lay.views_vllm_cpu(memory, D)
    else:
        memory = [torch.zeros(2, pages, *((P, H) if kind == "flash_nhd" else (H, P)), D) for _ in range(L)]
        views = (lay.views_flash_nhd if kind == "flash_nhd" else lay.views_flash_hnd)(memory)
    pool = lay.KVPool.from_views(layout, 1, 0, views, memory)
    lengths, rows = engine_rows(Lay(kind, P), L, pages, H, D * 4, False)
    assert np.array_equal(pool.stride_rows, rows)
    assert pool.region_lengths.tolist() == lengths


@pytest.mark.parametrize(
    "lay,mla",
    [(Lay(k), False) for k in VLLM]
    + [(Lay("LBNHC", 8, ratio=2), False), (Lay("LBNHC"), True), (Lay("LBNHC", padded_page=4096), True)],
    ids=lambda v: repr(v) if isinstance(v, Lay) else str(v),
)
def test_vllm_rows_are_the_pools(lay: Lay, mla: bool) -> None:
    """Strides rows of ``vllm_rows`` are those of ``pool_from_vllm`` over tensors laid out as vLLM's
    ``allocate_kv_cache`` lays them (``tests/vllm/test_layouts.py`` checks that against vLLM itself)."""
    from transfer_engine.integrations.vllm.layouts import pool_from_vllm

    L, blocks, H, hb = 3, 5, 1 if mla else 2, 144 if mla else 32
    N = lay.page_size * lay.ratio
    content = hb if mla else 2 * hb
    lengths, rows = vllm_rows(lay, L, blocks, H, hb, mla)
    buf = torch.zeros(lengths[0], dtype=torch.uint8)
    caches = {}
    for layer in range(L):
        k = rows[layer]
        stride = (int(k[2]) * lay.ratio, int(k[3]), int(k[4]), 1)
        t = torch.as_strided(buf, (blocks, H, N, content), stride, int(k[1]))
        if lay.ratio > 1:
            t = torch.as_strided(t, (blocks * lay.ratio, H, lay.page_size, content), (int(k[2]), *stride[1:]))
        caches[f"layer.{layer}"] = t
    kv = pool_from_vllm(
        caches, layout=lay.kind, block_size=N, head_size=None if mla else hb, tp_size=1, tp_rank=0
    )
    assert np.array_equal(kv.pool.stride_rows, rows)
    assert kv.pool.region_lengths.tolist() == lengths


# ---------------------------------------------------------------- index arithmetic and its errors


def _spec(**over: object) -> TableSpec:
    src = rank(Lay("LBNHC"), 4, 8, 4, 32, False, 1 << 48)
    args: dict[str, object] = dict(
        src_strides=src.rows, dst_strides=src.rows, head_bytes=32, src_page_size=16, dst_page_size=16,
        src_head_start=0, dst_head_start=0, num_heads=4, src_heads_local=4, dst_heads_local=4,
    )  # fmt: skip
    args.update(over)
    return decide_table(**args)  # type: ignore[arg-type]


def test_spec_of_vllm_nhd() -> None:
    spec = _spec()
    assert spec.order == (("kv", 2, 32), ("head", 4, 64), ("token", 16, 256))
    assert (spec.entry_bytes, spec.num_units, spec.entries_per_page("src"), spec.table_entries("dst", 8)) == (
        4096,
        4,
        1,
        32,
    )
    assert spec.unit_rows(1) == [1, 5]
    assert hash(spec) == hash(_spec()) and spec == _spec()


def test_indices_are_outer_sums() -> None:
    """(layer, token, head) entries, unequal pages: the index is ``(slot group * units + unit) *
    head groups + head group``, unit-major, then token, then head."""
    src = rank(Lay("LBNHC", 4), 2, 8, 2, 8, False, 1 << 48)
    dst = rank(Lay("LBHNC", 2), 2, 16, 2, 8, False, 1 << 52)
    spec = spec_of(src, dst, 8, heads.HeadSlice(0, 0, 0, 2), False, None)
    assert (spec.granularity, spec.tokens_per_entry, spec.head_groups, spec.num_units) == (
        "(layer, token, head)",
        1,
        2,
        2,
    )
    src_g, dst_g = chunk_groups(spec, [5], [3, 9, 1], dst_start_token=2)
    assert src_g.tolist() == [20, 21, 22, 23] and dst_g.tolist() == [18, 19, 2, 3]
    si, di = group_indices(spec, (src_g, dst_g), group_tensors(2, False, 1, 2))
    assert si.tolist() == [(g * 2 + 1) * 2 + h for g in (20, 21, 22, 23) for h in (0, 1)]
    assert di.tolist() == [(g * 2 + 1) * 2 + h for g in (18, 19, 2, 3) for h in (0, 1)]
    assert units_of(spec, None).tolist() == [0, 1]


def test_empty_chunk() -> None:
    spec = _spec()
    si, di = write_indices(spec, [1, 2], [3], dst_start_token=16)
    assert si.size == di.size == 0 and si.dtype == np.int32


def test_side_entries_values() -> None:
    src = rank(Lay("LBNHC"), 4, 8, 4, 32, False, 1 << 48)
    spec = _spec()
    addr, length = side_entries(spec, "src", src.bases, src.lengths, src.rows, 8)
    block = 16 * 4 * 64
    layer = 8 * block
    expected = [(1 << 48) + p * block + u * layer for p in range(8) for u in range(4)]
    assert addr.tolist() == expected and length.tolist() == [block] * 32 and not length.flags.writeable


@pytest.mark.parametrize(
    ("over", "message"),
    [
        (
            dict(dst_strides=np.zeros((6, 5), dtype=np.int64)),
            r"src_strides describes 8 tensors but dst_strides 6",
        ),
        (
            dict(src_strides=np.zeros((8, 4), dtype=np.int64)),
            r"src_strides must be an integer table of shape",
        ),
        (dict(head_bytes=0), r"head_bytes=0 must be an integer >= 1"),
        (dict(dst_page_size=0), r"dst_page_size=0 must be an integer >= 1"),
        (dict(num_heads=0), r"num_heads=0 must be"),
        (dict(src_head_start=1), r"src head slice \[1, 5\) does not fit in 4 heads"),
        (dict(dst_head_start=-1), r"dst_head_start=-1 must be an integer >= 0"),
        (dict(group_layers=0), r"group_layers=0 must be an integer >= 1"),
    ],
)
def test_decide_errors_name_the_value(over: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _spec(**over)


def test_decide_rejects_odd_tensor_counts() -> None:
    rows = rank(Lay("LBNHC"), 4, 8, 4, 32, False, 1 << 48).rows[:7]
    with pytest.raises(ConfigError, match=r"src_strides describes 7 tensors; expected 2L"):
        _spec(src_strides=rows, dst_strides=rows)
    negative = rows.copy()
    negative[2, 3] = -1
    with pytest.raises(ConfigError, match=r"src_strides\[2\].head=-1 must be >= 0"):
        _spec(src_strides=negative, dst_strides=rows)


def test_side_entries_errors_name_the_tensor() -> None:
    src = rank(Lay("LBNHC"), 4, 8, 4, 32, False, 1 << 48)
    spec = _spec()
    with pytest.raises(ConfigError, match=r"src tensor 3: an entry ends \d+ bytes into region 0"):
        side_entries(spec, "src", src.bases, src.lengths - np.uint64(1), src.rows, 8)
    with pytest.raises(ConfigError, match=r"dst tensor 3: an entry ends"):
        side_entries(spec, "dst", src.bases, src.lengths, src.rows, 9)
    rows = src.rows.copy()
    rows[3, 0] = 4
    with pytest.raises(ConfigError, match=r"src tensor 3 names region 4 of 1"):
        side_entries(spec, "src", src.bases, src.lengths, rows, 8)
    hnd = rank(Lay("LBHNC"), 4, 8, 4, 32, False, 1 << 48)
    with pytest.raises(
        ConfigError, match=r"dst_strides give the head dimension stride 1024, the spec's entries need 64"
    ):
        side_entries(spec, "dst", hnd.bases, hnd.lengths, hnd.rows, 8)
    with pytest.raises(ConfigError, match=r"side='left' must be 'src' or 'dst'"):
        side_entries(spec, "left", src.bases, src.lengths, src.rows, 8)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"num_pages=0 must be"):
        side_entries(spec, "src", src.bases, src.lengths, src.rows, 0)
    with pytest.raises(ConfigError, match=r"src_bases has 1 regions but src_lengths has 2"):
        side_entries(spec, "src", src.bases, [1, 2], src.rows, 8)
    with pytest.raises(ConfigError, match=r"src_strides describes 6 tensors, the spec 8"):
        side_entries(spec, "src", src.bases, src.lengths, src.rows[:6], 8)


def test_side_entries_refuses_tables_beyond_int32() -> None:
    ours = rank(Lay("ours", 1), 1, 1, 1, 8, False, 1 << 48)
    spec = spec_of(ours, ours, 8, heads.HeadSlice(0, 0, 0, 1), False, None)
    with pytest.raises(ConfigError, match=r"src table of 4294967296 entries .* exceeds NIXL's int32"):
        side_entries(spec, "src", ours.bases, [1 << 40, 1 << 40], ours.rows, 1 << 31)


def test_index_errors_name_the_value() -> None:
    spec = _spec()
    with pytest.raises(ConfigError, match=r"src_pages must be >= 0, got -1"):
        write_indices(spec, [-1], [0])
    with pytest.raises(ConfigError, match=r"dst_pages must be 1-D"):
        write_indices(spec, [1], [[0]])
    with pytest.raises(ConfigError, match=r"src_pages must hold integers"):
        write_indices(spec, [1.5], [0])
    with pytest.raises(ConfigError, match=r"num_tokens=48 from dst_start_token=0 do not fit 2 src pages"):
        write_indices(spec, [1, 2], [0, 1, 2], num_tokens=48)
    with pytest.raises(
        ConfigError, match=r"dst_start_token=8 and num_tokens=16 must be multiples of the entries' 16"
    ):
        write_indices(spec, [1], [0, 1], dst_start_token=8, num_tokens=16)
    with pytest.raises(ConfigError, match=r"rows \[1, 1\] repeat a tensor"):
        write_indices(spec, [1], [0], [1, 1])
    with pytest.raises(ConfigError, match=r"rows \[8\] name a tensor outside \[0, 8\)"):
        write_indices(spec, [1], [0], [8])
    with pytest.raises(ConfigError, match=r"rows \[1\] hold part of entry unit 1 \(tensors \[1, 5\]\)"):
        write_indices(spec, [1], [0], [1])
    with pytest.raises(ConfigError, match=r"rows must be a non-empty 1-D integer array"):
        write_indices(spec, [1], [0], [])
    with pytest.raises(ConfigError, match=r"page slot group 2147483647 gives table indices beyond int32"):
        write_indices(spec, [2**31 - 1], [0])
