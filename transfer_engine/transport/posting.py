"""NIXL's posting threads: the backend parameters an engine's agent is made with, and how a
host-memory WRITE is cut so that those threads copy it side by side (docs/DECISIONS.md, "NIXL's
posting threads on GPU pools", "Host WRITEs are cut for the posting threads"). Pure functions.
"""

from __future__ import annotations

import numpy as np

POST_THREADS = 4
"""UCX posting threads of an agent whose KV is in GPU memory (NIXL's ``num_threads``). UCX's cuda_ipc
pays about 8 us per descriptor inside ``transfer()`` on an H100 host, so a one-page room of 128 KV
tensors (128 descriptors) posted for 1.06 ms; four threads that each post a batch cut it to 0.33 ms
and the small room's latency by 0.57 ms (docs/PERF.md, "Posting on threads"). Idle threads cost
nothing (measured: no CPU while no transfer is out)."""
POST_SPLIT = 16
"""Descriptors per batch handed to a posting thread (NIXL's ``split_batch_size``). Its own default
is far above a room's descriptors, so without it no WRITE of ours was ever split."""


def default_params(backend: str, params: dict[str, str], device_type: str) -> dict[str, str]:
    """The backend parameters an engine's agent is made with: ``params`` as given, plus, for UCX with
    KV in GPU memory and no ``num_threads`` given, POST_THREADS threads splitting WRITEs in batches of
    POST_SPLIT descriptors. ``num_threads=0`` in ``params`` (``TE_NIXL_PARAMS``) keeps one thread.
    CPU pools keep NIXL's defaults: there UCX copies the bytes inside ``transfer()`` and the engine's
    CPU figures were measured without threads."""
    if backend != "UCX" or device_type != "cuda" or "num_threads" in params:
        return dict(params)
    return {**params, "num_threads": str(POST_THREADS), "split_batch_size": str(POST_SPLIT)}


HOST_PIECE_MIN = 256 << 10
"""Smallest piece a host-memory WRITE is cut into for the posting threads (:func:`spread`)."""


def host_pieces(params: dict[str, str]) -> int:
    """How many pieces a host-memory (DRAM) WRITE is spread over: NIXL's ``num_threads`` x
    ``split_batch_size`` when the backend has both, else 0 (never cut).

    UCX copies a DRAM -> DRAM WRITE between processes on one host inside ``transfer()``, on the
    caller's thread, unless the WRITE has more descriptors than one posting batch, and NIXL merges
    descriptors that follow each other in memory. Measured on the GPU machine with this transport
    (docs/PERF.md, "Host WRITEs spread over the posting threads"), 1 GiB of pinned memory: one
    descriptor, or 64 adjacent pieces, posted for 190-290 ms at 3.7-5.6 GB/s; 64 pieces listed
    as :func:`spread` lists them posted in 0.3-0.6 ms and were DONE at 9.8-15.7 GB/s."""
    try:
        threads, batch = int(params.get("num_threads", 0)), int(params.get("split_batch_size", 0))
    except ValueError:
        return 0  # NIXL itself refuses such params when the agent is made
    return threads * batch if threads > 0 and batch > 0 else 0


def spread(
    src: np.ndarray,
    dst: np.ndarray,
    length: np.ndarray,
    devices: np.ndarray | int,
    pieces: int,
    min_piece: int = HOST_PIECE_MIN,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | int]:
    """The same bytes as about ``pieces`` descriptors of equal size (each at least ``min_piece``,
    the last of each descriptor shorter): every descriptor is cut at multiples of that size, and the
    pieces are listed so that no two neighbours in the list are neighbours in memory. Returns the
    inputs unchanged when nothing needs cutting."""
    total = int(length.sum())
    if pieces <= 1 or total == 0:
        return src, dst, length, devices
    size = np.uint64(max(min_piece, -(-total // pieces)))
    counts = np.maximum((length + size - np.uint64(1)) // size, np.uint64(1)).astype(np.int64)
    if (counts == 1).all():
        return src, dst, length, devices
    which = np.repeat(np.arange(len(length)), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    offset = (np.arange(len(which)) - first).astype(np.uint64) * size
    # The odd pieces, then the even ones: NIXL merges a descriptor that starts where the one before
    # it in the list ends back into one (which one thread copies inside transfer()); here none does.
    order = np.concatenate([np.arange(1, len(which), 2), np.arange(0, len(which), 2)])
    which, offset = which[order], offset[order]
    cut = np.minimum(size, length[which] - offset)
    cut_devices = devices[which] if isinstance(devices, np.ndarray) else devices
    return src[which] + offset, dst[which] + offset, cut, cut_devices
