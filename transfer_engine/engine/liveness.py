"""Liveness: heartbeats, peer leases (:mod:`transfer_engine.protocol.leases`), peer death, stale stashed requests."""

from __future__ import annotations

import contextlib
import logging
import time

import anyio

from transfer_engine.engine.state import EngineState
from transfer_engine.protocol import leases
from transfer_engine.protocol import messages as m
from transfer_engine.runtime.mail import PeerDead, RepeatStaging, Subscribe
from transfer_engine.runtime.peers import Peer

log = logging.getLogger("transfer_engine.engine")


class Liveness(EngineState):
    """Heartbeats to every live peer, leases on theirs, and the end of a peer that fell silent."""

    async def _heartbeat_loop(self) -> None:
        """Send a heartbeat every half interval; check leases every quarter interval.

        A peer silent for more than ``LEASE_SILENCE`` intervals is dead; checked every quarter interval,
        that fails its rooms within 2.25 x heartbeat_interval of its last heartbeat.
        """
        interval = self.config.heartbeat_interval
        tick = interval / 4
        last_tick = last_beat = time.monotonic()
        while True:
            await anyio.sleep(tick)
            now = time.monotonic()
            stall = leases.stalled(last_tick, now, tick, interval)
            if stall is not None:
                log.warning("heartbeat loop stalled %.2f s; extending peer leases", stall)
                for peer in self.peers.values():
                    peer.last_seen = leases.extended(peer.last_seen, now, interval)
            last_tick = now
            if now - last_beat >= interval / 2 - tick / 2:  # twice per interval: see leases.LEASE_SILENCE
                last_beat = now
                self._heartbeat_seq += 1
                beat = m.Heartbeat(
                    agent=self.agent_name,
                    rank=self.config.tp_rank,
                    side=self.config.role,
                    seq=self._heartbeat_seq,
                )
                for peer in list(self.peers.values()):
                    if peer.alive:
                        self.control.send(peer.endpoint, beat)
                        if self.ring is not None:  # the watermark is state: repeat it, a lost one heals
                            with contextlib.suppress(anyio.WouldBlock, anyio.ClosedResourceError):
                                self.ring.inbox.send_nowait(Subscribe(peer))
                for worker in self.workers:  # unanswered StagingRequests (protocol.retransmit)
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
            for room in self._stash.stale(now, self.config.bootstrap_timeout):
                self.counters["stash_expired"] += 1
                answers = self._stash.expire(
                    room,
                    agent=self.agent_name,
                    rank=self.config.tp_rank,
                    timeout=self.config.bootstrap_timeout,
                )
                log.warning(
                    "room %d: no sender() within bootstrap_timeout; %d decode rank(s) told",
                    room,
                    len(answers),
                )
                self._answer(answers)

    async def _peer_dead(self, peer: Peer, detail: str) -> None:
        log.warning("%s rank %d: peer %s (rank %d) declared dead: %s", self.config.role, self.config.tp_rank,
                    peer.agent_name, peer.rank, detail)  # fmt: skip
        peer.alive = False
        self.counters["peers_dead"] += 1
        del self.peers[peer.agent_name]
        for bootstrap, inst in list(self.instances.items()):
            if peer in inst.ranks:
                del self.instances[bootstrap]
                self._slice_pieces_of.pop(bootstrap, None)
        self.control.forget(peer.endpoint)
        for actor in list(self.rooms.values()):
            await self._to_room(actor.room, PeerDead(peer.agent_name, detail))
        await self.poller.abandon(peer.agent_name, detail)
        self.poller.remove_peer(peer.agent_name)
