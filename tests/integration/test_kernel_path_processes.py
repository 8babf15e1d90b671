"""The kernel path between two real processes of this host (issue 40 item 2): the decode's pool in
shared memory, mapped by the prefill through ``/dev/shm`` (``tests/integration/kernel_rank.py``), the
copy bit-exact, the notification over the control channel, and a killed peer: the survivor's rooms fail
PEER_DEAD, its mapping of a dead decode is closed, and nothing is left held or mapped.

The cases are functions of the device: ``tests/gpu/test_kernel_path_gpu.py`` runs them on CUDA pools,
where the prefill maps the decode's pool through CUDA IPC.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from tests.chaos.rank_process import HEARTBEAT, RankProcess, child_pythonpath, expect_peer_dead
from transfer_engine.testing.cluster import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _env() -> dict[str, str]:
    return {"PYTHONPATH": child_pythonpath()}


@contextmanager
def kernel_ranks(device: str) -> Iterator[Callable[[str], RankProcess]]:
    """``start(role)``: one ``kernel_rank`` process on a free bootstrap port, returned once it is up. On
    leaving, whatever happened (one that never came up included), each one still running is killed
    and every pipe is closed."""
    port = free_port()
    started: list[RankProcess] = []

    def start(role: str) -> RankProcess:
        argv = [sys.executable, "-m", "tests.integration.kernel_rank", "--role", role, "--bootstrap-port",
                str(port), "--heartbeat", str(HEARTBEAT), "--device", device]  # fmt: skip
        rank = RankProcess(role, argv, env=_env())
        started.append(rank)
        rank.expect("up")
        return rank

    try:
        yield start
    finally:
        for rank in started:
            rank.close()


def quit_rank(rank: RankProcess) -> dict[str, object]:
    rank.send(cmd="quit")
    got = rank.expect("leaks")
    assert rank.proc.wait(30) == 0, "".join(rank.stderr[-20:])
    return got


def test_rooms_copy_between_two_processes(device: str = "cpu") -> None:
    """Three rooms, whole and layer-wise chunks: bytes exact, path kernel (the reason says so), the
    prefill's copies counted, and at the end nothing held, in flight or mapped on either side."""
    with kernel_ranks(device) as start:
        prefill = start("prefill")
        decode = start("decode")
        rooms = {1: (0, False), 2: (8, True), 3: (16, False)}
        for room, (first, layers) in rooms.items():
            pages = list(range(first, first + 4))
            decode.send(cmd="recv", room=room, pages=pages)
            decode.expect("opened", room=room)
            prefill.send(cmd="send", room=room, pages=pages, chunks=[2, 2], hold=False, layers=layers)
            prefill.expect("opened", room=room)
        for room in rooms:
            got = decode.expect("room", room=room)
            assert got["ok"], got
            assert got["path"] == "kernel" and "one host" in got["why"], got
            assert prefill.expect("room", room=room)["ok"]
        done_d, done_p = quit_rank(decode), quit_rank(prefill)
        assert not any(done_d["leaks"].values()) and not any(done_p["leaks"].values()), (done_d, done_p)
        assert done_d["mapped"] == ["shm" if device == "cpu" else "cuda_ipc"], done_d
        assert done_p["counters"]["kernel_copies"] >= 3 * 2, done_p
        assert done_p["counters"].get("kernel_fallbacks", 0) == 0, done_p
        assert done_p["mappings"] == 0 and done_d["mappings"] == 0


def test_decode_killed_mid_room_closes_the_mapping(device: str = "cpu") -> None:
    """A decode killed while a kernel-path room waits between two layers: the prefill's room fails
    PEER_DEAD within the heartbeat bound, its mapping of the dead decode's pool is closed (no copy in
    flight), and it leaks nothing."""
    with kernel_ranks(device) as start:
        prefill = start("prefill")
        decode = start("decode")
        pages = list(range(4))
        decode.send(cmd="recv", room=5, pages=pages)
        decode.expect("opened", room=5)
        prefill.send(cmd="send", room=5, pages=pages, chunks=[2, 2], hold=True, layers=True)
        prefill.expect("opened", room=5)
        prefill.expect("asked", room=5)  # before it, the room would wait for any decode, not fail
        killed_at = decode.kill()
        expect_peer_dead(prefill, [5], killed_at)
        done = quit_rank(prefill)
        assert not any(done["leaks"].values()), done
        assert done["mappings"] == 0, done


def test_prefill_killed_mid_room_fails_the_decode_room(device: str = "cpu") -> None:
    """A prefill killed mid-room (it mapped the decode's pool): the decode's room fails PEER_DEAD, and
    the decode ends with nothing held; its pool was never freed under a live copy (the copier is gone)."""
    with kernel_ranks(device) as start:
        prefill = start("prefill")
        decode = start("decode")
        pages = list(range(4))
        decode.send(cmd="recv", room=6, pages=pages)
        decode.expect("opened", room=6)
        prefill.send(cmd="send", room=6, pages=pages, chunks=[2, 2], hold=True, layers=False)
        prefill.expect("opened", room=6)
        prefill.expect("asked", room=6)  # mid-room: it has mapped the decode's pool
        killed_at = prefill.kill()
        expect_peer_dead(decode, [6], killed_at)
        done = quit_rank(decode)
        assert not any(done["leaks"].values()), done
