"""Control actor: the ZMQ sockets of one rank.

One ROUTER bound at the rank's control endpoint receives every message peers send; each is decoded
with the one typed decoder and handed to ``dispatch``. Malformed, oversized and unknown frames are
logged with their source, counted in ``dropped`` and dropped (the guard every ROUTER endpoint
shares, :mod:`transfer_engine.actors.router`); the actor keeps serving. A message whose dispatch
raises is dropped too (counted as ``dispatch_error``, logged with its traceback): that is a bug of
the engine, but one message must never take a rank down.

Outgoing one-way messages go through one cached DEALER per peer endpoint (:meth:`send`, never
blocks: a full queue drops and counts). Request/response exchanges (topology, handshake,
registration) use a short-lived DEALER whose answer comes back on it (:meth:`request`).

Landing notices (``ChunkLanded``, ``AuxLanded``) to a peer of this host go by Unix datagram when
``local_notices`` is on and CURVE is off (:mod:`transfer_engine.transport.local`): a rank that
receives them (``receives_notices``: a decode rank) binds a datagram socket named from its control
endpoint, reads it beside the ROUTER with the same decoder and
drop counts (taking only landing notices, as NIXL's notifications are decoded: anything else is
dropped as ``malformed``), and
:meth:`send` tries a notice's datagram before the peer's DEALER.

With a :class:`~transfer_engine.transport.security.Curve` every socket is secured: the ROUTER is a CURVE
server that accepts only allowed clients, every DEALER a CURVE client. Tests may set ``faults`` (a
:class:`~transfer_engine.transport.faults.ControlFaults`) at any time to delay, drop, duplicate or
reorder what :meth:`send` sends; held messages go out from a small task of :meth:`run`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import anyio
import zmq
import zmq.asyncio
from anyio.abc import TaskStatus

from transfer_engine.actors.router import CONTROL_MAX_FRAME, Inbox, bind_router, source_of
from transfer_engine.errors import PeerUnreachableError, RemoteProtocolError, TransportError
from transfer_engine.protocol import messages as m
from transfer_engine.transport import local

if TYPE_CHECKING:
    from transfer_engine.transport.faults import ControlFaults
    from transfer_engine.transport.security import Curve

log = logging.getLogger(__name__)

Dispatch = Callable[[m.AnyMessage, bytes], Awaitable[None]]
"""Called with each decoded message and the ROUTER identity it came from (for :meth:`reply_to`)."""

_SEND_HWM = 10_000

LOCAL_KINDS = (m.ChunkLanded, m.AuxLanded)
"""The messages that go by datagram to a peer of this host (``m.decode_notification``'s kinds: the
only ones taken from it)."""

_S = TypeVar("_S", bound=zmq.Socket)


class Control:
    """Owns the rank's ZMQ context and sockets; see the module docstring."""

    def __init__(
        self,
        host: str,
        port: int,
        dispatch: Dispatch,
        *,
        name: str = "control",
        curve: Curve | None = None,
        faults: ControlFaults | None = None,
        local_notices: bool = True,
        receives_notices: bool = True,
    ) -> None:
        self.host = host
        self.port = port
        self.name = name
        self.curve = curve
        self.faults = faults
        """Test hook: faults applied to :meth:`send`; may be set at any time (clearing it drops the
        messages it still holds)."""
        self._dispatch = dispatch
        self._ctx = zmq.asyncio.Context()
        self._sync_ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(self._ctx.underlying)
        """The same context without asyncio wrapping, for the one-way DEALERs: an asyncio socket's
        ``send(NOBLOCK)`` does not raise ``Again`` on a full queue but hands it to a Future nobody
        awaits (the drop would go uncounted), and costs twice as much per message."""
        self._router: zmq.asyncio.Socket | None = None
        self._dealers: dict[str, zmq.Socket[bytes]] = {}
        self._held = anyio.Event()
        self._inbox = Inbox(name, log)
        self.dropped: Counter[str] = self._inbox.dropped
        """Messages dropped, by kind: ``bad_frames``, ``malformed``, ``dispatch_error``,
        ``send_queue_full``, ``send_failed``, and the kinds dispatchers give :meth:`count_drop`."""
        self.endpoint = ""
        self.counters: Counter[str] = Counter()
        """``local_notices``: landing notices sent by datagram; ``local_fallbacks``: those to a peer of
        this host that went over ZMQ after all (its queue was full, or another error)."""
        self._local_wanted = local_notices and curve is None and local.supported()
        self._receives_notices = receives_notices
        """Bind the datagram socket (a decode rank); else only send from one (a prefill rank)."""
        self.local: local.LocalNotices | None = None
        """The datagram socket of landing notices (None: off, or not started)."""

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        secure = None if self.curve is None else self.curve.server
        try:
            router, self.port = bind_router(
                self._ctx,
                self.host,
                self.port,
                hwm=_SEND_HWM,
                max_frame=CONTROL_MAX_FRAME,
                secure=secure,
                setting="control_port",
            )
        except TransportError:  # BindError, or PeerUnreachableError when it cannot be secured
            self._ctx.term()
            raise
        self._router = router
        self.endpoint = f"tcp://{self.host}:{self.port}"
        if self._local_wanted:
            self.local = local.LocalNotices(self.endpoint, bind=self._receives_notices)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._release_held)
                if self.local is not None and self.local.bound:
                    tg.start_soon(self._serve_local, self.local)
                task_status.started()
                await self._inbox.serve(router, self.endpoint, self._handle)
        finally:
            self.close()

    async def _handle(self, message: m.AnyMessage, ident: bytes, source: str) -> None:
        try:
            await self._dispatch(message, ident)
        except Exception:  # no message may take the rank down; the bug is in the log
            self.dropped["dispatch_error"] += 1
            self._inbox.book.note(
                "dispatch_error", "%s: %s from %s could not be handled; dropped",
                self.name, type(message).__name__, source, exc_info=True,
            )  # fmt: skip

    async def _serve_local(self, notices: local.LocalNotices) -> None:
        """Hand every landing notice that comes by datagram to the dispatch; drop the rest (counted
        as the ROUTER's drops are)."""
        source = f"{self.endpoint}<-local"
        while True:
            data = notices.receive()
            if data is None:
                await notices.readable()
                continue
            try:  # the decoder of NIXL's notifications: a landing notice, or refused
                message = m.decode_notification(data)
            except RemoteProtocolError as exc:
                self._inbox.drop("malformed", source, str(exc))
                continue
            await self._handle(message, b"", source)

    def count_drop(self, kind: str, ident: bytes, detail: str) -> None:
        """For dispatchers: record a decoded message that is not acceptable now."""
        self._inbox.drop(kind, source_of(self.endpoint, ident), detail)

    def _dealer(self) -> zmq.asyncio.Socket:
        return self._setup_dealer(self._ctx.socket(zmq.DEALER))

    def _setup_dealer(self, sock: _S) -> _S:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, _SEND_HWM)
        sock.setsockopt(zmq.RCVHWM, _SEND_HWM)
        if self.curve is not None:
            self.curve.client(sock)
        return sock

    def send(self, endpoint: str, message: m.Message) -> bool:
        """Queue ``message`` to the peer's ROUTER without blocking; False (counted) if it was dropped."""
        payload = m.encode(message)
        if self.faults is None:
            if self.local is not None and isinstance(message, LOCAL_KINDS):
                sent = self.local.send(endpoint, payload)
                if sent is not None:
                    self.counters["local_notices" if sent else "local_fallbacks"] += 1
                if sent:
                    return True
            return self._send(endpoint, payload, type(message).__name__)
        for target, data in self.faults.submit(endpoint, payload):
            self._send(target, data, type(message).__name__)
        self._held.set()
        return True

    def _send(self, endpoint: str, payload: bytes, what: str) -> bool:
        if self._router is None:
            return False
        sock = self._dealers.get(endpoint)
        if sock is None:
            try:
                sock = self._setup_dealer(self._sync_ctx.socket(zmq.DEALER))
            except zmq.ZMQError as exc:  # out of sockets or file descriptors
                self._inbox.drop("send_failed", endpoint, f"{what}: {exc}")
                return False
            try:
                sock.connect(endpoint)
            except zmq.ZMQError as exc:  # a malformed endpoint (peers announce their own)
                sock.close(linger=0)
                self._inbox.drop("send_failed", endpoint, f"{what}: {exc}")
                return False
            self._dealers[endpoint] = sock
        try:
            sock.send(payload, flags=zmq.NOBLOCK)
        except zmq.Again:
            self._inbox.drop("send_queue_full", endpoint, what)
            return False
        return True

    async def _release_held(self) -> None:
        """Send the messages ``faults`` held back, each once it is due (idle without faults)."""
        while True:
            self._held = anyio.Event()
            faults = self.faults
            due = None if faults is None else faults.next_due()
            if faults is None or due is None:
                await self._held.wait()
                continue
            with anyio.move_on_after(max(due - faults.clock(), 0.0)):
                await self._held.wait()
            for target, data in faults.due():
                self._send(target, data, "held message")

    def forget(self, endpoint: str) -> None:
        """Close the cached DEALER to a peer that went away (a restarted peer gets a fresh one)."""
        sock = self._dealers.pop(endpoint, None)
        if sock is not None:
            sock.close(linger=0)
        if self.local is not None:
            self.local.forget(endpoint)

    async def request(self, endpoint: str, message: m.Message, wait_s: float) -> m.AnyMessage:
        """Send ``message`` and wait for one answer; PeerUnreachableError after ``wait_s`` seconds."""
        sock = self._dealer()
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
        if self.local is not None:
            self.local.close()
            self.local = None
        for sock in self._dealers.values():
            sock.close(linger=0)
        self._dealers.clear()
        if self._router is not None:
            self._router.close(linger=0)
            self._router = None
        self._ctx.term()
