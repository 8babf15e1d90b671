"""Introspect actor: the rank's state-dump endpoint (``transfer-engine dump``).

One ROUTER bound at ``tcp://{host}:{port}`` (loopback unless the engine's ``host`` says otherwise;
port 0 picks a free one) answers each ``DumpRequest`` with a ``DumpReply`` carrying the msgpack
bytes of a :class:`~transfer_engine.observe.Snapshot`. Frames are read, decoded and refused as
on every ROUTER endpoint of the rank (:mod:`transfer_engine.actors.router`: frames over
``INTROSPECT_MAX_FRAME`` are never read); malformed frames and
messages other than ``DumpRequest`` are logged with their source, counted in ``dropped`` and
dropped. Building a snapshot only reads engine state on the event-loop thread, so a dump never
races the actors it describes; a snapshot that cannot be built is logged and counted, and never
takes the engine down.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

import anyio
import zmq
import zmq.asyncio
from anyio.abc import TaskStatus

from transfer_engine.actors.router import INTROSPECT_MAX_FRAME, Inbox, Secure, bind_router
from transfer_engine.errors import TransportError
from transfer_engine.observe import Snapshot, encode_snapshot
from transfer_engine.protocol import messages as m

log = logging.getLogger(__name__)

SnapshotSource = Callable[[int | None], Snapshot]
"""Builds a snapshot, of one room when given its id (``build_snapshot`` bound to the engine)."""

_HWM = 100


class Introspect:
    """Owns the introspection ROUTER and its ZMQ context; see the module docstring."""

    def __init__(
        self,
        host: str,
        port: int,
        snapshot: SnapshotSource,
        *,
        name: str = "introspect",
        secure: Secure | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.name = name
        self._snapshot = snapshot
        self._secure = secure
        self._ctx: zmq.asyncio.Context | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._inbox = Inbox(name, log)
        self.dropped: Counter[str] = self._inbox.dropped
        """Frames dropped, by kind: ``bad_frames``, ``malformed``, ``unexpected``, ``snapshot_failed``."""
        self.served = 0
        self.endpoint = ""

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Bind, report ready, then answer dumps until cancelled; the socket closes on the way out."""
        self._ctx = zmq.asyncio.Context()
        try:
            router, self.port = bind_router(
                self._ctx,
                self.host,
                self.port,
                hwm=_HWM,
                max_frame=INTROSPECT_MAX_FRAME,
                secure=self._secure,
                setting="introspect_port",
            )
        except TransportError:  # BindError, or PeerUnreachableError when it cannot be secured
            self.close()
            raise
        self._router = router
        self.endpoint = f"tcp://{self.host}:{self.port}"
        task_status.started()
        try:
            await self._inbox.serve(router, self.endpoint, self._answer)
        finally:
            self.close()

    async def _answer(self, message: m.AnyMessage, ident: bytes, source: str) -> None:
        if not isinstance(message, m.DumpRequest):
            self._inbox.drop("unexpected", source, f"{type(message).__name__} is not a DumpRequest")
            return
        try:
            payload = encode_snapshot(self._snapshot(message.room))
        except Exception:  # a bug in building the dump must not take the engine down
            self.dropped["snapshot_failed"] += 1
            log.exception("%s: building a snapshot for %s failed", self.name, source)
            return
        assert self._router is not None
        await self._router.send_multipart([ident, m.encode(m.DumpReply(snapshot=payload))])
        self.served += 1

    def close(self) -> None:
        if self._router is not None:
            self._router.close(linger=0)
            self._router = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
