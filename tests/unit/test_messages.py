"""Wire messages: every type round-trips, and bad bytes only ever raise RemoteProtocolError.

``SAMPLES`` holds one instance of every message type with non-default values; a test fails when a
type is added to the union without a sample here, so no message can go untested.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer_engine.errors import FailureReason, RemoteProtocolError
from transfer_engine.protocol import messages
from transfer_engine.protocol.messages import (
    MAX_MESSAGE_BYTES,
    MAX_NOTIF_BYTES,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Abort,
    AbortAck,
    AuxLanded,
    ChunkLanded,
    DumpReply,
    DumpRequest,
    Heartbeat,
    LayoutInfo,
    MemRegion,
    Message,
    PeerHello,
    PeerHelloAck,
    PeerLeaving,
    PeerLeavingAck,
    RankInfo,
    RegisterAck,
    RegisterRank,
    RoomFailed,
    SliceSpec,
    StagingGrant,
    StagingRefused,
    StagingRequest,
    Topology,
    TopologyQuery,
    TransferRequest,
    Watermark,
    compat_hash,
    decode,
    decode_notification,
    encode,
)

LAYOUT = LayoutInfo(
    num_layers=4,
    num_heads=8,
    head_dim=128,
    dtype="bfloat16",
    page_size=16,
    mla=False,
    num_pages=64,
    aux_item_bytes=8,
    num_aux_slots=4,
)
REGION = MemRegion(addr=0x7F00_0000_1000, length=1 << 20, device=1)
COMPAT = compat_hash(LAYOUT)

SAMPLES: list[Message] = [
    RegisterRank(rank=1, tp_size=2, endpoint="tcp://127.0.0.1:5000", layout=LAYOUT, compat=COMPAT),
    RegisterAck(ok=False, detail="tp_size 4 differs from 2"),
    TopologyQuery(),
    Topology(
        tp_size=2, ranks=[RankInfo(0, "tcp://10.0.0.1:1"), RankInfo(1, "tcp://10.0.0.2:2")], complete=True
    ),
    PeerHello(
        rank=0,
        tp_size=2,
        endpoint="tcp://127.0.0.1:6000",
        agent_name="decode-0",
        agent_metadata=b"\x00\x01\xffmeta",
        mem_type="DRAM",
        regions=[REGION, MemRegion(addr=4096, length=8192, device=0)],
        aux=MemRegion(addr=1 << 40, length=32, device=0),
        ring=MemRegion(addr=1 << 41, length=1 << 20, device=0),
        ring_mem_type="DRAM",
        layout=LAYOUT,
        compat=COMPAT,
    ),
    PeerHelloAck(
        ok=True,
        detail="",
        rank=1,
        tp_size=4,
        agent_name="prefill-1",
        agent_metadata=b"md",
        layout=LAYOUT,
        compat=COMPAT,
        scratch=MemRegion(addr=1 << 42, length=4 << 20, device=1),
        scratch_mem_type="VRAM",
        host="node-1/boot",
    ),
    PeerLeaving(agent="decode-0", rank=0, side="decode", detail="engine closed"),
    PeerLeavingAck(agent="prefill-1"),
    TransferRequest(
        agent="decode-0",
        room=(1 << 63) - 1,
        decode_rank=1,
        decode_tp=2,
        path="staged",
        dst_pages=[5, 6, 9],
        aux_slot=3,
        slices=[SliceSpec(prefill_rank=2, src_head_start=0, dst_head_start=2, num_heads=2)],
    ),
    StagingRequest(agent="prefill-2", room=12, chunk_id=3, sender=2, page_start=8, num_pages=4, tokens=64),
    StagingGrant(
        agent="decode-0",
        room=12,
        chunk_id=3,
        alloc_id=17,
        round=2,
        offset=4096,
        length=8192,
        writer_offset=4096,
        writer_bytes=4096,
    ),
    StagingRefused(agent="decode-0", room=12, chunk_id=3, detail="raise ring_bytes to at least 8192"),
    Watermark(agent="decode-0", rank=0, round=2, tail=12288),
    Abort(agent="decode-0", room=12, rank=0, reason=int(FailureReason.ABORTED), detail="user abort"),
    AbortAck(agent="prefill-1", room=12, rank=1),
    RoomFailed(agent="prefill-1", room=12, rank=1, reason=int(FailureReason.TRANSPORT), detail="write error"),
    Heartbeat(agent="prefill-1", rank=1, side="prefill", seq=99),
    ChunkLanded(
        room=12, chunk_id=3, last=True, sender=5, page_start=8, num_pages=4, region=17, layers=(2, 4)
    ),
    AuxLanded(room=12, sender=5),
    DumpRequest(room=12),
    DumpReply(snapshot=b"\x81\xa1a\x01"),
]
NOTIFICATIONS = (ChunkLanded, AuxLanded)


def ids(sample: Message) -> str:
    return type(sample).__name__


def expect_protocol_error(data: bytes, **kwargs: Any) -> RemoteProtocolError:
    """``decode(data)`` must raise RemoteProtocolError; any other exception fails the test."""
    with pytest.raises(RemoteProtocolError) as info:
        decode(data, **kwargs)
    return info.value


def as_list(sample: Message) -> list[Any]:
    """The message as the msgpack array it travels as: ``[tag, *fields, v]``."""
    raw = msgspec.to_builtins(sample, builtin_types=(bytes,))
    assert isinstance(raw, list)
    return raw


# ---------------------------------------------------------------- round trips


def test_every_message_type_has_a_sample() -> None:
    assert {type(s) for s in SAMPLES} == set(MESSAGE_TYPES)
    assert len(SAMPLES) == len(MESSAGE_TYPES)


@pytest.mark.parametrize("sample", SAMPLES, ids=ids)
def test_round_trip(sample: Message) -> None:
    data = encode(sample)
    back = decode(data)
    assert type(back) is type(sample)
    assert back == sample
    assert back.v == PROTOCOL_VERSION
    assert decode(bytearray(data)) == sample
    assert decode(memoryview(data)) == sample


@pytest.mark.parametrize("sample", SAMPLES, ids=ids)
def test_wire_shape_is_tag_fields_version(sample: Message) -> None:
    raw = as_list(sample)
    assert raw[0] == type(sample).__name__
    assert raw[-1] == PROTOCOL_VERSION
    assert len(raw) == 1 + len(type(sample).__struct_fields__)


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
def test_message_struct_config(cls: type[Message]) -> None:
    config = cls.__struct_config__
    assert config.frozen and config.array_like
    assert config.tag == cls.__name__
    assert (cls.__dict__.get("__doc__") or "").strip(), f"{cls.__name__} needs a docstring"


@pytest.mark.parametrize("cls", NOTIFICATIONS, ids=lambda c: c.__name__)
def test_notifications_are_untracked_by_gc(cls: type[Message]) -> None:
    assert cls.__struct_config__.gc is False


@pytest.mark.parametrize("sample", [s for s in SAMPLES if isinstance(s, NOTIFICATIONS)], ids=ids)
def test_notification_round_trip_fits_limit(sample: Message) -> None:
    data = encode(sample)
    assert len(data) <= MAX_NOTIF_BYTES
    assert decode_notification(data) == sample


@pytest.mark.parametrize("sample", [s for s in SAMPLES if not isinstance(s, NOTIFICATIONS)], ids=ids)
def test_decode_notification_refuses_control_messages(sample: Message) -> None:
    with pytest.raises(RemoteProtocolError, match=f"{type(sample).__name__} is not a notification"):
        decode_notification(encode(sample))


def test_decode_notification_applies_its_own_limit() -> None:
    big = encode(DumpReply(snapshot=bytes(MAX_NOTIF_BYTES)))
    assert len(big) <= MAX_MESSAGE_BYTES
    with pytest.raises(RemoteProtocolError, match="exceeds"):
        decode_notification(big)


@pytest.mark.parametrize("reason", list(FailureReason), ids=lambda r: r.name)
def test_room_failed_carries_every_reason(reason: FailureReason) -> None:
    msg = RoomFailed(agent="a", room=1, rank=0, reason=int(reason), detail="d")
    back = decode(encode(msg))
    assert isinstance(back, RoomFailed)
    assert FailureReason(back.reason) is reason


@pytest.mark.parametrize("reason", [0, max(FailureReason) + 1, -1, 999])
def test_room_failed_with_unknown_reason_is_refused(reason: int) -> None:
    raw = as_list(RoomFailed(agent="a", room=1, rank=0, reason=3, detail="d"))
    raw[4] = reason
    err = expect_protocol_error(msgspec.msgpack.encode(raw))
    assert f"unknown reason {reason}" in str(err)


# ---------------------------------------------------------------- bad input: RemoteProtocolError only


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes(data: bytes) -> None:
    try:
        message = decode(data)
    except RemoteProtocolError:
        return
    assert isinstance(message, MESSAGE_TYPES)


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(
    tag=st.sampled_from([c.__name__ for c in MESSAGE_TYPES] + ["Nope", ""]),
    fields=st.lists(_values, max_size=12),
)
def test_random_structures_with_real_tags(tag: str, fields: list[Any]) -> None:
    data = msgspec.msgpack.encode([tag, *fields])
    try:
        message = decode(data)
    except RemoteProtocolError:
        return
    assert isinstance(message, MESSAGE_TYPES)
    assert encode(message) == data  # only a well-formed message of this version gets through


@settings(max_examples=100, deadline=None)
@given(_values)
def test_random_msgpack_values(value: Any) -> None:
    data = msgspec.msgpack.encode(value)
    try:
        message = decode(data)
    except RemoteProtocolError:
        return
    assert isinstance(message, MESSAGE_TYPES)


@pytest.mark.parametrize("sample", SAMPLES, ids=ids)
def test_every_truncation_is_refused(sample: Message) -> None:
    data = encode(sample)
    for cut in range(len(data)):
        expect_protocol_error(data[:cut])


@settings(max_examples=100, deadline=None)
@given(sample=st.sampled_from(SAMPLES), extra=st.integers(1, 64), fill=st.integers(0, 255))
def test_oversized_inputs(sample: Message, extra: int, fill: int) -> None:
    data = encode(sample)
    err = expect_protocol_error(data, limit=len(data) - 1)
    assert f"{len(data)} bytes exceeds the limit of {len(data) - 1}" in str(err)
    padded = data + bytes([fill]) * extra
    expect_protocol_error(padded, limit=len(data) + extra - 1)
    assert decode(data, limit=len(data)) == sample


def test_oversized_at_default_limit() -> None:
    err = expect_protocol_error(b"\x00" * (MAX_MESSAGE_BYTES + 1))
    assert "exceeds" in str(err)


def _wrong_values(t: mi.Type) -> list[Any]:
    """Values of a msgpack type that a field of type ``t`` must refuse."""
    if isinstance(t, mi.UnionType):  # only ``X | None`` occurs in messages
        (inner,) = [x for x in t.types if not isinstance(x, mi.NoneType)]
        return [v for v in _wrong_values(inner) if v is not None]
    if isinstance(t, mi.IntType):
        return ["7", 1.5, True, None, [], {}, b"\x07"]
    if isinstance(t, mi.StrType):
        return [7, 1.5, False, None, [], {}, b"x"]
    if isinstance(t, mi.BoolType):
        return [0, 1, "true", None, [], 1.0]
    if isinstance(t, mi.BytesType):
        return ["bytes", 7, None, [], True]
    if isinstance(t, mi.ListType):
        return [7, "x", None, {}, True] + [[v] for v in _wrong_values(t.item_type)[:2]]
    if isinstance(t, mi.StructType):
        return [7, "x", None, {}, True, []]
    if isinstance(t, mi.TupleType):
        return [7, "x", None, {}, True, [], [1] * (len(t.item_types) + 1)] + [
            [v] * len(t.item_types) for v in _wrong_values(t.item_types[0])[:2]
        ]
    raise AssertionError(f"no wrong values for {t}")


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_wrongly_typed_fields(data: st.DataObject) -> None:
    sample = data.draw(st.sampled_from(SAMPLES))
    info = mi.type_info(type(sample))
    assert isinstance(info, mi.StructType)
    fields = info.fields
    index = data.draw(st.integers(0, len(fields) - 1))
    wrong = data.draw(st.sampled_from(_wrong_values(fields[index].type)))
    raw = as_list(sample)
    raw[1 + index] = wrong
    err = expect_protocol_error(msgspec.msgpack.encode(raw))
    assert "undecodable" in str(err) or "protocol version" in str(err)


@pytest.mark.parametrize("sample", SAMPLES, ids=ids)
def test_unchanged_builtins_decode(sample: Message) -> None:
    """Guards the tests above: the arrays they corrupt are valid before corruption."""
    assert decode(msgspec.msgpack.encode(as_list(sample))) == sample


@settings(max_examples=100, deadline=None)
@given(
    sample=st.sampled_from(SAMPLES),
    version=st.integers(min_value=-(2**63), max_value=2**64 - 1).filter(lambda v: v != PROTOCOL_VERSION),
)
def test_other_protocol_versions(sample: Message, version: int) -> None:
    raw = as_list(sample)
    raw[-1] = version
    err = expect_protocol_error(msgspec.msgpack.encode(raw))
    assert f"protocol version {version}" in str(err)


@pytest.mark.parametrize("sample", SAMPLES, ids=ids)
def test_missing_or_extra_elements(sample: Message) -> None:
    raw = as_list(sample)
    # Without its version the array would decode with v defaulted: the count must catch it.
    expect_protocol_error(msgspec.msgpack.encode(raw[:-1]))
    # A peer with one more field (another protocol version) must not be half-read.
    expect_protocol_error(msgspec.msgpack.encode([*raw[:-1], 0, raw[-1]]))
    expect_protocol_error(msgspec.msgpack.encode([*raw, PROTOCOL_VERSION]))


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(["Nope", 1], id="unknown-tag"),
        pytest.param([], id="empty-array"),
        pytest.param({"type": "TopologyQuery", "v": 1}, id="map"),
        pytest.param(5, id="int"),
        pytest.param(None, id="nil"),
        pytest.param(["topologyquery", 1], id="tag-case"),
    ],
)
def test_not_a_message(value: Any) -> None:
    expect_protocol_error(msgspec.msgpack.encode(value))


def test_deeply_nested_input() -> None:
    expect_protocol_error(b"\x91" * 100_000)


# ---------------------------------------------------------------- compat hash

PINNED = LayoutInfo(
    num_layers=32, num_heads=8, head_dim=128, dtype="bfloat16", page_size=16, mla=False, num_pages=1000
)


def test_compat_hash_is_pinned() -> None:
    # Computed once and written down: a change here breaks compatibility with deployed peers.
    assert compat_hash(PINNED) == 3484999812343459059


def test_compat_hash_ignores_page_geometry_and_aux() -> None:
    for changes in (
        {"page_size": 1},
        {"page_size": 64},
        {"num_pages": 7},
        {"aux_item_bytes": 16, "num_aux_slots": 9},
    ):
        assert compat_hash(msgspec.structs.replace(PINNED, **changes)) == compat_hash(PINNED), changes


@pytest.mark.parametrize(
    "changes",
    [
        {"num_layers": 31},
        {"num_heads": 4},
        {"head_dim": 64},
        {"dtype": "float16"},
        {"dtype": "float8_e4m3fn"},
        {"mla": True},
    ],
    ids=lambda c: ",".join(c),
)
def test_compat_hash_covers_model_shape(changes: dict[str, Any]) -> None:
    other = msgspec.structs.replace(PINNED, **changes)
    assert compat_hash(other) != compat_hash(PINNED)


@settings(max_examples=100, deadline=None)
@given(
    layers=st.integers(1, 200),
    heads=st.integers(1, 128),
    head_dim=st.integers(1, 1024),
    dtype=st.sampled_from(["bfloat16", "float16", "float32", "float8_e4m3fn"]),
    mla=st.booleans(),
)
def test_compat_hash_is_63_bit_and_deterministic(
    layers: int, heads: int, head_dim: int, dtype: str, mla: bool
) -> None:
    layout = LayoutInfo(layers, heads, head_dim, dtype, 16, mla, 10)
    h = compat_hash(layout)
    assert 0 <= h < 2**63
    back = decode(encode(RegisterRank(rank=0, tp_size=1, endpoint="e", layout=layout, compat=h)))
    assert isinstance(back, RegisterRank)
    assert compat_hash(back.layout) == h == back.compat


# ---------------------------------------------------------------- small helpers and hygiene


def test_layout_info_tensor_count() -> None:
    assert PINNED.num_kv_tensors == 64
    assert msgspec.structs.replace(PINNED, mla=True).num_kv_tensors == 32


@pytest.mark.parametrize(
    ("addr", "length", "inside"),
    [
        (1000, 100, True),
        (1000, 0, True),
        (1050, 50, True),
        (999, 1, False),
        (1050, 51, False),
        (1100, 1, False),
    ],
)
def test_mem_region_contains(addr: int, length: int, inside: bool) -> None:
    region = MemRegion(addr=1000, length=100, device=0)
    assert region.end == 1100
    assert region.contains(addr, length) is inside


def test_messages_module_never_pickles() -> None:
    source = Path(messages.__file__).read_text()
    tree = ast.parse(source)
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "marshal", "shelve"}
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert "pickle" not in names
    assert "__reduce__" not in source


# ---------------------------------------------------------------- a request's pages on the wire

PAGES = 1 + TransferRequest.__struct_fields__.index("dst_pages")
"""Where ``dst_pages`` is in a TransferRequest's array (the tag first)."""


@given(pages=st.lists(st.integers(0, (1 << 31) - 1), max_size=300))
def test_request_pages_travel_as_int32(pages: list[int]) -> None:
    request = TransferRequest(
        agent="d",
        room=1,
        decode_rank=0,
        decode_tp=1,
        path="direct",
        dst_pages=pages,
        aux_slot=None,
        slices=[],
    )
    assert request.dst_pages == messages.pack_pages(pages) and len(request.dst_pages) == 4 * len(pages)
    back = decode(encode(request))
    assert isinstance(back, TransferRequest) and back == request
    assert back.pages.tolist() == pages and back.pages.dtype == messages.PAGE_DTYPE


def test_request_pages_of_a_partial_int32_are_refused() -> None:
    raw = as_list(SAMPLES[[type(s) for s in SAMPLES].index(TransferRequest)])
    raw[PAGES] = raw[PAGES] + b"\x01"  # one byte past the last whole page
    error = expect_protocol_error(msgspec.msgpack.encode(raw))
    assert "not a whole number of int32" in str(error)


def test_request_pages_as_a_list_of_ints_are_refused() -> None:
    """The encoding of protocol version 3 (a msgpack list) is malformed now, whatever version it says."""
    raw = as_list(SAMPLES[[type(s) for s in SAMPLES].index(TransferRequest)])
    raw[PAGES] = [5, 6, 9]
    expect_protocol_error(msgspec.msgpack.encode(raw))


@pytest.mark.parametrize("pages", [[1 << 31], [-(1 << 31) - 1], [[1, 2]], ["a"]])
def test_pack_pages_refuses_what_int32_cannot_hold(pages: list[Any]) -> None:
    with pytest.raises(ValueError, match="pages must"):
        messages.pack_pages(pages)
