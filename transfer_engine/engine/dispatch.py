"""Wire message dispatch: the Control actor hands every message it accepted to :meth:`Dispatch._dispatch`.

Requests and aborts for rooms not open yet are stashed (:mod:`transfer_engine.protocol.stash`);
those for rooms that ended are answered from the tombstones (:mod:`transfer_engine.protocol.retransmit`).
"""

from __future__ import annotations

import time

from transfer_engine.engine.state import EngineState
from transfer_engine.errors import FailureReason
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.retransmit import Ended, Late, answer_late_request
from transfer_engine.protocol.rooms import RoomStatus
from transfer_engine.runtime.mail import RoomMail


class Dispatch(EngineState):
    """Routes each control message to the room, worker or ring it is for, or answers it here."""

    async def _to_room(self, room: int, mail: RoomMail) -> bool:
        return await self.board.deliver(room, mail)

    async def _dispatch(self, message: m.AnyMessage, ident: bytes) -> None:
        self.me.trace.mark_mail("in", message)
        match message:
            case m.PeerHello() if self.config.role == "prefill":
                await self.control.reply_to(ident, self._on_peer_hello(message))
            case m.TransferRequest(agent=agent, room=room) if agent not in self.peers:
                # every decode rank says PeerHello before it asks for rooms: this one is forged or stale
                self.control.count_drop(
                    "TransferRequest", ident, f"room {room} from {agent!r}, which never said PeerHello"
                )
            case m.TransferRequest(room=room, agent=agent, decode_rank=rank) if self.config.role == "prefill":
                ended = self.tombstones.get(room, time.monotonic())
                if (
                    answer_late_request(ended, agent, rank) is not Late.STASH
                ):  # a repeat, or overtaken by its room's end
                    assert ended is not None
                    self._answer_late(room, agent, rank, ended)
                elif not await self._to_room(room, message) and not self._stash.add(
                    room, message, time.monotonic()
                ):
                    self.counters["requests_repeated"] += 1
            case m.Abort(room=room, agent=agent, rank=rank) if self.config.role == "prefill":
                if not await self._to_room(room, message):
                    peer = self.peers.get(agent)
                    if peer is not None:
                        if self.tombstones.get(room, time.monotonic()) is None:
                            self.tombstones.put(room, Ended(
                                RoomStatus.FAILED, FailureReason.ABORTED, f"aborted by decode {agent} before "
                                f"prefill rank {self.config.tp_rank} opened it: {message.detail}",
                                time.monotonic(), opened=False, aborted_by=frozenset({agent}),
                                askers=self._stash.askers(room) | {rank: agent},
                            ))  # fmt: skip
                        self._answer(
                            self._stash.abort(room, message, agent=self.agent_name, rank=self.config.tp_rank)
                        )
                        self.control.send(
                            peer.endpoint,
                            m.AbortAck(room=room, agent=self.agent_name, rank=self.config.tp_rank),
                        )
                    else:
                        self.control.count_drop(
                            "Abort", ident, f"abort of room {room} from unknown agent {agent} (rank {rank})"
                        )
            case m.StagingRequest() if self.ring is not None:
                await self.ring.inbox.send(message)
            case m.StagingGrant(agent=agent) | m.StagingRefused(agent=agent) | m.Watermark(agent=agent) if (
                self.config.role == "prefill"
            ):
                await self.worker_for(agent).inbox.send(message)
            case m.RoomFailed(room=room) | m.AbortAck(room=room):
                if not await self._to_room(room, message):
                    self.counters["late_messages"] += 1
            case m.Heartbeat(agent=agent):
                peer = self.peers.get(agent)
                if peer is not None:
                    peer.last_seen = time.monotonic()
                    self._held_by(agent, message.rooms, peer.last_seen)
            case _:
                self.control.count_drop(
                    type(message).__name__, ident, f"not accepted by a {self.config.role} engine"
                )

    def _answer_late(self, room: int, agent: str, rank: int, ended: Ended) -> None:
        """Answer a TransferRequest for ``room``, which is no longer live here (protocol.retransmit)."""
        peer = self.peers.get(agent)
        if answer_late_request(ended, agent, rank) is not Late.TELL_FAILURE or peer is None:
            self.counters["requests_repeated"] += 1
            return
        assert ended.reason is not None
        self.control.send(
            peer.endpoint,
            m.RoomFailed(room=room, agent=self.agent_name, rank=self.config.tp_rank,
                         reason=int(ended.reason), detail=ended.detail),
        )  # fmt: skip

    def _answer(self, answers: list[tuple[str, m.RoomFailed]]) -> None:
        """Send each (decode agent, RoomFailed) the stash owes; agents no longer known are skipped."""
        for agent, message in answers:
            peer = self.peers.get(agent)
            if peer is not None:
                self.control.send(peer.endpoint, message)
