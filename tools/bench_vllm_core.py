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
every process of the host. Each layout's first request is checked, every byte; every repetition
writes other bytes than the one before, so a sum that read the pages before they landed would not
match.

``--layouts`` runs each of vLLM's ``KVCacheLayout`` names (``all``: every one the core supports,
``integrations.vllm.layouts.LAYOUTS``) on both sides in turn, in the same two processes. Every
request is counted, the warm-up included: one line per layout and length with its failed requests,
the INTEGRITY failures among them (the decode's ``failed_integrity``) and the chunks the decode
checked, then one summary line. The exit status is 1 if any request failed or any byte was wrong.

    python tools/bench_vllm_core.py --tokens 1024,16384 --reps 10
    python tools/bench_vllm_core.py --integrity on --layouts all --tokens 1024,4096,16384 --reps 10
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.gpu.twoproc import DecodeProcess, devices  # noqa: E402
from tests.gpu.vllm_kv import Request, Side, allocate, layer_writes, make_core, wait_reported  # noqa: E402
from transfer_engine.integrations.vllm.core import ConnectorCore  # noqa: E402
from transfer_engine.integrations.vllm.layouts import LAYOUTS  # noqa: E402
from transfer_engine.testing.cluster import free_port  # noqa: E402

JUDGED = ("integrity_match", "integrity_mismatch", "integrity_unchecked", "failed_integrity")
"""The decode's counters each line reports (docs/INTEGRITY.md, "What it counts")."""


def cycles_per_us() -> float:
    """The GPU's ``torch.cuda._sleep`` cycles per microsecond, measured."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(10_000_000)
    start.record()
    torch.cuda._sleep(100_000_000)
    end.record()
    end.synchronize()
    return 100_000_000 / (start.elapsed_time(end) * 1000)


def parse_layouts(text: str) -> list[str]:
    """``all`` or a comma-separated list of vLLM layout names (NHD/HND accepted, as vLLM's aliases)."""
    if text == "all":
        return list(LAYOUTS)
    names = [{"NHD": "LBNHC", "HND": "LBHNC"}.get(n, n) for n in text.split(",") if n]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown or not names:
        raise SystemExit(f"--layouts {text!r}: not vLLM layouts {unknown}; one of {sorted(LAYOUTS)} or all")
    return names


def summed(counters: list[dict[str, int]]) -> dict[str, int]:
    """The decode ranks' counters of :data:`JUDGED`, summed."""
    return {k: sum(c.get(k, 0) for c in counters) for k in JUDGED}


def run_layout(
    args: argparse.Namespace,
    side: Side,
    sizes: list[int],
    decoder: DecodeProcess,
    p_dev: str,
    d_dev: str,
    cycles: float,
    config: dict[str, object],
) -> tuple[int, int, int, int]:
    """Every length of ``sizes``, ``args.reps`` + 1 requests each, for one layout on both sides.
    Returns (requests, failed requests, INTEGRITY failures, decode ranks with wrong bytes)."""
    caches = allocate(side, p_dev)
    core: ConnectorCore = make_core("prefill", side, 0, caches, free_port(), heartbeat_interval=5.0, **config)
    core.start()
    cuda = p_dev.startswith("cuda")
    forward = torch.cuda.Stream() if cuda else None
    names = side.layer_names()
    gen = torch.Generator(device=p_dev)
    gen.manual_seed(0)
    totals = [0, 0, 0, 0]
    try:
        for tokens in sizes:
            n_blocks = -(-tokens // side.block_size)
            p_blocks = tuple(range(n_blocks - 1, -1, -1))
            d_blocks = tuple(range(n_blocks))
            t = torch.arange(tokens, device=p_dev)
            page = torch.tensor(p_blocks, device=p_dev)[t // side.block_size]
            within = t % side.block_size
            heads = torch.arange(side.heads_local, device=p_dev)
            width = caches[names[0]].view(torch.uint8).shape[3]
            compute = int(args.compute_us * tokens / 1024 * cycles)
            before = summed(decoder.counters())
            tails, forwards = [], []
            failed, wrong_ranks = 0, 0
            for rep in range(args.reps + 1):  # rep 0 warms up (and, for the first length, checks bytes)
                check = rep == 0 and tokens == sizes[0]
                request = Request(f"bench-{side.layout}-{tokens}-{rep}", 3, p_blocks, d_blocks, tokens)
                # other bytes than the last request's: a sum of pages not landed yet cannot match
                data = torch.randint(
                    1, 256, (tokens, side.heads_local, width), dtype=torch.uint8, device=p_dev, generator=gen
                )
                if cuda:  # made on the current stream, read on the forward's: done before the clock starts
                    torch.cuda.current_stream().synchronize()
                decoder.ask([request], core.bootstrap, check=check)
                writes = layer_writes(caches, side, 0, request.number, p_blocks, tokens) if check else []
                begin = time.monotonic_ns()
                with torch.cuda.stream(forward) if forward is not None else contextlib.nullcontext():
                    core.begin_layers(request.transfer_id, request.transfer_id, p_blocks)
                    for layer, name in enumerate(names):
                        if compute:
                            torch.cuda._sleep(compute)
                        if check:
                            writes[layer]()
                        else:
                            caches[name].view(torch.uint8)[page[:, None], heads[None, :], within[:, None]] = (
                                data
                            )
                        core.layer_written(layer)
                    last = torch.cuda.Event() if forward is not None else None
                    if last is not None:
                        last.record(forward)
                    core.step_written()
                if last is not None:
                    last.synchronize()
                ended = time.monotonic_ns()
                wait_reported(core, {request.transfer_id}, prefill=True, timeout=60)
                errors, wrong, loaded = decoder.result()
                if errors:
                    failed += 1
                    print(
                        f"layout={side.layout} tokens={tokens} rep {rep}: load errors on {len(errors)} blocks"
                    )
                if wrong > 0:
                    wrong_ranks += wrong
                    print(
                        f"layout={side.layout} tokens={tokens} rep {rep}: wrong bytes on {wrong} decode ranks"
                    )
                if rep and not errors:
                    tails.append((loaded - ended) / 1e6)
                    forwards.append((ended - begin) / 1e6)
            after = summed(decoder.counters())
            judged = {k: after[k] - before[k] for k in JUDGED}
            tails.sort()
            timing = (
                f"median {statistics.median(tails):.3f} ms, min {tails[0]:.3f}, max {tails[-1]:.3f} "
                f"(n={len(tails)}); forward {statistics.median(forwards):.1f} ms"
                if tails
                else "no request succeeded"
            )
            print(
                f"tokens={tokens} layers={side.num_layers} per_write={args.layers_per_write} layout={side.layout} "
                f"integrity={args.integrity} path={args.path} table_max_descriptors={args.table_max_descriptors} "
                f"prefill={p_dev} decode={d_dev} ({torch.cuda.get_device_name(p_dev) if cuda else 'cpu'}): last layer's kernels end -> "
                f"decode reported loaded: {timing}; requests {args.reps + 1} (1 warm-up), failed {failed}, "
                f"INTEGRITY {judged['failed_integrity']}; decode checks: match {judged['integrity_match']}, "
                f"mismatch {judged['integrity_mismatch']}, unchecked {judged['integrity_unchecked']}",
                flush=True,
            )
            for i, n in enumerate((args.reps + 1, failed, judged["failed_integrity"], wrong_ranks)):
                totals[i] += n
    finally:
        core.close()
    return totals[0], totals[1], totals[2], totals[3]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1024,16384")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--heads", type=int, default=8, help="KV heads (TP 1)")
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument(
        "--layouts",
        "--layout",
        default="LBNHC",
        help="vLLM KVCacheLayout names, comma-separated, on both sides in turn (LBNHC: FlashAttention's), "
        f"or all: {','.join(LAYOUTS)}",
    )
    ap.add_argument("--layers-per-write", type=int, default=4)
    ap.add_argument("--compute-us", type=float, default=100.0, help="a layer's compute per 1K tokens, us")
    ap.add_argument(
        "--integrity", choices=("on", "off"), default="on", help="EngineConfig.integrity on both sides"
    )
    ap.add_argument(
        "--path", default="auto", help="EngineConfig.path on both sides (direct: NIXL from tables)"
    )
    ap.add_argument(
        "--table-max-descriptors",
        type=int,
        default=None,
        help="EngineConfig.table_max_descriptors on the prefill (1: no descriptor tables, each WRITE planned "
        "on its own, for an A/B)",
    )
    ap.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: a dry run of the same steps on CPU caches (no compute kernel, no streams)",
    )
    ap.add_argument(
        "--budget",
        type=float,
        default=0.0,
        help="seconds after which no further layout starts (the first always does; 0: no limit)",
    )
    args = ap.parse_args()
    sizes = [int(t) for t in args.tokens.split(",")]
    layouts = parse_layouts(args.layouts)
    blocks = -(-max(sizes) // args.block_size) + 1
    sides = [
        Side(
            layout=layout,
            num_layers=args.layers,
            num_heads=args.heads,
            head_size=args.head_size,
            block_size=args.block_size,
            num_blocks=blocks,
        )
        for layout in layouts
    ]
    cuda = args.device == "cuda"
    p_dev, d_dev = devices() if cuda else ("cpu", "cpu")
    if cuda:
        torch.cuda.set_device(torch.device(p_dev))
    config: dict[str, object] = {
        "layers_per_write": args.layers_per_write,
        "integrity": args.integrity == "on",
        "path": args.path,
    }
    if args.table_max_descriptors is not None:
        config["table_max_descriptors"] = args.table_max_descriptors
    start = time.monotonic()
    decoder = DecodeProcess(sides[0], d_dev, free_port(), **config)
    cycles = cycles_per_us() if cuda else 0.0
    totals = [0, 0, 0, 0]  # requests, failed, INTEGRITY failures, decode ranks with wrong bytes
    done: list[str] = []
    try:
        for i, side in enumerate(sides):
            if i and args.budget and time.monotonic() - start > args.budget:
                print(f"layouts {','.join(layouts[i:])}: skipped, the {args.budget:.0f} s budget was spent")
                break
            t0 = time.monotonic()
            if i:
                decoder.reset(side, **config)
            counts = run_layout(args, side, sizes, decoder, p_dev, d_dev, cycles, config)
            totals = [a + b for a, b in zip(totals, counts, strict=True)]
            done.append(side.layout)
            print(f"layout={side.layout}: {time.monotonic() - t0:.1f} s", flush=True)
    finally:
        leaks = decoder.stop()
        if any(leaks):
            print(f"decode leaked: {leaks}", flush=True)
    requests, failed, integrity, wrong = totals
    print(
        f"integrity={args.integrity}: {integrity} INTEGRITY failures, {failed} failed requests, "
        f"{wrong} decode ranks with wrong bytes, over {len(done)} layouts ({','.join(done)}) x "
        f"{len(sizes)} lengths ({args.tokens} tokens) x {args.reps + 1} requests = {requests} requests, "
        f"{args.layers} layers; {time.monotonic() - start:.0f} s",
        flush=True,
    )
    if failed or wrong or any(leaks) or len(done) < len(sides):
        sys.exit(1)


if __name__ == "__main__":
    main()
