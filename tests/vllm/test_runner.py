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

import pytest
import torch

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


def thread(role: str, layers: list[torch.Tensor], port: int) -> EngineThread:
    return EngineThread(
        role=role, layers=layers, head_dim=HEAD_DIM, tp_size=1, tp_rank=0, host="127.0.0.1",
        bootstrap_port=port, max_rooms=4, bootstrap_timeout=120.0, introspect_port=0,
        heartbeat_interval=5.0, connect_timeout=30.0, cpus=frozenset(os.sched_getaffinity(0)),
        layers_per_write=1,
    )  # fmt: skip


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
