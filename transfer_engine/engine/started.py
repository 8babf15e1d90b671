"""What the engine's parts share: the running actors they reach, one send and one reading of the
configuration.

The supervisor (:mod:`transfer_engine.engine.supervisor`) makes and starts the actors once the
engine is entered; the handshake, dispatch, liveness and path parts are made with the engine, before
that, and reach the actors they use through :class:`Started` (the supervisor is one) at the time of
each call. Nothing here changes an actor.
"""

from __future__ import annotations

from typing import Protocol

from transfer_engine.actors.control import Control
from transfer_engine.actors.nixl_poller import NixlPoller
from transfer_engine.actors.ring import RingActor
from transfer_engine.actors.worker import TransferWorker
from transfer_engine.config import EngineConfig
from transfer_engine.protocol import messages as m
from transfer_engine.runtime.ports import PeerBook


class Started(Protocol):
    """The actors of a started engine that its parts talk to (read only once the engine runs)."""

    @property
    def control(self) -> Control:
        """The rank's sockets: sends to peers, requests, replies."""
        ...

    @property
    def poller(self) -> NixlPoller:
        """The NIXL agent: peers' agents and metadata, WRITEs in flight."""
        ...

    @property
    def ring(self) -> RingActor | None:
        """Decode with a staging ring: the ring actor; else None."""
        ...

    @property
    def workers(self) -> list[TransferWorker]:
        """Prefill: the transfer workers; else empty."""
        ...

    def worker_for(self, agent_name: str) -> TransferWorker:
        """The prefill worker that serves decode agent ``agent_name``."""
        ...


def send_owed(started: Started, peers: PeerBook, answers: list[tuple[str, m.RoomFailed]]) -> None:
    """Send each (decode agent, RoomFailed) the early-request stash owes (a request aborted or
    expired before its room opened here); agents no longer known are skipped."""
    for agent, message in answers:
        peer = peers.get(agent)
        if peer is not None:
            started.control.send(peer.endpoint, message)


def host_staging(config: EngineConfig) -> bool:
    """Whether a decode rank's staging ring is in host memory (``path=host`` or ``staging_memory=host``)."""
    return config.path == "host" or config.staging_memory == "host"
