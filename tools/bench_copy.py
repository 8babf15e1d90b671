"""The kernel path's copy alone: ``kernels.copy.copy_entries`` against a plain device copy of the same bytes.

What the kernel path's throughput rows (``bench_transfer.py --path kernel``) hold the engine to is a raw
NIXL copy; this isolates the kernel from the engine's control: two pools on one device, described as
entry tables the way the kernel path describes them ((tensor, page) entries of ``page_size`` tokens of
every head), a room's pages scattered over the pool as a busy pool hands them out, and one launch per
room. Per launch shape (``--configs block_bytes:num_warps,...``; ``default``: the one ``copy_entries``
picks): the device time of the call (CUDA events around it, with the stream held busy by a device-side
wait queued before it, so the host's checks, upload and launch are not in it), the ceiling (``torch``
copy of one contiguous buffer of the room's bytes, timed the same way), their ratio, and the host call's
time (``perf_counter``). ``--reps`` rounds over every shape and the ceiling, each round in a rotated
order; medians. The last row is the same copy at the default shape given as the factors of its
outer sums (``copy_outer``: one offset per tensor, one column per page), the kernel path's form: its
host call is what the factors save. Then integrity's two reads (docs/INTEGRITY.md): the same copy
summing what it copies (the kernel path's writer with integrity on) and the decode's check of the
landed pages (``checksum_heads``), whose sum must equal the copy's. Every call is checked bit-exact once. One line per shape, then one JSON line.

    python tools/bench_copy.py --device cuda --page-size 16 --configs default,32768:4,65536:4,131072:8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from transfer_engine.kernels._common import LaunchConfig, as_kv_table
from transfer_engine.kernels.checksum import checksum_heads
from transfer_engine.kernels.copy import DEFAULT_CONFIG, WordOrder, copy_entries, copy_outer, entry_table

SLEEP_CYCLES = 4_000_000
"""A device-side wait queued before each timed call (about 2 ms on an H200), longer than its host call."""


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
    ap.add_argument(
        "--host-profile",
        type=int,
        default=0,
        metavar="N",
        help="then N back-to-back host calls of copy_outer (the kernel path's plain copy) under cProfile: "
        "where its host call goes, in us per call (the top 20 by own time)",
    )
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

    def one(fn) -> tuple[float, float]:  # (device ms, host ms) of one call
        if dev.type != "cuda":
            t0 = time.perf_counter()
            fn()
            host = (time.perf_counter() - t0) * 1e3
            return host, host
        # the stream is kept busy while the host call runs, so the events time the device's work alone
        torch.cuda._sleep(SLEEP_CYCLES)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        fn()
        host = (time.perf_counter() - t0) * 1e3
        b.record()
        b.synchronize()
        return a.elapsed_time(b), host

    def raw() -> None:
        flat_b.copy_(flat_a)

    for _ in range(20):  # clocks up before anything is timed
        raw()
    configs: list[LaunchConfig] = []
    for spec in args.configs.split(","):
        if spec == "default":  # what the kernel path launches: copy_entries' own choice for the entry size
            configs.append(DEFAULT_CONFIG)
        else:
            block_bytes, warps = (int(x) for x in spec.split(":"))
            configs.append(LaunchConfig(block_bytes=block_bytes, num_warps=warps))
    want = src.view(tensors, pool_pages, -1)[:, torch.as_tensor(src_pages, device=dev)]
    # the factors of the same copy (the kernel path's form): one offset per tensor, one column per page
    offsets = (np.arange(tensors, dtype=np.int64) * pool_pages).astype(np.int32)
    s_cols, d_cols = src_pages.astype(np.int32), dst_pages.astype(np.int32)
    calls: list[tuple[LaunchConfig, bool | str]] = [(cfg, False) for cfg in configs] + [
        (DEFAULT_CONFIG, True)
    ]
    # integrity's two reads (docs/INTEGRITY.md): the copy that sums what it copies (the kernel path's
    # writer) and the decode's check of the landed pages (checksum_heads), both in the room's gather
    # layout [tensor, token, head, dim], where entry (t, j) is one run starting at (t * tokens + j * ps)
    row_words = page_bytes // 4
    first = (np.arange(tensors, dtype=np.int64) * pages)[:, None] + np.arange(pages, dtype=np.int64)[None, :]
    word_order = WordOrder((first * row_words).reshape(-1), row_words)
    summed_out = torch.zeros(1, dtype=torch.int64, device=dev)
    checked_out = torch.zeros(1, dtype=torch.int64, device=dev)
    kv = [
        dst[t].view(torch.bfloat16).view(pool_pages, args.page_size, args.heads, args.head_dim)
        for t in range(tensors)
    ]
    slots = torch.from_numpy(
        (dst_pages[:, None] * args.page_size + np.arange(args.page_size)[None, :])
        .reshape(-1)
        .astype(np.int64)
    )
    table = as_kv_table(kv)
    outer_order = WordOrder(np.arange(tensors, dtype=np.int64) * pages * row_words, row_words,
                            cols=np.arange(pages, dtype=np.int64) * row_words)  # fmt: skip
    calls += [(DEFAULT_CONFIG, "summed"), (DEFAULT_CONFIG, "summed_outer"), (DEFAULT_CONFIG, "check")]

    def call(cfg: LaunchConfig, factors: bool | str) -> None:
        if factors == "summed":
            copy_entries(src_t, dst_t, s_idx, d_idx, config=cfg, checksum=summed_out, order=word_order)
        elif factors == "summed_outer":
            copy_outer(
                src_t, dst_t, offsets, s_cols, d_cols, config=cfg, checksum=summed_out, order=outer_order
            )
        elif factors == "check":
            checksum_heads(table, slots, 0, args.heads, out=checked_out)
        elif factors:
            copy_outer(src_t, dst_t, offsets, s_cols, d_cols, config=cfg)
        else:
            copy_entries(src_t, dst_t, s_idx, d_idx, config=cfg)

    exact = []
    for cfg, factors in calls:  # each shape checked bit-exact once (its first launch also compiles it)
        if factors == "check":  # the pages hold the room (the summed copy ran last): the sums must agree
            call(cfg, factors)
            exact.append(int(checked_out.item()) == int(summed_out.item()))
            continue
        dst.zero_()
        call(cfg, factors)
        got = dst.view(tensors, pool_pages, -1)[:, torch.as_tensor(dst_pages, device=dev)]
        exact.append(bool(torch.equal(got, want)))
    # rounds over every shape and the raw copy, each round in a rotated order (no shape always first)
    samples: dict[int, list[tuple[float, float]]] = {i: [] for i in range(-1, len(calls))}
    order = list(range(-1, len(calls)))
    for r in range(args.reps):
        for i in order[r % len(order) :] + order[: r % len(order)]:
            if i < 0:
                samples[i].append(one(raw))
            else:
                samples[i].append(one(lambda c=calls[i]: call(*c)))
    raw_ms = statistics.median(d for d, _ in samples[-1])
    raw_gbs = nbytes / raw_ms / 1e6
    print(
        f"room {nbytes / 1e9:.3f} GB, {s_idx.size} entries of {page_bytes} B, page size {args.page_size}; "
        f"raw copy {raw_ms:.3f} ms = {raw_gbs:.0f} GB/s (device time, median of {args.reps} rotated rounds)"
    )
    rows = []
    for i, (cfg, factors) in enumerate(calls):
        ms = statistics.median(d for d, _ in samples[i])
        host = statistics.median(h for _, h in samples[i])
        gbs = nbytes / ms / 1e6
        rows.append({"block_bytes": cfg.block_bytes, "num_warps": cfg.num_warps, "factors": factors, "ms": ms, "gbs": gbs,
                     "ratio": gbs / raw_gbs, "host_ms": host, "exact": exact[i]})  # fmt: skip
        name = {True: "copy_outer", False: "copy_entries", "summed": "copy_entries summed", "summed_outer": "copy_outer summed (integrity's writer on the kernel path)",
                "check": "checksum_heads of the landed pages (integrity's decode check; exact: equals the summed copy's)"}[factors]  # fmt: skip
        print(
            f"{name} block_bytes={cfg.block_bytes} num_warps={cfg.num_warps}: {ms:.3f} ms = {gbs:.0f} GB/s, "
            f"{gbs / raw_gbs:.2f} of raw; host call {host:.3f} ms; exact {exact[i]}"
        )
    print(json.dumps({"page_size": args.page_size, "entry_bytes": page_bytes, "entries": int(s_idx.size),
                      "room_bytes": nbytes, "raw_gbs": raw_gbs, "rows": rows}))  # fmt: skip
    if args.host_profile:
        _host_profile(args.host_profile, lambda: copy_outer(src_t, dst_t, offsets, s_cols, d_cols), dev)


def _host_profile(n: int, fn, dev: torch.device) -> None:
    """``n`` calls of ``fn`` back to back: their host time unprofiled (median), then under cProfile the
    top 20 functions by own time, in us per call (cProfile adds its own cost per function call: read
    the shares)."""
    import cProfile
    import pstats

    def calls() -> list[float]:
        times = []
        for i in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            if i % 16 == 15 and dev.type == "cuda":  # a bounded queue: the copies run 16 at a time
                torch.cuda.synchronize(dev)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return times

    plain = calls()
    prof = cProfile.Profile()
    prof.enable()
    profiled = calls()
    prof.disable()
    print(
        f"host call of copy_outer, {n} back to back: {statistics.median(plain) * 1e6:.1f} us median "
        f"({statistics.median(profiled) * 1e6:.1f} us under cProfile); top 20 by own time, us per call:"
    )
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:20]
    for (file, line, func), (_, ncalls, own, cum, _) in rows:
        print(
            f"  {own / n * 1e6:8.1f} own {cum / n * 1e6:8.1f} cum {ncalls / n:6.1f} calls  {file[-48:]}:{line} {func}"
        )


if __name__ == "__main__":
    main()
