"""vLLM's standard (sequential) P/D router protocol, for the tests and tools/bench_vllm.py.

Written from the protocol's description (docs/vllm.md, "Routers"), knowing nothing of our connector:
the prefill gets the client's request with ``max_tokens=1`` (and ``max_completion_tokens=1``),
without ``min_tokens`` or streaming, and ``kv_transfer_params={"do_remote_decode": true}``; once it
answered, the decode gets the client's request with the ``kv_transfer_params`` of the prefill's
answer (none if it carried none), and its answer goes to the client. Prefill and decode instances
are taken round robin. Headers go along (``Authorization``). A prefill error is the client's answer.

    python -m tests.vllm.standard_router --port 8001 --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200
"""

from __future__ import annotations

import argparse
import itertools
import logging
from typing import Any

import aiohttp
from aiohttp import web

SKIPPED_HEADERS = frozenset({"host", "content-length", "content-type", "transfer-encoding", "connection"})


def make_app(prefill: list[str], decode: list[str]) -> web.Application:
    prefills, decodes = itertools.cycle(prefill), itertools.cycle(decode)
    session: dict[str, aiohttp.ClientSession] = {}

    async def start(app: web.Application) -> None:
        session["s"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    async def close(app: web.Application) -> None:
        await session["s"].close()

    async def completions(request: web.Request) -> web.StreamResponse:
        body: dict[str, Any] = await request.json()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in SKIPPED_HEADERS}
        first = {k: v for k, v in body.items() if k not in ("min_tokens", "stream_options")}
        first.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        if "max_completion_tokens" in body:
            first["max_completion_tokens"] = 1
        async with session["s"].post(next(prefills) + request.path, json=first, headers=headers) as answer:
            if answer.status != 200:
                return web.Response(
                    status=answer.status, body=await answer.read(), content_type=answer.content_type
                )
            params = (await answer.json()).get("kv_transfer_params")
        second = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        if params:
            second["kv_transfer_params"] = params
        async with session["s"].post(next(decodes) + request.path, json=second, headers=headers) as answer:
            response = web.StreamResponse(status=answer.status)
            response.content_type = answer.content_type
            await response.prepare(request)
            async for data in answer.content.iter_any():
                await response.write(data)
            await response.write_eof()
            return response

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.on_startup.append(start)
    app.on_cleanup.append(close)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/healthz", health)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", action="append", required=True)
    parser.add_argument("--decode", action="append", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    web.run_app(make_app(args.prefill, args.decode), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
