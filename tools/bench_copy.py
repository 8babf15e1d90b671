"""The kernel path's copy alone: ``kernels.copy.copy_entries`` against a plain device copy of the same bytes.

What the kernel path's throughput rows (``bench_transfer.py --path kernel``) hold the engine to is a raw
NIXL copy; this isolates the kernel from the engine's control: two pools on one device, described as
entry tables the way the kernel path describes them ((tensor, page) entries of ``page_size`` tokens of
every head), a room's pages scattered over the pool as a busy pool hands them out, and one launch per
room. Per launch shape (``--configs block_bytes:num_warps,...``): the kernel's GB/s (CUDA events, median of
``--reps``), the ceiling (``torch`` copy of one contiguous buffer of the room's bytes, same run), their
ratio, and the host's time to check, upload and launch (``perf_counter``, median). Every copy is checked
bit-exact once per shape. One line per shape, then one JSON line.

    python tools/bench_copy.py --device cuda --page-size 16 --configs default,32768:4,65536:4,131072:8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from transfer_engine.kernels._common import LaunchConfig
from transfer_engine.kernels.copy import copy_entries, entry_table, plain_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens a room copies")
    ap.add_argument("--pool-rooms", type=int, default=3, help="pool size, in rooms")
    ap.add_argument(
        "--configs",
        default="default,32768:4,65536:4,131072:8,16384:4",
        help="block_bytes:num_warps,...; default: copy_entries' own choice for the entry size",
    )
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    dev = torch.device(args.device)
    rng = np.random.default_rng(args.seed)
    pages = args.tokens // args.page_size
    pool_pages = pages * args.pool_rooms
    tensors = 2 * args.layers
    page_bytes = args.page_size * args.heads * args.head_dim * 2
    # one allocation per side, tensor-major ([tensor][page]), as vLLM's per-layer caches sit in one pool
    src = torch.randint(
        -(2**15), 2**15, (tensors, pool_pages, page_bytes // 2), dtype=torch.int16, device=dev
    )
    dst = torch.zeros_like(src)
    offsets = np.arange(tensors * pool_pages, dtype=np.uint64) * np.uint64(page_bytes)
    src_t = entry_table(np.uint64(src.data_ptr()) + offsets, page_bytes, dev)
    dst_t = entry_table(np.uint64(dst.data_ptr()) + offsets, page_bytes, dev)
    # a room's pages as a busy pool hands them out: runs of 1-8 pages at random places
    src_pages = rng.permutation(pool_pages)[:pages]
    dst_pages = rng.permutation(pool_pages)[:pages]
    t_base = (np.arange(tensors, dtype=np.int64) * pool_pages)[:, None]
    s_idx = (t_base + src_pages[None, :]).reshape(-1).astype(np.int32)
    d_idx = (t_base + dst_pages[None, :]).reshape(-1).astype(np.int32)
    nbytes = s_idx.size * page_bytes
    flat_a = torch.empty(nbytes // 2, dtype=torch.int16, device=dev)
    flat_b = torch.empty_like(flat_a)

    def timed(fn) -> tuple[float, float]:  # (device ms median, host ms median)
        dev_ms, host_ms = [], []
        for _ in range(args.reps):
            if dev.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                t0 = time.perf_counter()
                fn()
                host_ms.append((time.perf_counter() - t0) * 1e3)
                b.record()
                b.synchronize()
                dev_ms.append(a.elapsed_time(b))
            else:
                t0 = time.perf_counter()
                fn()
                host_ms.append((time.perf_counter() - t0) * 1e3)
                dev_ms.append(host_ms[-1])
        return statistics.median(dev_ms), statistics.median(host_ms)

    raw_ms, _ = timed(lambda: flat_b.copy_(flat_a))
    raw_gbs = nbytes / raw_ms / 1e6
    want = src.view(tensors, pool_pages, -1)[:, torch.as_tensor(src_pages, device=dev)]
    rows = []
    print(
        f"room {nbytes / 1e9:.3f} GB, {s_idx.size} entries of {page_bytes} B, page size {args.page_size}; "
        f"raw copy {raw_ms:.3f} ms = {raw_gbs:.0f} GB/s"
    )
    for spec in args.configs.split(","):
        if spec == "default":  # what the kernel path launches: copy_entries' own choice for the entry size
            cfg = plain_config(page_bytes)
        else:
            block_bytes, warps = (int(x) for x in spec.split(":"))
            cfg = LaunchConfig(block_bytes=block_bytes, num_warps=warps)
        block_bytes, warps = cfg.block_bytes, cfg.num_warps
        dst.zero_()
        copy_entries(src_t, dst_t, s_idx, d_idx, config=cfg)
        got = dst.view(tensors, pool_pages, -1)[:, torch.as_tensor(dst_pages, device=dev)]
        exact = bool(torch.equal(got, want))
        ms, host = timed(lambda cfg=cfg: copy_entries(src_t, dst_t, s_idx, d_idx, config=cfg))
        gbs = nbytes / ms / 1e6
        rows.append({"block_bytes": block_bytes, "num_warps": warps, "ms": ms, "gbs": gbs,
                     "ratio": gbs / raw_gbs, "host_ms": host, "exact": exact})  # fmt: skip
        print(
            f"block_bytes={block_bytes} num_warps={warps}: {ms:.3f} ms = {gbs:.0f} GB/s, {gbs / raw_gbs:.2f} of raw; "
            f"host {host:.3f} ms; exact {exact}"
        )
    print(json.dumps({"page_size": args.page_size, "entry_bytes": page_bytes, "entries": int(s_idx.size),
                      "room_bytes": nbytes, "raw_gbs": raw_gbs, "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
