"""The connector's engine thread (``EngineThread``) without vLLM processes: real engines, NIXL and
ZMQ in this process, over KV tensors laid out as vLLM's CPU attention keeps them.

What vLLM drives through its hooks is driven here by hand: a layer-wise send reported layer by
layer (``save_kv_layer``), and a decode request cancelled before its room opened.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterator
from typing import Literal

import pytest
import torch

from transfer_engine import EngineConfig
from transfer_engine.testing.cluster import free_port

with warnings.catch_warnings():  # vLLM's own imports warn about torch APIs it uses (warnings are errors here)
    warnings.simplefilter("ignore", DeprecationWarning)
    from transfer_engine.integrations.vllm._runner import EngineThread
    from transfer_engine.integrations.vllm.connector import digest_of, room_of

pytestmark = pytest.mark.timeout(120)

LAYERS, BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM = 3, 8, 2, 16, 8

Pair = tuple[EngineThread, EngineThread, list[torch.Tensor], list[torch.Tensor], str]
"""The prefill's and the decode's engine threads, their KV, and the prefill's bootstrap."""


def kv(seed: int | None) -> list[torch.Tensor]:
    """One rank's KV as vLLM CPU keeps it: per layer [num_blocks, heads, block_size, 2 * head_dim]."""
    shape = (BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
    if seed is None:
        return [torch.zeros(shape) for _ in range(LAYERS)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(LAYERS)]


def thread(role: Literal["prefill", "decode"], layers: list[torch.Tensor], port: int) -> EngineThread:
    config = EngineConfig(
        role=role, host="127.0.0.1", bootstrap_host="127.0.0.1", bootstrap_port=port, max_rooms=4,
        bootstrap_timeout=120.0, heartbeat_interval=5.0, connect_timeout=30.0, layers_per_write=1,
    )  # fmt: skip
    return EngineThread(config, layers=layers, head_dim=HEAD_DIM, cpus=frozenset(os.sched_getaffinity(0)))


@pytest.fixture
def pair() -> Iterator[Pair]:
    port = free_port()
    source, target = kv(1), kv(None)
    prefill, decode = thread("prefill", source, port), thread("decode", target, port)
    prefill.start()
    decode.start()
    try:
        yield prefill, decode, source, target, f"tcp://127.0.0.1:{port}"
        for side in (prefill, decode):  # nothing left: no room, stash, WRITE or handle
            assert side.engine is not None
            deadline = time.monotonic() + 30
            while any(side.engine.leaks().values()):
                assert time.monotonic() < deadline, side.engine.leaks()
                time.sleep(0.05)
    finally:
        decode.stop()
        prefill.stop()


def finished(side: EngineThread, prefill: bool) -> set[str]:
    """Wait (30 s at most) for the side's next report, as vLLM's get_finished would see it."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        side.wait_for_news(0.1)
        sent, received = side.take_finished()
        if sent or received:
            return sent if prefill else received
    pytest.fail("no transfer reported within 30 s")


def test_a_layer_wise_send_lands_bit_exact_layer_by_layer(pair: Pair) -> None:
    prefill, decode, source, target, bootstrap = pair
    tid, blocks_p, blocks_d = "layerwise-1", [1, 4, 6], [7, 0, 2]
    room, digest = room_of(tid), digest_of(tid)
    decode.receive("d1", room, tid, blocks_d, bootstrap, digest)
    prefill.send_layerwise("p1", room, tid, blocks_p, digest)
    for layer in range(LAYERS - 1):  # the last layer comes from step_written(), as after a forward
        prefill.layer_written(layer)
    prefill.step_written()
    assert finished(decode, prefill=False) == {"d1"}
    assert finished(prefill, prefill=True) == {"p1"}
    assert not decode.take_load_errors()  # the digest matched
    for layer in range(LAYERS):
        assert torch.equal(target[layer][blocks_d], source[layer][blocks_p])
        untouched = [b for b in range(BLOCKS) if b not in blocks_d]
        assert not target[layer][untouched].any()


def test_a_decode_request_cancelled_before_its_room_opened_ends_the_prefills_room_at_once(
    pair: Pair,
) -> None:
    """The decode's request ends before its blocks were allocated; the prefill's send of it, opened
    after, ends at once (before: it waited bootstrap_timeout, 120 s here, for the decode)."""
    prefill, decode, _, target, bootstrap = pair
    tid = "cancelled-1"
    room, digest = room_of(tid), digest_of(tid)
    decode.cancel("d1", room, bootstrap)
    assert decode.engine is not None
    deadline = time.monotonic() + 30
    while decode.engine.counters["rooms_failed"] < 1:  # the cancel's room ended: the prefill acked
        assert time.monotonic() < deadline, "the cancel's room did not end"
        time.sleep(0.05)
    prefill.send("p1", room, tid, [1, 2], digest)
    assert finished(prefill, prefill=True) == {"p1"}
    assert prefill.engine is not None and prefill.engine.counters["failed_aborted"] == 1
    assert not any(t.any() for t in target)  # nothing was written


def test_a_decode_with_a_cached_prefix_gets_only_the_blocks_past_it_and_stats_count_them(pair: Pair) -> None:
    """The decode holds the first block already (prefix caching): it asks for blocks 1 and 2 of
    the prompt only, and the prefill WRITEs those (``decode_prefix_len``), leaving block 0 alone."""
    prefill, decode, source, target, bootstrap = pair
    tid, blocks_p, blocks_d = "prefix-1", [1, 4, 6], [7, 2]
    room, digest = room_of(tid), digest_of(tid)
    prefill.take_stats(), decode.take_stats()
    decode.receive("d1", room, tid, blocks_d, bootstrap, digest, prefix_len=BLOCK_SIZE)
    prefill.send("p1", room, tid, blocks_p, digest)
    assert finished(decode, prefill=False) == {"d1"}
    assert finished(prefill, prefill=True) == {"p1"}
    assert not decode.take_load_errors()
    for layer in range(LAYERS):
        assert torch.equal(target[layer][blocks_d], source[layer][blocks_p[1:]])
        assert not target[layer][[b for b in range(BLOCKS) if b not in blocks_d]].any()
    block_bytes = LAYERS * source[0][0].nbytes
    for side in (prefill, decode):
        stats = side.take_stats()
        assert stats["transfers"] == 1 and stats["bytes"] == 2 * block_bytes and not stats["failures"]
        assert len(stats["seconds"]) == 1 and 0 < stats["seconds"][0] < 30


def test_a_bootstrap_nobody_answers_fails_the_load_and_counts_it(pair: Pair) -> None:
    _, decode, _, _, _ = pair
    tid = "unanswered-1"
    decode.take_stats()
    decode.receive("d1", room_of(tid), tid, [3], f"tcp://127.0.0.1:{free_port()}", digest_of(tid))
    assert finished(decode, prefill=False) == {"d1"}
    assert decode.take_load_errors() == {3}  # vLLM recomputes or fails it, per kv_load_failure_policy
    stats = decode.take_stats()
    assert stats["transfers"] == 0 and stats["failures"] == {"unreachable": 1}
