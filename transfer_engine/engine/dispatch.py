"""Wire message dispatch: the Control actor hands every message it accepted to :meth:`Dispatch.route`.

Requests and aborts for rooms not open yet are stashed (:mod:`transfer_engine.protocol.stash`);
those for rooms that ended are answered from the tombstones (:mod:`transfer_engine.protocol.retransmit`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from transfer_engine.config import EngineConfig
from transfer_engine.engine.started import Started, send_owed
from transfer_engine.errors import FailureReason
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.retransmit import Ended, Late, Tombstones, answer_late_request
from transfer_engine.protocol.rooms import RoomStatus
from transfer_engine.protocol.stash import EarlyRequests
from transfer_engine.runtime.ports import PeerBook, RankIdentity, RoomBoard


class Dispatch:
    """Routes each control message to the room, worker or ring it is for, or answers it here.

    Given the books it reads and writes (the room board, the peer book, the early-request stash, the
    tombstones of ended rooms, the counters), the running actors, and the two answers other parts
    give: ``hello`` (the handshake's answer to a PeerHello) and ``held_by`` (liveness: a peer's
    heartbeat lists rooms it holds).
    """

    def __init__(
        self,
        config: EngineConfig,
        me: RankIdentity,
        started: Started,
        *,
        board: RoomBoard,
        peers: PeerBook,
        stash: EarlyRequests,
        tombstones: Tombstones,
        counters: Counter[str],
        hello: Callable[[m.PeerHello], m.PeerHelloAck],
        held_by: Callable[[str, list[int] | None, float], None],
    ) -> None:
        self.config = config
        self.me = me
        self._started = started
        self.board = board
        self.peers = peers
        self._stash = stash
        self.tombstones = tombstones
        self.counters = counters
        self._hello = hello
        self._held_by = held_by

    async def route(self, message: m.AnyMessage, ident: bytes) -> None:
        """Handle one message Control accepted (``ident``: the ROUTER identity it came from)."""
        self.me.trace.mark_mail("in", message)
        control = self._started.control
        match message:
            case m.PeerHello() if self.config.role == "prefill":
                await control.reply_to(ident, self._hello(message))
            case m.TransferRequest(agent=agent, room=room) if agent not in self.peers:
                # every decode rank says PeerHello before it asks for rooms: this one is forged or stale
                control.count_drop(
                    "TransferRequest", ident, f"room {room} from {agent!r}, which never said PeerHello"
                )
            case m.TransferRequest(room=room, agent=agent, decode_rank=rank) if self.config.role == "prefill":
                ended = self.tombstones.get(room, time.monotonic())
                if (
                    answer_late_request(ended, agent, rank) is not Late.STASH
                ):  # a repeat, or overtaken by its room's end
                    assert ended is not None
                    self._answer_late(room, agent, rank, ended)
                elif not await self.board.deliver(room, message) and not self._stash.add(
                    room, message, time.monotonic()
                ):
                    self.counters["requests_repeated"] += 1
            case m.Abort(room=room, agent=agent, rank=rank) if self.config.role == "prefill":
                if not await self.board.deliver(room, message):
                    peer = self.peers.get(agent)
                    if peer is not None:
                        if self.tombstones.get(room, time.monotonic()) is None:
                            self.tombstones.put(room, Ended(
                                RoomStatus.FAILED, FailureReason.ABORTED, f"aborted by decode {agent} before "
                                f"prefill rank {self.config.tp_rank} opened it: {message.detail}",
                                time.monotonic(), opened=False, aborted_by=frozenset({agent}),
                                askers=self._stash.askers(room) | {rank: agent},
                            ))  # fmt: skip
                        send_owed(
                            self._started,
                            self.peers,
                            self._stash.abort(
                                room, message, agent=self.me.agent_name, rank=self.config.tp_rank
                            ),
                        )
                        control.send(
                            peer.endpoint,
                            m.AbortAck(room=room, agent=self.me.agent_name, rank=self.config.tp_rank),
                        )
                    else:
                        control.count_drop(
                            "Abort", ident, f"abort of room {room} from unknown agent {agent} (rank {rank})"
                        )
            case m.StagingRequest() if self._started.ring is not None:
                await self._started.ring.inbox.send(message)
            case m.StagingGrant(agent=agent) | m.StagingRefused(agent=agent) | m.Watermark(agent=agent) if (
                self.config.role == "prefill"
            ):
                await self._started.worker_for(agent).inbox.send(message)
            case m.RoomFailed(room=room) | m.AbortAck(room=room):
                if not await self.board.deliver(room, message):
                    self.counters["late_messages"] += 1
            case m.ChunkLanded(room=room) | m.AuxLanded(room=room) if self.config.role == "decode":
                # the kernel path's notification (actors/worker/kernel.py): handled as NIXL's would be
                self.counters["kernel_notifs"] += 1
                if not await self.board.deliver(room, message):
                    self.counters["notifs_unrouted"] += 1
            case m.Heartbeat(agent=agent):
                peer = self.peers.get(agent)
                if peer is not None:
                    peer.last_seen = time.monotonic()
                    self._held_by(agent, message.rooms, peer.last_seen)
            case _:
                control.count_drop(
                    type(message).__name__, ident, f"not accepted by a {self.config.role} engine"
                )

    def _answer_late(self, room: int, agent: str, rank: int, ended: Ended) -> None:
        """Answer a TransferRequest for ``room``, which is no longer live here (protocol.retransmit)."""
        peer = self.peers.get(agent)
        if answer_late_request(ended, agent, rank) is not Late.TELL_FAILURE or peer is None:
            self.counters["requests_repeated"] += 1
            return
        assert ended.reason is not None
        self._started.control.send(
            peer.endpoint,
            m.RoomFailed(room=room, agent=self.me.agent_name, rank=self.config.tp_rank,
                         reason=int(ended.reason), detail=ended.detail),
        )  # fmt: skip
