"""The integrity checksum (kernels/checksum.py): its definition, and every implementation bit-exact.

The definition is :func:`checksum_numpy` (a weighted sum over ``uint64`` arrays); the expectations
here come from it or from Python integers, never from the code under test. The paged checksum is
compared with the definition over ``kvgen.expected_gather`` (built one token at a time), over
dtypes, paged layouts, head slices and layer subsets. Backends as the other kernel tests: the
Triton kernels under the interpreter and the torch reference on CPU, compiled with ``-m gpu``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from kvgen import PAGED_KINDS, Backend, expected_gather, make_paged, make_pool, page_slots, shuffled_pages

from transfer_engine.kernels import KernelInputError
from transfer_engine.kernels.checksum import (
    MASK64,
    checksum_bytes,
    checksum_heads,
    checksum_numpy,
    checksum_value,
)

pytestmark = pytest.mark.timeout(120)


def words(*values: int) -> bytes:
    return np.array(values, dtype="<u4").tobytes()


@pytest.mark.parametrize(
    ("data", "start", "expected"),
    [
        (b"", 0, 0),
        (words(1), 0, 1),
        (words(1, 2), 0, 1 * 1 + 2 * 2),
        (words(2, 1), 0, 1 * 2 + 2 * 1),  # order matters
        (words(1, 2), 10, 11 * 1 + 12 * 2),
        (words(0xFFFFFFFF), 0, 0xFFFFFFFF),
        (b"\x01\x00\x00\x00\x00\x00\x00\x01", 0, 1 + 2 * (1 << 24)),  # little-endian words
        (words(0xFFFFFFFF) * 3, (1 << 62), ((1 << 62) * 3 + 6) * 0xFFFFFFFF & MASK64),  # wraps mod 2**64
    ],
)
def test_definition(data: bytes, start: int, expected: int) -> None:
    assert checksum_numpy(data, start) == expected


def test_definition_refuses_a_partial_word() -> None:
    with pytest.raises(KernelInputError, match="7 bytes"):
        checksum_numpy(b"\x00" * 7)


def python_sum(data: bytes, start: int = 0) -> int:
    """The definition with Python integers: no fixed-width arithmetic anywhere."""
    ws = np.frombuffer(data, dtype="<u4").tolist()
    return sum((start + i + 1) * w for i, w in enumerate(ws)) % (1 << 64)


def test_numpy_definition_matches_python_integers() -> None:
    rng = random.Random(3)
    for n in (1, 5, 4096, 10_001):
        data = rng.randbytes(4 * n)
        start = rng.randrange(1 << 40)
        assert checksum_numpy(data, start) == python_sum(data, start)


@pytest.mark.parametrize("nbytes", [0, 4, 4 * 4095, 4 * 4096, 4 * 4097 + 8, 1 << 16])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32])
def test_bytes_bit_exact(backend: Backend, nbytes: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(nbytes)
    buf = backend.staging(nbytes, gen)
    stream = backend.stream()
    start = 12345 if nbytes % 8 else 0
    result = checksum_bytes(buf.view(dtype), start=start, stream=stream, impl=backend.impl)  # type: ignore[arg-type]
    backend.finish(stream)
    assert checksum_value(result) == checksum_numpy(buf.cpu().numpy(), start)


def test_bytes_worst_case_overflow(backend: Backend) -> None:
    """Every word 0xFFFFFFFF at word offsets from 2**40: every product and the sum overflow 64 bits."""
    n, start = 1 << 14, 1 << 40
    buf = torch.full((4 * n,), 0xFF, dtype=torch.uint8, device=backend.device)
    expected = 0xFFFFFFFF * (n * start + n * (n + 1) // 2) % (1 << 64)
    stream = backend.stream()
    result = checksum_bytes(buf, start=start, stream=stream, impl=backend.impl)  # type: ignore[arg-type]
    backend.finish(stream)
    assert checksum_value(result) == expected


def test_regions_add_at_their_offsets(backend: Backend) -> None:
    gen = torch.Generator().manual_seed(7)
    a, b = backend.staging(4 * 1000, gen), backend.staging(4 * 333, gen)
    whole = torch.cat([a.cpu(), b.cpu()])
    first = checksum_value(checksum_bytes(a, impl=backend.impl))  # type: ignore[arg-type]
    second = checksum_value(checksum_bytes(b, start=1000, impl=backend.impl))  # type: ignore[arg-type]
    assert (first + second) & MASK64 == checksum_numpy(whole.numpy())


def test_out_receives_the_sum(backend: Backend) -> None:
    gen = torch.Generator().manual_seed(9)
    buf = backend.staging(4 * 777, gen)
    out = torch.zeros(1, dtype=torch.int64)
    if backend.device == "cuda":
        out = out.pin_memory()
    stream = backend.stream()
    got = checksum_bytes(buf, stream=stream, impl=backend.impl, out=out)  # type: ignore[arg-type]
    backend.finish(stream)
    assert got is out
    assert checksum_value(out) == checksum_numpy(buf.cpu().numpy())


def test_every_single_bit_flip_and_word_swap_changes_the_sum() -> None:
    rng = random.Random(11)
    data = bytearray(rng.randbytes(4 * 2048))
    clean = checksum_numpy(bytes(data))
    for _ in range(300):
        byte, bit = rng.randrange(len(data)), rng.randrange(8)
        data[byte] ^= 1 << bit
        assert checksum_numpy(bytes(data)) != clean, (byte, bit)
        data[byte] ^= 1 << bit
    for _ in range(100):
        i, j = rng.sample(range(2048), 2)
        if data[4 * i : 4 * i + 4] == data[4 * j : 4 * j + 4]:
            continue
        swapped = bytearray(data)
        swapped[4 * i : 4 * i + 4], swapped[4 * j : 4 * j + 4] = (
            data[4 * j : 4 * j + 4],
            data[4 * i : 4 * i + 4],
        )
        assert checksum_numpy(bytes(swapped)) != clean, (i, j)


@dataclass(frozen=True)
class Heads:
    """A KV layout and the (tensors, head slice, tokens) whose gather layout is checksummed."""

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
        if self.kind in ("separate", "interleaved"):
            kv = make_pool(
                self.dtype, self.tensors, self.blocks * self.block_size, self.heads, self.head_dim,
                style=self.kind, device=device, gen=gen,
            )  # fmt: skip
            perm = torch.randperm(self.blocks * self.block_size, generator=gen)[: self.tokens]
            return kv, perm.to(torch.int64)
        kv = make_paged(
            self.kind, self.dtype, self.tensors, self.blocks, self.block_size, self.heads, self.head_dim,
            device=device, gen=gen,
        )  # fmt: skip
        pages = shuffled_pages(self.blocks, -(-self.tokens // self.block_size), gen)
        return kv, page_slots(pages, self.block_size, self.tokens)


CASES = {
    **{kind: Heads(kind) for kind in PAGED_KINDS},
    "separate": Heads("separate"),
    "interleaved-fp32-all-heads": Heads("interleaved", dtype=torch.float32, start=0, width=4),
    "fp8-block32": Heads("vllm_cpu", dtype=torch.float8_e4m3fn, block_size=32, blocks=3, tokens=70),
    "int8-one-head": Heads("flash_hnd", dtype=torch.int8, heads=8, head_dim=8, start=5, width=1),
    "fp16-wide-rows": Heads("contiguous", dtype=torch.float16, heads=2, head_dim=576, start=0, width=2),
    "one-token": Heads("flash_nhd", tokens=1),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_heads_bit_exact(backend: Backend, case: Heads) -> None:
    gen = torch.Generator().manual_seed(5)
    kv, slots = case.build(backend.device, gen)
    expected = checksum_numpy(expected_gather(kv, slots, case.start, case.width).numpy())
    stream = backend.stream()
    got = checksum_heads(kv, slots, case.start, case.width, stream=stream, impl=backend.impl)  # type: ignore[arg-type]
    backend.finish(stream)
    assert checksum_value(got) == expected


def test_heads_of_a_layer_group_is_its_tensors(backend: Backend) -> None:
    """A layer group's checksum is that of its own tensors' gather layout (``[K_a..K_b, V_a..V_b]``)."""
    gen = torch.Generator().manual_seed(6)
    kv, slots = Heads("flash_nhd", tensors=8).build(backend.device, gen)
    group = [kv[1], kv[2], kv[5], kv[6]]
    got = checksum_value(checksum_heads(group, slots, 0, 4, impl=backend.impl))  # type: ignore[arg-type]
    assert got == checksum_numpy(expected_gather(group, slots, 0, 4).numpy())


def test_heads_zero_tokens_is_zero(backend: Backend) -> None:
    gen = torch.Generator().manual_seed(8)
    kv, _ = Heads("contiguous").build(backend.device, gen)
    empty = torch.zeros(0, dtype=torch.int64)
    assert checksum_value(checksum_heads(kv, empty, 0, 4, impl=backend.impl)) == 0  # type: ignore[arg-type]


def test_a_landed_flip_is_seen_over_the_pages() -> None:
    gen = torch.Generator().manual_seed(4)
    kv, slots = Heads("vllm_cpu").build("cpu", gen)
    before = checksum_value(checksum_heads(kv, slots, 1, 2))
    victim = kv[3]
    slot = int(slots[7])
    victim.view(torch.uint8)[slot // 4, slot % 4, 2, 5] ^= 0x10
    assert checksum_value(checksum_heads(kv, slots, 1, 2)) != before


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: checksum_bytes(torch.zeros(6, dtype=torch.uint8)), "6 bytes"),
        (lambda: checksum_bytes(torch.zeros(8, 2, dtype=torch.int32).t()), "contiguous"),
        (lambda: checksum_bytes(torch.zeros(8, dtype=torch.uint8), start=-1), "start=-1"),
        (
            lambda: checksum_bytes(torch.zeros(8, dtype=torch.uint8), out=torch.zeros(1, dtype=torch.int32)),
            "out is torch.int32",
        ),
        (
            lambda: checksum_heads(
                make_pool(
                    torch.bfloat16,
                    2,
                    8,
                    4,
                    16,
                    style="padded",
                    device="cpu",
                    gen=torch.Generator().manual_seed(0),
                ),
                torch.arange(3),
                0,
                2,
                impl="triton",
            ),
            "not whole 4-byte words",
        ),  # fmt: skip
        (
            lambda: checksum_heads([torch.zeros(8, 4, 16, dtype=torch.bfloat16)], torch.tensor([8]), 0, 2),
            "slot 8",
        ),
        (
            lambda: checksum_heads([torch.zeros(8, 4, 16, dtype=torch.bfloat16)], torch.arange(2), 3, 2),
            "heads",
        ),
    ],
)
def test_bad_input_is_named(make: object, message: str) -> None:
    with pytest.raises(KernelInputError, match=message):
        make()  # type: ignore[operator]
