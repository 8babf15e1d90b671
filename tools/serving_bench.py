"""Measure the serving example (docs/PERF.md, "Serving loop"): TTFT split, event-loop lag, decode tokens/s.

    .venv/bin/python tools/serving_bench.py                      # CPU, the tiny model
    .venv/bin/python tools/serving_bench.py --device cuda \\
        --model-hidden 2048 --model-layers 16 --model-heads 16 --model-kv-heads 8 --model-head-dim 128 \\
        --model-ffn 5632 --long 4096 --chunk-tokens 512 --max-batch-tokens 1024   # GPU (NCCL, CUDA pools)

With ``--device cuda`` the prefill ranks take GPUs 0..P-1 and the decode ranks the next D (modulo the
GPUs there are); the model's all-reduces go over NCCL, the serving loop's control over gloo, and the
KV pools and aux items live on the GPUs.

Phases, all through the HTTP front door of one :class:`examples.serving.run.Cluster`:

1. TTFT split, one request at a time (no queueing behind other requests), ``--samples`` short
   (``--short`` tokens) then long (``--long``) prompts: TTFT and its parts, queue -> prefill
   compute -> transfer tail (the prefill's last kernel done -> every decode rank has every byte)
   -> first decode step; p50 and p99 of each. With ``--layerwise-ab`` each prompt is sent twice
   back to back, chunk-level then layer-wise (the request's own ``"layerwise"``), and the phase
   prints both modes and the per-pair difference, so slow drifts of the machine cancel.
2. Event-loop lag of the decode leader (a 1 ms ticker in its serving loop: how late each tick
   wakes) and decode tokens/s, in windows of ``--window`` s: ``idle`` (nothing to do), ``transfers
   only`` (long prompts with max_new_tokens=1 landing, no decode batch), ``decode alone``
   (``--batch`` closed-loop clients, each sending one ``--decode-tokens`` request after another, so
   the batch and its contexts stay in a steady range), ``decode + transfers`` (the same while long
   prompts land). The two alternate for ``--rounds`` rounds.

``--page-table`` orders every server's free pages at start (``transfer_engine.testing.pagetables.
free_order``: ``contiguous``, ``scattered`` — a fixed permutation —, or ``realistic`` — the free list
an allocator leaves after a stream of mixed requests); the servers' own FIFO allocators then hand
them out. Prints one line per measurement, each naming the page-table shape; ``--json-out`` writes
them all.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.common import percentile  # noqa: E402
from examples.serving import client  # noqa: E402
from examples.serving.run import MODEL_SHAPE, Cluster, ClusterSpec, add_model_arguments, model_from  # noqa: E402


def engine_options(pairs: list[str]) -> list[tuple[str, Any]]:
    """``--engine poll_interval=0.001`` -> EngineConfig fields for every rank (numbers parsed)."""
    out: list[tuple[str, Any]] = []
    for pair in pairs:
        key, _, text = pair.partition("=")
        value: Any = text
        for kind in (int, float):
            try:
                value = kind(text)
                break
            except ValueError:
                continue
        out.append((key.strip(), value))
    return out


def pct(values: list[float]) -> str:
    return f"p50 {percentile(values, 50):7.2f} p99 {percentile(values, 99):7.2f}"


async def ttft_phase(cluster: Cluster, args: argparse.Namespace, vocab: int, out: dict[str, Any]) -> None:
    for label, length in (("short", args.short), ("long", args.long)):
        items = client.make_workload(args.samples, 0.0, [length], 4, 0, vocab, seed=length)
        if args.layerwise_ab:  # the same prompt twice in a row, chunk-level then layer by layer
            items = [dataclasses.replace(it, layerwise=lw) for it in items for lw in (False, True)]
        results = []
        async with client_session() as session:
            for it in items:
                results.append(await client.generate(session, cluster.url, it))
        bad = [r.error for r in results if not r.ok]
        if bad:
            raise SystemExit(f"{label} prompts: {len(bad)} requests failed: {bad[:3]}")
        if args.layerwise_ab:
            ab_report(label, length, results, out)
            continue
        split = {
            k: [r.final["split_ms"][k] for r in results]
            for k in ("queue", "prefill", "transfer_tail", "first_step")
        }
        ttft = [r.final["ttft_ms"] for r in results]
        out[f"ttft_{label}"] = {
            "prompt_tokens": length,
            "ttft_ms": ttft,
            **{f"{k}_ms": v for k, v in split.items()},
        }
        print(
            f"TTFT {label:5} ({length:5} tokens, ms, page_table={args.page_table}): total {pct(ttft)}",
            flush=True,
        )
        for k, v in split.items():
            print(f"    {k:14} {pct(v)}", flush=True)


def ab_report(label: str, length: int, results: list[Any], out: dict[str, Any]) -> None:
    """``--layerwise-ab``: TTFT and its split per mode, and the per-pair differences (layer-wise minus
    chunk-level, each pair the same prompt back to back). The first pair warms up and is left out."""
    pairs = [(results[i], results[i + 1]) for i in range(2, len(results) - 1, 2)]
    keys = ("ttft", "prefill", "transfer_tail", "first_step")

    def value(r: Any, k: str) -> float:
        return float(r.final["ttft_ms"] if k == "ttft" else r.final["split_ms"][k])

    got: dict[str, Any] = {"prompt_tokens": length, "pairs": len(pairs)}
    for k in keys:
        chunk = [value(a, k) for a, _ in pairs]
        layer = [value(b, k) for _, b in pairs]
        diff = [y - x for x, y in zip(chunk, layer, strict=True)]
        got[k] = {"chunk_ms": chunk, "layerwise_ms": layer, "diff_ms": diff}
        print(
            f"TTFT A/B {label:5} ({length:5} tokens) {k:13} ms: chunk p50 {percentile(chunk, 50):7.2f}, "
            f"layer-wise p50 {percentile(layer, 50):7.2f}, difference per pair p50 {percentile(diff, 50):+7.2f} "
            f"(min {min(diff):+.2f}, max {max(diff):+.2f}; {len(diff)} pairs; page_table={out['page_table']})",
            flush=True,
        )
    out[f"ttft_ab_{label}"] = got


def client_session() -> Any:
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True))


async def window(cluster: Cluster, seconds: float) -> dict[str, Any]:
    await cluster.stats(reset=True)
    await anyio.sleep(seconds)
    stats = await cluster.stats()
    d, p = stats["decode"][0], stats["prefill"]
    return {
        "decode_lag_ms": d["lag_ms"],
        "prefill_lag_ms": p["lag_ms"],
        "decode_tokens": d["decode_tokens"],
        "decode_steps": d["decode_steps"],
        "decode_step_s": d["decode_step_s"],
        "window_s": d["window_s"],
    }


async def transfer_stream(cluster: Cluster, args: argparse.Namespace, vocab: int, stop: anyio.Event) -> int:
    """Long prompts with max_new_tokens=1, one after another (``--stream`` at a time), until ``stop``."""
    sent = 0
    items = client.make_workload(64, 0.0, [args.long], 1, 0, vocab, seed=99)

    async def lane(session: Any, k: int) -> None:
        nonlocal sent
        i = k
        while not stop.is_set():
            r = await client.generate(session, cluster.url, items[i % len(items)])
            if not r.ok:
                raise SystemExit(f"transfer stream request failed: {r.error}")
            sent += 1
            i += args.stream

    async with client_session() as session, anyio.create_task_group() as tg:
        for k in range(args.stream):
            tg.start_soon(lane, session, k)
    return sent


def report(label: str, w: dict[str, Any], out: dict[str, Any], transfers: int = 0) -> None:
    tps = w["decode_tokens"] / w["window_s"] if w["window_s"] else 0.0
    steps = w["decode_steps"]
    batch = w["decode_tokens"] / steps if steps else 0.0
    step_ms = 1e3 * w["decode_step_s"] / steps if steps else 0.0
    out[label] = {**w, "decode_tokens_per_s": tps, "batch": batch, "step_ms": step_ms, "transfers": transfers}
    print(
        f"{label:22} decode loop lag ms {pct(w['decode_lag_ms'])} | prefill loop lag ms {pct(w['prefill_lag_ms'])} "
        f"| decode {tps:7.1f} tok/s, batch {batch:4.1f}, step {step_ms:5.2f} ms | {transfers} transfers landed "
        f"| page_table={out['page_table']}",
        flush=True,
    )


async def lag_phase(cluster: Cluster, args: argparse.Namespace, vocab: int, out: dict[str, Any]) -> None:
    report("idle", await window(cluster, args.window), out)

    async def with_transfers(label: str) -> None:
        stop = anyio.Event()
        result: list[int] = []

        async def stream() -> None:
            result.append(await transfer_stream(cluster, args, vocab, stop))

        async with anyio.create_task_group() as tg:
            tg.start_soon(stream)
            await anyio.sleep(0.5)  # let the stream reach steady state
            w = await window(cluster, args.window)
            stop.set()
        report(label, w, out, result[0] if result else 0)

    await with_transfers("transfers only")
    stop_lanes = anyio.Event()

    async def lane(session: Any, k: int) -> None:
        """A closed-loop client: one generating request after another, so contexts stay in a steady range."""
        items = client.make_workload(16, 0.0, [args.short], args.decode_tokens, 0, vocab, seed=100 + k)
        i = 0
        while not stop_lanes.is_set():
            await client.generate(session, cluster.url, items[i % len(items)])
            i += 1

    async with client_session() as session, anyio.create_task_group() as tg:
        for k in range(args.batch):
            tg.start_soon(lane, session, k)
        await anyio.sleep(args.window)  # warm-up: every lane generating, contexts spread out
        for rnd in range(1, args.rounds + 1):
            report(f"decode alone #{rnd}", await window(cluster, args.window), out)
            await with_transfers(f"decode + transfers #{rnd}")
        stop_lanes.set()
        tg.cancel_scope.cancel()  # closes the lanes' connections: the front door cancels them
    alone = [v["decode_tokens_per_s"] for k, v in out.items() if k.startswith("decode alone")]
    loaded = [v["decode_tokens_per_s"] for k, v in out.items() if k.startswith("decode + transfers")]
    out["decode_tokens_per_s"] = {"alone": alone, "with_transfers": loaded}
    per_token = {
        name: [v["step_ms"] / v["batch"] for k, v in out.items() if k.startswith(prefix) and v.get("batch")]
        for name, prefix in (("alone", "decode alone"), ("loaded", "decode + transfers"))
    }
    print(
        f"decode tok/s: alone mean {sum(alone) / len(alone):.1f}, with transfers landing mean "
        f"{sum(loaded) / len(loaded):.1f} ({sum(loaded) / sum(alone):.2f}x); step ms per running request: "
        f"alone {sum(per_token['alone']) / max(len(per_token['alone']), 1):.3f}, "
        f"with transfers {sum(per_token['loaded']) / max(len(per_token['loaded']), 1):.3f}; "
        f"page_table={out['page_table']}",
        flush=True,
    )


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    model = model_from(args, MODEL_SHAPE)
    spec = ClusterSpec(
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        model=model,
        page_size=args.page_size,
        chunk_tokens=args.chunk_tokens,
        max_batch_tokens=args.max_batch_tokens,
        max_requests=args.batch + args.stream + 4,
        max_tokens=max(args.long + 4, args.short + args.decode_tokens),
        device=args.device,
        torch_threads=args.torch_threads,
        pin=args.pin if args.pin is not None else args.device == "cpu",
        engine=dict(engine_options(args.engine)),
        layerwise=args.layerwise,
        page_table=args.page_table,
    )
    out: dict[str, Any] = {"spec": {k: str(v) for k, v in vars(args).items()}, "page_table": args.page_table}
    async with Cluster(spec) as cluster:
        print(
            f"serving bench: {args.device}, P={args.prefill_tp} D={args.decode_tp}, model {model}, "
            f"page {args.page_size}, chunk {args.chunk_tokens}, page_table={args.page_table}",
            flush=True,
        )
        started = time.monotonic()
        if "ttft" in args.phases:
            await ttft_phase(cluster, args, model.vocab, out)
        if "lag" in args.phases:
            await lag_phase(cluster, args, model.vocab, out)
        out["seconds"] = time.monotonic() - started
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--prefill-tp", type=int, default=1)
    parser.add_argument("--decode-tp", type=int, default=1)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument(
        "--page-table",
        default="contiguous",
        choices=["contiguous", "scattered", "realistic"],
        help="the order of every server's free pages at start (transfer_engine.testing.pagetables)",
    )
    parser.add_argument("--chunk-tokens", type=int, default=128)
    parser.add_argument("--max-batch-tokens", type=int, default=384)
    parser.add_argument("--short", type=int, default=16, help="short prompt tokens (default 16)")
    parser.add_argument("--long", type=int, default=1024, help="long prompt tokens (default 1024)")
    parser.add_argument("--samples", type=int, default=20, help="requests per TTFT phase (default 20)")
    parser.add_argument("--batch", type=int, default=8, help="decode batch of the lag phase (default 8)")
    parser.add_argument(
        "--decode-tokens", type=int, default=200, help="tokens each batch request asks for (default 200)"
    )
    parser.add_argument(
        "--stream", type=int, default=2, help="long transfer-only requests in flight (default 2)"
    )
    parser.add_argument("--window", type=float, default=2.0, help="seconds per lag window (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="decode alone / + transfers rounds (default 3)")
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument(
        "--layerwise",
        action="store_true",
        help="the prefill sends each request's last chunk layer by layer from its forward",
    )
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pin prefill ranks to the first half of the CPUs, decode ranks to the second (default: on for cpu)",
    )
    parser.add_argument(
        "--layerwise-ab",
        action="store_true",
        help="TTFT phase: each prompt twice, chunk-level then layer-wise (per request), paired",
    )
    parser.add_argument("--phases", default="ttft,lag", help="which phases to run (default ttft,lag)")
    parser.add_argument("--json-out", default="")
    parser.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="EngineConfig field for every rank",
    )
    add_model_arguments(parser, MODEL_SHAPE)  # the weights' seed is ModelConfig's
    args = parser.parse_args(argv)
    out = anyio.run(main_async, args)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
