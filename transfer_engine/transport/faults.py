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
takes ``now`` as an argument. Nothing here is imported by the engine outside tests. The rules, the
queue and the control hook are pure and live in :mod:`transfer_engine.transport.fault_rules`; this
module holds the wrapper and re-exports them.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from transfer_engine.errors import TransportError
from transfer_engine.protocol.messages import MemRegion
from transfer_engine.transport.fault_rules import (
    NOTIF_FAULTS,
    WRITE_FAULTS,
    ControlFaults,
    DeliveryQueue,
    Fault,
    Loss,
    Rule,
    RuleList,
    matching,
)
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


_OUT_OF_RANGE = np.uint64(1 << 56)
"""Added to every destination address by BAD_ADDRESS: beyond any user-space mapping."""


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
        self.write_rules = RuleList(writes, WRITE_FAULTS, "WRITEs", rng)
        self.notif_rules = RuleList(notifs, NOTIF_FAULTS, "notifications", rng)
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

    def prepare_from_table(
        self, table: int, src_index: np.ndarray, dst_index: np.ndarray, spec: WriteSpec
    ) -> int:
        """As :meth:`prepare_indexed`: a WRITE made from descriptor tables."""
        return self._make(spec, lambda made: self.inner.prepare_from_table(table, src_index, dst_index, made))

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
