"""GPU-only behaviour: no host synchronisation, host-staging rules, and realistic sizes against torch."""

from __future__ import annotations

import warnings

import pytest
import torch
from kvgen import make_pool, page_slots, random_bytes

from transfer_engine.kernels import KernelInputError, gather_heads, scatter_heads

pytestmark = pytest.mark.gpu


def _pool(
    heads: int, head_dim: int = 128, tensors: int = 8, slots: int = 4096, seed: int = 0
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return make_pool(
        torch.bfloat16, tensors, slots, heads, head_dim, style="separate", device="cuda", gen=gen
    )


def _slots(tokens: int, page_size: int, num_pages: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return page_slots(torch.randperm(num_pages, generator=gen).tolist(), page_size, tokens)


@pytest.mark.parametrize("host", [False, True], ids=["device", "host"])
def test_gather_and_scatter_never_synchronize(host: bool) -> None:
    """With sync debug mode "error", any synchronising CUDA call inside the wrappers raises."""
    kv = _pool(4)
    slots = _slots(1000, 16, 256, 1)
    shape = (8, 1000, 2, 128)
    if host:
        staging = torch.empty(shape, dtype=torch.bfloat16, pin_memory=True)
    else:
        staging = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    gather_heads(kv, slots, 0, 2, staging, stream=stream)  # compile outside the checked region
    scatter_heads(staging, kv, slots, [(0, 2, 2)], stream=stream)
    stream.synchronize()
    before = [t.clone() for t in kv]
    try:
        with warnings.catch_warnings():  # "a prototype feature" notice
            warnings.simplefilter("ignore", UserWarning)
            torch.cuda.set_sync_debug_mode("error")
        gather_heads(kv, slots, 1, 2, staging, stream=stream)
        scatter_heads(staging, kv, slots, [(0, 2, 2)], stream=stream)
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            torch.cuda.set_sync_debug_mode("default")
    stream.synchronize()
    index = slots.cuda()
    want = torch.stack([t[index, 1:3] for t in before]).view(torch.int16)
    assert torch.equal(staging.cuda().view(torch.int16), want)
    for t, w in zip(kv, want, strict=True):
        assert torch.equal(t[index, 2:4].view(torch.int16), w)


def test_pageable_host_staging_rejected() -> None:
    with pytest.raises(KernelInputError, match="pinned"):
        gather_heads(_pool(2), torch.arange(4), 0, 2, torch.empty(8, 4, 2, 128, dtype=torch.bfloat16))


def test_device_slots_rejected() -> None:
    with pytest.raises(KernelInputError, match="host memory"):
        gather_heads(
            _pool(2),
            torch.arange(4, device="cuda"),
            0,
            2,
            torch.empty(8, 4, 2, 128, dtype=torch.bfloat16, device="cuda"),
        )


def test_stream_on_other_device_type_rejected() -> None:
    with pytest.raises(KernelInputError, match="stream"):
        gather_heads(
            _pool(2),
            torch.arange(4),
            0,
            2,
            torch.empty(8, 4, 2, 128, dtype=torch.bfloat16, device="cuda"),
            stream=object(),
        )  # type: ignore[arg-type]


@pytest.mark.parametrize("host", [False, True], ids=["device", "host"])
@pytest.mark.parametrize("layout", ["qwen-slice", "eight-writers", "mla"])
def test_realistic_sizes_match_torch(layout: str, host: bool) -> None:
    """4096 tokens on shuffled pages (prefill page 64, decode page 16), compiled kernel vs torch on the GPU."""
    heads, width, dim, tensors = {
        "qwen-slice": (4, 2, 128, 16),
        "eight-writers": (8, 1, 128, 16),
        "mla": (1, 1, 576, 6),
    }[layout]
    kv = _pool(heads, dim, tensors, slots=16384, seed=2)
    tokens = 4096 - 37
    gather_slots = _slots(tokens, 64, 256, 3)
    scatter_slots = _slots(tokens, 16, 1024, 4)
    nbytes = tensors * tokens * width * dim * 2
    gen = torch.Generator().manual_seed(5)
    outs = []
    for impl in ("torch", "triton"):
        out = random_bytes((nbytes,), gen)
        out = out.pin_memory() if host else out.cuda()
        gather_heads(kv, gather_slots, heads - width, width, out, stream=torch.cuda.Stream(), impl=impl)  # type: ignore[arg-type]
        outs.append(out)
    torch.cuda.synchronize()
    assert torch.equal(outs[0].cpu(), outs[1].cpu())

    writers = heads // width
    region = random_bytes((nbytes * writers,), gen)
    region = region.pin_memory() if host else region.cuda()
    blocks = [(w * nbytes, (w * 3 % writers) * width, width) for w in range(writers)]
    results = []
    for impl in ("torch", "triton"):
        dst = _pool(heads, dim, tensors, slots=16384, seed=6)
        scatter_heads(region, dst, scatter_slots, blocks, stream=torch.cuda.Stream(), impl=impl)  # type: ignore[arg-type]
        results.append(dst)
    torch.cuda.synchronize()
    for a, b in zip(*results, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
