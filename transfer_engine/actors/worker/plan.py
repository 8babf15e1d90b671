"""What one WriteJob moves, as pure functions of the job and the two sides' layouts.

The worker (:mod:`transfer_engine.actors.worker`) asks these which path a job takes, which token
slots a staged chunk gathers, which descriptors a direct or slice WRITE carries (a whole chunk, or
one layer group's tensors, which are rows of the chunk's: :func:`group_index`) and the notification
that rides on it. No I/O, no state: tested without sockets (``tests/unit/test_descriptors.py``).
"""

from __future__ import annotations

import numpy as np

from transfer_engine.errors import TransferError
from transfer_engine.memory.layout import KVPool, stride_rows_of
from transfer_engine.protocol import descriptors
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.layers import group_tensors
from transfer_engine.protocol.paths import is_staged
from transfer_engine.runtime.mail import WriteJob


def is_staged_job(job: WriteJob) -> bool:
    return job.chunk is not None and is_staged(job.request.path)


def chunk_slots(job: WriteJob, pool: KVPool, dst_pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The token slots a chunk job moves on each side: the prefill's, from its own pages, and the
    decode's, from ``dst_pages`` (every page of the request), clipped to the request's capacity."""
    peer, chunk = job.peer, job.chunk
    assert chunk is not None
    src_ps, dst_ps = pool.layout.page_size, peer.layout.page_size
    start = chunk.page_start * src_ps
    tokens = descriptors.chunk_tokens(start, chunk.num_pages, src_ps, len(dst_pages) * dst_ps)
    return descriptors.slots_of(job.src_pages, src_ps, 0, tokens), descriptors.slots_of(
        dst_pages, dst_ps, start, tokens
    )


def staged_slots(job: WriteJob, pool: KVPool) -> np.ndarray:
    """The prefill token slots a staged chunk gathers (clipped to the decode rank's capacity)."""
    return chunk_slots(job, pool, np.asarray(job.request.dst_pages, dtype=np.int64))[0]


def chunk_notification(job: WriteJob, region: int) -> bytes:
    """The encoded ``ChunkLanded`` riding on a chunk's WRITE (``region`` -1 off the staged paths)."""
    chunk = job.chunk
    assert chunk is not None
    return m.encode(
        m.ChunkLanded(
            room=job.room,
            chunk_id=chunk.chunk_id,
            last=chunk.last,
            sender=job.sender,
            page_start=chunk.page_start,
            num_pages=chunk.num_pages,
            region=region,
            layers=None if job.group is None else job.group.layers,
        )
    )


def group_rows(job: WriteJob, pool: KVPool) -> np.ndarray | None:
    """The KV tensor indices a layer-wise job moves (``protocol.layers.group_tensors``), else None."""
    if job.group is None:
        return None
    layout = pool.layout
    return group_tensors(layout.num_layers, layout.mla, job.group.start, job.group.end)


def plan_write(
    job: WriteJob, pool: KVPool, bases: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, bytes]:
    """The WRITE for a job: ``(src_addr, dst_addr, length, notification)``. Pure; raises TransferError.

    Direct path: coalesced page runs of every KV tensor. Slice path: one descriptor per tensor and
    token, covering the writer's head slice. Aux: one descriptor.
    """
    req, peer, chunk = job.request, job.peer, job.chunk
    if chunk is None:
        assert (
            job.aux_slot is not None
            and req.aux_slot is not None
            and peer.aux is not None
            and pool.aux is not None
        )
        item = pool.aux.shape[1]
        src = np.array([pool.aux.data_ptr() + job.aux_slot * item], dtype=np.uint64)
        dst = np.array([peer.aux.addr + req.aux_slot * item], dtype=np.uint64)
        return (
            src,
            dst,
            np.array([item], dtype=np.uint64),
            m.encode(m.AuxLanded(room=job.room, sender=job.sender)),
        )
    return (*chunk_descriptors(job, pool, bases, group_rows(job, pool)), chunk_notification(job, region=-1))


def shares_lists(job: WriteJob, pool: KVPool) -> bool:
    """Whether ``job``, a layer group of a direct or slice chunk in the contiguous layout, is made from
    descriptor lists prepared once for its whole chunk (``NixlTransport.prepare_lists``): its
    descriptors are then rows of the chunk's, tensor-major (:func:`group_index`)."""
    return (
        job.group is not None
        and job.chunk is not None
        and not is_staged_job(job)
        and pool.strides is None
        and job.peer.layout.strides is None
    )


def group_index(rows: np.ndarray, per_tensor: int) -> np.ndarray:
    """Positions in a chunk's tensor-major descriptors (``per_tensor`` of each tensor) of the tensors
    ``rows``, in row order."""
    return (rows[:, None] * per_tensor + np.arange(per_tensor, dtype=np.int64)).ravel()


def chunk_descriptors(
    job: WriteJob, pool: KVPool, bases: np.ndarray, rows: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(src_addr, dst_addr, length)`` of a chunk job's WRITE (see :func:`plan_write`): of the tensors
    ``rows`` (one layer group's), or of every tensor when None. Pure; raises TransferError."""
    req, peer, chunk = job.request, job.peer, job.chunk
    assert chunk is not None
    dst_pages_all = np.asarray(req.dst_pages, dtype=np.int64)
    spec = req.slices[0]
    if pool.strides is not None or peer.layout.strides is not None:
        return _strided_write(job, pool, bases, dst_pages_all, spec, rows)
    peer_bases = peer.bases
    if rows is not None:  # one group of layers: its tensors only, on both sides
        bases, peer_bases = bases[rows], peer_bases[rows]
    if req.path == "direct":
        dst_pages = dst_pages_all[chunk.page_start : chunk.page_start + chunk.num_pages]
        if len(dst_pages) != len(job.src_pages):
            raise TransferError(
                f"room {job.room}: chunk {chunk.chunk_id} covers request pages "
                f"[{chunk.page_start}, {chunk.page_start + chunk.num_pages}) but decode rank "
                f"{req.decode_rank} gave only {len(dst_pages_all)} pages"
            )
        return descriptors.direct_descriptors(bases, peer_bases, pool.page_bytes, job.src_pages, dst_pages)
    src_slots, dst_slots = chunk_slots(job, pool, dst_pages_all)
    return descriptors.slice_descriptors(
        bases,
        peer_bases,
        pool.slot_bytes,
        peer.slot_bytes(pool.itemsize),
        pool.head_bytes,
        src_slots,
        dst_slots,
        spec.src_head_start,
        spec.dst_head_start,
        spec.num_heads,
    )


def _strided_write(
    job: WriteJob,
    pool: KVPool,
    bases: np.ndarray,
    dst_pages: np.ndarray,
    spec: m.SliceSpec,
    rows: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Direct or slice WRITE where either side is not contiguous ``[slots, H, D]``: byte runs from both
    sides' strides, merged where both are contiguous (``descriptors.strided_descriptors``). ``rows``:
    the tensors of one layer group (their strides rows on both sides), or None for every tensor."""
    peer = job.peer
    src_slots, dst_slots = chunk_slots(job, pool, dst_pages)
    src_rows = pool.stride_rows
    dst_rows = stride_rows_of(peer.layout, peer.heads_local)
    if rows is not None:
        src_rows, dst_rows = src_rows[rows], dst_rows[rows]
    return descriptors.strided_descriptors(
        bases,
        pool.region_lengths,
        src_rows,
        peer.bases,
        np.array([r.length for r in peer.regions], dtype=np.uint64),
        dst_rows,
        pool.head_bytes,
        src_slots,
        dst_slots,
        pool.layout.page_size,
        peer.layout.page_size,
        spec.src_head_start,
        spec.dst_head_start,
        spec.num_heads,
        pool.heads_local,
        peer.heads_local,
    )
