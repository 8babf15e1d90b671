"""A/B the staging kernels' entry points of two source trees on CPU, interleaved in one process.

On a loaded shared box two separate benchmark runs differ by more than any change could; here
each round times tree A then tree B on the same tensors, and the median of the per-round ratios
B/A is printed. What runs is what the engine runs on CPU (``impl="auto"`` without
``TRITON_INTERPRET``: the torch implementation). Both trees' results are compared byte for byte.

Usage: python tools/ab_kernels.py KERNELS_DIR_A KERNELS_DIR_B [--tokens N] [--rounds N]
  e.g. python tools/ab_kernels.py /work/main/kernels kernels
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


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    trees = [load(args.a, "kernels_a"), load(args.b, "kernels_b")]
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
    tables = [(k.as_kv_table(src), k.as_kv_table([t.clone() for t in dst])) for k in trees]
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
    exact = torch.equal(outs[0], outs[1]) and all(
        torch.equal(a.view(torch.int16), b.view(torch.int16))
        for a, b in zip(tables[0][1].tensors, tables[1][1].tensors, strict=True)
    )
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
