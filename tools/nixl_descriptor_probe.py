"""What one NIXL descriptor costs: one-shot ``initialize_xfer`` against prepared lists, same bytes.

    python tools/nixl_descriptor_probe.py [--device cuda|pinned] [--mib 1024] [--pieces 128] [--gapped]
                                          [--threads N [--split K]]

Two processes (GPU 0 -> GPU 1 with ``--device cuda``, so UCX takes cuda_ipc). The initiator WRITEs
``--mib`` MiB as 1 descriptor, then as ``--pieces`` descriptors built per transfer
(``initialize_xfer``), then as the same pieces from prepared lists (``make_prepped_xfer``), and
then from lists prepared for each transfer (``per-transfer``), and prints for each the median time to create the transfer, to post it, and to see it DONE, and the
rate. ``--gapped`` leaves a gap after every piece (pieces at twice their size apart), as the pages
of one room lie in a KV pool: adjacent pieces may be merged somewhere below ``transfer()``, gapped
ones cannot. ``--threads N`` gives the initiator's UCX backend NIXL's ``num_threads`` (a pool of
threads that each post a share of a transfer's descriptors; ``--split K``: its ``split_batch_size``).
On a machine with one GPU both processes use it. Not an engine benchmark: it tells how much of a multi-descriptor WRITE's extra cost is NIXL's
per-transfer validation (which prepared lists skip) and how much is moving many pieces.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

REPS = 7


def _agent(name: str, threads: int = 0, split: int = 0) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    if threads == 0:
        return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    params = {"num_threads": str(threads)}
    if split:
        params["split_batch_size"] = str(split)
    agent.create_backend("UCX", params)
    return agent


def _buffer(args: argparse.Namespace, index: int) -> tuple[torch.Tensor, str, int]:
    nbytes = args.mib << (21 if args.gapped else 20)  # gapped: every piece followed by a gap of its size
    if args.device == "cuda":
        index %= torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{index}"), "VRAM", index
    pinned = args.device == "pinned"  # host memory as the host path stages in: pinned by CUDA
    return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pinned), "DRAM", 0


def target(args: argparse.Namespace, conn: Connection) -> None:
    agent = _agent("probe-target", args.target_threads, args.split if args.target_threads else 0)
    buf, mem, dev = _buffer(args, 1)
    agent.register_memory(buf, mem)
    conn.send((agent.get_agent_metadata(), buf.data_ptr(), mem, dev))
    agent.add_remote_agent(conn.recv())
    while not conn.poll():  # progress (UCX may need the target's calls) until told to stop
        agent.get_new_notifs()


def _table(
    nbytes: int, pieces: int, remote: int, dev: int, local: int, ldev: int, gapped: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    size = nbytes // pieces
    offs = np.arange(pieces, dtype=np.uint64) * np.uint64(size * (2 if gapped else 1))
    loc = np.stack(
        [np.uint64(local) + offs, np.full(pieces, size, np.uint64), np.full(pieces, ldev, np.uint64)], 1
    )
    rem = np.stack(
        [np.uint64(remote) + offs, np.full(pieces, size, np.uint64), np.full(pieces, dev, np.uint64)], 1
    )
    return loc, rem


def _one_shot(agent: Any, loc: np.ndarray, rem: np.ndarray, mem: str, rmem: str, peer: str) -> Any:
    return agent.initialize_xfer(
        "WRITE", agent.get_xfer_descs(loc, mem), agent.get_xfer_descs(rem, rmem), peer, b"n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda", "pinned"],
        help="pinned: host memory pinned by CUDA",
    )
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--pieces", type=int, default=128)
    parser.add_argument(
        "--gapped", action="store_true", help="a gap after every piece (buffers are 2x --mib)"
    )
    parser.add_argument("--threads", type=int, default=0, help="UCX backend num_threads of the initiator")
    parser.add_argument(
        "--target-threads",
        type=int,
        default=0,
        help="the target's num_threads (an engine's decode has 4 on GPUs)",
    )
    parser.add_argument("--split", type=int, default=0, help="UCX backend split_batch_size (with --threads)")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=target, args=(args, theirs))
    proc.start()
    agent = _agent("probe-initiator", args.threads, args.split)
    buf, mem, ldev = _buffer(args, 0)
    agent.register_memory(buf, mem)
    md, remote, rmem, dev = mine.recv()
    peer = agent.add_remote_agent(md)
    mine.send(agent.get_agent_metadata())
    nbytes = args.mib << 20

    def run(make: Callable[[], Any]) -> tuple[float, float, float]:
        times = []
        for _ in range(REPS + 1):
            t0 = time.perf_counter()
            handle = make()
            t1 = time.perf_counter()
            state = agent.transfer(handle)
            t2 = time.perf_counter()
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            t3 = time.perf_counter()
            assert state == "DONE", state
            agent.release_xfer_handle(handle)
            times.append((t1 - t0, t2 - t1, t3 - t2))
        rows = times[1:]
        make_s, post_s, done_s = (statistics.median(r[i] for r in rows) for i in range(3))
        return make_s, post_s, done_s

    results: dict[str, tuple[float, float, float]] = {}
    for pieces in (1, args.pieces):
        loc, rem = _table(nbytes, pieces, remote, dev, buf.data_ptr(), ldev, args.gapped)
        results[f"one-shot x{pieces}"] = run(functools.partial(_one_shot, agent, loc, rem, mem, rmem, peer))
    loc, rem = _table(nbytes, args.pieces, remote, dev, buf.data_ptr(), ldev, args.gapped)
    local_h = agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(loc, mem))
    remote_h = agent.prep_xfer_dlist(peer, agent.get_xfer_descs(rem, rmem))
    idx = np.arange(args.pieces)
    results[f"prepared x{args.pieces}"] = run(
        lambda: agent.make_prepped_xfer("WRITE", local_h, idx, remote_h, idx, b"n")
    )
    prepared_now: list[Any] = []

    def prepare_and_make() -> Any:  # lists prepared for this one transfer, as a per-chunk list would be
        for h in prepared_now:
            agent.release_dlist_handle(h)
        prepared_now[:] = [
            agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(loc, mem)),
            agent.prep_xfer_dlist(peer, agent.get_xfer_descs(rem, rmem)),
        ]
        return agent.make_prepped_xfer("WRITE", prepared_now[0], idx, prepared_now[1], idx, b"n")

    results[f"per-transfer x{args.pieces}"] = run(prepare_and_make)
    mine.send("stop")
    proc.join()
    for name, (make, post, done) in results.items():
        total = make + post + done
        print(
            f"{args.device} {args.mib} MiB{' gapped' if args.gapped else ''} threads={args.threads}"
            f"{f' split={args.split}' if args.split else ''} {name:>14}: create {make * 1e6:8.1f} us, post {post * 1e6:8.1f} us, "
            f"to DONE {done * 1e6:8.1f} us, {nbytes / total / 1e9:7.1f} GB/s"
        )


if __name__ == "__main__":
    main()
