"""The dump's published format and its table, without sockets: fixed snapshots against golden files.

Regenerate the golden files after an intended change of the table with
``TE_UPDATE_GOLDEN=1 python -m pytest -q tests/unit/test_introspect.py`` and review the diff.
"""

from __future__ import annotations

import io
import os
import socket
import sys
from pathlib import Path

import msgspec
import pytest

from transfer_engine.config import EngineConfig
from transfer_engine.errors import ConfigError, RemoteProtocolError
from transfer_engine.observe import (
    AllocationSnapshot,
    Counters,
    HistoryEntry,
    NixlSnapshot,
    PeerProgress,
    PeerSnapshot,
    RingSnapshot,
    RoomSnapshot,
    Snapshot,
    WorkerSnapshot,
    cli,
    decode_snapshot,
    encode_snapshot,
    has_room,
    render_table,
)

GOLDEN = Path(__file__).parent / "golden"
TAKEN_AT = 1_767_225_600.0  # 2026-01-01 00:00:00 UTC


def _counters(**kw: object) -> Counters:
    base: dict[str, object] = dict(
        bytes_written=0, writes_posted=0, writes_done=0, writes_failed=0, notifications=0, rooms_opened=0,
        rooms_by_outcome={}, failures_by_reason={}, dropped_by_kind={}, raw={},
    )  # fmt: skip
    base.update(kw)
    return msgspec.convert(base, Counters)


def decode_snapshot_fixture() -> Snapshot:
    """A decode rank (P=2 -> D=1, staged) with a room in each live state, two ended rooms, a ring."""
    waiting = RoomSnapshot(
        room=12, side="decode", state="WAITING_FOR_INPUT", age_s=0.25, in_state_s=0.2,
        bytes_done=None, bytes_expected=98304,
        progress=[
            PeerProgress(rank=0, chunks_done=0, chunks_expected=None, done=False, waiting_for="chunk 0 onward"),
            PeerProgress(rank=1, chunks_done=0, chunks_expected=None, done=False, waiting_for="chunk 0 onward"),
        ],
        waiting_for="prefill rank 0 (chunk 0 onward); prefill rank 1 (chunk 0 onward)",
    )  # fmt: skip
    slow = RoomSnapshot(
        room=7, side="decode", state="TRANSFERRING", age_s=3.5, in_state_s=3.125,
        bytes_done=73728, bytes_expected=98304,
        progress=[
            PeerProgress(rank=0, chunks_done=2, chunks_expected=2, done=True, waiting_for=""),
            PeerProgress(rank=1, chunks_done=1, chunks_expected=2, done=False, waiting_for="chunk 1, aux"),
        ],
        waiting_for="prefill rank 1 (chunk 1, aux)",
        history=[
            HistoryEntry(at_s=0.0, event="BOOTSTRAPPING"),
            HistoryEntry(at_s=0.001, event="WAITING_FOR_INPUT"),
            HistoryEntry(at_s=0.375, event="TRANSFERRING"),
        ],
    )  # fmt: skip
    newer = RoomSnapshot(
        room=9, side="decode", state="TRANSFERRING", age_s=0.75, in_state_s=0.5,
        bytes_done=49152, bytes_expected=98304,
        progress=[
            PeerProgress(rank=0, chunks_done=1, chunks_expected=None, done=False, waiting_for="chunk 1 onward"),
            PeerProgress(rank=1, chunks_done=1, chunks_expected=None, done=False, waiting_for="chunk 1 onward"),
        ],
        waiting_for="prefill rank 0 (chunk 1 onward); prefill rank 1 (chunk 1 onward); scatter of chunk 0",
    )  # fmt: skip
    aborting = RoomSnapshot(
        room=5, side="decode", state="FAILED", age_s=31.0, in_state_s=1.0,
        bytes_done=None, bytes_expected=98304, progress=[],
        waiting_for="AbortAck from prefill rank 1",
        failure_reason="TRANSFER_TIMEOUT", failure_detail="room 5 spent more than 30.0 s in TRANSFERRING",
    )  # fmt: skip
    ok = RoomSnapshot(
        room=3, side="decode", state="SUCCESS", age_s=0.0125, in_state_s=0.0,
        bytes_done=2_097_152, bytes_expected=2_097_152, progress=[], waiting_for="",
        ended_at=TAKEN_AT - 2.0,
        history=[
            HistoryEntry(at_s=0.0, event="BOOTSTRAPPING"),
            HistoryEntry(at_s=0.0005, event="WAITING_FOR_INPUT"),
            HistoryEntry(at_s=0.004, event="TRANSFERRING"),
            HistoryEntry(at_s=0.0125, event="SUCCESS"),
        ],
    )  # fmt: skip
    failed = RoomSnapshot(
        room=7, side="decode", state="FAILED", age_s=0.5, in_state_s=0.0, bytes_done=None,
        bytes_expected=98304, progress=[], waiting_for="", failure_reason="ABORTED",
        failure_detail="aborted by the application", ended_at=TAKEN_AT - 75.0,
    )  # fmt: skip
    return Snapshot(
        role="decode", tp_rank=0, tp_size=1, agent="te-decode-0-4242",
        control_endpoint="tcp://127.0.0.1:40001", introspect_endpoint="tcp://127.0.0.1:40002",
        metrics_endpoint="http://127.0.0.1:9100/metrics", taken_at=TAKEN_AT, uptime_s=4000.0,
        rooms=[aborting, slow, newer, waiting], ended=[ok, failed], workers=[],
        ring=RingSnapshot(
            size=8_388_608, live=2, live_bytes=196_608, round=3, head=196_608, watermark_round=3,
            watermark_tail=0,
            allocations=[
                AllocationSnapshot(alloc_id=17, round=3, offset=0, length=98304),
                AllocationSnapshot(alloc_id=18, round=3, offset=98304, length=98304),
            ],
        ),
        peers=[
            PeerSnapshot(agent="te-prefill-0-4000", rank=0, endpoint="tcp://127.0.0.1:40010", alive=True,
                         last_heartbeat_s=0.4, writes_in_flight=0),
            PeerSnapshot(agent="te-prefill-1-4001", rank=1, endpoint="tcp://127.0.0.1:40011", alive=True,
                         last_heartbeat_s=1.5, writes_in_flight=0),
        ],
        nixl=NixlSnapshot(writes_in_flight=0, handles_live=0),
        counters=_counters(
            notifications=41, rooms_opened=9, rooms_by_outcome={"FAILED": 1, "SUCCESS": 4},
            failures_by_reason={"ABORTED": 1}, dropped_by_kind={"control.malformed": 2, "introspect.malformed": 1},
        ),
    )  # fmt: skip


def prefill_snapshot_fixture() -> Snapshot:
    """A prefill rank with a room waiting for its requests, one sending, two workers, no ring."""
    bootstrapping = RoomSnapshot(
        room=11, side="prefill", state="BOOTSTRAPPING", age_s=0.125, in_state_s=0.125,
        bytes_done=0, bytes_expected=None, progress=[],
        waiting_for="TransferRequest from decode rank 1",
    )  # fmt: skip
    sending = RoomSnapshot(
        room=10, side="prefill", state="TRANSFERRING", age_s=1.5, in_state_s=1.25,
        bytes_done=12288, bytes_expected=None, writes_in_flight=1,
        progress=[
            PeerProgress(rank=0, chunks_done=1, chunks_expected=None, done=False, waiting_for="chunk 1 onward"),
        ],
        waiting_for="decode rank 0 (chunk 1 onward); send() of the next chunk",
    )  # fmt: skip
    return Snapshot(
        role="prefill", tp_rank=1, tp_size=2, agent="te-prefill-1-4001",
        control_endpoint="tcp://127.0.0.1:40011", introspect_endpoint="tcp://127.0.0.1:40012",
        metrics_endpoint=None, taken_at=TAKEN_AT, uptime_s=75.0,
        rooms=[sending, bootstrapping], ended=[],
        workers=[
            WorkerSnapshot(index=0, queue_depth=3, mailbox_size=1024, parked=2, awaiting_grant=1),
            WorkerSnapshot(index=1, queue_depth=0, mailbox_size=1024, parked=0),
        ],
        ring=None,
        peers=[
            PeerSnapshot(agent="te-decode-0-4242", rank=0, endpoint="tcp://127.0.0.1:40001", alive=True,
                         last_heartbeat_s=0.25, writes_in_flight=1),
        ],
        nixl=NixlSnapshot(writes_in_flight=1, handles_live=1),
        counters=_counters(bytes_written=1_572_864, writes_posted=13, writes_done=12, rooms_opened=11,
                           rooms_by_outcome={"SUCCESS": 9}),
    )  # fmt: skip


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("TE_UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert text == path.read_text(encoding="utf-8"), f"{path} differs; see the module docstring to update it"


@pytest.mark.parametrize(
    ("name", "snapshot", "room"),
    [
        ("dump_decode.txt", decode_snapshot_fixture(), None),
        ("dump_prefill.txt", prefill_snapshot_fixture(), None),
        ("dump_decode_room_7.txt", decode_snapshot_fixture(), 7),
        ("dump_decode_room_99.txt", decode_snapshot_fixture(), 99),
    ],
)
def test_table_matches_golden(name: str, snapshot: Snapshot, room: int | None) -> None:
    check_golden(name, render_table(snapshot, room=room))


def test_live_rooms_are_grouped_by_state_oldest_first() -> None:
    text = render_table(decode_snapshot_fixture())
    order = [text.index(f"\n{state} (") for state in ("WAITING_FOR_INPUT", "TRANSFERRING", "FAILED")]
    assert order == sorted(order)
    transferring = text[order[1] : order[2]]
    assert transferring.index("\n  7 ") < transferring.index("\n  9 ")  # room 7 is older


def test_ended_rooms_beyond_the_table_are_counted() -> None:
    base = decode_snapshot_fixture()
    many = msgspec.structs.replace(base, ended=[base.ended[0]] * 13)
    assert "... 3 more (--json or --room N shows them)" in render_table(many)


def test_snapshot_round_trips_through_msgpack_and_json() -> None:
    snapshot = decode_snapshot_fixture()
    assert decode_snapshot(encode_snapshot(snapshot)) == snapshot
    assert msgspec.json.decode(msgspec.json.encode(snapshot), type=Snapshot) == snapshot
    assert has_room(snapshot, 3) and has_room(snapshot, 12) and not has_room(snapshot, 99)


@pytest.mark.parametrize(
    "data", [b"", b"\xc1", msgspec.msgpack.encode({"role": "decode"}), b"\x93\x01\x02\x03"]
)
def test_decode_snapshot_rejects_what_is_not_a_snapshot(data: bytes) -> None:
    with pytest.raises(RemoteProtocolError, match="undecodable snapshot"):
        decode_snapshot(data)


# --- configuration --------------------------------------------------------------------------------


def test_introspect_and_metrics_ports_are_validated() -> None:
    assert EngineConfig(role="decode").introspect_port == 0
    assert EngineConfig(role="decode").metrics_port is None
    assert EngineConfig(role="decode", introspect_port=9000, metrics_port=0).metrics_port == 0
    with pytest.raises(ConfigError, match="introspect_port=70000 is not a TCP port"):
        EngineConfig(role="decode", introspect_port=70000)
    with pytest.raises(ConfigError, match="metrics_port=-1 is not a TCP port"):
        EngineConfig(role="decode", metrics_port=-1)
    env = {"TE_ROLE": "prefill", "TE_METRICS_PORT": "9100", "TE_INTROSPECT_PORT": "9101"}
    cfg = EngineConfig.from_env(env)
    assert (cfg.metrics_port, cfg.introspect_port) == (9100, 9101)


def test_metrics_without_prometheus_client_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from transfer_engine.engine import TransferEngine
    from transfer_engine.memory.layout import KVLayout, KVPool

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails as if not installed
    monkeypatch.delitem(sys.modules, "transfer_engine.observe.metrics", raising=False)
    layout = KVLayout(num_layers=1, num_heads=2, head_dim=8, dtype=torch.bfloat16, page_size=4)
    pool = KVPool.allocate(layout, 1, 0, 4, aux_slots=0)
    with pytest.raises(ConfigError, match=r"metrics_port=0 needs the package prometheus-client"):
        TransferEngine(EngineConfig(role="decode", metrics_port=0), pool)
    TransferEngine(EngineConfig(role="decode"), pool)  # metrics off: no need for the package


# --- the command line (no engine) -----------------------------------------------------------------


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(list(argv), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_dump_of_a_silent_endpoint_fails_fast_with_a_clear_message() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    code, out, err = run_cli("dump", "--endpoint", endpoint, "--timeout", "0.2")
    assert code == 1 and out == ""
    assert err == (
        f"transfer-engine dump: peer {endpoint} unreachable: no answer within 0.2 s "
        "(is an engine's introspection endpoint there?)\n"
    )


def test_dump_of_a_malformed_endpoint_fails() -> None:
    code, out, err = run_cli("dump", "--endpoint", "nowhere", "--timeout", "0.2")
    assert code == 1 and out == ""
    assert err.startswith("transfer-engine dump: peer nowhere unreachable: not a usable ZMQ endpoint")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--timeout", "0"], "--timeout=0.0 must be > 0"),
        (["--watch", "--interval", "-1"], "--interval=-1.0 must be > 0"),
        (["--watch", "--count", "0"], "--count=0 must be >= 1"),
        (
            ["--curve-secret-key-file", "x.key_secret"],
            "--curve-secret-key-file and --curve-server-key-file go",
        ),
    ],
)
def test_dump_usage_errors(args: list[str], message: str) -> None:
    code, out, err = run_cli("dump", "--endpoint", "tcp://127.0.0.1:1", *args)
    assert code == 2 and out == ""
    assert message in err


def test_dump_with_a_missing_certificate_is_a_usage_error(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.key_secret")
    code, _, err = run_cli(
        "dump", "--endpoint", "tcp://127.0.0.1:1", "--curve-secret-key-file", missing,
        "--curve-server-key-file", missing,
    )  # fmt: skip
    assert code == 2
    assert "cannot load CURVE certificate" in err
