"""Shared pieces of the examples: the synthetic model, the room schedule, allocators, rank processes.

How the prefill and decode sides agree on rooms without talking about them
---------------------------------------------------------------------------
A serving system's router hands each request to one prefill and one decode instance; the decode
side picks the room id and knows the request's length. Here both sides run the same deterministic
schedule, derived from ``--seed`` and ``--rooms``: the i-th room's id and token count come from the
schedule's random stream, and everything else is a function of ``(seed, room)``: the number of pages
(``ceil(tokens / page_size)``) and the chunk split (several ``send()``s, as chunked prefill does).
Page lists are never shared: each rank takes its pages from its own allocator, and the decode rank
tells the prefill where to write in its TransferRequest, exactly as in a real deployment.

Both sides walk the schedule in order with at most ``--inflight`` rooms open. Pages (and the aux
slot) of a room go back to the allocator only after the room's ``wait()`` returned, when no WRITE of
it can still land. Every side starts room ``i`` only after starting all rooms before it, so the
smallest unfinished room is always open (or about to be) on every rank: the schedule cannot
deadlock as long as one room fits in a pool.

This module imports no torch, NIXL or engine code at import time: the launcher processes stay
light, and only rank processes pay for those imports.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import hashlib
import logging
import math
import multiprocessing as mp
import os
import queue
import random
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import numpy as np

    from transfer_engine.memory.layout import KVLayout

GiB = 1 << 30
T = TypeVar("T")
EventSink = Any  # a multiprocessing Queue of (kind, rank, payload) tuples

# --- arguments shared by prefill.py, decode.py and pd_demo.py ---------------------------------------


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The model shape and room schedule; prefill and decode must be given the same values."""
    g = parser.add_argument_group("synthetic model (default: Qwen3-8B's KV cache shape)")
    g.add_argument("--layers", type=int, default=36, help="transformer layers (default 36)")
    g.add_argument("--kv-heads", type=int, default=8, help="total KV heads, unsharded (default 8)")
    g.add_argument("--head-dim", type=int, default=128, help="elements per head (default 128)")
    g.add_argument("--dtype", default="bfloat16", help="KV dtype (default bfloat16)")
    g.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    g = parser.add_argument_group("room schedule (must match on both sides)")
    g.add_argument("--rooms", type=int, default=200, help="rooms (requests) in the schedule (default 200)")
    g.add_argument("--seed", type=int, default=0, help="seed of the schedule (default 0)")
    g.add_argument("--min-tokens", type=int, default=32, help="shortest request, tokens (default 32)")
    g.add_argument("--max-tokens", type=int, default=320, help="longest request, tokens (default 320)")
    g.add_argument("--max-chunks", type=int, default=4, help="most send()s per room (default 4)")
    g = parser.add_argument_group("resources of each rank")
    g.add_argument("--inflight", type=int, default=16, help="rooms open at once per rank (default 16)")
    g.add_argument(
        "--pool-pages",
        type=int,
        default=0,
        help="KV pool pages per rank; 0 sizes it to --inflight longest rooms, capped at 1 GiB (default 0)",
    )
    g.add_argument("--aux-bytes", type=int, default=16, help="bytes of each room's aux item (default 16)")
    g.add_argument(
        "--work-nice",
        type=int,
        default=10,
        help="nice value of the threads that stand in for GPU work (the prefill's fill, the decode's "
        "verification) on --device cpu: on a GPU server they would not compete with the engine for "
        "the CPU (default 10; 0 runs them at the engine's priority)",
    )
    g.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="pool memory; cuda: cuda:<rank>")
    g.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="torch CPU threads per rank process; the KV patterns are computed on the CPU even for "
        "cuda pools (default 0: the CPUs shared among this machine's ranks, at least 1)",
    )
    g.add_argument(
        "--nixl-progress-thread",
        action="store_true",
        default=None,
        help="keep NIXL's own progress thread (off by default here: it busy-polls a third of a core per "
        "agent, and the engine polls NIXL itself)",
    )
    g.add_argument("--log-level", default="WARNING", help="engine log level (default WARNING)")


def workload_argv(args: argparse.Namespace) -> list[str]:
    """The flags of :func:`add_workload_arguments` as a command line, to start the other scripts."""
    names = (
        "layers kv_heads head_dim dtype page_size rooms seed min_tokens max_tokens max_chunks inflight "
        "pool_pages aux_bytes work_nice device torch_threads log_level"
    ).split()
    argv: list[str] = []
    for name in names:
        argv += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    if args.nixl_progress_thread:
        argv.append("--nixl-progress-thread")
    return argv


def check_workload(args: argparse.Namespace) -> str | None:
    """What is wrong with the workload flags, or None."""
    for name in ("layers", "kv_heads", "head_dim", "page_size", "min_tokens", "max_chunks", "inflight"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1"
    if args.rooms < 0:
        return f"--rooms={args.rooms} must be >= 0"
    if args.max_tokens < args.min_tokens:
        return f"--max-tokens={args.max_tokens} is below --min-tokens={args.min_tokens}"
    if args.aux_bytes < 0 or args.pool_pages < 0:
        return "--aux-bytes and --pool-pages must be >= 0"
    if not 0 <= args.work_nice <= 19:
        return f"--work-nice={args.work_nice} must be in 0..19"
    if 0 < args.pool_pages < pages_for(args.max_tokens, args.page_size):
        return (
            f"--pool-pages={args.pool_pages} cannot hold the longest room "
            f"({pages_for(args.max_tokens, args.page_size)} pages of {args.page_size} tokens)"
        )
    return None


# --- the schedule ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RoomPlan:
    """One request: its room id, length, pages and chunk split (page counts, in send order)."""

    index: int
    room: int
    tokens: int
    num_pages: int
    chunks: tuple[int, ...]


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def chunk_split(seed: int, room: int, num_pages: int, max_chunks: int) -> tuple[int, ...]:
    """How the prefill sends a room: 2..max_chunks chunks (fewer for short rooms), from (seed, room)."""
    rng = random.Random(f"chunks:{seed}:{room}")
    most = max(1, min(max_chunks, num_pages))
    k = rng.randint(min(2, most), most)
    cuts = sorted(rng.sample(range(1, num_pages), k - 1))
    bounds = [0, *cuts, num_pages]
    return tuple(b - a for a, b in zip(bounds, bounds[1:], strict=False))


ROOM_ID_BITS = 63
"""Room ids are random over the whole range the engine accepts, ``[0, 2**63)``."""


def staging_defaults(args: argparse.Namespace) -> dict[str, int]:
    """Staging sized to this schedule: a chunk is at most one whole room (unless set by flag or TE_*)."""
    if args.staging_chunk_pages is not None or "TE_STAGING_CHUNK_PAGES" in os.environ:
        return {}
    return {"staging_chunk_pages": pages_for(args.max_tokens, args.page_size)}


def make_schedule(args: argparse.Namespace) -> list[RoomPlan]:
    """The rooms both sides serve, in order. Room ids are random integers, unique per schedule."""
    rng = random.Random(f"schedule:{args.seed}")
    seen: set[int] = set()
    plans = []
    for index in range(args.rooms):
        room = rng.getrandbits(ROOM_ID_BITS)
        while room in seen:
            room = rng.getrandbits(ROOM_ID_BITS)
        seen.add(room)
        tokens = rng.randint(args.min_tokens, args.max_tokens)
        n = pages_for(tokens, args.page_size)
        plans.append(RoomPlan(index, room, tokens, n, chunk_split(args.seed, room, n, args.max_chunks)))
    return plans


def fingerprint(plans: list[RoomPlan], layout_text: str) -> str:
    """A short hash of the schedule and layout: both sides print it, so a mismatch is easy to spot."""
    h = hashlib.sha256(layout_text.encode())
    for p in plans:
        h.update(f"{p.room},{p.tokens},{p.chunks};".encode())
    return h.hexdigest()[:12]


def layout_text(args: argparse.Namespace) -> str:
    return (
        f"L={args.layers} H={args.kv_heads} head_dim={args.head_dim} {args.dtype} page_size={args.page_size}"
    )


def make_layout(args: argparse.Namespace) -> KVLayout:
    from transfer_engine.memory.layout import KVLayout, dtype_of

    return KVLayout(args.layers, args.kv_heads, args.head_dim, dtype_of(args.dtype), args.page_size)


def pool_pages(args: argparse.Namespace, page_bytes_all_tensors: int) -> int:
    """Pages of one rank's pool: what the user asked, or --inflight longest rooms capped at 1 GiB."""
    if args.pool_pages:
        return int(args.pool_pages)
    longest = pages_for(args.max_tokens, args.page_size)
    capped = GiB // max(page_bytes_all_tensors, 1)
    return max(longest, min(longest * args.inflight, capped))


def device_for(kind: str, rank: int) -> str:
    if kind == "cpu":
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    index = rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return f"cuda:{index}"


# --- allocators -----------------------------------------------------------------------------------


class PageAllocator:
    """One rank's KV pages. ``alloc`` waits until enough pages are free; pages come back in any order.

    The free list starts shuffled (from the seed and rank), so rooms get scattered pages, as in a
    serving system's pool after a while. Only one task allocates (the schedule loop), in order.
    """

    def __init__(self, num_pages: int, seed: str) -> None:
        import anyio

        pages = list(range(num_pages))
        random.Random(seed).shuffle(pages)
        self.num_pages = num_pages
        self._free: deque[int] = deque(pages)
        self._changed = anyio.Event()

    @property
    def free_pages(self) -> int:
        return len(self._free)

    async def alloc(self, n: int) -> np.ndarray:
        import anyio
        import numpy as np

        if n > self.num_pages:
            raise ValueError(f"a room of {n} pages cannot fit in a pool of {self.num_pages} pages")
        while len(self._free) < n:
            self._changed = anyio.Event()
            await self._changed.wait()
        return np.array([self._free.popleft() for _ in range(n)], dtype=np.int64)

    def free(self, pages: np.ndarray) -> None:
        self._free.extend(int(p) for p in pages)
        self._changed.set()


# --- statistics -----------------------------------------------------------------------------------


class ExampleTrace:
    """The example's own step marks beside the engine's (``TE_TRACE_OUT``: a folder to write them to).

    With ``TE_TRACE_OUT`` set (and ``TE_TRACE_STEPS`` > 0 for the engine's marks) each rank writes
    ``<folder>/<side>-<rank>.json`` at its end: ``[[monotonic_ns, room, step], ...]``, the engine's
    marks (``engine.me.trace``) merged with the example's (``x.filled``, ``x.opened``...), for
    ``tools/demo_trace.py``. Without it, :meth:`mark` does nothing.
    """

    def __init__(self, side: str, rank: int) -> None:
        from transfer_engine.runtime.steptrace import StepTrace

        self.folder = os.environ.get("TE_TRACE_OUT") or None
        self.side, self.rank = side, rank
        # the engine's own bounded buffer, side "x": marks read "x.<step>"
        self._trace = StepTrace(1 << 20 if self.folder is not None else 0, "x")

    def mark(self, room: int, step: str) -> None:
        self._trace.mark(room, step)

    def dump(self, engine_marks: list[tuple[int, int, str]]) -> None:
        if self.folder is None:
            return
        import json

        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, f"{self.side}-{self.rank}.json")
        with open(path, "w") as f:
            json.dump(sorted(self._trace.take() + engine_marks), f)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[k]


def human_bytes(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def say(text: str, file: IO[str] | None = None) -> None:
    """Print one line with ONE write, so lines of rank processes sharing a pipe never interleave."""
    stream = file or sys.stdout
    stream.write(text + "\n")
    stream.flush()


# --- rank processes -------------------------------------------------------------------------------


def _watch_parent(parent: int) -> None:
    """In a rank process: shut down (SIGTERM, then hard exit) if the launcher died, so no orphan lives on."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(15)
            os._exit(3)


def stand_in_executor(args: argparse.Namespace) -> concurrent.futures.ThreadPoolExecutor:
    """One thread for the examples' stand-ins for GPU work (the prefill's fill, the decode's
    verification), at nice ``--work-nice`` on CPU pools.

    On a small CPU machine that work would otherwise take the cores from the engine's gather,
    scatter and event loops, and the room latency would measure that contention (docs/PERF.md,
    "make demo's tail"); on a GPU server it does not compete for the CPU at all. A thread of its
    own, because a thread's nice value cannot be lowered back without privileges: the engine's
    threads never run on it."""
    nice = args.work_nice if args.device == "cpu" else 0
    return concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="stand-in", initializer=_lower_priority, initargs=(nice,)
    )


def _lower_priority(nice: int) -> None:
    if nice > 0:
        with contextlib.suppress(OSError, AttributeError):  # not Linux: run at the default priority
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


async def on_stand_in(executor: concurrent.futures.Executor, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on ``executor``'s thread, awaited from the event loop."""
    import asyncio

    return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)


def torch_threads(asked: int, ranks_on_host: int) -> int:
    """``asked``, or (0) the CPUs this process may run on divided among the rank processes, at least 1."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return asked if asked > 0 else max(1, cpus // max(ranks_on_host, 1))


def disable_nixl_progress_thread() -> None:
    """Create NIXL agents without NIXL's own progress thread (workaround, see below).

    ``NixlTransport`` builds its agent with ``nixl_agent_config``'s default ``enable_prog_thread=True``.
    That thread busy-polls: about a third of a CPU core per agent even when idle, which on a small
    machine takes a large share of the cores from the transfers themselves. The engine's NixlPoller
    already drives progress (it polls every posted WRITE and drains notifications), so the thread is
    not needed. An explicit ``enable_prog_thread=...`` given by the engine is left as it is, so once
    the engine passes its own setting (an ``EngineConfig.nixl_progress_thread`` is on its way) this
    shim does nothing and can be deleted.
    """
    try:
        from nixl._api import nixl_agent_config
    except ImportError:
        return
    original = nixl_agent_config.__init__
    if getattr(original, "_examples_shim", False):
        return

    def init(self: Any, *a: Any, **kw: Any) -> None:
        kw.setdefault("enable_prog_thread", False)
        original(self, *a, **kw)

    init._examples_shim = True  # type: ignore[attr-defined]
    nixl_agent_config.__init__ = init  # type: ignore[method-assign]


def rank_entry(run: Callable[[], int], name: str, args: argparse.Namespace, events: EventSink) -> None:
    """Body of every rank process: logging, orphan watchdog, torch threads; exits with run()'s status."""
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    STOP.install()
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True, name="watch-parent").start()
    code = 1
    try:
        import torch

        torch.set_num_threads(torch_threads(args.torch_threads, 2 * args.tp))
        if not args.nixl_progress_thread:
            disable_nixl_progress_thread()
        code = run()
    except KeyboardInterrupt:
        say(f"{name}: interrupted")
        code = 130
    except SystemExit as exc:
        say(f"{name}: {exc}", file=sys.stderr)
        code = 2
    except BaseException as exc:  # the launcher reports our exit status; say why here
        logging.getLogger(name).exception("%s failed: %s", name, exc)
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        events.close()
        events.join_thread()  # every event reaches the launcher before we go
        # The work is over: a late signal (the launcher forwards SIGTERM) must not kill the rank
        # during the interpreter's teardown, which restores the default handlers part-way through.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
    sys.exit(code)


class GracefulStop:
    """SIGTERM/SIGINT handling of a rank process: the first signal cancels the work, never the process.

    The handlers stay installed for the whole life of the process, so a second signal (Ctrl-C reaches
    the launcher and the ranks, and the launcher forwards SIGTERM) cannot kill a rank half-way through
    its shutdown: the engines always leave their ``async with``. Only SIGKILL (the launcher's last
    resort) ends a rank abruptly.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._cancel: Callable[[], None] | None = None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum
        if self._cancel is not None:
            self._cancel()

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    @contextlib.asynccontextmanager
    async def cancel_on_signal(self) -> AsyncIterator[None]:
        """Run the body; a signal (now or earlier) cancels it and the block exits quietly."""
        import asyncio

        import anyio

        loop = asyncio.get_running_loop()
        with anyio.CancelScope() as scope:
            self._cancel = lambda: loop.call_soon_threadsafe(scope.cancel)
            if self.signum is not None:
                scope.cancel()
            try:
                yield
            finally:
                self._cancel = None


STOP = GracefulStop()
"""The rank process's signal handling (installed by :func:`rank_entry`)."""


def run_ranks(
    role: str,
    n: int,
    target: Callable[..., None],
    args: argparse.Namespace,
    on_event: Callable[[str, int, Any], None] | None = None,
    *,
    grace: float = 20.0,
) -> list[int]:
    """Start ``n`` rank processes (spawn) running ``target(rank, args, events)``; return their exit codes.

    Events the ranks put on the queue go to ``on_event``. When a rank fails, or SIGTERM/SIGINT
    arrives, the others get ``grace`` seconds to finish, then SIGTERM, then SIGKILL: nothing is
    left behind.
    """
    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    procs = [
        ctx.Process(target=target, args=(rank, args, events), name=f"{role}-{rank}", daemon=True)
        for rank in range(n)
    ]
    stop_at: list[float] = []

    def on_signal(signum: int, frame: object) -> None:
        if not stop_at:
            stop_at.append(time.monotonic() + grace)
        for p in procs:  # the ranks shut down gracefully on SIGTERM
            if p.pid is not None and p.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    threading.Thread(target=_watch_launcher_parent, args=(os.getppid(),), daemon=True).start()
    escalated = 0
    try:
        for p in procs:
            p.start()
        while True:
            _drain(events, on_event, 0.1)
            alive = [p for p in procs if p.exitcode is None]
            if not alive:
                break
            if not stop_at and any(p.exitcode not in (None, 0) for p in procs):
                stop_at.append(time.monotonic() + grace)
            if stop_at and time.monotonic() > stop_at[0]:
                sig = signal.SIGTERM if escalated == 0 else signal.SIGKILL
                say(f"{role}: stopping {len(alive)} rank(s) with {sig.name}", file=sys.stderr)
                for p in alive:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, sig)  # type: ignore[arg-type]
                escalated += 1
                stop_at[0] = time.monotonic() + 10.0
        _drain(events, on_event, 0.0)
    finally:
        for p in procs:
            if p.exitcode is None and p.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
            if p.pid is not None:
                p.join(5)
        # The ranks are gone: nothing is left to stop. A SIGTERM that arrives now (a supervisor
        # stopping a server that already stopped by itself) is ignored. SIG_IGN, not a Python
        # handler: CPython resets Python handlers to the default action while the interpreter
        # shuts down (long, with torch loaded), which turned a clean exit into -15.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
    return [p.exitcode if p.exitcode is not None else -9 for p in procs]


def _watch_launcher_parent(parent: int) -> None:
    """In a launcher: if whoever started us died, stop our ranks as if we got SIGTERM."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)
            return


def _drain(events: Any, on_event: Callable[[str, int, Any], None] | None, timeout: float) -> None:
    while True:
        try:
            kind, rank, payload = events.get(timeout=timeout) if timeout else events.get_nowait()
        except queue.Empty:
            return
        except (EOFError, OSError):
            return
        timeout = 0.0
        if on_event is not None:
            on_event(kind, rank, payload)
