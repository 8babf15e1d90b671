"""Integrity decisions (protocol/integrity.py): the verdict table, parts that add, and the byte runs
of a staged writer's block a landed chunk or layer group covers. Pure; the runs are checked against
the checksum's definition over real byte strings."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from transfer_engine.errors import ConfigError
from transfer_engine.kernels.checksum import checksum_numpy
from transfer_engine.memory.integrity import PoolChecksums
from transfer_engine.memory.layout import KVLayout, KVPool
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.integrity import (
    MASK64,
    Run,
    Verdict,
    combine,
    mismatch_detail,
    staged_runs,
    verdict,
)
from transfer_engine.protocol.layers import group_tensor_runs

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize(
    ("carried", "landed", "expected"),
    [
        (5, 5, Verdict.MATCH),
        (5, 6, Verdict.MISMATCH),
        (None, 6, Verdict.UNCHECKED),
        (5, None, Verdict.UNCHECKED),
        (None, None, Verdict.UNCHECKED),
        (MASK64, -1, Verdict.MATCH),  # the same 64 bits, signed or not
        (0, 1 << 64, Verdict.MATCH),
    ],
)
def test_verdict(carried: int | None, landed: int | None, expected: Verdict) -> None:
    assert verdict(carried, landed) is expected


def test_parts_add_to_the_whole() -> None:
    rng = random.Random(2)
    data = rng.randbytes(4 * 1000)
    cuts = [0, 4 * 17, 4 * 500, 4 * 1000]
    parts = [checksum_numpy(data[a:b], a // 4) for a, b in zip(cuts, cuts[1:], strict=False)]
    assert combine(parts) == checksum_numpy(data)


@pytest.mark.parametrize(
    ("offset", "tensor_bytes", "tensors", "runs", "expected"),
    [
        (0, 64, 4, None, [Run(0, 256, 0)]),
        (256, 64, 4, None, [Run(256, 256, 0)]),
        (256, 64, 4, [(1, 1), (3, 1)], [Run(320, 64, 0), Run(448, 64, 16)]),
        (0, 8, 6, [(0, 3)], [Run(0, 24, 0)]),
    ],
)
def test_staged_runs(
    offset: int, tensor_bytes: int, tensors: int, runs: list[tuple[int, int]] | None, expected: list[Run]
) -> None:
    assert staged_runs(offset, tensor_bytes, tensors, runs) == expected


@pytest.mark.parametrize("layers", [(0, 1), (1, 3), (0, 4), (3, 4)])
@pytest.mark.parametrize("mla", [False, True])
def test_a_group_s_runs_sum_to_its_gather_layout(layers: tuple[int, int], mla: bool) -> None:
    """A staged block ``[T, tokens, n, D]``; a layer group's gather layout is its tensors in order."""
    num_layers, tensor_bytes = 4, 48
    tensors = num_layers if mla else 2 * num_layers
    rng = np.random.default_rng(1)
    block = rng.integers(0, 256, tensors * tensor_bytes, dtype=np.uint8)
    offset = 16
    region = np.concatenate([rng.integers(0, 256, offset, dtype=np.uint8), block])
    group = group_tensor_runs(num_layers, mla, *layers)
    mine = [t for first, count in group for t in range(first, first + count)]
    expected = checksum_numpy(
        np.concatenate([block[t * tensor_bytes : (t + 1) * tensor_bytes] for t in mine])
    )
    parts = [
        checksum_numpy(region[r.offset : r.offset + r.length], r.start)
        for r in staged_runs(offset, tensor_bytes, tensors, group)
    ]
    assert combine(parts) == expected


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 6, 4, None), "not whole 4-byte words"),
        ((2, 8, 4, None), "not whole 4-byte words"),
        ((0, 8, 4, [(3, 2)]), r"\(3, 2\) is outside the block's 4 tensors"),
        ((0, 8, 4, [(0, 0)]), r"\(0, 0\)"),
    ],
)
def test_staged_runs_refuse(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        staged_runs(*args)


def test_mismatch_detail_names_what_and_whom() -> None:
    assert mismatch_detail(3, 1, None, 1, 2) == (
        "integrity: chunk 3 from prefill rank 1 landed with checksum 0x0000000000000002, "
        "the writer's was 0x0000000000000001"
    )
    assert "layers [2, 4) of chunk 0" in mismatch_detail(0, 0, (2, 4), 1, 2)


@pytest.mark.parametrize("checksum", [None, 0, 1, MASK64])
def test_a_chunk_notification_carries_any_64_bit_checksum(checksum: int | None) -> None:
    landed = m.ChunkLanded(
        room=1, chunk_id=2, last=True, sender=0, page_start=0, num_pages=3, region=-1, checksum=checksum
    )
    decoded = m.decode_notification(m.encode(landed))
    assert decoded == landed and isinstance(decoded, m.ChunkLanded) and decoded.checksum == checksum


def test_a_pool_whose_rows_are_not_whole_words_is_refused_at_start() -> None:
    """Integrity sums 4-byte words: a KV of 6-byte rows (int8, head_dim 6) names the switch to turn off."""
    layout = KVLayout(num_layers=2, num_heads=2, head_dim=6, dtype=torch.int8, page_size=4, mla=False)
    with pytest.raises(
        ConfigError, match=r"\d+-byte aligned \(head_dim=6, torch.int8\); set integrity=False"
    ):
        PoolChecksums(KVPool.allocate(layout, 1, 0, 4))
    words = KVLayout(num_layers=2, num_heads=2, head_dim=8, dtype=torch.int8, page_size=4, mla=False)
    PoolChecksums(KVPool.allocate(words, 1, 0, 4))  # 8-byte rows: fine
