"""The integrity checksum (kernels/checksum.py): its definition, and every implementation bit-exact.

The definition is :func:`checksum_numpy` (a weighted sum over ``uint64`` arrays); the expectations
here come from it or from Python integers, never from the code under test. The paged checksum is
compared with the definition over ``kvgen.expected_gather`` (built one token at a time), over
dtypes, paged layouts, head slices and layer subsets. Backends as the other kernel tests: the
Triton kernels under the interpreter and the torch reference on CPU, compiled with ``-m gpu``.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from kvgen import PAGED_KINDS, Backend, expected_gather, make_paged, make_pool, page_slots, shuffled_pages

from transfer_engine.kernels import KernelInputError, gather_heads
from transfer_engine.kernels.checksum import (
    MASK64,
    checksum_bytes,
    checksum_heads,
    checksum_numpy,
    checksum_value,
)
from transfer_engine.memory.integrity import PoolChecksums
from transfer_engine.memory.layout import KVLayout, KVPool

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


@pytest.mark.gpu
@pytest.mark.parametrize("entry", ["bytes", "heads"])
def test_a_sum_lands_in_out_on_its_stream_not_the_current_one(entry: str) -> None:
    """``stream=`` covers the whole sum, its copy into ``out`` included: with the caller's current
    stream held by a long kernel (a serving system's forward), ``out`` holds the sum as soon as an
    event recorded on ``stream`` after the call completed, the moment the integrity code reads it.
    (The copy once ran on the current stream: it read the sum before the kernel wrote it and landed
    after the event, so a decode read 0 for bytes that were right.)"""
    gen = torch.Generator().manual_seed(21)
    kv, slots = Heads("flash_nhd").build("cuda", gen)
    data = torch.randint(0, 1 << 30, (4 * 1024,), generator=gen, dtype=torch.int32).cuda()
    if entry == "bytes":
        expected = checksum_numpy(data.cpu().numpy())
    else:
        expected = checksum_numpy(expected_gather(kv, slots, 1, 2).cpu().numpy())
    torch.cuda.synchronize()
    out = torch.zeros(1, dtype=torch.int64, pin_memory=True)
    side = torch.cuda.Stream()
    torch.cuda._sleep(400_000_000)  # about 0.2 s on the current stream, long after the sum is done
    if entry == "bytes":
        checksum_bytes(data, stream=side, out=out)
    else:
        checksum_heads(kv, slots, 1, 2, stream=side, out=out)
    done = torch.cuda.Event()
    done.record(side)
    done.synchronize()
    value = checksum_value(out)
    torch.cuda.synchronize()
    assert value == expected


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


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_the_torch_reference_on_cuda_is_bit_exact(case: Heads) -> None:
    """``impl="torch"`` over device KV (the rows taken by indexing, summed by torch)."""
    gen = torch.Generator().manual_seed(5)
    kv, slots = case.build("cuda", gen)
    expected = checksum_numpy(expected_gather(kv, slots, case.start, case.width).numpy())
    assert checksum_value(checksum_heads(kv, slots, case.start, case.width, impl="torch")) == expected


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_the_gather_sums_what_it_writes(backend: Backend, case: Heads) -> None:
    """``gather_heads(checksum=...)``: the gather (into staging memory, device or pinned host) also
    sums what it wrote, bit-exact with the definition over the bytes it wrote, and with the sum
    :func:`checksum_heads` takes over the pages. 4- and 8-byte copy units sum inside the kernel;
    narrower ones (int8 rows of 8 bytes at odd head offsets) by a second read."""
    gen = torch.Generator().manual_seed(15)
    kv, slots = case.build(backend.device, gen)
    nbytes = case.tensors * case.tokens * case.width * case.head_dim * kv[0].element_size()
    out = backend.staging(nbytes + 64, gen)
    summed = torch.zeros(1, dtype=torch.int64, pin_memory=backend.device == "cuda")
    stream = backend.stream()
    gather_heads(kv, slots, case.start, case.width, out, stream=stream, impl=backend.impl, checksum=summed)  # type: ignore[arg-type]
    backend.finish(stream)
    written = out[:nbytes].cpu().numpy()
    assert checksum_value(summed) == checksum_numpy(written)
    assert checksum_value(summed) == checksum_numpy(
        expected_gather(kv, slots, case.start, case.width).numpy()
    )


def test_a_gather_of_narrow_units_sums_by_a_second_read(backend: Backend) -> None:
    """int8 heads of 6 bytes: the gather copies 2-byte units, and the sum of its 12-byte rows is
    taken by a second read of what it wrote (still bit-exact)."""
    gen = torch.Generator().manual_seed(16)
    kv = [
        torch.randint(-128, 128, (5, 4, 3, 6), generator=gen, dtype=torch.int8).to(backend.device)
        for _ in range(4)
    ]
    slots = torch.tensor([7, 2, 19, 3, 11])
    out = backend.staging(4 * 5 * 2 * 6, gen)
    summed = torch.zeros(1, dtype=torch.int64, pin_memory=backend.device == "cuda")
    stream = backend.stream()
    gather_heads(kv, slots, 1, 2, out, stream=stream, impl=backend.impl, checksum=summed)  # type: ignore[arg-type]
    backend.finish(stream)
    assert checksum_value(summed) == checksum_numpy(out.cpu().numpy())


def test_a_gather_without_whole_words_refuses_a_checksum() -> None:
    kv = [torch.zeros(4, 2, 3, dtype=torch.int8)]
    out = torch.zeros(6, dtype=torch.int8).view(1, 1, 2, 3)
    with pytest.raises(KernelInputError, match="6 bytes are not whole 4-byte words"):
        gather_heads(kv, torch.tensor([1]), 0, 2, out, checksum=torch.zeros(1, dtype=torch.int64))


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


# --- the pool's sums, started without waiting for them (memory/integrity.py) -------------------------

POOL_DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def pool_checksums(device: str, seed: int) -> tuple[PoolChecksums, np.ndarray]:
    """A small random pool's checksums, and 13 shuffled token slots of it."""
    layout = KVLayout(num_layers=3, num_heads=4, head_dim=16, dtype=torch.bfloat16, page_size=4)
    pool = KVPool.allocate(layout, 1, 0, 8, device=device)
    gen = torch.Generator().manual_seed(seed)
    for tensor in pool.kv_views:
        tensor.view(torch.int16).copy_(torch.randint(-(1 << 15), 1 << 15, tensor.shape, generator=gen))
    slots = np.array(random.Random(seed).sample(range(32), 13), dtype=np.int64)
    return PoolChecksums(pool), slots


def written(pool: KVPool, value: int) -> None:
    for tensor in pool.kv_views:
        tensor.view(torch.int16).fill_(value)


@pytest.mark.parametrize("device", POOL_DEVICES)
@pytest.mark.parametrize("layers", [None, (1, 3)], ids=["all", "group"])
def test_a_started_sum_is_the_one_taken_at_once(device: str, layers: tuple[int, int] | None) -> None:
    checksums, slots = pool_checksums(device, 5)
    assert checksums.warmed == (2 * 3 if device == "cuda" else 0)  # compiled at start: widths 1, 2, 4
    try:
        started = checksums.enqueue(slots, 1, 2, layers)
        assert started.value() == checksums.chunk(slots, 1, 2, layers) != 0
        assert started.done.query() if isinstance(started.done, torch.cuda.Event) else started.done.is_set()
    finally:
        checksums.close()


@pytest.mark.parametrize("device", POOL_DEVICES)
def test_a_started_sum_waits_for_the_bytes_to_be_written(device: str) -> None:
    """``after``: the sum reads the bytes only once they are written (a CUDA event the checksum stream
    waits for, behind a long kernel on another stream; a threading.Event the checksum thread waits
    for, set by the thread that writes them)."""
    checksums, slots = pool_checksums(device, 6)
    pool = checksums.pool
    try:
        if device == "cuda":
            writer = torch.cuda.Stream(pool.device)
            with torch.cuda.stream(writer):
                torch.cuda._sleep(200_000_000)  # about 0.1 s: long after the sum is enqueued
                written(pool, 7)
            done = torch.cuda.Event()
            done.record(writer)
            started = checksums.enqueue(slots, 0, 4, None, after=[done])
        else:
            ready = threading.Event()
            started = checksums.enqueue(slots, 0, 4, None, after=[ready])
            time.sleep(0.05)
            assert not started.done.is_set()  # waiting for the bytes
            written(pool, 7)
            ready.set()
        value = started.value()
        assert value == checksums.chunk(slots, 0, 4, None)
        assert value == checksum_numpy(torch.full((2 * 3 * 13 * 4 * 16,), 7, dtype=torch.int16).numpy())
    finally:
        checksums.close()


@pytest.mark.gpu
def test_a_cuda_sum_cannot_wait_for_a_threading_event_not_set() -> None:
    checksums, slots = pool_checksums("cuda", 7)
    try:
        with pytest.raises(ValueError, match="threading.Event"):
            checksums.enqueue(slots, 0, 4, None, after=[threading.Event()])
    finally:
        checksums.close()


@pytest.mark.parametrize("device", POOL_DEVICES)
def test_a_submitted_sum_is_answered_on_the_loop(device: str) -> None:
    """``submit`` (the decode's check): the callback runs on the loop's thread with the value, and
    nothing is counted pending after it; a sum that cannot be taken answers None and why."""
    checksums, slots = pool_checksums(device, 8)
    answers: list[tuple[int | None, str, int]] = []

    async def main() -> None:
        done = asyncio.Event()

        def then(value: int | None, why: str) -> None:
            answers.append((value, why, threading.get_ident()))
            if len(answers) == 2:
                done.set()

        checksums.submit(slots, 0, 4, (0, 1), then)
        checksums.submit(np.array([99], dtype=np.int64), 0, 4, None, then)  # slot 99: outside the pool
        assert checksums.pending == 2
        await asyncio.wait_for(done.wait(), 30)

    try:
        asyncio.run(main())
    finally:
        checksums.close()
    assert checksums.pending == 0
    (value, why, thread), (bad, bad_why, _) = answers
    assert value == checksums.chunk(slots, 0, 4, (0, 1)) and why == "" and thread == threading.get_ident()
    assert bad is None and "99" in bad_why


def test_closed_checksums_end_a_sum_still_waiting_for_its_bytes() -> None:
    """The engine ended with a sum waiting for KV that was never written (its room was cancelled):
    the checksum thread stops waiting, the sum fails, and no new one starts."""
    checksums, slots = pool_checksums("cpu", 9)
    started = checksums.enqueue(slots, 0, 4, None, after=[threading.Event()])
    checksums.close()
    assert started.done.wait(5)
    with pytest.raises(RuntimeError, match="closed"):
        started.value()
    with pytest.raises(RuntimeError, match="closed"):
        checksums.enqueue(slots, 0, 4, None)
