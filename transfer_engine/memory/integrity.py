"""Checksums of the KV a chunk covers, over a rank's own pool (docs/INTEGRITY.md).

Both sides call :class:`PoolChecksums` over their own pages: the prefill with its token slots and
source head slice before a chunk's (or layer group's) WRITE starts, through the notification
its :class:`Seal` makes; the decode with its slots and destination head slice once the bytes are
in its pages (landed, or scattered out of the ring). Equal bytes give equal sums whatever the two
page layouts, paths or TP sizes (``protocol/integrity.py``).

No thread waits for a sum that is not done. :meth:`PoolChecksums.enqueue` starts one and returns
a :class:`Sum`: on CUDA its kernel is enqueued on a stream (this object's own, or the caller's:
the decode's scatter sums its pages behind the copy on the scatter stream) after the events the
bytes wait for, into pinned host memory, and ``Sum.done`` is the stream's event after it; on CPU
it runs on this object's one checksum thread (numpy), which first waits for the
``threading.Event`` s the bytes wait for, and ``Sum.done`` is set when it is known. Whoever needs
the value waits for ``done`` through the completion machinery (the prefill's worker holds the
WRITE until then; the decode's room hears :meth:`PoolChecksums.submit`'s callback, from this
object's thread) and then reads it without a synchronisation. A staged chunk's seal is not
started here: the gather kernel sums what it copies (``gather_heads(checksum=...)``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Sequence

import msgspec
import numpy as np
import torch

from transfer_engine.errors import ConfigError
from transfer_engine.events import Completion, reached, recorded
from transfer_engine.kernels import KVTable, as_kv_table, gather_heads
from transfer_engine.kernels.checksum import WORD, checksum_heads, checksum_value
from transfer_engine.memory.layout import KVPool
from transfer_engine.memory.staging import head_counts
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.layers import group_tensors

__all__ = ["Completion", "PoolChecksums", "Seal", "Sum"]

WAIT_CHECK_S = 0.05
"""How often the checksum thread, waiting for the bytes' ``threading.Event`` s, looks whether its
pool's checksums were closed (a room cancelled before its KV was written never sets them)."""


class Sum:
    """A checksum that was started and may not be known yet: read :meth:`value` once ``done`` has
    completed (it waits for it otherwise)."""

    __slots__ = ("done", "_read", "cancelled")

    def __init__(self, done: Completion, read: Callable[[], int]) -> None:
        self.done = done
        self._read = read
        self.cancelled = threading.Event()
        """Set by :meth:`cancel`: a CPU sum still waiting for its bytes gives up (its reader gets
        the error)."""

    def cancel(self) -> None:
        """Nobody will read this sum (its WRITE was dropped): a CPU sum that still waits for its KV
        stops waiting, so the checksum thread moves on to the next one. A sum being taken or known
        is unaffected; a CUDA sum always completes on its stream."""
        self.cancelled.set()

    @classmethod
    def known(cls, value: int) -> Sum:
        """A sum already taken (on the thread that took it)."""
        done = threading.Event()
        done.set()
        return cls(done, lambda: value)

    def value(self) -> int:
        """The checksum (raises what taking it raised). Waits for ``done`` if it has not completed:
        the callers wait for it first, so that no thread of theirs blocks here."""
        if not reached(self.done):
            if isinstance(self.done, threading.Event):
                self.done.wait()
            else:
                self.done.synchronize()
        return self._read()


class _Failed:
    """What a CPU sum raised, kept to be raised by its reader."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class PoolChecksums:
    """Checksums over one pool's KV: every tensor, or a layer group's, of some slots and a head slice.

    Thread-safe: the prefill calls it from the loop, a worker's gather thread or its completion
    waiter's thread. :meth:`close` ends its checksum thread (the engine's end)."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self._all = as_kv_table(pool.kv_views)
        if self._all.byte_gcd % WORD:
            raise ConfigError(
                f"integrity sums whole {WORD}-byte words, and this KV's rows, strides or addresses are "
                f"{self._all.byte_gcd}-byte aligned (head_dim={self._all.head_dim}, {self._all.dtype}); "
                "set integrity=False (TE_INTEGRITY=0) for it"
            )
        self._groups: dict[tuple[int, int], KVTable] = {}
        self._lock = threading.Lock()
        self.stream = torch.cuda.Stream(pool.device) if pool.device.type == "cuda" else None
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = threading.Event()
        self.pending = 0
        """Sums :meth:`submit` started whose callback has not run yet (the loop's count)."""
        self.warmed = self._warm()
        """Kernel launches made to compile the integrity kernels at start (0 on CPU)."""

    def _warm(self) -> int:
        """Compile the kernels integrity launches on a CUDA pool now, before any peer is connected:
        Triton compiles on a kernel's first launch, on the calling thread, which would be the
        engine's loop (``memory.staging.warm_staging_kernels`` says why that matters). The gather
        that sums as it copies (staged prefill) and the sum over the pages (direct prefill, every
        decode), for each head-slice width; one token of slot 0, nothing is written to the pool."""
        if self.stream is None:
            return 0
        kv, slot = self._all, torch.zeros(1, dtype=torch.int64)
        summed = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        launches = 0
        for n in head_counts(kv.heads):
            out = torch.empty(
                len(kv) * n * kv.head_dim * kv.itemsize, dtype=torch.uint8, device=self.pool.device
            )
            gather_heads(kv, slot, 0, n, out, checksum=summed)
            checksum_heads(kv, slot, 0, n, stream=self.stream, out=summed)
            launches += 2
        torch.cuda.synchronize(self.pool.device)
        return launches

    def _table(self, layers: tuple[int, int] | None) -> KVTable:
        if layers is None:
            return self._all
        with self._lock:
            table = self._groups.get(layers)
            if table is None:
                layout = self.pool.layout
                rows = group_tensors(layout.num_layers, layout.mla, *layers).tolist()
                table = self._groups[layers] = as_kv_table([self.pool.kv_views[i] for i in rows])
            return table

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The one checksum thread (made on first use): CPU sums, and the decode's waits for CUDA ones."""
        with self._lock:
            if self._closed.is_set():
                raise RuntimeError("the pool's checksums were closed (the engine ended)")
            if self._thread is None:
                self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="te-checksum")
            return self._thread

    def close(self) -> None:
        """End the checksum thread; sums not started are dropped (nobody waits for them any more)."""
        self._closed.set()
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.shutdown(wait=False, cancel_futures=True)

    def chunk(
        self, slots: np.ndarray, head_start: int, num_heads: int, layers: tuple[int, int] | None
    ) -> int:
        """The checksum of heads ``[head_start, head_start + num_heads)`` of ``slots`` (this pool's token
        slots, in the chunk's order) over every tensor, or layers ``[start, end)``'s: the gather
        layout ``kernels.checksum`` defines. Blocks the calling thread until it is known: for a
        thread that has the time (a CPU gather's), and tests."""
        index = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64))
        result = checksum_heads(self._table(layers), index, head_start, num_heads, stream=self.stream)
        if self.stream is None:
            return checksum_value(result)
        with torch.cuda.stream(self.stream):  # the read waits for this stream only, not the default one
            return checksum_value(result)

    def enqueue(
        self,
        slots: np.ndarray,
        head_start: int,
        num_heads: int,
        layers: tuple[int, int] | None,
        *,
        after: Sequence[Completion] = (),
        stream: torch.cuda.Stream | None = None,
    ) -> Sum:
        """Start the checksum :meth:`chunk` takes, once every completion of ``after`` has (the bytes
        are final then), without waiting for it.

        CUDA: enqueued on ``stream`` (default: this object's own), which first waits for the CUDA
        events of ``after``; the whole sum runs there (the slots' upload, the kernel, the copy of the
        value into pinned host memory: the caller's current stream orders none of it), and ``done``
        is the stream's event after it, the fence before which the value is never read
        (docs/INTEGRITY.md, "Which fence, and why it suffices"). A ``threading.Event`` in ``after`` must be set already on CUDA (the stream cannot
        wait for it): ValueError otherwise. CPU: taken on the checksum thread, which first waits for
        ``after``; ``done`` is set when it is known (or failed: :meth:`Sum.value` raises it)."""
        if self.pool.device.type == "cuda":
            on = stream or self.stream
            assert on is not None
            for wait in after:
                if isinstance(wait, threading.Event):
                    if not wait.is_set():
                        raise ValueError("a CUDA checksum cannot wait for a threading.Event that is not set")
                else:
                    on.wait_event(wait)
            index = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64))
            out = torch.empty(1, dtype=torch.int64, pin_memory=True)
            checksum_heads(self._table(layers), index, head_start, num_heads, stream=on, out=out)
            done = recorded(on)
            return Sum(done, lambda: checksum_value(out))
        finished = threading.Event()
        box: list[int | _Failed] = []
        cancelled = threading.Event()

        def take() -> None:
            try:
                for wait in after:
                    assert isinstance(wait, threading.Event), "a CPU pool's KV is ordered by threading.Events"
                    while not wait.wait(WAIT_CHECK_S):
                        if self._closed.is_set():
                            raise RuntimeError("the pool's checksums were closed before the KV was written")
                        if cancelled.is_set():
                            raise RuntimeError("the sum was cancelled before its KV was written")
                box.append(self.chunk(slots, head_start, num_heads, layers))
            except BaseException as exc:
                box.append(_Failed(exc))
            finally:
                finished.set()

        def read() -> int:
            (result,) = box
            if isinstance(result, _Failed):
                raise result.exc
            return result

        started = Sum(finished, read)
        started.cancelled = cancelled
        self._executor().submit(take)
        return started

    def submit(
        self,
        slots: np.ndarray,
        head_start: int,
        num_heads: int,
        layers: tuple[int, int] | None,
        then: Callable[[int | None, str], object],
    ) -> None:
        """From the loop: start the checksum :meth:`chunk` takes over bytes that are in the pages now
        (they landed, or their scatter completed), and call ``then(value, "")`` on the loop once it is
        known, or ``then(None, why)`` if taking it failed. Nothing on the loop waits for it: the sum
        runs on this object's stream (CUDA) or its thread (CPU), and the thread waits for the
        stream's event and wakes the loop."""
        loop = asyncio.get_running_loop()
        self.pending += 1

        def answer(value: int | None, why: str) -> None:
            self.pending -= 1
            then(value, why)

        def wake(value: int | None, why: str) -> None:
            try:
                loop.call_soon_threadsafe(answer, value, why)
            except RuntimeError:  # the loop closed: nobody waits any more
                pass

        try:
            started = self.enqueue(slots, head_start, num_heads, layers)

            def finish() -> None:
                try:
                    value = started.value()
                except Exception as exc:
                    wake(None, f"{type(exc).__name__}: {exc}")
                    return
                wake(value, "")

            self._executor().submit(finish)
        except Exception as exc:
            loop.call_soon(answer, None, f"{type(exc).__name__}: {exc}")


class Seal:
    """The notification a chunk's WRITE starts with: its ``ChunkLanded`` carrying the checksum of the
    bytes it moves (``WriteSpec.seal``). The worker starts the sum (:attr:`sum`) once the bytes are
    final and starts the WRITE only once it is known, so calling the seal reads a known value.
    With no sum started it takes one then, on the calling thread."""

    def __init__(self, notif: bytes, take: Callable[[], int], start: Callable[..., Sum]) -> None:
        landed = m.decode_notification(notif)
        if not isinstance(landed, m.ChunkLanded):
            raise TypeError(f"only a chunk's notification carries a checksum, not {type(landed).__name__}")
        self._landed = landed
        self._take = take
        self._start = start
        self.sum: Sum | None = None

    def start(self, *, after: Sequence[Completion] = (), stream: torch.cuda.Stream | None = None) -> Sum:
        """Start the sum (:meth:`PoolChecksums.enqueue`); once only."""
        assert self.sum is None, "a seal's sum is started once"
        self.sum = self._start(after=after, stream=stream)
        return self.sum

    def taken(self, taken: Sum) -> None:
        """The sum was taken elsewhere (by the staged gather, as it copied the bytes); once only."""
        assert self.sum is None, "a seal's sum is started once"
        self.sum = taken

    def cancel(self) -> None:
        """The WRITE was dropped (its room was cancelled): its sum, if started, need not be taken."""
        if self.sum is not None:
            self.sum.cancel()

    @property
    def ready(self) -> bool:
        """Whether reading the seal now waits for nothing: its sum is known (or was never started)."""
        return self.sum is None or reached(self.sum.done)

    def __call__(self) -> bytes:
        value = self._take() if self.sum is None else self.sum.value()
        return m.encode(msgspec.structs.replace(self._landed, checksum=value))
