"""Indexed entry copy: entry ``src_idx[i]`` of one address table onto entry ``dst_idx[i]`` of another.

The kernel path between two pools of one host (docs/DECISIONS.md, "One kernel between the GPUs of a
host") moves a chunk or a layer group as one launch: the writer's pool and the reader's pool, mapped
into the writer's process, are each described ONCE as a table of entry addresses
(``protocol.tables.side_entries``: every (tensor unit, page, head group) entry, all of one size), and
each copy is two int32 index arrays into them (``protocol.tables.write_indices``)::

    for i in range(n):
        memcpy(dst_table[dst_idx[i]], src_table[src_idx[i]], entry_bytes)

Any page table and any head slice is expressed by the tables and the indices, so one kernel serves
every layout. :class:`EntryTable` holds one side's table, uploaded to the device once;
:func:`copy_entries` checks the indices on the host, uploads them on the given stream and launches;
:func:`copy_outer` takes a copy whose indices are outer sums (``offsets[u] + cols[j]``, every copy
the kernel path makes: ``protocol.tables.write_factors``) as the factors, so U + 2C integers go up
for U x C entries and the kernel adds them; :func:`copy_entries_reference` is the pure-torch
reference (and the CPU implementation): the same arguments, a vectorized gather and scatter over
views of the memory the addresses name.

Launch shape: an entry is split into NPIECE equal power-of-two pieces (one piece for entries up to 2
KiB of 8-byte units), and each program copies BLOCK consecutive (entry, piece) pairs, about
``block_bytes``, in 16-byte vectors wherever every address and the entry size are 16-byte aligned
(the table's ``align``): the same tiling as the gather kernel (``kernels/gather.py``). Addresses are
absolute: the kernel casts them to pointers, so the two tables may name any memory the device can
reach (its own, a peer GPU's mapped through CUDA IPC, pinned host memory).

With ``checksum`` (integrity, docs/INTEGRITY.md) the same launch also sums what it copies, as
``kernels.checksum`` defines the sum, in the same pass (the source is read once, for both): the
copied words are weighed by their positions in the whole the sum is defined over (for the kernel
path, a chunk's or layer group's gather layout), which a :class:`WordOrder` states per entry (or, for
:func:`copy_outer`, as the factors of an outer sum, as the entries themselves are given). Each
program adds its weighted words into one partial (``kernels/_bytesum.py``'s ``combine``, mod 2**64),
and one ``sum`` of the partials lands in ``checksum`` on the copy's stream. That is a kernel of its
own (``_copy_sum_kernel``: the copy, then the sum of what it loaded); without ``checksum`` the plain
copy's kernel and launch are untouched.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import triton
import triton.language as tl

from ._bytesum import MASK64, WORD, as_int64, check_out, combine, finish
from ._common import (
    INT_VIEW,
    Impl,
    KernelInputError,
    LaunchConfig,
    check_stream,
    column_block,
    indexed,
    launcher,
    piece_block,
    pow2_divisor,
    resolve_impl,
    triton_int,
    upload,
    use_on_current_stream,
)

__all__ = [
    "DEFAULT_CONFIG",
    "EntryTable",
    "WordOrder",
    "copy_entries",
    "copy_entries_reference",
    "copy_outer",
    "entry_table",
    "view_starts",
]

DEFAULT_CONFIG = LaunchConfig(block_bytes=32768, num_warps=4)
"""Launch shape of :func:`copy_entries` (the gather's, whose tiling it shares). On one H200 the copy's
device time reads 0.91 of a device copy of the same bytes with it for 32 KiB entries and 0.80 for 2
KiB ones; 16 and 64 KiB programs read the same, 128 KiB programs of 8 warps 0.87 and 0.43
(``tools/bench_copy.py``, docs/PERF.md "The kernel path on one H200")."""

_REFERENCE_UNITS = 1 << 22
"""Copy units gathered per pass of the reference: bounds its index temporaries (32 MiB)."""


@triton.jit
def _move(
    src_table,  # *i64 [Ns]: absolute address of each source entry
    dst_table,  # *i64 [Nd]: absolute address of each destination entry
    offsets,  # *i32 [n // cols]: pair (u, j) copies entry offsets[u] + src_cols[j] ...
    src_cols,  # *i32 [cols]
    dst_cols,  # *i32 [cols]: ... onto entry offsets[u] + dst_cols[j]
    n,  # pairs in all
    cols,  # pairs per offset
    UNIT_TYPE: tl.constexpr,  # the integer type of one copy unit (1, 2, 4 or 8 bytes)
    ALIGN: tl.constexpr,  # bytes every entry address is a multiple of (<= 16)
    ROW: tl.constexpr,  # units per entry
    PIECE: tl.constexpr,  # units per piece: an entry is NPIECE pieces
    NPIECE: tl.constexpr,
    BLOCK: tl.constexpr,  # pieces per program
    EVEN: tl.constexpr,  # PIECE * NPIECE == ROW: no column mask
):
    """This program's copy, shared by both kernels: BLOCK (pair, piece)s. Returns each row's pair
    ``e``, which rows are real (``ok``), each unit's place in its entry (``within``), the units'
    mask and the values moved."""
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    e = r // NPIECE
    ok = e < n
    u = e // cols
    j = e - u * cols
    base = tl.load(offsets + u, mask=ok, other=0)
    s = (base + tl.load(src_cols + j, mask=ok, other=0)).to(tl.int64)
    d = (base + tl.load(dst_cols + j, mask=ok, other=0)).to(tl.int64)
    src_addr = tl.multiple_of(tl.load(src_table + s, mask=ok, other=0), ALIGN)
    dst_addr = tl.multiple_of(tl.load(dst_table + d, mask=ok, other=0), ALIGN)
    within = ((r % NPIECE) * PIECE)[:, None] + tl.arange(0, PIECE)[None, :]
    src = src_addr.to(tl.pointer_type(UNIT_TYPE))[:, None] + within
    dst = dst_addr.to(tl.pointer_type(UNIT_TYPE))[:, None] + within
    if EVEN:
        mask = ok[:, None]
    else:
        mask = ok[:, None] & (within < ROW)
    values = tl.load(src, mask=mask)
    tl.store(dst, values, mask=mask)
    return e, ok, within, mask, values


@triton.jit(do_not_specialize=["n", "cols"])  # both follow the room: one compiled kernel serves every size
def _copy_kernel(
    src_table,  # as _move's
    dst_table,
    offsets,
    src_cols,
    dst_cols,
    n,
    cols,
    UNIT_TYPE: tl.constexpr,
    ALIGN: tl.constexpr,
    ROW: tl.constexpr,
    PIECE: tl.constexpr,
    NPIECE: tl.constexpr,
    BLOCK: tl.constexpr,
    EVEN: tl.constexpr,
):
    _move(src_table, dst_table, offsets, src_cols, dst_cols, n, cols,
          UNIT_TYPE, ALIGN, ROW, PIECE, NPIECE, BLOCK, EVEN)  # fmt: skip


@triton.jit(do_not_specialize=["n", "cols", "step0", "step1", "step2", "step3"])  # these follow the chunk
def _copy_sum_kernel(
    src_table,  # as _move's
    dst_table,
    offsets,  # *i64 here (one upload for every factor), as _move's otherwise
    src_cols,
    dst_cols,
    n,
    cols,
    first_units,  # *i64 [n // cols]: pair (u, j)'s first word sits at first_units[u] + first_cols[j]
    first_cols,  # *i64 [cols]
    partials,  # *i64 [programs]: each program's checksum of what it copied
    step0,  # WordOrder.dims' steps, innermost first (0 past its dims)
    step1,
    step2,
    step3,
    UNIT_TYPE: tl.constexpr,  # as _move's, 4- or 8-byte units only
    ALIGN: tl.constexpr,
    ROW: tl.constexpr,
    PIECE: tl.constexpr,
    NPIECE: tl.constexpr,
    BLOCK: tl.constexpr,
    EVEN: tl.constexpr,
    WORDS: tl.constexpr,  # 32-bit words per unit: 1 (4-byte units) or 2 (8-byte)
    RUN_UNITS: tl.constexpr,  # WordOrder.run in units: a unit's words are in one run
    C0: tl.constexpr,  # WordOrder.dims' counts, innermost first (1 past its dims)
    C1: tl.constexpr,
    C2: tl.constexpr,
    C3: tl.constexpr,
    WIDE: tl.constexpr,  # a word's place past its pair's first word may reach 2**32 - 2: int64 weights
):
    # _move's copy, then the weighted sum of the units it moved (kernels/checksum.py): word w at
    # position F + i weighs F + i + 1, so a row (a pair's piece) adds F * sum(w) + sum(w * (i + 1)):
    # one 64-bit product per row, and per word a 32 x 32 -> 64-bit one (i + 1 < 2**32 unless WIDE)
    e, ok, within, mask, values = _move(src_table, dst_table, offsets, src_cols, dst_cols, n, cols,
                                        UNIT_TYPE, ALIGN, ROW, PIECE, NPIECE, BLOCK, EVEN)  # fmt: skip
    u = e // cols
    first = tl.load(first_units + u, mask=ok, other=0) + tl.load(
        first_cols + (e - u * cols), mask=ok, other=0
    )
    # WordOrder's rule at unit granularity (an entry is under 2**31 units): the unit's run split
    # innermost first into the dims' indices, each weighed by its step; a dim of count 1 is not
    # compiled in
    unit = within.to(tl.int32)
    run = unit // RUN_UNITS
    if WIDE:
        inner = ((unit % RUN_UNITS) * WORDS).to(tl.int64)
    else:
        inner = (unit % RUN_UNITS) * WORDS
    if C0 > 1:
        inner += (run % C0) * step0
        run = run // C0
    if C1 > 1:
        inner += (run % C1) * step1
        run = run // C1
    if C2 > 1:
        inner += (run % C2) * step2
        run = run // C2
    if C3 > 1:
        inner += (run % C3) * step3
    moved = tl.where(mask, values, 0)
    if WIDE:
        weight = inner.to(tl.int64) + 1
    else:
        weight = (inner + 1).to(tl.uint32).to(tl.int64)  # zero-extended: the product is a widening one
    if WORDS == 2:  # the unit's words sit at inner and inner + 1
        lo = moved.to(tl.uint32).to(tl.int64)
        hi = (moved >> 32).to(tl.uint32).to(tl.int64)
        words = lo + hi
        part = lo * weight + hi * (weight + 1)
    else:
        words = moved.to(tl.uint32).to(tl.int64)
        part = words * weight
    rows = first * tl.reduce(words, 1, combine) + tl.reduce(part, 1, combine)
    tl.store(partials + tl.program_id(0), tl.reduce(rows, 0, combine))


_TRITON_UNIT = {1: tl.uint8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


@dataclass(eq=False)
class EntryTable:
    """One side's entry addresses, made once per (pool, peer pool) pair (:func:`entry_table`).

    ``addr``: uint64 ``[N]`` host array, the address of each entry in THIS process (a mapped peer's
    entries at their mapped addresses); ``entry_bytes``: the size of every entry; ``device``: where
    the memory is (a CUDA device: the kernel runs there and the table is uploaded once; CPU: the
    reference copies). ``align``: the largest power of two (<= 16) dividing every address and
    ``entry_bytes``. The table keeps no memory alive: whoever made the addresses keeps their memory
    mapped while copies run.
    """

    addr: npt.NDArray[np.uint64]
    entry_bytes: int
    device: torch.device
    align: int
    _uploaded: tuple[torch.Tensor, torch.cuda.Event | None, int] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return int(self.addr.size)

    def on_device(self) -> torch.Tensor:
        """int64 ``[N]`` on the device (uploaded on the current stream the first time; the current
        stream is ordered after that upload)."""
        if self._uploaded is None:
            host = torch.from_numpy(self.addr.view(np.int64))
            self._uploaded = upload(host, self.device)
        tensor, ready, origin = self._uploaded
        return use_on_current_stream(tensor, ready, origin)


def entry_table(addr: npt.ArrayLike, entry_bytes: int, device: torch.device | str) -> EntryTable:
    """An :class:`EntryTable` over ``addr`` (uint64 addresses, one per entry). Raises
    :class:`KernelInputError` for an empty or non-1-D table, a zero address or a bad size."""
    array = np.ascontiguousarray(np.asarray(addr), dtype=np.uint64)
    if array.ndim != 1 or array.size == 0:
        raise KernelInputError(
            f"an entry table must be a non-empty 1-D address array, got shape {array.shape}"
        )
    if not isinstance(entry_bytes, int) or entry_bytes < 1:
        raise KernelInputError(f"entry_bytes={entry_bytes!r} must be an integer >= 1")
    if int(array.min()) == 0:
        raise KernelInputError(f"entry {int(np.argmin(array))} has address 0")
    if int(array.max()) + entry_bytes > 1 << 63:
        raise KernelInputError("an entry ends past 2**63: not an address")
    dev = torch.device(device)
    if dev.type not in ("cuda", "cpu"):
        raise KernelInputError(f"device {dev} is neither cuda nor cpu")
    dev = indexed(dev)  # "cuda" is the current device: tables and streams compare by index
    gcd = (
        int(np.bitwise_or.reduce(array)) | entry_bytes
    )  # the lowest set bit of the OR: the common power of two
    return EntryTable(array, entry_bytes, dev, pow2_divisor(gcd, 16))


MAX_DIMS = 4
"""Dimensions a :class:`WordOrder` may split an entry's runs into (kv, layer, head, token)."""


@dataclass(frozen=True, eq=False)
class WordOrder:
    """Where the words a copy moves sit in the whole its checksum is defined over (``kernels/
    checksum.py``: word ``i`` of the whole weighs ``i + 1``).

    Entry ``k`` of a copy (the bytes of ``src_idx[k]``'s entry, in address order, read 4 at a time
    as little-endian words) is ``entry_bytes / (4 * run)`` runs of ``run`` words, each run
    consecutive in the whole. Word ``c`` of the entry sits at::

        first[k] + c % run + i_0 * step_0 + i_1 * step_1 + ...

    where ``(i_0, i_1, ...)`` is the run ``c // run`` written in the mixed radix of ``dims``
    (``(count, step)`` pairs, innermost first: ``c // run = i_0 + count_0 * (i_1 + count_1 *
    (...))``, at most :data:`MAX_DIMS` of them). ``first``: int ``[n]`` host array, every position
    ``>= 0``; ``run * prod(counts) * 4`` must equal ``entry_bytes``. An odd ``run`` makes the
    kernel copy in 4-byte units (an 8-byte one could straddle two runs). The kernel path's (a
    chunk's gather layout) is made by ``transfer_engine.actors.worker.kernel.gather_order``.
    """

    first: npt.NDArray[np.int64]
    run: int
    dims: tuple[tuple[int, int], ...] = ()
    cols: npt.NDArray[np.int64] | None = None
    """With it, the order of a copy given as factors (:func:`copy_outer`): pair ``(u, j)``'s first word
    sits at ``first[u] + cols[j]`` (``first`` then has one item per offset); the kernel path's gather
    layout is such a sum (``gather_order``)."""

    def entry_first(self) -> npt.NDArray[np.int64]:
        """int64 ``[entries]``: each entry's first position (the outer sum, with :attr:`cols`)."""
        first = np.asarray(self.first, dtype=np.int64)
        if self.cols is None:
            return first
        return (first[:, None] + np.asarray(self.cols, dtype=np.int64)[None, :]).reshape(-1)

    def offsets(self) -> npt.NDArray[np.int64]:
        """int64 ``[entry words]``: each word's position past its entry's ``first``."""
        words = self.run * math.prod(count for count, _ in self.dims)
        c = np.arange(words, dtype=np.int64)
        out = c % self.run
        runs = c // self.run
        for count, step in self.dims:
            out += (runs % count) * step
            runs //= count
        return out


def _check_order(
    order: WordOrder, n: int, entry_bytes: int, units: int | None = None
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """``order``'s first positions as the kernel reads them: int64 ``(per offset, per column)`` host
    arrays, once ``order`` fits a copy of ``n`` entries of ``entry_bytes`` (:class:`KernelInputError`
    naming what does not). ``units``: the copy's offsets when it is given as factors (:func:`copy_outer`:
    ``order.cols`` is then required, ``units`` x ``len(order.cols)`` entries); None for index arrays
    (one offset, ``n`` columns: a factored order is summed out)."""
    if not isinstance(order, WordOrder):
        raise KernelInputError(f"order must be a WordOrder, got {type(order).__name__}")
    factors = []
    for name, values in (("order.first", order.first), ("order.cols", order.cols)):
        if values is None:
            continue
        array = np.asarray(values)
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise KernelInputError(f"{name} must be a 1-D integer array, got {array.dtype} {array.shape}")
        if array.size and int(array.min()) < 0:
            raise KernelInputError(f"{name} holds {int(array.min())}: positions are >= 0")
        factors.append(np.ascontiguousarray(array, dtype=np.int64))
    if units is not None and order.cols is None:
        raise KernelInputError("a copy given as factors sums with an order given as factors (order.cols)")
    entries = factors[0].size * (1 if len(factors) == 1 else factors[1].size)
    if entries != n or (units is not None and factors[0].size != units):
        given = "x".join(str(f.size) for f in factors)
        raise KernelInputError(f"order.first has {given} entries, the copy {n}")
    if not isinstance(order.run, int) or order.run < 1:
        raise KernelInputError(f"order.run={order.run!r} must be an int >= 1")
    if len(order.dims) > MAX_DIMS:
        raise KernelInputError(f"order has {len(order.dims)} dims; at most {MAX_DIMS}")
    for count, step in order.dims:
        if not isinstance(count, int) or not isinstance(step, int) or count < 1 or step < 0:
            raise KernelInputError(
                f"order dim (count={count!r}, step={step!r}) needs ints, count >= 1, step >= 0"
            )
    words = order.run * math.prod(count for count, _ in order.dims)
    if words * WORD != entry_bytes:
        raise KernelInputError(
            f"order covers {words} words of {WORD} bytes per entry; the entries are {entry_bytes} bytes"
        )
    if units is None:
        return np.zeros(1, dtype=np.int64), order.entry_first()
    return factors[0], factors[1]


def _widest(order: WordOrder) -> int:
    """The largest place of a word past its entry's first word, plus one (its weight's part)."""
    return order.run + sum((count - 1) * step for count, step in order.dims)


def _check_pair(src: EntryTable, dst: EntryTable) -> None:
    if not isinstance(src, EntryTable) or not isinstance(dst, EntryTable):
        raise KernelInputError("src and dst must be EntryTables (kernels.copy.entry_table)")
    if src.entry_bytes != dst.entry_bytes:
        raise KernelInputError(f"src entries are {src.entry_bytes} bytes, dst entries {dst.entry_bytes}")
    if src.device != dst.device:
        raise KernelInputError(f"src table is for {src.device}, dst table for {dst.device}")


def _out_of_range(array: np.ndarray, size: int) -> bool:
    """Whether an index of ``array`` lies outside ``[0, size)``. One pass for int32 (the engine's
    indices): read as unsigned, a negative index is above every table size (2**31 and up)."""
    if array.dtype == np.int32:
        return int(array.view(np.uint32).max()) >= size
    return int(array.min()) < 0 or int(array.max()) >= size


def _check_indices(
    src_idx: npt.ArrayLike, dst_idx: npt.ArrayLike, src: EntryTable, dst: EntryTable
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
    """The index arrays as int32 host arrays, range-checked against both tables (on the host)."""
    out = []
    for name, values, table in (("src_idx", src_idx, src), ("dst_idx", dst_idx, dst)):
        if isinstance(values, torch.Tensor):
            if values.device.type != "cpu":
                raise KernelInputError(f"{name} must be in host memory, got {values.device}")
            values = values.numpy()
        array = np.asarray(values)
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise KernelInputError(f"{name} must be a 1-D integer array, got {array.dtype} {array.shape}")
        if array.size and _out_of_range(array, len(table)):
            bad = int(array.min()) if int(array.min()) < 0 else int(array.max())
            raise KernelInputError(f"{name} holds {bad}, outside the table's [0, {len(table)})")
        out.append(np.ascontiguousarray(array, dtype=np.int32))
    if out[0].size != out[1].size:
        raise KernelInputError(f"src_idx has {out[0].size} entries, dst_idx {out[1].size}")
    return out[0], out[1]


def copy_entries(
    src: EntryTable,
    dst: EntryTable,
    src_idx: npt.ArrayLike,
    dst_idx: npt.ArrayLike,
    *,
    stream: torch.cuda.Stream | None = None,
    impl: Impl = "auto",
    config: LaunchConfig | None = None,
    checksum: torch.Tensor | None = None,
    order: WordOrder | None = None,
) -> None:
    """Copy ``entry_bytes`` from ``src.addr[src_idx[i]]`` to ``dst.addr[dst_idx[i]]`` for every ``i``.

    Shapes: ``src_idx``, ``dst_idx``: int ``[n]`` in HOST memory (numpy or CPU tensors), checked
    against their tables' lengths here, before anything is enqueued (a bad one raises
    :class:`KernelInputError` naming it); destination entries must not overlap each other or a
    source entry (the copy's order is unspecified).

    Stream: on CUDA everything (the tables' first upload, the indices' upload, the launch) is enqueued
    on ``stream`` (default: the current stream of the tables' device); nothing synchronizes. The
    bytes are in place when that stream reaches this point; the index arrays may be reused as soon as
    this returns. On CPU the copy is done when this returns (the reference, or the interpreted kernel
    with ``TRITON_INTERPRET=1`` / ``impl="triton"``).

    ``checksum`` (with ``order``): int64 ``[1]`` on the tables' device or in pinned host memory (CPU
    tables: on CPU), which receives the checksum of the copied words at the positions ``order``
    gives them (``kernels.checksum``'s sum, taken in the same pass as the copy), on ``stream`` too:
    read it once the stream passed this point. ``order.first`` is uploaded with the indices. The
    entries must be whole 4-byte words (``order`` says how many); with 4- or 8-byte copy units the
    kernel sums as it copies, with narrower ones (an address or the entry size only 1- or 2-byte
    aligned) the reference copies and sums.

    ``config``: the launch shape (default ``DEFAULT_CONFIG``).

    ``n == 0``: nothing is launched (``checksum`` gets 0).
    """
    _check_pair(src, dst)
    device = src.device
    check_stream(stream, device)
    s_idx, d_idx = _check_indices(src_idx, dst_idx, src, dst)
    which = resolve_impl(impl, device)
    firsts = _check_sum(checksum, order, device, int(s_idx.size), src.entry_bytes, None)
    _copy(
        src, dst, which, config or DEFAULT_CONFIG, stream, _NO_OFFSET, s_idx, d_idx, checksum, order, firsts
    )


def _check_sum(
    checksum: torch.Tensor | None,
    order: WordOrder | None,
    device: torch.device,
    n: int,
    entry_bytes: int,
    units: int | None,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]] | None:
    """A summed copy's first positions (:func:`_check_order`), or None for a plain copy."""
    if (checksum is None) != (order is None):
        raise KernelInputError("checksum and order go together: the sum needs its words' positions")
    if order is None:
        return None
    check_out(device, checksum)
    return _check_order(order, n, entry_bytes, units)


def _copy(
    src: EntryTable,
    dst: EntryTable,
    which: str,
    cfg: LaunchConfig,
    stream: torch.cuda.Stream | None,
    offsets: npt.NDArray[np.int32],
    src_cols: npt.NDArray[np.int32],
    dst_cols: npt.NDArray[np.int32],
    checksum: torch.Tensor | None,
    order: WordOrder | None,
    firsts: tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]] | None,
) -> None:
    """The copy of pairs ``(u, j)`` (checked), plain or summed (``firsts``), on ``stream``: the kernel,
    or the reference (CPU, or a sum over units under 4 bytes)."""
    device = src.device
    with launcher(device, stream):
        if offsets.size * src_cols.size == 0:
            if checksum is not None:
                checksum.reshape(-1)[:1].zero_()
            return
        unit = min(src.align, dst.align, 8)
        if order is not None and order.run % 2:  # a run of odd words: 8-byte units would straddle runs
            unit = min(unit, WORD)
        if which == "torch" or (checksum is not None and unit < WORD):
            total = copy_entries_reference(
                src, dst, _outer(offsets, src_cols), _outer(offsets, dst_cols), order=order
            )
            if checksum is not None:
                assert total is not None
                finish(total, checksum)
            return
        if order is None or checksum is None or firsts is None:
            _launch_plain(src, dst, which, cfg, unit, offsets, src_cols, dst_cols)
            return
        _launch_summed(src, dst, which, cfg, unit, offsets, src_cols, dst_cols, checksum, order, firsts)


def _launch_summed(
    src: EntryTable,
    dst: EntryTable,
    which: str,
    cfg: LaunchConfig,
    unit: int,
    offsets: npt.NDArray[np.int32],
    src_cols: npt.NDArray[np.int32],
    dst_cols: npt.NDArray[np.int32],
    checksum: torch.Tensor,
    order: WordOrder,
    firsts: tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]],
) -> None:
    """:func:`_launch_plain`'s copy summing what it copies (``order``'s weights, ``firsts`` its pairs'
    first words), its programs' partial sums reduced into ``checksum``, all on the current stream."""
    device = src.device
    n = int(offsets.size * src_cols.size)
    i64 = np.int64
    factors = _indices_on(device, offsets.astype(i64), src_cols.astype(i64), dst_cols.astype(i64), *firsts)
    programs, meta = _launch_meta(src, dst, cfg, unit, n)
    dims = (*order.dims, *((1, 0),) * (MAX_DIMS - len(order.dims)))
    partials = torch.empty(programs, dtype=torch.int64, device=device)
    kernel = _copy_sum_kernel if which == "jit" else triton_int(_copy_sum_kernel)
    kernel[(programs,)](  # type: ignore[index]
        src.on_device(),
        dst.on_device(),
        *factors[:3],
        n,
        int(src_cols.size),
        *factors[3:],
        partials,
        *(step for _, step in dims),
        **meta,
        WORDS=unit // WORD,
        RUN_UNITS=order.run * WORD // unit,
        C0=dims[0][0],
        C1=dims[1][0],
        C2=dims[2][0],
        C3=dims[3][0],
        WIDE=_widest(order) + 2 >= 1 << 32,
    )
    finish(partials.sum(), checksum)


_NO_OFFSET = np.zeros(1, dtype=np.int32)
"""The one offset of a copy given as plain index arrays (:func:`copy_entries`): the pairs are its columns."""


def copy_outer(
    src: EntryTable,
    dst: EntryTable,
    offsets: npt.ArrayLike,
    src_cols: npt.ArrayLike,
    dst_cols: npt.ArrayLike,
    *,
    stream: torch.cuda.Stream | None = None,
    impl: Impl = "auto",
    config: LaunchConfig | None = None,
    checksum: torch.Tensor | None = None,
    order: WordOrder | None = None,
) -> None:
    """Copy entry ``offsets[u] + src_cols[j]`` of ``src`` onto entry ``offsets[u] + dst_cols[j]`` of
    ``dst`` for every ``(u, j)``: the copy :func:`copy_entries` makes of the two outer sums, given as
    their factors (the kernel path's every plain copy: ``protocol.tables.write_factors``). A copy of
    U x C entries uploads U + 2C integers and makes no U x C array on the host: its host call does not
    grow with the entries (docs/PERF.md, "The kernel path on one H200").

    Shapes: ``offsets`` int ``[U]``, ``src_cols`` and ``dst_cols`` int ``[C]``, in HOST memory; every sum
    is checked against its table here, before anything is enqueued (:class:`KernelInputError` naming
    the side and the bad sum). Stream, overlap rules, the CPU copy and ``checksum`` as for
    :func:`copy_entries`, with ``order`` given as factors too (``WordOrder.cols``: pair ``(u, j)``'s
    first word at ``order.first[u] + order.cols[j]``; the kernel adds them as it adds the indices).
    ``U * C == 0``: nothing is launched (``checksum`` gets 0).
    """
    _check_pair(src, dst)
    device = src.device
    check_stream(stream, device)
    off, s_cols, d_cols = _check_factors(offsets, src_cols, dst_cols, src, dst)
    which = resolve_impl(impl, device)
    firsts = _check_sum(checksum, order, device, int(off.size * s_cols.size), src.entry_bytes, int(off.size))
    _copy(src, dst, which, config or DEFAULT_CONFIG, stream, off, s_cols, d_cols, checksum, order, firsts)


def _outer(offsets: npt.NDArray[np.int32], cols: npt.NDArray[np.int32]) -> npt.NDArray[np.int32]:
    return (offsets[:, None] + cols[None, :]).reshape(-1)


def _check_factors(
    offsets: npt.ArrayLike, src_cols: npt.ArrayLike, dst_cols: npt.ArrayLike, src: EntryTable, dst: EntryTable
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.int32]]:
    """The factors as int32 host arrays; every sum of an offset and a column inside its table."""
    arrays = []
    for name, values in (("offsets", offsets), ("src_cols", src_cols), ("dst_cols", dst_cols)):
        if isinstance(values, torch.Tensor):
            if values.device.type != "cpu":
                raise KernelInputError(f"{name} must be in host memory, got {values.device}")
            values = values.numpy()
        array = np.asarray(values)
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise KernelInputError(f"{name} must be a 1-D integer array, got {array.dtype} {array.shape}")
        arrays.append(array)
    off, s_cols, d_cols = arrays
    if s_cols.size != d_cols.size:
        raise KernelInputError(f"src_cols has {s_cols.size} entries, dst_cols {d_cols.size}")
    if off.size and s_cols.size:
        low, high = int(off.min()), int(off.max())
        for name, cols, table in (("src", s_cols, src), ("dst", d_cols, dst)):
            lo, hi = low + int(cols.min()), high + int(cols.max())
            if lo < 0 or hi >= len(table):
                raise KernelInputError(
                    f"{name} entry {lo if lo < 0 else hi} (an offset plus a {name}_cols value) is outside "
                    f"the table's [0, {len(table)})"
                )
    i32 = np.int32
    return (np.ascontiguousarray(off, dtype=i32), np.ascontiguousarray(s_cols, dtype=i32),
            np.ascontiguousarray(d_cols, dtype=i32))  # fmt: skip


def _launch_plain(
    src: EntryTable,
    dst: EntryTable,
    which: str,
    cfg: LaunchConfig,
    unit: int,
    offsets: npt.NDArray[np.int32],
    src_cols: npt.NDArray[np.int32],
    dst_cols: npt.NDArray[np.int32],
) -> None:
    """One launch of the plain copy on the current stream: pair ``(u, j)`` copies entry
    ``offsets[u] + src_cols[j]`` onto ``offsets[u] + dst_cols[j]`` (checked by the caller)."""
    n = int(offsets.size * src_cols.size)
    off_dev, s_dev, d_dev = _indices_on(src.device, offsets, src_cols, dst_cols)
    programs, meta = _launch_meta(src, dst, cfg, unit, n)
    kernel = _copy_kernel if which == "jit" else triton_int(_copy_kernel)
    grid = (programs,)
    kernel[grid](src.on_device(), dst.on_device(), off_dev, s_dev, d_dev, n, int(src_cols.size), **meta)  # type: ignore[index]


def _launch_meta(
    src: EntryTable, dst: EntryTable, cfg: LaunchConfig, unit: int, n: int
) -> tuple[int, dict[str, Any]]:
    """The programs of a launch over ``n`` pairs of ``unit``-byte units, and the compile-time arguments
    both copy kernels take (``_move``'s, then ``num_warps``)."""
    row, piece, even, npiece, block = _shape(src.entry_bytes, unit, cfg)
    meta = {"UNIT_TYPE": _TRITON_UNIT[unit], "ALIGN": min(src.align, dst.align), "ROW": row, "PIECE": piece,
            "NPIECE": npiece, "BLOCK": block, "EVEN": even, "num_warps": cfg.num_warps}  # fmt: skip
    return triton.cdiv(n * npiece, block), meta


def _shape(entry_bytes: int, unit: int, cfg: LaunchConfig) -> tuple[int, int, bool, int, int]:
    """``(ROW, PIECE, EVEN, NPIECE, BLOCK)`` of a launch over entries of ``entry_bytes`` in ``unit``-byte
    units (the module docstring's launch shape)."""
    row = entry_bytes // unit
    piece, even = column_block(row)
    return row, piece, even, triton.cdiv(row, piece), piece_block(cfg.block_bytes, piece * unit)


def _indices_on(
    device: torch.device, *arrays: npt.NDArray[np.int32] | npt.NDArray[np.int64]
) -> list[torch.Tensor]:
    """``arrays`` (of one dtype) on ``device``. On CUDA: written straight into one pinned buffer and sent
    with ONE asynchronous copy on the current stream, the launch's, which is therefore ordered after it
    with no event (torch's pinned-memory cache keeps the buffer until that copy ran); each array is a
    view of the copy, starting on a multiple of ``_VIEW_ALIGN`` bytes. Triton compiles a kernel anew for
    each pattern of its pointer arguments' 16-byte alignment: views at whatever offset the sizes before
    them left would make a new room size a new compile, on the engine's loop (a 50 ms copy seen on the
    H200), and the start's warm-up (``warm_copy_kernel``) miss the kernel rooms launch. On CPU: the
    arrays themselves. A small copy's host call is mostly these uploads (docs/PERF.md, "The kernel path
    on one H200")."""
    if device.type != "cuda":
        return [torch.from_numpy(a) for a in arrays]
    dtype = torch.from_numpy(arrays[0][:0]).dtype
    sizes = [int(a.size) for a in arrays]
    starts, total = view_starts(sizes, arrays[0].itemsize)
    staged = torch.empty(total, dtype=dtype, pin_memory=True)
    host = staged.numpy()
    for array, at, size in zip(arrays, starts, sizes, strict=True):
        host[at : at + size] = array
    on = staged.to(device, non_blocking=True)
    return [on[at : at + size] for at, size in zip(starts, sizes, strict=True)]


def view_starts(sizes: Sequence[int], itemsize: int) -> tuple[list[int], int]:
    """Where each of arrays of ``sizes`` items starts in one buffer, in items, each on a multiple of
    ``_VIEW_ALIGN`` bytes, and the buffer's length (:func:`_indices_on`)."""
    per = max(1, _VIEW_ALIGN // itemsize)
    starts, at = [], 0
    for size in sizes:
        starts.append(at)
        at += -(-size // per) * per
    return starts, at


_VIEW_ALIGN = 16
"""Bytes every uploaded index view starts on (the alignment Triton specializes pointers on)."""


class _CudaSpan:
    """A ``__cuda_array_interface__`` over raw device memory, for a torch view of it."""

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (addr, False),
            "version": 3,
            "stream": None,
        }


def _span(addr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` of memory at ``addr`` on ``device``; reads nothing."""
    if device.type == "cuda":
        return torch.as_tensor(_CudaSpan(addr, nbytes), device=device)
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(addr), dtype=torch.uint8)


def copy_entries_reference(
    src: EntryTable,
    dst: EntryTable,
    src_idx: npt.ArrayLike,
    dst_idx: npt.ArrayLike,
    *,
    order: WordOrder | None = None,
) -> torch.Tensor | None:
    """Pure-torch :func:`copy_entries` (the reference the kernel is tested against, and the CPU copy).

    Views the memory between the lowest and the highest entry each side's indices name as one byte
    tensor (nothing in between is read or written), then gathers the source entries' units and
    scatters them to the destination's, ``_REFERENCE_UNITS`` units per pass, through integer views
    (every bit pattern survives). On CUDA it runs on the current stream. Indices as for
    :func:`copy_entries`, unchecked here beyond their lengths.

    With ``order`` (checked as :func:`copy_entries` checks it) it also sums the gathered units, as
    they are scattered, at the positions ``order`` gives them, and returns the checksum: int64
    ``[1]`` on the tables' device (host memory: numpy, a bounded block of entries at a time; device
    memory: torch, on the current stream). Without it, returns None.
    """
    s_idx = np.asarray(src_idx, dtype=np.int64)
    d_idx = np.asarray(dst_idx, dtype=np.int64)
    if s_idx.size != d_idx.size:
        raise KernelInputError(f"src_idx has {s_idx.size} entries, dst_idx {d_idx.size}")
    device = src.device
    summed = None if order is None else _ReferenceSum(order, s_idx.size, src.entry_bytes, device)
    if s_idx.size == 0:
        return None if summed is None else summed.result()
    size = src.entry_bytes
    unit = min(src.align, dst.align, 8)
    int_dtype = INT_VIEW[unit]
    row = size // unit
    per_pass = max(1, _REFERENCE_UNITS // row)
    cols = torch.arange(row, dtype=torch.int64, device=device)
    for start in range(0, s_idx.size, per_pass):
        s_addr = src.addr[s_idx[start : start + per_pass]]
        d_addr = dst.addr[d_idx[start : start + per_pass]]
        views = []
        for addr in (s_addr, d_addr):
            low = int(addr.min())
            base = _span(low, int(addr.max()) - low + size, device).view(int_dtype)
            first = torch.from_numpy(((addr - np.uint64(low)) // np.uint64(unit)).astype(np.int64))
            views.append((base, (first.to(device)[:, None] + cols[None, :]).reshape(-1)))
        (s_base, s_off), (d_base, d_off) = views
        values = s_base[s_off]
        d_base[d_off] = values
        if summed is not None:
            summed.add(values.view(s_addr.size, row), start)
    return None if summed is None else summed.result()


_REFERENCE_SUM_WORDS = 1 << 16
"""Words the host reference weighs at a time: its uint64 temporaries stay in cache."""


class _ReferenceSum:
    """The reference's checksum of what it copies, pass by pass: entry ``k``'s words ``w`` add
    ``first[k] * sum(w) + sum((offsets + 1) * w)`` (:meth:`WordOrder.offsets`), mod 2**64."""

    def __init__(self, order: WordOrder, n: int, entry_bytes: int, device: torch.device) -> None:
        _, self.first = _check_order(order, n, entry_bytes)
        self.device = device
        weights = order.offsets() + 1
        self.host = device.type == "cpu"
        if self.host:
            self.weights = weights.astype(np.uint64)
            self.total = 0
        else:
            self.weights_dev = torch.from_numpy(weights).to(device)
            self.total_dev = torch.zeros((), dtype=torch.int64, device=device)

    def add(self, values: torch.Tensor, start: int) -> None:
        """``values``: the units of entries ``[start, start + len(values))``, one row per entry."""
        words = values.contiguous().view(torch.int32)  # [entries, entry words], little-endian words
        first = self.first[start : start + words.shape[0]]
        if self.host:
            host = words.numpy().view(np.uint32)
            rows = max(1, _REFERENCE_SUM_WORDS // host.shape[1])
            total = self.total
            for r in range(0, host.shape[0], rows):
                block = host[r : r + rows].astype(np.uint64)
                total += int(
                    np.dot(first[r : r + rows].astype(np.uint64), block.sum(axis=1, dtype=np.uint64))
                )
                total += int((block @ self.weights).sum(dtype=np.uint64))
            self.total = total & MASK64
            return
        wide = words.to(torch.int64) & 0xFFFFFFFF
        pos = torch.from_numpy(first).to(self.device)[:, None] + self.weights_dev[None, :]
        self.total_dev += (wide * pos).sum()

    def result(self) -> torch.Tensor:
        """The checksum so far: int64 ``[1]`` on the tables' device."""
        if self.host:
            return torch.tensor([as_int64(self.total)], dtype=torch.int64)
        return self.total_dev.reshape(1)
