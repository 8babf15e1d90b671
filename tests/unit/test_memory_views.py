"""Pools over memory a serving system owns: raw pointers (SGLang), aux packing.

No sockets: the views are checked to alias the caller's memory (a write through one is seen by the
other) and every bad input to raise LayoutError naming the value.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from transfer_engine.errors import LayoutError
from transfer_engine.memory.layout import KVLayout
from transfer_engine.memory.views import (
    AuxBuffers,
    check_disjoint,
    pool_from_pointers,
    view_of,
)

LAYOUT = KVLayout(num_layers=2, num_heads=4, head_dim=8, dtype=torch.float16, page_size=4)
PAGE_BYTES = 4 * 2 * 8 * 2  # page_size x heads_local (tp 2) x head_dim x 2 bytes


def buffers(n: int = 4, pages: int = 5) -> list[torch.Tensor]:
    return [torch.zeros(pages * PAGE_BYTES, dtype=torch.uint8) for _ in range(n)]


def args(bufs: list[torch.Tensor]) -> tuple[list[int], list[int], list[int]]:
    return [b.data_ptr() for b in bufs], [b.numel() for b in bufs], [PAGE_BYTES] * len(bufs)


def test_view_of_aliases_the_memory() -> None:
    t = torch.arange(16, dtype=torch.uint8)
    v = view_of(t.data_ptr(), 16)
    v[3] = 200
    assert t[3] == 200 and v.data_ptr() == t.data_ptr()


def test_pool_from_pointers_views_each_buffer() -> None:
    bufs = buffers()
    pool = pool_from_pointers(LAYOUT, 2, 1, *args(bufs))
    assert pool.num_pages == 5 and pool.heads_local == 2
    assert [r.addr for r in pool.regions()] == [b.data_ptr() for b in bufs]
    pool.tensors[2][7, 1, 3] = 1.5  # V of layer 0
    assert bufs[2].view(torch.float16).view(20, 2, 8)[7, 1, 3] == 1.5


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda p, n, i: (p[:3], n, i), "got 3 kv_data_ptrs"),
        (lambda p, n, i: (p, n, [i[0], i[1] * 2, *i[2:]]), "kv_item_lens\\[1\\]=256"),
        (lambda p, n, i: (p, [n[0] - 1, *n[1:]], i), "kv_data_lens\\[0\\]=639"),
        (lambda p, n, i: (p, [*n[:3], n[3] - PAGE_BYTES], i), "kv_data_lens\\[3\\]=512 differs"),
        (lambda p, n, i: ([p[0], p[0] + 8, *p[2:]], n, i), "overlaps"),
        (lambda p, n, i: ([0, *p[1:]], n, i), "address 0x0"),
        (lambda p, n, i: ([-5, *p[1:]], n, i), "kv_data_ptrs\\[0\\]=-5"),
    ],
)
def test_pool_from_pointers_refuses_bad_input(
    mutate: Callable[..., tuple[list[int], ...]], match: str
) -> None:
    bufs = buffers()
    with pytest.raises(LayoutError, match=match):
        pool_from_pointers(LAYOUT, 2, 0, *mutate(*args(bufs)))


def test_aux_buffers_pack_and_unpack_items_of_different_sizes() -> None:
    tokens = torch.zeros(6, 4, dtype=torch.int32)
    logprobs = torch.zeros(6, 2, dtype=torch.float64)
    aux = AuxBuffers([tokens.data_ptr(), logprobs.data_ptr()], [96, 96], [16, 16], device="cpu")
    assert aux.packed.shape == (6, 32)
    tokens[3] = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    logprobs[3] = torch.tensor([-0.5, -1.25], dtype=torch.float64)
    aux.pack(3)
    expected = torch.cat([tokens[3].view(torch.uint8), logprobs[3].view(torch.uint8)])
    assert torch.equal(aux.packed[3], expected)
    tokens.zero_()
    logprobs.zero_()
    aux.unpack(3)
    assert tokens[3].tolist() == [1, 2, 3, 4] and logprobs[3].tolist() == [-0.5, -1.25]
    assert tokens[2].tolist() == [0, 0, 0, 0]
    with pytest.raises(LayoutError, match="aux slot 6"):
        aux.pack(6)


def test_aux_buffers_refuse_bad_input() -> None:
    a, b = torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(
        LayoutError, match="aux_data_lens\\[1\\]=64 is not a multiple of aux_item_lens\\[1\\]=24"
    ):
        AuxBuffers([a.data_ptr(), b.data_ptr()], [64, 64], [8, 24])
    with pytest.raises(LayoutError, match="aux buffer 1 holds 4 slots"):
        AuxBuffers([a.data_ptr(), b.data_ptr()], [64, 64], [8, 16])
    with pytest.raises(LayoutError, match="overlaps"):
        AuxBuffers([a.data_ptr(), a.data_ptr() + 8], [64, 56], [8, 7])
    with pytest.raises(LayoutError, match="at least one"):
        AuxBuffers([], [], [])


def test_check_disjoint_names_both_ranges() -> None:
    check_disjoint([("a", 100, 10), ("b", 110, 5)])
    with pytest.raises(LayoutError, match="a \\[0x64, 0x6f\\) overlaps b starting at 0x6e"):
        check_disjoint([("b", 110, 5), ("a", 100, 11)])
