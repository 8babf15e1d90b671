"""The receiving side shared by a rank's ROUTER endpoints (:mod:`.control` and :mod:`.introspect`).

Anyone who can reach a rank's port can send to these sockets, so each must refuse hostile input in
the same way: never read a frame larger than the endpoint's messages can be, never queue more than
:data:`INBOUND_BYTES` per peer, decode with the one typed decoder of
:mod:`transfer_engine.protocol.messages`, and log, count and drop what fails, then keep serving.
Having one copy means a hardening of one endpoint is one of them all.

:func:`bind_router` makes the socket (the size cap, the high-water marks, CURVE through a
``secure`` callable, e.g. ``Curve.server``); an :class:`Inbox` reads it and hands every decoded
message on, and is also where the endpoint records the drops its handler decides on.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import NoReturn

import anyio
import zmq
import zmq.asyncio

from transfer_engine.errors import (
    AddressInUseError,
    BindError,
    PeerUnreachableError,
    RemoteProtocolError,
    TransportError,
)
from transfer_engine.protocol import messages as m
from transfer_engine.runtime.logbook import LogBook

CONTROL_MAX_FRAME = m.MAX_MESSAGE_BYTES
"""Largest frame a control ROUTER reads: its largest messages are a TransferRequest (a page index
per decode page: about 1.8 million pages in the worst msgpack encoding) and a PeerHello (NIXL
metadata and the KV regions), both within the decoder's default limit."""

BOOTSTRAP_MAX_FRAME = 1 << 20
"""Largest frame the bootstrap ROUTER reads: RegisterRank, whose layout lists at most a few strides
per layer (about 50 bytes each: 1 MiB is room for some ten thousand layers), and TopologyQuery."""

INTROSPECT_MAX_FRAME = 4096
"""Largest frame an introspection ROUTER reads: it takes only DumpRequest (a room id, under 30 bytes)."""

INBOUND_BYTES = 128 << 20
"""Budget of what one connected peer can make a ROUTER hold: its queue of unread messages
(``RCVHWM``, :func:`inbound_hwm`) times the largest frame the endpoint reads (plus
:data:`BATCH_PIN_BYTES`). libzmq counts its
high-water marks in messages, so the byte budget becomes a message count per endpoint."""

INBOUND_HWM = 1000
"""Most messages a ROUTER queues from one connected peer whatever their size (endpoints with small
frames). Honest peers' bursts fit, or wait in the sender's own queue: a rank reads its ROUTERs
continuously, and a full queue only stops libzmq reading that peer's socket (TCP pushes back)."""

BATCH_PIN_BYTES = 8192
"""libzmq decodes small messages in place in its receive buffer (``ZMQ_IN_BATCH_SIZE``, 8 KiB), so
one queued message may keep a whole buffer alive: counted once per queued message."""


def inbound_hwm(max_frame: int) -> int:
    """The ``RCVHWM`` that keeps a peer's queue within :data:`INBOUND_BYTES` for frames up to
    ``max_frame`` bytes: 7 for the control endpoints, 127 for the bootstrap, 1,000 for introspection."""
    return max(1, min(INBOUND_HWM, INBOUND_BYTES // (max_frame + BATCH_PIN_BYTES)))


ZMTP3_ONLY = b"transfer_engine.zmtp3"
"""The ZAP domain of unsecured ROUTERs. No ZAP handler answers it (libzmq then lets ZMTP 3 peers in,
``ZMQ_ZAP_ENFORCE_DOMAIN`` being off), but a socket with a ZAP domain refuses ZMTP 1.0 peers, and
without it any bytes that do not start with 0xFF are read as a ZMTP 1.0 peer's frames: each
connection of junk would become queued messages."""


Secure = Callable[[zmq.asyncio.Socket], None]
"""Configures a socket before it binds (ZMQ CURVE server options, see ``transfer_engine.transport.security``)."""

Handler = Callable[[m.AnyMessage, bytes, str], Awaitable[None]]
"""Called with each decoded message, the ROUTER identity it came from (to reply) and its source
(``endpoint<-identity``, for logs)."""


def bind_router(
    ctx: zmq.asyncio.Context,
    host: str,
    port: int,
    *,
    hwm: int,
    max_frame: int,
    secure: Secure | None,
    setting: str = "the port",
) -> tuple[zmq.asyncio.Socket, int]:
    """A ROUTER bound at ``tcp://host:port`` (port 0: a free one), and the port it got.

    It never reads a frame over ``max_frame`` bytes (libzmq drops the connection that sends one,
    before buffering it), queues at most :func:`inbound_hwm` messages per peer, and ``hwm`` replies
    per peer. ZMTP 1.0 peers are refused at the handshake (:data:`ZMTP3_ONLY`), so a connection of
    junk bytes queues nothing; ``secure`` may set its own ZAP domain (CURVE refuses them too).

    Raises, the socket closed: AddressInUseError when another socket holds the address (naming
    ``setting``, the configuration field that chose the port), BindError when it cannot be bound
    otherwise (not an address of this machine...), PeerUnreachableError when it cannot be secured.
    """
    sock = ctx.socket(zmq.ROUTER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, inbound_hwm(max_frame))
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZMTP3_ONLY)
        if secure is not None:
            secure(sock)
        if port:
            sock.bind(f"tcp://{host}:{port}")
        else:
            port = sock.bind_to_random_port(f"tcp://{host}")
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        address = f"tcp://{host}:{port or '*'}"
        if exc.errno == errno.EADDRINUSE:
            raise AddressInUseError(
                address,
                f"{os.strerror(exc.errno)}: another engine or process listens there "
                f"(set {setting} to another port, or stop it)",
            ) from exc
        raise BindError(address, os.strerror(exc.errno) if exc.errno else str(exc)) from exc
    except TransportError as exc:
        sock.close(linger=0)
        raise PeerUnreachableError(f"tcp://{host}:{port}", f"cannot secure the socket: {exc}") from exc
    return sock, port


def source_of(endpoint: str, ident: bytes) -> str:
    """How logs name a message's sender: the endpoint it reached and the ROUTER identity of the peer."""
    return f"{endpoint}<-{ident.hex()}"


class Inbox:
    """Reads one ROUTER and keeps its endpoint's ``dropped`` counts; see the module docstring.

    ``dropped`` is exact. The log is bounded (:class:`~transfer_engine.runtime.logbook.LogBook` on the
    owner's logger ``log``, so each endpoint's lines stay under its name): the first drop of a kind
    in full, then one "N more" line per kind and interval, however fast frames come.
    """

    def __init__(self, name: str, log: logging.Logger) -> None:
        self.name = name
        self.dropped: Counter[str] = Counter()
        self.book = LogBook(log, name)

    def drop(self, kind: str, source: str, detail: str) -> None:
        """Count one refused message under ``kind``; log it (bounded) with where it came from."""
        self.dropped[kind] += 1
        self.book.note(kind, "%s: dropped %s message from %s: %s", self.name, kind, source, detail)

    async def serve(self, router: zmq.asyncio.Socket, endpoint: str, handle: Handler) -> NoReturn:
        """Hand every well-formed message on ``router`` to ``handle`` until cancelled; drop the rest.

        On the way out (cancelled) the drop summaries still pending are written.
        """
        try:
            await self._serve(router, endpoint, handle)
        finally:
            self.book.close()

    async def _serve(self, router: zmq.asyncio.Socket, endpoint: str, handle: Handler) -> NoReturn:
        limit = router.getsockopt(zmq.MAXMSGSIZE)  # the endpoint's frame cap (bind_router)
        assert isinstance(limit, int) and limit > 0
        # Read through a plain view of the socket, woken by the loop's reader on its ZMQ_FD and
        # drained with non-blocking receives: no Future per message. A zmq.asyncio receive cost a
        # request 60-80 us more on the CPU box (tools/bench_channels.py; docs/DECISIONS.md, "Per-room
        # requests stay on the control ROUTER, read without zmq.asyncio").
        sock: zmq.Socket[bytes] = zmq.Socket.shadow(router.underlying)
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                await _readable(sock)
                continue
            self.book.flush()  # any traffic writes the summaries of windows that are over
            source = source_of(endpoint, frames[0]) if frames else f"{endpoint}<-?"
            if len(frames) != 2:
                self.drop("bad_frames", source, f"{len(frames)} frames")
                continue
            try:
                message = m.decode(frames[1], limit=limit)
            except RemoteProtocolError as exc:
                self.drop("malformed", source, str(exc))
                continue
            await handle(message, frames[0], source)


async def _readable(sock: zmq.Socket[bytes]) -> None:
    """Return once ``sock`` may have a message to read.

    ZMQ_FD is edge-like: it turns readable when the socket's state may have changed, and asking for
    ZMQ_EVENTS resets it. So EVENTS is asked first (a message may be waiting already, the FD quiet),
    and the loop's reader is added only around the wait, with no await in between: a zmq.asyncio
    view of the same socket (its replies) may register its own reader on the FD meanwhile, which
    this one then replaces for as long as it waits.
    """
    if int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
        return
    loop = asyncio.get_running_loop()
    fd = int(sock.getsockopt(zmq.FD))
    woken = anyio.Event()
    loop.add_reader(fd, woken.set)
    try:
        await woken.wait()
    finally:
        loop.remove_reader(fd)
