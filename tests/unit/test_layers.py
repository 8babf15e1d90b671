"""Layer-wise bookkeeping (protocol/layers.py): grouping, validation, tallies, tensor and block math."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer_engine.errors import ConfigError, LocalProtocolError, RemoteProtocolError
from transfer_engine.protocol.layers import (
    ChunkCut,
    LayerChunks,
    LayerGroup,
    LayerTally,
    check_layers_per_write,
    group_block_runs,
    group_tensor_runs,
    group_tensors,
)
from transfer_engine.protocol.staging import writer_block_bytes

# ---------------------------------------------------------------- grouping


@pytest.mark.parametrize(
    ("num_layers", "per_write", "calls", "groups"),
    [
        (4, 1, [(0, 1), (1, 2), (2, 3), (3, 4)], [(0, 1, False), (1, 2, False), (2, 3, False), (3, 4, True)]),
        (4, 2, [(0, 1), (1, 2), (2, 3), (3, 4)], [None, (0, 2, False), None, (2, 4, True)]),
        (
            5,
            2,
            [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)],
            [None, (0, 2, False), None, (2, 4, False), (4, 5, True)],
        ),
        (4, 8, [(0, 1), (1, 3), (3, 4)], [None, None, (0, 4, True)]),  # the closing range flushes
        (4, 2, [(0, 3), (3, 4)], [(0, 3, False), (3, 4, True)]),  # a wide range is one group
        (3, 1, [(0, 3)], [(0, 3, True)]),
    ],
)
def test_groups_cut_at_layers_per_write_and_at_the_last_layer(num_layers, per_write, calls, groups):
    chunks = LayerChunks(num_layers, per_write)
    chunks.open(0)
    got = [chunks.ready(a, b) for a, b in calls]
    assert got == [None if g is None else LayerGroup(0, *g) for g in groups]
    assert not chunks.is_open and chunks.closed == {0}


def test_a_closed_chunk_lets_the_next_one_open_at_layer_zero():
    chunks = LayerChunks(2, 1)
    chunks.open(0)
    chunks.ready(0, 2)
    chunks.open(1)
    assert chunks.ready(0, 1) == LayerGroup(1, 0, 1, False)
    assert chunks.ready(1, 2) == LayerGroup(1, 1, 2, True)


@pytest.mark.parametrize(
    ("calls", "bad", "error", "names"),
    [
        ([], (0, 1), LocalProtocolError, "no layer-wise chunk is open"),
        ([(0, 2)], (1, 3), LocalProtocolError, "overlap"),  # overlapping
        ([(0, 2)], (0, 2), LocalProtocolError, "must start at layer 2"),  # repeated
        ([(0, 2)], (3, 4), LocalProtocolError, "skip layers"),  # out of order
        ([], (1, 2), LocalProtocolError, "must start at layer 0"),
        ([], (0, 5), ConfigError, "[0, 5)"),  # out of bounds
        ([], (-1, 1), ConfigError, "[-1, 1)"),
        ([], (2, 2), ConfigError, "[2, 2)"),  # empty
        ([], (0, 1.5), ConfigError, "1.5"),
        ([], (True, 2), ConfigError, "True"),
        ([(0, 4)], (0, 1), LocalProtocolError, "chunk 0 closed"),  # after the chunk closed
    ],
)
def test_bad_ranges_raise_naming_the_value_and_change_nothing(calls, bad, error, names):
    chunks = LayerChunks(4, 2)
    chunks.open(0)
    if not calls:
        chunks.chunk_id = None if error is LocalProtocolError and "open" in names else 0
    for a, b in calls:
        chunks.ready(a, b)
    before = (chunks.chunk_id, chunks.next_layer, chunks.group_start, set(chunks.closed))
    with pytest.raises(error, match=None) as info:
        chunks.ready(*bad)
    assert names in str(info.value)
    assert (chunks.chunk_id, chunks.next_layer, chunks.group_start, chunks.closed) == before


def test_opening_while_a_chunk_is_open_or_reopening_a_closed_one_is_refused():
    chunks = LayerChunks(4, 1)
    chunks.open(0)
    chunks.ready(0, 1)
    with pytest.raises(LocalProtocolError, match="chunk 0 is still open at layer 1 of 4"):
        chunks.open(1)
    assert chunks.chunk_id == 0 and chunks.next_layer == 1
    chunks.ready(1, 4)
    with pytest.raises(LocalProtocolError, match="chunk 0 was already sent"):
        chunks.open(0)


@pytest.mark.parametrize("value", [0, -1, 1.0, "2", None, True])
def test_layers_per_write_must_be_a_positive_integer(value):
    with pytest.raises(ConfigError, match="layers_per_write"):
        check_layers_per_write(value)
    with pytest.raises(ConfigError, match="layers_per_write"):
        LayerChunks(4, value)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.integers(1, 10), st.data())
def test_groups_tile_every_layer_once_whatever_the_calls(num_layers, per_write, data):
    cuts = sorted(
        data.draw(st.sets(st.integers(1, num_layers - 1), max_size=num_layers)) if num_layers > 1 else set()
    )
    bounds = [0, *cuts, num_layers]
    chunks = LayerChunks(num_layers, per_write)
    chunks.open(7)
    groups = [g for a, b in zip(bounds, bounds[1:], strict=False) if (g := chunks.ready(a, b)) is not None]
    assert [g.start for g in groups] == [0] + [g.end for g in groups[:-1]]
    assert groups[-1].end == num_layers and groups[-1].closes
    assert all(not g.closes for g in groups[:-1])
    assert all(g.end - g.start >= per_write for g in groups[:-1])
    assert all(g.end in bounds for g in groups)


# ---------------------------------------------------------------- tallies


def test_tally_completes_a_key_when_groups_cover_every_layer_in_any_order():
    tally = LayerTally(6)
    assert not tally.add((0, 1), 4, 6)
    assert tally.partial((0, 1)) and tally.layers((0, 1)) == 2
    assert not tally.add((0, 1), 0, 2)
    assert tally.add((0, 2), 0, 6) is not False  # another key completes alone
    assert tally.has((0, 1), 4, 6) and not tally.has((0, 1), 2, 4)
    assert tally.add((0, 1), 2, 4)
    assert tally.complete((0, 1)) and not tally.partial((0, 1)) and tally.layers((0, 1)) == 6


@pytest.mark.parametrize(
    ("before", "bad", "names"),
    [
        ([(0, 2)], (1, 3), "overlap layers [0, 2)"),
        ([(0, 2)], (0, 2), "overlap layers [0, 2)"),
        ([], (0, 7), "[0, 7)"),
        ([], (3, 3), "[3, 3)"),
        ([(0, 6)], (0, 1), "already has every layer"),
    ],
)
@pytest.mark.parametrize("error", [RemoteProtocolError, LocalProtocolError])
def test_tally_refuses_bad_ranges_and_records_nothing(before, bad, names, error):
    tally = LayerTally(6, error)
    for a, b in before:
        tally.add("k", a, b)
    layers = tally.layers("k")
    with pytest.raises(error) as info:
        tally.add("k", *bad)
    assert names in str(info.value)
    assert tally.layers("k") == layers


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 30), st.data())
def test_tally_completes_exactly_at_the_last_group_of_any_permutation(num_layers, data):
    cuts = sorted(data.draw(st.sets(st.integers(1, num_layers - 1))) if num_layers > 1 else set())
    bounds = [0, *cuts, num_layers]
    ranges = data.draw(st.permutations(list(zip(bounds, bounds[1:], strict=False))))
    tally = LayerTally(num_layers)
    done = [tally.add("c", a, b) for a, b in ranges]
    assert done == [False] * (len(ranges) - 1) + [True]


# ---------------------------------------------------------------- tensors and staged blocks


@pytest.mark.parametrize(
    ("num_layers", "mla", "start", "end", "expected"),
    [
        (4, False, 0, 4, [0, 1, 2, 3, 4, 5, 6, 7]),
        (4, False, 1, 3, [1, 2, 5, 6]),
        (4, True, 1, 3, [1, 2]),
        (3, False, 2, 3, [2, 5]),
    ],
)
def test_group_tensors(num_layers, mla, start, end, expected):
    assert group_tensors(num_layers, mla, start, end).tolist() == expected


def test_group_tensors_refuses_a_bad_range():
    with pytest.raises(ConfigError, match=r"layers \[2, 1\)"):
        group_tensors(4, False, 2, 1)
    with pytest.raises(ConfigError, match=r"layers \[0, 5\)"):
        group_tensor_runs(4, False, 0, 5)


@pytest.mark.parametrize("mla", [False, True])
@settings(max_examples=100, deadline=None)
@given(st.integers(1, 12), st.data())
def test_tensor_runs_are_the_group_tensors_in_order(mla, num_layers, data):
    """Each run is consecutive tensors; together, in order, exactly the group's tensors."""
    start = data.draw(st.integers(0, num_layers - 1))
    end = data.draw(st.integers(start + 1, num_layers))
    runs = group_tensor_runs(num_layers, mla, start, end)
    flat = [t for first, count in runs for t in range(first, first + count)]
    assert flat == group_tensors(num_layers, mla, start, end).tolist()
    assert len(runs) == (1 if mla else 2) and all(count == end - start for _, count in runs)


@pytest.mark.parametrize("mla", [False, True])
@settings(max_examples=100, deadline=None)
@given(st.integers(1, 12), st.data())
def test_block_runs_put_each_group_tensor_where_the_whole_block_has_it(mla, num_layers, data):
    start = data.draw(st.integers(0, num_layers - 1))
    end = data.draw(st.integers(start + 1, num_layers))
    tokens, heads, head_dim, itemsize = 3, 2, 4, 2
    tensors = num_layers if mla else 2 * num_layers
    tensor_bytes = writer_block_bytes(1, tokens, heads, head_dim, itemsize)
    assert writer_block_bytes(tensors, tokens, heads, head_dim, itemsize) == tensors * tensor_bytes
    block = np.repeat(np.arange(tensors), tensor_bytes)  # byte -> tensor index of the whole block
    gathered = np.repeat(group_tensors(num_layers, mla, start, end), tensor_bytes)
    placed = np.full(block.size, -1)
    for src, dst, length in group_block_runs(num_layers, mla, tensor_bytes, start, end):
        placed[dst : dst + length] = gathered[src : src + length]
    mask = placed >= 0
    assert (placed[mask] == block[mask]).all() and mask.sum() == gathered.size


HOST4 = {"host": 4}


@pytest.mark.parametrize(
    ("cut", "num_layers", "nbytes", "path", "expected"),
    [
        (ChunkCut(HOST4, 100), 10, 100, "host", [(0, 4, False), (4, 8, False), (8, 10, True)]),
        (ChunkCut({"host": 5}), 10, 0, "host", [(0, 5, False), (5, 10, True)]),
        (ChunkCut(HOST4, 100), 10, 99, "host", None),  # under min_bytes: whole
        (ChunkCut(HOST4), 10, 100, "staged", None),  # a path the table does not name
        (ChunkCut(HOST4), 10, 100, "direct", None),
        (ChunkCut({"host": 0}), 10, 100, "host", None),  # off
        (ChunkCut({"host": 10}), 10, 100, "host", None),  # one group would be the whole chunk
        (ChunkCut({"staged": 1}), 2, 1, "staged", [(0, 1, False), (1, 2, True)]),
        (ChunkCut({"staged": 1}), 2, 1, "host", None),
        # each staging path its own group size; the bar is shared
        (ChunkCut({"host": 4, "staged": 32}, 64), 64, 64, "staged", [(0, 32, False), (32, 64, True)]),
        (
            ChunkCut({"host": 4, "staged": 32}, 64),
            64,
            64,
            "host",
            [(a, a + 4, a == 60) for a in range(0, 64, 4)],
        ),
        (ChunkCut({"host": 4, "staged": 32}, 64), 64, 63, "staged", None),
        (ChunkCut({"host": 4, "staged": 0}), 64, 0, "staged", None),
        (ChunkCut({"staged": 24}), 64, 0, "staged", [(0, 24, False), (24, 48, False), (48, 64, True)]),
        (ChunkCut(), 64, 1 << 30, "staged", None),  # the empty table cuts nothing
        (ChunkCut({"staged": 8}), 64, 1 << 30, "slice", None),
    ],
)
def test_chunk_cut_by_path_and_size(cut, num_layers, nbytes, path, expected):
    groups = cut.groups(7, num_layers, nbytes, path)
    if expected is None:
        assert groups is None
    else:
        assert groups is not None and all(g.chunk_id == 7 for g in groups)
        assert [(g.start, g.end, g.closes) for g in groups] == expected


@given(st.integers(1, 100), st.integers(1, 100), st.sampled_from(["host", "staged"]))
def test_chunk_cut_tiles_every_layer_once(num_layers, per_group, path):
    groups = ChunkCut({path: per_group}).groups(0, num_layers, 0, path)
    if per_group >= num_layers:
        assert groups is None
        return
    assert groups is not None
    assert [layer for g in groups for layer in range(g.start, g.end)] == list(range(num_layers))
    assert [g.closes for g in groups] == [False] * (len(groups) - 1) + [True]


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"per_path": {"host": -1}}, "per_path\\['host'\\]=-1"),
        ({"per_path": {"staged": 2.5}}, "per_path\\['staged'\\]=2.5"),
        ({"per_path": {"direct": 4}}, "path='direct'"),
        ({"per_path": {"slice": 0}}, "path='slice'"),
        ({"min_bytes": -5}, "min_bytes=-5"),
    ],
)
def test_chunk_cut_refuses_bad_settings_by_name(kwargs, names):
    with pytest.raises(ConfigError, match=names):
        ChunkCut(**kwargs)


def test_chunk_cut_keeps_its_own_table():
    table = {"staged": 8}
    cut = ChunkCut(table)
    table["staged"] = 0
    assert cut.per_group("staged") == 8 and cut.per_group("host") == 0
