"""Control actor: the ZMQ sockets of one rank.

One ROUTER bound at the rank's control endpoint receives every message peers send; each is decoded
with the one typed decoder and handed to ``dispatch``. Malformed, oversized and unknown frames are
logged with their source, counted in ``dropped`` and dropped; the actor keeps serving.

Outgoing one-way messages go through one cached DEALER per peer endpoint (:meth:`send`, never
blocks: a full queue drops and counts). Request/response exchanges (topology, handshake,
registration) use a short-lived DEALER whose answer comes back on it (:meth:`request`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable

import anyio
import zmq
import zmq.asyncio
from anyio.abc import TaskStatus

from transfer_engine.errors import PeerUnreachableError, RemoteProtocolError
from transfer_engine.protocol import messages as m

log = logging.getLogger(__name__)

Dispatch = Callable[[m.AnyMessage, bytes], Awaitable[None]]
"""Called with each decoded message and the ROUTER identity it came from (for :meth:`reply_to`)."""

_SEND_HWM = 10_000


def _configure(sock: zmq.asyncio.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, _SEND_HWM)
    sock.setsockopt(zmq.RCVHWM, _SEND_HWM)


class Control:
    """Owns the rank's ZMQ context and sockets; see the module docstring."""

    def __init__(self, host: str, port: int, dispatch: Dispatch, *, name: str = "control") -> None:
        self.host = host
        self.port = port
        self.name = name
        self._dispatch = dispatch
        self._ctx = zmq.asyncio.Context()
        self._router: zmq.asyncio.Socket | None = None
        self._dealers: dict[str, zmq.asyncio.Socket] = {}
        self.dropped: Counter[str] = Counter()
        self.endpoint = ""

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        router = self._ctx.socket(zmq.ROUTER)
        _configure(router)
        try:
            if self.port:
                router.bind(f"tcp://{self.host}:{self.port}")
            else:
                self.port = router.bind_to_random_port(f"tcp://{self.host}")
        except zmq.ZMQError as exc:
            router.close()
            raise PeerUnreachableError(f"tcp://{self.host}:{self.port}", f"cannot bind: {exc}") from exc
        self._router = router
        self.endpoint = f"tcp://{self.host}:{self.port}"
        task_status.started()
        try:
            while True:
                frames = await router.recv_multipart(copy=True)
                await self._handle(frames)
        finally:
            self.close()

    async def _handle(self, frames: list[bytes]) -> None:
        source = f"{self.endpoint}<-{frames[0].hex() if frames else '?'}"
        if len(frames) != 2:
            self._drop("bad_frames", source, f"{len(frames)} frames")
            return
        try:
            message = m.decode(frames[1])
        except RemoteProtocolError as exc:
            self._drop("malformed", source, str(exc))
            return
        await self._dispatch(message, frames[0])

    def _drop(self, kind: str, source: str, detail: str) -> None:
        self.dropped[kind] += 1
        log.warning("%s: dropped %s message from %s: %s", self.name, kind, source, detail)

    def count_drop(self, kind: str, ident: bytes, detail: str) -> None:
        """For dispatchers: record a decoded message that is not acceptable now."""
        self._drop(kind, f"{self.endpoint}<-{ident.hex()}", detail)

    def send(self, endpoint: str, message: m.Message) -> bool:
        """Queue ``message`` to the peer's ROUTER without blocking; False (counted) if it was dropped."""
        sock = self._dealers.get(endpoint)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            _configure(sock)
            sock.connect(endpoint)
            self._dealers[endpoint] = sock
        try:
            sock.send(m.encode(message), flags=zmq.NOBLOCK)
        except zmq.Again:
            self._drop("send_queue_full", endpoint, type(message).__name__)
            return False
        return True

    def forget(self, endpoint: str) -> None:
        """Close the cached DEALER to a peer that went away (a restarted peer gets a fresh one)."""
        sock = self._dealers.pop(endpoint, None)
        if sock is not None:
            sock.close(linger=0)

    async def request(self, endpoint: str, message: m.Message, wait_s: float) -> m.AnyMessage:
        """Send ``message`` and wait for one answer; PeerUnreachableError after ``wait_s`` seconds."""
        sock = self._ctx.socket(zmq.DEALER)
        _configure(sock)
        try:
            sock.connect(endpoint)
            await sock.send(m.encode(message))
            with anyio.move_on_after(wait_s):
                reply = await sock.recv()
                return m.decode(reply)
            raise PeerUnreachableError(endpoint, f"no answer to {type(message).__name__} within {wait_s} s")
        finally:
            sock.close(linger=0)

    async def reply_to(self, ident: bytes, message: m.Message) -> None:
        assert self._router is not None
        await self._router.send_multipart([ident, m.encode(message)])

    def close(self) -> None:
        for sock in self._dealers.values():
            sock.close(linger=0)
        self._dealers.clear()
        if self._router is not None:
            self._router.close(linger=0)
            self._router = None
        self._ctx.term()
