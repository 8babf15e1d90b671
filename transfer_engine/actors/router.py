"""The receiving side shared by a rank's ROUTER endpoints (:mod:`.control` and :mod:`.introspect`).

Anyone who can reach a rank's port can send to these sockets, so each must refuse hostile input in
the same way: never read a frame over :data:`MAX_FRAME_BYTES`, decode with the one typed decoder
of :mod:`transfer_engine.protocol.messages` (its size limit applies), and log, count and drop what
fails, then keep serving. Having one copy means a hardening of one endpoint is one of them all.

:func:`bind_router` makes the socket (the size cap, the high-water marks, CURVE through a
``secure`` callable, e.g. ``Curve.server``); an :class:`Inbox` reads it and hands every decoded
message on, and is also where the endpoint records the drops its handler decides on.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import NoReturn

import zmq
import zmq.asyncio

from transfer_engine.errors import PeerUnreachableError, RemoteProtocolError, TransportError
from transfer_engine.logbook import LogBook
from transfer_engine.protocol import messages as m

MAX_FRAME_BYTES = 4 * m.MAX_MESSAGE_BYTES
"""ROUTERs never read a frame larger than this: libzmq drops the connection that sends one, so a peer
cannot make a rank allocate without bound. Frames between the message limit and this are read,
counted as malformed and dropped."""

INBOUND_HWM = 1000
"""Most messages a ROUTER queues from one connected peer before libzmq stops reading that peer's
socket (TCP then pushes back on the sender). It bounds what a peer that sends faster than the rank
reads can make the rank hold: ``INBOUND_HWM`` messages per connection (flood figures in
docs/RELIABILITY.md). Honest peers' bursts fit: a rank reads its ROUTER continuously."""

Secure = Callable[[zmq.asyncio.Socket], None]
"""Configures a socket before it binds (ZMQ CURVE server options, see ``transfer_engine.security``)."""

Handler = Callable[[m.AnyMessage, bytes, str], Awaitable[None]]
"""Called with each decoded message, the ROUTER identity it came from (to reply) and its source
(``endpoint<-identity``, for logs)."""


def bind_router(
    ctx: zmq.asyncio.Context, host: str, port: int, *, hwm: int, secure: Secure | None
) -> tuple[zmq.asyncio.Socket, int]:
    """A ROUTER bound at ``tcp://host:port`` (port 0: a free one), and the port it got.

    Raises PeerUnreachableError, the socket closed, when it cannot be secured or bound.
    """
    sock = ctx.socket(zmq.ROUTER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, min(hwm, INBOUND_HWM))
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        if secure is not None:
            secure(sock)
        if port:
            sock.bind(f"tcp://{host}:{port}")
        else:
            port = sock.bind_to_random_port(f"tcp://{host}")
    except (zmq.ZMQError, TransportError) as exc:
        sock.close(linger=0)
        raise PeerUnreachableError(f"tcp://{host}:{port}", f"cannot bind: {exc}") from exc
    return sock, port


def source_of(endpoint: str, ident: bytes) -> str:
    """How logs name a message's sender: the endpoint it reached and the ROUTER identity of the peer."""
    return f"{endpoint}<-{ident.hex()}"


class Inbox:
    """Reads one ROUTER and keeps its endpoint's ``dropped`` counts; see the module docstring.

    ``dropped`` is exact. The log is bounded (:class:`~transfer_engine.logbook.LogBook` on the
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
        while True:
            frames = await router.recv_multipart(copy=True)
            self.book.flush()  # any traffic writes the summaries of windows that are over
            source = source_of(endpoint, frames[0]) if frames else f"{endpoint}<-?"
            if len(frames) != 2:
                self.drop("bad_frames", source, f"{len(frames)} frames")
                continue
            try:
                message = m.decode(frames[1])
            except RemoteProtocolError as exc:
                self.drop("malformed", source, str(exc))
                continue
            await handle(message, frames[0], source)
