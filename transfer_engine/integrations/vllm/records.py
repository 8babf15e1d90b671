"""What the vLLM connector's core keeps per request, free of vLLM: the digest that proves which
transfer's KV landed (:func:`digest_of`) and the slots it travels in (:class:`DigestSlots`), one
request's room (:class:`RequestRecord`), a layer-wise request's layers (:class:`LayerQueue`), what
ended since the last look (:class:`Reports`), and the kinds of failure the stats count
(:func:`failure_kind`)."""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from transfer_engine import PeerUnreachableError, Receiver, Sender, TransferAborted, TransferTimeout

__all__ = [
    "DIGEST_BYTES",
    "DigestSlots",
    "GroupReady",
    "LayerQueue",
    "Reports",
    "RequestRecord",
    "digest_of",
    "failure_kind",
    "no_stats",
]

DIGEST_BYTES = 16

GroupReady = torch.cuda.Event | None
"""What a layer group waits for before its WRITE: a CUDA event, or nothing (CPU)."""


def digest_of(transfer_id: str) -> bytes:
    """The 16 bytes the prefill WRITEs beside the KV and the decode checks: the full ID's digest."""
    return hashlib.blake2b(transfer_id.encode(), digest_size=DIGEST_BYTES, person=b"te-vllm").digest()


def failure_kind(exc: BaseException) -> str:
    """The kind of a room's failure, as :meth:`.core.ConnectorCore.take_stats` counts it."""
    if isinstance(exc, TransferTimeout):
        return "timeout"
    if isinstance(exc, TransferAborted):
        return "aborted"
    if isinstance(exc, PeerUnreachableError):
        return "unreachable"
    return "failed"


@dataclass
class RequestRecord:
    """One request's room on this rank (loop thread only, once handed over)."""

    req_id: str
    transfer_id: str
    room: int
    block_ids: tuple[int, ...]
    handle: Sender | Receiver | None = None
    aborted: bool = False
    opened: float = field(default_factory=time.monotonic)
    pages: int = 0
    """Pool pages this rank moved for the room (set once known)."""
    failure: str = "failed"


@dataclass
class LayerQueue:
    """A layer-wise request's layers as the worker thread reports them (worker thread only)."""

    queue: asyncio.Queue[tuple[int, int, GroupReady]]
    handed: int = 0
    """Layers ``[0, handed)`` were handed to the loop."""
    end: int = 0
    """Layers ``[0, end)`` were reported written."""
    stream: torch.cuda.Stream | None = None
    """CUDA: the stream that writes layers ``[handed, end)``."""


@dataclass
class Reports:
    """What ended since the last look (under the core's lock)."""

    sent: set[str] = field(default_factory=set)
    received: set[str] = field(default_factory=set)
    load_errors: set[int] = field(default_factory=set)
    stats: dict[str, Any] = field(default_factory=lambda: no_stats())

    def record(
        self, request: RequestRecord, ok: bool, prefill: bool, *, page_bytes: int, counts_rooms: bool
    ) -> None:
        """``request``'s room ended: report it, and count its bytes (``page_bytes`` a page) and, when
        ``counts_rooms`` (TP rank 0), its success or failure (under the core's lock)."""
        stats = self.stats
        if ok:
            stats["bytes"] += request.pages * page_bytes
        if counts_rooms and ok:
            stats["transfers"] += 1
            stats["seconds"].append(time.monotonic() - request.opened)
        elif counts_rooms and not request.aborted:
            stats["failures"][request.failure] = stats["failures"].get(request.failure, 0) + 1
        if prefill:
            self.sent.add(request.req_id)
            return
        self.received.add(request.req_id)
        if not ok and not request.aborted:
            self.load_errors.update(request.block_ids)


def no_stats() -> dict[str, Any]:
    return {"transfers": 0, "bytes": 0, "seconds": [], "failures": {}}


class DigestSlots:
    """The aux items of a rank's live requests: one :data:`DIGEST_BYTES` slot each, in the memory of
    the KV it travels with (``tensor``, registered with the pool), and the slots ``free``."""

    def __init__(self, count: int, device: torch.device) -> None:
        self.tensor = torch.zeros(count, DIGEST_BYTES, dtype=torch.uint8, device=device)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        """CUDA: where the loop thread copies digests in and out (a stream of its own: no wait on
        the forward's work)."""
        self.free = list(range(count))

    def write(self, slot: int, data: bytes) -> None:
        """Write aux slot ``slot``; done when this returns (CUDA: on the aux stream, waited for)."""
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if self.stream is None:
            self.tensor[slot] = src
            return
        with torch.cuda.stream(self.stream):
            self.tensor[slot].copy_(src)
        self.stream.synchronize()

    def read(self, slot: int) -> bytes:
        if self.stream is None:
            return bytes(self.tensor[slot].tolist())
        with torch.cuda.stream(self.stream):
            return bytes(self.tensor[slot].cpu().tolist())
