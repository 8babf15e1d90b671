"""A minimal disaggregated-serving router for vLLM instances running :mod:`.connector`.

    python -m transfer_engine.integrations.vllm.proxy --port 8000 \\
        --prefill http://127.0.0.1:8100 tcp://127.0.0.1:8998 \\
        --decode http://127.0.0.1:8200

For each ``POST /v1/completions`` (or ``/v1/chat/completions``) it picks a prefill and a decode
instance (round robin), makes a transfer ID, and sends the request to both at once: to the prefill
with ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true, "transfer_id": ID}``, to
the decode unchanged but for ``kv_transfer_params={"do_remote_prefill": true, "transfer_id": ID,
"bootstrap": PREFILL_BOOTSTRAP}``. The decode allocates the blocks and waits; the prefill computes
the prompt and WRITEs its KV into them (push). The client gets the decode's answer. When the client
goes away, both upstream requests are cancelled, so vLLM aborts them and the connector frees their
blocks on both sides. Streaming responses are passed through as they come.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import uuid
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger(__name__)


class Router:
    """Round-robin over prefill ``(url, bootstrap)`` pairs and decode urls."""

    def __init__(self, prefill: list[tuple[str, str]], decode: list[str]) -> None:
        if not prefill or not decode:
            raise ValueError("need at least one --prefill and one --decode instance")
        self._prefill = itertools.cycle(prefill)
        self._decode = itertools.cycle(decode)
        self._session: aiohttp.ClientSession | None = None

    async def start(self, app: web.Application) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    async def close(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        body: dict[str, Any] = await request.json()
        (prefill_url, bootstrap), decode_url = next(self._prefill), next(self._decode)
        transfer_id = f"{uuid.uuid4().hex}"
        prefill_body = dict(body, max_tokens=1, stream=False)
        prefill_body.pop("max_completion_tokens", None)
        prefill_body.pop("stream_options", None)
        prefill_body["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": transfer_id}
        decode_body = dict(body)
        decode_body["kv_transfer_params"] = {
            "do_remote_prefill": True,
            "transfer_id": transfer_id,
            "bootstrap": bootstrap,
        }
        path = request.path
        prefill = asyncio.ensure_future(self._post(prefill_url + path, prefill_body))
        try:
            async with self._session.post(decode_url + path, json=decode_body) as upstream:
                response = web.StreamResponse(status=upstream.status)
                response.content_type = upstream.content_type
                await response.prepare(request)
                async for data in upstream.content.iter_any():
                    await response.write(data)
                await response.write_eof()
            await prefill
            return response
        finally:  # the client went away (or the decode failed): stop the prefill request too
            if not prefill.done():
                prefill.cancel()

    async def _post(self, url: str, body: dict[str, Any]) -> None:
        assert self._session is not None
        async with self._session.post(url, json=body) as upstream:
            text = await upstream.text()
            if upstream.status != 200:
                log.warning("prefill %s answered %d: %s", url, upstream.status, text[:200])


async def _healthz(request: web.Request) -> web.Response:
    return web.Response(text=json.dumps({"ok": True}))


def make_app(prefill: list[tuple[str, str]], decode: list[str]) -> web.Application:
    router = Router(prefill, decode)
    app = web.Application()
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.close)
    app.router.add_post("/v1/completions", router.completions)
    app.router.add_post("/v1/chat/completions", router.completions)
    app.router.add_get("/healthz", _healthz)
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host", default="127.0.0.1")
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
