"""Head assignment: literal hand-derived vectors, properties, and invalid splits.

Every expected vector below was derived by hand from the head-assignment rules in transfer_engine/protocol/heads.py and is written out
literally; none is computed by the code under test. Rows are ``(prefill_rank, src, dst, n)``.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer_engine.errors import ConfigError, HeadSplitError
from transfer_engine.protocol.heads import (
    HeadSlice,
    head_assignment,
    heads_per_rank,
    owned_heads,
    targets_of,
    validate_split,
    writers_of,
)

Row = tuple[int, int, int, int]

# H = 8. need/own: tp=1 [0,8); tp=2 [0,4),[4,8); tp=4 [2k,2k+2); tp=8 [k,k+1);
# tp=16 replicated twice: rank r holds head r//2; writer of head g for decode d is 2g + d%2.
H8: dict[tuple[int, int], dict[int, list[Row]]] = {
    (1, 1): {0: [(0, 0, 0, 8)]},
    (1, 2): {0: [(0, 0, 0, 4)], 1: [(0, 4, 0, 4)]},
    (1, 4): {0: [(0, 0, 0, 2)], 1: [(0, 2, 0, 2)], 2: [(0, 4, 0, 2)], 3: [(0, 6, 0, 2)]},
    (1, 8): {
        0: [(0, 0, 0, 1)],
        1: [(0, 1, 0, 1)],
        2: [(0, 2, 0, 1)],
        3: [(0, 3, 0, 1)],
        4: [(0, 4, 0, 1)],
        5: [(0, 5, 0, 1)],
        6: [(0, 6, 0, 1)],
        7: [(0, 7, 0, 1)],
    },
    (1, 16): {
        0: [(0, 0, 0, 1)],
        1: [(0, 0, 0, 1)],
        2: [(0, 1, 0, 1)],
        3: [(0, 1, 0, 1)],
        4: [(0, 2, 0, 1)],
        5: [(0, 2, 0, 1)],
        6: [(0, 3, 0, 1)],
        7: [(0, 3, 0, 1)],
        8: [(0, 4, 0, 1)],
        9: [(0, 4, 0, 1)],
        10: [(0, 5, 0, 1)],
        11: [(0, 5, 0, 1)],
        12: [(0, 6, 0, 1)],
        13: [(0, 6, 0, 1)],
        14: [(0, 7, 0, 1)],
        15: [(0, 7, 0, 1)],
    },
    (2, 1): {0: [(0, 0, 0, 4), (1, 0, 4, 4)]},
    (2, 2): {0: [(0, 0, 0, 4)], 1: [(1, 0, 0, 4)]},
    (2, 4): {0: [(0, 0, 0, 2)], 1: [(0, 2, 0, 2)], 2: [(1, 0, 0, 2)], 3: [(1, 2, 0, 2)]},
    (2, 8): {
        0: [(0, 0, 0, 1)],
        1: [(0, 1, 0, 1)],
        2: [(0, 2, 0, 1)],
        3: [(0, 3, 0, 1)],
        4: [(1, 0, 0, 1)],
        5: [(1, 1, 0, 1)],
        6: [(1, 2, 0, 1)],
        7: [(1, 3, 0, 1)],
    },
    (2, 16): {
        0: [(0, 0, 0, 1)],
        1: [(0, 0, 0, 1)],
        2: [(0, 1, 0, 1)],
        3: [(0, 1, 0, 1)],
        4: [(0, 2, 0, 1)],
        5: [(0, 2, 0, 1)],
        6: [(0, 3, 0, 1)],
        7: [(0, 3, 0, 1)],
        8: [(1, 0, 0, 1)],
        9: [(1, 0, 0, 1)],
        10: [(1, 1, 0, 1)],
        11: [(1, 1, 0, 1)],
        12: [(1, 2, 0, 1)],
        13: [(1, 2, 0, 1)],
        14: [(1, 3, 0, 1)],
        15: [(1, 3, 0, 1)],
    },
    (4, 1): {0: [(0, 0, 0, 2), (1, 0, 2, 2), (2, 0, 4, 2), (3, 0, 6, 2)]},
    (4, 2): {0: [(0, 0, 0, 2), (1, 0, 2, 2)], 1: [(2, 0, 0, 2), (3, 0, 2, 2)]},
    (4, 4): {0: [(0, 0, 0, 2)], 1: [(1, 0, 0, 2)], 2: [(2, 0, 0, 2)], 3: [(3, 0, 0, 2)]},
    (4, 8): {
        0: [(0, 0, 0, 1)],
        1: [(0, 1, 0, 1)],
        2: [(1, 0, 0, 1)],
        3: [(1, 1, 0, 1)],
        4: [(2, 0, 0, 1)],
        5: [(2, 1, 0, 1)],
        6: [(3, 0, 0, 1)],
        7: [(3, 1, 0, 1)],
    },
    (4, 16): {
        0: [(0, 0, 0, 1)],
        1: [(0, 0, 0, 1)],
        2: [(0, 1, 0, 1)],
        3: [(0, 1, 0, 1)],
        4: [(1, 0, 0, 1)],
        5: [(1, 0, 0, 1)],
        6: [(1, 1, 0, 1)],
        7: [(1, 1, 0, 1)],
        8: [(2, 0, 0, 1)],
        9: [(2, 0, 0, 1)],
        10: [(2, 1, 0, 1)],
        11: [(2, 1, 0, 1)],
        12: [(3, 0, 0, 1)],
        13: [(3, 0, 0, 1)],
        14: [(3, 1, 0, 1)],
        15: [(3, 1, 0, 1)],
    },
    (8, 1): {
        0: [
            (0, 0, 0, 1),
            (1, 0, 1, 1),
            (2, 0, 2, 1),
            (3, 0, 3, 1),
            (4, 0, 4, 1),
            (5, 0, 5, 1),
            (6, 0, 6, 1),
            (7, 0, 7, 1),
        ]
    },
    (8, 2): {
        0: [(0, 0, 0, 1), (1, 0, 1, 1), (2, 0, 2, 1), (3, 0, 3, 1)],
        1: [(4, 0, 0, 1), (5, 0, 1, 1), (6, 0, 2, 1), (7, 0, 3, 1)],
    },
    (8, 4): {
        0: [(0, 0, 0, 1), (1, 0, 1, 1)],
        1: [(2, 0, 0, 1), (3, 0, 1, 1)],
        2: [(4, 0, 0, 1), (5, 0, 1, 1)],
        3: [(6, 0, 0, 1), (7, 0, 1, 1)],
    },
    (8, 8): {
        0: [(0, 0, 0, 1)],
        1: [(1, 0, 0, 1)],
        2: [(2, 0, 0, 1)],
        3: [(3, 0, 0, 1)],
        4: [(4, 0, 0, 1)],
        5: [(5, 0, 0, 1)],
        6: [(6, 0, 0, 1)],
        7: [(7, 0, 0, 1)],
    },
    (8, 16): {
        0: [(0, 0, 0, 1)],
        1: [(0, 0, 0, 1)],
        2: [(1, 0, 0, 1)],
        3: [(1, 0, 0, 1)],
        4: [(2, 0, 0, 1)],
        5: [(2, 0, 0, 1)],
        6: [(3, 0, 0, 1)],
        7: [(3, 0, 0, 1)],
        8: [(4, 0, 0, 1)],
        9: [(4, 0, 0, 1)],
        10: [(5, 0, 0, 1)],
        11: [(5, 0, 0, 1)],
        12: [(6, 0, 0, 1)],
        13: [(6, 0, 0, 1)],
        14: [(7, 0, 0, 1)],
        15: [(7, 0, 0, 1)],
    },
    (16, 1): {
        0: [
            (0, 0, 0, 1),
            (2, 0, 1, 1),
            (4, 0, 2, 1),
            (6, 0, 3, 1),
            (8, 0, 4, 1),
            (10, 0, 5, 1),
            (12, 0, 6, 1),
            (14, 0, 7, 1),
        ]
    },
    (16, 2): {
        0: [(0, 0, 0, 1), (2, 0, 1, 1), (4, 0, 2, 1), (6, 0, 3, 1)],
        1: [(9, 0, 0, 1), (11, 0, 1, 1), (13, 0, 2, 1), (15, 0, 3, 1)],
    },
    (16, 4): {
        0: [(0, 0, 0, 1), (2, 0, 1, 1)],
        1: [(5, 0, 0, 1), (7, 0, 1, 1)],
        2: [(8, 0, 0, 1), (10, 0, 1, 1)],
        3: [(13, 0, 0, 1), (15, 0, 1, 1)],
    },
    (16, 8): {
        0: [(0, 0, 0, 1)],
        1: [(3, 0, 0, 1)],
        2: [(4, 0, 0, 1)],
        3: [(7, 0, 0, 1)],
        4: [(8, 0, 0, 1)],
        5: [(11, 0, 0, 1)],
        6: [(12, 0, 0, 1)],
        7: [(15, 0, 0, 1)],
    },
    (16, 16): {
        0: [(0, 0, 0, 1)],
        1: [(1, 0, 0, 1)],
        2: [(2, 0, 0, 1)],
        3: [(3, 0, 0, 1)],
        4: [(4, 0, 0, 1)],
        5: [(5, 0, 0, 1)],
        6: [(6, 0, 0, 1)],
        7: [(7, 0, 0, 1)],
        8: [(8, 0, 0, 1)],
        9: [(9, 0, 0, 1)],
        10: [(10, 0, 0, 1)],
        11: [(11, 0, 0, 1)],
        12: [(12, 0, 0, 1)],
        13: [(13, 0, 0, 1)],
        14: [(14, 0, 0, 1)],
        15: [(15, 0, 0, 1)],
    },
}

# H = 2. tp=1 [0,2); tp=2 [k,k+1); tp=4 replicated twice (rank r holds head r//2);
# tp=8 replicated four times (rank r holds head r//4).
H2: dict[tuple[int, int], dict[int, list[Row]]] = {
    (1, 1): {0: [(0, 0, 0, 2)]},
    (1, 2): {0: [(0, 0, 0, 1)], 1: [(0, 1, 0, 1)]},
    (1, 4): {0: [(0, 0, 0, 1)], 1: [(0, 0, 0, 1)], 2: [(0, 1, 0, 1)], 3: [(0, 1, 0, 1)]},
    (1, 8): {
        0: [(0, 0, 0, 1)],
        1: [(0, 0, 0, 1)],
        2: [(0, 0, 0, 1)],
        3: [(0, 0, 0, 1)],
        4: [(0, 1, 0, 1)],
        5: [(0, 1, 0, 1)],
        6: [(0, 1, 0, 1)],
        7: [(0, 1, 0, 1)],
    },
    (2, 1): {0: [(0, 0, 0, 1), (1, 0, 1, 1)]},
    (2, 2): {0: [(0, 0, 0, 1)], 1: [(1, 0, 0, 1)]},
    (2, 4): {0: [(0, 0, 0, 1)], 1: [(0, 0, 0, 1)], 2: [(1, 0, 0, 1)], 3: [(1, 0, 0, 1)]},
    (2, 8): {
        0: [(0, 0, 0, 1)],
        1: [(0, 0, 0, 1)],
        2: [(0, 0, 0, 1)],
        3: [(0, 0, 0, 1)],
        4: [(1, 0, 0, 1)],
        5: [(1, 0, 0, 1)],
        6: [(1, 0, 0, 1)],
        7: [(1, 0, 0, 1)],
    },
    (4, 1): {0: [(0, 0, 0, 1), (2, 0, 1, 1)]},
    (4, 2): {0: [(0, 0, 0, 1)], 1: [(3, 0, 0, 1)]},
    (4, 4): {0: [(0, 0, 0, 1)], 1: [(1, 0, 0, 1)], 2: [(2, 0, 0, 1)], 3: [(3, 0, 0, 1)]},
    (4, 8): {
        0: [(0, 0, 0, 1)],
        1: [(1, 0, 0, 1)],
        2: [(0, 0, 0, 1)],
        3: [(1, 0, 0, 1)],
        4: [(2, 0, 0, 1)],
        5: [(3, 0, 0, 1)],
        6: [(2, 0, 0, 1)],
        7: [(3, 0, 0, 1)],
    },
}

CASES = [(8, p, d, rows) for (p, d), rows in H8.items()] + [(2, p, d, rows) for (p, d), rows in H2.items()]


def _rows(slices: tuple[HeadSlice, ...]) -> list[Row]:
    return [(s.prefill_rank, s.src_head_start, s.dst_head_start, s.num_heads) for s in slices]


def test_tables_cover_every_pair() -> None:
    assert set(H8) == {(p, d) for p in (1, 2, 4, 8, 16) for d in (1, 2, 4, 8, 16)}
    assert set(H2) == {(p, d) for p in (1, 2, 4) for d in (1, 2, 4, 8)}
    for (_, d_tp), rows in [*H8.items(), *H2.items()]:
        assert set(rows) == set(range(d_tp))


@pytest.mark.parametrize(("num_heads", "prefill_tp", "decode_tp", "expected"), CASES)
def test_writers_match_hand_derived_vectors(
    num_heads: int, prefill_tp: int, decode_tp: int, expected: dict[int, list[Row]]
) -> None:
    validate_split(num_heads, prefill_tp, decode_tp)
    for decode_rank, rows in expected.items():
        assert _rows(writers_of(num_heads, prefill_tp, decode_tp, decode_rank)) == rows
    assignment = head_assignment(num_heads, prefill_tp, decode_tp)
    assert [_rows(slices) for slices in assignment] == [expected[d] for d in range(decode_tp)]


@pytest.mark.parametrize(("num_heads", "prefill_tp", "decode_tp", "expected"), CASES)
def test_targets_invert_the_hand_derived_vectors(
    num_heads: int, prefill_tp: int, decode_tp: int, expected: dict[int, list[Row]]
) -> None:
    for prefill_rank in range(prefill_tp):
        want = {d: HeadSlice(*row) for d, rows in expected.items() for row in rows if row[0] == prefill_rank}
        assert targets_of(num_heads, prefill_tp, decode_tp, prefill_rank) == want


def test_design_worked_examples() -> None:
    assert [s.dst_head_start for d in range(2) for s in writers_of(8, 4, 2, d)] == [0, 2, 0, 2]
    assert [s.src_head_start for d in range(4) for s in writers_of(8, 2, 4, d)] == [0, 2, 0, 2]
    assert [s.src_head_start for d in range(4) for s in writers_of(2, 1, 4, d)] == [0, 0, 1, 1]


def test_targets_literal() -> None:
    assert targets_of(8, 4, 2, 0) == {0: HeadSlice(0, 0, 0, 2)}
    assert targets_of(8, 4, 2, 3) == {1: HeadSlice(3, 0, 2, 2)}
    assert targets_of(8, 2, 4, 1) == {2: HeadSlice(1, 0, 0, 2), 3: HeadSlice(1, 2, 0, 2)}
    assert targets_of(8, 16, 8, 1) == {}
    assert targets_of(8, 16, 8, 3) == {1: HeadSlice(3, 0, 0, 1)}
    assert targets_of(2, 1, 4, 0) == {
        0: HeadSlice(0, 0, 0, 1),
        1: HeadSlice(0, 0, 0, 1),
        2: HeadSlice(0, 1, 0, 1),
        3: HeadSlice(0, 1, 0, 1),
    }


@pytest.mark.parametrize(
    ("num_heads", "tp", "per_rank", "owned"),
    [
        (8, 1, 8, [(0, 8)]),
        (8, 2, 4, [(0, 4), (4, 8)]),
        (8, 4, 2, [(0, 2), (2, 4), (4, 6), (6, 8)]),
        (8, 16, 1, [(0, 1), (0, 1), (1, 2), (1, 2), (2, 3), (2, 3), (3, 4), (3, 4)]),
        (2, 8, 1, [(0, 1), (0, 1), (0, 1), (0, 1), (1, 2), (1, 2), (1, 2), (1, 2)]),
        (1, 3, 1, [(0, 1), (0, 1), (0, 1)]),
    ],
)
def test_heads_per_rank_and_owned_heads(
    num_heads: int, tp: int, per_rank: int, owned: list[tuple[int, int]]
) -> None:
    assert heads_per_rank(num_heads, tp) == per_rank
    assert [owned_heads(num_heads, tp, r) for r in range(len(owned))] == owned


@pytest.mark.parametrize("rank", [-1, 4, 100])
def test_owned_heads_rank_out_of_range(rank: int) -> None:
    with pytest.raises(ConfigError, match=f"rank {rank}"):
        owned_heads(8, 4, rank)


def test_rank_out_of_range_in_writers_and_targets() -> None:
    with pytest.raises(ConfigError, match="decode rank 2"):
        writers_of(8, 4, 2, 2)
    with pytest.raises(ConfigError, match="prefill rank 4"):
        targets_of(8, 4, 2, 4)
    with pytest.raises(ConfigError, match="decode rank -1"):
        writers_of(8, 4, 2, -1, mla=True)


@pytest.mark.parametrize(
    ("num_heads", "prefill_tp", "decode_tp"),
    [(6, 4, 2), (8, 2, 3), (8, 3, 3), (6, 4, 4), (8, 12, 2), (0, 1, 1), (8, 0, 2), (8, 2, 0), (-8, 2, 2)],
)
def test_invalid_splits_raise_naming_h_p_d(num_heads: int, prefill_tp: int, decode_tp: int) -> None:
    for call in (
        lambda: validate_split(num_heads, prefill_tp, decode_tp),
        lambda: writers_of(num_heads, prefill_tp, decode_tp, 0),
        lambda: head_assignment(num_heads, prefill_tp, decode_tp),
        lambda: targets_of(num_heads, prefill_tp, decode_tp, 0),
    ):
        with pytest.raises(HeadSplitError) as info:
            call()
        message = str(info.value)
        assert f"H={num_heads}" in message
        assert f"P={prefill_tp}" in message
        assert f"D={decode_tp}" in message
        assert (info.value.num_heads, info.value.prefill_tp, info.value.decode_tp) == (
            num_heads,
            prefill_tp,
            decode_tp,
        )


@pytest.mark.parametrize(
    ("num_heads", "prefill_tp", "decode_tp", "writer_ranks"),
    [
        (1, 4, 2, [0, 1]),
        (1, 2, 8, [0, 1, 0, 1, 0, 1, 0, 1]),
        (1, 1, 3, [0, 0, 0]),
        (1, 8, 1, [0]),
        (1, 3, 5, [0, 1, 2, 0, 1]),
        (8, 4, 4, [0, 1, 2, 3]),
    ],
)
def test_mla_has_exactly_one_writer(
    num_heads: int, prefill_tp: int, decode_tp: int, writer_ranks: list[int]
) -> None:
    assignment = head_assignment(num_heads, prefill_tp, decode_tp, mla=True)
    assert [_rows(slices) for slices in assignment] == [[(p, 0, 0, 1)] for p in writer_ranks]
    for p in range(prefill_tp):
        want = {d: HeadSlice(p, 0, 0, 1) for d, writer in enumerate(writer_ranks) if writer == p}
        assert targets_of(num_heads, prefill_tp, decode_tp, p, mla=True) == want


def test_mla_still_rejects_non_positive_sizes() -> None:
    with pytest.raises(HeadSplitError, match="H=0"):
        writers_of(0, 2, 2, 0, mla=True)
    with pytest.raises(HeadSplitError, match="P=0"):
        targets_of(1, 0, 2, 0, mla=True)


@st.composite
def valid_splits(draw: st.DrawFn) -> tuple[int, int, int]:
    num_heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 32]))
    divisors = [t for t in range(1, num_heads + 1) if num_heads % t == 0]
    multiples = [num_heads * k for k in (2, 3, 4) if num_heads * k <= 64]
    prefill_tp = draw(st.sampled_from(divisors + multiples))
    decode_tp = draw(st.sampled_from(divisors + multiples))
    return num_heads, prefill_tp, decode_tp


@settings(max_examples=150, deadline=None)
@given(valid_splits())
def test_writers_cover_each_decode_rank_exactly_once(split: tuple[int, int, int]) -> None:
    num_heads, prefill_tp, decode_tp = split
    validate_split(num_heads, prefill_tp, decode_tp)
    replicas = max(1, prefill_tp // num_heads)
    local_heads = heads_per_rank(num_heads, decode_tp)
    # prefill rank -> decode ranks it serves, per head group (to check replica spread).
    served_by_replica: dict[int, set[int]] = {}
    needed_by: dict[int, set[int]] = {}
    for decode_rank, slices in enumerate(head_assignment(num_heads, prefill_tp, decode_tp)):
        need_start, need_stop = owned_heads(num_heads, decode_tp, decode_rank)
        assert need_stop - need_start == local_heads
        covered: list[int] = []
        groups = set()
        for s in slices:
            assert s.num_heads >= 1
            own_start, own_stop = owned_heads(num_heads, prefill_tp, s.prefill_rank)
            assert 0 <= s.src_head_start and s.src_head_start + s.num_heads <= own_stop - own_start
            global_start = own_start + s.src_head_start
            assert global_start == need_start + s.dst_head_start
            covered.extend(range(s.dst_head_start, s.dst_head_start + s.num_heads))
            group = s.prefill_rank // replicas
            assert group not in groups, "two writers for one prefill head group"
            groups.add(group)
            if replicas > 1:
                assert s.prefill_rank % replicas == decode_rank % replicas
            served_by_replica.setdefault(group, set()).add(s.prefill_rank)
            needed_by.setdefault(group, set()).add(decode_rank)
        assert covered == list(range(local_heads)), "heads not covered exactly once, in dst order"
        targets_seen = {
            d
            for p in {s.prefill_rank for s in slices}
            for d in targets_of(num_heads, prefill_tp, decode_tp, p)
        }
        assert decode_rank in targets_seen
    # Every group is needed by someone, and replicated groups spread over as many replicas as can be used.
    assert set(needed_by) == set(range(min(num_heads, prefill_tp)))
    for group, ranks in served_by_replica.items():
        assert len(ranks) == min(replicas, len(needed_by[group]))
