"""Liveness: heartbeats, peer leases and room leases (:mod:`transfer_engine.protocol.leases`), peer
death, peers that leave (PeerLeaving), stale stashed requests."""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping

import anyio

from transfer_engine.actors.room import ReceiverRoomActor, SenderRoomActor
from transfer_engine.actors.room.common import RoomActor
from transfer_engine.config import EngineConfig
from transfer_engine.engine.started import Started, send_owed
from transfer_engine.protocol import leases
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.rooms import RoomStatus
from transfer_engine.protocol.stash import EarlyRequests
from transfer_engine.runtime.mail import LeaseRenewed, PeerDead, RepeatStaging, Subscribe
from transfer_engine.runtime.peers import Peer, PrefillInstance
from transfer_engine.runtime.ports import PeerBook, RoomBoard

log = logging.getLogger("transfer_engine.engine")

_LEASED = (RoomStatus.BOOTSTRAPPING, RoomStatus.WAITING_FOR_INPUT)
"""The states whose deadline a room's lease sets (``Deadlines.due``); Transferring runs on progress."""


class Liveness:
    """Heartbeats to every live peer, leases on theirs, and the end of a peer that fell silent.

    Reads the live rooms, the rooms announced ahead of their ``receiver()`` (by bootstrap address)
    and the prefill instances connected to (the handshake's); renews leases in the early-request
    stash and the rooms; at a peer's death, drops it from the peer book, has ``forget`` drop what was
    learnt of its instance, and tells its rooms.
    """

    def __init__(
        self,
        config: EngineConfig,
        agent_name: str,
        started: Started,
        *,
        rooms: Mapping[int, RoomActor],
        board: RoomBoard,
        peers: PeerBook,
        stash: EarlyRequests,
        announced: Mapping[int, str],
        instances: Mapping[str, PrefillInstance],
        forget: Callable[[Peer], None],
        counters: Counter[str],
    ) -> None:
        self.config = config
        self.agent_name = agent_name
        self._started = started
        self.rooms = rooms
        self.board = board
        self.peers = peers
        self._stash = stash
        self._announced = announced
        self._instances = instances
        self._forget = forget
        self.counters = counters
        self._heartbeat_seq = 0
        self._tick = config.heartbeat_interval / 4
        """How often the loop below runs: leases are checked every quarter interval."""
        self._last_tick: float | None = None
        """When the loop below last ran (None: not started)."""

    async def run(self) -> None:
        """Send a heartbeat every half interval; check leases every quarter interval.

        A peer silent for more than ``LEASE_SILENCE`` intervals is dead; checked every quarter interval,
        that fails its rooms within 2.25 x heartbeat_interval of its last heartbeat.
        """
        started = self._started
        interval = self.config.heartbeat_interval
        tick = self._tick
        last_tick = last_beat = self._last_tick = time.monotonic()
        while True:
            await anyio.sleep(tick)
            now = time.monotonic()
            stall = leases.stalled(last_tick, now, tick, interval)
            if stall is not None:
                hint = "" if self.config.stall_traceback else " (stall_traceback=5 writes what holds it)"
                log.warning("heartbeat loop stalled %.2f s; extending peer and room leases%s", stall, hint)
                for peer in self.peers.values():
                    peer.last_seen = leases.extended(peer.last_seen, now, interval)
                self._extend_room_leases(now - interval)
            last_tick = self._last_tick = now
            if now - last_beat >= interval / 2 - tick / 2:  # twice per interval: see leases.LEASE_SILENCE
                last_beat = now
                self._heartbeat_seq += 1
                held = leases.held_rooms(self._held_rooms(), self.config.max_rooms + len(self._announced))
                for peer in list(self.peers.values()):
                    if peer.alive:
                        beat = m.Heartbeat(
                            agent=self.agent_name,
                            rank=self.config.tp_rank,
                            side=self.config.role,
                            seq=self._heartbeat_seq,
                            rooms=held.get(peer.agent_name),
                        )
                        started.control.send(peer.endpoint, beat)
                        if started.ring is not None:  # the watermark is state: repeat it, a lost one heals
                            with contextlib.suppress(anyio.WouldBlock, anyio.ClosedResourceError):
                                started.ring.inbox.send_nowait(Subscribe(peer))
                for worker in started.workers:  # unanswered StagingRequests (protocol.retransmit)
                    if worker.awaiting_grant:
                        with contextlib.suppress(anyio.WouldBlock, anyio.ClosedResourceError):
                            worker.inbox.send_nowait(RepeatStaging(before=now - interval / 2))
            silent = leases.dead(
                {p.agent_name: p.last_seen for p in self.peers.values() if p.alive}, now, interval
            )
            for agent in silent:
                gone = self.peers.get(agent)
                if gone is not None and gone.alive:
                    await self._peer_dead(gone, f"no heartbeat from {agent} for {now - gone.last_seen:.2f} s")
            lease = leases.room_lease(self.config.room_lease, interval)
            for room in self._stash.stale(now, lease):
                self.counters["stash_expired"] += 1
                answers = self._stash.expire(
                    room, agent=self.agent_name, rank=self.config.tp_rank, lease=lease
                )
                log.warning(
                    "room %d: no sender(), no decode renewed it within room_lease; %d decode rank(s) told",
                    room,
                    len(answers),
                )
                send_owed(started, self.peers, answers)

    def _held_rooms(self) -> list[tuple[int, frozenset[str]]]:
        """Each room held live here, with the peer agents it is held with (:func:`leases.held_rooms`):
        an open prefill room with the decode ranks that asked for it, a stashed request with its
        askers, a decode room whose requests went out with every prefill rank it asked, and a room
        announced by ``announce()`` with every rank of its prefill instance."""
        held = [(room, self._stash.agents(room)) for room in self._stash.rooms()]
        for room, actor in self.rooms.items():
            if not actor.core.status.final:
                held.append((room, _room_peers(actor)))
        for room, bootstrap in self._announced.items():  # queued here, its receiver() to come (announce)
            instance = self._instances.get(bootstrap)
            if instance is not None and room not in self.rooms:
                held.append((room, frozenset(peer.agent_name for peer in instance.ranks)))
        return held

    def stall_renewal(self, now: float) -> float | None:
        """For rooms judging a deadline at ``now`` (``RoomPorts.stall_renewal``): when the loop below
        has not run for longer than a stall (``leases.stalled``), our loop was held and the renewal it
        will make on waking (:meth:`_extend_room_leases`, ``now - interval``); else None. A room whose
        deadline check runs right after the stall (its drain reply can come before this loop wakes)
        so renews itself first instead of failing for heartbeats that are queued unread."""
        interval = self.config.heartbeat_interval
        if self._last_tick is None or leases.stalled(self._last_tick, now, self._tick, interval) is None:
            return None
        return now - interval  # as leases.extended renews a peer after our stall

    def _extend_room_leases(self, at: float) -> None:
        """After our own stall, the renewals of leased rooms are queued unread as the peers'
        heartbeats are: renew each as of ``at`` (as :func:`leases.extended` does for the peers), so
        a lease that ran out while we stalled gives its peer time to be heard first."""
        for actor in list(self.rooms.values()):
            if actor.core.held_at is not None and actor.status in _LEASED:
                with contextlib.suppress(anyio.WouldBlock, anyio.ClosedResourceError):
                    actor.inbox.send_nowait(LeaseRenewed(at))

    def held_by(self, agent: str, rooms: list[int] | None, now: float) -> None:
        """Peer ``agent``'s heartbeat lists ``rooms`` as held live there: renew their leases here (a
        stashed request's; a leased room's, by mail, dropped when its mailbox is full: the next
        heartbeat renews it again)."""
        for room in rooms or ():
            actor = self.rooms.get(room)
            if actor is None:
                self._stash.hold(room, agent, now)
            elif (
                actor.core.held_at is not None
                and actor.status in _LEASED
                and leases.renews(agent, _room_peers(actor), unasked=_unasked(actor))
            ):
                with contextlib.suppress(anyio.WouldBlock, anyio.ClosedResourceError):
                    actor.inbox.send_nowait(LeaseRenewed(now))

    async def on_leaving(self, message: m.PeerLeaving) -> m.PeerLeavingAck:
        """A peer says it leaves (its engine closes normally, or it refused the link): forget it now,
        as a dead peer (its rooms here fail PEER_DEAD) but without the warning; answer."""
        peer = self.peers.get(message.agent)
        if peer is not None and peer.alive:
            log.info("%s rank %d: peer %s (%s rank %d) left: %s", self.config.role, self.config.tp_rank,
                     peer.agent_name, message.side, peer.rank, message.detail)  # fmt: skip
            self.counters["peers_left"] += 1
            # Marked first: a request of its still on the way is then told apart from a stranger's.
            # Its stashed requests stay: it leaves only once its rooms ended, so what it asked of a
            # room not opened here yet is what asks nothing (an empty slice list), and still counts.
            self.peers.mark_left(peer.agent_name)
            await self._drop(peer, f"peer {peer.agent_name} left: {message.detail}", keep_stash=True)
        return m.PeerLeavingAck(agent=self.agent_name)

    async def _peer_dead(self, peer: Peer, detail: str) -> None:
        log.warning("%s rank %d: peer %s (rank %d) declared dead: %s", self.config.role, self.config.tp_rank,
                    peer.agent_name, peer.rank, detail)  # fmt: skip
        self.counters["peers_dead"] += 1
        await self._drop(peer, detail)

    async def _drop(self, peer: Peer, detail: str, keep_stash: bool = False) -> None:
        """Forget ``peer`` (dead or gone): the peer book, its instances, its socket, its stashed
        requests (unless ``keep_stash``: a peer that left in good order); its rooms here fail
        PEER_DEAD with ``detail``; its WRITEs are abandoned."""
        peer.alive = False
        del self.peers[peer.agent_name]
        self._forget(peer)
        self._started.control.forget(peer.endpoint)
        if not keep_stash:
            self._stash.forget(peer.agent_name)  # nobody left to answer, nor to renew them
        for actor in list(self.rooms.values()):
            await self.board.deliver(actor.room, PeerDead(peer.agent_name, detail))
        poller = self._started.poller
        await poller.abandon(peer.agent_name, detail)
        poller.remove_peer(peer.agent_name)


def _unasked(actor: RoomActor) -> bool:
    """A prefill room no decode rank has asked for yet."""
    return isinstance(actor, SenderRoomActor) and not actor.peers


def _room_peers(actor: RoomActor) -> frozenset[str]:
    """The peer agents a live room is held with: for a prefill room, the decode ranks that asked for
    it; for a decode room, every prefill rank of its instance, whether its pages were given yet or
    not (SGLang opens the room when a request arrives and gives the pages once memory frees up,
    while the prefill holds the KV: the listing renews that room, :func:`leases.renews`)."""
    if isinstance(actor, SenderRoomActor):
        return frozenset(peer.agent_name for peer in actor.peers.values())
    if isinstance(actor, ReceiverRoomActor):
        return frozenset(peer.agent_name for peer in actor.everyone)
    return frozenset()
