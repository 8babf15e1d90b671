"""Soak: many random rooms through real engines, with aborts and injected faults; every byte checked.

    python tools/soak.py --rooms 10000 --abort-rate 0.1 --seed 1 --json [PATH] [--fault-rate 0.05]
                         [--layerwise 0.25] [--loss P]

The rooms run in *epochs*. Each epoch draws one cluster configuration — KV layout (1, 2, 4 or 8
heads, MLA sometimes, dtype, layers, page sizes that differ between prefill and decode on the slice
and staged paths), a (P, D) pair among (1,1) (2,1) (1,2) (4,2) (2,4) (4,1) (1,4), a path (direct
where allowed, slice, staged, host), a ring tiny enough that chunks wait on the watermark sometimes,
and which faults are on — starts P prefill and D decode engines in this process (real NIXL over
UCX on loopback, real ZMQ, like ``tests/integration/harness.cluster``), and runs 20-50 rooms on
several concurrent slots. Each room draws its length, its chunking, whether it carries an aux item,
which side opens first, and maybe:

- an **abort** (``--abort-rate``), from decode or prefill (every rank of that side, or one), at one
  of four points: before bootstrap (the other side's scheduler learns of it and aborts too, never
  opens the room, or lets it time out), between two chunks, mid-transfer (the room's WRITE
  completions and notifications are held back, so the abort lands while a WRITE is in flight), or
  after the last chunk;
- a **failed WRITE** (``--fault-rate``): one of the room's WRITEs is refused at post, aimed outside
  the peer's memory, or ends in error (the bytes move, the notification does not).

A share of the rooms (``--layerwise``) is sent **layer-wise**: each chunk opened with
``begin_chunk``, its layers reported ``layers_ready`` one range at a time (1 or 2 layers a call,
``layers_per_write`` 1 to 3), half the ranges with a ``threading.Event`` that is set only a little
later (the worker must wait for it). A between-chunks abort of a layer-wise room lands *between
layers* instead (``between_layers``): after the first range of a chunk was reported.

Epochs with faults on also delay WRITE completions, delay, reorder, duplicate and stall
notifications, and delay and reorder control messages (heartbeats included) at random; those never
fail a room. Faults come from :class:`~transfer_engine.transport.faults.FaultyTransport` and
:class:`~transfer_engine.transport.faults.ControlFaults` around the real transport and sockets.

**Loss** (``--loss P``, every epoch): each control message of every kind (requests, aborts, acks,
room failures, staging requests, grants, refusals, watermarks, heartbeats) and each NIXL
notification is lost with probability P (:class:`~transfer_engine.transport.faults.Loss`), and the
input and transfer deadlines drop to ``LOSS_PHASE_TIMEOUT_S``. A room some of whose messages were
lost must still end on both sides, Success with every byte right or Failed with a reason the loss
explains (a timeout, or the other side's failure or abort that followed it) — so may a room of a
staged epoch that lost nothing itself, since a decode ring is shared and a room whose notification
was lost holds its region until its deadline (counted apart); PEER_DEAD only in an
epoch where heartbeats were lost often enough in a row to break a lease. The summary says how many
rooms lost messages, how many of those still completed, and how long the others took to fail.

Outcomes. A room whose every decode rank succeeded is *completed* once every byte (and the aux
item) verifies on every decode rank — a byte that differs makes it *corrupted*. A room with an abort
or a fault that fired may fail (*failed as intended*), but every side's reason must be one that
cause explains; any other failure, a room that hangs, or a failure with no cause is *failed
unexpectedly*. After a room that failed, its decode pages (and aux slot) are reused at once by a
follow-up room that must verify: nothing of the failed room landed late. After each epoch every
engine's ``leaks()`` must reach all zero (*leaked* counts what did not). Exit status 1 when
anything was corrupted, leaked or failed unexpectedly.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import random
import re
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import torch

from transfer_engine.config import EngineConfig
from transfer_engine.engine import Receiver, Sender, TransferEngine
from transfer_engine.errors import (
    FailureReason,
    LocalProtocolError,
    RemoteProtocolError,
    TransferFailed,
)
from transfer_engine.memory.layout import KVLayout, KVPool
from transfer_engine.protocol import heads
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.staging import region_layout
from transfer_engine.testing import cluster as testing
from transfer_engine.testing import patterns
from transfer_engine.transport.faults import ControlFaults, Fault, FaultyTransport, Loss, Rule
from transfer_engine.transport.nixl import NixlTransport

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

log = logging.getLogger("soak")

TP_PAIRS = ((1, 1), (2, 1), (1, 2), (4, 2), (2, 4), (4, 1), (1, 4))
HEADS = (1, 2, 4, 8)
PAGE_SIZES = (1, 2, 4, 8, 16)
DTYPES = (torch.bfloat16, torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.int8)
ABORT_POINTS = ("before_bootstrap", "between_chunks", "mid_transfer", "after_last")
WRITE_FAULTS = (Fault.ERROR, Fault.FAIL_POST, Fault.BAD_ADDRESS)

BOOTSTRAP_TIMEOUT_S = 2.0
"""Short, so a room whose other side never opens (an abort before bootstrap) ends soon."""
PHASE_TIMEOUT_S = 20.0
"""Input and transfer deadlines: only a hang reaches them (a room takes milliseconds here)."""
LOSS_PHASE_TIMEOUT_S = 5.0
"""Input and transfer deadlines with ``--loss``: a lost notification or staging message leaves a room
to them (nothing repeats those), and 20 s per such room would make the run mostly waiting."""
ROOM_GUARD_S = 40.0
"""A room whose handles have not ended by then is counted as hung (failed unexpectedly)."""
LEAK_WAIT_S = BOOTSTRAP_TIMEOUT_S + 5.0
"""After an epoch: how long engines may take to become idle (a stashed request nobody renews expires
after ``room_lease``, set to BOOTSTRAP_TIMEOUT_S here, checked by the heartbeat loop)."""

ABORT_REASONS = frozenset({FailureReason.ABORTED, FailureReason.REMOTE, FailureReason.BOOTSTRAP_TIMEOUT})
"""What a side may fail with when a room was aborted. BOOTSTRAP_TIMEOUT: a decode rank's request
that reached the prefill after the failed room had ended waits in the early-request stash until
``bootstrap_timeout``, like a request for a room not opened yet (the prefill cannot tell them apart)."""
FAULT_REASONS = ABORT_REASONS | {FailureReason.TRANSPORT}
"""What a side may fail with when one of the room's WRITEs failed."""
LOSS_REASONS = ABORT_REASONS | {FailureReason.INPUT_TIMEOUT, FailureReason.TRANSFER_TIMEOUT}
"""What a side may fail with when some of the room's messages were lost: a deadline, or the other
side's failure (REMOTE) or abort (ABORTED, sent by a decode room whose deadline passed)."""


# --- plans ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EpochConfig:
    """One cluster: layout, TP sizes, path, ring, concurrency and which random faults are on."""

    index: int
    P: int
    D: int
    num_heads: int
    mla: bool
    layers: int
    head_dim: int
    dtype: torch.dtype
    prefill_page_size: int
    decode_page_size: int
    path: str
    concurrency: int
    max_pages: int
    """Most prefill pages a room has."""
    max_chunk: int
    """Most prefill pages one chunk has."""
    tiny_ring: bool
    num_workers: int
    random_faults: bool
    """Delayed WRITE completions, delayed/reordered/duplicated/stalled notifications, delayed and
    reordered control messages."""

    def layout(self, side: str) -> KVLayout:
        page_size = self.prefill_page_size if side == "prefill" else self.decode_page_size
        return KVLayout(
            num_layers=self.layers,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            page_size=page_size,
            mla=self.mla,
        )

    def decode_pages(self, prefill_pages: int) -> int:
        """Decode pages that hold ``prefill_pages`` prefill pages' tokens."""
        return -(-prefill_pages * self.prefill_page_size // self.decode_page_size)

    def ring_bytes(self) -> int:
        """A ring of one or two of the largest chunks (0: the engine's default size)."""
        if not self.tiny_ring:
            return 0
        layout = self.layout("decode")
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        tokens = self.max_chunk * self.prefill_page_size
        largest = max(
            region_layout(
                layout.num_kv_tensors,
                tokens,
                layout.head_dim,
                itemsize,
                heads.writers_of(layout.num_heads, self.P, self.D, d, layout.mla),
            ).total_bytes
            for d in range(self.D)
        )
        return largest * (1 if self.index % 2 else 2)

    def describe(self) -> str:
        kind = "MLA" if self.mla else f"H={self.num_heads}"
        dtype = str(self.dtype).removeprefix("torch.")
        ring = f" ring={self.ring_bytes()}" if self.tiny_ring else ""
        return (
            f"epoch {self.index}: P={self.P} D={self.D} {kind} L={self.layers} dim={self.head_dim} {dtype} "
            f"pages {self.prefill_page_size}->{self.decode_page_size} path={self.path}{ring} "
            f"slots={self.concurrency} faults={'on' if self.random_faults else 'off'}"
        )


def choose_epoch(index: int, rng: random.Random, fault_rate: float) -> EpochConfig:
    """A random cluster configuration (every choice valid: the engine must accept it)."""
    P, D = rng.choice(TP_PAIRS)
    mla = rng.random() < 0.2
    paths = ["slice", "staged", "host"]
    if P == D or mla:
        paths += ["direct", "direct"]
    path = rng.choice(paths)
    if path == "direct" or rng.random() < 0.4:
        prefill_ps = decode_ps = rng.choice(PAGE_SIZES[:4])
    else:
        prefill_ps, decode_ps = rng.sample(PAGE_SIZES, 2)
    return EpochConfig(
        index=index,
        P=P,
        D=D,
        num_heads=1 if mla else rng.choice(HEADS),
        mla=mla,
        layers=rng.randint(1, 3),
        head_dim=rng.choice((16, 32, 64) if mla else (8, 16, 32)),
        dtype=rng.choice(DTYPES),
        prefill_page_size=prefill_ps,
        decode_page_size=decode_ps,
        path=path,
        concurrency=rng.randint(2, 6),
        max_pages=rng.randint(2, 12),
        max_chunk=rng.randint(1, 4),
        tiny_ring=path in ("staged", "host") and rng.random() < 0.4,
        num_workers=rng.randint(1, 2),
        random_faults=fault_rate > 0 and rng.random() < 0.5,
    )


@dataclass(frozen=True)
class AbortPlan:
    """Who aborts a room, when, and what the other side's application does about it."""

    side: str
    """``decode`` or ``prefill``."""
    point: str
    """One of :data:`ABORT_POINTS`."""
    ranks: tuple[int, ...]
    """The ranks of ``side`` that abort: all of them (a scheduler aborts the request), or one."""
    after_chunks: int
    """``between_chunks``: how many chunks went out before the abort."""
    delay_s: float
    """A short pause before the abort (and before the other side follows a before-bootstrap one)."""
    other_side: str
    """Before bootstrap: the other side ``aborts`` too, ``never`` opens (decode aborted), or ``waits``
    (opens and runs until ``bootstrap_timeout`` fails it)."""

    @property
    def label(self) -> str:
        return f"{self.side}/{self.point}"


@dataclass(frozen=True)
class RoomPlan:
    """One room: its id, length, chunking and what goes wrong with it."""

    room: int
    chunks: tuple[int, ...]
    aux: bool
    prefill_first: bool
    abort: AbortPlan | None = None
    write_fault: tuple[Fault, int] | None = None
    """Fail the WRITE with this index (counted over the room's WRITEs on every prefill rank)."""
    follow_up: bool = False
    layer_step: int = 0
    """Layer-wise (> 0): layers reported per ``layers_ready`` call; 0 sends whole chunks."""
    layers_per_write: int = 1
    """Layer-wise: the room's ``layers_per_write`` (``TransferEngine.sender``)."""

    @property
    def pages(self) -> int:
        return sum(self.chunks)


def random_chunks(rng: random.Random, pages: int, max_chunk: int) -> tuple[int, ...]:
    chunks: list[int] = []
    while pages:
        chunks.append(rng.randint(1, min(pages, max_chunk)))
        pages -= chunks[-1]
    return tuple(chunks)


def plan_abort(
    rng: random.Random, cfg: EpochConfig, chunks: Sequence[int], layerwise: bool = False
) -> AbortPlan:
    side = rng.choice(("decode", "prefill"))
    tp = cfg.D if side == "decode" else cfg.P
    point = rng.choice(ABORT_POINTS)
    if point == "between_chunks" and layerwise:
        point = "between_layers"  # in chunk ``after_chunks - 1``, after its first range of layers
    elif point == "between_chunks" and len(chunks) < 2:
        point = "mid_transfer"
    ranks = tuple(range(tp)) if rng.random() < 0.6 else (rng.randrange(tp),)
    if point != "before_bootstrap":
        other = "aborts"
    elif side == "decode":
        other = rng.choice(("aborts", "aborts", "never", "waits"))
    else:
        other = rng.choice(("aborts", "aborts", "aborts", "waits"))
    return AbortPlan(
        side=side,
        point=point,
        ranks=ranks,
        after_chunks=rng.randint(1, max(1, len(chunks) - 1)),
        delay_s=rng.choice((0.0, 0.0, 0.001, 0.003, 0.01)),
        other_side=other,
    )


# --- fault injection ------------------------------------------------------------------------------


def _room_of(payload: bytes) -> int | None:
    try:
        message = m.decode(payload)
    except RemoteProtocolError:
        return None
    room = getattr(message, "room", None)
    return room if isinstance(room, int) else None


class Injector:
    """Decides which WRITE of which room fails and which rooms' WRITEs and notifications are held.

    Its matchers are the ``match`` of :class:`Rule`\\ s that always fire when they match, so the
    matcher alone decides, room by room; it records the rooms a failing fault really hit.
    """

    def __init__(self) -> None:
        self.fail: dict[int, tuple[Fault, int]] = {}
        self.writes_seen: Counter[int] = Counter()
        self.failed_rooms: set[int] = set()
        self.held_rooms: set[int] = set()
        """Rooms aborted mid-transfer: their WRITE completions and notifications come 30 ms late."""
        self.loss: Loss | None = None
        """With ``--loss``: loses control messages and notifications, and records which."""

    def _fail_match(self, fault: Fault) -> Callable[[bytes], bool]:
        def match(payload: bytes) -> bool:
            room = _room_of(payload)
            target = self.fail.get(room) if room is not None else None
            if room is None or target is None or target[0] is not fault:
                return False
            index = self.writes_seen[room]
            self.writes_seen[room] += 1
            if index != target[1]:
                return False
            self.failed_rooms.add(room)
            return True

        return match

    def _held(self, payload: bytes) -> bool:
        return _room_of(payload) in self.held_rooms

    def write_rules(self, cfg: EpochConfig) -> list[Rule]:
        rules = [Rule(fault, match=self._fail_match(fault), times=None) for fault in WRITE_FAULTS]
        rules.append(Rule(Fault.DELAY, match=self._held, times=None, delay_s=0.03))
        if cfg.random_faults:
            rules.append(Rule(Fault.DELAY, probability=0.1, times=None, delay_s=0.01))
        return rules

    def notif_rules(self, cfg: EpochConfig) -> list[Rule]:
        rules = self.loss.rules() if self.loss is not None else []
        rules.append(Rule(Fault.DELAY, match=self._held, times=None, delay_s=0.03))
        if cfg.random_faults:
            rules += [
                Rule(Fault.STALL, probability=0.01, times=None, delay_s=0.02),
                Rule(Fault.REORDER, probability=0.1, times=None, delay_s=0.02),
                Rule(Fault.DUPLICATE, probability=0.02, times=None),
                Rule(Fault.DELAY, probability=0.1, times=None, delay_s=0.01),
            ]
        return rules

    @staticmethod
    def control_rules() -> list[Rule]:
        return [
            Rule(Fault.REORDER, probability=0.05, times=None, delay_s=0.02),
            Rule(Fault.DELAY, probability=0.1, times=None, delay_s=0.01),
        ]


# --- the cluster ------------------------------------------------------------------------------------

_names = itertools.count()


@dataclass
class Cluster:
    prefill: list[TransferEngine]
    decode: list[TransferEngine]
    bootstrap: str
    transports: list[FaultyTransport]

    @property
    def engines(self) -> list[TransferEngine]:
        return self.prefill + self.decode


def _engine(
    cfg: EpochConfig, role: str, rank: int, port: int, injector: Injector, seed: int
) -> TransferEngine:
    tp = cfg.P if role == "prefill" else cfg.D
    name = f"soak-{role}-{rank}-{os.getpid()}-{next(_names)}"
    config = EngineConfig(
        role=role,  # type: ignore[arg-type]
        tp_size=tp,
        tp_rank=rank,
        bootstrap_port=port,
        agent_name=name,
        path=cfg.path,  # type: ignore[arg-type]
        ring_bytes=cfg.ring_bytes(),
        num_workers=cfg.num_workers,
        bootstrap_timeout=BOOTSTRAP_TIMEOUT_S,
        room_lease=BOOTSTRAP_TIMEOUT_S,
        waiting_timeout=PHASE_TIMEOUT_S if injector.loss is None else LOSS_PHASE_TIMEOUT_S,
        transfer_timeout=PHASE_TIMEOUT_S if injector.loss is None else LOSS_PHASE_TIMEOUT_S,
    )
    num_pages = 2 * cfg.concurrency * cfg.max_pages
    slots = 2 * cfg.concurrency
    if role == "decode":
        num_pages, slots = cfg.concurrency * cfg.decode_pages(cfg.max_pages), cfg.concurrency
    pool = KVPool.allocate(cfg.layout(role), tp, rank, num_pages, aux_slots=slots, aux_item_bytes=16)
    if role == "prefill":
        transport = FaultyTransport(NixlTransport(name), writes=injector.write_rules(cfg), seed=seed + rank)
    else:
        transport = FaultyTransport(NixlTransport(name), notifs=injector.notif_rules(cfg), seed=seed + rank)
    return TransferEngine(config, pool, transport=transport)


@contextlib.asynccontextmanager
async def open_cluster(cfg: EpochConfig, injector: Injector, seed: int) -> AsyncIterator[Cluster]:
    """P prefill and D decode engines of ``cfg`` in this process, entered (prefill rank 0 first)."""

    def make(role: str, rank: int, port: int) -> TransferEngine:
        return _engine(cfg, role, rank, port, injector, seed if role == "prefill" else seed + 100)

    async with testing.open_cluster(make, cfg.P, cfg.D) as opened:
        prefill, decode = opened.prefill, opened.decode
        engines = prefill + decode
        for i, engine in enumerate(engines):
            rules = injector.loss.rules() if injector.loss is not None else []
            if cfg.random_faults:
                rules += Injector.control_rules()
            if rules:
                engine.control.faults = ControlFaults(rules, seed=seed + 200 + i)
        transports = [e._transport for e in engines]
        yield Cluster(
            prefill, decode, opened.bootstrap, [t for t in transports if isinstance(t, FaultyTransport)]
        )
        for engine in engines:  # held control messages are not worth keeping alive the epoch's end
            engine.control.faults = None


# --- outcomes ---------------------------------------------------------------------------------------


@dataclass
class Tally:
    """Everything the soak counts; :meth:`summary` is the JSON object it prints."""

    seed: int
    abort_rate: float
    fault_rate: float
    loss: float = 0.0
    rooms: int = 0
    completed: int = 0
    failed_as_intended: int = 0
    failed_unexpectedly: int = 0
    corrupted: int = 0
    leaked: int = 0
    follow_ups: int = 0
    epochs: int = 0
    paths: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    tp_pairs: Counter[str] = field(default_factory=Counter)
    layouts: Counter[str] = field(default_factory=Counter)
    aborts: Counter[str] = field(default_factory=Counter)
    write_faults: Counter[str] = field(default_factory=Counter)
    reasons: Counter[str] = field(default_factory=Counter)
    faults_fired: Counter[str] = field(default_factory=Counter)
    engine_counters: Counter[str] = field(default_factory=Counter)
    lost: Counter[str] = field(default_factory=Counter)
    """Messages the loss mode lost, by kind."""
    loss_rooms: Counter[str] = field(default_factory=Counter)
    """Rooms that lost a message, by outcome."""
    loss_fail_s: list[float] = field(default_factory=list)
    """Of rooms that lost a message and failed: seconds from opening to both sides ended."""
    loss_complete_s: list[float] = field(default_factory=list)
    """Of rooms that lost a message and still completed: the same."""
    lease_breaks: int = 0
    layerwise: Counter[str] = field(default_factory=Counter)
    """Layer-wise rooms, by outcome."""
    unexpected: list[str] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def count(self, cfg: EpochConfig, outcome: str, detail: str = "", layerwise: bool = False) -> None:
        self.rooms += 1
        setattr(self, outcome, getattr(self, outcome) + 1)
        if layerwise:
            self.layerwise["rooms"] += 1
            self.layerwise[outcome] += 1
        self.paths[cfg.path]["rooms"] += 1
        self.paths[cfg.path][outcome] += 1
        self.tp_pairs[f"{cfg.P}x{cfg.D}"] += 1
        if cfg.mla:
            self.layouts["mla"] += 1
        if cfg.prefill_page_size != cfg.decode_page_size:
            self.layouts["page_sizes_differ"] += 1
        if cfg.tiny_ring:
            self.layouts["tiny_ring"] += 1
        if detail and len(self.unexpected) < 50 and outcome in ("failed_unexpectedly", "corrupted"):
            self.unexpected.append(f"{cfg.describe()}: {detail}")
            log.error("%s: %s", outcome, detail)

    def summary(self) -> dict[str, Any]:
        return {
            "rooms": self.rooms,
            "completed": self.completed,
            "failed_as_intended": self.failed_as_intended,
            "failed_unexpectedly": self.failed_unexpectedly,
            "corrupted": self.corrupted,
            "leaked": self.leaked,
            "rooms_per_s": round(self.rooms / self.seconds, 1) if self.seconds else 0.0,
            "seconds": round(self.seconds, 1),
            "seed": self.seed,
            "abort_rate": self.abort_rate,
            "fault_rate": self.fault_rate,
            "epochs": self.epochs,
            "follow_ups": self.follow_ups,
            "paths": {path: dict(sorted(c.items())) for path, c in sorted(self.paths.items())},
            "tp_pairs": dict(sorted(self.tp_pairs.items())),
            "layerwise": dict(sorted(self.layerwise.items())),
            "layouts": dict(sorted(self.layouts.items())),
            "aborts": dict(sorted(self.aborts.items())),
            "write_faults": dict(sorted(self.write_faults.items())),
            "failure_reasons": dict(sorted(self.reasons.items())),
            "faults_fired": dict(sorted(self.faults_fired.items())),
            "engine_counters": dict(sorted(self.engine_counters.items())),
            **(
                {
                    "loss": self.loss,
                    "lost": dict(sorted(self.lost.items())),
                    "rooms_with_loss": dict(sorted(self.loss_rooms.items())),
                    "loss_failed_seconds": _quantiles(self.loss_fail_s),
                    "loss_completed_seconds": _quantiles(self.loss_complete_s),
                    "lease_breaks": self.lease_breaks,
                }
                if self.loss
                else {}
            ),
            "unexpected": self.unexpected,
            "leaks": self.leaks,
        }


def _quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def q(f: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(f * len(ordered)))], 2)

    return {"n": len(ordered), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": round(ordered[-1], 2)}


Outcome = FailureReason | None
"""How one handle of a room ended: None for Success, else the failure reason."""


async def _outcome(handle: Sender | Receiver) -> tuple[Outcome, str]:
    try:
        with anyio.fail_after(ROOM_GUARD_S):
            await handle.wait()
    except TransferFailed as exc:
        return exc.reason, exc.detail
    except TimeoutError:
        status = handle.poll().name
        with anyio.move_on_after(5.0):
            await handle.abort("soak: hung")
        return FailureReason.TRANSFER_TIMEOUT, f"hung: still {status} after {ROOM_GUARD_S} s"
    return None, ""


async def _outcomes(handles: Sequence[Sender | Receiver]) -> list[tuple[Outcome, str]]:
    results: list[tuple[Outcome, str]] = [(None, "")] * len(handles)

    async def one(i: int) -> None:
        results[i] = await _outcome(handles[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(handles)):
            tg.start_soon(one, i)
    return results


# --- one epoch --------------------------------------------------------------------------------------


@dataclass
class Slot:
    """The pages and aux slots one concurrent lane of rooms owns (prefill has two sets: A and B)."""

    prefill_pages: tuple[list[int], list[int]]
    prefill_aux: tuple[int, int]
    decode_pages: list[int]
    decode_aux: int
    turn: int = 0


class Epoch:
    """Runs one epoch's rooms on one cluster and counts them into ``tally``."""

    def __init__(
        self,
        cfg: EpochConfig,
        cluster: Cluster,
        injector: Injector,
        tally: Tally,
        rng: random.Random,
        rooms: int,
        room_ids: itertools.count[int],
        abort_rate: float,
        fault_rate: float,
        layerwise: float = 0.0,
    ) -> None:
        self.cfg = cfg
        self.c = cluster
        self.injector = injector
        self.tally = tally
        self.rng = rng
        self.budget = rooms
        self.room_ids = room_ids
        self.abort_rate = abort_rate
        self.fault_rate = fault_rate
        self.layerwise = layerwise

    def slots(self) -> list[Slot]:
        cfg, rng = self.cfg, self.rng
        prefill = rng.sample(range(2 * cfg.concurrency * cfg.max_pages), 2 * cfg.concurrency * cfg.max_pages)
        per_decode = cfg.decode_pages(cfg.max_pages)
        decode = rng.sample(range(cfg.concurrency * per_decode), cfg.concurrency * per_decode)
        k = cfg.max_pages
        return [
            Slot(
                (prefill[2 * i * k : (2 * i + 1) * k], prefill[(2 * i + 1) * k : (2 * i + 2) * k]),
                (2 * i, 2 * i + 1),
                decode[i * per_decode : (i + 1) * per_decode],
                i,
            )
            for i in range(cfg.concurrency)
        ]

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            for slot in self.slots():
                tg.start_soon(self._lane, slot)

    async def _lane(self, slot: Slot) -> None:
        rng = self.rng
        while self.budget > 0:
            self.budget -= 1
            pages = rng.randint(1, self.cfg.max_pages)
            plan = RoomPlan(
                room=next(self.room_ids),
                chunks=random_chunks(rng, pages, self.cfg.max_chunk),
                aux=rng.random() < 0.7,
                prefill_first=rng.random() < 0.3,
            )
            if self.layerwise and rng.random() < self.layerwise:
                plan = _replace(plan, layer_step=rng.randint(1, 2), layers_per_write=rng.randint(1, 3))
            if rng.random() < self.abort_rate:
                plan = _replace(plan, abort=plan_abort(rng, self.cfg, plan.chunks, plan.layer_step > 0))
            if rng.random() < self.fault_rate:
                plan = _replace(
                    plan,
                    write_fault=(rng.choice(WRITE_FAULTS), rng.randrange(len(plan.chunks) * self.cfg.P + 1)),
                )
            src = np.array(rng.sample(slot.prefill_pages[slot.turn % 2], pages), dtype=np.int64)
            dst = np.array(rng.sample(slot.decode_pages, self.cfg.decode_pages(pages)), dtype=np.int64)
            aux_p = slot.prefill_aux[slot.turn % 2]
            slot.turn += 1
            failed, old_senders = await self._room(plan, src, dst, aux_p, slot.decode_aux)
            if not failed:
                await old_senders
                continue
            # The decode pages and aux slot of a failed room take the next room at once, before the
            # failed room's senders are even done: nothing of the failed room may land there now.
            follow = RoomPlan(
                room=next(self.room_ids),
                chunks=random_chunks(rng, pages, self.cfg.max_chunk),
                aux=plan.aux,
                prefill_first=rng.random() < 0.3,
                follow_up=True,
            )
            src2 = np.array(rng.sample(slot.prefill_pages[slot.turn % 2], pages), dtype=np.int64)
            aux_p2 = slot.prefill_aux[slot.turn % 2]
            slot.turn += 1
            self.budget -= 1
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._follow_up, follow, src2, dst, aux_p2, slot.decode_aux)
                await old_senders

    async def _follow_up(
        self, plan: RoomPlan, src: np.ndarray, dst: np.ndarray, aux_p: int, aux_d: int
    ) -> None:
        self.tally.follow_ups += 1
        _, senders = await self._room(plan, src, dst, aux_p, aux_d)
        await senders

    async def _room(
        self, plan: RoomPlan, src: np.ndarray, dst: np.ndarray, aux_p: int, aux_d: int
    ) -> tuple[bool, Awaitable[None]]:
        """Run one room until its decode handles ended; returns (failed, awaitable of the prefill side).

        The prefill side is finished (and counted) by the returned awaitable, so the decode pages can
        be reused while the prefill's senders still end.
        """
        cfg, c, room, rng = self.cfg, self.c, plan.room, self.rng
        opened = time.monotonic()
        abort = plan.abort
        if abort is not None:
            self.tally.aborts[abort.label] += 1
            if abort.point == "mid_transfer":
                self.injector.held_rooms.add(room)
        if plan.write_fault is not None:
            self.injector.fail[room] = plan.write_fault
        for engine in c.prefill:
            patterns.fill(engine.pool, room, src)
            if plan.aux:
                patterns.fill_aux(engine.pool, room, aux_p)
        receivers: list[Receiver] = []
        senders: list[Sender] = []
        problems: list[str] = []

        async def open_receivers() -> None:
            for engine in c.decode:
                receivers.append(
                    await engine.receiver(room, c.bootstrap, dst, aux_slot=aux_d if plan.aux else None)
                )

        def open_senders() -> None:
            per_write = plan.layers_per_write if plan.layer_step else None
            senders.extend(engine.sender(room, layers_per_write=per_write) for engine in c.prefill)

        async def abort_side(handles: Sequence[Sender | Receiver], ranks: Sequence[int]) -> None:
            if abort is not None and abort.delay_s:
                await anyio.sleep(abort.delay_s)
            async with anyio.create_task_group() as tg:
                for rank in ranks:
                    if rank < len(handles):
                        tg.start_soon(handles[rank].abort, f"soak: {abort.label if abort else 'abort'}")

        def refused(call: str, exc: LocalProtocolError) -> None:
            """A call refused because the room failed meanwhile: only an abort or a fault explains it."""
            if abort is None and room not in self.injector.failed_rooms:
                problems.append(f"{call} refused: {exc}")

        async def send_layers(
            live: Sequence[Sender], pages: np.ndarray, last: bool, mid: Callable[[], Awaitable[None]] | None
        ) -> None:
            """One chunk, layer-wise, on every live rank: ``begin_chunk``, then ranges of
            ``plan.layer_step`` layers; ``mid`` (an abort) runs after the first range."""
            aux_slot = aux_p if last and plan.aux else None
            ranks = []
            for sender in live:
                if sender.poll().final:
                    continue
                try:
                    await sender.begin_chunk(pages, last=last, aux_slot=aux_slot)
                    ranks.append(sender)
                except LocalProtocolError as exc:
                    refused("begin_chunk()", exc)
            unset: list[threading.Event] = []  # set a little later: the worker must wait for them
            try:
                for a in range(0, cfg.layers, plan.layer_step):
                    b = min(a + plan.layer_step, cfg.layers)
                    for sender in list(ranks):
                        ready = threading.Event() if rng.random() < 0.5 else None
                        try:
                            await sender.layers_ready(a, b, ready=ready)
                        except LocalProtocolError as exc:
                            refused("layers_ready()", exc)
                            ranks.remove(sender)
                            continue
                        if ready is not None:
                            unset.append(ready)
                    if a == 0 and mid is not None:
                        await mid()
                    if rng.random() < 0.5:
                        await anyio.lowlevel.checkpoint()
                        for event in unset:
                            event.set()
                        unset.clear()
            finally:
                for event in unset:
                    event.set()

        async def send_chunks(
            live: Sequence[Sender], hook_at: int | None, hook: Callable[[], Awaitable[None]]
        ) -> None:
            between_layers = abort is not None and abort.point == "between_layers"
            start = 0
            for i, k in enumerate(plan.chunks):
                if hook_at == i and not between_layers:
                    await hook()
                last = i == len(plan.chunks) - 1
                if plan.layer_step:
                    mid = hook if between_layers and hook_at == i else None
                    await send_layers(live, src[start : start + k], last, mid)
                    start += k
                    continue
                for sender in live:
                    if sender.poll().final:
                        continue
                    try:
                        await sender.send(
                            src[start : start + k], last=last, aux_slot=aux_p if last and plan.aux else None
                        )
                    except LocalProtocolError as exc:  # the room failed meanwhile (an abort came in)
                        refused("send()", exc)
                start += k
                if rng.random() < 0.3:
                    await anyio.lowlevel.checkpoint()
            if hook_at == len(plan.chunks):
                await hook()

        try:
            async with anyio.create_task_group() as tg:

                async def start_abort() -> None:
                    assert abort is not None
                    handles: list[Sender | Receiver] = list(receivers if abort.side == "decode" else senders)
                    tg.start_soon(abort_side, handles, abort.ranks)

                async def nothing() -> None:
                    pass

                if abort is not None and abort.point == "before_bootstrap":
                    await self._before_bootstrap(
                        plan, abort, open_receivers, open_senders, abort_side, send_chunks, receivers, senders
                    )
                else:
                    if plan.prefill_first:
                        open_senders()
                        await open_receivers()
                    else:
                        await open_receivers()
                        open_senders()
                    hook_at: int | None = None
                    hook: Callable[[], Awaitable[None]] = nothing
                    if abort is not None:
                        hook = start_abort
                        hook_at = len(plan.chunks)
                        if abort.point == "between_chunks":
                            hook_at = abort.after_chunks
                        elif abort.point == "between_layers":
                            hook_at = min(abort.after_chunks - 1, len(plan.chunks) - 1)
                        if abort.point == "after_last" and rng.random() < 0.5:
                            hook = self._after_success(receivers, start_abort)
                    await send_chunks(senders, hook_at, hook)
        except Exception as exc:  # an API call that should not have raised
            problems.extend(_errors(exc))
        decoded = await _outcomes(receivers)
        verified = self._verify(plan, dst, aux_d, decoded)
        failed = any(reason is not None for reason, _ in decoded) or bool(problems) or len(receivers) < cfg.D

        async def prefill_side() -> None:
            prefilled = await _outcomes(senders)
            self._judge(plan, src, verified, decoded, prefilled, problems, time.monotonic() - opened)
            self.injector.fail.pop(room, None)
            self.injector.writes_seen.pop(room, None)
            self.injector.held_rooms.discard(room)

        return failed, prefill_side()

    async def _before_bootstrap(
        self,
        plan: RoomPlan,
        abort: AbortPlan,
        open_receivers: Callable[[], Awaitable[None]],
        open_senders: Callable[[], None],
        abort_side: Callable[[Sequence[Sender | Receiver], Sequence[int]], Awaitable[None]],
        send_chunks: Callable[[Sequence[Sender], int | None, Callable[[], Awaitable[None]]], Awaitable[None]],
        receivers: list[Receiver],
        senders: list[Sender],
    ) -> None:
        """An abort before the other side opened the room; the other side then follows ``abort.other_side``."""

        async def nothing() -> None:
            pass

        if abort.side == "decode":
            await open_receivers()
            await abort_side(receivers, abort.ranks)
            if abort.other_side == "never":
                return
            open_senders()
            if abort.other_side == "aborts":
                await abort_side(senders, range(len(senders)))
            else:
                await send_chunks(senders, None, nothing)
            return
        open_senders()
        await abort_side(senders, abort.ranks)
        await open_receivers()
        if abort.other_side == "aborts":
            await abort_side(receivers, range(len(receivers)))

    @staticmethod
    def _after_success(
        receivers: Sequence[Receiver], then: Callable[[], Awaitable[None]]
    ) -> Callable[[], Awaitable[None]]:
        """A hook that waits (briefly) until every decode rank succeeded, then runs ``then``."""

        async def hook() -> None:
            with anyio.move_on_after(1.0):
                while not all(r.poll().final for r in receivers):  # noqa: ASYNC110 (polling, as a scheduler does)
                    await anyio.sleep(0.001)
            await then()

        return hook

    def _verify(
        self, plan: RoomPlan, dst: np.ndarray, aux_d: int, decoded: list[tuple[Outcome, str]]
    ) -> list[str]:
        """What differs on the decode ranks that succeeded: checked as soon as the decode side ended,
        before its pages can go to a follow-up room."""
        cfg = self.cfg
        bad: list[str] = []
        tokens = patterns.received_tokens(plan.pages, cfg.prefill_page_size, len(dst), cfg.decode_page_size)
        for (reason, _), engine in zip(decoded, self.c.decode, strict=False):
            if reason is not None:
                continue
            wrong = patterns.mismatches(engine.pool, plan.room, dst, tokens)
            if wrong:
                bad.append(f"decode rank {engine.config.tp_rank}: {wrong} elements differ")
            if plan.aux and not patterns.aux_ok(engine.pool, plan.room, aux_d):
                bad.append(f"decode rank {engine.config.tp_rank}: aux item differs")
        return bad

    def _judge(
        self,
        plan: RoomPlan,
        src: np.ndarray,
        verified: list[str],
        decoded: list[tuple[Outcome, str]],
        prefilled: list[tuple[Outcome, str]],
        problems: list[str],
        seconds: float,
    ) -> None:
        cfg, tally = self.cfg, self.tally
        abort = plan.abort

        def count(outcome: str, detail: str = "") -> None:
            tally.count(cfg, outcome, detail, layerwise=plan.layer_step > 0)

        faulted = plan.room in self.injector.failed_rooms
        loss = self.injector.loss
        lost = sorted(loss.rooms.get(plan.room, ())) if loss is not None else []
        if faulted and plan.write_fault is not None:
            tally.write_faults[plan.write_fault[0].value] += 1
        for reason, _ in decoded + prefilled:
            if reason is not None:
                tally.reasons[reason.name] += 1
        bad = verified
        what = (
            f"room {plan.room} ({plan.pages} pages in {list(plan.chunks)}, aux={plan.aux}, "
            f"abort={abort.label + ' ranks ' + str(abort.ranks) + ' other ' + abort.other_side if abort else None}, "
            f"fault={plan.write_fault[0].value if faulted and plan.write_fault else None}, follow_up={plan.follow_up}"
            f"{f', layer-wise {plan.layer_step} per call x{plan.layers_per_write}' if plan.layer_step else ''}"
            f"{', lost ' + '+'.join(lost) if lost else ''})"
        )
        if bad:
            count("corrupted", f"{what}: {'; '.join(bad)}")
            return
        allowed: frozenset[FailureReason] = frozenset()
        if abort is not None:
            allowed |= ABORT_REASONS
        if faulted:
            allowed |= FAULT_REASONS
        # A ring is shared by the rooms of a decode rank: a room whose notification was lost holds its
        # region until its deadline, and the rooms queued behind it on the ring may reach theirs.
        collateral = not lost and loss is not None and bool(loss.rooms) and cfg.path in ("staged", "host")
        if lost or collateral:
            allowed |= LOSS_REASONS
        if loss is not None and loss.lease_breaks:
            allowed |= {FailureReason.PEER_DEAD}
        failures = [
            f"{side} rank {rank}: {reason.name}: {detail}"
            for side, results in (("decode", decoded), ("prefill", prefilled))
            for rank, (reason, detail) in enumerate(results)
            if reason is not None
        ]
        unexplained = [
            f"{side} rank {rank}: {reason.name}: {detail}"
            for side, results in (("decode", decoded), ("prefill", prefilled))
            for rank, (reason, detail) in enumerate(results)
            if reason is not None and not _explained(reason, detail, allowed)
        ]
        if lost:
            ok = not (problems or unexplained) and not failures and len(decoded) == cfg.D
            tally.loss_rooms["completed" if ok else "failed"] += 1
            (tally.loss_complete_s if ok else tally.loss_fail_s).append(seconds)
        elif collateral and failures:
            tally.loss_rooms["failed_behind_a_loss_on_the_ring"] += 1
        if problems or unexplained:
            count("failed_unexpectedly", f"{what}: {'; '.join(problems + unexplained)}")
        elif len(decoded) == cfg.D and all(reason is None for reason, _ in decoded):
            count("completed")
        elif failures:
            count("failed_as_intended")
        elif abort is not None and abort.point == "before_bootstrap" and abort.other_side == "never":
            count("failed_as_intended")  # aborted by decode; the prefill never opened it
        else:
            count("failed_unexpectedly", f"{what}: no decode outcome")


REFUSED_AS_ENDED = re.compile(r"refused the chunk: room \d+ (is FAILED|is not a live staged room|ended)")
"""A decode ring's StagingRefused for a room that had already failed there."""


def _explained(reason: FailureReason, detail: str, allowed: frozenset[FailureReason]) -> bool:
    """Whether ``reason`` is one the room's abort or fault explains.

    A prefill rank whose staged chunk was refused because the decode room had already failed reports
    STAGING: it hears the refusal before the decode's Abort when control messages are delayed or
    reordered (they are FIFO otherwise). That counts as the abort's or fault's doing.
    """
    if reason in allowed:
        return True
    return bool(allowed) and reason is FailureReason.STAGING and REFUSED_AS_ENDED.search(detail) is not None


def _errors(exc: BaseException) -> list[str]:
    """``Type: message`` of ``exc``, or of each exception inside an exception group."""
    if isinstance(exc, BaseExceptionGroup):
        return [line for inner in exc.exceptions for line in _errors(inner)]
    return [f"{type(exc).__name__}: {exc}"]


def _replace(plan: RoomPlan, **changes: Any) -> RoomPlan:
    fields = {name: getattr(plan, name) for name in RoomPlan.__dataclass_fields__}
    return RoomPlan(**(fields | changes))


async def _settle(cluster: Cluster, tally: Tally, cfg: EpochConfig) -> None:
    """Wait until every engine is idle (bounded), then count whatever it still holds as leaked."""
    with anyio.move_on_after(LEAK_WAIT_S):
        while any(any(engine.leaks().values()) for engine in cluster.engines):  # noqa: ASYNC110
            await anyio.sleep(0.02)
    for engine in cluster.engines:
        leaks = {k: v for k, v in engine.leaks().items() if v}
        if leaks:
            tally.leaked += sum(leaks.values())
            tally.leaks.append(f"{cfg.describe()}: {engine.agent_name} holds {leaks}")
            log.error("leak: %s holds %s", engine.agent_name, leaks)


def _collect(cluster: Cluster, tally: Tally) -> None:
    for transport in cluster.transports:
        tally.faults_fired.update({f"transport_{k}": v for k, v in transport.fired.items()})
    for engine in cluster.engines:
        faults = engine.control.faults
        if isinstance(faults, ControlFaults):
            tally.faults_fired.update({f"control_{k}": v for k, v in faults.fired.items()})
        for key in ("notifs_duplicate", "late_messages", "stash_expired", "peers_dead",
                    "requests_repeated", "repeated_requests", "repeated_aborts"):  # fmt: skip
            tally.engine_counters[key] += engine.counters[key]
        tally.engine_counters["notifs_unrouted"] += engine.poller.counters["notifs_unrouted"]
        for worker in engine.workers:
            for key in ("watermark_waits", "lease_waits", "staged_writes"):
                tally.engine_counters[key] += worker.counters[key]


async def soak(
    rooms: int,
    *,
    abort_rate: float = 0.1,
    fault_rate: float = 0.05,
    loss: float = 0.0,
    layerwise: float = 0.0,
    seed: int = 0,
    min_epoch: int = 20,
    max_epoch: int = 50,
    progress: bool = False,
) -> dict[str, Any]:
    """Run about ``rooms`` rooms (follow-ups included) in epochs; returns the summary object."""
    rng = random.Random(seed)
    tally = Tally(seed, abort_rate, fault_rate, loss)
    room_ids = itertools.count(seed * 1_000_000_000 + 1)
    started = time.monotonic()
    left = rooms
    while left > 0:
        size = min(left, rng.randint(min_epoch, max_epoch))
        if 0 < left - size < min_epoch:  # no tiny last epoch
            size = left
        cfg = choose_epoch(tally.epochs, rng, fault_rate)
        before = tally.rooms
        injector = Injector()
        if loss:
            injector.loss = Loss(loss, seed=rng.randrange(1 << 30))
        epoch_started = time.monotonic()
        async with open_cluster(cfg, injector, seed=rng.randrange(1 << 30)) as cluster:
            epoch = Epoch(cfg, cluster, injector, tally, random.Random(rng.randrange(1 << 62)), size,
                          room_ids, abort_rate, fault_rate, layerwise)  # fmt: skip
            await epoch.run()
            await _settle(cluster, tally, cfg)
            _collect(cluster, tally)
        if injector.loss is not None:
            tally.lost.update(injector.loss.lost)
            tally.lease_breaks += injector.loss.lease_breaks
        tally.epochs += 1
        left -= tally.rooms - before
        if progress:
            print(
                f"{cfg.describe()}: {tally.rooms - before} rooms in {time.monotonic() - epoch_started:.1f} s; "
                f"total {tally.rooms}: {tally.completed} ok, {tally.failed_as_intended} failed as intended, "
                f"{tally.failed_unexpectedly} unexpectedly, {tally.corrupted} corrupted, {tally.leaked} leaked",
                file=sys.stderr,
                flush=True,
            )
    tally.seconds = time.monotonic() - started
    return tally.summary()


def healthy(summary: dict[str, Any]) -> bool:
    """Nothing corrupted, leaked or failed unexpectedly."""
    return summary["corrupted"] == summary["leaked"] == summary["failed_unexpectedly"] == 0


def _quiet_nixl() -> None:
    """NIXL logs each agent it creates at INFO on stdout; stdout is for the summary."""
    with contextlib.suppress(ImportError):
        import nixl._api  # noqa: F401  (sets up the "nixl" logger, level INFO, when first imported)
    logging.getLogger("nixl").setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rooms", type=int, default=1000, help="rooms to run, follow-ups included")
    parser.add_argument("--abort-rate", type=float, default=0.1, help="fraction of rooms aborted")
    parser.add_argument("--fault-rate", type=float, default=0.05,
                        help="fraction of rooms with a failed WRITE; > 0 also turns random delays on in half the epochs")  # fmt: skip
    parser.add_argument("--loss", type=float, default=0.0,
                        help="probability that each control message and NIXL notification is lost")  # fmt: skip
    parser.add_argument("--layerwise", type=float, default=0.25,
                        help="fraction of rooms sent layer-wise (begin_chunk/layers_ready)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-epoch", type=int, default=20, help="fewest rooms per cluster configuration")
    parser.add_argument("--max-epoch", type=int, default=50, help="most rooms per cluster configuration")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                        help="print the summary as one JSON object (and write it to PATH)")  # fmt: skip
    parser.add_argument("--quiet", action="store_true", help="no line per epoch on stderr")
    parser.add_argument("--log-level", default="CRITICAL", help="engine log level (default: silent)")
    args = parser.parse_args(argv)
    if not (
        0 <= args.abort_rate <= 1
        and 0 <= args.fault_rate <= 1
        and 0 <= args.loss <= 1
        and 0 <= args.layerwise <= 1
        and args.rooms > 0
    ):
        parser.error("--rooms must be > 0 and the rates in [0, 1]")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("soak").setLevel(logging.ERROR)
    _quiet_nixl()
    summary = anyio.run(
        lambda: soak(
            args.rooms,
            abort_rate=args.abort_rate,
            fault_rate=args.fault_rate,
            loss=args.loss,
            layerwise=args.layerwise,
            seed=args.seed,
            min_epoch=args.min_epoch,
            max_epoch=args.max_epoch,
            progress=not args.quiet,
        )
    )
    if args.json is not None:
        text = json.dumps(summary)
        print(text)
        if args.json != "-":
            with open(args.json, "w") as f:
                f.write(text + "\n")
    else:
        print(
            f"{summary['rooms']} rooms in {summary['seconds']} s ({summary['rooms_per_s']}/s): "
            f"{summary['completed']} completed, {summary['failed_as_intended']} failed as intended, "
            f"{summary['failed_unexpectedly']} failed unexpectedly, {summary['corrupted']} corrupted, "
            f"{summary['leaked']} leaked"
        )
        for line in summary["unexpected"] + summary["leaks"]:
            print("  " + line)
    return 0 if healthy(summary) else 1


if __name__ == "__main__":
    sys.exit(main())
