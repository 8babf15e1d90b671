"""Benchmark the staging kernels against their ceilings, measured in the same run (docs/PERF.md).

For each layout (Qwen3-32B: 64 layers x 8 KV heads x 128, Llama-3-70B: 80 x 8 x 128, an MLA
model: 61 layers x 576 latent; all bf16) and each P:D head split (4:2, 2:4, 8:1; MLA: whole
latent), a 4096-token chunk on a shuffled page list (prefill pages of 16 slots, decode pages of
64, pools of 16384 slots) is:

  - gathered by one prefill rank for one decode rank (device staging and pinned-host staging),
  - scattered on the decode rank from a region holding ALL of its writers' blocks.

Printed for each: the kernel's GB/s, the ceiling's GB/s on the same bytes (timed just before
the kernel, so both see the same machine state), the ratio, and the torch-indexing GB/s
(``impl="torch"``, one index op per tensor) with the speed-up. For host staging, also the rate
of the copy-engine alternative: the device kernel into a device scratch buffer plus a pinned
memcpy (gather), or a pinned memcpy plus the device kernel (scatter).
Device rates count bytes read + written; host rates count bytes crossing PCIe (the staging
bytes), as the pinned memcpy ceilings (D2H for the gather, H2D for the scatter) do.

Timing: ``triton.testing.do_bench`` (warm-up, L2 flushed before each run, median of the runs);
random bytes; every buffer several times the L2; every layout timed in ``--passes`` separate
passes (pass 1 also sweeps launch configs with ``--sweep``). Slot indices are uploaded once per
layout (``prepare_slots``) and the KV list validated once (``as_kv_table``), as the runtime does;
their host cost per call is printed separately. Each kernel result is checked byte-exact against
the torch reference on the GPU.

KV layouts (``--layouts``): "contiguous" (ours, ``[slots, H, D]`` per tensor), or a serving system's
paged layout as ``KVPool.from_views`` takes it: "vllm_cpu" (per layer ``[blocks, H, block_size,
2D]``), "flash_nhd" / "flash_hnd" (per layer ``(2, blocks, block_size, H, D)`` / ``(2, blocks, H,
block_size, D)``); the staging format is the same for all of them. MLA rows use "contiguous" only.

``--device cpu`` times what the engine runs on CPU (the torch implementation, which the kernels'
entry points pick for CPU tensors) against a plain CPU copy of the same bytes, with
``time.perf_counter`` medians; there "exact" compares with the same copy done from contiguous
clones of the views. Pick small ``--tokens``/``--slots`` there.

Usage: python tools/bench_kernels.py [--sweep] [--passes N] [--json PATH] [--models ...] [--splits ...]
       [--layouts contiguous,vllm_cpu,flash_nhd,flash_hnd] [--device cuda|cpu] [--tokens N] [--slots N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import triton
from triton.testing import do_bench

from transfer_engine.kernels import (
    KVTable,
    LaunchConfig,
    SlotIndex,
    as_kv_table,
    gather_heads,
    prepare_slots,
    scatter_heads,
)
from transfer_engine.kernels import gather as gather_mod
from transfer_engine.kernels import scatter as scatter_mod
from transfer_engine.memory.layout import views_flash_hnd, views_flash_nhd, views_vllm_cpu

MODELS = {"qwen3-32b": (64, 8, 128), "llama3-70b": (80, 8, 128), "mla-61x576": (61, 1, 576)}
SPLITS = ["4:2", "2:4", "8:1"]
SWEEP = [LaunchConfig(b, w) for b in (8192, 16384, 32768) for w in (4, 8)] + [LaunchConfig(65536, 8)]
NUM_SLOTS = 16384
"""Slots of every pool (``--slots``); a multiple of both page sizes."""
PREFILL_PAGE, DECODE_PAGE = 16, 64
KV_LAYOUTS = ("contiguous", "vllm_cpu", "flash_nhd", "flash_hnd")
DEVICE = "cuda"
"""Where the KV lives (``--device``)."""


@dataclass
class Row:
    run: int  # pass number (1-based): pass 1 may sweep launch configs, later passes time the defaults
    layout: str
    op: str  # gather | scatter
    staging: str  # device | host
    nbytes: int  # staging bytes moved
    ceiling: str
    ceiling_gbs: float  # timed just before the kernel, on the same bytes
    kernel_gbs: float  # default launch config
    config: str
    exact: bool
    torch_gbs: float | None = None  # device staging: impl="torch"
    composed_gbs: float | None = None  # host staging: device kernel + pinned memcpy (copy engine)
    sweep: dict[str, float] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.kernel_gbs / self.ceiling_gbs

    @property
    def speedup(self) -> float | None:
        return self.kernel_gbs / self.torch_gbs if self.torch_gbs else None


def median_ms(fn: Callable[[], object], rep: int) -> float:
    """Median milliseconds of ``fn``: ``do_bench`` on CUDA; on CPU, one warm-up run, then the median of
    ``max(11, rep // 10)`` runs timed with ``time.perf_counter``."""
    if DEVICE == "cuda":
        return float(do_bench(fn, warmup=25, rep=rep, return_mode="median"))
    fn()
    samples = []
    for _ in range(max(11, rep // 10)):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def release() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def shuffled_slots(tokens: int, page_size: int, gen: torch.Generator) -> torch.Tensor:
    pages = torch.randperm(NUM_SLOTS // page_size, generator=gen)[: -(-tokens // page_size)]
    slots = (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:tokens]
    return slots.to(torch.int64)


def random_pool(
    count: int, heads: int, dim: int, kind: str = "contiguous", page_size: int = PREFILL_PAGE
) -> list[torch.Tensor]:
    """``count`` bf16 KV tensors of ``NUM_SLOTS`` slots in layout ``kind`` (pages of ``page_size``):
    ``[slots, heads, dim]`` tensors, or ``[blocks, page_size, heads, dim]`` views of a paged layout."""

    def memory(*shape: int) -> torch.Tensor:
        return torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, device=DEVICE).view(torch.bfloat16)

    if kind == "contiguous":
        return [memory(NUM_SLOTS, heads, dim) for _ in range(count)]
    blocks, layers = NUM_SLOTS // page_size, count // 2
    if kind == "vllm_cpu":
        return views_vllm_cpu([memory(blocks, heads, page_size, 2 * dim) for _ in range(layers)], dim)
    if kind == "flash_nhd":
        return views_flash_nhd([memory(2, blocks, page_size, heads, dim) for _ in range(layers)])
    if kind == "flash_hnd":
        return views_flash_hnd([memory(2, blocks, heads, page_size, dim) for _ in range(layers)])
    raise ValueError(f"layout {kind!r} is not one of {KV_LAYOUTS}")


def contiguous_copies(kv: KVTable) -> list[torch.Tensor]:
    """The KV of ``kv`` copied into contiguous ``[slots, heads, dim]`` tensors (the CPU exactness check)."""
    return [t.reshape(kv.num_slots, kv.heads, kv.head_dim).contiguous() for t in kv.tensors]


def split_heads(model: str, split: str) -> tuple[int, int, int, int, int]:
    """(tensors, prefill heads_local, gather head_start, writer width n, decode heads_local)."""
    layers, heads, _ = MODELS[model]
    if model.startswith("mla"):
        return layers, 1, 0, 1, 1
    p, d = (int(x) for x in split.split(":"))
    heads_p, heads_d = max(1, heads // p), max(1, heads // d)
    n = min(heads_p, heads_d)
    start = heads_p - n  # 2:4 -> a writer sends the upper half of its heads
    return 2 * layers, heads_p, start, n, heads_d


def bench_layout(
    run: int,
    model: str,
    split: str,
    tokens: int,
    configs: list[LaunchConfig | None],
    host: bool,
    gen: torch.Generator,
    kind: str = "contiguous",
) -> list[Row]:
    _, _, dim = MODELS[model]
    count, heads_p, start, n, heads_d = split_heads(model, split)
    name = model if model.startswith("mla") else f"{model} {split}"
    name += "" if kind == "contiguous" else f" {kind}"
    stagings = ("device", "host") if host else ("device",)
    nbytes = count * tokens * n * dim * 2

    rows = []
    prefill = as_kv_table(random_pool(count, heads_p, dim, kind, PREFILL_PAGE))
    slots = prepare_slots(shuffled_slots(tokens, PREFILL_PAGE, gen), NUM_SLOTS, prefill.device)
    for staging in stagings:
        rows.append(_bench_gather(run, name, prefill, slots, start, n, nbytes, staging, configs))
    del prefill, slots
    release()

    writers = heads_d // n
    decode = as_kv_table(random_pool(count, heads_d, dim, kind, DECODE_PAGE))
    slots = prepare_slots(shuffled_slots(tokens, DECODE_PAGE, gen), NUM_SLOTS, decode.device)
    blocks = [(w * nbytes, w * n, n) for w in range(writers)]
    for staging in stagings:
        rows.append(_bench_scatter(run, name, decode, slots, blocks, writers * nbytes, staging, configs))
    del decode, slots
    release()
    return rows


def _bench_gather(
    run: int,
    name: str,
    kv: KVTable,
    slots: SlotIndex,
    start: int,
    n: int,
    nbytes: int,
    staging: str,
    configs: list[LaunchConfig | None],
) -> Row:
    host = staging == "host"
    out = torch.empty(nbytes, dtype=torch.uint8, device="cpu" if host else DEVICE, pin_memory=host)
    check = torch.empty_like(out, pin_memory=host)
    gather_heads(kv if DEVICE == "cuda" else contiguous_copies(kv), slots, start, n, check, impl="torch")
    ceiling_ms = _ceiling_ms("gather", staging, nbytes)
    times = {}
    for cfg in configs:

        def run_kernel(cfg: LaunchConfig | None = cfg) -> None:
            gather_heads(kv, slots, start, n, out, config=cfg)

        run_kernel()
        sync()
        times[_label(cfg, staging, gather_mod)] = median_ms(run_kernel, 200 if host else 100)
    sync()
    exact = torch.equal(out.cpu(), check.cpu())
    del check
    torch_ms = composed_ms = None
    if host:
        scratch = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

        def composed() -> None:
            gather_heads(kv, slots, start, n, scratch)
            out.copy_(scratch, non_blocking=True)

        composed_ms = median_ms(composed, 200)
    elif DEVICE == "cuda":
        torch_ms = median_ms(lambda: gather_heads(kv, slots, start, n, out, impl="torch"), 200)
    return _row(
        run, name, "gather", staging, nbytes, ceiling_ms, times, torch_ms, composed_ms, exact, gather_mod
    )


def _bench_scatter(
    run: int,
    name: str,
    kv: KVTable,
    slots: SlotIndex,
    blocks: list[tuple[int, int, int]],
    nbytes: int,
    staging: str,
    configs: list[LaunchConfig | None],
) -> Row:
    host = staging == "host"
    region = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=DEVICE)
    if host:
        region = region.cpu().pin_memory()
    want = [t.clone() for t in kv.tensors] if DEVICE == "cuda" else contiguous_copies(kv)
    scatter_heads(region, want, slots, blocks, impl="torch")
    ceiling_ms = _ceiling_ms("scatter", staging, nbytes)
    times = {}
    for cfg in configs:

        def run_kernel(cfg: LaunchConfig | None = cfg) -> None:
            scatter_heads(region, kv, slots, blocks, config=cfg)

        run_kernel()
        sync()
        times[_label(cfg, staging, scatter_mod)] = median_ms(run_kernel, 200 if host else 100)
    sync()
    exact = all(
        torch.equal(a.reshape(b.shape).view(torch.int16), b.view(torch.int16))
        for a, b in zip(kv.tensors, want, strict=True)
    )
    del want
    torch_ms = composed_ms = None
    if host:
        scratch = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

        def composed() -> None:
            scratch.copy_(region, non_blocking=True)
            scatter_heads(scratch, kv, slots, blocks)

        composed_ms = median_ms(composed, 200)
    elif DEVICE == "cuda":
        torch_ms = median_ms(lambda: scatter_heads(region, kv, slots, blocks, impl="torch"), 200)
    return _row(
        run, name, "scatter", staging, nbytes, ceiling_ms, times, torch_ms, composed_ms, exact, scatter_mod
    )


def _label(cfg: LaunchConfig | None, staging: str, module: object) -> str:
    if cfg is None:
        cfg = getattr(module, "HOST_CONFIG" if staging == "host" else "DEFAULT_CONFIG")
    assert cfg is not None
    return f"{cfg.block_bytes // 1024}K/w{cfg.num_warps}"


def _row(
    run: int,
    name: str,
    op: str,
    staging: str,
    nbytes: int,
    ceiling_ms: float,
    times: dict[str, float],
    torch_ms: float | None,
    composed_ms: float | None,
    exact: bool,
    module: object,
) -> Row:
    default = _label(None, staging, module)
    scale = 2 if staging == "device" else 1  # device: read + write; host: bytes over PCIe

    def rate(ms: float | None) -> float | None:
        return scale * nbytes / (ms * 1e6) if ms else None

    gbs = {k: scale * nbytes / (v * 1e6) for k, v in times.items()}
    config = default if default in gbs else max(gbs, key=lambda k: gbs[k])
    ceiling = "d2d copy" if staging == "device" else ("pinned D2H" if op == "gather" else "pinned H2D")
    ceiling = "cpu copy" if DEVICE == "cpu" else ceiling
    return Row(
        run=run,
        layout=name,
        op=op,
        staging=staging,
        nbytes=nbytes,
        ceiling=ceiling,
        ceiling_gbs=scale * nbytes / (ceiling_ms * 1e6),
        kernel_gbs=gbs[config],
        config=config,
        exact=exact,
        torch_gbs=rate(torch_ms),
        composed_gbs=rate(composed_ms),
        sweep=gbs,
    )


def _ceiling_ms(op: str, staging: str, nbytes: int) -> float:
    """Median ms of the plain copy of ``nbytes``: device-to-device (or CPU to CPU), or pinned D2H / H2D."""
    dev = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=DEVICE)
    if staging == "device":
        other = torch.empty_like(dev)
        return median_ms(lambda: other.copy_(dev), 100)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    if op == "gather":
        return median_ms(lambda: pinned.copy_(dev, non_blocking=True), 200)
    return median_ms(lambda: dev.copy_(pinned, non_blocking=True), 200)


def host_overhead_us(model: str, tokens: int, gen: torch.Generator) -> dict[str, float]:
    """Host (Python) microseconds per gather call: raw tensor list + host slots vs KVTable + SlotIndex."""
    count, heads_p, start, n, _ = split_heads(model, "4:2")
    kv = random_pool(count, heads_p, MODELS[model][2])
    layout = as_kv_table(kv)
    host_slots = shuffled_slots(tokens, PREFILL_PAGE, gen)
    index = prepare_slots(host_slots, NUM_SLOTS, layout.device)
    out = torch.empty(count, tokens, n, MODELS[model][2], dtype=torch.bfloat16, device="cuda")
    result = {}
    for label, args in (
        ("raw list + host slots", (kv, host_slots)),
        ("KVTable + SlotIndex", (layout, index)),
    ):
        samples = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                gather_heads(args[0], args[1], start, n, out)
            samples.append((time.perf_counter() - t0) / 20 * 1e6)
        result[label] = statistics.median(samples)
    torch.cuda.synchronize()
    return result


def print_table(rows: list[Row]) -> None:
    print(
        "| layout | op | staging | MiB | kernel GB/s | ceiling | ceiling GB/s | ratio | torch GB/s | x torch | via copy engine | exact | config | best config |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        torch_col = f"{r.torch_gbs:.0f}" if r.torch_gbs else "-"
        speed = f"{r.speedup:.1f}x" if r.speedup else "-"
        composed = f"{r.composed_gbs:.1f} ({r.composed_gbs / r.ceiling_gbs:.1%})" if r.composed_gbs else "-"
        top = max(r.sweep, key=lambda k: r.sweep[k])
        best = f"{top} {r.sweep[top]:.0f} ({r.sweep[top] / r.ceiling_gbs:.1%})" if len(r.sweep) > 1 else "-"
        coarse = r.staging == "device" and DEVICE == "cuda"  # hundreds of GB/s: no decimals
        rate = f"{r.kernel_gbs:.0f}" if coarse else f"{r.kernel_gbs:.2f}"
        ceiling = f"{r.ceiling_gbs:.0f}" if coarse else f"{r.ceiling_gbs:.2f}"
        print(
            f"| {r.layout} | {r.op} | {r.staging} | {r.nbytes / 2**20:.0f} | {rate} | {r.ceiling} | "
            f"{ceiling} | {r.ratio:.1%} | {torch_col} | {speed} | {composed} | {r.exact} | {r.config} | {best} |"
        )


def main(argv: list[str] | None = None) -> int:
    global DEVICE, NUM_SLOTS
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--splits", default=",".join(SPLITS))
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument(
        "--sweep", action="store_true", help=f"pass 1 times every launch config of {len(SWEEP)}"
    )
    parser.add_argument("--passes", type=int, default=2, help="repeat every layout this many times")
    parser.add_argument("--no-host", action="store_true", help="skip the pinned-host variants")
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--layouts", default="contiguous", help=f"KV layouts, of {','.join(KV_LAYOUTS)}")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--slots", type=int, default=NUM_SLOTS, help="slots of every pool")
    args = parser.parse_args(argv)
    DEVICE, NUM_SLOTS = args.device, args.slots
    kinds = args.layouts.split(",")
    for kind in kinds:
        if kind not in KV_LAYOUTS:
            parser.error(f"--layouts: {kind!r} is not one of {','.join(KV_LAYOUTS)}")
    if NUM_SLOTS < 1 or NUM_SLOTS % DECODE_PAGE or args.tokens > NUM_SLOTS:
        parser.error(f"--slots {NUM_SLOTS}: a positive multiple of {DECODE_PAGE}, at least --tokens")
    gen = torch.Generator().manual_seed(0)
    if DEVICE == "cpu":
        device_name = "cpu"
        print(f"device: cpu, {torch.get_num_threads()} threads; torch {torch.__version__}")
    elif not torch.cuda.is_available():
        print("bench_kernels --device cuda needs a CUDA device", file=sys.stderr)
        return 2
    else:
        props = torch.cuda.get_device_properties(0)
        device_name = props.name
        print(
            f"device: {props.name}, {props.multi_processor_count} SMs, L2 {props.L2_cache_size >> 20} MiB; "
            f"torch {torch.__version__}, triton {triton.__version__}"
        )
    rows: list[Row] = []
    failures = 0
    for run in range(1, args.passes + 1):
        configs: list[LaunchConfig | None] = [None, *SWEEP] if args.sweep and run == 1 else [None]
        host = not args.no_host and DEVICE == "cuda"
        for model in args.models.split(","):
            for split in ["-"] if model.startswith("mla") else args.splits.split(","):
                for kind in ["contiguous"] if model.startswith("mla") else kinds:
                    try:
                        new = bench_layout(run, model, split, args.tokens, configs, host, gen, kind)
                    except Exception as exc:  # keep the other layouts' figures; the exit code reports it
                        print(f"  {model} {split} {kind}: FAILED: {exc!r}", flush=True)
                        failures += 1
                        release()
                        continue
                    rows.extend(new)
                    for r in new:
                        print(
                            f"  pass {run} {r.layout:30s} {r.op:7s} {r.staging:6s} {r.kernel_gbs:8.1f} GB/s "
                            f"{r.ratio:6.1%} of {r.ceiling} {r.ceiling_gbs:.1f}; sweep "
                            + " ".join(f"{k}={v:.0f}" for k, v in r.sweep.items()),
                            flush=True,
                        )
    dense = [m for m in args.models.split(",") if not m.startswith("mla")]
    overhead = host_overhead_us(dense[-1], args.tokens, gen) if dense and DEVICE == "cuda" else {}
    for run in range(1, args.passes + 1):
        print(f"\npass {run}:")
        print_table([r for r in rows if r.run == run])
    print()
    for label, us in overhead.items():
        print(f"host cost per gather call ({dense[-1]}, 4:2), {label}: {us:.0f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": device_name,
                    "rows": [asdict(r) | {"ratio": r.ratio} for r in rows],
                    "host_overhead_us": overhead,
                },
                f,
                indent=1,
            )
    return 0 if failures == 0 and all(r.exact for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
