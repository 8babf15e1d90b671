"""Kernel-path jobs: a chunk (or layer group) copied by one indexed copy into the decode's pool, which
this process mapped at the handshake (``memory/ipc.py``), then announced to the decode as a WRITE's
notification would be (docs/DECISIONS.md, "One kernel between the GPUs of a host").

Per (decode rank, head slice, layer grouping) the two sides' entry tables are made once
(``protocol.tables``: :func:`~transfer_engine.protocol.tables.decide_table`, then
:func:`~transfer_engine.protocol.tables.side_entries` of this rank's pool and of the mapped one) and
kept on the device (:class:`~transfer_engine.kernels.copy.EntryTable`); each job is one copy
(:func:`~transfer_engine.kernels.copy.copy_outer`) of the two factors of its entries' outer sums
(:func:`~transfer_engine.protocol.tables.write_factors`: one offset per tensor unit, one column per
token group and head group): no entry of the copy is listed on the CPU, so its host call does not
grow with the tensors.

- CUDA: the copy is one Triton launch on this part's side stream, ordered after the job's CUDA ready
  events (``wait_event``: no CPU wait); a blocking event recorded after it is handed to the worker's
  completion waiter, whose callback sends the notification.
- CPU: the copy (the torch reference over the mapped memory) runs on one thread of this part, off
  the loop; a ``threading.Event`` it sets at the end goes to the completion waiter the same way.

A job whose KV is ordered by a ``threading.Event`` not set yet is held until it is (the completion
waiter again). The ``ChunkLanded`` goes over the control channel once the copy completed; the decode
delivers it to the room exactly as it delivers NIXL's notifications. The job is answered (a
``WriteDone``) only after that: so a room's ``AbortAck``, sent once no job of it is out, is sent only
once no copy of it is in flight, and the decode frees the room's pages only after it.

Integrity on (docs/INTEGRITY.md): the copy sums what it copies, in the same pass
(``copy_outer(checksum=..., order=...)``), each word weighed by its position in the chunk's (or
layer group's) gather layout, the order the direct path's seal and the decode's check sum in
(:func:`gather_order`, factors like the copy's own). The ``ChunkLanded`` carries that sum as its
``checksum``, and the decode checks the landed pages against it as it checks a direct WRITE's. The
fence: on CUDA the kernel, the reduction of its partials and the copy of the sum into pinned host
memory are all enqueued on the side stream, and the completion event is recorded on that stream
after them; the callback that reads the sum runs only once the completion waiter saw that event
complete, so the value in pinned memory is final when it is read, and the notification it rides on
leaves only then. On CPU the copy thread writes the sum before it sets the ``threading.Event`` the
callback waits for. No other stream or thread touches the sum.

Falls back to NIXL (the direct part, with the job's path naming neither direct nor a staged path, it
moves the head slice) when this process has no usable mapping of the decode's pool (mapping closed,
or the peer re-said hello), or its tables cannot be made: the reason is logged once per decode
agent.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from transfer_engine.errors import ConfigError, FailureReason, TransferError
from transfer_engine.kernels import KernelInputError
from transfer_engine.kernels.checksum import WORD, checksum_value
from transfer_engine.kernels.copy import EntryTable, WordOrder, copy_outer, entry_table
from transfer_engine.memory.ipc import MappedPool
from transfer_engine.memory.layout import KVPool, stride_rows_of
from transfer_engine.protocol import descriptors, tables
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.paths import TransferPath
from transfer_engine.runtime.completion import Completion, CompletionWaiter, recorded
from transfer_engine.runtime.mail import WriteJob
from transfer_engine.runtime.ports import Outbox
from transfer_engine.runtime.steptrace import StepTrace

from .core import Done, OwnInbox
from .plan import group_rows

log = logging.getLogger(__name__)

Factors = tuple[np.ndarray, np.ndarray, np.ndarray]
"""A copy's entries as ``(offsets, src_cols, dst_cols)``: pair ``(u, j)`` copies entry ``offsets[u] +
src_cols[j]`` onto ``offsets[u] + dst_cols[j]`` (``protocol.tables.write_factors``)."""

MAX_TABLE_ENTRIES = 1 << 27
"""Entries one side's table may hold (8 bytes each on the device: 1 GiB); a finer table falls back."""


@dataclass(frozen=True, eq=False, slots=True)
class _Tables:
    """The two sides' entry tables of one (mapping, spec)."""

    spec: tables.TableSpec
    src: EntryTable
    dst: EntryTable


@dataclass(eq=False, slots=True)
class _Copy:
    """One copy in flight: its job, the mapping it writes into, what says it completed, and (integrity
    on) where its checksum lands: int64 ``[1]``, pinned host memory on CUDA, read once ``done``
    completed."""

    job: WriteJob
    mapping: MappedPool
    done: Completion
    nbytes: int
    checksum: torch.Tensor | None = None
    error: str = ""


class KernelPath:
    """Carries the jobs whose request names the kernel path (:meth:`takes`); see the module docstring.

    Given this rank's pool, the outbox (the notification to the decode), the worker's own inbox (its
    wake-up), its completion waiter, the worker's reply to a job, ``fallback`` (the direct part's
    handling of a job: NIXL), and ``checked`` (whether integrity is on)."""

    def __init__(
        self,
        index: int,
        pool: KVPool,
        outbox: Outbox,
        inbox: OwnInbox,
        completions: CompletionWaiter,
        done: Done,
        fallback: Callable[[WriteJob], Awaitable[None]],
        checked: Callable[[], bool],
        *,
        trace: StepTrace,
        counters: dict[str, int],
    ) -> None:
        self.index = index
        self.pool = pool
        self.outbox = outbox
        self.inbox = inbox
        self.completions = completions
        self.done = done
        self.fallback = fallback
        self.checked = checked
        self.trace = trace
        self.counters = counters
        self._src_bases = np.array([r.addr for r in pool.regions()], dtype=np.uint64)
        self._specs: dict[tuple[str, int, int, int, int | None], tables.TableSpec] = {}
        self._tables: dict[tuple[MappedPool, tables.TableSpec], _Tables] = {}
        self._outcomes: dict[int, tuple[str, str]] = {}
        """id(job) -> what :meth:`try_start` found for a job it could not start (:meth:`execute` acts on it)."""
        self._held: dict[int, WriteJob] = {}
        """id(job) -> a job whose KV is ordered by a ``threading.Event`` not set yet."""
        self._ready: list[WriteJob] = []
        """Held jobs whose awaited event was set: looked at again on the next ``Reached``."""
        self._flying: dict[int, _Copy] = {}
        """id(copy) -> copies started and not completed."""
        self._finished: list[tuple[WriteJob, bool, str]] = []
        """Jobs whose copy completed, to answer on the next ``Reached``."""
        self._told: set[str] = set()
        """Decode agents whose fallback to NIXL was logged."""
        self._used: set[MappedPool] = set()
        self._stream: torch.cuda.Stream | None = None
        self._thread: ThreadPoolExecutor | None = None

    @staticmethod
    def takes(job: WriteJob) -> bool:
        """Whether ``job`` is this part's: a chunk (or layer group) of a room on the kernel path."""
        return job.chunk is not None and job.request.path == TransferPath.KERNEL.value

    @property
    def held_jobs(self) -> int:
        """Jobs held until their KV is written (0 when idle)."""
        return len(self._held)

    @property
    def in_flight(self) -> int:
        """Copies started and not completed (0 when idle)."""
        return len(self._flying)

    # --- a job ---------------------------------------------------------------------------------------

    async def execute(self, job: WriteJob) -> None:
        """Copy ``job``'s KV now (ordered after its CUDA events), hold it until its host events are
        set, or hand it to NIXL when the kernel path cannot carry it."""
        outcome = self._outcomes.pop(id(job), None) or self._begin(job)
        if outcome is None:
            return
        kind, why = outcome
        if kind == "fallback":
            await self._fall_back(job, why)
            return
        log.warning("worker %d: room %d: %s", self.index, job.room, why)
        await self.done(job, False, f"kernel path: {why}", FailureReason.TRANSPORT)

    def try_start(self, job: WriteJob) -> bool:
        """:meth:`execute` in the caller's call, for the worker's inbox taker (a room posting the job
        while the worker waits on its empty inbox): True when the copy started (or the job is held
        until its KV is written); False when the job has to be answered or handed to NIXL, which
        takes an await: the worker's :meth:`execute` does it, from what was found here (nothing is
        tried twice)."""
        outcome = self._begin(job)
        if outcome is None:
            return True
        self._outcomes[id(job)] = outcome
        return False

    def _begin(self, job: WriteJob) -> tuple[str, str] | None:
        """Start ``job``'s copy, or hold it: None. Otherwise ``("fallback", why)`` (NIXL carries it)
        or ``("fail", why)`` (answered failed), with nothing started."""
        mapping = job.peer.mapping
        if not isinstance(mapping, MappedPool) or not mapping.usable:
            return "fallback", "the decode's pool is not mapped in this process"
        waits = [w for w in (*job.waits, job.ready) if w is not None]
        pending = [w for w in waits if isinstance(w, threading.Event) and not w.is_set()]
        if pending:
            self._held[id(job)] = job
            self.completions.notify(pending[0], functools.partial(self._reached, job), owner=job)
            return None
        self.trace.mark(job.room, "ready")
        try:
            pair = self._tables_for(job, mapping)
        except (ConfigError, TransferError) as exc:
            return "fallback", f"no tables: {exc}"
        try:
            factors, order = self._indices(job, pair.spec, summed=self.checked())
            entries = len(factors[0]) * len(factors[1])
            if entries == 0:
                raise TransferError(f"room {job.room}: empty copy")
        except (ConfigError, TransferError) as exc:
            return "fail", str(exc)
        if not mapping.acquire():
            return "fallback", "the mapping closed"
        self._used.add(mapping)
        copy = _Copy(job, mapping, threading.Event(), entries * pair.spec.entry_bytes)
        try:
            self._start(copy, pair, factors, order, waits)
        except (KernelInputError, TransferError, RuntimeError) as exc:
            mapping.release()
            return "fail", f"copy not started: {exc}"
        self._flying[id(copy)] = copy
        self.counters["kernel_copies"] += 1
        self.trace.mark(job.room, "posted")
        self.completions.notify(copy.done, functools.partial(self._copied, copy))
        return None

    def _start(
        self,
        copy: _Copy,
        pair: _Tables,
        factors: Factors,
        order: WordOrder | None,
        waits: Sequence[object],
    ) -> None:
        """Start ``copy``: on the side stream after the job's CUDA events, or on this part's thread.
        With ``order`` (integrity on) the copy also sums what it copies into ``copy.checksum``; on
        CUDA the sum's copy into pinned host memory is enqueued on the side stream before the
        completion event is recorded there (the module docstring's fence)."""
        if self.pool.device.type == "cuda":
            stream = self._side_stream()
            for wait in waits:
                if isinstance(wait, torch.cuda.Event):
                    stream.wait_event(wait)
            if order is not None:
                copy.checksum = torch.empty(1, dtype=torch.int64, pin_memory=True)
            _copy(pair, factors, order, copy.checksum, stream)
            copy.done = recorded(stream)
            return
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"kernel-copy-{self.index}")
        assert isinstance(copy.done, threading.Event)
        if order is not None:
            copy.checksum = torch.zeros(1, dtype=torch.int64)
        self._thread.submit(_copy_on_thread, copy, pair, factors, order)

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.pool.device)
        return self._stream

    async def _fall_back(self, job: WriteJob, why: str) -> None:
        agent = job.peer.agent_name
        if agent not in self._told:
            self._told.add(agent)
            log.info("worker %d: kernel-path jobs to %s go through NIXL: %s", self.index, agent, why)
        self.counters["kernel_fallbacks"] += 1
        await self.fallback(job)

    def _tables_for(self, job: WriteJob, mapping: MappedPool) -> _Tables:
        """The entry tables of ``job``'s (mapping, spec), made once (ConfigError when they cannot be)."""
        peer, head = job.peer, job.request.slices[0]
        group = None if job.group is None else math.gcd(job.group.start, job.group.end)
        key = (peer.agent_name, head.src_head_start, head.dst_head_start, head.num_heads, group)
        spec = self._specs.get(key)
        pool = self.pool
        dst_rows = stride_rows_of(peer.layout, peer.heads_local)
        if spec is None:
            spec = tables.decide_table(
                pool.stride_rows, dst_rows, pool.head_bytes, pool.layout.page_size, peer.layout.page_size,
                head.src_head_start, head.dst_head_start, head.num_heads, pool.heads_local, peer.heads_local,
                mla=pool.layout.mla, group_layers=group,
            )  # fmt: skip
            self._specs[key] = spec
        found = self._tables.get((mapping, spec))
        if found is not None:
            return found
        for stale in [k for k in self._tables if not k[0].usable]:  # a closed mapping's tables
            del self._tables[stale]
        sizes = (spec.table_entries("src", pool.num_pages), spec.table_entries("dst", peer.layout.num_pages))
        if max(sizes) > MAX_TABLE_ENTRIES:
            raise ConfigError(f"{spec.granularity} tables of {max(sizes)} entries exceed {MAX_TABLE_ENTRIES}")
        src, _ = tables.side_entries(
            spec, "src", self._src_bases, pool.region_lengths, pool.stride_rows, pool.num_pages
        )
        dst, _ = tables.side_entries(
            spec, "dst", mapping.bases, mapping.lengths, dst_rows, peer.layout.num_pages
        )
        found = _Tables(spec, entry_table(src, spec.entry_bytes, pool.device),
                        entry_table(dst, spec.entry_bytes, pool.device))  # fmt: skip
        self._tables[(mapping, spec)] = found
        self.counters["kernel_tables"] += 1
        return found

    def _indices(
        self, job: WriteJob, spec: tables.TableSpec, *, summed: bool
    ) -> tuple[Factors, WordOrder | None]:
        """The entries of ``job``'s copy (its chunk's tokens, its group's tensors) as the factors of
        their outer sums (``tables.write_factors``), and with ``summed`` (integrity on) where its
        words sit in the chunk's gather layout."""
        chunk = job.chunk
        assert chunk is not None
        src_ps, dst_ps = self.pool.layout.page_size, job.peer.layout.page_size
        dst_pages = _request_pages(job.request)
        start = chunk.page_start * src_ps
        tokens = descriptors.chunk_tokens(start, chunk.num_pages, src_ps, len(dst_pages) * dst_ps)
        rows = group_rows(job, self.pool)
        factors = tables.write_factors(
            spec, job.src_pages, dst_pages, rows, dst_start_token=start, num_tokens=tokens
        )
        return factors, gather_order(spec, rows, tokens) if summed else None

    # --- completions (on the loop, from the completion waiter) ----------------------------------------

    def _reached(self, job: WriteJob) -> None:
        """A held job's awaited event was set: look at it again on the next ``Reached``."""
        if id(job) in self._held:
            self._ready.append(job)
            self.inbox.wake()

    def _copied(self, copy: _Copy) -> None:
        """``copy`` completed: tell the decode (as NIXL would have), then answer its job."""
        self._flying.pop(id(copy), None)
        copy.mapping.release()
        job, ok, detail = copy.job, not copy.error, copy.error
        if ok:
            self.trace.mark(job.room, "transferred")
            self.counters["kernel_bytes"] += copy.nbytes
            summed = None if copy.checksum is None else checksum_value(copy.checksum)
            ok = self.outbox.send(job.peer.endpoint, _landed(job, summed))
            detail = "" if ok else "the kernel path's notification was dropped"
        self._finished.append((job, ok, detail))
        self.inbox.wake()

    async def on_reached(self) -> None:
        """On the worker's ``Reached``: answer the jobs whose copy completed, start the held jobs whose
        host events were set."""
        finished, self._finished = self._finished, []
        for job, ok, detail in finished:
            await self.done(job, ok, detail, FailureReason.TRANSPORT)
        ready, self._ready = self._ready, []
        for job in ready:
            if self._held.pop(id(job), None) is not None:
                await self.execute(job)

    async def cancel(self, room: int) -> None:
        """Answer ``room``'s held jobs as cancelled. A copy in flight cannot be stopped: its job is
        answered once it completed (so the room's ``AbortAck`` waits for it)."""
        gone = [job for job in self._held.values() if job.room == room]
        for job in gone:
            del self._held[id(job)]
            self.completions.forget(job)
            await self.done(job, False, "cancelled while its KV was not written", FailureReason.ABORTED)
        self._ready = [job for job in self._ready if job.room != room]

    def close(self) -> None:
        """At the worker's end, its completion waiter closed: wait for the copies in flight (they write
        into mapped memory), then close every mapping this part used."""
        if self._stream is not None:
            self._stream.synchronize()
        if self._thread is not None:
            self._thread.shutdown(wait=True)
        for copy in list(self._flying.values()):
            copy.mapping.release()
        self._flying.clear()
        self._held.clear()
        self._tables.clear()
        for mapping in self._used:
            mapping.close_when_idle()
        self._used.clear()


def warm_copy_kernel(pool: KVPool, layers_per_write: int) -> int:
    """Compile the copy kernel a CUDA ``pool``'s kernel-path jobs launch, before any peer is connected
    (``memory.staging.warm_staging_kernels`` says why: Triton compiles on a kernel's first launch, on
    the calling thread, which would be the engine's loop). The compile-time constants follow the
    entry of the pair's tables and its alignment, not the room: the entry is taken as a decode of this
    pool's own layout would give it (equal TP and page size, whole chunks and groups of
    ``layers_per_write`` layers), and one entry is copied between two scratch buffers (nothing of the
    pool is touched). A pair with another entry (hetero TP, another layout) compiles its own at its
    first copy. Returns the launches (0 on CPU)."""
    if pool.device.type != "cuda":
        return 0
    heads = pool.heads_local
    sizes = set()
    for group in (None, layers_per_write):
        try:
            spec = tables.decide_table(
                pool.stride_rows, pool.stride_rows, pool.head_bytes, pool.layout.page_size,
                pool.layout.page_size, 0, 0, heads, heads, heads, mla=pool.layout.mla, group_layers=group,
            )  # fmt: skip
        except ConfigError:
            continue
        sizes.add(spec.entry_bytes)
    one = np.zeros(1, dtype=np.int32)
    for size in sorted(sizes):
        a, b = (torch.empty(size, dtype=torch.uint8, device=pool.device) for _ in range(2))
        src, dst = (entry_table(np.array([t.data_ptr()], dtype=np.uint64), size, pool.device) for t in (a, b))
        copy_outer(src, dst, one, one, one)
    torch.cuda.synchronize(pool.device)
    return len(sizes)


def _copy(
    pair: _Tables,
    factors: Factors,
    order: WordOrder | None,
    checksum: torch.Tensor | None,
    stream: torch.cuda.Stream | None = None,
) -> None:
    """The copy itself, from the factors (U + 2C integers sent for U x C entries), summed as it copies
    with integrity on (``order``: its positions, factors too: U + C more)."""
    copy_outer(pair.src, pair.dst, *factors, stream=stream, checksum=checksum, order=order)


def _copy_on_thread(copy: _Copy, pair: _Tables, factors: Factors, order: WordOrder | None) -> None:
    """This part's copy thread (CPU pools): the copy (and its sum into ``copy.checksum``), then
    ``copy.done`` set, whatever happened."""
    try:
        _copy(pair, factors, order, copy.checksum)
    except Exception as exc:  # the loop answers the job failed; the thread goes on
        copy.error = f"kernel path copy failed: {type(exc).__name__}: {exc}"
    finally:
        assert isinstance(copy.done, threading.Event)
        copy.done.set()


def _request_pages(req: m.TransferRequest) -> np.ndarray:
    """The request's decode pages as int64 (its wire form: int32 bytes, or a list of ints)."""
    pages: object = req.dst_pages
    if isinstance(pages, bytes | bytearray | memoryview):
        return np.frombuffer(pages, dtype="<i4").astype(np.int64)
    return np.asarray(pages, dtype=np.int64)


def gather_order(spec: tables.TableSpec, rows: np.ndarray | None, num_tokens: int) -> WordOrder:
    """Where the words of the copy ``tables.write_indices(spec, ..., rows, num_tokens=num_tokens)``
    makes sit in that chunk's (or layer group's) gather layout ``[T, tokens, num_heads, head_dim]``:
    the order the checksum is defined over (docs/INTEGRITY.md, "What is checked"), ``T`` the tensors
    ``rows`` names in its order (``protocol.layers.group_tensors``: K of each layer, then V) or every
    tensor, ``num_heads`` the spec's head slice.

    In head-sized runs (``W = head_bytes / 4`` words), run ``(t, token, head)`` of the layout starts
    at word ``((t * tokens + token) * num_heads + head) * W``. ``write_indices`` lists a copy's
    entries unit by unit (``units_of``, ascending), then token group by token group (``g`` tokens
    each) in the chunk's order, then head group by head group (``k`` heads each); so entry ``(u, q,
    h)`` starts at run ``(T index of unit u's first tensor, q * g, h * k)``. Inside an entry its runs
    follow ``spec.order`` (innermost first), each dimension a fixed step in the layout: a head ``W``,
    a token ``num_heads * W``, a layer one tensor (``tokens * num_heads * W``), K to V as many
    tensors as the copy has layers. Entry ``(u, j)``'s start is a term per unit plus a term per
    column ``j = (q, h)``, so the order comes as those factors (``WordOrder.first`` per unit,
    ``WordOrder.cols`` per column), as ``write_factors`` gives the copy's own entries.
    Raises ConfigError when a head is not whole 4-byte words (integrity refuses such pools)."""
    if spec.head_bytes % WORD:
        raise ConfigError(f"heads of {spec.head_bytes} bytes are not whole {WORD}-byte words: no checksum")
    run = spec.head_bytes // WORD
    n, g, k = spec.num_heads, spec.tokens_per_entry, spec.heads_per_entry
    tensors = np.arange(spec.num_tensors, dtype=np.int64) if rows is None else np.asarray(rows, np.int64)
    position = np.full(spec.num_tensors, -1, dtype=np.int64)
    position[tensors] = np.arange(tensors.size, dtype=np.int64)
    units = tables.units_of(spec, rows)
    layers, m = spec.num_layers, spec.layers_per_entry
    if spec.mla or spec.kv_fused:  # TableSpec.unit_rows(u)[0], for every unit at once
        first_rows = units * m
    else:
        first_rows = (units // (layers // m)) * layers + (units % (layers // m)) * m
    tensor = n * num_tokens * run
    step = {"head": run, "token": n * run, "layer": tensor}
    step["kv"] = (tensors.size if spec.mla else tensors.size // 2) * tensor
    t0 = position[first_rows]
    token0 = np.arange(num_tokens // g, dtype=np.int64) * g
    head0 = np.arange(spec.head_groups, dtype=np.int64) * k
    # entry (u, q, h) starts at ((t0[u] * tokens + token0[q]) * n + head0[h]) * run: a term per unit
    # plus a term per column (q, h), the factors the copy's own indices come in (write_factors)
    units = t0 * num_tokens * n * run
    cols = ((token0[:, None] * n + head0[None, :]) * run).reshape(-1)
    return WordOrder(units, run, tuple((size, step[name]) for name, size, _ in spec.order), cols=cols)


def _landed(job: WriteJob, checksum: int | None) -> m.ChunkLanded:
    """The notification of ``job``'s copy: the ``ChunkLanded`` its WRITE would have carried (with its
    checksum, integrity on)."""
    chunk = job.chunk
    assert chunk is not None
    return m.ChunkLanded(
        room=job.room,
        chunk_id=chunk.chunk_id,
        last=chunk.last,
        sender=job.sender,
        page_start=chunk.page_start,
        num_pages=chunk.num_pages,
        region=-1,
        layers=None if job.group is None else job.group.layers,
        checksum=checksum,
    )
