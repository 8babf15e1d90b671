"""Landing notices between the processes of one host, by Unix datagram (docs/DECISIONS.md, "Landing
notices between processes of one host go by datagram").

A control message over ZMQ passes through an I/O thread on each side: the sender's call hands it to
its context's thread, which writes the TCP socket; the receiver's thread reads it and wakes the
receiving loop. A Unix datagram is one ``sendto`` into the receiver's socket queue and one wake of the
receiving loop. Only landing notices (``ChunkLanded``, ``AuxLanded``: what the kernel path sends once
its copy completed) take this way: they need no order with the other control messages, as the NIXL
paths' own notifications have none (they ride on NIXL, beside ZMQ).

Names: a rank that receives binds ``name_of(endpoint)`` (made once per endpoint), a name in Linux's abstract namespace made
from its control endpoint, so a peer that knows the endpoint knows the name, and a peer on another
host (or in another network namespace) finds no such name and sends over ZMQ as before. The name goes
with the socket when its process ends.

Sending never blocks and never raises: :meth:`LocalNotices.send` says whether the datagram was taken;
when it was not (no such name: the peer is not on this host; its queue is full: the receiver is
busy; anything else), the caller sends over ZMQ instead. A name that is not on this host is
remembered, so the datagram is tried once per peer endpoint, not once per message.

Anyone on the host (in the network namespace) can send to the name, as anyone who reaches the
control port can send to the ROUTER: the receiver decodes datagrams with the same typed decoder and
drops what is malformed or not a landing notice, and the channel is off when CURVE is on (a datagram
carries no CURVE authentication).
"""

from __future__ import annotations

import asyncio
import errno
import functools
import hashlib
import logging
import socket
import sys

import anyio

log = logging.getLogger(__name__)

MAX_DATAGRAM = 8192
"""Largest datagram read whole (a landing notice is under 200 bytes; the decoder refuses anything over
``MAX_NOTIF_BYTES``, 4 KiB); a longer one is cut here, and refused."""

_GONE = (errno.ENOENT, errno.ECONNREFUSED)
"""What ``sendto`` says when no socket has the name: the peer is not on this host (or has ended)."""


@functools.lru_cache(maxsize=4096)
def name_of(endpoint: str) -> bytes:
    """The abstract socket name of the rank whose control endpoint is ``endpoint``."""
    return b"\0transfer-engine/" + hashlib.sha256(endpoint.encode()).hexdigest()[:32].encode()


def supported() -> bool:
    """Abstract Unix socket names exist on Linux only."""
    return sys.platform.startswith("linux")


class LocalNotices:
    """One rank's datagram socket: bound at ``name_of(endpoint)`` to receive (``bind=True``), and the
    socket its sends go from. Close it with :meth:`close`."""

    def __init__(self, endpoint: str, *, bind: bool) -> None:
        self.endpoint = endpoint
        self._not_here: set[str] = set()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self.bound = False
        if bind:
            try:
                self._sock.bind(name_of(endpoint))
                self.bound = True
            except OSError as exc:  # the name is taken (another rank of this endpoint?), or no abstract names
                log.info("landing notices for %s go over ZMQ only: %s", endpoint, exc)

    def send(self, endpoint: str, payload: bytes) -> bool | None:
        """Send ``payload`` to the rank at ``endpoint`` if it is on this host. True: sent; False: it is
        on this host but the datagram was not taken (its queue is full, or another error); None: it is
        not on this host. Either way but True, the caller sends over ZMQ."""
        if endpoint in self._not_here:
            return None
        try:
            self._sock.sendto(payload, name_of(endpoint))
        except OSError as exc:
            if exc.errno in _GONE:
                self._not_here.add(endpoint)
                return None
            return False  # EAGAIN (its queue is full), EMSGSIZE, ...: this one goes over ZMQ
        return True

    def forget(self, endpoint: str) -> None:
        """A peer went away: its endpoint is tried afresh (a restarted peer may be on this host)."""
        self._not_here.discard(endpoint)

    def receive(self) -> bytes | None:
        """One waiting datagram, or None when none waits."""
        try:
            return self._sock.recv(MAX_DATAGRAM)
        except BlockingIOError:
            return None

    async def readable(self) -> None:
        """Return once a datagram may be waiting."""
        loop = asyncio.get_running_loop()
        woken = anyio.Event()
        fd = self._sock.fileno()
        loop.add_reader(fd, woken.set)
        try:
            await woken.wait()
        finally:
            loop.remove_reader(fd)

    def close(self) -> None:
        self._sock.close()
