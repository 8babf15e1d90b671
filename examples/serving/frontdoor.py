"""The front door: HTTP in (aiohttp), requests out to the prefill and decode leaders (ZMQ), tokens back.

``POST /generate`` with ``{"prompt": [token ids], "max_new_tokens": n}`` (and optionally
``"layerwise": true|false``, overriding the prefill server's ``--layerwise`` for this request) answers a stream of JSON
lines (``application/x-ndjson``): ``{"rid": ..., "tokens": [...]}`` as the decode produces them, then one
``{"rid": ..., "done": true, "ok": ..., "ttft_ms": ..., "transfer_ms": ..., "split_ms": {...}}``. A client that
closes the connection cancels its request on both servers. ``GET /stats`` (``?reset=1`` starts a new
measurement window) answers every server's :class:`~examples.serving.messages.Stats`.

The front door picks a random room id per request, sends the prompt to the prefill and the room to a
decode instance (round robin over the live ones) at the same time, as a disaggregated router does.
When a decode instance dies (``alive`` says so), its requests end with an error and are cancelled on
the prefill.

Timing, per request (all ``time.monotonic()``, one clock on one machine):
``ttft`` = arrival here -> the first tokens reach the front door, which happens right after the
decode's first step (the prefill's token travels in the aux item and is streamed with the first
decode token). Its split: ``queue`` (arrival -> the prefill starts the first chunk: queueing and
the decode's request reaching the prefill), ``prefill`` (-> the last chunk's kernels are done),
``transfer_tail`` (-> every decode rank has every byte), ``first_step`` (-> the decode's first step
is done); ``transfer`` is the decode's whole wait (``receiver()`` -> every byte there).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
import zmq
import zmq.asyncio
from aiohttp import web

from examples.serving import messages as msg

log = logging.getLogger("serving.frontdoor")
PREFILL_DONE_WAIT_S = 10.0
STATS_TIMEOUT_S = 30.0


class LeaderLink:
    """A DEALER to one server leader; replies are handed to ``on_message``."""

    def __init__(
        self, ctx: zmq.asyncio.Context, port: int, on_message: Callable[[msg.FromServer], None]
    ) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.on_message = on_message
        self.stats_lock = asyncio.Lock()
        self.stats_reply: asyncio.Future[msg.Stats] | None = None

    async def send(self, message: msg.ToServer) -> None:
        await self.sock.send(msg.encode(message))

    async def run(self) -> None:
        while True:
            payload = await self.sock.recv()
            try:
                message = msg.client_decoder.decode(payload)
            except msgspec.MsgspecError as exc:
                log.warning("dropped a malformed server message: %s", exc)
                continue
            if isinstance(message, msg.Stats):
                if self.stats_reply is not None and not self.stats_reply.done():
                    self.stats_reply.set_result(message)
            else:
                self.on_message(message)

    async def stats(self, reset: bool) -> msg.Stats:
        """The leader's Stats (TimeoutError after ``STATS_TIMEOUT_S``)."""
        async with self.stats_lock:
            self.stats_reply = asyncio.get_running_loop().create_future()
            await self.send(msg.StatsQuery(reset))
            with anyio.fail_after(STATS_TIMEOUT_S):
                return await self.stats_reply


@dataclass
class Pending:
    """One request in flight at the front door."""

    rid: int
    instance: int
    t_arrived: float
    events: asyncio.Queue[msg.FromServer | str] = field(default_factory=asyncio.Queue)
    prefill: msg.PrefillDone | None = None
    prefill_arrived: asyncio.Event = field(default_factory=asyncio.Event)
    t_first_tokens: float = 0.0


class FrontDoor:
    """Routes requests to the servers and streams tokens back; serve it with :meth:`start`."""

    def __init__(
        self,
        prefill_port: int,
        decode_ports: list[int],
        bootstrap: str,
        vocab: int,
        alive: Callable[[int], bool] = lambda instance: True,
    ) -> None:
        self.ctx = zmq.asyncio.Context()
        self.prefill = LeaderLink(self.ctx, prefill_port, self._on_message)
        self.decode = [LeaderLink(self.ctx, p, self._on_message) for p in decode_ports]
        self.bootstrap = bootstrap
        self.vocab = vocab
        self.alive = alive
        self.dead: set[int] = set()
        self.stopping = False
        self.pending: dict[int, Pending] = {}
        self.next_rid = 1
        self.turn = 0
        self.rng = random.Random()
        self.tasks: list[asyncio.Task[None]] = []
        """The links' receive loops and the watcher: asyncio tasks (aiohttp is asyncio-only), started
        by :meth:`start`, cancelled and awaited by :meth:`close`."""
        self.runner: web.AppRunner | None = None
        self.url = ""

    def _on_message(self, m: msg.FromServer) -> None:
        if isinstance(m, msg.PrefillDone):
            p = self.pending.get(m.rid)
            if p is not None:
                p.prefill = m
                p.prefill_arrived.set()
            return
        rid = getattr(m, "rid", None)
        p = self.pending.get(rid) if rid is not None else None
        if p is not None:
            p.events.put_nowait(m)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            if self.stopping:
                return
            for i in range(len(self.decode)):
                if i not in self.dead and not self.alive(i):
                    self.dead.add(i)
                    log.warning("decode instance %d died; failing its requests", i)
                    for p in list(self.pending.values()):
                        if p.instance == i:
                            p.events.put_nowait(f"decode instance {i} died")
                            await self.prefill.send(msg.Cancel(p.rid))

    # --- HTTP -----------------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        t_arrived = time.monotonic()
        try:
            body = await request.json()
        except ValueError:
            raise web.HTTPBadRequest(text="the body must be JSON") from None
        prompt = body.get("prompt") if isinstance(body, dict) else None
        max_new = body.get("max_new_tokens", 16) if isinstance(body, dict) else None
        if not isinstance(prompt, list) or not prompt:
            raise web.HTTPBadRequest(text=f"prompt={prompt!r} must be a non-empty list of token ids")
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < self.vocab]
        if bad:
            raise web.HTTPBadRequest(text=f"prompt token {bad[0]!r} is not an id in [0, {self.vocab})")
        if not isinstance(max_new, int) or max_new < 1:
            raise web.HTTPBadRequest(text=f"max_new_tokens={max_new!r} must be an integer >= 1")
        layerwise = body.get("layerwise")
        if layerwise is not None and not isinstance(layerwise, bool):
            raise web.HTTPBadRequest(text=f"layerwise={layerwise!r} must be true, false or absent")
        live = [i for i in range(len(self.decode)) if i not in self.dead]
        if not live:
            raise web.HTTPServiceUnavailable(text="no decode instance is alive")
        instance = live[self.turn % len(live)]
        self.turn += 1
        rid, self.next_rid = self.next_rid, self.next_rid + 1
        room = self.rng.getrandbits(63)
        p = Pending(rid, instance, t_arrived)
        self.pending[rid] = p
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        finished = False
        try:
            await self.prefill.send(msg.PrefillRequest(rid, room, prompt, layerwise))
            await self.decode[instance].send(
                msg.DecodeRequest(rid, room, len(prompt), max_new, self.bootstrap)
            )
            await response.prepare(request)
            while True:
                event = await p.events.get()
                if isinstance(event, msg.Tokens):
                    if not p.t_first_tokens:
                        p.t_first_tokens = time.monotonic()
                    await response.write(json.dumps({"rid": rid, "tokens": event.tokens}).encode() + b"\n")
                elif isinstance(event, msg.DecodeDone):
                    finished = True
                    await response.write(json.dumps(await self._final(p, event)).encode() + b"\n")
                    break
                else:  # the decode instance died
                    finished = True
                    await response.write(
                        json.dumps({"rid": rid, "done": True, "ok": False, "error": event}).encode() + b"\n"
                    )
                    break
            await response.write_eof()
            return response
        except ConnectionResetError:  # the client closed the stream (aiohttp's ClientConnectionResetError)
            return response
        finally:
            if not finished:  # the client went away (or the request failed to start): cancel everywhere
                with contextlib.suppress(Exception):
                    await self.prefill.send(msg.Cancel(rid))
                    if instance not in self.dead:
                        await self.decode[instance].send(msg.Cancel(rid))
            self.pending.pop(rid, None)

    async def _final(self, p: Pending, done: msg.DecodeDone) -> dict[str, Any]:
        if not done.ok:
            await self.prefill.send(msg.Cancel(p.rid))  # no-op if the prefill is already done
            return {"rid": p.rid, "done": True, "ok": False, "error": done.detail}
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(p.prefill_arrived.wait(), PREFILL_DONE_WAIT_S)
        pf = p.prefill
        out: dict[str, Any] = {
            "rid": p.rid,
            "done": True,
            "ok": True,
            "ttft_ms": (p.t_first_tokens - p.t_arrived) * 1e3,
            "transfer_ms": (done.t_landed - done.t_opened) * 1e3,
        }
        if pf is not None and pf.ok:
            out["split_ms"] = {
                "queue": (pf.t_first_chunk - p.t_arrived) * 1e3,
                "prefill": (pf.t_kernels_done - pf.t_first_chunk) * 1e3,
                "transfer_tail": (done.t_landed - pf.t_kernels_done) * 1e3,
                "first_step": (done.t_first_step - done.t_landed) * 1e3 if done.t_first_step else 0.0,
            }
        return out

    async def http_stats(self, request: web.Request) -> web.Response:
        reset = request.query.get("reset", "0") not in ("0", "")
        return web.json_response(await self.stats(reset))

    async def stats(self, reset: bool = False) -> dict[str, Any]:
        """Every live server's Stats, as dicts: ``{"prefill": {...}, "decode": [{...} or None, ...]}``."""
        prefill = await self.prefill.stats(reset)
        decode = [None if i in self.dead else await d.stats(reset) for i, d in enumerate(self.decode)]
        return msgspec.to_builtins({"prefill": prefill, "decode": decode})

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self, port: int = 0) -> str:
        """Serve HTTP on 127.0.0.1:``port`` (0: any free port); returns the base URL."""
        for link in (self.prefill, *self.decode):
            self.tasks.append(asyncio.ensure_future(link.run()))
        self.tasks.append(asyncio.ensure_future(self._watch()))
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/stats", self.http_stats)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port)
        await site.start()
        sockets = self.runner.addresses
        self.url = f"http://127.0.0.1:{sockets[0][1]}"
        return self.url

    async def stop_servers(self) -> None:
        """Tell every live server to shut down (their exits are no longer failures)."""
        self.stopping = True
        await self.prefill.send(msg.Stop())
        for i, d in enumerate(self.decode):
            if i not in self.dead:
                await d.send(msg.Stop())

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        for t in self.tasks:
            t.cancel()
        for t in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self.tasks = []
        for link in (self.prefill, *self.decode):
            link.sock.close(0)
        self.ctx.term()
