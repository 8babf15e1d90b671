"""What one WriteJob moves, as pure functions of the job and the two sides' layouts.

The worker (:mod:`transfer_engine.actors.worker`) asks these which path a job takes, which token
slots a staged chunk gathers, which descriptors a direct or slice WRITE carries (a whole chunk, or
one layer group's tensors, which are rows of the chunk's: :func:`group_index`) and the notification
that rides on it. No I/O, no state: tested without sockets (``tests/unit/test_descriptors.py``).

A direct or slice WRITE is made from descriptor tables where its pair has them (docs/DECISIONS.md,
"Descriptor tables made once per peer"): :func:`table_spec` decides a pair's entry once,
:func:`side_table` lays each side's table out as NIXL's strided rows, and per WRITE
:func:`table_chunk_groups` (once per chunk) and :func:`table_indices` give both sides' index arrays
and addresses (``tests/unit/test_table_plan.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from transfer_engine.errors import AddressRangeError, ConfigError, TransferError
from transfer_engine.memory.layout import KVPool, stride_rows_of
from transfer_engine.protocol import descriptors, tables
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.layers import group_tensors
from transfer_engine.protocol.paths import is_staged
from transfer_engine.runtime.mail import WriteJob
from transfer_engine.transport.interface import TableRows


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
    return chunk_slots(job, pool, job.request.pages.astype(np.int64))[0]


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
    dst_pages_all = req.pages.astype(np.int64)
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


# --- descriptor tables: one per (decode agent, TableSpec), made once; each WRITE is two index arrays --


@dataclass(frozen=True, slots=True)
class SideTable:
    """One side's descriptor table for a :class:`~transfer_engine.protocol.tables.TableSpec`, over
    that side's whole pool, as NIXL's strided rows (:class:`~transfer_engine.transport.interface.TableRows`).

    Rows are the entries of page 0 in ``protocol.tables``' order (token group, unit, head group), each
    stepping over the pages (``token_groups`` = the spec's groups per page, ``count`` = pages); where
    a unit's pages follow each other token for token (``block == page_size * token``: contiguous
    pools, vLLM's NHD caches), one row per (unit, head group) steps over every token group of the
    pool instead (``token_groups`` = 1), so a run of consecutive pages stays one run of entries, which
    NIXL merges into one descriptor. Entry ``(slot group s, unit u, head group h)`` has index
    ``((s % G * U + u) * H + h) * count + s // G`` (``G`` = ``token_groups``)."""

    rows: TableRows
    token_groups: int
    units: int
    heads: int
    unit_stride: np.ndarray
    """uint64, one per unit: the step of that unit's rows (one page, or one token group for slot rows)."""
    group_stride: np.ndarray
    """uint64, one per unit: from a token group's row to the next one's within a page (page rows)."""
    slot_groups: int
    """Slot groups of the pool (``num_pages * groups_per_page``): the bound of a WRITE's slot groups."""

    @property
    def uniform(self) -> bool:
        """Every unit steps alike (the same layout per layer): a WRITE's addresses are one outer sum."""
        return bool(
            (self.unit_stride == self.unit_stride[0]).all()
            and (self.group_stride == self.group_stride[0]).all()
        )

    @property
    def runs(self) -> bool:
        """Consecutive entries of one of its rows may follow each other in memory (one head group, one
        row per unit over every slot group, stepping one entry): the only neighbours NIXL merges."""
        return (
            self.heads == 1 and self.token_groups == 1 and bool((self.unit_stride == self.rows.length).any())
        )


def group_layers_of(job: WriteJob) -> int | None:
    """The ``group_layers`` a job's table is decided with (``tables.decide_table``): None for a whole
    chunk; for a layer group ``[start, end)``, the layers that divide both its start and its size, so
    that every entry unit lies inside it."""
    group = job.group
    return None if group is None else math.gcd(group.start, group.end - group.start)


def table_spec(job: WriteJob, pool: KVPool) -> tables.TableSpec:
    """The table spec of ``job``'s pair (this pool, the decode rank's), for its head slice and layer
    group: ``tables.decide_table`` over both sides' strides tables. Raises ConfigError."""
    peer, head = job.peer, job.request.slices[0]
    return tables.decide_table(
        pool.stride_rows,
        stride_rows_of(peer.layout, peer.heads_local),
        pool.head_bytes,
        pool.layout.page_size,
        peer.layout.page_size,
        head.src_head_start,
        head.dst_head_start,
        head.num_heads,
        pool.heads_local,
        peer.heads_local,
        mla=pool.layout.mla,
        group_layers=group_layers_of(job),
    )


def side_table(
    spec: tables.TableSpec,
    side: tables.Side,
    bases: npt.ArrayLike,
    lengths: npt.ArrayLike,
    strides: npt.ArrayLike,
    num_pages: int,
) -> SideTable:
    """``side``'s table over its whole pool (arguments as ``tables.side_entries``'), as strided rows;
    see :class:`SideTable`. Raises ConfigError naming the tensor when an entry leaves its region."""
    first, _ = tables.side_entries(spec, side, bases, lengths, strides, 1)  # page 0's entries
    table = np.asarray(strides, dtype=np.int64)
    units, heads = spec.num_units, spec.head_groups
    lead = np.array([spec.unit_rows(u)[0] for u in range(units)], dtype=np.int64)
    block, token = table[lead, 2], table[lead, 4]
    per_page, g = spec.groups_per_page(side), spec.tokens_per_entry
    if per_page > 1 and bool((block == per_page * g * token).all()):  # slot rows: pages run token for token
        addr, step, groups, count = first[: units * heads], token * g, 1, num_pages * per_page
    else:
        addr, step, groups, count = first, block, per_page, num_pages
    unit_stride = step.astype(np.uint64)
    group_stride = (token * g).astype(np.uint64)
    stride = np.broadcast_to(unit_stride[None, :, None], (groups, units, heads)).reshape(-1)
    rows = TableRows(addr, np.ascontiguousarray(stride), count, spec.entry_bytes)
    # side_entries checked page 0; every row's last entry is its farthest (strides are >= 0)
    region = np.broadcast_to(table[lead, 0][None, :, None], (groups, units, heads)).reshape(-1)
    base = np.asarray(bases).astype(np.uint64)
    end = rows.addr + rows.spans()
    limit = base[region] + np.asarray(lengths).astype(np.uint64)[region]
    bad = np.flatnonzero(end > limit)
    if bad.size:
        r = int(bad[0])
        tensor = int(lead[(r // heads) % units])
        raise ConfigError(
            f"{side} tensor {tensor}: its last page's entry ends {int(end[r] - base[region[r]])} bytes into "
            f"region {int(region[r])}, which has {int(limit[r] - base[region[r]])} bytes"
        )
    return SideTable(rows, groups, units, heads, unit_stride, group_stride, num_pages * per_page)


def table_chunk_groups(job: WriteJob, pool: KVPool, spec: tables.TableSpec) -> tuple[np.ndarray, np.ndarray]:
    """The slot groups (``tables.chunk_groups``) of a chunk job on each side: the prefill's from its
    pages, the decode's from the request's pages, the chunk clipped to the decode's capacity as
    :func:`chunk_slots` clips it. Raises TransferError as :func:`chunk_descriptors` does, and
    AddressRangeError for a page outside either side's pool (an index there would name another
    tensor's entry)."""
    req, peer, chunk = job.request, job.peer, job.chunk
    assert chunk is not None
    dst_pages = req.pages.astype(np.int64)
    if req.path == "direct" and len(dst_pages[chunk.page_start : chunk.page_start + chunk.num_pages]) != len(
        job.src_pages
    ):
        raise TransferError(
            f"room {job.room}: chunk {chunk.chunk_id} covers request pages "
            f"[{chunk.page_start}, {chunk.page_start + chunk.num_pages}) but decode rank "
            f"{req.decode_rank} gave only {len(dst_pages)} pages"
        )
    src_ps, dst_ps = pool.layout.page_size, peer.layout.page_size
    start = chunk.page_start * src_ps
    tokens = descriptors.chunk_tokens(start, chunk.num_pages, src_ps, len(dst_pages) * dst_ps)
    try:
        src_g, dst_g = tables.chunk_groups(
            spec, job.src_pages, dst_pages, dst_start_token=start, num_tokens=tokens
        )
    except ConfigError as exc:
        raise TransferError(f"room {job.room}: chunk {chunk.chunk_id}: {exc}") from exc
    sides: tuple[tuple[tables.Side, np.ndarray, int, str], ...] = (
        ("src", src_g, pool.num_pages, "this rank's pool"),
        ("dst", dst_g, peer.layout.num_pages, f"decode rank {req.decode_rank}'s pool"),
    )
    for side, got, pages, what in sides:
        if got.size and int(got.max()) >= pages * spec.groups_per_page(side):
            page = int(got.max()) // spec.groups_per_page(side)
            raise AddressRangeError(
                f"room {job.room}: chunk {chunk.chunk_id} names page {page}, outside {what} of {pages} pages"
            )
    return src_g, dst_g


def table_indices(
    side: SideTable, slot_groups: np.ndarray, units: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``(index, addr)`` of one side's entries of a WRITE: int32 table indices and their uint64
    addresses, ordered unit, then slot group (token order), then head group, as
    ``tables.group_indices`` orders a WRITE. Each is one outer sum of a per-(unit, head group) term
    and a per-slot-group term (per unit as well where units step unlike each other)."""
    U, H, C, G = side.units, side.heads, side.rows.count, side.token_groups
    s = slot_groups.astype(np.int64, copy=False)
    if G == 1:
        pos, tg = s, None
        slot_index = s
    else:
        pos, tg = np.divmod(s, G)
        slot_index = tg * (U * H * C) + pos
    row0 = (units.astype(np.int64) * H)[:, None] + np.arange(H, dtype=np.int64)[None, :]  # (units, H)
    index = (row0 * C).astype(np.int32)[:, None, :] + slot_index.astype(np.int32)[None, :, None]
    first = side.rows.addr.reshape(G, U, H)[0][units]  # (units, H): token group 0's rows
    pos64 = pos.astype(np.uint64)
    if side.uniform:
        slot_addr = pos64 * side.unit_stride[0]
        if tg is not None:
            slot_addr += tg.astype(np.uint64) * side.group_stride[0]
        addr = first[:, None, :] + slot_addr[None, :, None]
    else:
        step = pos64[None, :] * side.unit_stride[units][:, None]  # (units, S)
        if tg is not None:
            step += tg.astype(np.uint64)[None, :] * side.group_stride[units][:, None]
        addr = first[:, None, :] + step[:, :, None]
    return index.reshape(-1), addr.reshape(-1)


def table_write(
    src: SideTable, dst: SideTable, groups: tuple[np.ndarray, np.ndarray], units: np.ndarray, entry_bytes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One WRITE from tables: ``(src_index, dst_index, src, dst, length)``, both sides' index arrays
    (:func:`table_indices` of the chunk's slot groups ``groups`` and the ``units``) and the
    descriptors NIXL posts for them: merged (:func:`merged_runs`) where runs of entries may follow
    each other on both sides, else one per entry."""
    src_index, src_addr = table_indices(src, groups[0], units)
    dst_index, dst_addr = table_indices(dst, groups[1], units)
    if src.runs and dst.runs:
        merged = merged_runs(src_addr, dst_addr, entry_bytes, run=len(groups[0]))
        return src_index, dst_index, *merged
    return src_index, dst_index, src_addr, dst_addr, np.full(len(src_addr), entry_bytes, dtype=np.uint64)


def merged_runs(
    src: np.ndarray, dst: np.ndarray, length: int, *, run: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(src, dst, length)`` of entries of ``length`` bytes with neighbours that follow each other on
    both sides merged into one descriptor each, as NIXL merges them when it makes the transfer: the
    WRITE as NIXL posts it (its count, bytes, and ranges for the fault rules). ``run``: no merge
    across multiples of it (entries of one table row come ``run`` at a time; NIXL merges inside a row)."""
    n = len(src)
    step = np.uint64(length)
    if n <= 1:
        return src, dst, np.full(n, step, dtype=np.uint64)
    follows = (src[1:] == src[:-1] + step) & (dst[1:] == dst[:-1] + step)
    if run is not None and 0 < run < n:
        follows[run - 1 :: run] = False
    starts = np.flatnonzero(~follows) + 1
    starts = np.concatenate((np.zeros(1, dtype=starts.dtype), starts))
    counts = np.diff(np.append(starts, n)).astype(np.uint64)
    return src[starts], dst[starts], counts * step
