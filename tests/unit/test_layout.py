"""KV layout and pool validation, on CPU tensors; expected sizes are written out by hand."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from transfer_engine.errors import ConfigError, HeadSplitError, LayoutError
from transfer_engine.memory.layout import KVLayout, KVPool, dtype_name, dtype_of
from transfer_engine.protocol.messages import LayoutInfo, MemRegion

# L=2, H=4, head_dim=8, bf16, page_size=4; at tp=2 each rank holds 2 heads.
LAYOUT = KVLayout(num_layers=2, num_heads=4, head_dim=8, dtype=torch.bfloat16, page_size=4)
MLA = KVLayout(num_layers=3, num_heads=1, head_dim=16, dtype=torch.float16, page_size=2, mla=True)


def kv(
    n: int = 4, slots: int = 8, heads: int = 2, dim: int = 8, dtype: torch.dtype = torch.bfloat16
) -> list[torch.Tensor]:
    return [torch.zeros(slots, heads, dim, dtype=dtype) for _ in range(n)]


def pool(
    tensors: list[torch.Tensor], aux: Any = None, layout: KVLayout = LAYOUT, tp: int = 2, rank: int = 0
) -> KVPool:
    return KVPool(layout, tp, rank, tensors, aux)


# ---------------------------------------------------------------- KVLayout and dtypes


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_layers", 0),
        ("num_heads", -1),
        ("head_dim", 0),
        ("page_size", 0),
        ("page_size", 2.0),
        ("num_layers", True),
    ],
)
def test_layout_rejects_non_positive_ints(field: str, value: Any) -> None:
    args: dict[str, Any] = {
        "num_layers": 2,
        "num_heads": 4,
        "head_dim": 8,
        "dtype": torch.bfloat16,
        "page_size": 4,
    }
    args[field] = value
    with pytest.raises(LayoutError, match=f"{field}={value!r}"):
        KVLayout(**args)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.complex64])
def test_layout_rejects_unsupported_dtype(dtype: torch.dtype) -> None:
    with pytest.raises(LayoutError, match=str(dtype)):
        KVLayout(num_layers=1, num_heads=1, head_dim=1, dtype=dtype, page_size=1)


def test_layout_rejects_dtype_given_as_string() -> None:
    with pytest.raises(LayoutError, match="'bfloat16'"):
        KVLayout(num_layers=1, num_heads=1, head_dim=1, dtype="bfloat16", page_size=1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("dtype", "name"),
    [
        (torch.bfloat16, "bfloat16"),
        (torch.float16, "float16"),
        (torch.float32, "float32"),
        (torch.float8_e4m3fn, "float8_e4m3fn"),
        (torch.float8_e5m2, "float8_e5m2"),
        (torch.int8, "int8"),
        (torch.uint8, "uint8"),
    ],
)
def test_dtype_names_round_trip(dtype: torch.dtype, name: str) -> None:
    assert dtype_name(dtype) == name
    assert dtype_of(name) is dtype


def test_dtype_of_names_the_bad_value() -> None:
    with pytest.raises(LayoutError, match="'float64'"):
        dtype_of("float64")
    with pytest.raises(LayoutError, match="torch.float64"):
        dtype_name(torch.float64)


def test_layout_tensor_counts_and_local_heads() -> None:
    assert LAYOUT.num_kv_tensors == 4
    assert MLA.num_kv_tensors == 3
    assert [LAYOUT.heads_local(tp) for tp in (1, 2, 4, 8, 16)] == [4, 2, 1, 1, 1]
    assert [MLA.heads_local(tp) for tp in (1, 3, 8)] == [1, 1, 1]


# ---------------------------------------------------------------- KVPool validation


def test_valid_pool_geometry() -> None:
    p = pool(kv())
    assert (p.heads_local, p.num_slots, p.num_pages) == (2, 8, 2)
    assert (p.itemsize, p.head_bytes, p.slot_bytes, p.page_bytes) == (2, 16, 32, 128)
    assert p.mem_type == "DRAM" and p.device_id == 0


@pytest.mark.parametrize(("count", "expected"), [(3, 4), (5, 4), (1, 4)])
def test_wrong_tensor_count(count: int, expected: int) -> None:
    with pytest.raises(LayoutError, match=f"got {count} KV tensors, expected {expected}"):
        pool(kv(n=count))


def test_wrong_tensor_count_mla() -> None:
    with pytest.raises(LayoutError, match="got 6 KV tensors, expected 3"):
        KVPool(MLA, 1, 0, kv(n=6, heads=1, dim=16, dtype=torch.float16))


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        pytest.param(
            lambda: kv(heads=4), r"shape \(8, 4, 8\), expected \[num_slots, 2, 8\]", id="heads-of-tp1"
        ),
        pytest.param(lambda: kv(dim=16), r"shape \(8, 2, 16\)", id="head-dim"),
        pytest.param(
            lambda: [torch.zeros(8, 16, dtype=torch.bfloat16) for _ in range(4)], r"shape \(8, 16\)", id="2d"
        ),
        pytest.param(
            lambda: [torch.zeros((), dtype=torch.bfloat16) for _ in range(4)], r"shape \(\)", id="0d"
        ),
        pytest.param(
            lambda: kv()[:3] + kv(n=1, slots=12), r"KV tensor 3 has shape \(12, 2, 8\)", id="slots-differ"
        ),
        pytest.param(
            lambda: kv(n=1) + kv(n=3, dtype=torch.float16), "KV tensor 1 has dtype torch.float16", id="dtype"
        ),
        pytest.param(lambda: kv(dtype=torch.float16), "KV tensor 0 has dtype torch.float16", id="dtype-all"),
        pytest.param(
            lambda: kv(slots=10), "num_slots=10 is not a positive multiple of page_size=4", id="slots-page"
        ),
        pytest.param(lambda: kv(slots=0), "num_slots=0", id="no-slots"),
        pytest.param(lambda: kv()[:3] + [[0.0]], "KV tensor 3 is a list", id="not-a-tensor"),
    ],
)
def test_bad_tensors_are_named(make: Callable[[], list[torch.Tensor]], needle: str) -> None:
    with pytest.raises(LayoutError, match=needle):
        pool(make())


def _strided() -> list[torch.Tensor]:
    wide = torch.zeros(8, 4, 8, dtype=torch.bfloat16)
    return kv()[:2] + [wide[:, ::2], wide[:, 1::2]]


def _transposed() -> list[torch.Tensor]:
    t = torch.zeros(2, 8, 8, dtype=torch.bfloat16).transpose(0, 1)
    return [t] + kv()[:3]


def _every_other_slot() -> list[torch.Tensor]:
    return kv(n=3) + [torch.zeros(16, 2, 8, dtype=torch.bfloat16)[::2]]


@pytest.mark.parametrize(
    ("make", "index"),
    [(_strided, 2), (_transposed, 0), (_every_other_slot, 3)],
    ids=["head-slice", "transposed", "slot-stride"],
)
def test_non_contiguous_tensors_are_refused(make: Callable[[], list[torch.Tensor]], index: int) -> None:
    tensors = make()
    assert not tensors[index].is_contiguous()
    with pytest.raises(
        LayoutError, match=rf"KV tensor {index} has strides \(\d+, \d+, \d+\); it must be contiguous"
    ):
        pool(tensors)


def test_device_mismatch_is_refused() -> None:
    # The meta device stands in for a second device on a machine without a GPU.
    tensors = kv()[:3] + [torch.empty(8, 2, 8, dtype=torch.bfloat16, device="meta")]
    with pytest.raises(LayoutError, match="KV tensor 3 is on meta, expected cpu"):
        pool(tensors)


@pytest.mark.parametrize(
    ("aux", "needle"),
    [
        pytest.param(torch.zeros(4, 8, dtype=torch.float32), "torch.float32", id="dtype"),
        pytest.param(torch.zeros(32, dtype=torch.uint8), r"\(32,\)", id="1d"),
        pytest.param(torch.zeros(4, 8, 2, dtype=torch.uint8), r"\(4, 8, 2\)", id="3d"),
        pytest.param(torch.zeros(8, 4, dtype=torch.uint8).t(), r"strides \(1, 4\)", id="transposed"),
        pytest.param(torch.zeros(4, 16, dtype=torch.uint8)[:, ::2], r"strides \(16, 2\)", id="strided"),
        pytest.param(torch.zeros(4, 0, dtype=torch.uint8), r"\(4, 0\)", id="zero-item-bytes"),
        pytest.param(torch.zeros(0, 8, dtype=torch.uint8), r"\(0, 8\)", id="zero-slots"),
        pytest.param(bytearray(32), "aux is a bytearray", id="not-a-tensor"),
    ],
)
def test_bad_aux_is_named(aux: Any, needle: str) -> None:
    with pytest.raises(LayoutError, match=needle):
        pool(kv(), aux=aux)


@pytest.mark.parametrize(("tp", "rank"), [(2, 2), (2, -1), (0, 0)])
def test_bad_rank_is_named(tp: int, rank: int) -> None:
    with pytest.raises(LayoutError, match=f"tp_rank={rank} is not a rank of tp_size={tp}"):
        pool(kv(), tp=tp, rank=rank)


def test_impossible_head_split_is_refused() -> None:
    layout = KVLayout(num_layers=1, num_heads=6, head_dim=8, dtype=torch.bfloat16, page_size=4)
    with pytest.raises(HeadSplitError, match="H=6"):
        KVPool.allocate(layout, 4, 0, num_pages=1)


def test_layout_errors_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        pool(kv(n=1))


# ---------------------------------------------------------------- allocate, info, regions


def test_allocate_non_mla() -> None:
    p = KVPool.allocate(LAYOUT, 2, 1, num_pages=5, aux_slots=3, aux_item_bytes=12)
    assert len(p.tensors) == 4
    assert all(t.shape == (20, 2, 8) and t.dtype == torch.bfloat16 and t.is_contiguous() for t in p.tensors)
    assert all(int(t.count_nonzero()) == 0 for t in p.tensors)
    assert p.aux is not None and p.aux.shape == (3, 12) and p.aux.dtype == torch.uint8
    assert (p.tp_size, p.tp_rank, p.num_pages, p.page_bytes) == (2, 1, 5, 128)


def test_allocate_replicated_heads() -> None:
    layout = KVLayout(num_layers=2, num_heads=2, head_dim=8, dtype=torch.bfloat16, page_size=4)
    p = KVPool.allocate(layout, 4, 3, num_pages=2)
    assert p.heads_local == 1
    assert [tuple(t.shape) for t in p.tensors] == [(8, 1, 8)] * 4
    assert p.info().num_heads == 2  # the unsharded count travels


def test_allocate_mla() -> None:
    p = KVPool.allocate(MLA, 3, 2, num_pages=4)
    assert p.heads_local == 1
    assert [tuple(t.shape) for t in p.tensors] == [(8, 1, 16)] * 3
    assert p.aux is None
    assert (p.slot_bytes, p.page_bytes) == (32, 64)


def test_allocate_zero_pages_is_refused() -> None:
    with pytest.raises(LayoutError, match="num_slots=0"):
        KVPool.allocate(LAYOUT, 2, 0, num_pages=0)


def test_allocate_aux_without_item_bytes_is_refused() -> None:
    with pytest.raises(LayoutError, match=r"\(3, 0\)"):
        KVPool.allocate(LAYOUT, 2, 0, num_pages=1, aux_slots=3, aux_item_bytes=0)


def test_info_non_mla() -> None:
    p = KVPool.allocate(LAYOUT, 2, 0, num_pages=5, aux_slots=3, aux_item_bytes=12)
    assert p.info() == LayoutInfo(
        num_layers=2,
        num_heads=4,
        head_dim=8,
        dtype="bfloat16",
        page_size=4,
        mla=False,
        num_pages=5,
        aux_item_bytes=12,
        num_aux_slots=3,
    )


def test_info_mla() -> None:
    layout = KVLayout(num_layers=3, num_heads=16, head_dim=16, dtype=torch.float16, page_size=2, mla=True)
    p = KVPool.allocate(layout, 2, 0, num_pages=4)
    assert p.info() == LayoutInfo(
        num_layers=3, num_heads=1, head_dim=16, dtype="float16", page_size=2, mla=True, num_pages=4
    )


def test_regions_are_the_tensors() -> None:
    p = KVPool.allocate(LAYOUT, 2, 0, num_pages=3, aux_slots=2, aux_item_bytes=5)
    regions = p.regions()
    assert [r.addr for r in regions] == [t.data_ptr() for t in p.tensors]
    assert [r.length for r in regions] == [12 * 2 * 8 * 2] * 4
    assert {r.device for r in regions} == {0}
    assert p.aux is not None
    assert p.aux_region() == MemRegion(addr=p.aux.data_ptr(), length=10, device=0)
    assert KVPool.allocate(LAYOUT, 2, 0, num_pages=1).aux_region() is None


def test_regions_of_given_views_use_their_offsets() -> None:
    backing = torch.zeros(4, 8, 2, 8, dtype=torch.bfloat16)
    p = pool(list(backing.unbind(0)))
    assert [r.addr for r in p.regions()] == [backing.data_ptr() + i * 256 for i in range(4)]


def test_check_pages() -> None:
    p = KVPool.allocate(LAYOUT, 2, 0, num_pages=5)
    p.check_pages([0, 4, 2])
    p.check_pages([])
    with pytest.raises(LayoutError, match=r"pages contains page 5, outside \[0, 5\)"):
        p.check_pages([0, 5])
    with pytest.raises(LayoutError, match=r"dst_pages contains page -1"):
        p.check_pages([-1], what="dst_pages")


def test_check_aux_slot() -> None:
    p = KVPool.allocate(LAYOUT, 2, 0, num_pages=1, aux_slots=3, aux_item_bytes=4)
    p.check_aux_slot(None)
    p.check_aux_slot(0)
    p.check_aux_slot(2)
    for slot in (3, -1):
        with pytest.raises(LayoutError, match=rf"aux_slot={slot} outside \[0, 3\)"):
            p.check_aux_slot(slot)
    no_aux = KVPool.allocate(LAYOUT, 2, 0, num_pages=1)
    no_aux.check_aux_slot(None)
    with pytest.raises(LayoutError, match="aux_slot=0 given but this engine's pool has no aux buffer"):
        no_aux.check_aux_slot(0)
