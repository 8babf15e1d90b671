"""The vLLM connector core's tail on GPUs: from the last layer's kernels ending on the prefill to the
decode's blocks being reported loaded (``get_finished`` would return the request), layer-wise.

Two processes (``tests/gpu/twoproc.py``): the prefill ranks here on ``cuda:0``, the decode ranks in a
spawned process on ``cuda:1`` (``cuda:0`` when one GPU is visible: the line says which). The KV
caches are laid out as vLLM 0.32 allocates them (``tests/gpu/vllm_kv.py``; FlashAttention's layout
``LBNHC`` by default). Each repetition is one request: the decode asks for it, then the prefill runs
a forward as vLLM's model runner drives the connector: per layer a compute kernel (``--compute-us``
per 1K tokens, ``torch.cuda._sleep``), the layer's cache update, then ``save_kv_layer``
(``layer_written``), all on one non-default stream; ``wait_for_save`` (``step_written``). The tail
is the decode's report time minus the time the host saw the last cache update end (an event
recorded after it, synchronized by spinning); both are ``time.monotonic_ns()``, one clock for
every process of the host. The first repetition's bytes are checked, every byte.

    python tools/bench_vllm_core.py --tokens 1024,16384 --reps 10
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.gpu.twoproc import DecodeProcess, devices  # noqa: E402
from tests.gpu.vllm_kv import Request, Side, allocate, layer_writes, make_core, wait_reported  # noqa: E402
from transfer_engine.testing.cluster import free_port  # noqa: E402


def cycles_per_us() -> float:
    """The GPU's ``torch.cuda._sleep`` cycles per microsecond, measured."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(10_000_000)
    start.record()
    torch.cuda._sleep(100_000_000)
    end.record()
    end.synchronize()
    return 100_000_000 / (start.elapsed_time(end) * 1000)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1024,16384")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--heads", type=int, default=8, help="KV heads (TP 1)")
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layout", default="LBNHC", help="vLLM KVCacheLayout name (LBNHC: FlashAttention's)")
    ap.add_argument("--layers-per-write", type=int, default=4)
    ap.add_argument("--compute-us", type=float, default=100.0, help="a layer's compute per 1K tokens, us")
    ap.add_argument(
        "--integrity", choices=("on", "off"), default="on", help="EngineConfig.integrity on both sides"
    )
    args = ap.parse_args()
    sizes = [int(t) for t in args.tokens.split(",")]
    blocks = -(-max(sizes) // args.block_size) + 1
    side = Side(
        layout=args.layout,
        num_layers=args.layers,
        num_heads=args.heads,
        head_size=args.head_size,
        block_size=args.block_size,
        num_blocks=blocks,
    )
    p_dev, d_dev = devices()
    torch.cuda.set_device(torch.device(p_dev))
    port = free_port()
    per_write = {"layers_per_write": args.layers_per_write, "integrity": args.integrity == "on"}
    decoder = DecodeProcess(side, d_dev, port, **per_write)
    caches = allocate(side, p_dev)
    core = make_core("prefill", side, 0, caches, port, heartbeat_interval=5.0, **per_write)
    core.start()
    cycles = cycles_per_us()
    forward = torch.cuda.Stream()
    names = side.layer_names()
    try:
        for tokens in sizes:
            n_blocks = -(-tokens // side.block_size)
            p_blocks = tuple(range(n_blocks - 1, -1, -1))
            d_blocks = tuple(range(n_blocks))
            t = torch.arange(tokens, device=p_dev)
            page = torch.tensor(p_blocks, device=p_dev)[t // side.block_size]
            within = t % side.block_size
            heads = torch.arange(side.heads_local, device=p_dev)
            data = torch.randint(
                1, 256, (tokens, side.heads_local, 2 * side.head_size * 2), dtype=torch.uint8, device=p_dev
            )
            compute = int(args.compute_us * tokens / 1024 * cycles)
            tails, forwards = [], []
            for rep in range(args.reps + 1):  # rep 0 warms up and checks bytes
                check = rep == 0 and tokens == sizes[0]
                request = Request(f"bench-{tokens}-{rep}", 3, p_blocks, d_blocks, tokens)
                decoder.ask([request], core.bootstrap, check=check)
                writes = layer_writes(caches, side, 0, request.number, p_blocks, tokens) if check else []
                begin = time.monotonic_ns()
                with torch.cuda.stream(forward):
                    core.begin_layers(request.transfer_id, request.transfer_id, p_blocks)
                    for layer, name in enumerate(names):
                        torch.cuda._sleep(compute)
                        if check:
                            writes[layer]()
                        else:
                            caches[name].view(torch.uint8)[page[:, None], heads[None, :], within[:, None]] = (
                                data
                            )
                        core.layer_written(layer)
                    last = torch.cuda.Event()
                    last.record(forward)
                    core.step_written()
                last.synchronize()
                ended = time.monotonic_ns()
                wait_reported(core, {request.transfer_id}, prefill=True, timeout=60)
                errors, wrong, loaded = decoder.result()
                if errors or wrong > 0:
                    raise SystemExit(
                        f"tokens={tokens} rep {rep}: load errors {errors}, wrong bytes on {wrong} ranks"
                    )
                if rep:
                    tails.append((loaded - ended) / 1e6)
                    forwards.append((ended - begin) / 1e6)
            tails.sort()
            print(
                f"tokens={tokens} layers={side.num_layers} per_write={args.layers_per_write} layout={side.layout} "
                f"integrity={args.integrity} "
                f"prefill={p_dev} decode={d_dev} ({torch.cuda.get_device_name(p_dev)}): last layer's kernels end -> "
                f"decode reported loaded: median {statistics.median(tails):.3f} ms, min {tails[0]:.3f}, "
                f"max {tails[-1]:.3f} (n={len(tails)}); forward {statistics.median(forwards):.1f} ms",
                flush=True,
            )
    finally:
        core.close()
        leaks = decoder.stop()
        if any(leaks):
            print(f"decode leaked: {leaks}", flush=True)


if __name__ == "__main__":
    main()
