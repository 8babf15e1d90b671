"""Strided KV layouts: the pool's view validation and ``strided_descriptors``' byte runs, without sockets.

Descriptors are executed here by ``ctypes.memmove`` on the real tensors, then every byte of the
destination memory is compared with what the layouts say it must hold.
"""

from __future__ import annotations

import ctypes
import random

import numpy as np
import pytest
import torch

from transfer_engine import KVLayout, KVPool
from transfer_engine.errors import ConfigError, LayoutError
from transfer_engine.memory.layout import (
    stride_rows_of,
    views_contiguous,
    views_flash_hnd,
    views_flash_nhd,
    views_vllm_cpu,
)
from transfer_engine.protocol import descriptors, heads
from transfer_engine.protocol.paths import TransferPath, auto_path

L, H, D = 2, 4, 8
LAYOUTS = ["ours", "vllm_cpu", "flash_nhd", "flash_hnd"]


def make(
    kind: str, num_blocks: int, bs: int, heads: int, seed: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(memory, views) of one rank's KV in layout ``kind``, filled with random float32 values."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    if kind == "ours":
        k = [rand(num_blocks * bs, heads, D) for _ in range(L)]
        v = [rand(num_blocks * bs, heads, D) for _ in range(L)]
        return [*k, *v], views_contiguous(k, v, bs)
    if kind == "vllm_cpu":
        layers = [rand(num_blocks, heads, bs, 2 * D) for _ in range(L)]
        return layers, views_vllm_cpu(layers, D)
    if kind == "flash_nhd":
        layers = [rand(2, num_blocks, bs, heads, D) for _ in range(L)]
        return layers, views_flash_nhd(layers)
    layers = [rand(2, num_blocks, heads, bs, D) for _ in range(L)]
    return layers, views_flash_hnd(layers)


def pool_of(
    kind: str, tp: int, rank: int, num_blocks: int, bs: int, seed: int
) -> tuple[KVPool, list[torch.Tensor]]:
    memory, views = make(kind, num_blocks, bs, H // tp, seed)
    layout = KVLayout(num_layers=L, num_heads=H, head_dim=D, dtype=torch.float32, page_size=bs)
    return KVPool.from_views(layout, tp, rank, views, memory), views


def execute(src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> None:
    for s, d, n in zip(src.tolist(), dst.tolist(), length.tolist(), strict=True):
        ctypes.memmove(d, s, n)


def move(src_pool: KVPool, dst_pool: KVPool, src_pages, dst_pages, src_h0: int, dst_h0: int, nh: int):
    ps, pd = src_pool.layout.page_size, dst_pool.layout.page_size
    tokens = min(len(src_pages) * ps, len(dst_pages) * pd)
    return descriptors.strided_descriptors(
        [t.data_ptr() for t in src_pool.tensors],
        src_pool.region_lengths,
        src_pool.stride_rows,
        [t.data_ptr() for t in dst_pool.tensors],
        dst_pool.region_lengths,
        dst_pool.stride_rows,
        src_pool.head_bytes,
        descriptors.slots_of(src_pages, ps, 0, tokens),
        descriptors.slots_of(dst_pages, pd, 0, tokens),
        ps,
        pd,
        src_h0,
        dst_h0,
        nh,
        src_pool.heads_local,
        dst_pool.heads_local,
    )


def expected_after(dst_kind, dst_memory, dst_bs, src_views, src_pages, dst_pages, src_h0, dst_h0, nh, ps):
    """A copy of the destination memory with the moved heads written through its own views."""
    memory = [t.clone() for t in dst_memory]
    kind_views = {
        "ours": lambda m: views_contiguous(m[:L], m[L:], dst_bs),
        "vllm_cpu": lambda m: views_vllm_cpu(m, D),
        "flash_nhd": views_flash_nhd,
        "flash_hnd": views_flash_hnd,
    }
    views = kind_views[dst_kind](memory)
    tokens = min(len(src_pages) * ps, len(dst_pages) * dst_bs)
    for t in range(2 * L):
        for n in range(tokens):
            sb, so = src_pages[n // ps], n % ps
            db, do = dst_pages[n // dst_bs], n % dst_bs
            views[t][db, do, dst_h0 : dst_h0 + nh] = src_views[t][sb, so, src_h0 : src_h0 + nh]
    return memory


def assert_same_bytes(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert torch.equal(a.view(torch.int32), e.view(torch.int32)), f"memory tensor {i} differs"


@pytest.mark.parametrize("src_kind", LAYOUTS)
@pytest.mark.parametrize("dst_kind", LAYOUTS)
@pytest.mark.parametrize(("P", "Dtp"), [(1, 1), (2, 1), (1, 2)])
def test_any_layout_to_any_layout_bit_exact(src_kind: str, dst_kind: str, P: int, Dtp: int) -> None:
    rng = random.Random(hash((src_kind, dst_kind, P, Dtp)))
    bs, nb = 4, 12
    for src_rank in range(P):
        for dst_rank in range(Dtp):
            # the heads this (prefill rank, decode rank) pair shares
            lo = max(src_rank * H // P, dst_rank * H // Dtp)
            hi = min((src_rank + 1) * H // P, (dst_rank + 1) * H // Dtp)
            if lo >= hi:
                continue
            src_pool, src_views = pool_of(src_kind, P, src_rank, nb, bs, seed=1)
            dst_memory, _ = make(dst_kind, nb, bs, H // Dtp, seed=2)
            layout = KVLayout(num_layers=L, num_heads=H, head_dim=D, dtype=torch.float32, page_size=bs)
            dst_views = _views(dst_kind, dst_memory, bs)
            dst_pool = KVPool.from_views(layout, Dtp, dst_rank, dst_views, dst_memory)
            n = rng.randint(1, 5)
            src_pages = rng.sample(range(nb), n)
            dst_pages = rng.sample(range(nb), n)
            src_h0, dst_h0 = lo - src_rank * H // P, lo - dst_rank * H // Dtp
            expected = expected_after(
                dst_kind, dst_memory, bs, src_views, src_pages, dst_pages, src_h0, dst_h0, hi - lo, bs
            )
            execute(*move(src_pool, dst_pool, src_pages, dst_pages, src_h0, dst_h0, hi - lo))
            assert_same_bytes(dst_memory, expected)


def _views(kind: str, memory: list[torch.Tensor], bs: int) -> list[torch.Tensor]:
    if kind == "ours":
        return views_contiguous(memory[:L], memory[L:], bs)
    if kind == "vllm_cpu":
        return views_vllm_cpu(memory, D)
    return views_flash_nhd(memory) if kind == "flash_nhd" else views_flash_hnd(memory)


def test_different_block_sizes_bit_exact() -> None:
    src_pool, src_views = pool_of("vllm_cpu", 1, 0, 8, 4, seed=3)
    dst_memory, _ = make("flash_hnd", 4, 8, H, seed=4)
    layout = KVLayout(num_layers=L, num_heads=H, head_dim=D, dtype=torch.float32, page_size=8)
    dst_pool = KVPool.from_views(layout, 1, 0, views_flash_hnd(dst_memory), dst_memory)
    src_pages, dst_pages = [5, 1, 2], [3, 0]  # 12 tokens into 16 slots
    expected = expected_after("flash_hnd", dst_memory, 8, src_views, src_pages, dst_pages, 0, 0, H, 4)
    execute(*move(src_pool, dst_pool, src_pages, dst_pages, 0, 0, H))
    assert_same_bytes(dst_memory, expected)


def test_vllm_cpu_equal_tp_moves_whole_block_runs() -> None:
    """K beside V, head-major blocks: consecutive pages on both sides merge into one run per layer."""
    src_pool, _ = pool_of("vllm_cpu", 1, 0, 16, 32, seed=5)
    dst_pool, _ = pool_of("vllm_cpu", 1, 0, 16, 32, seed=6)
    src, dst, length = move(src_pool, dst_pool, [3, 4, 5, 9], [7, 8, 9, 2], 0, 0, H)
    block = H * 32 * 2 * D * 4
    # per layer: pages 3-5 -> 7-9 as one run, page 9 -> 2 as another
    assert sorted(length.tolist()) == sorted([3 * block, block] * L)


def test_vllm_cpu_head_slice_is_one_run_per_block() -> None:
    """Prefill rank 1 of 2 into a TP-1 decode: its head slice of a block is one piece on both sides."""
    src_pool, _ = pool_of("vllm_cpu", 2, 1, 16, 32, seed=7)
    dst_pool, _ = pool_of("vllm_cpu", 1, 0, 16, 32, seed=8)
    src, dst, length = move(src_pool, dst_pool, [0, 1, 2], [4, 5, 6], 0, H // 2, H // 2)
    assert length.tolist() == [(H // 2) * 32 * 2 * D * 4] * (L * 3)


def test_contiguous_rows_match_the_classic_formulas() -> None:
    layout = KVLayout(num_layers=L, num_heads=H, head_dim=D, dtype=torch.bfloat16, page_size=4)
    pool = KVPool.allocate(layout, 2, 0, 8)
    rows = pool.stride_rows
    assert rows.shape == (2 * L, 5)
    assert rows[:, 0].tolist() == list(range(2 * L))
    assert set(rows[:, 2].tolist()) == {pool.page_bytes}
    assert set(rows[:, 3].tolist()) == {pool.head_bytes}
    assert set(rows[:, 4].tolist()) == {pool.slot_bytes}
    assert (stride_rows_of(pool.info(), pool.heads_local) == rows).all()


def test_strides_travel_in_layout_info() -> None:
    pool, _ = pool_of("flash_hnd", 2, 1, 6, 4, seed=9)
    info = pool.info()
    assert info.strides is not None and len(info.strides) == 2 * L
    k0 = info.strides[0]
    assert (k0.region, k0.offset, k0.block, k0.head, k0.token) == (
        0,
        0,
        (H // 2) * 4 * D * 4,
        4 * D * 4,
        D * 4,
    )
    v0 = info.strides[L]
    assert (v0.region, v0.offset) == (0, 6 * (H // 2) * 4 * D * 4)


# --- errors name the bad value ------------------------------------------------------------------


def _layout(bs: int = 4) -> KVLayout:
    return KVLayout(num_layers=L, num_heads=H, head_dim=D, dtype=torch.float32, page_size=bs)


def test_from_views_rejects_wrong_count() -> None:
    memory, views = make("vllm_cpu", 4, 4, H, seed=0)
    with pytest.raises(LayoutError, match=r"got 3 KV views, expected 4"):
        KVPool.from_views(_layout(), 1, 0, views[:3], memory)


def test_from_views_rejects_wrong_block_size() -> None:
    memory, views = make("vllm_cpu", 4, 4, H, seed=0)
    with pytest.raises(LayoutError, match=r"KV view 0 has shape \(4, 4, 4, 8\), expected \[num_blocks, 8,"):
        KVPool.from_views(_layout(8), 1, 0, views, memory)


def test_from_views_rejects_a_view_outside_memory() -> None:
    memory, views = make("vllm_cpu", 4, 4, H, seed=0)
    with pytest.raises(LayoutError, match=r"KV view 1 spans .* inside no memory tensor"):
        KVPool.from_views(_layout(), 1, 0, views, memory[:1])


def test_from_views_rejects_strided_head_elements() -> None:
    memory, views = make("vllm_cpu", 4, 4, H, seed=0)
    views[2] = memory[0][..., ::2].transpose(1, 2)
    with pytest.raises(LayoutError, match=r"KV view 2 has strides .*each head's elements must be contiguous"):
        KVPool.from_views(_layout(), 1, 0, views, memory)


def test_from_views_rejects_dtype() -> None:
    memory, views = make("vllm_cpu", 4, 4, H, seed=0)
    views = [v.to(torch.float16) for v in views]
    with pytest.raises(LayoutError, match=r"KV view 0 has dtype torch.float16, expected torch.float32"):
        KVPool.from_views(_layout(), 1, 0, views, memory)


def test_from_views_rejects_non_contiguous_memory() -> None:
    memory, views = make("vllm_cpu", 4, 4, H, seed=0)
    memory = [memory[0].transpose(1, 2), memory[1]]
    with pytest.raises(LayoutError, match=r"memory tensor 0 has strides"):
        KVPool.from_views(_layout(), 1, 0, views, memory)


def _args(**over):
    pool, _ = pool_of("vllm_cpu", 1, 0, 4, 4, seed=0)
    args = dict(
        src_bases=[t.data_ptr() for t in pool.tensors],
        src_lengths=pool.region_lengths,
        src_strides=pool.stride_rows,
        dst_bases=[t.data_ptr() for t in pool.tensors],
        dst_lengths=pool.region_lengths,
        dst_strides=pool.stride_rows,
        head_bytes=pool.head_bytes,
        src_slots=[0, 1],
        dst_slots=[4, 5],
        src_page_size=4,
        dst_page_size=4,
        src_head_start=0,
        dst_head_start=0,
        num_heads=H,
        src_heads_local=H,
        dst_heads_local=H,
    )
    args.update(over)
    return pool, args


def test_descriptor_errors_name_the_value() -> None:
    pool, args = _args(dst_strides=pool_of("vllm_cpu", 1, 0, 4, 4, seed=0)[0].stride_rows[:3])
    with pytest.raises(ConfigError, match=r"src_strides describes 4 tensors but dst_strides 3"):
        descriptors.strided_descriptors(**args)
    rows = pool.stride_rows.copy()
    rows[1, 0] = 7
    with pytest.raises(ConfigError, match=r"dst tensor 1 names region 7 of 2"):
        descriptors.strided_descriptors(**_args(dst_strides=rows)[1])
    with pytest.raises(ConfigError, match=r"dst tensor 0: a run ends \d+ bytes into region 0"):
        descriptors.strided_descriptors(**_args(dst_slots=[4, 16])[1])
    with pytest.raises(ConfigError, match=r"src_slots has 2 tokens but dst_slots has 1"):
        descriptors.strided_descriptors(**_args(dst_slots=[4])[1])
    rows = pool.stride_rows.copy()
    rows[2, 3] = -1
    with pytest.raises(ConfigError, match=r"src_strides\[2\].head=-1 must be >= 0"):
        descriptors.strided_descriptors(**_args(src_strides=rows)[1])
    with pytest.raises(ConfigError, match=r"src_page_size=0 must be >= 1"):
        descriptors.strided_descriptors(**_args(src_page_size=0)[1])
    with pytest.raises(ConfigError, match=r"src head slice \[1, 5\) does not fit in 4 heads"):
        descriptors.strided_descriptors(**_args(src_head_start=1)[1])


def _pieces(src_kind: str, dst_kind: str, P: int, Dtp: int, src_bs: int, dst_bs: int) -> float:
    """The slice path's worst descriptors per page over every (writer, decode rank) of P -> Dtp."""
    worst = 0.0
    for d in range(Dtp):
        dst, _ = pool_of(dst_kind, Dtp, d, 4, dst_bs, seed=1)
        for w in heads.writers_of(H, P, Dtp, d):
            src, _ = pool_of(src_kind, P, w.prefill_rank, 4, src_bs, seed=2)
            worst = max(
                worst,
                descriptors.slice_pieces_per_page(
                    src.stride_rows, dst.stride_rows, src.head_bytes, src_bs, dst_bs,
                    w.src_head_start, w.dst_head_start, w.num_heads, src.heads_local, dst.heads_local,
                ),
            )  # fmt: skip
    return worst


@pytest.mark.parametrize(
    ("src_kind", "dst_kind", "P", "Dtp", "src_bs", "dst_bs", "expected"),
    [
        ("vllm_cpu", "vllm_cpu", 2, 1, 4, 4, L),  # a rank's heads of a block: K and V in one run per layer
        ("vllm_cpu", "vllm_cpu", 1, 2, 4, 4, L),
        ("flash_hnd", "flash_hnd", 2, 1, 4, 4, 2 * L),  # one run per tensor and block
        ("ours", "ours", 1, 1, 4, 8, 2 * L),  # equal TP, pages of 4 into pages of 8: page runs
        ("ours", "ours", 2, 1, 4, 4, 2 * L * 4),  # a head slice of ours: one run per token
        ("vllm_cpu", "vllm_cpu", 1, 1, 4, 8, L * H),  # head-major blocks of other sizes: per head
        ("flash_nhd", "flash_hnd", 2, 1, 8, 4, 2 * L * 4 * (H // 2)),  # per (tensor, token, head)
        ("vllm_cpu", "ours", 2, 1, 4, 8, 2 * L * 4 * (H // 2)),
    ],
)
def test_slice_pieces_per_page(
    src_kind: str, dst_kind: str, P: int, Dtp: int, src_bs: int, dst_bs: int, expected: int
) -> None:
    assert _pieces(src_kind, dst_kind, P, Dtp, src_bs, dst_bs) == expected


AUTO_CASES = [
    # (equal_tp, same_pages, has_ring, host, slice_pieces) -> path; 2L = 4 tensors
    ((True, True, True, False, 1000.0), TransferPath.DIRECT),
    ((False, True, True, False, 16.0), TransferPath.STAGED),
    ((False, True, True, True, 16.0), TransferPath.HOST),
    ((False, True, True, False, 4.0), TransferPath.SLICE),  # slice as coarse as direct
    ((True, False, True, False, 2.0), TransferPath.SLICE),
    ((True, False, True, False, 4.5), TransferPath.STAGED),
    ((False, True, False, False, 16.0), TransferPath.SLICE),  # no ring: slice serves every shape
    ((True, False, True, False, float("inf")), TransferPath.STAGED),  # contiguous pools: as before
]


@pytest.mark.parametrize(("args", "expected"), AUTO_CASES)
def test_auto_path(args: tuple[bool, bool, bool, bool, float], expected: TransferPath) -> None:
    equal_tp, same_pages, has_ring, host, pieces = args
    got = auto_path(
        equal_tp=equal_tp,
        same_pages=same_pages,
        has_ring=has_ring,
        host=host,
        slice_pieces=pieces,
        num_tensors=4,
    )
    assert got is expected
