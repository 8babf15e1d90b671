"""One rank process of a prefill or decode server: model shard, KV pool, engine, serving loop.

Every rank runs one asyncio loop (anyio) holding its :class:`~transfer_engine.TransferEngine`; the
model runs in that same loop, one layer at a time with a checkpoint between layers, so the engine's
actors (NIXL polling, control messages, heartbeats) run between layers. No thread of ours.

Rank 0 is the leader: it owns the request queue (fed by the front door over ZMQ), the page and aux
allocators, and the scheduling. Each step it broadcasts a :class:`~examples.serving.messages.Plan`;
every rank (the leader too) executes it: open the new rooms, abort the cancelled ones, run the
batch's forward, ``send()`` each prefill chunk right after its forward is enqueued, drop finished
rooms; then all ranks MIN-reduce, per tracked request, (room status, settled, completion time).
The leader acts on the reduced values, so every decision accounts for the slowest rank: pages and
aux slots are freed only once every rank's room is settled (``wait()`` returned: no WRITE of it can
still land or read), and a room failed on any rank is aborted on all.

Scheduling
----------
Prefill: FIFO admission (pages for the prompt, one aux slot); a room is computed once it left
Bootstrapping on every rank (the decode's request is in, as SGLang's scheduler waits); chunked
prefill of ``chunk_tokens`` per chunk, at most one chunk per request per step, up to
``max_batch_tokens`` per step. The last chunk writes the first generated token into the aux slot.
Decode: FIFO admission (pages for prompt + generated tokens, one aux slot) and ``receiver()`` on
every rank; once every rank has the room, the leader reads the first token from its aux item and
the request joins the running batch; every step runs one token of every running request.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
import torch
import zmq
import zmq.asyncio

from examples import common
from examples.serving import messages as msg
from examples.serving.model import ModelConfig, Seq, TPModel
from examples.serving.tp import TPGroup
from transfer_engine import (
    EngineConfig,
    FailureReason,
    KVPool,
    Receiver,
    RoomStatus,
    Sender,
    TransferEngine,
    TransferError,
    TransferFailed,
)
from transfer_engine.runtime.ticker import sleep as fine_sleep
from transfer_engine.testing.pagetables import free_order, side_seed

log = logging.getLogger("serving")
AUX_BYTES = 8
"""The aux item: the first generated token, int64."""


@dataclass(frozen=True)
class ServerSpec:
    """Everything a server's rank processes need; the launcher builds it."""

    role: str
    instance: int
    tp: int
    model: ModelConfig
    page_size: int
    num_pages: int
    max_requests: int
    chunk_tokens: int
    max_batch_tokens: int
    device: str
    dist_port: int
    control_port: int
    bootstrap_port: int
    record_dir: str = ""
    torch_threads: int = 1
    log_level: str = "WARNING"
    engine: dict[str, Any] = field(default_factory=dict)
    layerwise: bool = False
    """Prefill: send each request's last chunk layer by layer from inside the forward
    (``Sender.layers_ready``); earlier chunks go whole, right after their forward."""
    cpus: tuple[int, ...] = ()
    """CPUs the rank processes are pinned to (empty: not pinned)."""
    gpu_offset: int = 0
    """With ``device="cuda"``, rank ``r`` uses GPU ``(gpu_offset + r) % device_count``."""
    page_table: str = "contiguous"
    """The order of the free pages at start (``transfer_engine.testing.pagetables.free_order``)."""

    @property
    def name(self) -> str:
        return f"{self.role}{self.instance}"


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class PageAllocator:
    """Free pages of a server (the same page ids on every rank); FIFO reuse, so freed pages come back."""

    def __init__(self, num_pages: int, order: list[int] | None = None) -> None:
        """``order``: the free pages at start, head first (default ``0 .. num_pages - 1``)."""
        self.total = num_pages
        self._free: deque[int] = deque(range(num_pages) if order is None else order)

    @property
    def free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.popleft() for _ in range(n)]

    def release(self, pages: list[int]) -> None:
        self._free.extend(pages)


def kv_digests(pool: KVPool, pages: list[int], tokens: int, rank: int) -> dict[str, str]:
    """SHA-256 per global KV head over the first ``tokens`` tokens' K and V of every layer."""
    ps = pool.layout.page_size
    table = torch.as_tensor(pages, dtype=torch.int64)
    pos = torch.arange(tokens, dtype=torch.int64)
    slots = (table[pos // ps] * ps + pos % ps).to(pool.device)
    out = {}
    for j in range(pool.heads_local):
        h = hashlib.sha256()
        for t in pool.tensors:
            h.update(t[slots, j].contiguous().cpu().numpy().tobytes())
        out[str(rank * pool.heads_local + j)] = h.hexdigest()
    return out


LayerHook = Callable[[int], Awaitable[None]]
"""Called with a layer index once that layer's K/V of the whole batch are in the pool (enqueued)."""


async def run_layers(
    steps: Generator[int, None, torch.Tensor], on_layer: LayerHook | None = None
) -> torch.Tensor:
    """Drive :meth:`TPModel.layers`, letting the event loop run between layers; return the logits.

    ``on_layer`` (if given) is awaited after each layer, before the next one is enqueued: the place
    to send a group of layers while the next ones compute (layer-wise transfer).
    """
    while True:
        try:
            layer = next(steps)
        except StopIteration as done:
            logits: torch.Tensor = done.value
            return logits
        if on_layer is not None:
            await on_layer(layer)
        await anyio.lowlevel.checkpoint()


class Rank:
    """What every rank of a server does with a plan: its rooms, its forward, its share of the reduction."""

    def __init__(self, spec: ServerSpec, rank: int, engine: TransferEngine, model: TPModel, tg: Any) -> None:
        self.spec, self.rank, self.engine, self.model, self.tg = spec, rank, engine, model, tg
        self.pool = engine.pool
        self.handles: dict[int, Sender | Receiver] = {}
        self.opened: dict[int, msg.OpenSend | msg.OpenRecv] = {}
        self.settled: dict[int, float] = {}
        self.kernels_done: dict[int, float] = {}
        self.prefill_layer_hook: Callable[[list[msg.Chunk]], LayerHook | None] | None = None
        """Per prefill batch, the hook :func:`run_layers` calls after each layer (None: chunks are
        sent whole, after the batch's last layer)."""
        self.layer_senders: dict[int, Sender] = {}
        """``--layerwise``: the rooms of this batch whose chunk is open layer by layer, by rid."""
        if spec.role == "prefill":  # per batch: only for its chunks sent layer by layer
            self.prefill_layer_hook = self._layerwise_hook
        self.record = None
        if spec.record_dir:
            path = os.path.join(spec.record_dir, f"{spec.name}-rank{rank}.jsonl")
            self.record = open(path, "a", buffering=1)  # noqa: SIM115 (lives as long as the rank)

    def write_record(self, **fields: Any) -> None:
        if self.record is not None:
            self.record.write(json.dumps(fields) + "\n")

    async def _watch(self, rid: int, handle: Sender | Receiver, opened: msg.OpenSend | msg.OpenRecv) -> None:
        """Mark ``rid`` settled once its room is quiescent (``wait()`` returned or raised)."""
        ok = True
        try:
            await handle.wait()
        except TransferError as exc:
            ok = False
            # an abort by this serving loop is routine; any other failure is worth a line in the log
            aborted = isinstance(exc, TransferFailed) and exc.reason is FailureReason.ABORTED
            log.log(
                logging.INFO if aborted else logging.WARNING,
                "%s rank %d: room %d failed: %s: %s",
                self.spec.name, self.rank, opened.room, type(exc).__name__, exc,
            )  # fmt: skip
        if ok and self.record is not None:
            self.write_record(rid=rid, kv=kv_digests(self.pool, opened.pages, opened.prompt_len, self.rank))
        self.settled[rid] = time.monotonic()

    async def execute(self, plan: msg.Plan) -> torch.Tensor | None:
        """Run one step's plan on this rank; returns the batch's logits (or None without a batch)."""
        for o in plan.opens_send:
            sender = self.engine.sender(o.room)
            self.handles[o.rid], self.opened[o.rid] = sender, o
            self.tg.start_soon(self._watch, o.rid, sender, o)
        for r in plan.opens_recv:
            self.opened[r.rid] = r
            try:
                receiver = await self.engine.receiver(r.room, r.bootstrap, r.pages, aux_slot=r.aux_slot)
            except TransferError as exc:  # nothing was registered: this rank reports it failed
                log.warning("%s rank %d: receiver(%d) refused: %s", self.spec.name, self.rank, r.room, exc)
                self.settled[r.rid] = time.monotonic()
                continue
            self.handles[r.rid] = receiver
            self.tg.start_soon(self._watch, r.rid, receiver, r)
        for rid in plan.aborts:
            handle = self.handles.get(rid)
            if handle is not None:
                self.tg.start_soon(handle.abort, "cancelled by the serving loop")
        logits = None
        if plan.chunks:
            logits = await self._prefill(plan.chunks)
        elif plan.steps:
            seqs = [Seq([s.token], s.position, s.page_table) for s in plan.steps]
            logits = await run_layers(self.model.layers(seqs, self.pool))
        for rid in plan.forgets:
            self.handles.pop(rid, None)
            self.opened.pop(rid, None)
            self.settled.pop(rid, None)
            self.kernels_done.pop(rid, None)
        return logits

    def _layerwise_hook(self, chunks: list[msg.Chunk]) -> LayerHook | None:
        """Chunks marked ``layerwise`` (``--layerwise``, or the request's own ``layerwise``; None
        when the batch has none): after layer 0 opens each such last chunk (``begin_chunk``), every
        layer but the last is reported ready as soon as it is enqueued (the group's WRITE is ordered
        after it on the current stream). The last layer is reported by :meth:`_prefill` once the aux
        item (the first token, from the logits) is written, since the room's aux WRITE follows its
        closing group.

        Only last chunks: with chunked prefill an earlier chunk's transfer overlaps the next chunks'
        forward anyway, and each layer group costs the engine's work on this loop between two layers
        of the forward (docs/PERF.md, "The serving example on the GPU"); only the last chunk's
        transfer is on the time to first token."""
        self.layer_senders = {}
        chunks = [c for c in chunks if c.layerwise]
        if not chunks:
            return None
        last_layer = self.pool.layout.num_layers - 1

        async def on_layer(layer: int) -> None:
            if layer == 0:
                for c in chunks:
                    handle = self.handles.get(c.rid)
                    if not isinstance(handle, Sender):
                        continue
                    try:
                        await handle.begin_chunk(
                            c.send_pages, last=c.last, aux_slot=c.aux_slot if c.last else None
                        )
                    except TransferError as exc:  # the room ended meanwhile
                        log.info(
                            "%s rank %d: begin_chunk(%d) refused: %s", self.spec.name, self.rank, c.rid, exc
                        )
                        continue
                    self.layer_senders[c.rid] = handle
                    self.write_record(rid=c.rid, layerwise=True)  # tests check which requests went so
            if layer < last_layer:
                for rid, handle in list(self.layer_senders.items()):
                    try:
                        await handle.layers_ready(layer, layer + 1)
                    except TransferError as exc:
                        log.info(
                            "%s rank %d: layers_ready(%d) refused: %s", self.spec.name, self.rank, rid, exc
                        )
                        del self.layer_senders[rid]

        return on_layer

    async def _send_chunk(self, c: msg.Chunk, handle: Sender) -> None:
        """Send ``c`` whole, or (``--layerwise``, a request's last chunk) report its last layer,
        closing the open chunk."""
        if self.layer_senders.pop(c.rid, None) is handle:
            layers = self.pool.layout.num_layers
            await handle.layers_ready(layers - 1, layers)
        else:
            await handle.send(c.send_pages, last=c.last, aux_slot=c.aux_slot if c.last else None)

    async def _prefill(self, chunks: list[msg.Chunk]) -> torch.Tensor:
        seqs = [Seq(c.tokens, c.start, c.page_table) for c in chunks]
        hook = self.prefill_layer_hook(chunks) if self.prefill_layer_hook is not None else None
        logits = await run_layers(self.model.layers(seqs, self.pool), hook)
        aux = self.pool.aux
        assert aux is not None
        for i, c in enumerate(chunks):
            if c.last:  # the first generated token travels in the aux item; enqueued, not synchronized
                aux[c.aux_slot].view(torch.int64).copy_(logits[i].argmax().view(1))
            handle = self.handles.get(c.rid)
            if not isinstance(handle, Sender):
                continue
            try:
                await self._send_chunk(c, handle)
            except TransferError as exc:  # the room ended meanwhile; the reduction tells the leader
                log.info("%s rank %d: send(%d) refused: %s", self.spec.name, self.rank, c.rid, exc)
        done = [c.rid for c in chunks if c.last]
        if self.pool.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self.tg.start_soon(self._stamp, event, done)
        else:
            now = time.monotonic()
            for rid in done:
                self.kernels_done[rid] = now
        return logits

    async def _stamp(self, event: Any, rids: list[int]) -> None:
        """CUDA: note when the last chunk's kernels finished (polled from the loop every 100 us)."""
        while not event.query():  # noqa: ASYNC110 (a CUDA event has no awaitable)
            await fine_sleep(100e-6)
        now = time.monotonic()
        for rid in rids:
            self.kernels_done[rid] = now

    def report(self, track: list[int]) -> list[float]:
        """Per tracked request (status, settled, -settle time), then (-leaks, -handles): MIN-reduced."""
        values: list[float] = []
        for rid in track:
            handle = self.handles.get(rid)
            status = float(handle.poll().value) if handle is not None else float(RoomStatus.FAILED.value)
            if rid in self.settled:
                values += [status, 1.0, -self.settled[rid]]
            else:
                values += [status, 0.0, 0.0]
        leaks = sum(self.engine.leaks().values())
        return [*values, -float(leaks), -float(len(self.handles))]


class Link:
    """The leader's ROUTER to the front door: typed messages in, typed messages out."""

    def __init__(self, port: int) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://127.0.0.1:{port}")
        self.peer: bytes | None = None
        self.inbox: list[msg.ToServer] = []
        self.arrived = anyio.Event()

    async def run(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            if len(frames) != 2:
                continue
            self.peer = frames[0]
            try:
                self.inbox.append(msg.server_decoder.decode(frames[1]))
            except msgspec.MsgspecError as exc:
                log.warning("dropped a malformed front-door message: %s", exc)
                continue
            self.arrived.set()

    async def take(self, wait: bool) -> list[msg.ToServer]:
        if wait and not self.inbox:
            await self.arrived.wait()
        self.arrived = anyio.Event()
        out, self.inbox = self.inbox, []
        return out

    async def send(self, message: msg.FromServer) -> None:
        if self.peer is not None:
            await self.sock.send_multipart([self.peer, msg.encode(message)])

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


class Ticker:
    """A 1 ms ticker in the serving loop: each sample is how late one tick woke, in ms."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.window_start = time.monotonic()

    async def run(self) -> None:
        while True:
            t = time.monotonic()
            await anyio.sleep(0.001)
            self.samples.append((time.monotonic() - t - 0.001) * 1e3)
            if len(self.samples) > 200_000:
                del self.samples[:100_000]

    def reset(self) -> None:
        self.samples = []
        self.window_start = time.monotonic()


@dataclass
class Request:
    """The leader's view of one request."""

    rid: int
    room: int
    prompt: list[int]
    prompt_len: int
    max_new: int = 1
    bootstrap: str = ""
    pages: list[int] = field(default_factory=list)
    aux_slot: int = -1
    state: str = "queued"
    """queued -> open -> ready -> sent (prefill) / running (decode) -> done; or aborting -> done."""
    next_start: int = 0
    tokens: list[int] = field(default_factory=list)
    detail: str = ""
    t_arrived: float = 0.0
    t_opened: float = 0.0
    t_first_chunk: float = 0.0
    t_kernels_done: float = 0.0
    t_landed: float = 0.0
    layerwise: bool = False
    """Prefill: its last chunk goes layer by layer."""
    t_first_step: float = 0.0


class Leader:
    """Rank 0's scheduler for either role; see the module docstring."""

    def __init__(self, spec: ServerSpec, rank: Rank, group: TPGroup, link: Link, ticker: Ticker) -> None:
        self.spec, self.rank, self.group, self.link, self.ticker = spec, rank, group, link, ticker
        self.prefill = spec.role == "prefill"
        order = free_order(spec.page_table, spec.num_pages, seed=side_seed(spec.instance, spec.role))
        self.pages = PageAllocator(spec.num_pages, order.tolist())
        self.aux_free: deque[int] = deque(range(spec.max_requests))
        self.queue: deque[Request] = deque()
        self.live: dict[int, Request] = {}
        self.aborts: list[int] = []
        self.forgets: list[int] = []
        self.stats_wanted: list[msg.StatsQuery] = []
        self.stop = False
        self.max_leaks = 0
        self.max_handles = 0
        self.decode_tokens = 0
        self.decode_steps = 0
        self.decode_step_s = 0.0
        self.cancelled = 0

    # --- messages ---------------------------------------------------------------------------------

    async def on_message(self, m: msg.ToServer) -> None:
        now = time.monotonic()
        match m:
            case msg.PrefillRequest(rid=rid, room=room, prompt=prompt, layerwise=layerwise) if self.prefill:
                self.queue.append(
                    Request(
                        rid,
                        room,
                        list(prompt),
                        len(prompt),
                        t_arrived=now,
                        layerwise=self.spec.layerwise if layerwise is None else layerwise,
                    )  # fmt: skip
                )
            case msg.DecodeRequest() if not self.prefill:
                self.queue.append(
                    Request(m.rid, m.room, [], m.prompt_len, m.max_new_tokens, m.bootstrap, t_arrived=now)
                )
            case msg.Cancel(rid=rid):
                await self._cancel(rid)
            case msg.StatsQuery():
                self.stats_wanted.append(m)
            case msg.Stop():
                self.stop = True
            case _:
                log.warning("%s: ignored %s", self.spec.name, type(m).__name__)

    async def _cancel(self, rid: int) -> None:
        for r in self.queue:
            if r.rid == rid:
                self.queue.remove(r)
                r.detail = "cancelled"
                await self._report(r, ok=False)
                return
        r = self.live.get(rid)
        if r is None or r.state in ("aborting", "done"):
            return
        r.detail = "cancelled"
        self.cancelled += 1
        if r.state == "running":  # decode: the room is over, nothing can land any more
            await self._finish(r, ok=False)
        else:
            r.state = "aborting"
            self.aborts.append(rid)

    # --- plans ------------------------------------------------------------------------------------

    def _admit(self, plan: msg.Plan) -> None:
        ps = self.spec.page_size
        while self.queue and self.aux_free:
            r = self.queue[0]
            need = pages_for(r.prompt_len + (0 if self.prefill else r.max_new - 1), ps)
            pages = self.pages.alloc(need)
            if pages is None:
                return
            self.queue.popleft()
            r.pages, r.aux_slot, r.state, r.t_opened = (
                pages,
                self.aux_free.popleft(),
                "open",
                time.monotonic(),
            )
            self.live[r.rid] = r
            prompt_pages = pages[: pages_for(r.prompt_len, ps)]
            if self.prefill:
                plan.opens_send.append(msg.OpenSend(r.rid, r.room, r.prompt_len, prompt_pages))
            else:
                plan.opens_recv.append(
                    msg.OpenRecv(r.rid, r.room, r.prompt_len, prompt_pages, r.aux_slot, r.bootstrap)
                )

    def _chunks(self, plan: msg.Plan) -> None:
        ps, budget = self.spec.page_size, self.spec.max_batch_tokens
        used = 0
        for r in self.live.values():
            if r.state != "ready":
                continue
            start = r.next_start
            end = min(r.prompt_len, start + self.spec.chunk_tokens)
            if used and used + end - start > budget:
                break
            used += end - start
            last = end == r.prompt_len
            plan.chunks.append(
                msg.Chunk(
                    r.rid,
                    r.prompt[start:end],
                    start,
                    r.pages[: pages_for(end, ps)],
                    r.pages[start // ps : pages_for(end, ps)],
                    last,
                    r.aux_slot,
                    last and r.layerwise,
                )
            )
            if not start:
                r.t_first_chunk = time.monotonic()
            r.next_start = end
            if last:
                r.state = "sent"

    def _steps(self, plan: msg.Plan) -> None:
        ps = self.spec.page_size
        for r in self.live.values():
            if r.state == "running":
                pos = r.prompt_len + len(r.tokens) - 1
                plan.steps.append(msg.Step(r.rid, r.tokens[-1], pos, r.pages[: pages_for(pos + 1, ps)]))

    def make_plan(self) -> msg.Plan:
        plan = msg.Plan(aborts=self.aborts, forgets=self.forgets, stop=self.stop)
        self.aborts, self.forgets = [], []
        if not self.stop:
            self._admit(plan)
            if self.prefill:
                self._chunks(plan)
            else:
                self._steps(plan)
        plan.track.extend(rid for rid, r in self.live.items() if r.state not in ("running", "done"))
        return plan

    # --- results ----------------------------------------------------------------------------------

    async def on_step(self, plan: msg.Plan, logits: torch.Tensor | None, reduced: list[float]) -> None:
        now = time.monotonic()
        for c in plan.chunks:
            r = self.live[c.rid]  # chunks are planned for live requests, and only on_step ends them
            if c.last:
                r.t_kernels_done = self.rank.kernels_done.get(c.rid, 0.0)
        if plan.steps and logits is not None:
            chosen = logits.argmax(dim=-1).tolist()
            for i, s in enumerate(plan.steps):
                r = self.live.get(s.rid)
                if r is None or r.state != "running":
                    continue  # cancelled during the step
                r.tokens.append(int(chosen[i]))
                self.decode_tokens += 1
                if len(r.tokens) == 2:
                    r.t_first_step = now
                    if self.rank.record is not None:
                        self.rank.write_record(rid=r.rid, first_logits=logits[i].cpu().tolist())
                    await self.link.send(msg.Tokens(r.rid, r.tokens[:2]))
                else:
                    await self.link.send(msg.Tokens(r.rid, r.tokens[-1:]))
                if len(r.tokens) >= r.max_new:
                    await self._finish(r, ok=True)
        n = len(plan.track)
        self.max_leaks, self.max_handles = int(-reduced[3 * n]), int(-reduced[3 * n + 1])
        for i, rid in enumerate(plan.track):
            status, settled, neg_t = reduced[3 * i : 3 * i + 3]
            r = self.live.get(rid)
            if r is None or r.state == "done":
                continue
            if settled == 1.0:
                if status == RoomStatus.SUCCESS.value and r.state in ("sent", "open", "ready"):
                    await self._settled_ok(r, -neg_t)
                elif status != RoomStatus.SUCCESS.value or r.state == "aborting":
                    r.detail = r.detail or "transfer failed"
                    await self._finish(r, ok=False)
            elif status == RoomStatus.FAILED.value and r.state != "aborting":
                r.state, r.detail = "aborting", "transfer failed"
                self.aborts.append(rid)
            elif r.state == "open" and status >= RoomStatus.WAITING_FOR_INPUT.value and self.prefill:
                r.state = "ready"
        for q in self.stats_wanted:
            await self.link.send(self.stats())
            if q.reset:
                self.ticker.reset()
                self.decode_tokens = self.decode_steps = 0
                self.decode_step_s = 0.0
        self.stats_wanted = []

    async def _settled_ok(self, r: Request, t_landed: float) -> None:
        if self.prefill:
            await self._finish(r, ok=True)
            return
        r.t_landed = t_landed
        aux = self.rank.pool.aux
        assert aux is not None
        r.tokens = [int(aux[r.aux_slot].view(torch.int64)[0].item())]
        self.aux_free.append(r.aux_slot)
        r.aux_slot = -1
        self.forgets.append(r.rid)
        if r.max_new <= 1:
            await self.link.send(msg.Tokens(r.rid, r.tokens))
            await self._finish(r, ok=True)
        else:
            r.state = "running"

    async def _finish(self, r: Request, ok: bool) -> None:
        """The request is over and nothing of it is in flight on any rank: free and report."""
        r.state = "done"
        self.live.pop(r.rid, None)
        self.pages.release(r.pages)
        if r.aux_slot >= 0:
            self.aux_free.append(r.aux_slot)
        if r.rid not in self.forgets:
            self.forgets.append(r.rid)
        if self.rank.record is not None and not self.prefill:
            self.rank.write_record(rid=r.rid, tokens=r.tokens, ok=ok)
        await self._report(r, ok)

    async def _report(self, r: Request, ok: bool) -> None:
        if self.prefill:
            # On CUDA the kernels-done time is stamped by a task polling the chunk's event, after the
            # step that enqueued it: read it now (the room ended, so its WRITEs read finished KV).
            done_at = self.rank.kernels_done.get(r.rid, r.t_kernels_done)
            await self.link.send(msg.PrefillDone(r.rid, ok, r.detail, r.t_arrived, r.t_first_chunk, done_at))
        else:
            await self.link.send(msg.DecodeDone(r.rid, ok, r.detail, r.t_opened, r.t_landed, r.t_first_step))

    def stats(self) -> msg.Stats:
        return msg.Stats(
            role=self.spec.role,
            pages_free=self.pages.free,
            pages_total=self.pages.total,
            aux_free=len(self.aux_free),
            aux_total=self.spec.max_requests,
            requests_live=len(self.live) + len(self.queue),
            leaks=self.max_leaks,
            handles=self.max_handles,
            cancelled=self.cancelled,
            lag_ms=list(self.ticker.samples),
            decode_tokens=self.decode_tokens,
            decode_steps=self.decode_steps,
            decode_step_s=self.decode_step_s,
            window_s=time.monotonic() - self.ticker.window_start,
        )

    def busy(self) -> bool:
        return bool(self.live or self.queue or self.aborts or self.forgets or self.stats_wanted or self.stop)

    async def run(self) -> None:
        while True:
            for m in await self.link.take(wait=not self.busy()):
                await self.on_message(m)
            plan = self.make_plan()
            t0 = time.monotonic()
            await self.group.broadcast(msg.encode(plan))
            logits = await self.rank.execute(plan)
            if plan.steps:
                self.decode_steps += 1
                self.decode_step_s += time.monotonic() - t0
            reduced = await self.group.reduce_min(self.rank.report(plan.track))
            await self.on_step(plan, logits, reduced)
            if plan.stop:
                return
            if not plan.chunks and not plan.steps and self.live:
                await anyio.sleep(0.001)  # only waiting on transfers: poll every millisecond


async def follow(rank: Rank, group: TPGroup) -> None:
    """A follower rank: execute the leader's plans until told to stop."""
    while True:
        plan = msg.plan_decoder.decode(await group.broadcast(None))
        await rank.execute(plan)
        await group.reduce_min(rank.report(plan.track))
        if plan.stop:
            return


async def serve(spec: ServerSpec, rank: int, events: Any) -> int:
    if spec.cpus:
        os.sched_setaffinity(0, spec.cpus)
    if spec.device == "cuda":
        index = (spec.gpu_offset + rank) % torch.cuda.device_count()
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    else:
        device = torch.device("cpu")
    group = TPGroup(spec.tp, rank, spec.dist_port, device)
    model = TPModel(spec.model, spec.tp, rank, device=device, all_reduce=group.all_reduce)
    layout = spec.model.kv_layout(torch.float32, spec.page_size)
    pool = KVPool.allocate(
        layout,
        spec.tp,
        rank,
        spec.num_pages,
        device=device,
        aux_slots=spec.max_requests,
        aux_item_bytes=AUX_BYTES,
    )
    model.check_pool(pool)
    extra: dict[str, Any] = dict(spec.engine)
    if spec.role == "prefill":
        extra["bootstrap_port"] = spec.bootstrap_port
    cfg = EngineConfig(role=spec.role, tp_size=spec.tp, tp_rank=rank, **extra)  # type: ignore[arg-type]
    link = Link(spec.control_port) if rank == 0 else None
    try:
        async with TransferEngine(cfg, pool) as engine:
            async with common.STOP.cancel_on_signal(), anyio.create_task_group() as tg:
                worker = Rank(spec, rank, engine, model, tg)
                events.put(("up", rank, spec.name))
                if link is not None:
                    ticker = Ticker()
                    tg.start_soon(link.run)
                    tg.start_soon(ticker.run)
                    await Leader(spec, worker, group, link, ticker).run()
                else:
                    await follow(worker, group)
                tg.cancel_scope.cancel()
    finally:
        if link is not None:
            link.close()
        group.close()
    return 0


def rank_main(spec: ServerSpec, rank: int, events: Any) -> None:
    """Entry point of one rank process (spawned by the launcher)."""
    args = SimpleNamespace(
        log_level=spec.log_level, torch_threads=spec.torch_threads, tp=spec.tp, nixl_progress_thread=False
    )
    name = f"{spec.name} rank {rank}/{spec.tp}"
    common.rank_entry(lambda: anyio.run(serve, spec, rank, events), name, args, events)  # type: ignore[arg-type]
