"""Host-memory WRITEs cut into pieces for NIXL's posting threads (transport.posting.spread)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer_engine.transport.posting import HOST_PIECE_MIN, host_pieces, spread

U64 = np.uint64


def _covered(src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> list[tuple[int, int, int]]:
    """Byte-exact coverage: every (src offset, dst offset) pair, as runs merged when adjacent."""
    runs: list[tuple[int, int, int]] = []
    for s, d, n in zip(src.tolist(), dst.tolist(), length.tolist(), strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + n)
        else:
            runs.append((s, d, n))
    return runs


@pytest.mark.parametrize(
    ("params", "pieces"),
    [
        ({"num_threads": "4", "split_batch_size": "16"}, 64),
        ({"num_threads": "0", "split_batch_size": "16"}, 0),
        ({"num_threads": "4"}, 0),  # NIXL's own batch is larger than any WRITE of ours: no cut helps
        ({}, 0),
        ({"num_threads": "four", "split_batch_size": "16"}, 0),
    ],
)
def test_host_pieces(params: dict[str, str], pieces: int) -> None:
    assert host_pieces(params) == pieces


def test_one_large_descriptor_is_cut_into_equal_pieces() -> None:
    src, dst, length, dev = spread(
        np.array([1 << 40], dtype=U64), np.array([1 << 41], dtype=U64), np.array([64 << 20], dtype=U64), 0, 16
    )
    assert len(length) == 16
    assert set(length.tolist()) == {4 << 20}
    assert sorted((src - (1 << 40)).tolist()) == [i * (4 << 20) for i in range(16)]
    assert (dst - (1 << 41)).tolist() == (src - (1 << 40)).tolist()
    assert dev == 0


def test_small_writes_are_left_whole() -> None:
    src = np.array([0, 1 << 30], dtype=U64)
    length = np.array([HOST_PIECE_MIN, HOST_PIECE_MIN // 2], dtype=U64)
    out = spread(src, src + U64(7), length, np.array([3, 4], dtype=U64), 64)
    assert out[2] is length  # nothing cut: the same arrays back


def test_devices_follow_their_descriptor() -> None:
    length = np.array([4 * HOST_PIECE_MIN, 2 * HOST_PIECE_MIN], dtype=U64)
    src = np.array([0, 1 << 30], dtype=U64)
    _, _, cut, dev = spread(src, src, length, np.array([5, 6], dtype=U64), 6)
    assert cut.tolist() == [HOST_PIECE_MIN] * 6
    assert isinstance(dev, np.ndarray) and sorted(dev.tolist()) == [5, 5, 5, 5, 6, 6]


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 3 << 20), min_size=1, max_size=8),
    pieces=st.integers(0, 80),
    min_piece=st.sampled_from([1, 4096, HOST_PIECE_MIN]),
)
def test_spread_moves_exactly_the_same_bytes(lengths: list[int], pieces: int, min_piece: int) -> None:
    length = np.array(lengths, dtype=U64)
    src = (np.arange(len(lengths), dtype=U64) * U64(8 << 20)) + U64(1 << 32)  # gapped, as KV tensors are
    dst = src[::-1].copy()
    s, d, n, _ = spread(src, dst, length, 0, pieces, min_piece)
    assert int(n.sum()) == int(length.sum())
    by_src = np.argsort(s, kind="stable")
    assert _covered(s[by_src], d[by_src], n[by_src]) == _covered(src, dst, length)
    if len(n) != len(length):  # no two neighbours in the list touch in memory (NIXL would merge them)
        touching = (s[:-1] + n[:-1] == s[1:]) & (d[:-1] + n[:-1] == d[1:]) & (n[:-1] > 0)
        assert not touching.any()
    if len(n) != len(length):  # cut: no piece above the common size
        assert int(n.max()) <= max(min_piece, -(-int(length.sum()) // pieces))
