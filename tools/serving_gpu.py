"""The GPU variant of the serving-loop measurement (docs/PERF.md, "Serving loop"): one command.

    .venv/bin/python tools/serving_gpu.py [--out-dir /tmp/serving_gpu] [--quick]

Checks first that the demo's tokens match the monolithic reference on the GPUs (P = D = 1, and
P = 2 -> D = 2 when there are 4 GPUs), then runs ``tools/serving_bench.py --device cuda`` with a
model of a realistic layer shape (16 layers, hidden 2048, 16 query / 8 KV heads of 128, SwiGLU
5632; fp32, fixed-seed weights) for every (P, D) the machine's GPUs allow: prefill ranks on GPUs
0..P-1, decode ranks on the next D. Each run prints its lines and writes ``bench-P{P}-D{D}.json``.
Needs P + D GPUs per run (NCCL cannot put two ranks of one group on one GPU).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = [
    "--model-hidden", "2048", "--model-layers", "16", "--model-heads", "16", "--model-kv-heads", "8",
    "--model-head-dim", "128", "--model-ffn", "5632", "--model-vocab", "32000",
]  # fmt: skip


def run(cmd: list[str]) -> int:
    print("$ " + " ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=ROOT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out-dir", default="/tmp/serving_gpu", help="where the JSON results go")
    parser.add_argument("--quick", action="store_true", help="fewer samples and shorter windows")
    args = parser.parse_args(argv)
    import torch

    gpus = torch.cuda.device_count()
    if gpus < 2:
        raise SystemExit(f"needs at least 2 GPUs (one prefill, one decode); torch sees {gpus}")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    failures = 0
    pairs = [(p, d) for p, d in ((1, 1), (2, 1), (1, 2), (2, 2)) if p + d <= gpus]
    for p, d in [(1, 1), (2, 2)] if gpus >= 4 else [(1, 1)]:
        failures += (
            run(
                [
                    py,
                    "-m",
                    "examples.serving",
                    "--device",
                    "cuda",
                    "--prefill-tp",
                    str(p),
                    "--decode-tp",
                    str(d),
                ]
            )
            != 0
        )
    extra = ["--samples", "5", "--window", "1", "--rounds", "2"] if args.quick else []
    for p, d in pairs:
        failures += (
            run(
                [
                    py,
                    "tools/serving_bench.py",
                    "--device",
                    "cuda",
                    "--prefill-tp",
                    str(p),
                    "--decode-tp",
                    str(d),
                    *MODEL,
                    "--long",
                    "4096",
                    "--chunk-tokens",
                    "512",
                    "--max-batch-tokens",
                    "1024",
                    "--decode-tokens",
                    "256",
                    "--json-out",
                    str(out / f"bench-P{p}-D{d}.json"),
                    *extra,
                ]  # fmt: skip
            )
            != 0
        )
    print(f"serving gpu: {len(pairs)} bench runs, {failures} failed; results in {out}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
