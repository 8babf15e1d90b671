"""Integrity on the kernel path (issue 42 item 3; docs/INTEGRITY.md): with ``integrity`` on, rooms between
two pools of one host still take the kernel path (no fallback to NIXL), the copy kernel sums what it
copies in the same pass, the ``ChunkLanded`` carries that sum, and the decode checks its pages against it
as it checks a direct WRITE's: every chunk (or layer group) matches, bytes exact.

A copy corrupted after it summed (one bit of the destination flipped once the real copy wrote it, before
its notification leaves: :class:`FlippedCopies`, a fault-injecting wrapper around the worker's real
``copy_outer``) fails its room with INTEGRITY while the rooms beside it succeed byte-exact. Integrity
off on either side: the chunks count unchecked, still on the kernel path.

The pools are on ``TE_TEST_DEVICE`` (``tests.integration.harness.DEVICE``): the CPU in CI (the decode's pool
in shared memory, the torch reference's sum), CUDA on the GPU machine (the Triton kernel's sum, its value
copied into pinned memory on the side stream; ``tests/gpu/test_kernel_path_gpu.py`` runs the cases
there). Nothing is left held, in flight or mapped after each test.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import numpy as np
import pytest

from tests.integration.harness import make_pool, run_room, shuffled_pages, small_layout
from tests.integration.test_kernel_path import kernel_copies, shared
from transfer_engine.actors.worker import kernel as kernel_part
from transfer_engine.config import EngineConfig
from transfer_engine.engine import Receiver, Sender, TransferEngine
from transfer_engine.engine.snapshot import build_snapshot
from transfer_engine.errors import LocalProtocolError, TransferFailed
from transfer_engine.kernels.copy import EntryTable
from transfer_engine.memory import ipc
from transfer_engine.memory.layout import KVLayout
from transfer_engine.testing import patterns
from transfer_engine.testing.cluster import Cluster, open_cluster
from transfer_engine.transport.faults import flip_bit

pytestmark = pytest.mark.timeout(120)


@contextlib.asynccontextmanager
async def integrity_cluster(
    layout: KVLayout,
    P: int,
    D: int,
    *,
    kinds: tuple[str, str] = ("contiguous", "contiguous"),
    prefill: dict[str, Any] | None = None,
    decode: dict[str, Any] | None = None,
    **config: Any,
) -> AsyncIterator[Cluster]:
    """P prefill and D decode engines in this process, integrity on unless ``prefill`` / ``decode`` (each
    side's extra config) say otherwise, the decodes' pools in shared memory (the kernel path's)."""

    def make(role: str, rank: int, port: int) -> TransferEngine:
        tp = P if role == "prefill" else D
        side = (prefill if role == "prefill" else decode) or {}
        fields = {"integrity": True, **config, **side}
        cfg = EngineConfig(role=role, tp_size=tp, tp_rank=rank, bootstrap_port=port, **fields)  # type: ignore[arg-type]
        pool = make_pool(kinds[0] if role == "prefill" else kinds[1], layout, tp, rank, 64, 8)
        return TransferEngine(cfg, shared(pool) if role == "decode" else pool)

    async with open_cluster(make, P, D) as c:
        yield c


def counted(c: Cluster, name: str) -> int:
    """The decodes' engine counter ``name`` (``integrity_match``, ``kernel_notifs``...), summed."""
    return sum(e.counters[name] for e in c.decode)


def fallbacks(c: Cluster) -> int:
    return sum(w.counters["kernel_fallbacks"] for e in c.prefill for w in e.workers)


async def rooms_keep_the_kernel_path(P: int, D: int, kinds: tuple[str, str], layers: int, mla: bool) -> None:
    """Two rooms of three chunks (or their layer groups), integrity on: the kernel path, every landed
    chunk matched, none unchecked or mismatched, bytes exact, nothing leaked."""
    layout = small_layout(1 if mla else 8, mla=mla)
    rng = random.Random(P * 10 + D + layers)
    async with integrity_cluster(layout, P, D, kinds=kinds, layers_per_write=2) as c:
        assert all(w.checksums is not None for e in c.prefill for w in e.workers)
        for room in (100, 101):
            src, dst = shuffled_pages(rng, 64, 6), shuffled_pages(rng, 64, 6)
            await run_room(c, room, src, dst, [2, 3, 1], aux_slot=room % 8, layers=layers)
        (ended, *_) = [r for r in build_snapshot(c.decode[0]).ended if r.room == 100]
        assert ended.path == "kernel", (ended.path, ended.path_reason)
        assert kernel_copies(c) >= 2 * 3 * D and fallbacks(c) == 0
        landed = counted(c, "kernel_notifs")
        assert landed >= 2 * 3
        assert counted(c, "integrity_match") == landed
        assert counted(c, "integrity_mismatch") == counted(c, "integrity_unchecked") == 0
        c.assert_no_leaks()
    assert ipc.open_mappings() == 0


KEEP_CASES = [
    pytest.param(1, 1, ("contiguous", "contiguous"), 0, False, id="1x1-contiguous"),
    pytest.param(1, 1, ("flash_nhd", "flash_hnd"), 0, False, id="1x1-nhd-to-hnd"),
    pytest.param(2, 1, ("contiguous", "contiguous"), 0, False, id="2x1-hetero-tp"),
    pytest.param(1, 2, ("flash_nhd", "contiguous"), 0, False, id="1x2-slices"),
    pytest.param(1, 1, ("contiguous", "vllm_cpu"), 1, False, id="1x1-layerwise"),
    pytest.param(2, 2, ("contiguous", "contiguous"), 2, False, id="2x2-layerwise"),
    pytest.param(1, 1, ("vllm_cpu", "vllm_cpu"), 2, False, id="1x1-vllm-kv-fused-layerwise"),
    pytest.param(1, 1, ("contiguous", "contiguous"), 0, True, id="1x1-mla"),
    pytest.param(1, 1, ("contiguous", "contiguous"), 1, True, id="1x1-mla-layerwise"),
]
"""(P, D, pool kinds, layers per group (0: whole chunks), MLA): the layouts the kernel path keeps with
integrity on (``tests/gpu/test_kernel_path_gpu.py`` runs them on CUDA pools)."""


@pytest.mark.anyio
@pytest.mark.parametrize(("P", "D", "kinds", "layers", "mla"), KEEP_CASES)
async def test_integrity_keeps_the_kernel_path(
    P: int, D: int, kinds: tuple[str, str], layers: int, mla: bool
) -> None:
    await rooms_keep_the_kernel_path(P, D, kinds, layers, mla)


class FlippedCopies:
    """The worker's real ``copy_outer``, and then, for a copy whose first destination entry lies in
    ``spans`` (set once the decode's pool is mapped), one bit of that entry's first byte flipped in the
    destination: after the copy summed what it read, before its completion is recorded (on CUDA the
    copy's stream is synchronized first), so the notification carries the sum of the right bytes and the
    decode's check reads the wrong ones."""

    def __init__(self, real: Callable[..., None]) -> None:
        self.real = real
        self.spans: list[tuple[int, int]] = []
        self.flipped = 0

    def __call__(
        self, src: EntryTable, dst: EntryTable, offsets: Any, src_cols: Any, dst_cols: Any, **kw: Any
    ) -> None:
        self.real(src, dst, offsets, src_cols, dst_cols, **kw)
        addr = int(dst.addr[int(np.asarray(offsets)[0]) + int(np.asarray(dst_cols)[0])])
        if not any(low <= addr < high for low, high in self.spans):
            return
        stream = kw.get("stream")
        if stream is not None:
            stream.synchronize()
        on_gpu = dst.device.type == "cuda"
        flip_bit(addr, 3, "VRAM" if on_gpu else "DRAM", (dst.device.index or 0) if on_gpu else 0)
        self.flipped += 1


def page_spans(c: Cluster, pages: np.ndarray) -> list[tuple[int, int]]:
    """The bytes of ``pages`` of decode rank 0's pool as the prefill's mapping of it addresses them:
    one span per (tensor, page) (a page of a contiguous pool's tensor is one run)."""
    (peer,) = [p for p in c.prefill[0].peers.values() if isinstance(p.mapping, ipc.MappedPool)]
    assert isinstance(peer.mapping, ipc.MappedPool)
    bases = peer.mapping.bases
    spans = []
    for region, offset, block, _, _ in c.decode[0].pool.stride_rows.tolist():
        for page in pages.tolist():
            low = int(bases[region]) + offset + page * block
            spans.append((low, low + block))
    return spans


async def outcome(handle: Sender | Receiver) -> str:
    """``SUCCESS`` or the failure reason's name, once the room ended."""
    try:
        with anyio.fail_after(20):
            await handle.wait()
    except TransferFailed as exc:
        return exc.reason.name
    return "SUCCESS"


async def a_flipped_copy_fails_its_room_only(layers: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four rooms at once, the second's copies corrupted after they summed: it fails INTEGRITY on the
    decode (and never counts), the three beside it succeed byte-exact, no copy fell back, nothing leaks."""
    flips = FlippedCopies(kernel_part.copy_outer)
    monkeypatch.setattr(kernel_part, "copy_outer", flips)
    rooms, flipped = [10, 11, 12, 13], 11
    rng = random.Random(40 + layers)
    async with integrity_cluster(small_layout(), 1, 1, layers_per_write=1) as c:
        src, dst = rng.sample(range(64), 16), rng.sample(range(64), 16)
        pages = {
            room: (np.array(src[4 * i : 4 * i + 4]), np.array(dst[4 * i : 4 * i + 4]))
            for i, room in enumerate(rooms)
        }
        receivers = {}
        for room in rooms:
            patterns.fill(c.prefill[0].pool, room, pages[room][0])
            receivers[room] = await c.decode[0].receiver(room, c.bootstrap, pages[room][1])
        flips.spans = page_spans(c, pages[flipped][1])
        senders = {room: c.prefill[0].sender(room) for room in rooms}
        num_layers = c.prefill[0].pool.layout.num_layers
        for room, sender in senders.items():
            # the flipped room may have failed before its later calls: they are refused then
            with contextlib.suppress(*((LocalProtocolError,) if room == flipped else ())):
                for first, last in ((0, False), (2, True)):
                    chunk = pages[room][0][first : first + 2]
                    if not layers:
                        await sender.send(chunk, last=last)
                        continue
                    await sender.begin_chunk(chunk, last=last)
                    for layer in range(num_layers):
                        await sender.layers_ready(layer, layer + 1)
        ended = {room: await outcome(receivers[room]) for room in rooms}
        assert ended == {room: "INTEGRITY" if room == flipped else "SUCCESS" for room in rooms}, ended
        for room in rooms:
            await outcome(senders[room])  # every prefill room ended (the flipped one may have succeeded)
        tokens = patterns.received_tokens(4, 4, 4, 4)
        for room in rooms:
            if room != flipped:
                assert patterns.mismatches(c.decode[0].pool, room, pages[room][1], tokens) == 0
        assert flips.flipped >= 1 and fallbacks(c) == 0
        assert c.decode[0].counters["failed_integrity"] == 1
        assert c.decode[0].counters["integrity_mismatch"] >= 1
        assert c.decode[0].counters["integrity_match"] >= 3 * (2 * num_layers if layers else 2)
        c.assert_no_leaks()
    assert ipc.open_mappings() == 0


@pytest.mark.anyio
@pytest.mark.parametrize("layers", [0, 1], ids=["chunks", "layers"])
async def test_a_flipped_copy_fails_its_room_only(layers: int, monkeypatch: pytest.MonkeyPatch) -> None:
    await a_flipped_copy_fails_its_room_only(layers, monkeypatch)


@pytest.mark.anyio
@pytest.mark.parametrize("off", ["prefill", "decode"])
async def test_integrity_off_on_one_side_counts_unchecked(off: str) -> None:
    """Off on the prefill: its copies carry no sum; off on the decode: it compares none. The kernel path
    either way, every chunk counted unchecked, bytes exact."""
    sides: dict[str, dict[str, Any]] = {off: {"integrity": False}}
    async with integrity_cluster(small_layout(), 1, 1, **sides) as c:  # type: ignore[arg-type]
        await run_room(c, 3, np.arange(5), np.arange(20, 25), [2, 3])
        landed = counted(c, "kernel_notifs")
        assert landed == 2 and kernel_copies(c) == 2 and fallbacks(c) == 0
        assert counted(c, "integrity_unchecked") == landed
        assert counted(c, "integrity_match") == counted(c, "integrity_mismatch") == 0
        c.assert_no_leaks()
    assert ipc.open_mappings() == 0
