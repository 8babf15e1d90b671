"""Our disaggregated-serving router for vLLM instances running :mod:`.connector` (concurrent protocol).

    python -m transfer_engine.integrations.vllm.proxy --port 8000 \\
        --prefill http://127.0.0.1:8100 tcp://127.0.0.1:8998 \\
        --decode http://127.0.0.1:8200

For each ``POST /v1/completions`` (or ``/v1/chat/completions``) it picks a prefill and a decode
instance (round robin), makes a transfer ID, and sends the request to both at once: to the prefill
with ``max_tokens=1`` (and ``max_completion_tokens=1``, without the fields that conflict with one
token: :data:`PREFILL_DROPS`) and ``kv_transfer_params={"do_remote_decode": true, "transfer_id":
ID}``, to the decode unchanged but for ``kv_transfer_params={"do_remote_prefill": true,
"transfer_id": ID, "bootstrap": PREFILL_BOOTSTRAP}``. The decode allocates the blocks and waits; the
prefill computes the prompt and WRITEs its KV into them (push). Both legs carry the client's headers
(``Authorization`` included) but the hop-by-hop ones.

The client gets the decode's answer, streamed as it comes, once the prefill answered 200. A prefill
that answers an error has its status and body returned to the client at once, and the decode leg is
cancelled (vLLM aborts it and the connector frees its blocks). When the client goes away, both legs
are cancelled the same way, and a line is logged (no traceback). ``GET /healthz`` answers 200 only
while every server answers its ``/health``; otherwise 503, naming those that did not.

Choosing the instances by the transfer cost (docs/INTEGRITY.md, "Choosing an instance"): given
``--decode-metrics DECODE_URL METRICS_URL`` for a decode instance (its engine's Prometheus endpoint,
``metrics_port`` of the connector's settings; once per TP rank) and ``--kv-bytes-per-token``, the
router estimates for each (prefill, decode) pair how long this request's KV would take to reach the
decode now: on each decode rank, ``backlog_seconds + N / rate`` for that prefill instance (N: the
rank's share of the request's KV bytes, plus those of requests the router sent there since its last
reading), the slowest rank's for the instance, and takes the least (``transfer_engine.choose``; ties
in round-robin order). The metrics are read in the background every ``--cost-interval`` seconds: a
request never waits for them. A decode instance without metrics, or whose reading failed or is
older than :data:`MAX_AGE_INTERVALS` intervals, is taken in its round-robin turn (logged once).
``GET /costs`` shows each endpoint's last reading. Without ``--decode-metrics`` it is round robin.

vLLM's standard sequential protocol needs no router of ours: see docs/vllm.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import math
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from transfer_engine import DEFAULT_PRIOR_RATE, choose, estimate_seconds
from transfer_engine.errors import ConfigError

log = logging.getLogger(__name__)

PREFILL_DROPS = ("min_tokens", "stream_options", "max_completion_tokens")
"""Request fields the prefill leg goes without: ``min_tokens`` above 1 is refused next to
``max_tokens=1`` (HTTP 400), and the stream options belong to the client's (decode) leg;
``max_completion_tokens`` is set to 1 again after."""

HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
     "transfer-encoding", "upgrade", "host", "content-length", "content-type", "accept-encoding"}
)  # fmt: skip
"""Headers not forwarded (RFC 9110's hop-by-hop ones, and those aiohttp sets for the new body)."""

HEALTH_TIMEOUT_S = 5.0

COST_INTERVAL_S = 0.5
"""Default seconds between two readings of a decode rank's metrics."""
MAX_AGE_INTERVALS = 10
"""A reading older than this many intervals is not used (its instance goes round robin)."""
CHARS_PER_TOKEN = 4
"""A text prompt's tokens are guessed from its UTF-8 bytes (the router has no tokenizer)."""
BACKLOG = "transfer_engine_peer_backlog_seconds"
RATE = "transfer_engine_peer_rate_bytes_per_second"


def forwarded(headers: Mapping[str, str]) -> dict[str, str]:
    """The client's headers for the upstream legs (``Authorization``, ``X-Request-Id``...)."""
    return {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP}


def prefill_body(body: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    """The prefill leg's request: one token, not streamed, with the transfer's params."""
    out = {k: v for k, v in body.items() if k not in PREFILL_DROPS}
    out.update(max_tokens=1, stream=False)
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    out["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": transfer_id}
    return out


def decode_body(body: dict[str, Any], transfer_id: str, bootstrap: str) -> dict[str, Any]:
    """The decode leg's request: the client's, with the transfer's params."""
    return dict(
        body,
        kv_transfer_params={"do_remote_prefill": True, "transfer_id": transfer_id, "bootstrap": bootstrap},
    )


# ---- the transfer cost: pure decisions ------------------------------------------------------------

Pair = tuple[int, int]
"""A (prefill, decode) pair, by the instances' indexes in the router's lists."""


@dataclass(frozen=True)
class PeerReading:
    """One decode rank's cost of one prefill instance, as its metrics gave it."""

    backlog_s: float
    """``transfer_engine_peer_backlog_seconds``: until a new room's bytes would start moving."""
    rate: float | None
    """``transfer_engine_peer_rate_bytes_per_second``; None before the rank measured one."""


def readings_of(text: str) -> dict[str, PeerReading]:
    """A decode rank's readings by prefill instance (bootstrap address), from its metrics' text. An
    instance it never had a room with is absent. ValueError for text that is not Prometheus'."""
    backlog: dict[str, float] = {}
    rate: dict[str, float] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, IndexError, KeyError, TypeError) as exc:  # the parser's errors, as one
        raise ValueError(f"not Prometheus text ({type(exc).__name__}: {exc}): {text[:80]!r}") from None
    for family in families:
        for sample in family.samples:
            into = {BACKLOG: backlog, RATE: rate}.get(sample.name)
            if into is not None and "instance" in sample.labels:
                into[sample.labels["instance"]] = sample.value
    return {name: PeerReading(seconds, rate.get(name)) for name, seconds in backlog.items()}


def prompt_tokens(body: Mapping[str, Any]) -> int:
    """The request's prompt tokens: the length of a token-ID prompt, else a guess from the bytes of
    its text (``prompt`` or the chat ``messages``' contents; :data:`CHARS_PER_TOKEN`). Each
    candidate pair is charged the same N, so a poor guess only weighs the backlog against it."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):  # a batch of token-ID prompts
        return sum(len(p) for p in prompt if isinstance(p, list))
    if prompt is None:
        prompt = [m.get("content") for m in body.get("messages") or () if isinstance(m, dict)]
    text = json.dumps(prompt, ensure_ascii=False) if not isinstance(prompt, str) else prompt
    return max(1, len(text.encode()) // CHARS_PER_TOKEN)


def pair_estimate(
    ranks: Sequence[Mapping[str, PeerReading]], bootstrap: str, nbytes: int, pending: int = 0
) -> float:
    """Seconds until a request of ``nbytes`` KV bytes from the prefill instance ``bootstrap`` landed
    on every rank of a decode instance, by each rank's readings: ``backlog_s + (share + pending
    share) / rate``, the slowest rank's. A rank splits the bytes evenly with the others; ``pending``
    are bytes sent there after the readings were taken. An instance a rank has no reading of costs
    its backlog-free prior, as the engine's own estimate does."""
    if nbytes < 0 or pending < 0:
        raise ConfigError(f"nbytes={nbytes} and pending={pending} must be >= 0")
    if not ranks:
        raise ConfigError("a decode instance needs the readings of at least one rank")
    share = (nbytes + pending) / len(ranks)
    worst = 0.0
    for readings in ranks:
        reading = readings.get(bootstrap, PeerReading(0.0, None))
        worst = max(worst, reading.backlog_s + estimate_seconds(0, share, reading.rate, DEFAULT_PRIOR_RATE))
    return worst


def turn_order(turn: int, num_prefill: int, num_decode: int) -> list[Pair]:
    """Every pair, the round-robin one of ``turn`` first (prefill ``turn`` and decode ``turn``, each
    modulo its count, as independent cycles would give), then the others in their round-robin order."""
    if num_prefill < 1 or num_decode < 1:
        raise ConfigError(f"{num_prefill} prefill and {num_decode} decode instances: need one of each")
    return [
        ((turn + a) % num_prefill, (turn + b) % num_decode)
        for a in range(num_prefill)
        for b in range(num_decode)
    ]


def decide(order: Sequence[Pair], estimates: Mapping[Pair, float | None]) -> Pair:
    """The pair a request goes to. ``order``: every pair, in round-robin order (the first is the one
    whose turn it is); ``estimates``: each pair's seconds, None where unknown (no metrics, or none
    fresh). A pair whose turn it is and that is unknown gets the request: an instance the router cannot
    see keeps its round-robin share. Otherwise the least known estimate wins (``choose``: ties go to
    the earlier in ``order``)."""
    if not order:
        raise ConfigError("no (prefill, decode) pair to choose from")
    first = order[0]
    if estimates.get(first) is None:
        return first
    known = [(pair, seconds) for pair in order if (seconds := estimates.get(pair)) is not None]
    best = choose([(str(i), seconds) for i, (_, seconds) in enumerate(known)])
    return known[int(best)][0]


# ---- the transfer cost: reading the metrics ------------------------------------------------------


class CostScraper:
    """Reads one decode rank's metrics every ``interval`` seconds in the background; :meth:`current`
    hands out the last reading while it is fresh. A failed reading is logged once (and its return)."""

    def __init__(self, url: str, interval: float) -> None:
        self.url = url
        self.interval = interval
        self.readings: dict[str, PeerReading] | None = None
        self.taken_at = -math.inf
        """When the last good reading was asked for (monotonic seconds)."""
        self.failing: str | None = None
        """Why the last reading failed; None while they succeed."""

    def current(self, now: float) -> tuple[dict[str, PeerReading], float] | None:
        """The last good reading and when it was asked for; None when none is younger than
        :data:`MAX_AGE_INTERVALS` intervals."""
        if self.readings is None or now - self.taken_at > MAX_AGE_INTERVALS * self.interval:
            return None
        return self.readings, self.taken_at

    async def read(self, session: aiohttp.ClientSession) -> None:
        """One reading (at most ``interval`` seconds; never raises but for cancellation)."""
        asked = time.monotonic()
        try:
            async with session.get(self.url, timeout=aiohttp.ClientTimeout(total=self.interval)) as r:
                if r.status != 200:
                    raise ValueError(f"HTTP {r.status}")
                readings = readings_of(await r.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, UnicodeDecodeError) as exc:
            why = f"{type(exc).__name__}: {exc}"
            if self.failing is None:
                log.warning("cost metrics %s unreadable (%s): its instance goes round robin", self.url, why)
            self.failing = why
            return
        if self.failing is not None:
            log.info("cost metrics %s readable again", self.url)
        self.failing = None
        self.readings, self.taken_at = readings, asked

    async def run(self, session: aiohttp.ClientSession) -> None:
        while True:
            started = time.monotonic()
            await self.read(session)
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))

    def describe(self, now: float) -> dict[str, Any]:
        """For ``GET /costs``."""
        return {
            "url": self.url,
            "age_s": None if self.readings is None else now - self.taken_at,
            "failing": self.failing,
            "instances": {
                name: {"backlog_s": r.backlog_s, "rate": r.rate} for name, r in (self.readings or {}).items()
            },
        }


@dataclass(frozen=True)
class CostSettings:
    """How the router reads the transfer cost: per decode url, its ranks' metrics urls."""

    metrics: Mapping[str, Sequence[str]]
    kv_bytes_per_token: int
    """KV bytes one prompt token takes on a decode instance, all its ranks together."""
    interval: float = COST_INTERVAL_S

    def check(self, decode: Sequence[str]) -> None:
        """ConfigError naming a metrics entry for no known decode, or a bad number."""
        for url, endpoints in self.metrics.items():
            if url not in decode:
                raise ConfigError(f"--decode-metrics {url}: not one of the --decode instances {list(decode)}")
            if not endpoints:
                raise ConfigError(f"--decode-metrics {url}: no metrics endpoint")
        if self.kv_bytes_per_token <= 0:
            raise ConfigError(f"kv_bytes_per_token={self.kv_bytes_per_token} must be > 0")
        if not self.interval > 0:
            raise ConfigError(f"cost interval={self.interval} must be > 0")


@dataclass
class _Sent:
    pair: Pair
    nbytes: int
    at: float


class Router:
    """Round-robin over prefill ``(url, bootstrap)`` pairs and decode urls, or by the transfer cost
    where ``costs`` gives decode instances' metrics."""

    def __init__(
        self, prefill: list[tuple[str, str]], decode: list[str], costs: CostSettings | None = None
    ) -> None:
        if not prefill or not decode:
            raise ValueError("need at least one --prefill and one --decode instance")
        if costs is not None:
            costs.check(decode)
        self._servers = [url for url, _ in prefill] + list(decode)
        self._prefills = list(prefill)
        self._decodes = list(decode)
        self._turn = 0
        self._costs = costs
        self._scrapers: list[list[CostScraper]] = [
            [CostScraper(m, costs.interval) for m in costs.metrics.get(url, ())] if costs else []
            for url in decode
        ]
        """Per decode instance, one per rank (none: round robin for it)."""
        self._sent: dict[int, _Sent] = {}
        """Requests routed and not answered yet, by a key of their own."""
        self._keys = itertools.count()
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None

    async def start(self, app: web.Application) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        for scraper in (s for ranks in self._scrapers for s in ranks):
            self._tasks.append(asyncio.ensure_future(scraper.run(self._session)))

    async def close(self, app: web.Application) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    def _estimate(self, pair: Pair, nbytes: int, now: float) -> float | None:
        """``pair``'s estimate from its decode's fresh readings; None when it has none."""
        p, d = pair
        taken = [s.current(now) for s in self._scrapers[d]]
        if not taken or any(t is None for t in taken):
            return None
        ranks = [t[0] for t in taken if t is not None]
        oldest = min(t[1] for t in taken if t is not None)
        pending = sum(s.nbytes for s in self._sent.values() if s.pair == pair and s.at >= oldest)
        return pair_estimate(ranks, self._prefills[p][1], nbytes, pending)

    def route(self, body: Mapping[str, Any]) -> tuple[Pair, int]:
        """The pair this request goes to, and its KV bytes (0 without cost settings)."""
        order = turn_order(self._turn, len(self._prefills), len(self._decodes))
        self._turn += 1
        if self._costs is None:
            return order[0], 0
        nbytes = prompt_tokens(body) * self._costs.kv_bytes_per_token
        now = time.monotonic()
        estimates = {pair: self._estimate(pair, nbytes, now) for pair in order}
        pair = decide(order, estimates)
        log.debug(
            "to prefill %s, decode %s (%d bytes; estimates %s)", self._prefills[pair[0]][0],
            self._decodes[pair[1]], nbytes, {f"{p},{d}": e for (p, d), e in estimates.items()},
        )  # fmt: skip
        return pair, nbytes

    async def costs(self, request: web.Request) -> web.Response:
        """Each decode instance's metrics endpoints and their last readings."""
        now = time.monotonic()
        return web.json_response(
            {
                url: [s.describe(now) for s in ranks]
                for url, ranks in zip(self._decodes, self._scrapers, strict=True)
            }
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        session = self._session
        assert session is not None
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return web.json_response({"error": "the request body is not JSON"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": "the request body is not a JSON object"}, status=400)
        (p, d), nbytes = self.route(body)
        (prefill_url, bootstrap), decode_url = self._prefills[p], self._decodes[d]
        key = next(self._keys)
        self._sent[key] = _Sent((p, d), nbytes, time.monotonic())
        transfer_id = uuid.uuid4().hex
        headers = forwarded(request.headers)
        path = request.path
        relayed = False
        decode = asyncio.ensure_future(
            session.post(decode_url + path, json=decode_body(body, transfer_id, bootstrap), headers=headers)
        )
        try:
            async with session.post(
                prefill_url + path, json=prefill_body(body, transfer_id), headers=headers
            ) as prefill:
                prefill_payload = await prefill.read()
                if prefill.status != 200:  # the client hears the prefill's error; the decode leg ends
                    log.warning(
                        "prefill %s answered %d: %s", prefill_url, prefill.status, prefill_payload[:200]
                    )
                    return web.Response(
                        status=prefill.status, body=prefill_payload, content_type=prefill.content_type
                    )
            async with await decode as upstream:
                response, relayed = await self._relay(request, upstream)
                return response
        except asyncio.CancelledError:
            log.info("client of %s went away; both legs cancelled", path)
            raise
        except aiohttp.ClientError as exc:
            log.warning("upstream failed for %s: %s", path, exc)
            return web.json_response({"error": f"upstream failed: {exc}"}, status=502)
        finally:  # a decode leg not relayed to its end is closed: vLLM aborts it
            del self._sent[key]
            if not decode.done():
                decode.cancel()
            elif not relayed and not decode.cancelled() and decode.exception() is None:
                decode.result().close()

    async def _relay(
        self, request: web.Request, upstream: aiohttp.ClientResponse
    ) -> tuple[web.StreamResponse, bool]:
        """Stream the decode's answer to the client: (the response, whether all of it went). A
        client gone mid-way ends it quietly."""
        response = web.StreamResponse(status=upstream.status)
        response.content_type = upstream.content_type
        try:
            await response.prepare(request)
            async for data in upstream.content.iter_any():
                await response.write(data)
            await response.write_eof()
        except ConnectionError:
            log.info("client of %s went away mid-answer; decode leg closed", request.path)
            return response, False
        return response, True

    async def healthz(self, request: web.Request) -> web.Response:
        """200 while every server answers ``/health`` with 200, else 503 naming the others."""
        assert self._session is not None
        session = self._session

        async def ok(url: str) -> bool:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with session.get(
                    url + "/health", timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
                ) as r:
                    return r.status == 200
            return False

        answers = await asyncio.gather(*(ok(url) for url in self._servers))
        down = [url for url, up in zip(self._servers, answers, strict=True) if not up]
        return web.json_response({"ok": not down, "down": down}, status=503 if down else 200)


def make_app(
    prefill: list[tuple[str, str]], decode: list[str], costs: CostSettings | None = None
) -> web.Application:
    router = Router(prefill, decode, costs)
    app = web.Application()
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.close)
    app.router.add_post("/v1/completions", router.completions)
    app.router.add_post("/v1/chat/completions", router.completions)
    app.router.add_get("/healthz", router.healthz)
    app.router.add_get("/costs", router.costs)
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host", default="127.0.0.1", help="where the router listens (default loopback)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--prefill", nargs=2, action="append", metavar=("URL", "BOOTSTRAP"), required=True,
        help="a prefill instance's HTTP URL and its connector's bootstrap endpoint (repeatable)",
    )  # fmt: skip
    parser.add_argument("--decode", action="append", metavar="URL", required=True, help="repeatable")
    parser.add_argument(
        "--decode-metrics", nargs=2, action="append", default=[], metavar=("URL", "METRICS_URL"),
        help="a decode instance's engine metrics (http://HOST:METRICS_PORT/metrics), once per TP rank: "
        "route by the transfer cost (needs --kv-bytes-per-token)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-bytes-per-token", type=int, metavar="BYTES",
        help="KV bytes one prompt token takes on a decode instance, all its TP ranks together "
        "(e.g. 2 x layers x KV heads x head size x dtype bytes)",
    )  # fmt: skip
    parser.add_argument(
        "--cost-interval", type=float, default=COST_INTERVAL_S, metavar="SECONDS",
        help=f"seconds between two readings of each metrics endpoint (default {COST_INTERVAL_S})",
    )  # fmt: skip
    args = parser.parse_args(argv)
    costs = None
    if args.decode_metrics:
        if args.kv_bytes_per_token is None:
            parser.error("--decode-metrics needs --kv-bytes-per-token")
        metrics: dict[str, list[str]] = {}
        for url, endpoint in args.decode_metrics:
            metrics.setdefault(url, []).append(endpoint)
        costs = CostSettings(metrics, args.kv_bytes_per_token, args.cost_interval)
        try:
            costs.check(args.decode)
        except ConfigError as exc:
            parser.error(str(exc))
    logging.basicConfig(level=logging.INFO)
    app = make_app([(u, b) for u, b in args.prefill], args.decode, costs)
    prefill = ", ".join(f"{url} ({bootstrap})" for url, bootstrap in args.prefill)

    def listening(_: str) -> None:  # aiohttp calls it once the socket is bound
        host = f"[{args.host}]" if ":" in args.host else args.host
        log.info(
            "router listening on http://%s:%d; prefill %s; decode %s%s",
            host, args.port, prefill, ", ".join(args.decode),
            "; routing by transfer cost" if costs is not None else "",
        )  # fmt: skip

    web.run_app(app, host=args.host, port=args.port, print=listening, handler_cancellation=True)


if __name__ == "__main__":
    main()
