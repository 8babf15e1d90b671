"""SIGKILL a rank process in the middle of live rooms: the survivor fails them with PEER_DEAD, in time.

Each engine runs in its own process (``tests/chaos/rank.py``: real NIXL, real ZMQ), driven over
stdin/stdout with JSON lines. Rooms are held live on purpose (the prefill sends every chunk but the
last, or, for a layer-wise room, stops between two layers of the last), so the kill always lands
mid-transfer.

Bound: a peer silent for 2 heartbeat intervals is dead and leases are checked every quarter
interval, so a room fails within 2.25 intervals of the peer's last heartbeat, which precedes the
kill, plus scheduling slack (see ``rank_process.BOUND``).
"""

from __future__ import annotations

import time

import pytest

from tests.chaos.rank_process import expect_peer_dead, open_rooms, rank_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


def test_killed_decode_fails_its_rooms_and_a_new_decode_is_served() -> None:
    with rank_processes() as ranks:
        prefill, decode = ranks.start("prefill"), ranks.start("decode")
        open_rooms(prefill, decode, {1: 0, 2: 4}, hold=False)
        for room in (1, 2):
            assert prefill.expect("room", room=room)["ok"] and decode.expect("room", room=room)["ok"]
        open_rooms(prefill, decode, {3: 8, 4: 12}, hold=True)
        open_rooms(prefill, decode, {5: 16}, hold=True, layers=True)  # held between two layers
        time.sleep(0.2)  # the first chunks are written: the rooms are mid-transfer
        killed_at = decode.kill()
        expect_peer_dead(prefill, (3, 4, 5), killed_at)
        # A fresh decode process registers and is served, every byte verified.
        fresh = ranks.start("decode")
        open_rooms(prefill, fresh, {3: 20, 6: 24}, hold=False)
        open_rooms(prefill, fresh, {9: 28}, hold=False, layers=True)
        for room in (3, 6, 9):
            assert prefill.expect("room", room=room)["ok"]
            result = fresh.expect("room", room=room)
            assert result["ok"], result
        assert all(v == 0 for v in fresh.quit().values())
        assert all(v == 0 for v in prefill.quit().values())


def test_killed_prefill_fails_the_decode_rooms_instead_of_hanging() -> None:
    with rank_processes() as ranks:
        prefill, decode = ranks.start("prefill"), ranks.start("decode")
        open_rooms(prefill, decode, {7: 0}, hold=True)
        open_rooms(prefill, decode, {8: 4}, hold=True, layers=True)  # held between two layers
        time.sleep(0.2)
        killed_at = prefill.kill()
        expect_peer_dead(decode, (7, 8), killed_at)
        assert all(v == 0 for v in decode.quit().values())
