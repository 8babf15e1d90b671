"""Layer-wise sending against chunk-level sending: the transfer tail and the forward time, one run.

    python tools/bench_layerwise.py --device cuda [--path direct|host|staged|slice]
                                    [--tokens 1024,4096,16384] [--per-write 1,2,4,8] [--reps 5]
    python tools/bench_layerwise.py --tiny      # CPU, tiny sizes: checks that it runs

Two processes (prefill, decode; with ``--device cuda`` GPU 0 and GPU 1), each a blocking-facade engine
(``transfer_engine.facade``) as a threaded scheduler would use it, on a Qwen3-32B-shaped KV layout by
default (64 layers, 8 KV heads, head_dim 128, bf16, pages of 16 tokens). Per room the prefill runs a
simulated forward on its own thread: per layer one ``[tokens, hidden] @ [hidden, ffn]`` matmul (about
the FLOPs of a 32B model's layer at the defaults) on the prefill GPU, then

- ``chunk``: after the last layer, ``send(pages, last=True)``;
- ``layers xN``: ``begin_chunk(pages)`` before the forward, ``layers_ready(l, l + 1)`` after each layer
  (an event recorded on the forward's stream; ``layers_per_write`` = N groups them).

Measured per room (medians over ``--reps`` rooms, after one warm-up room per mode):

- ``tail``: the prefill's last layer finished (its stream synchronized, ``time.monotonic()``) to the
  decode's ``poll()`` saying Success (every byte landed), in the same clock (one host);
- ``forward``: the forward's wall time, start to last layer finished (layer-wise sending must not
  slow it: compare with ``chunk``, which sends nothing during it);
- ``group``: one group's own transfer, estimated as room bytes / the chunk-level room's transfer rate
  times N / L (the issue's goal: ``tail <= group + 0.3 ms``).

KV contents are not checked here (the tests check every byte: tests/integration/test_matrix.py).
The serving example's TTFT with and without ``--layerwise`` is ``tools/serving_gpu.py`` run twice,
the second time with ``--layerwise`` passed through (see docs/PERF.md).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from transfer_engine.config import EngineConfig
from transfer_engine.facade import BlockingEngine
from transfer_engine.layout import KVLayout, KVPool
from transfer_engine.protocol.rooms import RoomStatus
from transfer_engine.testing import free_port


def _layout(args: argparse.Namespace) -> KVLayout:
    return KVLayout(args.layers, args.kv_heads, args.head_dim, torch.bfloat16, args.page_size)


def _pool(args: argparse.Namespace, device: torch.device) -> KVPool:
    pages = -(-max(args.tokens) // args.page_size)
    return KVPool.allocate(_layout(args), 1, 0, pages, device=device, aux_slots=1, aux_item_bytes=8)


def _config(args: argparse.Namespace, role: str, port: int, per_write: int = 4) -> EngineConfig:
    return EngineConfig(
        role=role, bootstrap_port=port, path=args.path, layers_per_write=per_write,  # type: ignore[arg-type]
        staging_chunk_pages=-(-max(args.tokens) // args.page_size), transfer_timeout=120.0,
    )  # fmt: skip


def _wait(handle: Any, want: RoomStatus, limit_s: float = 120.0) -> float:
    """Spin on ``poll()`` until ``want``; the time it was first seen. RuntimeError on failure."""
    deadline = time.monotonic() + limit_s
    while True:
        status = handle.poll()
        if status is want:
            return time.monotonic()
        if status is RoomStatus.FAILED or time.monotonic() > deadline:
            raise RuntimeError(f"room {handle.room}: {status.name} {handle.failure}")


def decode_main(args: argparse.Namespace, port: int, pipe: Connection) -> None:
    device = (
        torch.device("cuda", 1 % torch.cuda.device_count()) if args.device == "cuda" else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    pool = _pool(args, device)
    with BlockingEngine(_config(args, "decode", port), pool) as engine:
        while True:
            job = pipe.recv()
            if job is None:
                return
            room, tokens = job
            pages = np.arange(-(-tokens // args.page_size))
            receiver = engine.receiver(room, bootstrap=f"tcp://127.0.0.1:{port}")
            _wait(receiver, RoomStatus.WAITING_FOR_INPUT)
            receiver.request(pages)
            pipe.send("asked")
            pipe.send(_wait(receiver, RoomStatus.SUCCESS))


def _forward(x: torch.Tensor, w: torch.Tensor, layers: int, on_layer: Any) -> float:
    """Run ``layers`` matmuls, calling ``on_layer(l)`` after each is enqueued; the time the last finished."""
    for layer in range(layers):
        torch.matmul(x, w)
        on_layer(layer)
    if x.is_cuda:
        torch.cuda.current_stream(x.device).synchronize()
    return time.monotonic()


def prefill_main(args: argparse.Namespace, port: int, pipe: Connection, out: Connection) -> None:
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    pool = _pool(args, device)
    weight = torch.randn(
        args.hidden, args.ffn, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32
    )
    modes = [("chunk", 0)] + [("layers", n) for n in args.per_write]
    rows = []
    room = 1
    with BlockingEngine(_config(args, "prefill", port), pool) as engine:
        for tokens in args.tokens:
            x = torch.randn(tokens, args.hidden, device=device, dtype=weight.dtype)
            pages = np.arange(-(-tokens // args.page_size))
            for mode, per_write in modes:
                tails, forwards = [], []
                for rep in range(args.reps + 1):
                    sender = engine.sender(room, layers_per_write=max(per_write, 1))
                    pipe.send((room, tokens))
                    assert pipe.recv() == "asked"
                    _wait(sender, RoomStatus.WAITING_FOR_INPUT)
                    start = time.monotonic()
                    if mode == "chunk":
                        done = _forward(x, weight, args.layers, lambda layer: None)
                        sender.send(pages, last=True)
                    else:
                        sender.begin_chunk(pages, last=True)
                        done = _forward(
                            x, weight, args.layers, lambda layer, s=sender: s.layers_ready(layer, layer + 1)
                        )
                    landed = pipe.recv()
                    _wait(sender, RoomStatus.SUCCESS)
                    room += 1
                    if rep:  # the first room of each mode warms it up
                        tails.append((landed - done) * 1e3)
                        forwards.append((done - start) * 1e3)
                rows.append((tokens, mode, per_write, statistics.median(tails), statistics.median(forwards)))
        pipe.send(None)
    out.send(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--path", default="auto", help="engine path (direct, host, staged, slice; auto: direct)"
    )
    parser.add_argument("--tokens", default="1024,4096,16384", help="room sizes in tokens, comma-separated")
    parser.add_argument("--per-write", default="1,2,4,8", help="layers_per_write values, comma-separated")
    parser.add_argument("--reps", type=int, default=5, help="rooms per (size, mode), after one warm-up")
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument(
        "--hidden", type=int, default=5120, help="simulated layer: [tokens, hidden] @ [hidden, ffn]"
    )
    parser.add_argument(
        "--ffn", type=int, default=97280, help="(5120 x 97280 bf16: about a Qwen3-32B layer's weights)"
    )
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny sizes (checks that the script runs)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.device, args.reps, args.layers, args.kv_heads, args.head_dim = "cpu", 2, 4, 2, 16
        args.hidden, args.ffn, args.tokens, args.per_write = 64, 128, "64,256", "1,2"
    args.tokens = [int(t) for t in str(args.tokens).split(",")]
    args.per_write = [int(n) for n in str(args.per_write).split(",")]
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        print("note: one GPU: prefill and decode share it", file=sys.stderr)
    ctx = mp.get_context("spawn")
    port = free_port()
    to_decode, decode_end = ctx.Pipe()
    results, results_end = ctx.Pipe(duplex=False)
    decode = ctx.Process(target=decode_main, args=(args, port, decode_end))
    prefill = ctx.Process(target=prefill_main, args=(args, port, to_decode, results_end))
    prefill.start()
    decode.start()
    rows = results.recv()
    prefill.join(60)
    decode.join(60)
    layout = _layout(args)
    per_token = 2 * layout.num_layers * layout.num_heads * layout.head_dim * 2
    print(
        f"layer-wise vs chunk-level: {args.device}, path={args.path}, {args.layers} layers x {args.kv_heads} "
        f"KV heads x {args.head_dim}, bf16, {args.reps} rooms each (medians)"
    )
    print(
        f"{'tokens':>7} {'MB':>8} {'mode':>10} {'tail ms':>9} {'group ms':>9} {'forward ms':>11} {'fwd vs chunk':>12}"
    )
    chunk_rate: dict[int, tuple[float, float]] = {}
    for tokens, mode, per_write, tail, forward in rows:
        mb = tokens * per_token / 1e6
        if mode == "chunk":
            chunk_rate[tokens] = (tail, forward)
            group, label, ratio = "", "chunk", ""
        else:
            whole, base_forward = chunk_rate[tokens]
            group = f"{whole * min(per_write, args.layers) / args.layers:9.3f}"
            label, ratio = f"layers x{per_write}", f"{forward / base_forward:12.3f}"
        print(f"{tokens:7d} {mb:8.1f} {label:>10} {tail:9.3f} {group:>9} {forward:11.3f} {ratio:>12}")
    return 0 if prefill.exitcode == 0 and decode.exitcode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
