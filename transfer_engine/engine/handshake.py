"""The handshake: a decode rank learns a prefill instance's ranks from its bootstrap and says PeerHello to
each; a prefill rank checks the hello (:mod:`transfer_engine.protocol.handshake`), loads the peer and answers.
"""

from __future__ import annotations

import logging
import time

import anyio

from transfer_engine.config import EngineConfig
from transfer_engine.engine.started import Started
from transfer_engine.errors import LayoutError, PeerUnreachableError, RemoteProtocolError, TransferError
from transfer_engine.memory.ipc import MappedPool, ShareError, export_pool, map_pool
from transfer_engine.memory.layout import KVPool
from transfer_engine.protocol import handshake, heads
from transfer_engine.protocol import messages as m
from transfer_engine.runtime.mail import Subscribe
from transfer_engine.runtime.peers import Peer, PrefillInstance
from transfer_engine.runtime.ports import PeerBook
from transfer_engine.transport.nixl import RemotePeer

log = logging.getLogger("transfer_engine.engine")


class Handshake:
    """The decode side connects to prefill instances (``instances``, by bootstrap address); the
    prefill side answers their PeerHello. Both add the peers they meet to the peer book."""

    def __init__(
        self,
        config: EngineConfig,
        pool: KVPool,
        agent_name: str,
        started: Started,
        peers: PeerBook,
        info: m.LayoutInfo,
        compat: int,
    ) -> None:
        self.config = config
        self.pool = pool
        self.agent_name = agent_name
        self._started = started
        self.peers = peers
        self._info = info
        self._compat = compat
        self.instances: dict[str, PrefillInstance] = {}
        """Decode: the prefill instances this rank connected to, by bootstrap address."""
        self._connecting: dict[str, anyio.Event] = {}
        self._share: tuple[m.PoolShare | None, str] | None = None
        """Decode: this rank's pool exported for the kernel path, or why not (made once, at the first
        handshake: :meth:`_exported`)."""

    def forget(self, peer: Peer) -> list[str]:
        """Drop the instances ``peer`` is a rank of (it died); their bootstrap addresses. A prefill
        rank's mapping of the dead decode's pool closes once no copy into it is in flight."""
        if isinstance(peer.mapping, MappedPool):
            peer.mapping.close_when_idle()
        gone = [bootstrap for bootstrap, inst in self.instances.items() if peer in inst.ranks]
        for bootstrap in gone:
            del self.instances[bootstrap]
        return gone

    def close(self) -> None:
        """At the engine's end, its workers stopped: close every peer's mapping (prefill)."""
        for peer in self.peers.values():
            if isinstance(peer.mapping, MappedPool):
                peer.mapping.close_when_idle()

    async def instance(self, bootstrap: str) -> PrefillInstance:
        """The prefill instance behind ``bootstrap``, connecting (once, shared by callers) if needed."""
        while bootstrap not in self.instances:
            pending = self._connecting.get(bootstrap)
            if pending is not None:
                await pending.wait()
                if bootstrap not in self.instances:
                    raise PeerUnreachableError(
                        bootstrap, "connection attempt by a concurrent receiver() failed"
                    )
                break
            event = self._connecting[bootstrap] = anyio.Event()
            try:
                self.instances[bootstrap] = await self._connect(bootstrap)
            finally:
                del self._connecting[bootstrap]
                event.set()
        return self.instances[bootstrap]

    async def _connect(self, bootstrap: str) -> PrefillInstance:
        cfg = self.config
        control, poller, ring = self._started.control, self._started.poller, self._started.ring
        deadline = time.monotonic() + cfg.bootstrap_timeout
        while True:
            try:
                topo = await control.request(bootstrap, m.TopologyQuery(), cfg.connect_timeout)
            except PeerUnreachableError:
                raise
            if not isinstance(topo, m.Topology):
                raise RemoteProtocolError(f"bootstrap {bootstrap} answered {type(topo).__name__}")
            if topo.complete:
                break
            if time.monotonic() > deadline:
                raise PeerUnreachableError(
                    bootstrap, f"only {len(topo.ranks)} of {topo.tp_size} prefill ranks registered"
                )
            await anyio.sleep(0.05)
        if not self.pool.layout.mla:
            heads.validate_split(self.pool.layout.num_heads, topo.tp_size, cfg.tp_size)
        share, unshared = self._exported()
        hello = m.PeerHello(
            rank=cfg.tp_rank,
            tp_size=cfg.tp_size,
            endpoint=control.endpoint,
            agent_name=self.agent_name,
            agent_metadata=poller.metadata(),
            mem_type=self.pool.mem_type,
            regions=self.pool.regions(),
            aux=self.pool.aux_region(),
            ring=None if ring is None else ring.memory.region(),
            ring_mem_type="" if ring is None else ring.memory.mem_type,
            layout=self._info,
            compat=self._compat,
            share=share,
            unshared=unshared,
        )
        peers: list[Peer] = []
        for info in topo.ranks:
            ack = await control.request(info.endpoint, hello, cfg.connect_timeout)
            if not isinstance(ack, m.PeerHelloAck):
                raise RemoteProtocolError(
                    f"prefill rank {info.rank} answered {type(ack).__name__} to PeerHello"
                )
            if not ack.ok or ack.layout is None:
                raise LayoutError(
                    f"prefill rank {info.rank} at {info.endpoint} refused this decode rank: {ack.detail}"
                )
            peer = Peer(
                ack.agent_name, info.endpoint, info.rank, ack.tp_size, ack.layout, last_seen=time.monotonic()
            )
            peer.mapped, peer.unmapped = ack.mapped, ack.unmapped
            poller.add_peer(RemotePeer(peer.agent_name, "DRAM", []), ack.agent_metadata)
            self.peers[peer.agent_name] = peer
            peers.append(peer)
            if ring is not None:
                await ring.inbox.send(Subscribe(peer))
        log.info(
            "decode rank %d connected to prefill instance %s (tp %d)", cfg.tp_rank, bootstrap, topo.tp_size
        )
        return PrefillInstance(bootstrap, topo.tp_size, peers)

    def _exported(self) -> tuple[m.PoolShare | None, str]:
        """Decode: this rank's pool exported for the kernel path (``memory/ipc.py``), once, or None and
        why not (logged once)."""
        if self._share is None:
            if not self.config.kernel_path or self.config.path != "auto":
                self._share = (None, "kernel path off on the decode (kernel_path, or a path other than auto)")
            else:
                try:
                    self._share = (export_pool(self.pool.regions(), self.pool.device), "")
                except ShareError as exc:
                    self._share = (None, str(exc))
                    log.info(
                        "decode rank %d: pool not exported for the kernel path: %s", self.config.tp_rank, exc
                    )
        return self._share

    def _map(self, hello: m.PeerHello) -> tuple[MappedPool | None, str]:
        """Prefill: the decode's pool mapped for the kernel path, or None and why not (logged)."""
        if not self.config.kernel_path:
            return None, f"kernel path off on prefill rank {self.config.tp_rank}"
        if hello.share is None:
            return None, hello.unshared or "the decode exported no pool"
        try:
            return map_pool(hello.share, hello.regions, self.pool.device), ""
        except ShareError as exc:
            log.info("prefill rank %d: pool of %s not mapped for the kernel path: %s",
                     self.config.tp_rank, hello.agent_name, exc)  # fmt: skip
            return None, str(exc)

    def on_peer_hello(self, hello: m.PeerHello) -> m.PeerHelloAck:
        """Prefill side of the handshake: validate, load the peer's agent and memory, map its pool for
        the kernel path when it offers it, answer."""
        refuse = handshake.refusal(hello, self._info, self._compat, self.config.tp_size)
        mapping: MappedPool | None = None
        unmapped = ""
        if refuse is None:
            try:
                peer = Peer(
                    hello.agent_name, hello.endpoint, hello.rank, hello.tp_size, hello.layout,
                    hello.mem_type, list(hello.regions), hello.aux, hello.ring, time.monotonic(),
                )  # fmt: skip
                remote_regions = list(hello.regions) + ([hello.aux] if hello.aux else [])
                mem_types = [hello.mem_type] * len(remote_regions)
                if hello.ring:
                    remote_regions.append(hello.ring)
                    mem_types.append(hello.ring_mem_type)
                self._started.poller.add_peer(
                    RemotePeer(hello.agent_name, hello.mem_type, remote_regions, mem_types),
                    hello.agent_metadata,
                )
                old = self.peers.get(hello.agent_name)
                if old is not None and old.endpoint != hello.endpoint:
                    self._started.control.forget(old.endpoint)
                mapping, unmapped = self._map(hello)
                peer.mapping = mapping
                if old is not None and isinstance(old.mapping, MappedPool):
                    old.mapping.close_when_idle()
                self.peers[hello.agent_name] = peer
            except TransferError as exc:
                refuse = str(exc)
                if mapping is not None:
                    mapping.close_when_idle()
                    mapping = None
        if refuse is not None:
            log.warning("refused PeerHello from %s: %s", hello.agent_name, refuse)
            return m.PeerHelloAck(ok=False, detail=refuse, rank=self.config.tp_rank, tp_size=self.config.tp_size,
                                  agent_name=self.agent_name, agent_metadata=b"", layout=None, compat=self._compat)  # fmt: skip
        log.info(
            "prefill rank %d accepted decode rank %d/%d (%s)",
            self.config.tp_rank,
            hello.rank,
            hello.tp_size,
            hello.agent_name,
        )
        return m.PeerHelloAck(ok=True, detail="", rank=self.config.tp_rank, tp_size=self.config.tp_size,
                              agent_name=self.agent_name, agent_metadata=self._started.poller.metadata(), layout=self._info,
                              compat=self._compat, mapped="" if mapping is None else mapping.how,
                              unmapped=unmapped)  # fmt: skip
