"""Test inputs for the staging kernels, and expectations built by hand (a loop per token).

Nothing here calls the code under test: expected outputs come from plain per-token indexing of
byte views, so they hold for any dtype (fp8 and NaN patterns included).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from transfer_engine.memory.layout import views_contiguous, views_flash_hnd, views_flash_nhd, views_vllm_cpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]


@dataclass(frozen=True)
class Backend:
    """Where a case runs: KV device, staging memory, and the ``impl`` passed to the entry points."""

    name: str
    device: str
    host_staging: bool
    impl: str

    def stream(self) -> torch.cuda.Stream | None:
        return torch.cuda.Stream() if self.device == "cuda" else None

    def staging(self, nbytes: int, gen: torch.Generator) -> torch.Tensor:
        """A uint8 staging buffer of ``nbytes`` filled with random bytes (so unwritten bytes show)."""
        buf = random_bytes((nbytes,), gen)
        if self.device == "cpu":
            return buf
        if self.host_staging:
            return buf.pin_memory()
        return buf.to(self.device)

    def finish(self, stream: torch.cuda.Stream | None) -> None:
        if stream is not None:
            stream.synchronize()


def random_bytes(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def make_pool(
    dtype: torch.dtype,
    count: int,
    num_slots: int,
    heads: int,
    head_dim: int,
    *,
    style: str,
    device: str,
    gen: torch.Generator,
) -> list[torch.Tensor]:
    """``count`` KV tensors ``[num_slots, heads, head_dim]`` of random bytes.

    ``style``: "separate" (one allocation each), "interleaved" (views ``big[:, t]`` of one
    ``[num_slots, count, heads, head_dim]`` tensor: slot stride ``count*heads*head_dim``), or
    "padded" (views ``big[t, :, :, :head_dim]`` of ``[count, num_slots, heads, head_dim + 3]``:
    head stride ``head_dim + 3``).
    """
    size = itemsize(dtype)
    if style == "separate":
        return [
            random_bytes((num_slots, heads, head_dim * size), gen).to(device).view(dtype)
            for _ in range(count)
        ]
    if style == "interleaved":
        big = random_bytes((num_slots, count, heads, head_dim * size), gen).to(device).view(dtype)
        return [big[:, t] for t in range(count)]
    if style == "padded":
        big = random_bytes((count, num_slots, heads, (head_dim + 3) * size), gen).to(device).view(dtype)
        return [big[t, :, :, :head_dim] for t in range(count)]
    raise ValueError(style)


PAGED_KINDS = ["contiguous", "vllm_cpu", "flash_nhd", "flash_hnd", "padded_blocks"]
"""Paged layouts ``make_paged`` builds: the views ``KVPool.from_views`` takes for each."""


def make_paged(
    kind: str,
    dtype: torch.dtype,
    count: int,
    num_blocks: int,
    block_size: int,
    heads: int,
    head_dim: int,
    *,
    device: str,
    gen: torch.Generator,
) -> list[torch.Tensor]:
    """``count`` KV views ``[num_blocks, block_size, heads, head_dim]`` of random bytes, laid out as ``kind``.

    "contiguous": ours (``[slots, heads, head_dim]`` per tensor, viewed by pages: flat);
    "vllm_cpu": per layer ``[num_blocks, heads, block_size, 2 * head_dim]``, K and V side by side;
    "flash_nhd" / "flash_hnd": per layer ``(2, num_blocks, block_size, heads, head_dim)`` / ``(2,
    num_blocks, heads, block_size, head_dim)``; "padded_blocks": per tensor ``[num_blocks,
    block_size + 1, heads, head_dim]`` with the last token of each block unused (heads contiguous,
    blocks not flat). K/V kinds need an even ``count``.
    """
    size = itemsize(dtype)

    def memory(*shape: int) -> torch.Tensor:
        return random_bytes((*shape[:-1], shape[-1] * size), gen).to(device).view(dtype)

    layers = count // 2
    if kind == "contiguous":
        mem = [memory(num_blocks * block_size, heads, head_dim) for _ in range(count)]
        return (
            views_contiguous(mem[:layers], mem[layers:], block_size)
            if count > 1
            else [mem[0].view(num_blocks, block_size, heads, head_dim)]
        )
    if kind == "padded_blocks":
        return [memory(num_blocks, block_size + 1, heads, head_dim)[:, :block_size] for _ in range(count)]
    assert count % 2 == 0, f"{kind} holds K and V: count={count} must be even"
    if kind == "vllm_cpu":
        return views_vllm_cpu(
            [memory(num_blocks, heads, block_size, 2 * head_dim) for _ in range(layers)], head_dim
        )
    if kind == "flash_nhd":
        return views_flash_nhd([memory(2, num_blocks, block_size, heads, head_dim) for _ in range(layers)])
    if kind == "flash_hnd":
        return views_flash_hnd([memory(2, num_blocks, heads, block_size, head_dim) for _ in range(layers)])
    raise ValueError(kind)


def page_slots(pages: list[int], page_size: int, tokens: int) -> torch.Tensor:
    """Token slots of ``tokens`` tokens laid on ``pages`` (in that order): the last page may be partial."""
    slots = [page * page_size + i for page in pages for i in range(page_size)]
    assert len(slots) >= tokens
    return torch.tensor(slots[:tokens], dtype=torch.int64)


def shuffled_pages(num_pages: int, count: int, gen: torch.Generator) -> list[int]:
    return torch.randperm(num_pages, generator=gen)[:count].tolist()


def byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view(torch.uint8)


def row(t: torch.Tensor, slot: int) -> torch.Tensor:
    """Slot ``slot`` of a ``[slots, H, D]`` tensor, or of a ``[blocks, block_size, H, D]`` view."""
    if t.dim() == 4:
        return t[slot // t.shape[1], slot % t.shape[1]]
    return t[slot]


def expected_gather(kv: list[torch.Tensor], slots: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """``[T, tokens, n, head_dim * itemsize]`` bytes, one token at a time."""
    rows = []
    for t in kv:
        src = byte_view(t)
        rows.append(torch.stack([row(src, s)[start : start + n] for s in slots.tolist()]))
    return torch.stack(rows)


def expected_scatter(
    kv: list[torch.Tensor], region: torch.Tensor, slots: torch.Tensor, blocks: list[tuple[int, int, int]]
) -> list[torch.Tensor]:
    """Byte images of ``kv`` after the scatter, one token at a time (``region``: uint8 bytes)."""
    out = [byte_view(t).clone() for t in kv]
    tokens, width = len(slots), out[0].shape[-1]
    data = region.cpu()
    for offset, start, n in blocks:
        block = data[offset : offset + len(kv) * tokens * n * width].view(len(kv), tokens, n, width)
        for t, dst in enumerate(out):
            for i, s in enumerate(slots.tolist()):
                row(dst, s)[start : start + n] = block[t, i]
    return out
