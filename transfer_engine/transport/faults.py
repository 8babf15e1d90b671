"""Fault injection for tests: a wrapper around the real transport, and a hook for the control sockets.

:class:`FaultyTransport` wraps any :class:`~transfer_engine.transport.nixl.Transport` (in practice
the real :class:`~transfer_engine.transport.nixl.NixlTransport`: the bytes always move over NIXL)
and applies :class:`Rule`\\ s to two streams:

- **WRITEs** it posts (``writes=``): refuse the post (:attr:`Fault.FAIL_POST`), post it with its
  destination moved outside the peer's memory so that the real range check refuses it
  (:attr:`Fault.BAD_ADDRESS`), post it without its notification and report it ended in error
  (:attr:`Fault.ERROR`), or report its completion late (:attr:`Fault.DELAY`);
- **notifications** it drains (``notifs=``): deliver late (DELAY), hold everything for a while
  (STALL), lose (DROP), deliver twice (DUPLICATE), or let the next one overtake (REORDER).

:class:`ControlFaults` applies rules (DELAY, DROP, DUPLICATE, REORDER) to the one-way messages a
:class:`~transfer_engine.actors.control.Control` sends (set ``control.faults``).

:class:`Loss` is the lossy-network mode: a DROP matcher (:meth:`Loss.rules`) that loses control
messages of every kind and NIXL notifications, each with its own probability, and records what it
lost by room and kind (and runs of heartbeats lost in a row, which can break a lease), so that a
soak can tell a room that failed because its messages were lost from one that failed for nothing.

Every rule decides from a seeded ``random.Random`` and counts what it did, so a failing run is
reproduced by its seed. Held payloads live in a :class:`DeliveryQueue`, a sans-IO scheduler that
takes ``now`` as an argument. Nothing here is imported by the engine outside tests.
"""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import heapq
import itertools
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from transfer_engine.errors import RemoteProtocolError, TransportError
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.messages import MemRegion
from transfer_engine.transport.nixl import RemotePeer, Transport, WriteSpec, XferState

__all__ = [
    "ControlFaults",
    "DeliveryQueue",
    "Fault",
    "FaultyTransport",
    "Loss",
    "Rule",
    "matching",
]

log = logging.getLogger(__name__)


class Fault(enum.Enum):
    """What a rule does to the WRITE, notification or message it fires on."""

    FAIL_POST = "fail_post"
    """WRITE: ``post_write`` (``prepare_write``) raises TransportError; nothing is posted."""
    BAD_ADDRESS = "bad_address"
    """WRITE: the destination is moved outside the peer's regions; the real transport must refuse it."""
    ERROR = "error"
    """WRITE: posted (the bytes move) without its notification; its state ends as ERR."""
    FLIP = "flip"
    """WRITE: one bit of the bytes it moves is flipped in flight. The bit (a random descriptor, byte
    and bit) is flipped in the source memory as the WRITE starts — after its notification, and the
    checksum on it, were taken — and flipped back once the WRITE has ended: the peer receives the
    corrupted byte, this side's memory is left as it was. Aux items carry no checksum: match chunk
    WRITEs (``matching(m.ChunkLanded)``)."""
    DELAY = "delay"
    """WRITE: completion reported ``delay_s`` late. Notification or message: delivered ``delay_s`` late."""
    STALL = "stall"
    """Notification: this one and every later one are held until ``delay_s`` from now."""
    DROP = "drop"
    """Notification or message: lost."""
    DUPLICATE = "duplicate"
    """Notification or message: delivered twice."""
    REORDER = "reorder"
    """Notification or message: held until the next one of the same source (or target) went
    through, then delivered after it; at most ``delay_s`` later."""


WRITE_FAULTS = frozenset({Fault.FAIL_POST, Fault.BAD_ADDRESS, Fault.ERROR, Fault.DELAY, Fault.FLIP})
NOTIF_FAULTS = frozenset({Fault.DELAY, Fault.STALL, Fault.DROP, Fault.DUPLICATE, Fault.REORDER})
MESSAGE_FAULTS = frozenset({Fault.DELAY, Fault.DROP, Fault.DUPLICATE, Fault.REORDER})

_OUT_OF_RANGE = np.uint64(1 << 56)
"""Added to every destination address by BAD_ADDRESS: beyond any user-space mapping."""


@dataclass
class Rule:
    """One fault and when it fires.

    Of the payloads ``match`` accepts (all, when None), the first ``skip`` pass untouched; after
    that each fires with ``probability``, at most ``times`` times (None: no limit). The payload is
    a WRITE's notification bytes, a notification, or an encoded control message.
    """

    fault: Fault
    match: Callable[[bytes], bool] | None = None
    probability: float = 1.0
    skip: int = 0
    times: int | None = 1
    delay_s: float = 0.05
    seen: int = field(default=0, init=False)
    """Payloads ``match`` accepted so far."""
    fired: int = field(default=0, init=False)
    """Times the fault was applied."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"probability={self.probability} must be in [0, 1]")
        if self.skip < 0 or (self.times is not None and self.times < 0) or self.delay_s < 0:
            raise ValueError(f"skip={self.skip}, times={self.times}, delay_s={self.delay_s} must be >= 0")

    def fires(self, payload: bytes, rng: random.Random) -> bool:
        """Whether the rule applies to ``payload`` now; updates ``seen`` and ``fired``."""
        if self.match is not None and not self.match(payload):
            return False
        self.seen += 1
        if self.seen <= self.skip or (self.times is not None and self.fired >= self.times):
            return False
        if self.probability < 1.0 and rng.random() >= self.probability:
            return False
        self.fired += 1
        return True


def matching(*types: type[m.Message], room: int | None = None) -> Callable[[bytes], bool]:
    """A ``Rule.match`` for payloads that decode to one of ``types`` (any type if none), of ``room``."""

    def match(payload: bytes) -> bool:
        if not payload:
            return False
        try:
            message = m.decode(payload)
        except RemoteProtocolError:
            return False
        if types and not isinstance(message, types):
            return False
        return room is None or getattr(message, "room", None) == room

    return match


def _decode_any(payload: bytes) -> m.AnyMessage | m.ChunkLanded | m.AuxLanded | None:
    """A control message or a NIXL notification, or None for bytes that are neither."""
    for decode in (m.decode, m.decode_notification):
        try:
            return decode(payload)
        except RemoteProtocolError:
            continue
    return None


class Loss:
    """Loses messages at random and remembers which: the lossy-network fault mode.

    ``probability`` is the chance that one message is lost; ``by_kind`` overrides it per message
    type name (``{"Heartbeat": 0.0}``). Use it as the ``match`` of an always-firing DROP rule
    (:meth:`rules`) placed first, on control sockets (``ControlFaults``) and on notifications
    (``FaultyTransport(notifs=...)``); one instance may serve every engine of a cluster.

    It records ``lost`` (count by kind), ``rooms`` (room -> kinds lost of it) and ``lease_breaks``:
    ``lease_run`` heartbeats in a row of one agent of which at least one copy was lost, enough to make
    a live peer look dead to some peer (counted generously: a rule sees the message, not its target).
    Messages it cannot decode are never lost (they are not the protocol's).
    """

    def __init__(
        self,
        probability: float,
        *,
        seed: int = 0,
        by_kind: dict[str, float] | None = None,
        lease_run: int = 3,
    ) -> None:
        for kind, p in {"*": probability, **(by_kind or {})}.items():
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"loss probability {p} for {kind} must be in [0, 1]")
        self.probability = probability
        self.by_kind = dict(by_kind or {})
        self.lease_run = lease_run
        self._rng = random.Random(seed)
        self.lost: Counter[str] = Counter()
        self.rooms: dict[int, set[str]] = {}
        self.lease_breaks = 0
        self._beat_runs: dict[str, tuple[int, int]] = {}
        """agent -> (last heartbeat seq with a lost copy, run of consecutive such seqs)."""

    def __call__(self, payload: bytes) -> bool:
        """Whether ``payload`` is lost; records it if so."""
        message = _decode_any(payload)
        if message is None:
            return False
        kind = type(message).__name__
        lost = self._rng.random() < self.by_kind.get(kind, self.probability)
        if lost and isinstance(message, m.Heartbeat):
            last, run = self._beat_runs.get(message.agent, (-2, 0))
            if message.seq != last:
                run = run + 1 if message.seq == last + 1 else 1
                self._beat_runs[message.agent] = (message.seq, run)
                if run == self.lease_run:
                    self.lease_breaks += 1
        if lost:
            self.lost[kind] += 1
            room = getattr(message, "room", None)
            if isinstance(room, int):
                self.rooms.setdefault(room, set()).add(kind)
        return lost

    def rules(self) -> list[Rule]:
        """The DROP rule to put first in a rule list (every loss decided by this instance)."""
        return [Rule(Fault.DROP, match=self, times=None)]


class _Rules:
    """An ordered rule list over one stream; the first rule that fires wins."""

    def __init__(self, rules: Iterable[Rule], allowed: frozenset[Fault], stream: str, rng: random.Random):
        self.rules = list(rules)
        for rule in self.rules:
            if rule.fault not in allowed:
                raise ValueError(f"{rule.fault.name} does not apply to {stream}")
        self._rng = rng

    def pick(self, payload: bytes) -> Rule | None:
        for rule in self.rules:
            if rule.fires(payload, self._rng):
                return rule
        return None


Item = tuple[str, bytes]
"""``(key, payload)``: key is the notification's source agent, or the message's target endpoint."""


class DeliveryQueue:
    """Holds delayed, stalled and reordered payloads; sans-IO: every call takes ``now``.

    :meth:`put` returns what goes out at once (in order); :meth:`due` what has become due since.
    Payloads released together keep the order they were put in.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str, bytes]] = []
        self._held: dict[str, list[int]] = {}
        self._released: set[int] = set()
        self._seq = itertools.count()
        self.stalled_until = 0.0

    def __len__(self) -> int:
        return len(self._heap) - len(self._released)

    def put(self, key: str, payload: bytes, rule: Rule | None, now: float) -> list[Item]:
        """Apply ``rule`` (None: no fault) to one payload; returns the payloads to deliver now."""
        fault = rule.fault if rule is not None else None
        if fault is Fault.DROP:
            return []
        copies = 2 if fault is Fault.DUPLICATE else 1
        if rule is not None and fault is Fault.STALL:
            self.stalled_until = max(self.stalled_until, now + rule.delay_s)
        hold_until = self.stalled_until
        if rule is not None and fault in (Fault.DELAY, Fault.REORDER):
            hold_until = max(hold_until, now + rule.delay_s)
        if hold_until > now:
            seqs = [self._push(hold_until, key, payload) for _ in range(copies)]
            if fault is Fault.REORDER:
                self._held.setdefault(key, []).extend(seqs)
            return []
        out = [(key, payload)] * copies
        for seq in self._held.pop(key, []):  # the held ones go after the one that overtook them
            if seq not in self._released:
                out.append(self._find(seq))
                self._released.add(seq)
        return out

    def due(self, now: float) -> list[Item]:
        """The held payloads whose time has come by ``now``, in order."""
        out: list[Item] = []
        while self._heap and self._heap[0][0] <= now:
            _, seq, key, payload = heapq.heappop(self._heap)
            if seq in self._released:
                self._released.discard(seq)
                continue
            held = self._held.get(key)
            if held and seq in held:
                held.remove(seq)
            out.append((key, payload))
        return out

    def next_due(self) -> float | None:
        """When the next held payload is due; None when nothing is held."""
        live = [entry[0] for entry in self._heap if entry[1] not in self._released]
        return min(live, default=None)

    def clear(self) -> int:
        """Forget every held payload; returns how many there were."""
        n = len(self)
        self._heap.clear()
        self._held.clear()
        self._released.clear()
        return n

    def _push(self, due: float, key: str, payload: bytes) -> int:
        seq = next(self._seq)
        heapq.heappush(self._heap, (due, seq, key, payload))
        return seq

    def _find(self, seq: int) -> Item:
        for _, s, key, payload in self._heap:
            if s == seq:
                return key, payload
        raise KeyError(seq)


class ControlFaults:
    """Faults on the one-way messages of a Control actor (``control.faults = ControlFaults(...)``).

    Control calls :meth:`submit` for each message it sends and sends what it returns; it sends
    what :meth:`due` returns once :meth:`next_due` has passed. ``clock`` is the time source.
    """

    def __init__(
        self, rules: Sequence[Rule], *, seed: int = 0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._rules = _Rules(rules, MESSAGE_FAULTS, "control messages", random.Random(seed))
        self.queue = DeliveryQueue()
        self.clock = clock
        self.fired: Counter[str] = Counter()

    @property
    def rules(self) -> list[Rule]:
        return self._rules.rules

    def submit(self, endpoint: str, payload: bytes) -> list[Item]:
        """Apply the rules to one message to ``endpoint``; returns what to send now."""
        rule = self._rules.pick(payload)
        if rule is not None:
            self.fired[rule.fault.value] += 1
        return self.queue.put(endpoint, payload, rule, self.clock())

    def due(self) -> list[Item]:
        """The held messages that are due now."""
        return self.queue.due(self.clock())

    def next_due(self) -> float | None:
        """When the next held message is due, on ``clock``'s time line; None when none is held."""
        return self.queue.next_due()


@dataclass
class _Flip:
    """One bit of local memory to flip as a WRITE starts and to flip back once it ended."""

    addr: int
    bit: int
    mem_type: str
    device: int
    flipped: bool = False

    def toggle(self) -> None:
        flip_bit(self.addr, self.bit, self.mem_type, self.device)
        self.flipped = not self.flipped


def flip_bit(addr: int, bit: int, mem_type: str, device: int) -> None:
    """XOR bit ``bit`` of the byte at ``addr`` of this process's memory (DRAM, or VRAM of ``device``)."""
    if mem_type == "DRAM":
        byte = ctypes.c_uint8.from_address(addr)
        byte.value ^= 1 << bit
        return
    import torch

    class _Byte:  # one byte of device memory, as torch.as_tensor takes it
        __cuda_array_interface__: ClassVar[dict[str, Any]] = {
            "shape": (1,), "typestr": "|u1", "data": (addr, False), "version": 3,
        }  # fmt: skip

    with torch.cuda.device(device):
        view = torch.as_tensor(_Byte(), device=f"cuda:{device}")
        view ^= 1 << bit
        torch.cuda.synchronize(device)


@dataclass
class _Override:
    error: bool = False
    release_at: float = 0.0
    flip: _Flip | None = None


class FaultyTransport:
    """A :class:`Transport` that applies fault rules around a real one; see the module docstring.

    ``fired`` counts the faults applied, by :class:`Fault` value; ``held()`` is how many
    notifications are held back right now. Methods not listed here go to the wrapped transport.
    """

    def __init__(
        self,
        inner: Transport,
        *,
        writes: Sequence[Rule] = (),
        notifs: Sequence[Rule] = (),
        seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        rng = random.Random(seed)
        self._rng = rng
        self.write_rules = _Rules(writes, WRITE_FAULTS, "WRITEs", rng)
        self.notif_rules = _Rules(notifs, NOTIF_FAULTS, "notifications", rng)
        self.inner = inner
        self.name = inner.name
        self.clock = clock
        self.fired: Counter[str] = Counter()
        self._queue = DeliveryQueue()
        self._overrides: dict[int, _Override] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def metadata(self) -> bytes:
        return self.inner.metadata()

    def register(self, regions: Sequence[MemRegion], mem_type: str) -> int:
        return self.inner.register(regions, mem_type)

    def deregister(self, reg: int) -> None:
        self.inner.deregister(reg)

    def add_peer(self, peer: RemotePeer, metadata: bytes) -> None:
        self.inner.add_peer(peer, metadata)

    def remove_peer(self, agent_name: str) -> None:
        self.inner.remove_peer(agent_name)

    def post_write(self, spec: WriteSpec) -> int:
        return self.start_write(self.prepare_write(spec))

    def start_write(self, handle: int, notif: bytes = b"") -> int:
        """Start a made WRITE (with ``notif`` in place of the one it was made with, when given); a
        FLIP rule's bit is flipped now, after the caller took the notification."""
        override = self._overrides.get(handle)
        if override is not None and override.error:
            notif = b""  # an ERROR WRITE goes without a notification, whatever it starts with
        if override is not None and override.flip is not None and not override.flip.flipped:
            override.flip.toggle()
        try:
            return self.inner.start_write(handle, notif) if notif else self.inner.start_write(handle)
        except Exception:
            self._unflip(handle)
            raise

    def prepare_lists(self, spec: WriteSpec) -> int:
        return self.inner.prepare_lists(spec)

    def close_lists(self, lists: int) -> None:
        self.inner.close_lists(lists)

    def prepare_indexed(self, lists: int, index: np.ndarray, spec: WriteSpec) -> int:
        """As :meth:`prepare_write`: a WRITE that a rule alters (a bad address, no notification) is
        made on its own from ``spec`` by the real transport, which refuses or posts it as it would."""
        return self._make(spec, lambda made: self.inner.prepare_indexed(lists, index, made))

    def prepare_write(self, spec: WriteSpec) -> int:
        """The WRITE rules apply here, when the WRITE is made (a prepared one may be started later)."""
        return self._make(spec, self.inner.prepare_write)

    def _make(self, spec: WriteSpec, make: Callable[[WriteSpec], int]) -> int:
        rule = self.write_rules.pick(spec.notif)
        fault = rule.fault if rule is not None else None
        if fault is not None:
            self.fired[fault.value] += 1
            log.info("injecting %s into a WRITE to %s", fault.name, spec.peer)
        if fault is Fault.FAIL_POST:
            raise TransportError(
                f"injected fault: WRITE to {spec.peer} refused ({len(spec.src)} descriptors)"
            )
        if fault is Fault.BAD_ADDRESS:
            spec, make = dataclasses.replace(spec, dst=spec.dst + _OUT_OF_RANGE), self.inner.prepare_write
        if fault is Fault.ERROR:
            spec = dataclasses.replace(spec, notif=b"")
        handle = make(spec)
        if fault is Fault.ERROR:
            self._overrides[handle] = _Override(error=True)
        elif fault is Fault.DELAY:
            assert rule is not None
            self._overrides[handle] = _Override(release_at=self.clock() + rule.delay_s)
        elif fault is Fault.FLIP:
            self._overrides[handle] = _Override(flip=self._pick_flip(spec))
        return handle

    def _pick_flip(self, spec: WriteSpec) -> _Flip:
        """A random bit of ``spec``'s source bytes (a descriptor picked by its length)."""
        lengths = spec.length.astype(np.int64)
        at = self._rng.randrange(int(lengths.sum()))
        index = int(np.searchsorted(np.cumsum(lengths), at, side="right"))
        offset = at - int(lengths[:index].sum())
        devices = spec.local_devices
        device = int(devices if isinstance(devices, int) else np.asarray(devices).reshape(-1)[index])
        return _Flip(int(spec.src[index]) + offset, self._rng.randrange(8), spec.local_mem, device)

    def _unflip(self, handle: int) -> None:
        """Put back the bit a FLIP rule flipped for ``handle`` (its WRITE ended, or never started)."""
        override = self._overrides.get(handle)
        if override is not None and override.flip is not None and override.flip.flipped:
            override.flip.toggle()

    def state(self, handle: int) -> XferState:
        state = self.inner.state(handle)
        override = self._overrides.get(handle)
        if state is XferState.PROC or override is None:
            return state
        if override.flip is not None:
            self._unflip(handle)
            return state
        if override.error:
            return XferState.ERR
        return XferState.PROC if self.clock() < override.release_at else state

    def release(self, handle: int) -> None:
        self._unflip(handle)
        self._overrides.pop(handle, None)
        self.inner.release(handle)

    def drain_notifs(self) -> dict[str, list[bytes]]:
        now = self.clock()
        items = self._queue.due(now)
        for agent, raws in self.inner.drain_notifs().items():
            for raw in raws:
                rule = self.notif_rules.pick(raw)
                if rule is not None:
                    self.fired[rule.fault.value] += 1
                items.extend(self._queue.put(agent, raw, rule, now))
        out: dict[str, list[bytes]] = {}
        for agent, raw in items:
            out.setdefault(agent, []).append(raw)
        return out

    def held(self) -> int:
        """Notifications held back now (delayed, stalled or reordered)."""
        return len(self._queue)

    def live_handles(self) -> int:
        return self.inner.live_handles()

    def close(self) -> None:
        dropped = self._queue.clear()
        if dropped:
            log.info("FaultyTransport %s: %d held notifications dropped at close", self.name, dropped)
        self._overrides.clear()
        self.inner.close()
