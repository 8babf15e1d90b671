"""The connector core (``transfer_engine/integrations/vllm/core.py``) on CPU: requests, layer readiness
and their ends, with real engines (NIXL over UCX, ZMQ) in this process.

The calls are made as vLLM's worker makes the connector's (``vllm/distributed/kv_transfer/
kv_connector/v1/base.py``): ``register_kv_caches`` builds the core; ``bind_connector_metadata``
opens a layer-wise room before the forward (``begin_layers``); ``save_kv_layer`` after each
layer's cache update (``layer_written``); ``wait_for_save`` once the forward is queued
(``step_written``); ``get_finished`` and ``get_block_ids_with_load_errors`` collect the ends
(``take_finished``, ``take_load_errors``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

from tests.gpu.inprocess import cores
from tests.gpu.vllm_kv import (
    Side,
    allocate,
    make_core,
    mismatches,
    requests_for,
    run_prefill,
    wait_reported,
    written_bytes,
)
from transfer_engine.errors import (
    AddressInUseError,
    ConfigError,
    LayoutError,
    LocalProtocolError,
)
from transfer_engine.integrations.vllm.core import ConnectorCore, digest_of
from transfer_engine.testing.cluster import free_port

pytestmark = pytest.mark.timeout(120)

SIDE = Side(layout="LBNHC", num_layers=5)


class Recording(ConnectorCore):
    """The core, with the layer ranges it hands to the engine recorded (nothing else changed)."""

    handed: list[tuple[str, int, int]]

    def _hand_layers(self, layers) -> None:  # type: ignore[no-untyped-def]
        if layers.end > layers.handed:
            req = next(r for r, lw in self._layerwise.items() if lw is layers)
            self.handed.append((req, layers.handed, layers.end))
        super()._hand_layers(layers)


def assert_no_leaks(*sides: ConnectorCore) -> None:
    """Nothing left on any side (30 s at most for rooms ending): no room, stash, WRITE or request."""
    deadline = time.monotonic() + 30
    for side in sides:
        while leaks := {k: v for k, v in side.leaks().items() if v}:
            assert time.monotonic() < deadline, leaks
            time.sleep(0.05)


@contextlib.contextmanager
def checked_cores() -> Iterator[tuple[list[ConnectorCore], list[ConnectorCore], list[dict], list[dict]]]:
    """``cores`` over ``SIDE`` on both sides, P=1 -> D=1; once the test's body passed, nothing leaked."""
    with cores(SIDE, SIDE, "cpu") as started:
        yield started
        assert_no_leaks(*started[0], *started[1])


def test_layers_go_out_in_groups() -> None:
    """``layers_per_write`` 2 over 5 layers: groups [0, 2), [2, 4), [4, 5); per-layer calls that
    close no group hand nothing; a range of several layers may close a group at once."""
    with checked_cores() as (p_cores, d_cores, p_caches, d_caches):
        core = p_cores[0]
        core.__class__ = Recording
        core.handed = []  # type: ignore[attr-defined]
        reqs = requests_for(SIDE, SIDE, [20, 30])
        for r in reqs:
            d_cores[0].receive(r.transfer_id, r.transfer_id, r.decode_blocks, core.bootstrap)
        a, b = (r.transfer_id for r in reqs)
        core.begin_layers(a, a, reqs[0].prefill_blocks)
        core.begin_layers(b, b, reqs[1].prefill_blocks)
        core.layers_ready(a, 0, 1)
        assert core.handed == []  # type: ignore[attr-defined]
        core.layers_ready(a, 1, 2)
        core.layers_ready(b, 0, 3)
        assert core.handed == [(a, 0, 2), (b, 0, 3)]  # type: ignore[attr-defined]
        core.layer_written(3)  # a: [2, 4) closes a group; b: [3, 4) does not
        core.step_written()  # both: the rest
        assert core.handed == [(a, 0, 2), (b, 0, 3), (a, 2, 4), (a, 4, 5), (b, 3, 5)]  # type: ignore[attr-defined]
        with pytest.raises(LocalProtocolError, match=repr(a)):
            core.layers_ready(a, 5, 5)  # the request's layers are all reported
        wait_reported(core, {a, b}, prefill=True)
        assert wait_reported(d_cores[0], {a, b}, prefill=False) == set()


def test_bad_calls_raise_on_the_callers_thread() -> None:
    """Typed errors naming the value, before anything reaches the engine."""
    with checked_cores() as (p_cores, _, _, _):
        core = p_cores[0]
        with pytest.raises(LocalProtocolError, match="'r1'.*begin_layers"):
            core.layers_ready("r1", 0, 1)
        core.begin_layers("r1", "t1", [0, 1])
        with pytest.raises(LocalProtocolError, match="'r1' already"):
            core.begin_layers("r1", "t1", [0, 1])
        with pytest.raises(ConfigError, match=r"\[1, 2\).*starts at 0"):
            core.layers_ready("r1", 1, 2)
        with pytest.raises(ConfigError, match=r"\[0, 6\).*ends by 5"):
            core.layers_ready("r1", 0, 6)
        with pytest.raises(LayoutError, match="block id 12"):
            core.send("r2", "t2", [3, 12])
        with pytest.raises(ConfigError, match="transfer_id=''"):
            core.send("r3", "", [0])
        with pytest.raises(LayoutError, match="'model.layers.9"):
            core.layer_index("model.layers.9.self_attn.attn")
        core.abort("r1", "t1")
        core.step_written()
        wait_reported(core, {"r1"}, prefill=True)


def test_construction_errors() -> None:
    caches = allocate(SIDE, "cpu")
    with pytest.raises(ConfigError, match="max_requests=0"):
        ConnectorCore(
            make_core("prefill", SIDE, 0, caches, 1).config,
            caches,
            layout="LBNHC",
            block_size=16,
            head_size=16,
            max_requests=0,
        )
    with pytest.raises(LayoutError, match="LBHNC"):
        ConnectorCore(
            make_core("prefill", SIDE, 0, caches, 1).config,
            caches,
            layout="LBHNC",
            block_size=16,
            head_size=16,
            max_requests=1,
        )


def test_start_raises_the_engines_error() -> None:
    """An engine that cannot start (its bootstrap port is taken) raises from start(); no thread is left."""
    with checked_cores() as (p_cores, _, _, _):
        port = p_cores[0].config.bootstrap_port
        other = make_core("prefill", SIDE, 0, allocate(SIDE, "cpu"), port)
        with pytest.raises(
            AddressInUseError, match=rf"cannot bind tcp://127\.0\.0\.1:{port}: Address already in use"
        ):
            other.start()
        other.close()
        assert not [t for t in threading.enumerate() if t.name == "te-vllm-prefill-0" and t.is_alive()][1:]


def test_decode_abort_reports_without_load_errors() -> None:
    """A decode request aborted while waiting for a prefill that never sends: reported once its
    room ended, and its blocks are not load errors (vLLM freed the request)."""
    with checked_cores() as (p_cores, d_cores, _, _):
        d = d_cores[0]
        d.receive("r1", "t-abort", [4, 5], p_cores[0].bootstrap)
        d.abort("r1", "t-abort")
        assert wait_reported(d, {"r1"}, prefill=False) == set()


def test_prefill_abort_fails_the_decode() -> None:
    """A prefill request aborted before it was sent fails its room: the decode reports the
    request with its blocks as load errors (vLLM recomputes them), at once, not at a timeout."""
    with checked_cores() as (p_cores, d_cores, _, _):
        d = d_cores[0]
        d.receive("r1", "t-fail", [4, 5], p_cores[0].bootstrap)
        p_cores[0].abort("r1", "t-fail")
        assert wait_reported(d, {"r1"}, prefill=False, timeout=10) == {"4", "5"}


def test_decode_prefix_cache() -> None:
    """A decode that holds a request's first block already (its prefix cache) asks for the rest
    (``prefix_len``): the prefill sends only those blocks' KV, the cached block is not written."""
    with checked_cores() as (p_cores, d_cores, p_caches, d_caches):
        p, d = p_cores[0], d_cores[0]
        (r,) = requests_for(SIDE, SIDE, [50])
        d.receive(r.transfer_id, r.transfer_id, r.decode_blocks[1:], p.bootstrap, prefix_len=16)
        run_prefill(p, p_caches[0], SIDE, 0, [r])
        wait_reported(p, {r.transfer_id}, prefill=True)
        assert wait_reported(d, {r.transfer_id}, prefill=False) == set()
        assert mismatches(d_caches[0], SIDE, 0, r.number, r.decode_blocks[1:], 34, start=16) == 0
        item = 2  # bf16
        assert written_bytes(d_caches[0]) == 34 * SIDE.heads_local * SIDE.content * item * SIDE.num_layers
        assert p.take_stats()["bytes"] == 3 * p.pool.page_bytes * 2 * SIDE.num_layers  # 3 of 4 blocks
        with pytest.raises(ConfigError, match="prefix_len=8"):
            d.receive("r2", "t2", [0], p.bootstrap, prefix_len=8)


def test_decode_cancel_ends_the_prefills_room_at_once() -> None:
    """A decode request that ends before its room opened cancels it (``cancel``): the prefill's
    send of it, opened after, fails at once (well within its 30 s ``bootstrap_timeout``), counted
    as aborted; nothing is written on the decode."""
    with checked_cores() as (p_cores, d_cores, _, d_caches):
        p, d = p_cores[0], d_cores[0]
        p.take_stats()
        d.cancel("d1", "t-cancelled", p.bootstrap)
        p.send("p1", "t-cancelled", [1, 2])
        wait_reported(p, {"p1"}, prefill=True, timeout=10)
        assert p.take_stats()["failures"] == {"aborted": 1}
        assert written_bytes(d_caches[0]) == 0


def test_a_bootstrap_nobody_answers_fails_the_load() -> None:
    """The decode's blocks are load errors (vLLM recomputes them or fails the request, per its
    ``kv_load_failure_policy``), counted as unreachable."""
    with checked_cores() as (_, d_cores, _, _):
        d = d_cores[0]
        d.take_stats()
        d.receive("d1", "t-unanswered", [3], f"tcp://127.0.0.1:{free_port()}")
        assert wait_reported(d, {"d1"}, prefill=False) == {"3"}
        stats = d.take_stats()
        assert stats["transfers"] == 0 and stats["failures"] == {"unreachable": 1}


def test_stats() -> None:
    """Rank 0 counts transfers and their seconds, every rank its bytes; failures by kind."""
    with checked_cores() as (p_cores, d_cores, p_caches, d_caches):
        p, d = p_cores[0], d_cores[0]
        reqs = requests_for(SIDE, SIDE, [16, 33])
        for r in reqs:
            d.receive(r.transfer_id, r.transfer_id, r.decode_blocks, p.bootstrap)
        run_prefill(p, p_caches[0], SIDE, 0, reqs)
        ids = {r.transfer_id for r in reqs}
        wait_reported(p, ids, prefill=True)
        wait_reported(d, ids, prefill=False)
        page_bytes = p.pool.page_bytes * 2 * SIDE.num_layers
        for core in (p, d):
            stats = core.take_stats()
            assert (stats["transfers"], stats["bytes"], len(stats["seconds"]), stats["failures"]) == (
                2,
                (1 + 3) * page_bytes,
                2,
                {},
            )
            assert core.take_stats()["transfers"] == 0
        d.receive("r3", "t-fails", [9], p.bootstrap)
        p.abort("r3", "t-fails")
        assert wait_reported(d, {"r3"}, prefill=False, timeout=10) == {"9"}
        assert d.take_stats()["failures"] == {"aborted": 1}


def test_requests_in_steps_and_news() -> None:
    """Two steps of requests through one pair of cores, each reported once; wait_for_news returns
    at once when nothing is outstanding; nothing leaks."""
    with checked_cores() as (p_cores, d_cores, p_caches, d_caches):
        p, d = p_cores[0], d_cores[0]
        p.wait_for_news(5.0)  # nothing outstanding: returns at once (the test's timeout would tell)
        for step in range(2):
            reqs = [
                replace(r, transfer_id=f"{r.transfer_id}-s{step}", number=r.number + 10 * step)
                for r in requests_for(SIDE, SIDE, [16, 33, 7])
            ]
            for r in reqs:
                d.receive(r.transfer_id, r.transfer_id, r.decode_blocks, p.bootstrap)
            run_prefill(p, p_caches[0], SIDE, 0, reqs)
            ids = {r.transfer_id for r in reqs}
            wait_reported(p, ids, prefill=True)
            assert wait_reported(d, ids, prefill=False) == set()
            assert p.take_finished() == (set(), set())
        assert not {k: v for k, v in p.leaks().items() if v} and not {k: v for k, v in d.leaks().items() if v}


def test_digest() -> None:
    assert len(digest_of("a")) == 16 and digest_of("a") != digest_of("b") and digest_of("a") == digest_of("a")
