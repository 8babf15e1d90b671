"""Bit-exact gather and scatter against hand-built expectations.

CPU backends: "interp" runs the Triton kernels under Triton's interpreter (``TRITON_INTERPRET=1``
set for the test only), "torch" the pure-torch reference. ``-m gpu`` backends compile the kernels
and run them on a non-default stream, with the staging buffer in device memory ("cuda") or in
pinned host memory ("cuda-host").
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from kvgen import (
    DTYPES,
    Backend,
    byte_view,
    expected_gather,
    expected_scatter,
    itemsize,
    make_pool,
    page_slots,
    shuffled_pages,
)

from transfer_engine.kernels import (
    LaunchConfig,
    as_kv_table,
    gather_heads,
    prepare_slots,
    scatter_heads,
)


@dataclass(frozen=True)
class Case:
    """One layout: KV tensors, page list and head slice."""

    dtype: torch.dtype = torch.bfloat16
    tensors: int = 4
    heads: int = 4
    head_dim: int = 16
    start: int = 1
    width: int = 2
    page_size: int = 4
    pages: int = 16
    tokens: int = 10
    style: str = "separate"
    block_bytes: int | None = None

    @property
    def num_slots(self) -> int:
        return self.pages * self.page_size


GATHER_CASES = {
    "single-token": Case(tokens=1),
    "page1-all-heads": Case(page_size=1, start=0, width=4, tokens=7),
    "page16-partial-last": Case(page_size=16, pages=4, tokens=37),
    "last-head": Case(start=3, width=1),
    "interleaved-layers": Case(style="interleaved", tensors=6),
    "padded-head-stride": Case(style="padded", start=1, width=3),
    "odd-head-dim-int8": Case(dtype=torch.int8, head_dim=3, start=0, width=3),
    "odd-head-dim-fp16": Case(dtype=torch.float16, head_dim=5, start=2, width=2),
    "many-programs": Case(tokens=29, block_bytes=64),
    "mla-576": Case(tensors=3, heads=1, head_dim=576, start=0, width=1, tokens=9),
    "mla-fp8-strided": Case(
        dtype=torch.float8_e4m3fn, tensors=3, heads=1, head_dim=576, start=0, width=1, style="interleaved"
    ),
}


def _run_gather(backend: Backend, case: Case, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    kv = make_pool(
        case.dtype,
        case.tensors,
        case.num_slots,
        case.heads,
        case.head_dim,
        style=case.style,
        device=backend.device,
        gen=gen,
    )
    pages = shuffled_pages(case.pages, -(-case.tokens // case.page_size), gen)
    slots = page_slots(pages, case.page_size, case.tokens)
    row = case.width * case.head_dim * itemsize(case.dtype)
    nbytes = case.tensors * case.tokens * row
    staging = backend.staging(nbytes + 64, gen)
    before = staging.cpu().clone()
    stream = backend.stream()
    config = LaunchConfig(block_bytes=case.block_bytes) if case.block_bytes else None
    gather_heads(kv, slots, case.start, case.width, staging, stream=stream, impl=backend.impl, config=config)  # type: ignore[arg-type]
    backend.finish(stream)
    got = staging.cpu()
    want = expected_gather(kv, slots, case.start, case.width).reshape(-1)
    assert want.numel() == nbytes
    assert torch.equal(got[:nbytes], want)
    assert torch.equal(got[nbytes:], before[nbytes:]), "gather wrote past its output"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather_every_dtype(backend: Backend, dtype: torch.dtype) -> None:
    _run_gather(backend, Case(dtype=dtype))


@pytest.mark.parametrize("name", list(GATHER_CASES))
def test_gather_layouts(backend: Backend, name: str) -> None:
    _run_gather(backend, GATHER_CASES[name])


def test_gather_typed_out_and_reused_tables(backend: Backend) -> None:
    """A typed ``[T, tokens, n, head_dim]`` out, a KVTable and a SlotIndex reused for two head slices."""
    gen = torch.Generator().manual_seed(7)
    case = Case(tokens=12)
    kv = make_pool(
        case.dtype,
        case.tensors,
        case.num_slots,
        case.heads,
        case.head_dim,
        style="separate",
        device=backend.device,
        gen=gen,
    )
    slots = page_slots(shuffled_pages(case.pages, 3, gen), case.page_size, case.tokens)
    layout = as_kv_table(kv)
    stream = backend.stream()
    index = prepare_slots(slots, layout.num_slots, layout.device, stream=stream)
    for start in (0, 2):
        shape = (case.tensors, case.tokens, 2, case.head_dim)
        out = (
            backend.staging(case.tensors * case.tokens * 2 * case.head_dim * 2, gen)
            .view(torch.bfloat16)
            .view(shape)
        )
        gather_heads(layout, index, start, 2, out, stream=stream, impl=backend.impl)  # type: ignore[arg-type]
        backend.finish(stream)
        assert torch.equal(byte_view(out), expected_gather(kv, slots, start, 2))


SCATTER_CASES = {
    "two-writers": Case(heads=4),
    "single-token": Case(tokens=1),
    "page16-partial-last": Case(page_size=16, pages=4, tokens=37),
    "eight-writers-of-one-head": Case(heads=8, head_dim=8),
    "interleaved-layers": Case(style="interleaved", tensors=6),
    "padded-head-stride": Case(style="padded"),
    "odd-head-dim-int8": Case(dtype=torch.int8, head_dim=3),
    "many-programs": Case(tokens=29, block_bytes=64),
    "mla-576": Case(tensors=3, heads=1, head_dim=576, tokens=9),
}


def _writer_blocks(case: Case, gen: torch.Generator) -> tuple[list[tuple[int, int, int]], int]:
    """Writers covering the decode heads: widths 1 and 2 alternating, placed in the region in shuffled order."""
    widths, start = [], 0
    while start < case.heads:
        width = min(case.heads - start, 1 + len(widths) % 2)
        widths.append((start, width))
        start += width
    order = torch.randperm(len(widths), generator=gen).tolist()
    head_bytes = case.tensors * case.tokens * case.head_dim * itemsize(case.dtype)
    offset, blocks = 32, []
    for i in order:
        start, width = widths[i]
        blocks.append((offset, start, width))
        offset += width * head_bytes + 16
    return blocks, offset


def _run_scatter(backend: Backend, case: Case, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    kv = make_pool(
        case.dtype,
        case.tensors,
        case.num_slots,
        case.heads,
        case.head_dim,
        style=case.style,
        device=backend.device,
        gen=gen,
    )
    base = kv[0]._base if case.style != "separate" else None
    base_before = base.cpu().clone() if base is not None else None
    pages = shuffled_pages(case.pages, -(-case.tokens // case.page_size), gen)
    slots = page_slots(pages, case.page_size, case.tokens)
    blocks, nbytes = _writer_blocks(case, gen)
    region = backend.staging(nbytes + 3, gen)  # a region need not end on a copy unit
    want = expected_scatter(kv, region, slots, blocks)
    untouched = [byte_view(t).clone() for t in kv]
    stream = backend.stream()
    config = LaunchConfig(block_bytes=case.block_bytes) if case.block_bytes else None
    scatter_heads(region, kv, slots, blocks, stream=stream, impl=backend.impl, config=config)  # type: ignore[arg-type]
    backend.finish(stream)
    for t in range(case.tensors):
        assert torch.equal(byte_view(kv[t]), want[t]), f"tensor {t}"
    assert not all(torch.equal(byte_view(kv[t]), untouched[t]) for t in range(case.tensors))
    if base is not None and base_before is not None and case.style == "padded":
        pad = case.head_dim * itemsize(case.dtype)
        assert torch.equal(base.cpu().view(torch.uint8)[..., pad:], base_before.view(torch.uint8)[..., pad:])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scatter_every_dtype(backend: Backend, dtype: torch.dtype) -> None:
    _run_scatter(backend, Case(dtype=dtype))


@pytest.mark.parametrize("name", list(SCATTER_CASES))
def test_scatter_layouts(backend: Backend, name: str) -> None:
    _run_scatter(backend, SCATTER_CASES[name])


def test_prefill4_to_decode2_round_trip(backend: Backend) -> None:
    """H=8, P=4, D=2: decode rank d's writers are p=2d, 2d+1 with dst starts 0 and 2.

    Prefill and decode use different page sizes (4 and 16); each writer gathers its 2 heads into
    its own place of one region, and one scatter rebuilds decode rank d's 4 heads.
    """
    gen = torch.Generator().manual_seed(3)
    heads, head_dim, layers, tokens = 8, 16, 2, 21
    full = make_pool(torch.bfloat16, 2 * layers, 64, heads, head_dim, style="separate", device="cpu", gen=gen)
    prefill_slots = page_slots(shuffled_pages(16, 6, gen), 4, tokens)
    decode_slots = page_slots(shuffled_pages(4, 2, gen), 16, tokens)
    prefill = {p: [t[:, 2 * p : 2 * p + 2].contiguous().to(backend.device) for t in full] for p in range(4)}
    block_bytes = 2 * layers * tokens * 2 * head_dim * 2
    stream = backend.stream()
    for d in range(2):
        decode = make_pool(
            torch.bfloat16, 2 * layers, 64, 4, head_dim, style="separate", device=backend.device, gen=gen
        )
        region = backend.staging(2 * block_bytes, gen)
        blocks = []
        for w, (p, dst_start) in enumerate([(2 * d, 0), (2 * d + 1, 2)]):
            window = region[w * block_bytes : (w + 1) * block_bytes]
            gather_heads(prefill[p], prefill_slots, 0, 2, window, stream=stream, impl=backend.impl)  # type: ignore[arg-type]
            blocks.append((w * block_bytes, dst_start, 2))
        scatter_heads(region, decode, decode_slots, blocks, stream=stream, impl=backend.impl)  # type: ignore[arg-type]
        backend.finish(stream)
        for t in range(2 * layers):
            want = byte_view(full[t])[prefill_slots][:, 4 * d : 4 * d + 4]
            assert torch.equal(byte_view(decode[t])[decode_slots], want)


def test_empty_chunk_launches_nothing(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    from transfer_engine.kernels import gather as gather_mod
    from transfer_engine.kernels import scatter as scatter_mod

    def launched(*args: object, **kwargs: object) -> None:
        raise AssertionError("a kernel was launched for an empty chunk")

    for module in (gather_mod, scatter_mod):
        monkeypatch.setattr(module, "triton_int", launched)
    monkeypatch.setattr(gather_mod, "gather_heads_reference", launched)
    monkeypatch.setattr(scatter_mod, "scatter_heads_reference", launched)
    monkeypatch.setattr(gather_mod, "_gather_kernel", None)
    monkeypatch.setattr(scatter_mod, "_scatter_kernel", None)
    gen = torch.Generator().manual_seed(0)
    kv = make_pool(torch.bfloat16, 4, 16, 4, 16, style="separate", device=backend.device, gen=gen)
    empty = torch.empty(0, dtype=torch.int64)
    staging = backend.staging(64, gen)
    before = staging.cpu().clone()
    gather_heads(kv, empty, 0, 2, staging, impl=backend.impl)  # type: ignore[arg-type]
    scatter_heads(staging, kv, empty, [(0, 0, 2)], impl=backend.impl)  # type: ignore[arg-type]
    assert torch.equal(staging.cpu(), before)
