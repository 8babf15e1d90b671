"""Request leases under real vLLM servers: queues far longer than every fixed window, a killed
prefill, abandoned requests (docs/vllm.md, "Timeouts and leases"); and P=1 -> D=2.

The lease tests share one module-wide set-up: a prefill and a decode (TP=1 each, each server's
compute threads on a core of its own), both with ``--max-num-seqs 1`` (a second request queues
behind the first), over the tests' tiny random Llama, with the liveness settings shrunk below what
a request waits here (heartbeat 5 s, the connector's default; ``room_lease`` 15 s, its least;
``bootstrap_timeout`` 3 s), and our concurrent router and vLLM's standard sequential protocol over
them. :func:`busy` keeps one server's only sequence slot taken: the requests behind it wait in
vLLM's queue, on the prefill (the concurrent protocol: the decode's room waits) or on the decode
(the standard protocol: the prefill holds the KV). Each such request must still give the tokens of
vLLM alone, with the decode computing none of its prompt. The last test kills the prefill with
SIGKILL while a decode request waits on it.

``TestP1D2`` runs first, on servers of its own: a decode of TP=2 fed by a prefill of TP=1.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from tests.integration.harness import cluster, small_layout
from tests.vllm.test_disaggregated import (
    API_KEY,
    CONNECTOR,
    EXTERNAL,
    LOCAL,
    SERVERS,
    Proc,
    complete,
    counter_delta,
    free_port,
    held_report,
    live_rooms,
    make_model,
    metrics,
    post,
    prompts,
    router,
    serve,
    standard_router,
    stop,
    wait_healthy,
)
from tests.vllm.test_disaggregated import LIVENESS as SLOW_LIVENESS
from tests.vllm.test_transfer_book import BOOTSTRAP as BOOK_BOOTSTRAP
from tests.vllm.test_transfer_book import Req, decode_req, prefill_req
from transfer_engine.errors import FailureReason, TransferFailed
from transfer_engine.integrations.vllm.book import Transfer, TransferBook
from transfer_engine.observe.cli import fetch_snapshot
from transfer_engine.testing import patterns

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

HEARTBEAT = 5.0
"""The connector's default (``CONNECTOR_DEFAULTS``). It once had to be doubled here: while the
servers ran in sessions of their own, a worker busy-waiting in one kept the other's engine loop off
the CPU for 10-46 s (the autogroup starvation ``test_disaggregated.spawn`` avoids)."""
LEASE = 3 * HEARTBEAT
"""``room_lease`` at its least (three heartbeat intervals, ``protocol.leases.ROOM_LEASE_FLOOR``; the
engine's default is 30 s). At two intervals, the least before, a room's lease raced its peer's death
check: under CI a decode's rooms lapsed while their prefill, late by a stall, still lived."""
BOOTSTRAP = 3.0
LIVENESS = {"heartbeat_interval": HEARTBEAT, "room_lease": LEASE, "bootstrap_timeout": BOOTSTRAP}
HOLD_S = LEASE + 2 * HEARTBEAT
"""How long a server is kept busy while requests queue: past every window they could time out by."""
WAITED_S = LEASE + HEARTBEAT
"""What a queued request and its room must have waited, at least, to prove anything: past
``bootstrap_timeout`` and ``room_lease`` by a heartbeat (a room opens a moment after its request
was sent)."""
BLOCKERS = 10
KILL_MARGIN_S = 5.0
"""What a killed prefill's peer may take beyond two heartbeat intervals to free a waiting request's
blocks on this loaded 2-core box: the liveness check runs every quarter interval, then vLLM's
next step takes the failed load and frees the blocks, and ``/metrics`` and the dump are read in
turn (each read alone can take seconds here)."""


@dataclass
class Leased:
    prefill: Proc
    decode: Proc
    ours: Proc
    std: Proc
    bootstrap: int
    introspect: dict[str, list[int]]
    """Each side's engines (TP ranks) by introspection port."""
    tmp: Path


ENGINE_SHORT: dict[str, Any] = {"bootstrap_timeout": 1.0, "heartbeat_interval": 0.2, "room_lease": 0.6}
"""Engines alone (no vLLM): every window shrunk, as tests/integration/test_leases.py does."""


def test_the_book_announces_each_queued_decode_request_with_valid_params_only() -> None:
    """``on_new_request``: the decode announces a request it will ask a prefill for; a prefill, or
    a request without (or with foreign) params, announces nothing."""
    decode = TransferBook(is_prefill=False, block_size=32)
    decode.added(decode_req("r1"))
    decode.added(Req("r2", list(range(40))))
    decode.added(Req("r3", list(range(40)), {"do_remote_prefill": True, "remote_engine_id": "x"}))
    assert decode.take_meta().announce == [Transfer("r1", "t-r1", (), BOOK_BOOTSTRAP)]
    prefill = TransferBook(is_prefill=True, block_size=32)
    prefill.added(prefill_req("r1"))
    assert prefill.take_meta().announce == []


@pytest.mark.anyio
async def test_a_prefill_room_nobody_asked_for_lives_while_a_decode_announces_it() -> None:
    """Real engines: the prefill opened a room and sent its KV before any decode asked (the
    sequential protocol); a decode announces the room (its request queued) for five leases, then
    asks: every byte arrives. A room announced and then withdrawn ends at its lease."""
    async with cluster(small_layout(), 1, 1, **ENGINE_SHORT) as c:
        src, dst = np.arange(6), np.arange(10, 16)
        patterns.fill(c.prefill[0].pool, 41, src)
        sender = c.prefill[0].sender(41)
        await sender.send(src, last=True)
        await c.decode[0].announce(41, c.bootstrap)
        await anyio.sleep(5 * ENGINE_SHORT["room_lease"])
        assert not sender.status.final, sender.status
        receiver = await c.decode[0].receiver(41, c.bootstrap, dst)
        with anyio.fail_after(10):
            await receiver.wait()
            await sender.wait()
        tokens = patterns.received_tokens(len(src), c.prefill[0].pool.layout.page_size, len(dst), 4)
        assert patterns.mismatches(c.decode[0].pool, 41, dst, tokens) == 0
        patterns.fill(c.prefill[0].pool, 42, src)
        withdrawn = c.prefill[0].sender(42)
        await withdrawn.send(src, last=True)
        await c.decode[0].announce(42, c.bootstrap)
        c.decode[0].withdraw(42)
        with anyio.fail_after(10), pytest.raises(TransferFailed) as info:
            await withdrawn.wait()
        assert info.value.reason is FailureReason.BOOTSTRAP_TIMEOUT, info.value
        c.assert_no_leaks()  # "announced" among them


@contextlib.contextmanager
def serving_pair(
    name: str,
    tmp_path_factory: pytest.TempPathFactory,
    liveness: dict[str, float],
    prefill: tuple[tuple[str, ...], dict[str, str] | None],
    decode: tuple[tuple[str, ...], dict[str, str] | None],
    decode_ranks: int = 1,
) -> Iterator[Leased]:
    """A prefill and a decode server with our connector (``liveness`` in its extra config; each
    side's extra vLLM arguments and environment), both routers over them, the first forward of each
    taken; stopped on leaving. The decode's TP rank r serves introspection on its port + r."""
    tmp = tmp_path_factory.mktemp(name)
    model = tmp / "model"
    make_model(model)
    bootstrap, i_p, i_d = free_port(), free_port(), free_port()

    def kv(role: str, **extra: object) -> str:
        return json.dumps({**CONNECTOR, "kv_role": role, "kv_connector_extra_config": {**liveness, **extra}})

    (p_args, p_env), (d_args, d_env) = prefill, decode
    p = serve(
        "prefill", tmp, model, free_port(), *p_args,
        "--kv-transfer-config", kv("kv_producer", bootstrap_port=bootstrap, introspect_port=i_p), env=p_env,
    )  # fmt: skip
    d = serve(
        "decode", tmp, model, free_port(), *d_args,
        "--kv-transfer-config", kv("kv_consumer", introspect_port=i_d), env=d_env,
    )  # fmt: skip
    ours = router("ours", tmp, free_port(), p.port, bootstrap, d.port)
    std = standard_router("std", tmp, free_port(), [p.port], d.port)
    procs = [p, d, ours, std]
    SERVERS[:] = procs
    try:
        wait_healthy([p, d])
        wait_healthy([ours, std], "/healthz")
        for server in (p, d):  # the first forward of an instance is slow
            complete(server.port, [1, 2, 3], 1)
        introspect = {"prefill": [i_p], "decode": [i_d + r for r in range(decode_ranks)]}
        yield Leased(p, d, ours, std, bootstrap, introspect, tmp)
    finally:
        stop(procs)


@pytest.fixture(scope="module")
def leased(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Leased]:
    with serving_pair(
        "vllm-leases", tmp_path_factory, LIVENESS,
        prefill=(("--max-num-seqs", "1"), {"VLLM_CPU_OMP_THREADS_BIND": "0"}),
        decode=(("--max-num-seqs", "1"), {"VLLM_CPU_OMP_THREADS_BIND": "1"}),
    ) as pair:  # fmt: skip
        yield pair


def assert_nothing_held(
    s: Leased, sides: tuple[str, ...] = ("prefill", "decode"), within: float = 60
) -> None:
    """No blocks held by vLLM and no live room in the engine on each of ``sides``."""
    deadline = time.monotonic() + within
    while True:
        usage = {side: metrics(getattr(s, side).port)["vllm:kv_cache_usage_perc"] for side in sides}
        rooms = {port: live_rooms(port) for side in sides for port in s.introspect[side]}
        if not any(usage.values()) and not any(rooms.values()):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"still held after {within} s: KV cache usage {usage}\n{held_report(rooms)}")
        time.sleep(0.2)


@contextlib.contextmanager
def busy(server: Proc) -> Iterator[None]:
    """Keep ``server``'s one sequence slot busy while the block runs: :data:`BLOCKERS` generations
    of 2,000 tokens sent straight to it (queued one behind the other), abandoned when the block
    ends (their connections closed: vLLM aborts them, running or queued)."""
    body = json.dumps({"model": "m", "prompt": [1], "max_tokens": 2000, "ignore_eos": True}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with contextlib.ExitStack() as stack:
        for _ in range(BLOCKERS):
            sock = stack.enter_context(socket.create_connection(("127.0.0.1", server.port), timeout=60))
            sock.sendall(head + body)
        deadline = time.monotonic() + 60
        while metrics(server.port)["vllm:num_requests_running"] < 1:
            assert time.monotonic() < deadline, f"{server.name}: the blockers did not start"
            time.sleep(0.1)
        yield


def successes(ports: list[int]) -> list[int]:
    """Rooms that succeeded so far in each engine serving introspection on ``ports``."""
    counted = [fetch_snapshot(f"tcp://127.0.0.1:{port}", timeout=60).counters for port in ports]
    return [c.rooms_by_outcome.get("SUCCESS", 0) for c in counted]


def wait_for_room(port: int, within: float = 60) -> None:
    """Until the engine serving introspection on ``port`` has a live room."""
    deadline = time.monotonic() + within
    while not live_rooms(port):
        assert time.monotonic() < deadline, f"no room opened on :{port} within {within} s"
        time.sleep(0.2)


class OldestRoom:
    """Samples the live rooms of an engine in the background: the oldest age seen."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.age = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                self.age = max([self.age, *(r.age_s for r in live_rooms(self.port))])
            self._stop.wait(1.0)

    def __enter__(self) -> OldestRoom:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def timed(fn: Callable[..., list[int]], *args: Any, **fields: Any) -> tuple[list[int], float]:
    started = time.monotonic()
    tokens = fn(*args, **fields)
    return tokens, time.monotonic() - started


@pytest.fixture(scope="class")
def d2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Leased]:
    with serving_pair(
        "vllm-d2", tmp_path_factory, SLOW_LIVENESS,
        prefill=(("--max-num-batched-tokens", "512"), None),  # prompts over 512 tokens: in chunks
        decode=(("--tensor-parallel-size", "2"), {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}),
        decode_ranks=2,
    ) as pair:  # fmt: skip
        yield pair


class TestP1D2:
    """P=1 -> D=2: a prefill of TP=1 and a decode of TP=2 (two KV-head halves, one per rank), with
    servers of their own, stopped before the lease tests start theirs (the 2-core box runs no more
    vLLM workers at once in time). Liveness is not what these tests are about: heartbeats and
    windows as long as ``test_disaggregated``'s."""

    @pytest.mark.parametrize("which", ["std", "ours"])
    def test_tokens_match_vllm_alone_and_the_decode_computes_no_prompt(self, d2: Leased, which: str) -> None:
        """A decode of TP=2 (two KV-head halves, one per rank) fed by a prefill of TP=1, through vLLM's
        standard protocol and our router: prompts of 37 to 1,100 tokens give the tokens of vLLM alone,
        and vLLM's counters show the decode took every prompt token from the transfer."""
        batch = prompts(60 + len(which), (37, 333, 1100))
        reference = [complete(d2.prefill.port, p, 12) for p in batch]
        before = metrics(d2.decode.port)
        succeeded = successes(d2.introspect["decode"])
        assert [complete(getattr(d2, which).port, p, 12) for p in batch] == reference
        assert counter_delta(d2.decode.port, before, LOCAL) == 0
        assert counter_delta(d2.decode.port, before, EXTERNAL) == sum(map(len, batch))
        expected = [n + len(batch) for n in succeeded]  # every request's room, on both ranks
        deadline = time.monotonic() + 20  # a room is counted once it closed, just after it succeeded
        while successes(d2.introspect["decode"]) != expected and time.monotonic() < deadline:
            time.sleep(0.2)
        assert successes(d2.introspect["decode"]) == expected
        assert_nothing_held(d2)


def queued_past_every_window(
    leased: Leased, router: Proc, busy_side: str, batch: list[list[int]]
) -> dict[str, float]:
    """Send ``batch`` through ``router`` while the ``busy_side`` server is kept busy for
    :data:`HOLD_S`: every request gives the tokens of vLLM alone, waited past :data:`WAITED_S`, and
    the other side's oldest room (the one that waits) lived past it too. The decode's metrics from
    before, for the caller's counter checks."""
    watched = "decode" if busy_side == "prefill" else "prefill"
    reference = [complete(leased.prefill.port, p, 8) for p in batch]
    before = metrics(leased.decode.port)
    with ThreadPoolExecutor(4) as pool, OldestRoom(leased.introspect[watched][0]) as oldest:
        with busy(getattr(leased, busy_side)):
            routed = [pool.submit(timed, complete, router.port, p, 8) for p in batch]
            time.sleep(HOLD_S)
        results = [f.result() for f in routed]
    assert [tokens for tokens, _ in results] == reference
    waited = min(seconds for _, seconds in results)
    assert waited > WAITED_S, f"the requests waited only {waited:.1f} s: no queue to prove anything"
    assert oldest.age > WAITED_S, f"the {watched}'s oldest room was {oldest.age:.1f} s old"
    return before


def test_our_router_a_prefill_queue_longer_than_every_window_completes(leased: Leased) -> None:
    """The prefill is busy for ~25 s: the decode's room waits on it far past ``bootstrap_timeout``
    and ``room_lease``, renewed by the prefill's heartbeats (its stashed request) while it waits;
    the next requests queue on the decode too, announced to the prefill, which holds their KV."""
    batch = prompts(61, (40, 333, 700))
    before = queued_past_every_window(leased, leased.ours, "prefill", batch)
    assert counter_delta(leased.decode.port, before, LOCAL) == 0
    assert counter_delta(leased.decode.port, before, EXTERNAL) == sum(map(len, batch))
    assert_nothing_held(leased)


def test_standard_protocol_the_prefill_holds_the_kv_while_the_decode_request_queues(leased: Leased) -> None:
    """vLLM's sequential protocol with the decode busy for ~25 s: each prefill finished at once and
    holds the KV (its room opened) while the decode's request waits in vLLM's queue, far past
    ``room_lease``: the decode announces the queued request's room, its heartbeats renew the lease."""
    batch = prompts(62, (50, 400, 900))
    before = queued_past_every_window(leased, leased.std, "decode", batch)
    assert counter_delta(leased.decode.port, before, LOCAL) <= BLOCKERS  # their one-token prompts
    assert counter_delta(leased.decode.port, before, EXTERNAL) == sum(map(len, batch))
    assert_nothing_held(leased)


def test_standard_protocol_kv_nobody_asks_for_is_freed_when_its_lease_ends(leased: Leased) -> None:
    """The router went away between the two legs: the prefill answered and holds the KV, no decode
    ever asks or announces it; the blocks are freed once ``room_lease`` passed."""
    prompt = prompts(63, (300,))[0]
    before = metrics(leased.prefill.port)
    answer = post(
        leased.prefill.port,
        {"model": "m", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    answered = time.monotonic()
    assert answer["kv_transfer_params"]["do_remote_prefill"] is True
    held = live_rooms(leased.introspect["prefill"][0])
    assert len(held) == 1, held  # holding the KV for a decode that may come
    assert_nothing_held(leased, within=LEASE + 2 * HEARTBEAT + KILL_MARGIN_S)
    freed = time.monotonic() - answered
    assert freed >= LEASE - 0.5, f"freed after {freed:.1f} s, before its lease ended"
    timeouts = counter_delta(leased.prefill.port, before, "vllm:te_kv_failures_total[timeout]", 1)
    assert timeouts == 1
    assert complete(leased.std.port, prompt, 6) == complete(leased.prefill.port, prompt, 6)
    assert_nothing_held(leased)


def test_our_router_killed_mid_request_frees_both_sides(leased: Leased) -> None:
    """A router killed (SIGKILL) while its request waits on a busy prefill: both servers see their
    connections close and abort the request; nothing stays held."""
    doomed = router(
        "doomed", leased.tmp, free_port(), leased.prefill.port, leased.bootstrap, leased.decode.port
    )
    try:
        wait_healthy([doomed], "/healthz")
        prompt = prompts(64, (500,))[0]
        with ThreadPoolExecutor(1) as pool, busy(leased.prefill):
            body = {"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0}
            pool.submit(send_raw, doomed.port, body)
            wait_for_room(leased.introspect["decode"][0])  # the decode's room waits on the prefill
            os.killpg(doomed.popen.pid, signal.SIGKILL)
            doomed.popen.wait(10)
            assert_nothing_held(leased, ("decode",), within=30)  # while the prefill is still busy
    finally:
        stop([doomed])
    assert_nothing_held(leased)


def send_raw(port: int, body: dict[str, Any]) -> int:
    """POST ``body``; the HTTP status, or 0 when the connection broke (a server killed)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    headers = {"content-type": "application/json", "authorization": f"Bearer {API_KEY}"}
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        response = conn.getresponse()
        response.read()
        return response.status
    except (OSError, http.client.HTTPException):
        return 0
    finally:
        conn.close()


def test_a_killed_prefill_frees_the_waiting_decode_s_blocks_within_two_heartbeats(leased: Leased) -> None:
    """Last (it kills the prefill). A decode request waits on the busy prefill (both legs sent as
    our router sends them); SIGKILL to the prefill: the decode declares it dead after two silent
    heartbeat intervals, the waiting room fails, vLLM frees its blocks, and the decode serves the
    next request."""
    prompt, after = prompts(65, (600, 120))
    expected = complete(leased.prefill.port, after, 8)
    params = {"transfer_id": "waits-on-a-killed-prefill"}
    decode_leg = {"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                  "kv_transfer_params": {**params, "do_remote_prefill": True,
                                         "bootstrap": f"tcp://127.0.0.1:{leased.bootstrap}"}}  # fmt: skip
    prefill_leg = {"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0,
                   "kv_transfer_params": {**params, "do_remote_decode": True}}  # fmt: skip
    with ThreadPoolExecutor(2) as pool, busy(leased.prefill):
        decoded = pool.submit(send_raw, leased.decode.port, decode_leg)
        pool.submit(send_raw, leased.prefill.port, prefill_leg)
        wait_for_room(leased.introspect["decode"][0])
        time.sleep(HEARTBEAT)  # a heartbeat of the prefill renewed the room before the kill
        assert live_rooms(leased.introspect["decode"][0]), "the decode's room ended while its prefill lived"
        os.killpg(leased.prefill.popen.pid, signal.SIGKILL)
        killed = time.monotonic()
        assert_nothing_held(leased, ("decode",), within=30)
        freed = time.monotonic() - killed
        assert decoded.result() == 500  # kv_load_failure_policy=fail, vLLM's default
    leased.prefill.popen.wait(30)
    print(f"the decode freed the killed prefill's request in {freed:.2f} s")
    assert freed <= 2 * HEARTBEAT + KILL_MARGIN_S, f"freed {freed:.2f} s after the kill"
    assert complete(leased.decode.port, after, 8) == expected  # computed on the decode alone
    assert_nothing_held(leased, ("decode",))
