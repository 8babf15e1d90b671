"""Pages freed on the TP group's Failed are safe on every rank (SGLang's deferred release).

P=2 -> D=2, equal TP: prefill rank r writes decode rank r only. Decode rank 0 fails its room (a
rank-local failure: it aborts) while prefill rank 1's WRITEs into decode rank 1 are in flight:
rank 1 is ahead, its scheduler sending a chunk per step, and nothing holds any of it back. The group's MIN says
Failed as soon as rank 0's room ended. The decode ranks then do what SGLang 0.5.23's
``DecodeTransferQueue.pop_transferred`` and ``resolve_deferred_releases`` do with a backend that
supports deferred release: ``failure_exception()``, ``ensure_abort_notified(force_arm=True)``,
hold the pages on every rank when any holds (MAX), and free them once
``kv_mgr.is_abort_release_safe`` is true on every rank (MIN). The moment they are freed, the next
request's forward writes its own KV into exactly those pages; after every rank's room has ended
those bytes are checked, then the next transfer lands in the same pages and every byte is checked.

The test asserts, in at least one round, that prefill rank 1's engine had WRITEs posted and not
completed (its own ``writes_in_flight`` counter, read the moment decode rank 0 failed) while decode
rank 1's room was still live; that the count was 0 when the group said Failed (the moment SGLang
frees the pages); and that the pages stayed held until every rank's room had ended. The WRITEs are large (2 MiB chunks of a 16 MiB room per rank) so that they are still on the
wire then; nothing holds them back. It cannot show a late WRITE landing: on this CPU loopback the WRITEs that were in flight
then finished before the forward's writes in a variant that freed at once (docs/sglang.md).
Budget: about 20 s.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from sglang.srt.disaggregation.base.conn import KVPoll

from tests.sglang.rank_memory import Memory, manager
from transfer_engine import KVLayout, RoomStatus, TransferFailed
from transfer_engine.integrations.sglang import KVBootstrapServer, KVManager, KVReceiver, KVSender
from transfer_engine.testing import patterns
from transfer_engine.testing.cluster import free_port

pytestmark = pytest.mark.timeout(120)

LAYOUT = KVLayout(num_layers=8, num_heads=4, head_dim=128, dtype=torch.bfloat16, page_size=16)
"""128 KiB per page on each decode rank; a room of 128 pages (16 MiB) in chunks of 16 pages (2 MiB)."""
ROOM_PAGES = 128
CHUNK_PAGES = 16
STEP_S = 0.0
"""Between rank 1's chunks: none, its chunked prefill steps back to back (a short forward per chunk)."""
ROUNDS = 2
ENDED = (RoomStatus.SUCCESS, RoomStatus.FAILED)


def _until(what: str, check: object, limit_s: float = 20.0) -> None:
    deadline = time.monotonic() + limit_s
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.0005)


class DecodeGroup:
    """Two decode ranks stepped in lockstep; their free lists hand freed pages out first."""

    def __init__(self, mgrs: list[KVManager]) -> None:
        self.mgrs = mgrs
        self.free = [list(range(m.pool.num_pages)) for m in mgrs]

    def take(self, n: int) -> list[np.ndarray]:
        return [np.array([free.pop() for _ in range(n)], dtype=np.int64) for free in self.free]

    def give(self, pages: list[np.ndarray]) -> None:
        for free, p in zip(self.free, pages, strict=True):
            free.extend(p.tolist())


def _open(pmgrs: list[KVManager], group: DecodeGroup, port: int, room: int, aux: int):
    senders = [KVSender(m, f"127.0.0.1:{port}", room) for m in pmgrs]
    receivers = [KVReceiver(m, f"127.0.0.1:{port}", room) for m in group.mgrs]
    for r in receivers:
        r.init(0)
    _until("the decode handshake", lambda: min(r.poll() for r in receivers) == KVPoll.WaitingForInput)
    pages = group.take(ROOM_PAGES)
    for r, p in zip(receivers, pages, strict=True):
        r.send_metadata(p.astype(np.int32), aux, None, 0)
    _until("the prefill's requests", lambda: min(s.poll() for s in senders) == KVPoll.WaitingForInput)
    src = np.arange(ROOM_PAGES, dtype=np.int64)
    for s, m in zip(senders, pmgrs, strict=True):
        patterns.fill(m.pool, room, src)
        s.init(ROOM_PAGES, aux)
    return senders, receivers, pages, src


def _forward(pool: object, pages: np.ndarray, value: int) -> None:
    """What the next request's forward does to pages it was given: writes its KV into them, fast."""
    slots = torch.from_numpy(pages[:, None] * LAYOUT.page_size + np.arange(LAYOUT.page_size)).flatten()
    for tensor in pool.kv_views:  # type: ignore[attr-defined]
        tensor[slots] = value


def _forward_intact(pool: object, pages: np.ndarray, value: int) -> bool:
    slots = torch.from_numpy(pages[:, None] * LAYOUT.page_size + np.arange(LAYOUT.page_size)).flatten()
    return all(bool((tensor[slots] == value).all()) for tensor in pool.kv_views)  # type: ignore[attr-defined]


def _send_all(
    sender: KVSender, src: np.ndarray, step_s: float = 0.0, started: threading.Event | None = None
) -> None:
    for start in range(0, ROOM_PAGES, CHUNK_PAGES):
        sender.send(src[start : start + CHUNK_PAGES].astype(np.int32))
        if started is not None and start >= 2 * CHUNK_PAGES:
            started.set()
        time.sleep(step_s)


def test_pages_freed_on_the_groups_failed_are_not_written_by_another_ranks_late_writes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # UCX over TCP, as on a cluster without RDMA: a chunk's WRITE takes milliseconds on loopback,
    # longer than an abort's round trip, so WRITEs are still in flight when rank 0's room has ended.
    monkeypatch.setenv("UCX_TLS", "tcp")
    port = free_port()
    server = KVBootstrapServer("127.0.0.1", port)
    mgrs: list[KVManager] = []
    try:
        pmem = [Memory.allocate(LAYOUT, 2, 2 * ROOM_PAGES, 8) for _ in range(2)]
        dmem = [Memory.allocate(LAYOUT, 2, 2 * ROOM_PAGES, 8) for _ in range(2)]
        pmgrs = [manager("prefill", LAYOUT, 2, r, pmem[r], port) for r in range(2)]
        dmgrs = [manager("decode", LAYOUT, 2, r, dmem[r], port) for r in range(2)]
        mgrs = pmgrs + dmgrs
        group = DecodeGroup(dmgrs)
        raced = 0
        posted_at_failure: list[int] = []
        for n in range(ROUNDS):
            room = 1000 + n
            senders, receivers, pages, src = _open(pmgrs, group, port, room, aux=n % 8)
            # prefill rank 1 is ahead: its scheduler sends a chunk per step; rank 0 has not sent yet
            started = threading.Event()
            rank1 = threading.Thread(target=_send_all, args=(senders[1], src, STEP_S, started))
            rank1.start()
            assert started.wait(30)
            receivers[0].abort()  # decode rank 0 fails (a rank-local failure) mid-transfer
            # the failure moment: prefill rank 1's own count of WRITEs posted and not completed, and
            # whether decode rank 1's room is still receiving
            posted = pmgrs[1].engine.leaks()["writes_in_flight"]
            live = receivers[1].poll() not in ENDED
            posted_at_failure.append(posted)
            raced += bool(posted) and live
            _until("the group's Failed", lambda rs=receivers: min(r.poll() for r in rs) == KVPoll.Failed)
            # SGLang would free the pages now: by then every prefill rank's WRITEs of the room are done
            assert pmgrs[1].engine.leaks()["writes_in_flight"] == 0, "a WRITE in flight at the group's Failed"
            # SGLang's DecodeTransferQueue.pop_transferred on every rank, for a failed poll:
            holds = []
            for r in receivers:
                with pytest.raises(TransferFailed):
                    r.failure_exception()
                if not r.abort_notified:
                    r.ensure_abort_notified(force_arm=True)
                holds.append(r.abort_notified)
            assert max(holds), "no rank held the pages of a failed room"
            rank1.join(30)
            _send_all(senders[0], src)  # prefill rank 0 catches up: no-ops on a failed room
            # resolve_deferred_releases, each step: release once MIN over the ranks is ready
            waited = 0
            while not min(
                m.is_abort_release_safe(room, len(r.bootstrap_infos))
                for m, r in zip(dmgrs, receivers, strict=True)
            ):
                assert receivers[1].poll() not in ENDED or (receivers[0].poll() not in ENDED), (
                    "held although every rank's room ended"
                )
                waited += 1
                time.sleep(0.0005)
            for m, r in zip(dmgrs, receivers, strict=True):
                assert r.ended()
                m.clear_deferred_abort_state(room)
                r.clear()
            group.give(pages)
            # the next request's forward writes its KV into those pages at once
            reused = group.take(ROOM_PAGES)
            assert [set(p.tolist()) for p in reused] == [set(p.tolist()) for p in pages]
            for m, p in zip(dmgrs, reused, strict=True):
                _forward(m.pool, p, 0x5A + n)
            _until("every prefill room's end", lambda ss=senders: all(s.poll() in ENDED for s in ss))
            for rank, (m, p) in enumerate(zip(dmgrs, reused, strict=True)):
                assert _forward_intact(m.pool, p, 0x5A + n), f"round {n}: a late WRITE hit rank {rank}"
            group.give(reused)
            # the next transfer lands in the same pages; every byte checked
            room = 2000 + n
            senders, receivers, pages2, src = _open(pmgrs, group, port, room, aux=n % 8)
            assert [set(p.tolist()) for p in pages2] == [set(p.tolist()) for p in pages]
            for s in senders:
                _send_all(s, src)
            _until(
                "the next room's Success", lambda rs=receivers: min(r.poll() for r in rs) == KVPoll.Success
            )
            _until("the prefill's Success", lambda ss=senders: min(s.poll() for s in ss) == KVPoll.Success)
            for m, p in zip(dmgrs, pages2, strict=True):
                assert patterns.mismatches(m.pool, room, p, ROOM_PAGES * LAYOUT.page_size) == 0
            group.give(pages2)
        assert raced >= 1, (
            f"prefill rank 1 had no WRITE in flight to a live room when decode rank 0 failed "
            f"(its writes_in_flight then, per round: {posted_at_failure})"
        )
        for m in mgrs:
            assert not any(m.engine.leaks().values()), m.engine.leaks()
    finally:
        for m in reversed(mgrs):
            m.close()
        server.close()
