"""Fault rules, sans-IO: what a fault does (:class:`Fault`), when it fires (:class:`Rule`,
:func:`matching`), the lossy-network mode (:class:`Loss`), an ordered rule list (:class:`RuleList`),
the scheduler that holds delayed, stalled and reordered payloads (:class:`DeliveryQueue`, which takes
``now`` as an argument), and the hook for a Control actor's messages (:class:`ControlFaults`).
:mod:`transfer_engine.transport.faults` applies them around the real transport."""

from __future__ import annotations

import enum
import heapq
import itertools
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from transfer_engine.errors import RemoteProtocolError
from transfer_engine.protocol import messages as m

__all__ = [
    "MESSAGE_FAULTS",
    "NOTIF_FAULTS",
    "WRITE_FAULTS",
    "ControlFaults",
    "DeliveryQueue",
    "Fault",
    "Item",
    "Loss",
    "Rule",
    "RuleList",
    "matching",
]


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


class RuleList:
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
        self._rules = RuleList(rules, MESSAGE_FAULTS, "control messages", random.Random(seed))
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
