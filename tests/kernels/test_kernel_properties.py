"""Property tests: the interpreted Triton kernels against hand-built expectations on random layouts."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("hypothesis")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st
from kvgen import (
    DTYPES,
    PAGED_KINDS,
    byte_view,
    expected_gather,
    expected_scatter,
    itemsize,
    make_paged,
    make_pool,
    page_slots,
    random_bytes,
)

from transfer_engine.kernels import LaunchConfig, gather_heads, scatter_heads


@dataclass(frozen=True)
class Layout:
    dtype: torch.dtype
    tensors: int
    heads: int
    head_dim: int
    start: int
    width: int
    page_size: int
    pages: int
    tokens: int
    style: str
    seed: int
    block_bytes: int

    def build(self) -> tuple[list[torch.Tensor], torch.Tensor, torch.Generator]:
        """KV tensors over ``pages + 3`` pages, and the slots of ``tokens`` tokens on shuffled pages.
        Paged styles (``kvgen.PAGED_KINDS``) hold K and V: their tensor count is rounded up to even."""
        gen = torch.Generator().manual_seed(self.seed)
        num_pages = self.pages + 3
        if self.style in PAGED_KINDS:
            kv = make_paged(
                self.style, self.dtype, self.tensors + self.tensors % 2, num_pages, self.page_size,
                self.heads, self.head_dim, device="cpu", gen=gen,
            )  # fmt: skip
            pages = torch.randperm(num_pages, generator=gen)[: self.pages].tolist()
            return kv, page_slots(pages, self.page_size, self.tokens), gen
        kv = make_pool(
            self.dtype,
            self.tensors,
            num_pages * self.page_size,
            self.heads,
            self.head_dim,
            style=self.style,
            device="cpu",
            gen=gen,
        )
        pages = torch.randperm(num_pages, generator=gen)[: self.pages].tolist()
        return kv, page_slots(pages, self.page_size, self.tokens), gen


@st.composite
def layouts(draw: st.DrawFn) -> Layout:
    heads = draw(st.integers(1, 4))
    start = draw(st.integers(0, heads - 1))
    page_size = draw(st.integers(1, 8))
    pages = draw(st.integers(1, 6))
    return Layout(
        dtype=draw(st.sampled_from(DTYPES)),
        tensors=draw(st.integers(1, 4)),
        heads=heads,
        head_dim=draw(st.sampled_from([1, 2, 3, 8, 24])),
        start=start,
        width=draw(st.integers(1, heads - start)),
        page_size=page_size,
        pages=pages,
        tokens=draw(st.integers(1, pages * page_size)),
        style=draw(st.sampled_from(["separate", "interleaved", "padded", *PAGED_KINDS])),
        seed=draw(st.integers(0, 2**31)),
        block_bytes=draw(st.sampled_from([16, 256, 16384])),
    )


@settings(max_examples=40, deadline=None)
@given(layouts())
def test_gather_matches_hand_expectation(p: Layout) -> None:
    kv, slots, gen = p.build()
    nbytes = len(kv) * len(slots) * p.width * p.head_dim * itemsize(p.dtype)
    out = random_bytes((nbytes,), gen)
    gather_heads(
        kv, slots, p.start, p.width, out, impl="triton", config=LaunchConfig(block_bytes=p.block_bytes)
    )
    assert torch.equal(out, expected_gather(kv, slots, p.start, p.width).reshape(-1))


@settings(max_examples=40, deadline=None)
@given(layouts())
def test_scatter_matches_hand_expectation(p: Layout) -> None:
    """Two writers: heads [start, start + width) first in the region, then heads [0, start)."""
    kv, slots, gen = p.build()
    head_bytes = len(kv) * len(slots) * p.head_dim * itemsize(p.dtype)
    blocks = [(0, p.start, p.width)]
    if p.start > 0:
        blocks.append((p.width * head_bytes, 0, p.start))
    region = random_bytes((head_bytes * (p.width + p.start),), gen)
    want = expected_scatter(kv, region, slots, blocks)
    scatter_heads(region, kv, slots, blocks, impl="triton", config=LaunchConfig(block_bytes=p.block_bytes))
    for t, expected in zip(kv, want, strict=True):
        assert torch.equal(byte_view(t), expected)
