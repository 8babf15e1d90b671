"""Hostile bytes at a live engine's control socket and at its bootstrap registry.

Every frame below is sent from a raw DEALER (no engine behind it). Each one must be dropped and
counted — in ``engine.control.dropped`` or ``bootstrap.dropped`` — and nothing may change: after
the barrage a room transfers, every byte verified, and nothing leaked.

The engines run in a portal thread (``anyio.from_thread``) so that hypothesis drives a plain
synchronous test and shrinks any frame that breaks the property.
"""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import zmq
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.harness import Cluster, run_room, shuffled_pages
from transfer_engine.actors.router import BOOTSTRAP_MAX_FRAME, CONTROL_MAX_FRAME
from transfer_engine.errors import RemoteProtocolError
from transfer_engine.protocol import messages as m
from transfer_engine.transport import local

from .helpers import engines

pytestmark = pytest.mark.timeout(90)

FUZZ = settings(
    max_examples=100,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


def _valid_messages() -> list[bytes]:
    layout = m.LayoutInfo(3, 8, 16, "bfloat16", 4, False, 64, 16, 8)
    region = m.MemRegion(0x7000_0000, 4096, 0)
    return [
        m.encode(msg)
        for msg in (
            m.RegisterRank(rank=0, tp_size=1, endpoint="tcp://127.0.0.1:1", layout=layout, compat=5),
            m.TopologyQuery(),
            m.PeerHello(
                rank=0,
                tp_size=1,
                endpoint="tcp://127.0.0.1:1",
                agent_name="x",
                agent_metadata=b"\0" * 64,
                mem_type="DRAM",
                regions=[region],
                aux=None,
                ring=None,
                ring_mem_type="",
                layout=layout,
                compat=5,
            ),
            m.TransferRequest(
                agent="x",
                room=1,
                decode_rank=0,
                decode_tp=1,
                path="direct",
                dst_pages=list(range(20)),
                aux_slot=None,
                slices=[m.SliceSpec(0, 0, 0, 8)],
            ),
            m.Abort(agent="x", room=1, rank=0, reason=3, detail="d"),
            m.RoomFailed(agent="x", room=1, rank=0, reason=5, detail="d"),
            m.Heartbeat(agent="x", rank=0, side="decode", seq=1),
            m.ChunkLanded(room=1, chunk_id=0, last=True, sender=0, page_start=0, num_pages=1, region=-1),
        )
    ]


VALID = _valid_messages()
TAGS = [t.__name__ for t in m.MESSAGE_TYPES]
FIELDS = {t.__name__: len(t.__struct_fields__) for t in m.MESSAGE_TYPES}

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner, max_size=5),
    max_leaves=20,
)


@st.composite
def truncated(draw: st.DrawFn) -> bytes:
    """A valid message cut short anywhere (never whole)."""
    data = draw(st.sampled_from(VALID))
    return data[: draw(st.integers(0, len(data) - 1))]


@st.composite
def wrong_field_count(draw: st.DrawFn) -> bytes:
    """A known tag followed by a field count that is not the message's."""
    tag = draw(st.sampled_from(TAGS))
    n = draw(st.integers(0, 12).filter(lambda k: k != FIELDS[tag]))
    return msgspec.msgpack.encode([tag, *draw(st.lists(msgpack_values, min_size=n, max_size=n))])


@st.composite
def wrong_field_type(draw: st.DrawFn) -> bytes:
    """A valid message with one field replaced by a map (no field of any message is a map)."""
    fields = list(msgspec.msgpack.decode(draw(st.sampled_from(VALID))))
    index = draw(st.integers(1, len(fields) - 1))
    fields[index] = draw(st.dictionaries(st.text(max_size=3), msgpack_values, min_size=0, max_size=2))
    return msgspec.msgpack.encode(fields)


one_frame = st.one_of(
    st.binary(max_size=512),
    truncated(),
    wrong_field_count(),
    wrong_field_type(),
    msgpack_values.map(msgspec.msgpack.encode),
)
"""Single frames that must each be counted as ``malformed``."""

many_frames = st.lists(st.binary(max_size=64), min_size=2, max_size=5)
"""Multipart messages with a wrong frame count (ROUTER adds the identity: 3 to 6 frames)."""


class Raw:
    """A raw DEALER, and a way to wait for a drop counter to move."""

    def __init__(self, portal: BlockingPortal, endpoint: str, counter: Callable[[], int]) -> None:
        self.portal = portal
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.endpoint = endpoint
        self.counter = counter

    def drops(self) -> int:
        return self.portal.call(lambda: _sync(self.counter))

    def send_and_count(self, frames: list[bytes], timeout: float = 5.0) -> None:
        """Send one message and wait until it was counted as dropped."""
        before = self.drops()
        self.sock.send_multipart(frames)
        deadline = time.monotonic() + timeout
        while self.drops() < before + 1:
            assert time.monotonic() < deadline, f"{[f[:40] for f in frames]} was not counted as dropped"
            time.sleep(0.001)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


async def _sync(fn: Callable[[], int]) -> int:
    return fn()


def drop_total(counter: Any) -> Callable[[], int]:
    return lambda: sum(counter.dropped.values())


@pytest.fixture
def portal() -> Iterator[BlockingPortal]:
    with start_blocking_portal() as p:
        yield p


def _check_serving(portal: BlockingPortal, c: Cluster, room: int) -> None:
    rng = random.Random(room)
    portal.call(run_room, c, room, shuffled_pages(rng, 64, 6), shuffled_pages(rng, 64, 6), [3, 3])
    c.assert_no_leaks()


def test_fuzz_control_and_bootstrap_sockets(portal: BlockingPortal) -> None:
    with portal.wrap_async_context_manager(engines(1, 1)) as c:
        prefill, decode = c.prefill[0], c.decode[0]
        assert prefill.bootstrap is not None
        targets = [
            Raw(portal, prefill.endpoint, drop_total(prefill.control)),
            Raw(portal, decode.endpoint, drop_total(decode.control)),
            Raw(portal, c.bootstrap, drop_total(prefill.bootstrap)),
        ]
        try:
            _check_serving(portal, c, 1)  # the decode is connected: peers exist while we fuzz

            @FUZZ
            @given(frame=one_frame, multi=many_frames, which=st.integers(0, 2))
            def fuzz(frame: bytes, multi: list[bytes], which: int) -> None:
                raw = targets[which]
                raw.send_and_count([frame])
                raw.send_and_count(multi)

            fuzz()
            limits = (CONTROL_MAX_FRAME, CONTROL_MAX_FRAME, BOOTSTRAP_MAX_FRAME)
            for raw, limit in zip(targets, limits, strict=True):
                raw.send_and_count([bytes(limit)])  # the largest frame is read (and is no message)
            assert prefill.control.dropped["malformed"] > 0 and prefill.control.dropped["bad_frames"] > 0
            assert decode.control.dropped["malformed"] > 0 and prefill.bootstrap.dropped["malformed"] > 0
            # A frame over the endpoint's limit is never read: libzmq drops that connection instead.
            for raw, limit in ((targets[0], CONTROL_MAX_FRAME), (targets[2], BOOTSTRAP_MAX_FRAME)):
                huge = Raw(portal, raw.endpoint, raw.counter)
                before = huge.drops()
                huge.sock.send(bytes(limit + 1))
                time.sleep(0.2)
                assert huge.drops() == before
                huge.close()
            _check_serving(portal, c, 2)
            assert prefill.bootstrap.ranks == {0: prefill.endpoint}
        finally:
            for raw in targets:
                raw.close()


def test_fuzz_the_landing_notice_datagram_socket(portal: BlockingPortal) -> None:
    """Hostile datagrams at a live decode's landing-notice socket (transport/local.py): any bytes, any
    well-formed message that is not a landing notice, a notice over the size limit, a notice for a
    room nobody opened. Each is dropped and counted, nothing raises, and a room transfers after."""
    with portal.wrap_async_context_manager(engines(1, 1)) as c:
        decode = c.decode[0]
        assert decode.control.local is not None and decode.control.local.bound
        name = local.name_of(decode.endpoint)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

        def counted(data: bytes, count: Callable[[], int]) -> None:
            before = count()
            sock.sendto(data, name)
            deadline = time.monotonic() + 2.0
            while count() < before + 1:
                assert time.monotonic() < deadline, f"{data[:40]!r} was not counted"
                time.sleep(0.001)

        def malformed() -> int:
            return decode.control.dropped["malformed"]

        try:
            _check_serving(portal, c, 1)

            @FUZZ
            @given(data=one_frame.filter(lambda b: 0 < len(b) <= local.MAX_DATAGRAM), message=well_formed)
            def fuzz(data: bytes, message: m.Message) -> None:
                try:
                    notice = isinstance(m.decode_notification(data), m.ChunkLanded | m.AuxLanded)
                except RemoteProtocolError:
                    notice = False
                if not notice:
                    counted(data, malformed)
                if not isinstance(message, m.ChunkLanded | m.AuxLanded):
                    counted(m.encode(message), malformed)
                assert decode.control.dropped["dispatch_error"] == 0

            fuzz()
            counted(bytes(local.MAX_DATAGRAM + 100), malformed)  # cut at MAX_DATAGRAM, over the limit
            stray = m.ChunkLanded(
                room=987_654, chunk_id=0, last=True, sender=0, page_start=0, num_pages=1, region=-1
            )
            counted(m.encode(stray), lambda: decode.counters["notifs_unrouted"])
            _check_serving(portal, c, 2)
        finally:
            sock.close()


def _encodable(message: m.Message) -> bool:
    try:
        m.encode(message)
    except OverflowError:  # hypothesis drew an int beyond msgpack's 64 bits
        return False
    return True


well_formed = (
    st.sampled_from(m.MESSAGE_TYPES)
    .flatmap(st.from_type)
    .filter(_encodable)
    .map(lambda msg: msgspec.structs.replace(msg, v=m.PROTOCOL_VERSION))
)
"""Messages of every type that decode fine, with arbitrary values (unknown agents, rooms, ranks)."""

SENTINEL = b"\xc1"
"""Never valid msgpack: once it is counted, every message sent before it on that socket was handled."""


def test_fuzz_well_formed_hostile_messages(portal: BlockingPortal) -> None:
    """Decodable messages with arbitrary field values: answered, ignored or dropped; never a crash."""
    with portal.wrap_async_context_manager(
        engines(1, 1, heartbeat_interval=0.25, bootstrap_timeout=1.0)
    ) as c:
        prefill, decode = c.prefill[0], c.decode[0]
        assert prefill.bootstrap is not None
        bootstrap = prefill.bootstrap
        targets = [
            Raw(portal, prefill.endpoint, lambda: prefill.control.dropped["malformed"]),
            Raw(portal, decode.endpoint, lambda: decode.control.dropped["malformed"]),
            Raw(portal, c.bootstrap, lambda: bootstrap.dropped["malformed"]),
        ]
        try:
            _check_serving(portal, c, 1)

            @FUZZ
            @given(message=well_formed, which=st.integers(0, 2))
            def fuzz(message: m.Message, which: int) -> None:
                raw = targets[which]
                raw.sock.send(m.encode(message))
                raw.send_and_count([SENTINEL])
                errors = prefill.control.dropped["dispatch_error"] + decode.control.dropped["dispatch_error"]
                assert errors == 0, f"{message!r} raised in dispatch"

            fuzz()
            assert bootstrap.ranks == {0: prefill.endpoint}
            # Requests for rooms nobody opens wait in the stash until bootstrap_timeout, then expire.
            deadline = time.monotonic() + 5.0
            while prefill.leaks()["stashed"] and time.monotonic() < deadline:
                time.sleep(0.05)
            _check_serving(portal, c, 2)
        finally:
            for raw in targets:
                raw.close()


def _hello(engine: Any, regions: list[m.MemRegion]) -> m.PeerHello:
    """A PeerHello that passes the layout check of ``engine`` (a prefill), from an unknown agent."""
    return m.PeerHello(
        rank=0,
        tp_size=1,
        endpoint="tcp://127.0.0.1:9",
        agent_name="stranger",
        agent_metadata=b"\0" * 64,
        mem_type="DRAM",
        regions=regions,
        aux=None,
        ring=None,
        ring_mem_type="",
        layout=engine.pool.info(),
        compat=m.compat_hash(engine.pool.info()),
    )


def test_peer_hello_with_out_of_range_region_does_not_take_the_rank_down(portal: BlockingPortal) -> None:
    """Found by fuzzing: a region address outside uint64 raised OverflowError in the handshake.

    Before, one unauthenticated message took the rank down. Now ``MemRegion`` fields are bounded to
    NIXL's uint64 in the message schema: the hello fails decoding, is dropped as ``malformed`` before
    any dispatch, and the rank keeps serving.
    """
    with portal.wrap_async_context_manager(engines(1, 1)) as c:
        prefill = c.prefill[0]
        raw = Raw(portal, prefill.endpoint, lambda: prefill.control.dropped["malformed"])
        try:
            before = prefill.control.dropped["malformed"]
            raw.sock.send(m.encode(_hello(prefill, [m.MemRegion(-1, 4096, 0)])))
            raw.send_and_count([SENTINEL])
            assert prefill.control.dropped["malformed"] >= before + 1
            assert prefill.control.dropped["dispatch_error"] == 0
            _check_serving(portal, c, 1)
        finally:
            raw.close()


def test_forged_transfer_request_does_not_poison_a_later_room(portal: BlockingPortal) -> None:
    with portal.wrap_async_context_manager(engines(1, 1)) as c:
        prefill = c.prefill[0]
        raw = Raw(portal, prefill.endpoint, lambda: prefill.control.dropped["malformed"])
        try:
            forged = m.TransferRequest(
                agent="nobody",
                room=77,
                decode_rank=0,
                decode_tp=1,
                path="direct",
                dst_pages=[0],
                aux_slot=None,
                slices=[m.SliceSpec(0, 0, 0, 8)],
            )
            raw.sock.send(m.encode(forged))
            raw.send_and_count([SENTINEL])
            assert prefill.leaks()["stashed"] == 0, "a request from an unknown agent was kept"
            _check_serving(portal, c, 77)
        finally:
            raw.close()
