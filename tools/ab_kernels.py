"""A/B the staging kernels' CPU entry points, interleaved in one process: two source trees, or two
KV layouts, on the same logical KV.

On a loaded shared box two separate benchmark runs differ by more than any change could; here
each round times A then B, and the median of the per-round ratios B/A is printed. What runs is what
the engine runs on CPU (``impl="auto"`` without ``TRITON_INTERPRET``: the torch implementation).

A and B are each ``KERNELS_DIR[:LAYOUT]``: a kernels source tree and a KV layout ("contiguous",
"vllm_cpu", "flash_nhd", "flash_hnd"; default contiguous). Both hold the same logical KV (64 layers x
2 KV heads x 128 bf16 on the prefill, 4 heads on the decode, pages of 16), so their gathers must
give the same bytes and their scatters the same KV: both are checked.

Usage: python tools/ab_kernels.py A B [--tokens N] [--rounds N]
  e.g. python tools/ab_kernels.py /work/main/kernels kernels          (before / after, contiguous)
       python tools/ab_kernels.py kernels kernels:vllm_cpu           (contiguous / vLLM CPU layout)
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from transfer_engine.memory.layout import views_flash_hnd, views_flash_nhd, views_vllm_cpu

LAYERS, HEADS_P, HEADS_D, DIM, SLOTS, PAGE = 64, 2, 4, 128, 2048, 16


def load(directory: str, name: str) -> ModuleType:
    """The kernels package in ``directory``, imported as ``name``."""
    init = Path(directory) / "__init__.py"
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def laid_out(kind: str, data: list[torch.Tensor]) -> list[torch.Tensor]:
    """``data`` (K then V, ``[SLOTS, H, DIM]`` each) copied into layout ``kind``: the tensors
    themselves for "contiguous", else ``[blocks, PAGE, H, DIM]`` views of that layout's memory."""
    if kind == "contiguous":
        return [t.clone() for t in data]
    heads, blocks = data[0].shape[1], SLOTS // PAGE

    def memory(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=data[0].dtype)

    if kind == "vllm_cpu":
        views = views_vllm_cpu([memory(blocks, heads, PAGE, 2 * DIM) for _ in range(LAYERS)], DIM)
    elif kind == "flash_nhd":
        views = views_flash_nhd([memory(2, blocks, PAGE, heads, DIM) for _ in range(LAYERS)])
    elif kind == "flash_hnd":
        views = views_flash_hnd([memory(2, blocks, heads, PAGE, DIM) for _ in range(LAYERS)])
    else:
        raise SystemExit(f"layout {kind!r}: one of contiguous, vllm_cpu, flash_nhd, flash_hnd")
    for view, t in zip(views, data, strict=True):
        view.copy_(t.view(blocks, PAGE, heads, DIM))
    return views


def logical(kv: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.reshape(SLOTS, *t.shape[-2:]).view(torch.int16) for t in kv]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    specs = [(*arg.split(":", 1), "contiguous")[:2] for arg in (args.a, args.b)]
    trees = [load(directory, f"kernels_{'ab'[i]}") for i, (directory, _) in enumerate(specs)]
    gen = torch.Generator().manual_seed(0)

    def pool(heads: int) -> list[torch.Tensor]:
        shape = (SLOTS, heads, DIM)
        return [
            torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=gen).view(torch.bfloat16)
            for _ in range(2 * LAYERS)
        ]

    src, dst = pool(HEADS_P), pool(HEADS_D)
    pages = torch.randperm(SLOTS // PAGE, generator=gen)[: -(-args.tokens // PAGE)]
    slots = (pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)[: args.tokens]
    nbytes = 2 * LAYERS * args.tokens * 2 * DIM * 2
    second = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)  # the other writer's block
    outs = [torch.cat([torch.empty(nbytes, dtype=torch.uint8), second]) for _ in trees]
    tables = [
        (k.as_kv_table(laid_out(kind, src)), k.as_kv_table(laid_out(kind, dst)))
        for k, (_, kind) in zip(trees, specs, strict=True)
    ]
    gather_ms: list[list[float]] = [[], []]
    scatter_ms: list[list[float]] = [[], []]
    for _ in range(args.rounds):
        for i, k in enumerate(trees):
            t0 = time.perf_counter()
            k.gather_heads(tables[i][0], slots, 0, 2, outs[i][:nbytes])
            t1 = time.perf_counter()
            k.scatter_heads(outs[i], tables[i][1], slots, [(0, 0, 2), (nbytes, 2, 2)])
            t2 = time.perf_counter()
            gather_ms[i].append((t1 - t0) * 1e3)
            scatter_ms[i].append((t2 - t1) * 1e3)
    decoded = [logical(list(t[1].tensors)) for t in tables]
    exact = torch.equal(outs[0], outs[1]) and all(
        torch.equal(a, b) for a, b in zip(decoded[0], decoded[1], strict=True)
    )
    print(f"A = {':'.join(specs[0])}, B = {':'.join(specs[1])}, {args.tokens} tokens, {args.rounds} rounds")
    for op, ms, mib in (("gather", gather_ms, nbytes / 2**20), ("scatter", scatter_ms, 2 * nbytes / 2**20)):
        ratio = statistics.median(b / a for a, b in zip(ms[0], ms[1], strict=True))
        print(
            f"{op}: {mib:.0f} MiB, A median {statistics.median(ms[0]):.1f} ms, "
            f"B median {statistics.median(ms[1]):.1f} ms, median per-round B/A {ratio:.2f}"
        )
    print(f"exact: {exact}")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
