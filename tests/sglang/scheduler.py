"""A model of SGLang's disaggregated schedulers, driving the adapter as they drive a backend.

One thread per TP rank on each side. Every scheduler step, each rank polls all its live senders
(or receivers) and the group combines the results with MIN (SGLang's ``poll_and_all_reduce``), so
every rank acts on the slowest rank's state:

- prefill: a request waits in the bootstrap queue until the group's poll says WaitingForInput;
  then ``pop_decode_prefix_len()``, ``init(num_pages, aux_index)``, and one ``send()`` per chunk,
  one chunk per step (chunked prefill). It is done when the group's poll says Success or Failed;
  its pages go back to the free list then.
- decode: ``KVReceiver(...)`` and ``init(0)``; when the group's poll says WaitingForInput the rank
  takes pages from its free list (last freed first: freed pages are reused at once) and calls
  ``send_metadata(pages, aux_index, None, decode_prefix_len)``. On Success every byte is checked;
  on Success or Failed the pages go back to the free list at once.

Requests can carry an abort (by the prefill or the decode, at a given step of their life), which the
rank of the side that aborts calls on every rank, as SGLang's abort does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.utils import MetadataBuffers
from sglang.srt.server_args import prepare_server_args

from transfer_engine.config import EngineConfig
from transfer_engine.errors import TransferFailed
from transfer_engine.integrations.sglang import KVManager, KVReceiver, KVSender
from transfer_engine.memory.layout import KVLayout
from transfer_engine.memory.views import view_of
from transfer_engine.testing import patterns

SMALL = KVLayout(num_layers=3, num_heads=4, head_dim=16, dtype=torch.bfloat16, page_size=4)
"""The model every test here uses: 3 layers, 4 KV heads of 16 bf16 elements, pages of 4 tokens."""
STEP_S = 0.0005


@dataclass
class Request:
    room: int
    pages: int
    """Pages the prefill sends (after the decode's prefix)."""
    chunks: list[int]
    aux_index: int
    prefix_pages: int = 0
    abort_by: str = ""
    """"prefill": the prefill aborts after sending ``abort_step`` pages; "decode": the decode aborts
    ``abort_step`` steps after ``send_metadata``."""
    abort_step: int = 0
    decode_aborted: threading.Event = field(default_factory=threading.Event, repr=False, compare=False)
    """Set once every decode rank called ``abort()``. Until then, and until the prefill rank's room
    polls Failed (see ``_heard_abort``), the prefill holds back the last chunk of a room the decode
    aborts, so the abort always lands mid-transfer: otherwise it races the room's completion, and an
    abort after Success is rightly a no-op."""
    _decode_aborts: set[int] = field(default_factory=set, repr=False, compare=False)

    def note_decode_abort(self, rank: int, group_size: int) -> None:
        with _ABORT_LOCK:
            self._decode_aborts.add(rank)
            if len(self._decode_aborts) == group_size:
                self.decode_aborted.set()


_ABORT_LOCK = threading.Lock()


@dataclass
class Memory:
    """A rank's KV and aux buffers as a serving system owns them: raw tensors, handed as pointers.

    The aux buffers are SGLang's own ``MetadataBuffers`` (first output token, cached-token counts,
    logprobs, hidden states, bootstrap room...); :attr:`aux` views each of them as bytes per slot.
    """

    kv: list[torch.Tensor]
    metadata: MetadataBuffers
    aux: list[torch.Tensor]

    @classmethod
    def allocate(cls, layout: KVLayout, tp_size: int, num_pages: int, aux_slots: int) -> Memory:
        heads = layout.heads_local(tp_size)
        kv = [
            torch.zeros(num_pages * layout.page_size, heads, layout.head_dim, dtype=layout.dtype)
            for _ in range(layout.num_kv_tensors)
        ]
        metadata = MetadataBuffers(
            aux_slots, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=0
        )
        ptrs, lens, items = metadata.get_buf_infos()
        aux = [view_of(p, n).view(n // i, i) for p, n, i in zip(ptrs, lens, items, strict=True)]
        return cls(kv, metadata, aux)

    def kv_args(self, layout: KVLayout, tp_size: int, rank: int) -> KVArgs:
        args = KVArgs()
        args.engine_rank = rank
        args.kv_data_ptrs = [t.data_ptr() for t in self.kv]
        args.kv_data_lens = [t.numel() * t.element_size() for t in self.kv]
        page_bytes = layout.page_size * self.kv[0].shape[1] * layout.head_dim * self.kv[0].element_size()
        args.kv_item_lens = [page_bytes] * len(self.kv)
        args.kv_cache_dtype_str = "auto"  # what SGLang passes by default; the backend never reads it
        args.kv_head_num = layout.heads_local(tp_size)
        args.total_kv_head_num = layout.num_heads
        args.page_size = layout.page_size
        args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = self.metadata.get_buf_infos()
        args.gpu_id = 0
        return args


def aux_values(room: int, buffer: int, item_bytes: int) -> torch.Tensor:
    """The bytes a prefill's forward writes into metadata buffer ``buffer``'s slot for ``room``."""
    gen = torch.Generator().manual_seed((room * 31 + buffer) % (1 << 62))
    return torch.randint(0, 256, (item_bytes,), generator=gen, dtype=torch.uint8)


class Group:
    """A TP group's MIN all-reduce of poll results, one call per rank per step."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._barrier = threading.Barrier(size)
        self._lists: list[list[int]] = [[] for _ in range(size)]

    def all_reduce_min(self, rank: int, polls: list[int]) -> list[int]:
        self._lists[rank] = polls
        self._barrier.wait(timeout=60)
        combined = [min(values) for values in zip(*self._lists, strict=True)]
        self._barrier.wait(timeout=60)
        return combined

    def abort(self) -> None:
        self._barrier.abort()


@dataclass
class Stats:
    succeeded: int = 0
    failed: int = 0
    bytes_checked: int = 0
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def error(self, what: str) -> None:
        with self.lock:
            self.errors.append(what)


def manager(
    role: str,
    layout: KVLayout,
    tp_size: int,
    rank: int,
    memory: Memory,
    bootstrap_port: int,
    **config: object,
) -> KVManager:
    server_args = prepare_server_args(
        ["--model-path", "unused", "--device", "cpu", "--tp-size", str(tp_size), "--disaggregation-mode", role,
         "--disaggregation-transfer-backend", "transfer_engine",
         "--disaggregation-bootstrap-port", str(bootstrap_port)]
    )  # SGLang's defaults for everything else  # fmt: skip
    cfg = EngineConfig(
        role=role, tp_size=tp_size, tp_rank=rank, bootstrap_port=bootstrap_port, host_bootstrap=False,
        num_workers=2, **config,
    )  # type: ignore[arg-type]  # fmt: skip
    return KVManager(memory.kv_args(layout, tp_size, rank), role, server_args, False, config=cfg)


def run_prefill_rank(
    mgr: KVManager, memory: Memory, group: Group, rank: int, requests: list[Request], stats: Stats,
    timeout_s: float = 60.0,
) -> None:  # fmt: skip
    """One prefill scheduler thread; see the module docstring."""
    pool = mgr.pool
    free = list(range(pool.num_pages))
    deadline = time.monotonic() + timeout_s
    bootstrap: list[tuple[Request, KVSender, int]] = []
    forward: list[tuple[Request, KVSender, np.ndarray, int]] = []
    inflight: list[tuple[Request, KVSender, np.ndarray]] = []
    for req in requests:
        bootstrap.append((req, KVSender(mgr, "127.0.0.1:0", req.room), 0))
    while bootstrap or forward or inflight:
        if time.monotonic() > deadline:
            stats.error(
                f"prefill rank {rank}: timed out with {len(bootstrap)}/{len(forward)}/{len(inflight)} left"
            )
            group.abort()
            return
        polls = group.all_reduce_min(rank, [int(s.poll()) for _, s, _ in bootstrap])
        still = []
        for (req, sender, age), poll in zip(bootstrap, polls, strict=True):
            if poll == KVPoll.Failed:
                _failed(sender, stats)
            elif poll == KVPoll.WaitingForInput and len(free) < req.pages:
                still.append((req, sender, age + 1))  # no memory yet: every rank decides the same
            elif poll == KVPoll.WaitingForInput:
                prefix = sender.pop_decode_prefix_len()
                if prefix != req.prefix_pages * pool.layout.page_size:
                    stats.error(
                        f"room {req.room}: decode_prefix_len {prefix}, expected {req.prefix_pages} pages"
                    )
                pages = np.array([free.pop() for _ in range(req.pages)], dtype=np.int32)
                patterns.fill(pool, req.room, pages.astype(np.int64))
                for i, buf in enumerate(memory.aux):
                    buf[req.aux_index] = aux_values(req.room, i, buf.shape[1])
                sender.init(req.pages, req.aux_index)
                forward.append((req, sender, pages, 0))
            else:
                still.append((req, sender, age + 1))
        bootstrap = still
        moving = []
        for req, sender, pages, sent in forward:  # one chunk per request per step
            if req.abort_by == "prefill" and sent == req.abort_step:
                sender.abort()
                inflight.append((req, sender, pages))
                continue
            chunk = req.chunks[len([c for c in np.cumsum(req.chunks) if c <= sent])]
            if req.abort_by == "decode" and sent + chunk == req.pages and not _heard_abort(req, sender):
                moving.append((req, sender, pages, sent))  # the last chunk waits for the decode's abort
                continue
            sender.send(pages[sent : sent + chunk])  # a no-op once the room failed, as SGLang expects
            sent += chunk
            if sent == req.pages:
                inflight.append((req, sender, pages))
            else:
                moving.append((req, sender, pages, sent))
        forward = moving
        polls = group.all_reduce_min(rank, [int(s.poll()) for _, s, _ in inflight])
        left = []
        for (req, sender, pages), poll in zip(inflight, polls, strict=True):
            if poll == KVPoll.Success:
                free.extend(pages.tolist())
                with stats.lock:
                    stats.succeeded += 1
            elif poll == KVPoll.Failed:
                _failed(sender, stats)
                free.extend(pages.tolist())
            else:
                left.append((req, sender, pages))
        inflight = left
        time.sleep(STEP_S)


def _heard_abort(req: Request, sender: KVSender) -> bool:
    """Whether this prefill rank has heard the decode's abort of ``req`` (its room polls Failed).

    Every decode rank's ``abort()`` returning is not enough: their Abort is still on its way, and a
    last chunk sent before it lands completes the room, rightly Success on the prefill."""
    return req.decode_aborted.is_set() and sender.poll() == KVPoll.Failed


def _failed(handle: KVSender | KVReceiver, stats: Stats) -> None:
    try:
        handle.failure_exception()
    except TransferFailed:
        with stats.lock:
            stats.failed += 1
        return
    stats.error(f"room {handle.bootstrap_room}: failure_exception() did not raise TransferFailed on Failed")


def run_decode_rank(
    mgr: KVManager, memory: Memory, group: Group, rank: int, bootstrap_addr: str, requests: list[Request],
    stats: Stats, prefill_page_size: int, timeout_s: float = 60.0,
    on_step: Callable[[int], None] | None = None,
) -> None:  # fmt: skip
    """One decode scheduler thread; see the module docstring."""
    pool = mgr.pool
    free = list(range(pool.num_pages))
    deadline = time.monotonic() + timeout_s
    queue: list[tuple[Request, KVReceiver, int]] = []
    transfer: list[tuple[Request, KVReceiver, np.ndarray, int]] = []
    for req in requests:
        receiver = KVReceiver(mgr, bootstrap_addr, req.room)
        receiver.init(0)
        queue.append((req, receiver, 0))
    step = 0
    while queue or transfer:
        if on_step is not None:
            on_step(step)
        step += 1
        if time.monotonic() > deadline:
            stats.error(f"decode rank {rank}: timed out with {len(queue)}/{len(transfer)} left")
            group.abort()
            return
        polls = group.all_reduce_min(rank, [int(r.poll()) for _, r, _ in queue])
        still = []
        for (req, receiver, age), poll in zip(queue, polls, strict=True):
            if poll == KVPoll.Failed:
                _failed(receiver, stats)
            elif poll == KVPoll.WaitingForInput and len(free) < -(
                -req.pages * prefill_page_size // pool.layout.page_size
            ):
                still.append((req, receiver, age + 1))  # no memory yet: every rank decides the same
            elif poll == KVPoll.WaitingForInput:
                tokens = req.pages * prefill_page_size
                n = -(-tokens // pool.layout.page_size)
                pages = np.array([free.pop() for _ in range(n)], dtype=np.int64)
                prefix = req.prefix_pages * prefill_page_size  # tokens
                receiver.send_metadata(pages.astype(np.int32), req.aux_index, None, prefix)
                transfer.append((req, receiver, pages, 0))
            else:
                still.append((req, receiver, age + 1))
        queue = still
        polls = group.all_reduce_min(rank, [int(r.poll()) for _, r, _, _ in transfer])
        left = []
        for (req, receiver, pages, age), poll in zip(transfer, polls, strict=True):
            if poll == KVPoll.Success:
                tokens = req.pages * prefill_page_size
                bad = patterns.mismatches(pool, req.room, pages, tokens)
                aux_ok = all(
                    torch.equal(buf[req.aux_index], aux_values(req.room, i, buf.shape[1]))
                    for i, buf in enumerate(memory.aux)
                )
                if bad or not aux_ok:
                    stats.error(f"decode rank {rank} room {req.room}: {bad} elements differ, aux ok {aux_ok}")
                with stats.lock:
                    stats.succeeded += 1
                    stats.bytes_checked += tokens * pool.slot_bytes * pool.layout.num_kv_tensors
                free.extend(pages.tolist())
            elif poll == KVPoll.Failed:
                _failed(receiver, stats)
                free.extend(pages.tolist())  # SGLang frees at once; the next request reuses them
            else:
                if req.abort_by == "decode" and age == req.abort_step:
                    receiver.abort()
                    req.note_decode_abort(rank, group.size)
                left.append((req, receiver, pages, age + 1))
        transfer = left
        time.sleep(STEP_S)
