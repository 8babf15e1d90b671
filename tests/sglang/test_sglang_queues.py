"""Conformance under SGLang 0.5.23's own scheduler queues (tests/sglang/queues.py).

One process per TP rank on each side, each running SGLang's ``PrefillBootstrapQueue`` and its
inflight processing, or its ``DecodePreallocQueue`` and ``DecodeTransferQueue``, over SGLang's real
CPU pools and ``Req`` objects, with ``ServerArgs`` parsed from a command line with SGLang's defaults;
the bootstrap registry runs here, as beside SGLang's HTTP server. Requests arrive in waves: each
wave gets the pages the last one freed, and every byte of every request is checked on every decode
rank. Prefills are sent whole or chunked (several sends per room, one per scheduler step); decode
pages may be larger than the prefill's. A decode abort, a prefill abort mid-chunking, and a prefill
process killed mid-room, go through SGLang's deferred release (``failure_exception``,
``ensure_abort_notified``, ``bootstrap_infos``, ``is_abort_release_safe``) before the pages come back. Nothing leaks: every page, request row and metadata slot is free at
the end, and the engines hold nothing.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from typing import Any

import pytest

from tests.sglang.queues import DECODE_POOL_TOKENS, PAGE, POOL_TOKENS, Plan, run, write_model
from transfer_engine.integrations.sglang import KVBootstrapServer
from transfer_engine.testing.cluster import free_port

pytestmark = pytest.mark.timeout(240)


def _context() -> Any:
    """Rank processes forked from one server process that imported SGLang once (a spawned process spends
    seconds of CPU importing it again); the server is started clean, so nothing of this process's
    threads or engines is inherited."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.sglang.queues"])
    return ctx


WAVES = [[(11, 10), (12, 9)], [(13, 17)], [(14, 8)]]
"""(room, prompt tokens); the second wave reuses the first's pages, the third the second's."""


def _run_sides(
    tmp_path: Any,
    prefill_tp: int,
    decode_tp: int,
    mla: bool,
    decode_aborts: list[int],
    waves: list[list[tuple[int, int]]] = WAVES,
    prefill_dies_in: int = 0,
    prefill_aborts: tuple[int, ...] = (),
    chunk_tokens: int = 0,
    decode_page: int = PAGE,
    prefix_of: dict[int, int] | None = None,
) -> list[Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is a local config.json; nothing to fetch
    model = write_model(str(tmp_path / "model"), mla)
    port = free_port()
    server = KVBootstrapServer("127.0.0.1", port)
    ctx = _context()
    results = ctx.Queue()
    procs = []
    try:
        for role, tp, aborts in (
            ("prefill", prefill_tp, list(prefill_aborts)),
            ("decode", decode_tp, decode_aborts),
        ):
            group_port = free_port()
            for rank in range(tp):
                plan = Plan(role, tp, rank, group_port, port, mla, model, waves, aborts, timeout_s=90)
                plan.prefix_of = prefix_of or {}
                if role == "prefill":
                    plan.die_in_room, plan.chunk_tokens = prefill_dies_in, chunk_tokens
                else:
                    plan.page_size = decode_page
                proc = ctx.Process(target=run, args=(plan, results), name=f"{role}-{rank}")
                proc.start()
                procs.append((plan, proc))
        reports = []
        for _ in range(len(procs) - (prefill_tp if prefill_dies_in else 0)):
            status, rank, report = results.get(timeout=200)
            assert status == "ok", report
            reports.append(report)
        for plan, proc in procs:
            proc.join(30)
            killed = plan.role == "prefill" and prefill_dies_in
            assert proc.exitcode == (-signal.SIGKILL if killed else 0), (
                f"{proc.name} exited with {proc.exitcode}"
            )
        return [r for r in reports]
    finally:
        for _, proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        server.close()


def _check(
    reports: list[Any],
    decode_tp: int,
    prefill_tp: int,
    aborted: list[int],
    prefill_aborted: tuple[int, ...] = (),
) -> None:
    rooms = [room for wave in WAVES for room, _ in wave]
    aborted = [*aborted, *prefill_aborted]
    decodes = [r for r in reports if r["pool_tokens"] == DECODE_POOL_TOKENS]
    prefills = [r for r in reports if r["pool_tokens"] == POOL_TOKENS]
    assert len(decodes) == decode_tp and len(prefills) == prefill_tp
    for r in decodes:
        for room in rooms:
            expected = "FINISH_ABORT" if room in aborted else "received"
            assert r["done"][room] == expected, (room, r["done"])
        # an aborted room's pages were held by SGLang's deferred release until the backend said safe
        assert r["deferred"] == (1 if aborted else 0), r
        tokens = sum(t for wave in WAVES for room, t in wave if room not in aborted)
        assert r["bytes_checked"] > 0 and r["bytes_checked"] % tokens == 0, r["bytes_checked"]
    for r in prefills:
        for room in rooms:
            if room not in aborted:
                assert r["done"][room] == "FINISH_LENGTH", (room, r["done"])
            elif room in prefill_aborted:  # aborted before its last chunk went out: never Success
                assert r["done"][room] == "FINISH_ABORT", (room, r["done"])
            else:
                # the decode aborts as soon as the room is in its transfer queue: the prefill's room
                # fails (ABORT) unless its WRITEs were all done and acknowledged by then (Success)
                assert r["done"][room] in ("FINISH_ABORT", "FINISH_LENGTH"), (room, r["done"])
    for r in reports:
        # pages reused at once: each later wave got pages an earlier wave had (SGLang's own allocator)
        first = {p for room, _ in WAVES[0] for p in r["pages"].get(room, [])}
        later = {p for wave in WAVES[1:] for room, _ in wave for p in r["pages"].get(room, [])}
        assert first & later, r["pages"]
        # nothing leaked: every page, row and metadata slot back, no engine state left
        assert r["free_tokens"] == r["pool_tokens"], r
        assert r["free_rows"] == 16 + (16 if r in decodes else 0), r
        assert r["free_metadata"] == 8, r
        assert not r["leaks"], r["leaks"]


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "mla", "aborted"),
    [(1, 1, False, [13]), (2, 1, False, []), (1, 2, True, [])],
    ids=["P1-D1-abort", "P2-D1", "P1-D2-mla"],
)
def test_sglang_queues_move_every_byte(
    tmp_path: Any, prefill_tp: int, decode_tp: int, mla: bool, aborted: list[int]
) -> None:
    reports = _run_sides(tmp_path, prefill_tp, decode_tp, mla, aborted)
    _check(reports, decode_tp, prefill_tp, aborted)


def test_a_killed_prefill_fails_the_room_and_its_pages_come_back(tmp_path: Any, monkeypatch: Any) -> None:
    """The prefill process is killed (SIGKILL) once the second wave's room is bootstrapped: the decode's
    pages for it (the first wave's, reused at once) are held by SGLang's deferred release until the
    backend's room ended (the peer declared dead from its missing heartbeats), then all come back."""
    monkeypatch.setenv("TE_HEARTBEAT_INTERVAL", "0.2")  # the rank processes read it (EngineConfig.from_env)
    waves = [[(21, 10), (22, 9)], [(23, 17)]]
    reports = _run_sides(tmp_path, 1, 1, False, [], waves=waves, prefill_dies_in=23)
    (decode,) = reports
    assert decode["done"] == {21: "received", 22: "received", 23: "FINISH_ABORT"}, decode["done"]
    assert decode["deferred"] == 1, decode
    assert set(decode["pages"][23]) & {p for room in (21, 22) for p in decode["pages"][room]}, decode["pages"]
    assert decode["bytes_checked"] > 0
    assert decode["free_tokens"] == decode["pool_tokens"] and decode["free_rows"] == 32, decode
    assert decode["free_metadata"] == 8 and not decode["leaks"], decode


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "decode_page", "prefill_aborted"),
    [(2, 2, PAGE, (13,)), (1, 1, 2 * PAGE, ()), (2, 1, 2 * PAGE, (13,))],
    ids=["P2-D2-abort", "P1-D1-decode-pages-8", "P2-D1-decode-pages-8-abort"],
)
def test_chunked_prefill_moves_every_byte(
    tmp_path: Any, prefill_tp: int, decode_tp: int, decode_page: int, prefill_aborted: tuple[int, ...]
) -> None:
    """Chunked prefill, 6 tokens a step: every room goes out in 2 or 3 sends, each middle one cut to
    whole prefill pages by SGLang (its partial page rides with the next send). Decode pages of 8
    tokens take prefill pages of 4 (the staged path). Room 13, aborted by the prefill after its first
    chunk, ends FINISH_ABORT on every rank of both sides; its prefill pages are freed at once."""
    reports = _run_sides(
        tmp_path, prefill_tp, decode_tp, False, [], prefill_aborts=prefill_aborted, chunk_tokens=6,
        decode_page=decode_page,
    )  # fmt: skip
    _check(reports, decode_tp, prefill_tp, [], prefill_aborted)
    for r in reports:
        if (
            r["pool_tokens"] == POOL_TOKENS
        ):  # a middle send ends on a whole page; the last at the prompt's end
            assert r["sent"][11] == [4, 10] and r["sent"][14] == [4, 8], r["sent"]
            assert r["sent"][13] == ([4] if 13 in prefill_aborted else [4, 12, 17]), r["sent"]


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (2, 1)], ids=["P1-D1", "P2-D1"])
def test_a_prefix_in_sglangs_decode_radix_cache_is_not_sent(
    tmp_path: Any, prefill_tp: int, decode_tp: int
) -> None:
    """The decode runs SGLang's radix cache: room 31's KV stays in it once received, room 32 (its
    prompt extends 31's) and room 33 (a prefix of 32's) find their cached pages there, SGLang sends
    the cached length as ``decode_prefix_len``, the prefill skips those tokens and sends the rest,
    and the decode holds every byte of the whole prompt (the prefix from its cache)."""
    waves = [[(31, 10)], [(32, 17)], [(33, 14)]]
    reports = _run_sides(tmp_path, prefill_tp, decode_tp, False, [], waves=waves, prefix_of={32: 31, 33: 32})
    decodes = [r for r in reports if r["pool_tokens"] == DECODE_POOL_TOKENS]
    prefills = [r for r in reports if r["pool_tokens"] == POOL_TOKENS]
    for r in decodes:
        assert r["done"] == {31: "received", 32: "received", 33: "received"}, r["done"]
        assert r["bytes_checked"] > 0
        assert set(r["pages"][31]) & set(r["pages"][32]), r["pages"]  # the prefix's pages, shared
        assert r["free_tokens"] == r["pool_tokens"] and r["free_rows"] == 32, r
        assert r["free_metadata"] == 8 and not r["leaks"], r
    for r in prefills:
        assert r["done"] == {31: "FINISH_LENGTH", 32: "FINISH_LENGTH", 33: "FINISH_LENGTH"}, r["done"]
        assert r["prefix"] == {31: 0, 32: 8, 33: 12}, r["prefix"]
        assert r["free_tokens"] == r["pool_tokens"] and not r["leaks"], r
