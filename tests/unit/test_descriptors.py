"""Descriptor arithmetic: hand-computed literals and naive-loop references."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer_engine.actors.worker.plan import group_index
from transfer_engine.errors import ConfigError
from transfer_engine.protocol.descriptors import (
    chunk_tokens,
    direct_descriptors,
    page_runs,
    slice_descriptors,
    slots_of,
)
from transfer_engine.protocol.layers import group_tensors

Triple = tuple[list[int], list[int], list[int]]


def _lists(arrays: tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64], npt.NDArray[np.uint64]]) -> Triple:
    for array in arrays:
        assert array.dtype == np.uint64 and array.ndim == 1
    return arrays[0].tolist(), arrays[1].tolist(), arrays[2].tolist()


# ---------------------------------------------------------------- naive references


def naive_page_runs(src: list[int], dst: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return runs


def naive_direct(
    src_bases: list[int], dst_bases: list[int], page_bytes: int, src: list[int], dst: list[int]
) -> Triple:
    out: Triple = ([], [], [])
    for sb, db in zip(src_bases, dst_bases, strict=True):
        for s, d, c in naive_page_runs(src, dst):
            out[0].append(sb + s * page_bytes)
            out[1].append(db + d * page_bytes)
            out[2].append(c * page_bytes)
    return out


def naive_slots(pages: list[int], page_size: int, start: int, count: int) -> list[int]:
    return [pages[t // page_size] * page_size + t % page_size for t in range(start, start + count)]


def naive_slice(
    src_bases: list[int],
    dst_bases: list[int],
    src_slot_bytes: int,
    dst_slot_bytes: int,
    head_bytes: int,
    src_slots: list[int],
    dst_slots: list[int],
    src_head_start: int,
    dst_head_start: int,
    num_heads: int,
) -> Triple:
    out: Triple = ([], [], [])
    for sb, db in zip(src_bases, dst_bases, strict=True):
        for s, d in zip(src_slots, dst_slots, strict=True):
            out[0].append(sb + s * src_slot_bytes + src_head_start * head_bytes)
            out[1].append(db + d * dst_slot_bytes + dst_head_start * head_bytes)
            out[2].append(num_heads * head_bytes)
    return out


# ---------------------------------------------------------------- page_runs


@pytest.mark.parametrize(
    ("src", "dst", "expected"),
    [
        ([3, 4, 5, 9, 10, 2], [7, 8, 9, 1, 2, 3], [[3, 7, 3], [9, 1, 2], [2, 3, 1]]),
        ([0, 1, 2], [5, 6, 8], [[0, 5, 2], [2, 8, 1]]),  # dst breaks the run
        ([0, 2, 3], [5, 6, 7], [[0, 5, 1], [2, 6, 2]]),  # src breaks the run
        ([1, 1], [4, 5], [[1, 4, 1], [1, 5, 1]]),
        ([5, 4], [1, 0], [[5, 1, 1], [4, 0, 1]]),  # decreasing never merges
        ([7], [0], [[7, 0, 1]]),
        ([0, 1, 2, 3], [10, 11, 12, 13], [[0, 10, 4]]),
    ],
)
def test_page_runs_literal(src: list[int], dst: list[int], expected: list[list[int]]) -> None:
    runs = page_runs(np.array(src), np.array(dst))
    assert runs.dtype == np.int64 and runs.shape == (len(expected), 3)
    assert runs.tolist() == expected


def test_page_runs_empty_and_errors() -> None:
    assert page_runs(np.array([], dtype=np.int64), np.array([], dtype=np.int64)).shape == (0, 3)
    with pytest.raises(ConfigError, match="3 pages.*2"):
        page_runs(np.array([1, 2, 3]), np.array([1, 2]))
    with pytest.raises(ConfigError, match="-1"):
        page_runs(np.array([1, -1]), np.array([1, 2]))
    with pytest.raises(ConfigError, match="1-D"):
        page_runs(np.zeros((2, 2), dtype=np.int64), np.zeros((2, 2), dtype=np.int64))


page_lists = st.integers(0, 40).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(0, 12), min_size=n, max_size=n),
        st.lists(st.integers(0, 12), min_size=n, max_size=n),
    )
)


@settings(max_examples=150, deadline=None)
@given(page_lists)
def test_page_runs_matches_naive(pages: tuple[list[int], list[int]]) -> None:
    src, dst = pages
    runs = page_runs(np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64))
    assert runs.tolist() == naive_page_runs(src, dst)
    assert int(runs[:, 2].sum()) == len(src)


# ---------------------------------------------------------------- direct


def test_direct_descriptors_literal() -> None:
    # runs (3, 0, 2) and (9, 5, 1), page_bytes 64, two tensors
    got = direct_descriptors(
        np.array([1000, 2000], dtype=np.uint64),
        np.array([50000, 60000], dtype=np.uint64),
        64,
        np.array([3, 4, 9]),
        np.array([0, 1, 5]),
    )
    assert _lists(got) == (
        [1192, 1576, 2192, 2576],
        [50000, 50320, 60000, 60320],
        [128, 64, 128, 64],
    )


def test_direct_descriptors_high_addresses_stay_exact() -> None:
    base = 0x7F00_0000_0000_0000
    got = direct_descriptors(
        np.array([base], dtype=np.uint64), np.array([base + 1], dtype=np.uint64), 4096, [1], [2]
    )
    assert _lists(got) == ([base + 4096], [base + 1 + 8192], [4096])


def test_direct_descriptors_errors() -> None:
    with pytest.raises(ConfigError, match="2 tensors.*1"):
        direct_descriptors(np.array([1, 2], dtype=np.uint64), np.array([1], dtype=np.uint64), 64, [0], [0])
    with pytest.raises(ConfigError, match="page_bytes=0"):
        direct_descriptors(np.array([1], dtype=np.uint64), np.array([1], dtype=np.uint64), 0, [0], [0])
    with pytest.raises(ConfigError, match="2 pages"):
        direct_descriptors(np.array([1], dtype=np.uint64), np.array([1], dtype=np.uint64), 8, [0, 1], [0])


def test_direct_descriptors_empty() -> None:
    got = direct_descriptors(np.array([1, 2], dtype=np.uint64), np.array([3, 4], dtype=np.uint64), 8, [], [])
    assert _lists(got) == ([], [], [])


@settings(max_examples=100, deadline=None)
@given(
    pages=page_lists,
    bases=st.lists(st.tuples(st.integers(0, 2**40), st.integers(0, 2**40)), min_size=1, max_size=6),
    page_bytes=st.integers(1, 1 << 20),
)
def test_direct_descriptors_match_naive(
    pages: tuple[list[int], list[int]], bases: list[tuple[int, int]], page_bytes: int
) -> None:
    src, dst = pages
    src_bases = [b[0] for b in bases]
    dst_bases = [b[1] for b in bases]
    got = direct_descriptors(
        np.array(src_bases, dtype=np.uint64),
        np.array(dst_bases, dtype=np.uint64),
        page_bytes,
        np.array(src, dtype=np.int64),
        np.array(dst, dtype=np.int64),
    )
    assert _lists(got) == naive_direct(src_bases, dst_bases, page_bytes, src, dst)


# ---------------------------------------------------------------- slots_of


def test_slots_of_literal() -> None:
    pages = np.array([5, 2, 7])
    assert slots_of(pages, 4).tolist() == [20, 21, 22, 23, 8, 9, 10, 11, 28, 29, 30, 31]
    assert slots_of(pages, 4, 3, 3).tolist() == [23, 8, 9]
    assert slots_of(pages, 4, 10).tolist() == [30, 31]
    assert slots_of(pages, 4, 12).tolist() == []
    assert slots_of(pages, 1, 1, 2).tolist() == [2, 7]
    assert slots_of(pages, 4).dtype == np.int64


@pytest.mark.parametrize(
    ("start", "count", "fragment"),
    [(10, 5, r"\[10, 15\)"), (-1, 2, r"\[-1, 1\)"), (0, -1, r"\[0, -1\)"), (13, None, r"\[13, 12\)")],
)
def test_slots_of_out_of_range(start: int, count: int | None, fragment: str) -> None:
    with pytest.raises(
        ConfigError, match=fragment + r" out of range for 3 pages of page_size=4 \(12 slots\)"
    ):
        slots_of(np.array([5, 2, 7]), 4, start, count)


def test_slots_of_bad_page_size() -> None:
    with pytest.raises(ConfigError, match="page_size=0"):
        slots_of(np.array([1]), 0)


@settings(max_examples=100, deadline=None)
@given(
    pages=st.lists(st.integers(0, 1000), max_size=20),
    page_size=st.integers(1, 16),
    data=st.data(),
)
def test_slots_of_matches_naive(pages: list[int], page_size: int, data: st.DataObject) -> None:
    capacity = len(pages) * page_size
    start = data.draw(st.integers(0, capacity))
    count = data.draw(st.integers(0, capacity - start))
    got = slots_of(np.array(pages, dtype=np.int64), page_size, start, count)
    assert got.tolist() == naive_slots(pages, page_size, start, count)


# ---------------------------------------------------------------- slice


def test_slice_descriptors_literal() -> None:
    # prefill: 4 local heads of 8 bytes (32-byte slots); decode: 2 local heads (16-byte slots).
    # heads [2, 4) of prefill go to heads [0, 2) of decode.
    got = slice_descriptors(
        np.array([1000, 5000], dtype=np.uint64),
        np.array([9000, 20000], dtype=np.uint64),
        32,
        16,
        8,
        np.array([3, 10]),
        np.array([0, 7]),
        2,
        0,
        2,
    )
    assert _lists(got) == (
        [1112, 1336, 5112, 5336],
        [9000, 9112, 20000, 20112],
        [16, 16, 16, 16],
    )


def test_slice_descriptors_into_the_middle_of_a_slot() -> None:
    # one head of 256 bytes from prefill local head 0 into decode local head 1 (dst slot 512 bytes)
    got = slice_descriptors([0], [100_000], 256, 512, 256, [5], [2], 0, 1, 1)
    assert _lists(got) == ([1280], [100_000 + 1024 + 256], [256])


def test_slice_descriptors_errors() -> None:
    one = np.array([0], dtype=np.uint64)
    with pytest.raises(ConfigError, match="2 tokens.*1"):
        slice_descriptors(one, one, 32, 16, 8, [0, 1], [0], 0, 0, 1)
    with pytest.raises(ConfigError, match=r"src head slice \[3, 5\)"):
        slice_descriptors(one, one, 32, 16, 8, [0], [0], 3, 0, 2)
    with pytest.raises(ConfigError, match=r"dst head slice \[1, 3\)"):
        slice_descriptors(one, one, 32, 16, 8, [0], [0], 0, 1, 2)
    with pytest.raises(ConfigError, match="num_heads=0"):
        slice_descriptors(one, one, 32, 16, 8, [0], [0], 0, 0, 0)
    with pytest.raises(ConfigError, match="tensors"):
        slice_descriptors(one, np.array([1, 2], dtype=np.uint64), 32, 16, 8, [0], [0], 0, 0, 1)


@settings(max_examples=100, deadline=None)
@given(
    bases=st.lists(st.tuples(st.integers(0, 2**40), st.integers(0, 2**40)), min_size=1, max_size=5),
    head_bytes=st.sampled_from([1, 2, 64, 256]),
    src_heads=st.integers(1, 8),
    dst_heads=st.integers(1, 8),
    data=st.data(),
)
def test_slice_descriptors_match_naive(
    bases: list[tuple[int, int]], head_bytes: int, src_heads: int, dst_heads: int, data: st.DataObject
) -> None:
    num_heads = data.draw(st.integers(1, min(src_heads, dst_heads)))
    src_head_start = data.draw(st.integers(0, src_heads - num_heads))
    dst_head_start = data.draw(st.integers(0, dst_heads - num_heads))
    tokens = data.draw(st.integers(0, 30))
    src_slots = data.draw(st.lists(st.integers(0, 10_000), min_size=tokens, max_size=tokens))
    dst_slots = data.draw(st.lists(st.integers(0, 10_000), min_size=tokens, max_size=tokens))
    args = (
        [b[0] for b in bases],
        [b[1] for b in bases],
        src_heads * head_bytes,
        dst_heads * head_bytes,
        head_bytes,
        src_slots,
        dst_slots,
        src_head_start,
        dst_head_start,
        num_heads,
    )
    got = slice_descriptors(
        np.array(args[0], dtype=np.uint64),
        np.array(args[1], dtype=np.uint64),
        src_heads * head_bytes,
        dst_heads * head_bytes,
        head_bytes,
        np.array(src_slots, dtype=np.int64),
        np.array(dst_slots, dtype=np.int64),
        src_head_start,
        dst_head_start,
        num_heads,
    )
    assert _lists(got) == naive_slice(*args)


# ---------------------------------------------------------------- chunk_tokens


@pytest.mark.parametrize(
    ("start", "num_pages", "page_size", "capacity", "expected"),
    [
        (0, 2, 16, 100, 32),
        (16, 2, 16, 40, 24),  # clipped by the decode side's capacity
        (32, 1, 16, 40, 8),
        (48, 1, 16, 40, 0),  # entirely past the decode capacity
        (40, 1, 16, 40, 0),
        (0, 0, 16, 40, 0),
        (0, 3, 1, 3, 3),
    ],
)
def test_chunk_tokens(start: int, num_pages: int, page_size: int, capacity: int, expected: int) -> None:
    assert chunk_tokens(start, num_pages, page_size, capacity) == expected


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((-1, 1, 16, 40), "chunk_token_start"),
        ((0, -1, 16, 40), "num_pages"),
        ((0, 1, 0, 40), "src_page_size"),
    ],
)
def test_chunk_tokens_rejects_bad_values(args: tuple[int, int, int, int], name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        chunk_tokens(*args)


# ---------------------------------------------------------------- a layer group as rows of its chunk


@settings(max_examples=150, deadline=None)
@given(
    layers=st.integers(1, 6),
    mla=st.booleans(),
    pages=st.lists(st.integers(0, 40), min_size=1, max_size=8, unique=True),
    data=st.data(),
)
def test_a_group_planned_alone_is_its_rows_of_the_chunk(
    layers: int, mla: bool, pages: list[int], data: st.DataObject
) -> None:
    """What the worker relies on to make a layer group's WRITE from its chunk's shared lists: the
    group's own descriptors (its tensors' bases only) are the chunk's at ``group_index(rows)``, for the
    direct and the slice path."""
    tensors = layers if mla else 2 * layers
    src_b = np.arange(tensors, dtype=np.uint64) * np.uint64(1 << 30) + np.uint64(1 << 40)
    dst_b = np.arange(tensors, dtype=np.uint64) * np.uint64(1 << 30) + np.uint64(1 << 44)
    dst_pages = data.draw(st.permutations(range(48)))[: len(pages)]
    start = data.draw(st.integers(0, layers - 1))
    end = data.draw(st.integers(start + 1, layers))
    rows = group_tensors(layers, mla, start, end)
    slots = slots_of(pages, 4)
    dst_slots = slots_of(dst_pages, 4)
    plans = {
        "direct": lambda s, d: direct_descriptors(s, d, 4096, pages, dst_pages),
        "slice": lambda s, d: slice_descriptors(s, d, 512, 256, 64, slots, dst_slots, 2, 1, 3),
    }
    for path, plan in plans.items():
        whole = plan(src_b, dst_b)
        assert len(whole[0]) % tensors == 0, path
        index = group_index(rows, len(whole[0]) // tensors)
        alone = plan(src_b[rows], dst_b[rows])
        for got, want in zip((w[index] for w in whole), alone, strict=True):
            assert got.tolist() == want.tolist(), path
