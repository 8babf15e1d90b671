"""A client that replays a workload against the front door and summarises it in one line.

    python -m examples.serving.client --url http://127.0.0.1:PORT [--requests 24 --rate 8 ...]

Arrivals are a Poisson process of ``rate`` requests/s; prompt lengths are drawn uniformly from a
fixed list (``--prompt-lens``); token ids are uniform over the vocabulary; all from ``seed``. The
first ``cancel`` requests in a shuffled order are cancelled by closing the connection: half of them
after their first tokens arrived, half after a few milliseconds (usually before the first token,
while the prefill or the transfer runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import anyio

from examples.common import percentile


@dataclass(frozen=True)
class Item:
    index: int
    at: float
    """Seconds after the start of the replay."""
    prompt: list[int]
    max_new: int
    cancel_after_tokens: int | None = None
    cancel_after_s: float | None = None
    layerwise: bool | None = None
    """Ask the prefill to send the last chunk layer by layer (None: the server's default)."""


@dataclass
class Result:
    item: Item
    rid: int = 0
    """The front door's request id (0 until its first line arrived)."""
    tokens: list[int] = field(default_factory=list)
    ok: bool = False
    cancelled: bool = False
    error: str = ""
    final: dict[str, Any] = field(default_factory=dict)


def make_workload(
    requests: int,
    rate: float,
    prompt_lens: list[int],
    max_new: int,
    cancel: int,
    vocab: int,
    seed: int = 0,
) -> list[Item]:
    """The replayed requests, in arrival order (deterministic in ``seed``)."""
    rng = random.Random(f"workload:{seed}")
    cancelled = set(rng.sample(range(requests), min(cancel, requests)))
    items = []
    t = 0.0
    for i in range(requests):
        t += rng.expovariate(rate) if rate > 0 else 0.0
        n = rng.choice(prompt_lens)
        prompt = [rng.randrange(vocab) for _ in range(n)]
        by_tokens = by_time = None
        if i in cancelled:
            if len(cancelled & set(range(i))) % 2 == 0:
                by_tokens = 2
            else:
                by_time = 0.005
        items.append(Item(i, t, prompt, max_new, by_tokens, by_time))
    return items


async def generate(session: aiohttp.ClientSession, url: str, item: Item) -> Result:
    """One request: stream its tokens; cancel it (close the connection) where the item says."""
    result = Result(item)
    try:
        with anyio.move_on_after(item.cancel_after_s if item.cancel_after_s else math.inf) as scope:
            body: dict[str, Any] = {"prompt": item.prompt, "max_new_tokens": item.max_new}
            if item.layerwise is not None:
                body["layerwise"] = item.layerwise
            async with session.post(f"{url}/generate", json=body) as resp:
                if resp.status != 200:
                    result.error = f"HTTP {resp.status}: {await resp.text()}"
                    return result
                async for line in resp.content:
                    event = json.loads(line)
                    result.rid = event.get("rid", result.rid)
                    if "tokens" in event:
                        result.tokens += event["tokens"]
                        if (
                            item.cancel_after_tokens is not None
                            and len(result.tokens) >= item.cancel_after_tokens
                        ):
                            result.cancelled = True
                            resp.close()  # drop the connection: the front door cancels the request
                            return result
                    elif event.get("done"):
                        result.final = event
                        result.ok = bool(event.get("ok"))
                        result.error = event.get("error", "")
                        return result
        if scope.cancelled_caught:
            result.cancelled = True
        else:
            result.error = "stream ended without a final line"
    except aiohttp.ClientError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def replay(url: str, items: list[Item]) -> tuple[list[Result], float]:
    """Send every item at its arrival time; returns the results (in item order) and the wall time."""
    started = time.monotonic()

    async def one(session: aiohttp.ClientSession, item: Item) -> Result:
        await asyncio.sleep(max(0.0, started + item.at - time.monotonic()))
        return await generate(session, url, item)

    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        results = await asyncio.gather(*(one(session, it) for it in items))
    return list(results), time.monotonic() - started


def ms(values: list[float]) -> str:
    return f"p50 {percentile(values, 50):.1f} ms p99 {percentile(values, 99):.1f} ms" if values else "n/a"


def summary(results: list[Result], seconds: float, identical: tuple[int, int] | None = None) -> str:
    """The one summary line; ``identical`` is (matching, compared) against a reference, if run."""
    done = [r for r in results if r.ok]
    cancelled = sum(r.cancelled for r in results)
    failed = len(results) - len(done) - cancelled
    ttft = [r.final["ttft_ms"] for r in done if "ttft_ms" in r.final]
    transfer = [r.final["transfer_ms"] for r in done if "transfer_ms" in r.final]
    splits = [r.final["split_ms"] for r in done if "split_ms" in r.final]
    parts = []
    if splits:
        for key in ("queue", "prefill", "transfer_tail", "first_step"):
            parts.append(f"{key} {percentile([s[key] for s in splits], 50):.1f}")
    tokens = sum(len(r.tokens) for r in results)
    head = f"serving: {len(results)} requests"
    if identical is not None:
        head += f", tokens identical to the reference {identical[0]}/{identical[1]}"
    return (
        f"{head}, completed {len(done)}, cancelled {cancelled}, failed {failed}, TTFT {ms(ttft)}"
        + (f" (p50 split ms: {', '.join(parts)})" if parts else "")
        + f", transfer {ms(transfer)}, {tokens} tokens in {seconds:.2f} s"
    )


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--requests", type=int, default=24, help="requests to replay (default 24)")
    g.add_argument("--rate", type=float, default=8.0, help="Poisson arrival rate, requests/s (default 8)")
    g.add_argument(
        "--prompt-lens",
        default="12,40,100,200",
        help="prompt lengths drawn uniformly (default 12,40,100,200)",
    )
    g.add_argument("--max-new-tokens", type=int, default=12, help="tokens generated per request (default 12)")
    g.add_argument("--cancel", type=int, default=2, help="requests the client cancels mid-way (default 2)")
    g.add_argument("--seed", type=int, default=0, help="seed of the workload (default 0)")


def workload_from(args: argparse.Namespace, vocab: int) -> list[Item]:
    lens = [int(x) for x in str(args.prompt_lens).split(",") if x.strip()]
    if not lens or min(lens) < 1:
        raise SystemExit(f"--prompt-lens={args.prompt_lens!r} must list positive integers")
    if args.requests < 0 or args.max_new_tokens < 1 or args.cancel < 0 or args.rate < 0:
        raise SystemExit("--requests/--cancel/--rate must be >= 0 and --max-new-tokens >= 1")
    return make_workload(args.requests, args.rate, lens, args.max_new_tokens, args.cancel, vocab, args.seed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Replay a workload against the serving example's front door."
    )
    parser.add_argument("--url", required=True, help="the front door, e.g. http://127.0.0.1:8080")
    parser.add_argument("--vocab", type=int, default=512, help="vocabulary of the served model (default 512)")
    add_workload_arguments(parser)
    args = parser.parse_args(argv)
    results, seconds = asyncio.run(replay(args.url, workload_from(args, args.vocab)))
    print(summary(results, seconds), flush=True)
    return 0 if all(r.ok or r.cancelled for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
