"""CPU time of planning one layer group's WRITE: the per-group planner against descriptor tables.

    python tools/bench_plan.py [--tokens 1024 4096 16384] [--shapes realistic scattered]
                               [--layers-per-write 4] [--old-reps 5] [--new-reps 300]

A Qwen3-32B-like KV cache as vLLM 0.32 lays it out for FlashAttention (``LBNHC``: one backing
buffer, per layer ``[blocks, 16 tokens, 8 heads, K|V of 128 bf16]``), 64 layers, one request of
``--tokens`` tokens on page tables of each ``--shapes`` (``transfer_engine.testing.pagetables``:
the writer's and the reader's from unrelated allocators). Per case, the first layer group
(``--layers-per-write`` layers) of the whole request, planned

- the old way, as ``actors/worker/plan.py``'s strided path does it: both sides' token slots
  (``descriptors.slots_of``) and ``descriptors.strided_descriptors`` over the group's strides rows
  (one run per (tensor, token, head), sorted and merged);
- from tables (``protocol/tables.py``): ``write_indices`` for the group (the chunk's slot groups
  included); the tables themselves (``decide_table``, ``side_entries``) are made once per peer at
  handshake and timed apart, with their entries and memory over this pool, and last over a pool
  of ``--big-pool`` pages (equal TP and the TP-2 writer);
- as the worker makes it (``actors/worker/plan.py``): both sides' index arrays and addresses into
  its strided-row tables (``table_indices``, the chunk's slot groups computed once per chunk and
  shared by its groups, so not counted here), merged as NIXL merges them (``merged_runs``: the
  descriptors NIXL posts); and each side's rows (``side_table``), made once per peer: rows a side
  and their ms, over this pool and over the big pool (the rows do not grow with it).

Cases: equal TP (the direct path), a TP-2 writer into a TP-1 reader (hetero-TP head slice), and
an HND reader (NHD -> HND: the finest entries). Times are this thread's CPU time
(``time.thread_time_ns``), median over the repetitions, so a loaded box slows them little.
Prints one table; docs/PERF.md, "Planning from descriptor tables", has the figures.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from transfer_engine.actors.worker.plan import side_table, table_write
from transfer_engine.protocol import descriptors, tables
from transfer_engine.protocol.layers import group_tensors
from transfer_engine.testing.pagetables import pool_pages, room_tables, side_seed

LAYERS, HEADS, HEAD_BYTES, PAGE = 64, 8, 128 * 2, 16
AXES = "LBHNC"


@dataclass(frozen=True)
class Rank:
    bases: np.ndarray
    lengths: np.ndarray
    rows: np.ndarray
    heads_local: int


def vllm_rank(order: str, blocks: int, heads_local: int, base: int) -> Rank:
    """One rank's vLLM caches: one buffer ``[L, B, H, N, K|V]`` in ``order``, as strides rows."""
    shape = dict(zip(AXES, (LAYERS, blocks, heads_local, PAGE, 2 * HEAD_BYTES), strict=True))
    stride, size = {}, 1
    for axis in reversed(order):
        stride[axis] = size
        size *= shape[axis]
    k = [(0, layer * stride["L"], stride["B"], stride["H"], stride["N"]) for layer in range(LAYERS)]
    rows = np.array(k + [(0, off + HEAD_BYTES, b, h, n) for _, off, b, h, n in k], dtype=np.int64)
    return Rank(np.array([base], dtype=np.uint64), np.array([size], dtype=np.uint64), rows, heads_local)


@dataclass(frozen=True)
class Case:
    name: str
    dst_order: str
    src_heads: int
    dst_heads: int
    dst_head_start: int


CASES = (
    Case("direct NHD->NHD", "LBNHC", HEADS, HEADS, 0),
    Case("slice TP2->TP1", "LBNHC", HEADS // 2, HEADS, HEADS // 2),
    Case("NHD->HND", "LBHNC", HEADS, HEADS, 0),
)


def cpu_ms(fn: Callable[[], object], reps: int) -> float:
    """Median thread CPU time of ``fn`` in ms over ``reps`` calls (after one warm-up call)."""
    fn()
    samples = []
    for _ in range(reps):
        t0 = time.thread_time_ns()
        fn()
        samples.append(time.thread_time_ns() - t0)
    return statistics.median(samples) / 1e6


def plan_old(
    src: Rank,
    dst: Rank,
    case: Case,
    rows: np.ndarray,
    src_pages: np.ndarray,
    dst_pages: np.ndarray,
    tokens: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``plan.py``'s strided path for one group: both sides' slots, then ``strided_descriptors``."""
    src_slots = descriptors.slots_of(src_pages, PAGE, 0, tokens)
    dst_slots = descriptors.slots_of(dst_pages, PAGE, 0, tokens)
    return descriptors.strided_descriptors(
        src.bases, src.lengths, src.rows[rows], dst.bases, dst.lengths, dst.rows[rows], HEAD_BYTES,
        src_slots, dst_slots, PAGE, PAGE, 0, case.dst_head_start, case.src_heads, src.heads_local,
        dst.heads_local,
    )  # fmt: skip


def make_tables(
    src: Rank, dst: Rank, case: Case, pages: int, group_layers: int
) -> tuple[tables.TableSpec, int, float]:
    """The pair's spec and both sides' tables over ``pages`` pages: (spec, entries, thread CPU ms)."""
    t0 = time.thread_time_ns()
    spec = tables.decide_table(
        src.rows, dst.rows, HEAD_BYTES, PAGE, PAGE, 0, case.dst_head_start, case.src_heads,
        src.heads_local, dst.heads_local, group_layers=group_layers,
    )  # fmt: skip
    src_addr, _ = tables.side_entries(spec, "src", src.bases, src.lengths, src.rows, pages)
    dst_addr, _ = tables.side_entries(spec, "dst", dst.bases, dst.lengths, dst.rows, pages)
    return spec, src_addr.size + dst_addr.size, (time.thread_time_ns() - t0) / 1e6


def worker_rows(src: Rank, dst: Rank, spec: tables.TableSpec, pages: int) -> tuple[tuple, float]:
    """Both sides' strided-row tables (``plan.side_table``) over ``pages`` pages, and their thread CPU ms."""
    t0 = time.thread_time_ns()
    sides = (
        side_table(spec, "src", src.bases, src.lengths, src.rows, pages),
        side_table(spec, "dst", dst.bases, dst.lengths, dst.rows, pages),
    )
    return sides, (time.thread_time_ns() - t0) / 1e6


def plan_worker(spec, sides, groups, units) -> tuple[np.ndarray, ...]:  # noqa: ANN001
    """One group's WRITE as the worker makes it from its tables, given the chunk's slot groups."""
    return table_write(sides[0], sides[1], groups, units, spec.entry_bytes)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--shapes", nargs="+", default=["realistic", "scattered"])
    parser.add_argument("--layers-per-write", type=int, default=4)
    parser.add_argument("--old-reps", type=int, default=5)
    parser.add_argument("--new-reps", type=int, default=300)
    parser.add_argument(
        "--big-pool", type=int, default=131072, help="pages of the pool the tables are timed over last"
    )
    args = parser.parse_args()

    rows = group_tensors(LAYERS, False, 0, args.layers_per_write)
    print(
        f"{LAYERS} layers, {HEADS} KV heads of {HEAD_BYTES} bytes, page {PAGE}, vLLM LBNHC writer; "
        f"one group of {args.layers_per_write} layers; thread CPU ms, median"
    )
    header = (
        "| case | tokens | old ms | old descriptors | new ms | new indices | of which chunk_groups ms "
        "| entry | tables once: pool pages, entries (both sides), MiB, ms | worker ms | worker descriptors "
        "| worker rows (both sides), ms |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for shape in args.shapes:
        for tokens in args.tokens:
            pages = -(-tokens // PAGE)
            total = pool_pages(shape, pages, 8)
            src_pages = room_tables(shape, pages, 8, seed=side_seed(1, "prefill"))[3]
            dst_pages = room_tables(shape, pages, 8, seed=side_seed(1, "decode"))[5]
            for case in CASES:
                src = vllm_rank("LBNHC", total, case.src_heads, 1 << 40)
                dst = vllm_rank(case.dst_order, total, case.dst_heads, 1 << 44)
                spec, entries, once_ms = make_tables(src, dst, case, total, args.layers_per_write)
                old = functools.partial(plan_old, src, dst, case, rows, src_pages, dst_pages, tokens)
                new = functools.partial(
                    tables.write_indices, spec, src_pages, dst_pages, rows, num_tokens=tokens
                )
                groups = functools.partial(tables.chunk_groups, spec, src_pages, dst_pages, num_tokens=tokens)
                old_ms, new_ms = cpu_ms(old, args.old_reps), cpu_ms(new, args.new_reps)
                groups_ms = cpu_ms(groups, args.new_reps)
                sides, rows_ms = worker_rows(src, dst, spec, total)
                worker = functools.partial(plan_worker, spec, sides, groups(), tables.units_of(spec, rows))
                worker_ms = cpu_ms(worker, args.new_reps)
                print(
                    f"| {case.name} ({shape}) | {tokens} | {old_ms:.2f} | {len(old()[0])} | {new_ms:.3f} | "
                    f"{len(new()[0])} | {groups_ms:.3f} | {spec.granularity} | {total}, {entries}, "
                    f"{entries * 8 / 2**20:.1f}, {once_ms:.0f} | {worker_ms:.3f} | {len(worker()[2])} | "
                    f"{sides[0].rows.rows + sides[1].rows.rows}, {rows_ms:.2f} |",
                    flush=True,
                )
    big = args.big_pool
    for case in CASES[:2]:
        src = vllm_rank("LBNHC", big, case.src_heads, 1 << 40)
        dst = vllm_rank(case.dst_order, big, case.dst_heads, 1 << 44)
        spec, entries, once_ms = make_tables(src, dst, case, big, args.layers_per_write)
        sides, rows_ms = worker_rows(src, dst, spec, big)
        print(
            f"tables of {case.name} over {big} pages ({big * PAGE} tokens): {spec.granularity}, {entries} entries "
            f"(both sides), {entries * 8 / 2**20:.0f} MiB of addresses, {once_ms:.0f} ms; the worker's strided "
            f"rows: {sides[0].rows.rows + sides[1].rows.rows} (both sides), {rows_ms:.2f} ms"
        )


if __name__ == "__main__":
    main()
