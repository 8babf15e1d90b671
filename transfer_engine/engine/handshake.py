"""The handshake: a decode rank learns a prefill instance's ranks from its bootstrap and says PeerHello to
each; a prefill rank checks the hello (:mod:`transfer_engine.protocol.handshake`), loads the peer and answers.

Then the decode probes the link to each prefill rank that writes to it (docs/PERF.md, "The link
probe"): a timed WRITE of a few MiB from a scratch buffer of its own into one the prefill rank
offered in its PeerHelloAck (never KV), through the engine's own transport
(:mod:`transfer_engine.transport.probe`). The decode probes, not the prefill, because the figure is
needed there: its dump and metrics show the link, its cost signal starts from the measured rate
(:meth:`~transfer_engine.protocol.cost.CostBook.seed`), and its ``receiver()`` is what a refused link
fails. The probe's bytes go the other way than KV does; NVLink, RDMA and TCP carry both ways alike.

The probe runs on a worker thread (the transport serializes it with the poller's calls under its one
lock), so the loop keeps serving. Without a floor (``min_link_gbps``, ``refuse_tcp_link``) it runs in
the background (:meth:`Handshake.run`) and rooms start at once; with one, the handshake waits for it,
so that no room opens on a link it refuses (SlowLinkError, the pair forgotten on both sides).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import anyio
import anyio.to_thread
from anyio.streams.memory import MemoryObjectSendStream

from transfer_engine.config import EngineConfig
from transfer_engine.engine.started import Started
from transfer_engine.errors import (
    LayoutError,
    PeerUnreachableError,
    RemoteProtocolError,
    SlowLinkError,
    TransferError,
    TransportError,
)
from transfer_engine.memory.ipc import MappedPool, ShareError, export_pool, host_id, map_pool
from transfer_engine.memory.layout import KVPool
from transfer_engine.memory.staging import StagingMemory, allocate_staging
from transfer_engine.protocol import handshake, heads
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.cost import CostBook
from transfer_engine.runtime.mail import Subscribe
from transfer_engine.runtime.peers import Peer, PrefillInstance
from transfer_engine.runtime.ports import PeerBook
from transfer_engine.transport.nixl import RemotePeer
from transfer_engine.transport.probe import (
    PROBE_BYTES,
    LinkProbe,
    check_floor,
    configured_devices,
    probe_link,
)

log = logging.getLogger("transfer_engine.engine")

PROBE_TIMED = 2
"""Timed WRITEs of a probe, after the one that connects the pair (UCX wires a pair up at its first
WRITE); the fastest is the figure (a thread may see DONE late when the loop holds the GIL)."""
PROBES_QUEUED = 64
"""Background probes waiting for :meth:`Handshake.run` (one per prefill instance connected)."""
LEAVING_WAIT_S = 1.0
"""How long an engine that closes waits for each peer to answer its PeerLeaving (all at once)."""


@dataclass(frozen=True)
class ProbeTarget:
    """A prefill rank the decode probes: the peer, the scratch it offered and whether it is on this host."""

    peer: Peer
    scratch: m.MemRegion
    same_host: bool


def link_verdict(
    probe: LinkProbe, *, min_gbps: float, refuse_tcp: bool, mem_type: str
) -> tuple[str, SlowLinkError | None]:
    """What a decode makes of a probe: ``("refuse", error)`` below ``min_gbps`` or over TCP with
    ``refuse_tcp``; ``("warn", error)`` for a GPU pool's link over TCP that is not refused (RDMA or
    NVLink was expected; a host pool's TCP is no news); ``("ok", None)`` otherwise. Pure."""
    try:
        check_floor(probe, min_gbps, refuse_tcp=refuse_tcp)
    except SlowLinkError as exc:
        return "refuse", exc
    if probe.transport == "tcp" and mem_type == "VRAM":
        try:
            check_floor(probe, 0.0, refuse_tcp=True)
        except SlowLinkError as exc:
            return "warn", exc
    return "ok", None


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
        costs: CostBook,
    ) -> None:
        self.config = config
        self.pool = pool
        self.agent_name = agent_name
        self._started = started
        self.peers = peers
        self._info = info
        self._compat = compat
        self._costs = costs
        self.instances: dict[str, PrefillInstance] = {}
        """Decode: the prefill instances this rank connected to, by bootstrap address."""
        self._connecting: dict[str, anyio.Event] = {}
        self._failed: dict[str, TransferError] = {}
        """Decode: why the latest connection to a bootstrap failed, for the receivers that waited on it."""
        self._share: tuple[m.PoolShare | None, str] | None = None
        """Decode: this rank's pool exported for the kernel path, or why not (made once, at the first
        handshake: :meth:`_exported`)."""
        self.links: dict[str, LinkProbe] = {}
        """Decode: the link probe of each prefill rank (by agent) that writes to this rank, while it is a peer."""
        self._scratch: StagingMemory | None = None
        """A few MiB beside the pool, registered once (:meth:`_scratch_memory`): the decode's probe
        source, the prefill's probe target (offered in PeerHelloAck)."""
        self._probes: MemoryObjectSendStream[tuple[str, list[ProbeTarget]]] | None = None
        """Decode: where a handshake hands its probes to :meth:`run` (None until it runs)."""
        self.probing = 0
        """Probe WRITEs out now (0 or 1): their handle is the probe's, released by it, not a room's."""
        self._closing = threading.Event()
        """Set as the engine closes: a probe in flight gives up at its next look (:meth:`_look`)."""

    @property
    def floor(self) -> bool:
        """Whether a link may be refused (``min_link_gbps`` or ``refuse_tcp_link``): the handshake
        then waits for its probes."""
        return self.config.min_link_gbps > 0 or self.config.refuse_tcp_link

    def forget(self, peer: Peer) -> list[str]:
        """Drop the instances ``peer`` is a rank of (it died or left), and its link; their bootstrap
        addresses. A prefill rank's mapping of the gone decode's pool closes once no copy into it is
        in flight."""
        if isinstance(peer.mapping, MappedPool):
            peer.mapping.close_when_idle()
        self.links.pop(peer.agent_name, None)
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
                    failed = self._failed.get(bootstrap)
                    if isinstance(failed, SlowLinkError):  # the same refusal, typed
                        raise failed
                    raise PeerUnreachableError(
                        bootstrap, "connection attempt by a concurrent receiver() failed"
                    )
                break
            event = self._connecting[bootstrap] = anyio.Event()
            self._failed.pop(bootstrap, None)
            try:
                self.instances[bootstrap] = await self._connect(bootstrap)
            except TransferError as exc:
                self._failed[bootstrap] = exc
                raise
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
        targets: list[ProbeTarget] = []
        here = host_id()
        writers = {
            w.prefill_rank
            for w in heads.writers_of(
                self.pool.layout.num_heads, topo.tp_size, cfg.tp_size, cfg.tp_rank, self.pool.layout.mla
            )
        }
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
            scratch = [ack.scratch] if ack.scratch is not None else []  # the only memory we may WRITE there
            poller.add_peer(
                RemotePeer(peer.agent_name, ack.scratch_mem_type or "DRAM", scratch), ack.agent_metadata
            )
            self.peers[peer.agent_name] = peer
            peers.append(peer)
            if ack.scratch is not None and info.rank in writers:
                targets.append(ProbeTarget(peer, ack.scratch, bool(ack.host) and ack.host == here))
        if targets and self.floor:
            try:
                await self._probe(bootstrap, targets, refuse=True)
            except SlowLinkError as exc:
                await self._refuse(peers, str(exc))
                raise
        elif targets and self._probes is not None:
            try:
                self._probes.send_nowait((bootstrap, targets))
            except anyio.WouldBlock:
                log.info("decode rank %d: too many link probes queued; %s not probed", cfg.tp_rank, bootstrap)
        if ring is not None:
            for peer in peers:
                await ring.inbox.send(Subscribe(peer))
        log.info(
            "decode rank %d connected to prefill instance %s (tp %d)", cfg.tp_rank, bootstrap, topo.tp_size
        )
        return PrefillInstance(bootstrap, topo.tp_size, peers)

    # --- the link probe (decode) ------------------------------------------------------------------

    async def run(self) -> None:
        """Decode: run the probes of handshakes that did not wait for them, one at a time (two
        probes at once would share the link they measure). Runs for the engine's life."""
        send, receive = anyio.create_memory_object_stream[tuple[str, list[ProbeTarget]]](PROBES_QUEUED)
        self._probes = send
        try:
            with send, receive:
                async for bootstrap, targets in receive:
                    await self._probe(bootstrap, targets, refuse=False)
        finally:
            self._probes = None

    async def _probe(self, bootstrap: str, targets: list[ProbeTarget], *, refuse: bool) -> None:
        """Probe each of ``targets`` (the prefill ranks of ``bootstrap`` that write here): keep its
        link, log it, judge it (:func:`link_verdict`) and start the instance's cost from the slowest.
        ``refuse`` (a floor is set): raise SlowLinkError for a link refused or a probe that failed;
        without, a failed probe is a warning and the instance keeps the book's default rate."""
        cfg = self.config
        rates: list[float] = []
        for target in targets:
            peer = target.peer
            if self._closing.is_set() or self.peers.get(peer.agent_name) is not peer:
                return  # closing, or the peer died or left meanwhile
            try:
                local = self._scratch_memory()
                probe = await anyio.to_thread.run_sync(self._probe_one, target, local)
            except (TransportError, RuntimeError) as exc:  # RuntimeError: no device memory for the scratch
                if self._closing.is_set() or self.peers.get(peer.agent_name) is not peer:
                    return
                if refuse:
                    raise SlowLinkError(
                        peer.agent_name,
                        "unknown",
                        0.0,
                        f"the link probe failed ({exc}); no floor can be checked",
                    ) from exc
                log.warning("decode rank %d: link probe to %s failed: %s", cfg.tp_rank, peer.agent_name, exc)
                continue
            if self.peers.get(peer.agent_name) is not peer:
                return
            self.links[peer.agent_name] = probe
            inferred = "" if probe.transport == "tcp" else "; transport inferred from where the peer is"
            log.info("decode rank %d: link to %s: %s %.3g GB/s %.0f us (devices %s%s)", cfg.tp_rank,
                     peer.agent_name, probe.transport, probe.gbps, probe.seconds * 1e6, probe.devices,
                     inferred)  # fmt: skip
            verdict, error = link_verdict(
                probe, min_gbps=cfg.min_link_gbps, refuse_tcp=cfg.refuse_tcp_link, mem_type=self.pool.mem_type
            )
            if verdict == "refuse":  # only with a floor: without one nothing is refused
                assert error is not None
                raise error
            if verdict == "warn":
                log.warning("decode rank %d: %s (refuse_tcp_link refuses it)", cfg.tp_rank, error)
            rates.append(probe.nbytes / probe.seconds if probe.seconds > 0 else float("inf"))
        finite = [rate for rate in rates if rate < float("inf")]
        if finite:
            self._costs.seed(bootstrap, min(finite))

    def _probe_one(self, target: ProbeTarget, local: StagingMemory) -> LinkProbe:
        """On a worker thread: connect the pair with one WRITE from ``local`` into the target's
        scratch, then keep the fastest of PROBE_TIMED more. Raises TransportError as probe_link."""
        transport = self._started.poller.transport
        nbytes = min(PROBE_BYTES, local.nbytes, target.scratch.length)
        devices = configured_devices(getattr(transport, "params", {}))
        timeout = self.config.connect_timeout
        best: LinkProbe | None = None
        for i in range(PROBE_TIMED + 1):
            self.probing += 1  # before the post, after the release: never fewer than the probe's handles
            try:
                probe = probe_link(
                    transport, target.peer.agent_name, local.addr, target.scratch.addr, nbytes,
                    mem_type=local.mem_type, device=local.device_id, same_host=target.same_host,
                    devices=devices, timeout=timeout, between_polls=self._look,
                )  # fmt: skip
            finally:
                self.probing -= 1
            if i > 0 and (best is None or probe.seconds < best.seconds):
                best = probe
        assert best is not None
        return best

    def _look(self) -> None:
        """Between two looks at a probe's WRITE: give the GIL to the loop, and give up if closing."""
        if self._closing.is_set():
            raise TransportError("the engine is closing")
        time.sleep(0)

    def _scratch_memory(self) -> StagingMemory:
        """This rank's probe scratch: PROBE_BYTES on the pool's device, registered with the agent once."""
        if self._scratch is None:
            memory = allocate_staging(self.pool, PROBE_BYTES, host=False)
            self._started.poller.register([memory.region()], memory.mem_type)
            self._scratch = memory
        return self._scratch

    async def _refuse(self, peers: list[Peer], detail: str) -> None:
        """Decode: a link of this instance was refused before any room opened with it: forget each of
        its ranks here, and tell them (PeerLeaving) so that they forget this rank at once."""
        for peer in peers:
            peer.alive = False
            if self.peers.get(peer.agent_name) is peer:
                del self.peers[peer.agent_name]
            self.links.pop(peer.agent_name, None)
            self._started.poller.remove_peer(peer.agent_name)
        await self.say_leaving(peers, f"link refused: {detail}")
        for peer in peers:
            self._started.control.forget(peer.endpoint)

    # --- leaving ----------------------------------------------------------------------------------

    async def leave(self) -> None:
        """The engine closes normally (its rooms ended): stop a probe in flight, and tell every live
        peer (PeerLeaving), so that each forgets this rank at once instead of declaring it dead once
        its heartbeats stopped."""
        self._closing.set()
        await self.say_leaving([peer for peer in self.peers.values() if peer.alive], "its engine closed")

    async def say_leaving(self, peers: list[Peer], detail: str) -> None:
        """Send PeerLeaving to each of ``peers`` at once and wait (LEAVING_WAIT_S at most) for their
        answers: once answered, the peer has forgotten this rank. A peer that does not answer learns it
        from the heartbeats that stop."""
        cfg = self.config
        message = m.PeerLeaving(agent=self.agent_name, rank=cfg.tp_rank, side=cfg.role, detail=detail)
        wait = min(cfg.connect_timeout, LEAVING_WAIT_S)

        async def one(peer: Peer) -> None:
            try:
                await self._started.control.request(peer.endpoint, message, wait)
            except TransferError as exc:
                log.debug("%s rank %d: %s did not answer PeerLeaving: %s", cfg.role, cfg.tp_rank,
                          peer.agent_name, exc)  # fmt: skip

        async with anyio.create_task_group() as tg:
            for peer in peers:
                tg.start_soon(one, peer)

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
        scratch = self._offered_scratch()  # registered before the metadata is read: it carries it
        return m.PeerHelloAck(ok=True, detail="", rank=self.config.tp_rank, tp_size=self.config.tp_size,
                              agent_name=self.agent_name, agent_metadata=self._started.poller.metadata(), layout=self._info,
                              compat=self._compat, mapped="" if mapping is None else mapping.how,
                              unmapped=unmapped, scratch=None if scratch is None else scratch.region(),
                              scratch_mem_type="" if scratch is None else scratch.mem_type, host=host_id())  # fmt: skip

    def _offered_scratch(self) -> StagingMemory | None:
        """Prefill: the scratch a decode's link probe WRITEs into; None (logged) when it cannot be made."""
        try:
            return self._scratch_memory()
        except (TransferError, RuntimeError) as exc:  # out of device memory, or NIXL refused it
            log.warning("prefill rank %d: no link probe target: %s", self.config.tp_rank, exc)
            return None
