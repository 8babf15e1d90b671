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

vLLM's standard sequential protocol needs no router of ours: see docs/vllm.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import uuid
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp import web

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


class Router:
    """Round-robin over prefill ``(url, bootstrap)`` pairs and decode urls."""

    def __init__(self, prefill: list[tuple[str, str]], decode: list[str]) -> None:
        if not prefill or not decode:
            raise ValueError("need at least one --prefill and one --decode instance")
        self._servers = [url for url, _ in prefill] + list(decode)
        self._prefill = itertools.cycle(prefill)
        self._decode = itertools.cycle(decode)
        self._session: aiohttp.ClientSession | None = None

    async def start(self, app: web.Application) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    async def close(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        session = self._session
        assert session is not None
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return web.json_response({"error": "the request body is not JSON"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": "the request body is not a JSON object"}, status=400)
        (prefill_url, bootstrap), decode_url = next(self._prefill), next(self._decode)
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


def make_app(prefill: list[tuple[str, str]], decode: list[str]) -> web.Application:
    router = Router(prefill, decode)
    app = web.Application()
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.close)
    app.router.add_post("/v1/completions", router.completions)
    app.router.add_post("/v1/chat/completions", router.completions)
    app.router.add_get("/healthz", router.healthz)
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
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    app = make_app([(u, b) for u, b in args.prefill], args.decode)
    web.run_app(app, host=args.host, port=args.port, print=None, handler_cancellation=True)


if __name__ == "__main__":
    main()
