"""Bootstrap actor: the prefill instance's registry of ranks.

A ZMQ ROUTER on ``bootstrap_port`` (hosted by prefill rank 0 unless configured otherwise). Prefill
ranks announce themselves with ``RegisterRank``; decode ranks ask ``TopologyQuery`` and get the
ranks registered so far, with ``complete`` once every rank of the TP group is in. A rank that
re-registers (a restarted process) replaces its old entry. Ranks whose TP size or layout differ
from the first registration are refused. With a :class:`~transfer_engine.transport.security.Curve` the
ROUTER is a CURVE server: only holders of an allowed key can register or ask.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING

import anyio
import zmq
import zmq.asyncio
from anyio.abc import TaskStatus

from transfer_engine.actors.router import BOOTSTRAP_MAX_FRAME, Inbox, bind_router
from transfer_engine.errors import TransportError
from transfer_engine.protocol import messages as m

if TYPE_CHECKING:
    from transfer_engine.transport.security import Curve

log = logging.getLogger(__name__)

_HWM = 1000
"""libzmq's default high-water mark: the registry kept it before it shared :func:`bind_router`."""


class Bootstrap:
    """See the module docstring. ``ranks`` maps rank -> its control endpoint.

    Frames are read and refused as on every ROUTER of the rank (:mod:`transfer_engine.actors.router`);
    ``dropped`` counts ``bad_frames``, ``malformed`` and, by type name, messages it does not serve.
    """

    def __init__(self, host: str, port: int, *, curve: Curve | None = None) -> None:
        self.host = host
        self.port = port
        self.curve = curve
        self.tp_size: int | None = None
        self.compat: int | None = None
        self.ranks: dict[int, str] = {}
        self._inbox = Inbox("bootstrap", log)
        self.dropped: Counter[str] = self._inbox.dropped
        self._ctx = zmq.asyncio.Context()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Bind, report ready, then answer until cancelled; the socket and context close on the way out."""
        secure = None if self.curve is None else self.curve.server
        try:
            sock, self.port = bind_router(
                self._ctx,
                self.host,
                self.port,
                hwm=_HWM,
                max_frame=BOOTSTRAP_MAX_FRAME,
                secure=secure,
                setting="bootstrap_port",
            )
        except TransportError:  # BindError, or PeerUnreachableError when it cannot be secured
            self._ctx.term()
            raise

        async def answer(message: m.AnyMessage, ident: bytes, source: str) -> None:
            reply = self.handle(message)
            if reply is None:
                self._inbox.drop(type(message).__name__, source, "not a bootstrap message")
                return
            await sock.send_multipart([ident, m.encode(reply)])

        task_status.started()
        try:
            await self._inbox.serve(sock, f"tcp://{self.host}:{self.port}", answer)
        finally:
            sock.close(linger=0)
            self._ctx.term()

    def handle(self, message: m.AnyMessage) -> m.Message | None:
        """The answer to one message (pure: no I/O), or None for messages it does not serve.

        A DumpRequest is for an engine's introspection endpoint; one sent here (the wrong port) is
        answered with the topology, so that ``transfer-engine dump`` can say what it reached."""
        match message:
            case m.RegisterRank(rank=rank, tp_size=tp_size, endpoint=endpoint, compat=compat):
                if self.tp_size is None:
                    self.tp_size, self.compat = tp_size, compat
                if tp_size != self.tp_size:
                    return m.RegisterAck(ok=False, detail=f"tp_size={tp_size}, instance has {self.tp_size}")
                if compat != self.compat:
                    return m.RegisterAck(ok=False, detail=f"rank {rank} layout differs from rank 0's")
                if not 0 <= rank < tp_size:
                    return m.RegisterAck(ok=False, detail=f"rank {rank} outside [0, {tp_size})")
                if self.ranks.get(rank) not in (None, endpoint):
                    log.info("bootstrap: prefill rank %d re-registered at %s", rank, endpoint)
                self.ranks[rank] = endpoint
                return m.RegisterAck(ok=True)
            case m.TopologyQuery() | m.DumpRequest():
                ranks = [m.RankInfo(r, e) for r, e in sorted(self.ranks.items())]
                tp = self.tp_size or 0
                return m.Topology(tp_size=tp, ranks=ranks, complete=tp > 0 and len(ranks) == tp)
        return None
