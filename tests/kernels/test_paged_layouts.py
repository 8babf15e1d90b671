"""Gather and scatter over paged KV views (vLLM CPU, FlashAttention NHD/HND...), bit-exact.

Each serving system's layout is built as ``KVPool.from_views`` takes it (``kvgen.make_paged``):
views ``[num_blocks, block_size, heads, head_dim]`` whose slot ``s`` is token ``s % block_size`` of
block ``s // block_size``. Expectations are built one token at a time on byte views (``kvgen``);
backends as in ``test_gather_scatter.py`` (the interpreted Triton kernel, the torch reference, and
with ``-m gpu`` the compiled kernel on device and pinned-host staging).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch
from kvgen import (
    PAGED_KINDS,
    Backend,
    byte_view,
    expected_gather,
    expected_scatter,
    itemsize,
    make_paged,
    page_slots,
    shuffled_pages,
)

from transfer_engine.kernels import KernelInputError, as_kv_table, gather_heads, scatter_heads


@dataclass(frozen=True)
class Paged:
    """One paged layout and the head slice moved."""

    kind: str
    dtype: torch.dtype = torch.bfloat16
    tensors: int = 4
    heads: int = 4
    head_dim: int = 16
    start: int = 1
    width: int = 2
    block_size: int = 4
    blocks: int = 8
    tokens: int = 13

    def build(self, device: str, gen: torch.Generator) -> tuple[list[torch.Tensor], torch.Tensor]:
        kv = make_paged(
            self.kind, self.dtype, self.tensors, self.blocks, self.block_size, self.heads, self.head_dim,
            device=device, gen=gen,
        )  # fmt: skip
        pages = shuffled_pages(self.blocks, -(-self.tokens // self.block_size), gen)
        return kv, page_slots(pages, self.block_size, self.tokens)


CASES = {
    **{kind: Paged(kind) for kind in PAGED_KINDS},
    "vllm_cpu-block32-fp8": Paged("vllm_cpu", dtype=torch.float8_e4m3fn, block_size=32, blocks=3, tokens=70),
    "flash_hnd-one-head-per-writer": Paged("flash_hnd", heads=8, head_dim=8, start=5, width=1),
    "flash_nhd-all-heads-fp32": Paged("flash_nhd", dtype=torch.float32, start=0, width=4),
    "vllm_cpu-odd-head-dim-int8": Paged("vllm_cpu", dtype=torch.int8, head_dim=3, start=0, width=3),
    "padded_blocks-mla-576": Paged("padded_blocks", tensors=3, heads=1, head_dim=576, start=0, width=1),
    "flash_hnd-one-block": Paged("flash_hnd", blocks=1, tokens=3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_paged_gather(backend: Backend, name: str) -> None:
    case = CASES[name]
    gen = torch.Generator().manual_seed(11)
    kv, slots = case.build(backend.device, gen)
    nbytes = case.tensors * case.tokens * case.width * case.head_dim * itemsize(case.dtype)
    staging = backend.staging(nbytes + 32, gen)
    before = staging.cpu().clone()
    stream = backend.stream()
    gather_heads(kv, slots, case.start, case.width, staging, stream=stream, impl=backend.impl)  # type: ignore[arg-type]
    backend.finish(stream)
    got = staging.cpu()
    assert torch.equal(got[:nbytes], expected_gather(kv, slots, case.start, case.width).reshape(-1))
    assert torch.equal(got[nbytes:], before[nbytes:]), "gather wrote past its output"


def _memory_of(kv: list[torch.Tensor]) -> list[torch.Tensor]:
    """The distinct allocations the views live in, as bytes."""
    bases = {id(t._base): t._base for t in kv if t._base is not None}
    return [byte_view(b).clone() for b in bases.values()]


@pytest.mark.parametrize("name", list(CASES))
def test_paged_scatter(backend: Backend, name: str) -> None:
    """Two writers (the slice, then the heads before it) into the views; bytes outside them untouched."""
    case = CASES[name]
    gen = torch.Generator().manual_seed(12)
    kv, slots = case.build(backend.device, gen)
    head_bytes = case.tensors * case.tokens * case.head_dim * itemsize(case.dtype)
    blocks = [(16, case.start, case.width)]
    if case.start:
        blocks.append((16 + case.width * head_bytes, 0, case.start))
    region = backend.staging(16 + (case.width + case.start) * head_bytes, gen)
    want = expected_scatter(kv, region, slots, blocks)
    memory_before = _memory_of(kv)
    stream = backend.stream()
    scatter_heads(region, kv, slots, blocks, stream=stream, impl=backend.impl)  # type: ignore[arg-type]
    backend.finish(stream)
    for t in range(case.tensors):
        assert torch.equal(byte_view(kv[t]), want[t]), f"tensor {t}"
    if case.kind == "padded_blocks":  # the unused last token of every block stays as it was
        for before, t in zip(memory_before, kv, strict=True):
            assert t._base is not None
            assert torch.equal(byte_view(t._base)[:, case.block_size], before[:, case.block_size])


@pytest.mark.parametrize(
    ("src_kind", "dst_kind"),
    [("vllm_cpu", "contiguous"), ("flash_nhd", "flash_hnd"), ("contiguous", "vllm_cpu")],
)
def test_two_writers_round_trip_across_layouts(backend: Backend, src_kind: str, dst_kind: str) -> None:
    """H=4, prefill TP 2 (pages of 4) -> decode TP 1 (pages of 8): each prefill rank gathers its 2
    heads from its layout into its block of one region, one scatter fills the decode's layout."""
    gen = torch.Generator().manual_seed(5)
    layers, head_dim, tokens = 2, 16, 19
    prefill = [
        make_paged(src_kind, torch.bfloat16, 2 * layers, 8, 4, 2, head_dim, device=backend.device, gen=gen)
        for _ in range(2)
    ]
    decode = make_paged(
        dst_kind, torch.bfloat16, 2 * layers, 4, 8, 4, head_dim, device=backend.device, gen=gen
    )
    src_slots = page_slots(shuffled_pages(8, 5, gen), 4, tokens)
    dst_slots = page_slots(shuffled_pages(4, 3, gen), 8, tokens)
    block_bytes = 2 * layers * tokens * 2 * head_dim * 2
    region = backend.staging(2 * block_bytes, gen)
    stream = backend.stream()
    for rank in range(2):
        window = region[rank * block_bytes : (rank + 1) * block_bytes]
        gather_heads(prefill[rank], src_slots, 0, 2, window, stream=stream, impl=backend.impl)  # type: ignore[arg-type]
    blocks = [(rank * block_bytes, 2 * rank, 2) for rank in range(2)]
    scatter_heads(region, decode, dst_slots, blocks, stream=stream, impl=backend.impl)  # type: ignore[arg-type]
    backend.finish(stream)
    for t in range(2 * layers):
        for i in range(tokens):
            s, d = int(src_slots[i]), int(dst_slots[i])
            got = byte_view(decode[t])[d // 8, d % 8]
            want = torch.cat([byte_view(prefill[r][t])[s // 4, s % 4] for r in range(2)])
            assert torch.equal(got, want), f"tensor {t} token {i}"


def test_flat_and_paged_tables() -> None:
    """Our layout viewed by pages is flat (the contiguous kernel path); the serving layouts are not."""
    gen = torch.Generator()
    flat = {
        kind: as_kv_table(make_paged(kind, torch.bfloat16, 4, 4, 8, 2, 16, device="cpu", gen=gen)).flat
        for kind in PAGED_KINDS
    }
    assert flat == {
        "contiguous": True,
        "vllm_cpu": False,
        "flash_nhd": True,
        "flash_hnd": False,
        "padded_blocks": False,
    }
    one_block = as_kv_table(make_paged("flash_hnd", torch.bfloat16, 2, 1, 8, 2, 16, device="cpu", gen=gen))
    assert one_block.flat  # one block: slot s is token s, whatever the block stride
    assert one_block.num_slots == 8 and one_block.block_size == 8


BAD_VIEWS = {
    "five-dims": (lambda kv: [t.unsqueeze(0) for t in kv], "expected [num_slots, heads_local, head_dim]"),
    "mixed-3d-and-4d": (
        lambda kv: [kv[0].flatten(0, 1).contiguous(), *kv[1:]],
        "kv[1] has shape (4, 4, 2, 16)",
    ),
    "head-dim-strided": (lambda kv: [t.transpose(1, 3) for t in kv], "in its last dim"),
}


@pytest.mark.parametrize("name", list(BAD_VIEWS))
def test_bad_paged_views_raise_before_launch(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    change, message = BAD_VIEWS[name]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kv = make_paged("vllm_cpu", torch.bfloat16, 2, 4, 4, 2, 16, device="cpu", gen=torch.Generator())
    out = torch.full((2 * 3 * 2 * 16 * 2,), 7, dtype=torch.uint8)
    with pytest.raises(KernelInputError, match=re.escape(message)):
        gather_heads(change(kv), torch.tensor([0, 5, 15]), 0, 2, out)
    assert torch.equal(out, torch.full_like(out, 7))


def test_paged_slot_past_the_pool_is_named() -> None:
    kv = make_paged("flash_hnd", torch.bfloat16, 2, 4, 4, 2, 16, device="cpu", gen=torch.Generator())
    with pytest.raises(KernelInputError, match=r"slot 16 at position 1 is outside the KV pool \[0, 16\)"):
        scatter_heads(torch.zeros(4096, dtype=torch.uint8), kv, torch.tensor([3, 16]), [(0, 0, 2)])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["vllm_cpu", "flash_nhd", "flash_hnd"])
def test_realistic_paged_sizes_match_torch(kind: str) -> None:
    """4059 tokens on shuffled blocks of 16 (1024 blocks, 16 tensors, 4 heads x 128): the compiled
    kernels against the torch implementation on the GPU, gather of heads 2-3 and a two-writer scatter."""
    gen = torch.Generator().manual_seed(21)
    tokens, width = 4059, 2
    kv = make_paged(kind, torch.bfloat16, 16, 1024, 16, 4, 128, device="cuda", gen=gen)
    slots = page_slots(shuffled_pages(1024, 254, gen), 16, tokens)
    nbytes = 16 * tokens * width * 128 * 2
    outs = []
    for impl in ("torch", "triton"):
        out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        gather_heads(kv, slots, 2, width, out, stream=torch.cuda.Stream(), impl=impl)  # type: ignore[arg-type]
        outs.append(out)
    torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[1])
    region = torch.cat([outs[0], outs[0].flip(0)])
    results = []
    for impl in ("torch", "triton"):
        dst = make_paged(kind, torch.bfloat16, 16, 1024, 16, 4, 128, device="cuda", gen=torch.Generator())
        scatter_heads(region, dst, slots, [(0, 2, 2), (nbytes, 0, 2)], stream=torch.cuda.Stream(), impl=impl)  # type: ignore[arg-type]
        results.append(dst)
    torch.cuda.synchronize()
    for a, b in zip(*results, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
