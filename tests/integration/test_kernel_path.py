"""The kernel path (issue 40 item 2; docs/DECISIONS.md, "One kernel between the GPUs of a host") on CPU
pools: the handshake's export and mapping, ``auto``'s choice and its reason in the dump, the copy
(bit-exact, whole chunks and layer groups, hetero TP, strided layouts), the notification handled as
NIXL's, aborts, the fallback and its reasons, and nothing left mapped.

In one process the decode's pool in shared memory is "mapped" as it is (``process``); the tests in
``test_kernel_path_processes.py`` run the two sides in two processes, through ``/dev/shm``.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import AsyncIterator

import anyio
import numpy as np
import pytest
import torch

from tests.integration.harness import DEVICE, layers_landed, make_pool, run_room, shuffled_pages, small_layout
from transfer_engine.config import EngineConfig
from transfer_engine.engine import Receiver, Sender, TransferEngine
from transfer_engine.engine.snapshot import build_snapshot
from transfer_engine.errors import TransferFailed
from transfer_engine.memory import ipc
from transfer_engine.memory.layout import KVLayout, KVPool
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.paths import TransferPath, choose_kernel
from transfer_engine.testing import patterns
from transfer_engine.testing.cluster import Cluster, open_cluster

pytestmark = pytest.mark.timeout(120)


def shared(pool: KVPool) -> KVPool:
    """``pool`` with its memory moved to shared memory (torch's ``share_memory_()``, in place)."""
    for t in pool.tensors:
        t.share_memory_()
    return pool


@contextlib.asynccontextmanager
async def kernel_cluster(
    layout: KVLayout,
    P: int,
    D: int,
    *,
    kinds: tuple[str, str] = ("contiguous", "contiguous"),
    share: bool = True,
    decode_layout: KVLayout | None = None,
    **config: object,
) -> AsyncIterator[Cluster]:
    """P prefill and D decode engines in this process; the decodes' pools in shared memory (``share``)."""

    def make(role: str, rank: int, port: int) -> TransferEngine:
        tp = P if role == "prefill" else D
        cfg = EngineConfig(role=role, tp_size=tp, tp_rank=rank, bootstrap_port=port, **config)  # type: ignore[arg-type]
        kind = kinds[0] if role == "prefill" else kinds[1]
        pool = make_pool(kind, (decode_layout or layout) if role == "decode" else layout, tp, rank, 64, 8)
        return TransferEngine(cfg, shared(pool) if share and role == "decode" else pool)

    async with open_cluster(make, P, D) as c:
        yield c


def kernel_copies(c: Cluster) -> int:
    return sum(w.counters["kernel_copies"] for e in c.prefill for w in e.workers)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("P", "D", "kinds", "layers"),
    [
        pytest.param(1, 1, ("contiguous", "contiguous"), 0, id="1x1-contiguous"),
        pytest.param(1, 1, ("flash_nhd", "flash_hnd"), 0, id="1x1-nhd-to-hnd"),
        pytest.param(2, 1, ("contiguous", "contiguous"), 0, id="2x1-hetero-tp"),
        pytest.param(1, 2, ("flash_nhd", "contiguous"), 0, id="1x2-slices"),
        pytest.param(1, 1, ("contiguous", "vllm_cpu"), 1, id="1x1-layerwise"),
        pytest.param(2, 2, ("contiguous", "contiguous"), 2, id="2x2-layerwise"),
    ],
)
async def test_rooms_take_the_kernel_path_bit_exact(
    P: int, D: int, kinds: tuple[str, str], layers: int
) -> None:
    """``auto`` takes the kernel path when every prefill rank mapped the decode's pool; every byte lands,
    only the aux item goes through NIXL, and the dump says why."""
    layout = small_layout()
    rng = random.Random(P * 10 + D)
    async with kernel_cluster(layout, P, D, kinds=kinds, layers_per_write=2) as c:
        posted = sum(e.poller.counters["descriptors_posted"] for e in c.prefill)
        for room in (100, 101):
            src, dst = shuffled_pages(rng, 64, 6), shuffled_pages(rng, 64, 6)
            await run_room(c, room, src, dst, [2, 3, 1], aux_slot=room % 8, layers=layers)
        (ended, *_) = [r for r in build_snapshot(c.decode[0]).ended if r.room == 100]
        assert ended.path == "kernel" and "one host" in ended.path_reason, (ended.path, ended.path_reason)
        assert kernel_copies(c) >= 2 * 3 * D
        # NIXL moved each room's aux item only (one descriptor per room and decode rank it goes to)
        aux = sum(e.poller.counters["descriptors_posted"] for e in c.prefill) - posted
        assert aux <= 2 * D, aux
        notices = sum(e.counters["kernel_notifs"] for e in c.decode)
        assert notices >= 2 * 3
        # every notice went by datagram (one host: docs/DECISIONS.md, "Landing notices between
        # processes of one host go by datagram"), none fell back to ZMQ
        assert sum(e.control.counters["local_notices"] for e in c.prefill) == notices
        assert sum(e.control.counters["local_fallbacks"] for e in c.prefill) == 0
        # only a decode rank binds a name (it receives notices); a prefill rank sends from an unbound socket
        assert all(e.control.local is not None and not e.control.local.bound for e in c.prefill)
        assert all(e.control.local is not None and e.control.local.bound for e in c.decode)
        c.assert_no_leaks()
    assert ipc.open_mappings() == 0


@pytest.mark.anyio
async def test_local_notices_off_sends_them_over_zmq() -> None:
    """``local_notices=False``: the kernel path's notices go over the control ROUTER, and land the same."""
    layout = small_layout()
    rng = random.Random(7)
    async with kernel_cluster(layout, 1, 1, local_notices=False) as c:
        await run_room(c, 200, shuffled_pages(rng, 64, 4), shuffled_pages(rng, 64, 4), [2, 2], aux_slot=1)
        assert c.decode[0].counters["kernel_notifs"] >= 2
        assert c.prefill[0].control.local is None and c.decode[0].control.local is None
        assert not c.prefill[0].control.counters
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_a_chunk_sent_before_the_request_is_copied_in_the_requests_call() -> None:
    """The prefill sent first (its KV ready), then the decode asks: the room offers the job to its
    worker, which waits on an empty inbox, and the copy starts in that call (the inbox's taker,
    ``KernelPath.try_start``), not a loop turn later; every byte lands, nothing is left over."""
    layout = small_layout()
    async with kernel_cluster(layout, 1, 1) as c:
        await run_room(c, 60, np.arange(4), np.arange(4), [4])  # connected and mapped
        worker = c.prefill[0].worker_for(c.decode[0].agent_name)
        taken = worker.counters["kernel_taken"]
        src, dst = np.array([9, 3, 7, 1]), np.array([2, 8, 5, 11])
        patterns.fill(c.prefill[0].pool, 61, src)
        sender = c.prefill[0].sender(61)
        await sender.send(src, last=True)
        receiver = await c.decode[0].receiver(61, c.bootstrap, dst)
        with anyio.fail_after(10):
            await receiver.wait()
            await sender.wait()
        assert worker.counters["kernel_taken"] == taken + 1
        assert patterns.mismatches(c.decode[0].pool, 61, dst, 4 * layout.page_size) == 0
        c.assert_no_leaks()


@pytest.mark.anyio
@pytest.mark.skipif(DEVICE != "cpu", reason="CUDA pools are always exportable")
async def test_private_pool_falls_back_with_the_reason() -> None:
    """A decode pool not in shared memory is not exported: rooms take NIXL's paths, the fallback's
    reason is in the prefill's ack (``unmapped``) and the decode's log, and bytes land as before."""
    layout = small_layout()
    async with kernel_cluster(layout, 1, 1, share=False) as c:
        await run_room(c, 7, np.arange(4), np.arange(10, 14), [4])
        (ended,) = [r for r in build_snapshot(c.decode[0]).ended if r.room == 7]
        assert ended.path == "direct", ended.path
        (peer,) = c.decode[0].peers.values()
        assert peer.mapped == "" and "private host memory" in peer.unmapped, peer.unmapped
        assert kernel_copies(c) == 0
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_switch_off_offers_nothing() -> None:
    """``kernel_path=False`` on the decode: nothing exported, nothing mapped, NIXL as before."""
    layout = small_layout()
    async with kernel_cluster(layout, 1, 1, kernel_path=False) as c:
        await run_room(c, 8, np.arange(4), np.arange(4), [2, 2])
        (ended,) = [r for r in build_snapshot(c.decode[0]).ended if r.room == 8]
        assert ended.path == "direct"
        (peer,) = c.decode[0].peers.values()
        assert peer.mapped == "" and "kernel path off" in peer.unmapped
        assert all(p.mapping is None for p in c.prefill[0].peers.values())
        assert ipc.open_mappings() == 0
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_prefill_switch_off_falls_back() -> None:
    """The decode offers its pool, the prefill (``kernel_path=False``) does not map it: NIXL."""
    layout = small_layout()

    def make(role: str, rank: int, port: int) -> TransferEngine:
        cfg = EngineConfig(role=role, bootstrap_port=port, kernel_path=role == "decode")
        pool = make_pool("contiguous", layout, 1, 0, 64, 8)
        return TransferEngine(cfg, shared(pool) if role == "decode" else pool)

    async with open_cluster(make, 1, 1) as c:
        await run_room(c, 9, np.arange(4), np.arange(4), [4])
        (ended,) = [r for r in build_snapshot(c.decode[0]).ended if r.room == 9]
        assert ended.path == "direct"
        (peer,) = c.decode[0].peers.values()
        assert "kernel path off on prefill rank 0" in peer.unmapped
        c.assert_no_leaks()


async def one_group_landed(
    c: Cluster, room: int, pages: np.ndarray, rest: tuple[int, int], ready: threading.Event
) -> tuple[Sender, Receiver]:
    """P=D=1: ``room`` open on both sides as one layer-wise chunk of ``pages``, its layer 0 reported
    written and landed on the decode, layers ``rest`` reported with ``ready`` (not set here)."""
    patterns.fill(c.prefill[0].pool, room, pages)
    receiver = await c.decode[0].receiver(room, c.bootstrap, pages)
    sender = c.prefill[0].sender(room)
    await sender.begin_chunk(pages, last=True)
    await sender.layers_ready(0, 1)
    await sender.layers_ready(*rest, ready=ready)
    await layers_landed(c, room, 1)
    return sender, receiver


@pytest.mark.anyio
async def test_abort_mid_room_waits_for_no_copy() -> None:
    """A decode aborts a kernel-path room between two layer groups: both sides end ABORTED, the held
    group is answered cancelled, nothing is left held or in flight, and a later room still copies."""
    layout = small_layout()
    async with kernel_cluster(layout, 1, 1, layers_per_write=1) as c:
        never = threading.Event()  # layer 1 is never written: its group stays held
        receiver, sender = await one_group_landed(c, 20, np.arange(4), (1, 2), never)
        worker = c.prefill[0].worker_for(c.decode[0].agent_name)
        with anyio.fail_after(10):
            while worker.kernel.held_jobs < 1:  # noqa: ASYNC110 - the group reaches the worker
                await anyio.sleep(0.002)
        await receiver.abort()
        with anyio.fail_after(10):
            for handle in (receiver, sender):
                with pytest.raises(TransferFailed):
                    await handle.wait()
        assert all(w.kernel.held_jobs == 0 and w.kernel.in_flight == 0 for w in c.prefill[0].workers)
        await run_room(c, 21, np.arange(4, 8), np.arange(8, 12), [4])
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_a_decode_with_only_kernel_path_rooms_polls_nixl_at_the_relaxed_cadence() -> None:
    """Kernel-path rooms hear of their chunks over the control channel: while only such rooms (no aux
    item) are live the decode's poller looks at NIXL every ``poll_relaxed``, not at the quick cadence
    a room on a NIXL path keeps it at (docs/DECISIONS.md, "The decode's poller is quick only for rooms
    that hear over NIXL"). A room waits 0.3 s between two layer groups; the looks in that time are
    counted against what the relaxed cadence allows (quick looks every 50 us would be thousands)."""
    layout = small_layout()
    async with kernel_cluster(layout, 1, 1, layers_per_write=1, poll_relaxed=0.005) as c:
        pages, later = np.arange(4), threading.Event()
        receiver, sender = await one_group_landed(c, 40, pages, (1, 3), later)
        poller = c.decode[0].poller
        assert not c.decode[0].rooms[40].hears_nixl
        polls = poller.counters["polls"]
        await anyio.sleep(0.3)
        looked = poller.counters["polls"] - polls
        later.set()
        with anyio.fail_after(10):
            await receiver.wait()
            await sender.wait()
        assert looked <= 0.3 / 0.005 * 1.5 + 10, looked
        assert patterns.mismatches(c.decode[0].pool, 40, pages, 4 * layout.page_size) == 0
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_a_kernel_path_room_given_its_pages_later_with_an_aux_item_makes_the_poller_look() -> None:
    """A kernel-path room opened without pages, then given them with an aux item: the aux item comes as
    a NIXL WRITE, so the room tells the poller to look quickly (``DrainPort.listen``) as its request
    leaves. The poller is asleep for a relaxed look 20 s away when the pages come: without that call
    the room would wait as long for the aux's notification; it ends within 10 s, KV and aux exact."""
    layout = small_layout()
    async with kernel_cluster(layout, 1, 1, poll_relaxed=20.0) as c:
        await run_room(c, 70, np.arange(4), np.arange(4), [4])  # connected and mapped
        pages = np.array([5, 9, 2])
        patterns.fill(c.prefill[0].pool, 71, pages)
        patterns.fill_aux(c.prefill[0].pool, 71, 3)
        receiver = await c.decode[0].receiver(71, c.bootstrap)
        sender = c.prefill[0].sender(71)
        await sender.send(pages, last=True, aux_slot=3)
        await anyio.sleep(0.1)  # the decode's poller, with only this room and no pages, sleeps its 20 s
        assert not c.decode[0].rooms[71].hears_nixl
        receiver.request(pages, aux_slot=3)
        with anyio.fail_after(10):
            await receiver.wait()
            await sender.wait()
        assert patterns.mismatches(c.decode[0].pool, 71, pages, 3 * layout.page_size) == 0
        assert patterns.aux_ok(c.decode[0].pool, 71, 3)
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_a_kernel_path_room_whose_writer_falls_back_to_nixl_still_lands() -> None:
    """The decode chose the kernel path, then the prefill's mapping closed (the peer re-said hello, or
    it is closing): the writer falls back to NIXL, whose notification the decode's poller still hears
    at its relaxed looks. Every byte lands; the fallback is counted."""
    layout = small_layout()
    async with kernel_cluster(layout, 1, 1, poll_relaxed=0.002) as c:
        await run_room(c, 50, np.arange(4), np.arange(4), [4])  # connected, mapped, the kernel path
        (peer,) = c.prefill[0].peers.values()
        assert isinstance(peer.mapping, ipc.MappedPool)
        peer.mapping.close_when_idle()  # what a re-said hello does to the old mapping
        await run_room(c, 51, np.arange(4, 8), np.arange(8, 12), [2, 2])
        (ended,) = [r for r in build_snapshot(c.decode[0]).ended if r.room == 51]
        assert ended.path == "kernel", ended.path
        assert sum(w.counters["kernel_fallbacks"] for w in c.prefill[0].workers) == 2
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_decode_death_closes_the_mapping() -> None:
    """A decode rank that leaves: the prefill declares it dead, closes its mapping (no copy in flight),
    and nothing stays mapped."""
    layout = small_layout()

    def make(role: str, rank: int, port: int) -> TransferEngine:
        cfg = EngineConfig(role=role, bootstrap_port=port, heartbeat_interval=0.2)
        pool = make_pool("contiguous", layout, 1, 0, 64, 8)
        return TransferEngine(cfg, shared(pool) if role == "decode" else pool)

    async with open_cluster(make, 1, 0) as c:
        prefill = c.prefill[0]
        async with make("decode", 0, int(c.bootstrap.rsplit(":", 1)[1])) as decode:
            await run_room(Cluster(c.prefill, [decode], c.bootstrap), 30, np.arange(4), np.arange(4), [4])
            (peer,) = prefill.peers.values()
            assert isinstance(peer.mapping, ipc.MappedPool) and peer.mapping.how == "process"
            mapping = peer.mapping
        with anyio.fail_after(5):
            while prefill.peers:  # noqa: ASYNC110 - the heartbeat lease runs out
                await anyio.sleep(0.05)
        assert mapping.closed and ipc.open_mappings() == 0


def test_choose_kernel_table() -> None:
    """The pure decision: taken only when enabled and every rank mapped the pool."""
    assert choose_kernel(enabled=False, mapped=[("shm", "")]) == (False, "kernel path off")
    assert choose_kernel(enabled=True, mapped=[]) == (False, "no prefill rank")
    took, why = choose_kernel(enabled=True, mapped=[("cuda_ipc", ""), ("cuda_ipc", "")])
    assert took and why == "one host: every prefill rank mapped this pool (cuda_ipc)"
    took, why = choose_kernel(enabled=True, mapped=[("shm", ""), ("", "another host (h/b)")])
    assert not took and "prefill rank 1" in why and "another host" in why
    assert TransferPath("kernel") is TransferPath.KERNEL and not TransferPath.KERNEL.staged


def test_share_round_trips_without_pickle() -> None:
    """The export travels as msgspec fields: a 64-byte handle, a path, sizes; a longer handle fails decoding."""
    share = m.PoolShare(
        kind="cuda_ipc", host="h/b", pid=1, device=b"u" * 16,
        memories=[m.SharedMemory(handle=b"\x01" * 64, path="", size=1 << 30)],
        regions=[m.SharedRegion(memory=0, offset=4096)],
    )  # fmt: skip
    hello = m.PeerHello(
        rank=0, tp_size=1, endpoint="tcp://x:1", agent_name="a", agent_metadata=b"", mem_type="VRAM",
        regions=[m.MemRegion(1 << 20, 4096, 0)], aux=None, ring=None, ring_mem_type="",
        layout=m.LayoutInfo(num_layers=1, num_heads=1, head_dim=8, dtype="bfloat16", page_size=1, mla=False,
                            num_pages=1), compat=0, share=share,
    )  # fmt: skip
    assert m.decode(m.encode(hello)) == hello
    bad = hello.__class__(**{**{f: getattr(hello, f) for f in hello.__struct_fields__}, "share": m.PoolShare(
        kind="cuda_ipc", host="h", pid=1, device=b"", memories=[m.SharedMemory(handle=b"x" * 65, path="", size=1)],
        regions=[])})  # fmt: skip
    with pytest.raises(Exception, match="65|length"):
        m.decode(m.encode(bad))


def test_mapping_counts_copies_in_flight() -> None:
    """A mapping closes only once no copy is in flight, and refuses new ones from then on."""
    pool = shared(KVPool.allocate(small_layout(), 1, 0, 4))
    share = ipc.export_pool(pool.regions(), torch.device("cpu"))
    assert share.kind == "shm" and len(share.regions) == len(pool.regions())
    mapping = ipc.map_pool(share, pool.regions(), torch.device("cpu"))
    assert mapping.how == "process" and ipc.open_mappings() == 1
    assert mapping.acquire()
    mapping.close_when_idle()
    assert not mapping.closed and not mapping.acquire()
    mapping.release()
    assert mapping.closed and ipc.open_mappings() == 0


def test_another_host_is_refused() -> None:
    pool = shared(KVPool.allocate(small_layout(), 1, 0, 4))
    share = ipc.export_pool(pool.regions(), torch.device("cpu"))
    other = m.PoolShare(kind=share.kind, host="elsewhere/0", pid=share.pid, device=b"", memories=share.memories,
                        regions=share.regions)  # fmt: skip
    with pytest.raises(ipc.ShareError, match="another host"):
        ipc.map_pool(other, pool.regions(), torch.device("cpu"))
    wrong = m.PoolShare(kind=share.kind, host=share.host, pid=share.pid + 1, device=b"",
                        memories=[m.SharedMemory(handle=b"", path=share.memories[0].path, size=share.memories[0].size,
                                                 file_id=(0, 1))] * len(share.memories), regions=share.regions)  # fmt: skip
    with pytest.raises(ipc.ShareError, match="not the file"):
        ipc.map_pool(wrong, pool.regions(), torch.device("cpu"))
    assert ipc.open_mappings() == 0


def test_a_cuda_ipc_handle_keeps_every_byte() -> None:
    """A ``CUipcMemHandle`` is 64 opaque bytes, zeros anywhere: the driver's struct is read and written
    whole (ctypes reads a ``c_char`` array field only up to its first zero byte; the first GPU run
    exported empty handles that way)."""
    raw = bytes([0, 7, 0, 0]) + bytes(range(60))
    handle = ipc._IpcHandle.from_buffer_copy(raw)  # as _Driver.open fills it
    assert bytes(handle) == raw and len(bytes(handle)) == 64  # as _Driver.export reads it
