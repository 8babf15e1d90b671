"""NIXL descriptor arithmetic for the direct and slice paths, vectorized with numpy.

Conventions shared by every function here:

- ``bases`` is a 1-D array of the base addresses of one rank's KV tensors in the order
  ``[K_0..K_{L-1}, V_0..V_{L-1}]`` (or ``[C_0..C_{L-1}]`` for MLA). Source and destination bases
  list the same tensors in the same order.
- Each tensor is contiguous ``[num_slots, heads_local, head_dim]``: slot ``s`` starts at
  ``base + s * slot_bytes`` with ``slot_bytes = heads_local * head_dim * itemsize``, and page ``p``
  starts at ``base + p * page_size * slot_bytes``.
- Descriptor lists come back as three equal-length 1-D ``uint64`` arrays ``(src_addr, dst_addr,
  length)``, tensor-major: all entries of tensor 0, then tensor 1, and so on.
- Pages and slots are non-negative integers; results that index them are ``int64``.

No Python loop runs per page, token or tensor; cost is a handful of numpy passes per chunk. Bad input
raises :class:`~transfer_engine.errors.ConfigError` naming the values.

:func:`strided_descriptors` drops the contiguous-tensor convention: each side describes every KV
tensor by a strides row (see :data:`STRIDE_FIELDS`), so the two sides may use different layouts (vLLM
CPU's, FlashAttention's NHD or HND, SGLang's, ours) and the byte runs are computed from both rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from transfer_engine.errors import ConfigError

__all__ = [
    "STRIDE_FIELDS",
    "chunk_tokens",
    "contiguous_strides",
    "direct_descriptors",
    "page_runs",
    "slice_descriptors",
    "slice_pieces_per_page",
    "slots_of",
    "strided_descriptors",
    "strides_table",
]

U64Array = npt.NDArray[np.uint64]
I64Array = npt.NDArray[np.int64]
_Array = TypeVar("_Array", I64Array, U64Array)


# --- input checks, shared with protocol.tables ---------------------------------------------------


def index_array(values: npt.ArrayLike, name: str) -> I64Array:
    """``values`` (pages or slots) as a 1-D int64 array of non-negative integers, or :class:`ConfigError`."""
    array = np.asarray(values)
    if array.ndim != 1:
        raise ConfigError(f"{name} must be 1-D, got shape {array.shape}")
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.dtype != np.int64:  # int64 (every caller in the engine) skips to the one check it needs
        if not np.issubdtype(array.dtype, np.integer):
            raise ConfigError(f"{name} must hold integers, got dtype {array.dtype}")
        if int(array.max()) > np.iinfo(np.int64).max:
            raise ConfigError(f"{name} value {int(array.max())} does not fit in int64")
        if np.issubdtype(array.dtype, np.unsignedinteger):
            return array.astype(np.int64)
    low = int(array.min())
    if low < 0:
        raise ConfigError(f"{name} must be >= 0, got {low}")
    return array.astype(np.int64, copy=False)


def address_array(values: npt.ArrayLike, name: str) -> U64Array:
    """``values`` as a 1-D uint64 array of addresses, or :class:`ConfigError`."""
    array = np.asarray(values)
    if array.ndim != 1:
        raise ConfigError(f"{name} must be 1-D, got shape {array.shape}")
    if array.size == 0:
        return np.zeros(0, dtype=np.uint64)
    if not np.issubdtype(array.dtype, np.integer):
        raise ConfigError(f"{name} must hold integer addresses, got dtype {array.dtype}")
    if np.issubdtype(array.dtype, np.signedinteger) and int(array.min()) < 0:
        raise ConfigError(f"{name} must be >= 0, got {int(array.min())}")
    return array.astype(np.uint64, copy=False)


def region_arrays(side: str, bases: npt.ArrayLike, lengths: npt.ArrayLike) -> tuple[U64Array, U64Array]:
    """``side``'s registered regions: ``(bases, lengths)`` as uint64 arrays of one value per region,
    or :class:`ConfigError` naming ``{side}_bases``/``{side}_lengths``."""
    return _paired(address_array, "regions", (f"{side}_bases", bases), (f"{side}_lengths", lengths))


def check_head_slice(side: str, start: int, num_heads: int, held: int) -> None:
    """:class:`ConfigError` unless heads ``[start, start + num_heads)`` lie within ``side``'s ``held`` heads."""
    if start + num_heads > held:
        raise ConfigError(f"{side} head slice [{start}, {start + num_heads}) does not fit in {held} heads")


def _paired(
    convert: Callable[[npt.ArrayLike, str], _Array],
    unit: str,
    first: tuple[str, npt.ArrayLike],
    second: tuple[str, npt.ArrayLike],
) -> tuple[_Array, _Array]:
    """Two ``(name, values)`` arrays through ``convert``, or :class:`ConfigError` when they differ in
    length (``unit``: what one element is, for the message)."""
    a = convert(first[1], first[0])
    b = convert(second[1], second[0])
    if a.size != b.size:
        raise ConfigError(f"{first[0]} has {a.size} {unit} but {second[0]} has {b.size}")
    return a, b


def _check_at_least(name: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise ConfigError(f"{name}={value} must be >= {minimum}")


def _runs(src: np.ndarray, dst: np.ndarray, step: int | np.uint64) -> tuple[I64Array, I64Array]:
    """``(starts, counts)`` of the runs of positions over which ``src`` and ``dst`` (1-D, equal
    lengths, at least one position) both advance by exactly ``step``: each run's first position and
    its length, in position order."""
    breaks = (np.diff(src) != step) | (np.diff(dst) != step)
    starts = np.flatnonzero(np.concatenate(([True], breaks)))
    return starts, np.diff(np.append(starts, src.size))


def page_runs(src_pages: npt.ArrayLike, dst_pages: npt.ArrayLike) -> I64Array:
    """Merge a page mapping into runs: int64 ``(n_runs, 3)`` rows of ``(src_page, dst_page, count)``.

    Position ``i`` maps ``src_pages[i]`` to ``dst_pages[i]``. Consecutive positions where both the
    source and the destination page increase by exactly 1 merge into one run; runs come in position
    order and their counts sum to the number of pages. Empty input gives shape ``(0, 3)``.
    Raises :class:`ConfigError` when the lengths differ or a page is negative.
    """
    src, dst = _paired(index_array, "pages", ("src_pages", src_pages), ("dst_pages", dst_pages))
    if src.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    if src.size == 1:  # a one-page chunk: skip the passes below (numpy costs ~2 us per call)
        return np.array([[src[0], dst[0], 1]], dtype=np.int64)
    starts, counts = _runs(src, dst, 1)
    return np.stack([src[starts], dst[starts], counts], axis=1).astype(np.int64, copy=False)


def direct_descriptors(
    src_bases: npt.ArrayLike,
    dst_bases: npt.ArrayLike,
    page_bytes: int,
    src_pages: npt.ArrayLike,
    dst_pages: npt.ArrayLike,
) -> tuple[U64Array, U64Array, U64Array]:
    """Descriptors of the direct path: one per (tensor, page run), tensor-major.

    ``page_bytes`` is the bytes of one page of one tensor (``page_size * slot_bytes``), equal on both
    sides (the direct path requires equal layouts). For run ``(s, d, c)`` of :func:`page_runs` and
    tensor ``t``: ``src = src_bases[t] + s * page_bytes``, ``dst = dst_bases[t] + d * page_bytes``,
    ``length = c * page_bytes``.
    """
    src_b, dst_b = _paired(address_array, "tensors", ("src_bases", src_bases), ("dst_bases", dst_bases))
    _check_at_least("page_bytes", page_bytes, 1)
    runs = page_runs(src_pages, dst_pages).astype(np.uint64)
    step = np.uint64(page_bytes)
    src_addr = (src_b[:, None] + runs[None, :, 0] * step).ravel()
    dst_addr = (dst_b[:, None] + runs[None, :, 1] * step).ravel()
    length = np.tile(runs[:, 2] * step, src_b.size)
    return src_addr, dst_addr, length


def slots_of(
    pages: npt.ArrayLike, page_size: int, start_token: int = 0, num_tokens: int | None = None
) -> I64Array:
    """Token-slot indices (int64) of tokens ``[start_token, start_token + num_tokens)`` of a request.

    ``pages`` are the request's pages in token order; token ``t`` lives in slot
    ``pages[t // page_size] * page_size + t % page_size``. ``num_tokens=None`` means up to the end of
    the last page. Raises :class:`ConfigError` naming the values when the range does not lie inside
    ``[0, len(pages) * page_size)`` or ``page_size < 1``.
    """
    page_array = index_array(pages, "pages")
    _check_at_least("page_size", page_size, 1)
    capacity = page_array.size * page_size
    if num_tokens is None:
        num_tokens = capacity - start_token
    if start_token < 0 or num_tokens < 0 or start_token + num_tokens > capacity:
        raise ConfigError(
            f"tokens [{start_token}, {start_token + num_tokens}) out of range for {page_array.size} pages "
            f"of page_size={page_size} ({capacity} slots)"
        )
    tokens = np.arange(start_token, start_token + num_tokens, dtype=np.int64)
    return page_array[tokens // page_size] * page_size + tokens % page_size


def slice_descriptors(
    src_bases: npt.ArrayLike,
    dst_bases: npt.ArrayLike,
    src_slot_bytes: int,
    dst_slot_bytes: int,
    head_bytes: int,
    src_slots: npt.ArrayLike,
    dst_slots: npt.ArrayLike,
    src_head_start: int,
    dst_head_start: int,
    num_heads: int,
) -> tuple[U64Array, U64Array, U64Array]:
    """Descriptors of the slice path: one per (tensor, token) head slice, tensor-major.

    ``head_bytes = head_dim * itemsize``. For tensor ``t`` and token ``i``:
    ``src = src_bases[t] + src_slots[i] * src_slot_bytes + src_head_start * head_bytes``,
    ``dst = dst_bases[t] + dst_slots[i] * dst_slot_bytes + dst_head_start * head_bytes``,
    ``length = num_heads * head_bytes``. Raises :class:`ConfigError` when the slot arrays differ in
    length, or the head slice does not fit inside a slot on either side.
    """
    src_b, dst_b = _paired(address_array, "tensors", ("src_bases", src_bases), ("dst_bases", dst_bases))
    src_s, dst_s = _paired(index_array, "tokens", ("src_slots", src_slots), ("dst_slots", dst_slots))
    _check_at_least("head_bytes", head_bytes, 1)
    _check_at_least("num_heads", num_heads, 1)
    _check_at_least("src_head_start", src_head_start, 0)
    _check_at_least("dst_head_start", dst_head_start, 0)
    for side, start, slot_bytes in (
        ("src", src_head_start, src_slot_bytes),
        ("dst", dst_head_start, dst_slot_bytes),
    ):
        if (start + num_heads) * head_bytes > slot_bytes:
            raise ConfigError(
                f"{side} head slice [{start}, {start + num_heads}) of {head_bytes}-byte heads does not fit "
                f"in a {slot_bytes}-byte slot"
            )
    src_off = src_s.astype(np.uint64) * np.uint64(src_slot_bytes) + np.uint64(src_head_start * head_bytes)
    dst_off = dst_s.astype(np.uint64) * np.uint64(dst_slot_bytes) + np.uint64(dst_head_start * head_bytes)
    src_addr = (src_b[:, None] + src_off[None, :]).ravel()
    dst_addr = (dst_b[:, None] + dst_off[None, :]).ravel()
    length = np.full(src_addr.size, num_heads * head_bytes, dtype=np.uint64)
    return src_addr, dst_addr, length


def chunk_tokens(chunk_token_start: int, num_pages: int, src_page_size: int, dst_capacity_tokens: int) -> int:
    """Tokens a chunk carries: ``min(start + num_pages * src_page_size, dst_capacity) - start``, >= 0.

    ``chunk_token_start`` is the request token index of the chunk's first page. The decode side may
    hold fewer slots than the prefill's last, partial page covers, so the chunk is clipped to
    ``dst_capacity_tokens``; a chunk entirely past it carries 0 tokens.
    """
    _check_at_least("chunk_token_start", chunk_token_start, 0)
    _check_at_least("num_pages", num_pages, 0)
    _check_at_least("src_page_size", src_page_size, 1)
    _check_at_least("dst_capacity_tokens", dst_capacity_tokens, 0)
    return max(0, min(chunk_token_start + num_pages * src_page_size, dst_capacity_tokens) - chunk_token_start)


STRIDE_FIELDS = ("region", "offset", "block", "head", "token")
"""Columns of a strides table: one int64 row per KV tensor, in tensor order. Head ``h`` of token ``n``
of block ``b`` of tensor ``t`` starts at ``bases[region] + offset + b * block + h * head + n * token``
(bytes), and its ``head_dim`` elements are contiguous. Rows mirror ``messages.KVStrides``."""


def contiguous_strides(num_tensors: int, heads_local: int, head_bytes: int, page_size: int) -> I64Array:
    """The strides table of the contiguous ``[num_slots, heads_local, head_dim]`` layout, one region per tensor."""
    _check_at_least("num_tensors", num_tensors, 1)
    _check_at_least("heads_local", heads_local, 1)
    _check_at_least("head_bytes", head_bytes, 1)
    _check_at_least("page_size", page_size, 1)
    slot = heads_local * head_bytes
    table = np.empty((num_tensors, 5), dtype=np.int64)
    table[:, 0] = np.arange(num_tensors)
    table[:, 1] = 0
    table[:, 2] = page_size * slot
    table[:, 3] = head_bytes
    table[:, 4] = slot
    return table


def strides_table(strides: npt.ArrayLike, name: str) -> I64Array:
    """``strides`` as an int64 ``(num_tensors, len(STRIDE_FIELDS))`` table, or ConfigError naming ``name``."""
    table = np.asarray(strides)
    if table.ndim != 2 or table.shape[1] != len(STRIDE_FIELDS) or not np.issubdtype(table.dtype, np.integer):
        raise ConfigError(
            f"{name} must be an integer table of shape (num_tensors, {len(STRIDE_FIELDS)}), got "
            f"{table.dtype} {table.shape}"
        )
    if table.size and int(table.min()) < 0:
        row, col = np.argwhere(table < 0)[0]
        raise ConfigError(f"{name}[{row}].{STRIDE_FIELDS[col]}={int(table[row, col])} must be >= 0")
    return table.astype(np.int64, copy=False)


def strides_pair(src_strides: npt.ArrayLike, dst_strides: npt.ArrayLike) -> tuple[I64Array, I64Array]:
    """Both sides' :func:`strides_table`, or ConfigError when they describe different numbers of tensors
    (tensor ``t`` of one side goes to tensor ``t`` of the other)."""
    src = strides_table(src_strides, "src_strides")
    dst = strides_table(dst_strides, "dst_strides")
    if src.shape[0] != dst.shape[0]:
        raise ConfigError(f"src_strides describes {src.shape[0]} tensors but dst_strides {dst.shape[0]}")
    return src, dst


def check_table_regions(side: str, table: I64Array, num_regions: int) -> None:
    """ConfigError naming the first tensor of the strides ``table`` whose region is not one of
    ``side``'s ``num_regions``."""
    regions = table[:, 0]
    if regions.size and int(regions.max()) >= num_regions:
        t = int(np.argmax(regions >= num_regions))
        raise ConfigError(f"{side} tensor {t} names region {int(regions[t])} of {num_regions}")


def _run_addresses(
    side: str,
    bases: U64Array,
    lengths: U64Array,
    table: I64Array,
    slots: I64Array,
    page_size: int,
    head_start: int,
    num_heads: int,
    head_bytes: int,
) -> U64Array:
    """Start address of every (tensor, token, head) run of ``head_bytes``, tensor-major then token then
    head; ConfigError naming the tensor when a run leaves its region."""
    check_table_regions(side, table, bases.size)
    regions = table[:, 0]
    blocks, tokens = np.divmod(slots, page_size)
    heads = np.arange(head_start, head_start + num_heads, dtype=np.int64)
    # offsets within each tensor: (token, head) grid, then per tensor
    per_token = blocks[None, :] * table[:, 2:3] + tokens[None, :] * table[:, 4:5]  # (T, N)
    offsets = per_token[:, :, None] + heads[None, None, :] * table[:, 3][:, None, None]  # (T, N, H)
    offsets += table[:, 1][:, None, None]
    if offsets.size:
        last = offsets.reshape(offsets.shape[0], -1).max(axis=1) + head_bytes  # (T,)
        over = last.astype(np.uint64) > lengths[regions]
        if over.any():
            t = int(np.argmax(over))
            raise ConfigError(
                f"{side} tensor {t}: a run ends {int(last[t])} bytes into region {int(regions[t])}, "
                f"which has {int(lengths[regions[t]])} bytes"
            )
    return (bases[regions][:, None, None] + offsets.astype(np.uint64)).ravel()


def strided_descriptors(
    src_bases: npt.ArrayLike,
    src_lengths: npt.ArrayLike,
    src_strides: npt.ArrayLike,
    dst_bases: npt.ArrayLike,
    dst_lengths: npt.ArrayLike,
    dst_strides: npt.ArrayLike,
    head_bytes: int,
    src_slots: npt.ArrayLike,
    dst_slots: npt.ArrayLike,
    src_page_size: int,
    dst_page_size: int,
    src_head_start: int,
    dst_head_start: int,
    num_heads: int,
    src_heads_local: int,
    dst_heads_local: int,
) -> tuple[U64Array, U64Array, U64Array]:
    """Descriptors moving heads ``[src_head_start, +num_heads)`` of every KV tensor and token to heads
    ``[dst_head_start, +num_heads)`` on the other side, whatever the two layouts are.

    ``*_bases``/``*_lengths`` are each side's registered regions (their counts may differ) and
    ``*_strides`` its strides tables (:data:`STRIDE_FIELDS`; equal row counts, tensor ``t`` of one side goes to tensor ``t`` of the
    other). ``src_slots[i]`` goes to ``dst_slots[i]``; slot ``s`` is token ``s % page_size`` of block
    ``s // page_size`` on its side. Every ``head_bytes`` run is computed on both sides; runs are then
    ordered by source address and merged wherever both sides continue contiguously, so a layout that
    keeps a block (or a rank's head slice of it, or K beside V) in one piece moves as one descriptor
    per such piece. ``*_heads_local`` are the heads each side holds. Raises :class:`ConfigError`
    naming the value when the tables differ in size, a head slice does not fit a side's heads, a run
    leaves its region, or the slot arrays differ in length.
    """
    src_b, src_len = region_arrays("src", src_bases, src_lengths)
    dst_b, dst_len = region_arrays("dst", dst_bases, dst_lengths)
    src_t, dst_t = strides_pair(src_strides, dst_strides)
    src_s, dst_s = _paired(index_array, "tokens", ("src_slots", src_slots), ("dst_slots", dst_slots))
    _check_at_least("head_bytes", head_bytes, 1)
    _check_at_least("num_heads", num_heads, 1)
    _check_at_least("src_page_size", src_page_size, 1)
    _check_at_least("dst_page_size", dst_page_size, 1)
    _check_at_least("src_head_start", src_head_start, 0)
    _check_at_least("dst_head_start", dst_head_start, 0)
    check_head_slice("src", src_head_start, num_heads, src_heads_local)
    check_head_slice("dst", dst_head_start, num_heads, dst_heads_local)
    src = _run_addresses(
        "src", src_b, src_len, src_t, src_s, src_page_size, src_head_start, num_heads, head_bytes
    )
    dst = _run_addresses(
        "dst", dst_b, dst_len, dst_t, dst_s, dst_page_size, dst_head_start, num_heads, head_bytes
    )
    if src.size == 0:
        return src, dst, np.zeros(0, dtype=np.uint64)
    order = np.argsort(src, kind="stable")
    src, dst = src[order], dst[order]
    step = np.uint64(head_bytes)
    starts, counts = _runs(src, dst, step)
    return src[starts], dst[starts], counts.astype(np.uint64) * step


def slice_pieces_per_page(
    src_strides: npt.ArrayLike,
    dst_strides: npt.ArrayLike,
    head_bytes: int,
    src_page_size: int,
    dst_page_size: int,
    src_head_start: int,
    dst_head_start: int,
    num_heads: int,
    src_heads_local: int,
    dst_heads_local: int,
) -> float:
    """How many descriptors the slice path needs per page (of the smaller page size) for this head
    slice between these two layouts: :func:`strided_descriptors` on a sample of ``lcm`` page-size
    tokens laid on every other page of each side (so no two pages merge by adjacency), over
    synthetic regions. The contiguous layout's direct path needs one per tensor per page; vLLM CPU
    to vLLM CPU with a TP-2 head slice one per layer (K and V merge), while FlashAttention NHD to
    HND needs one per (tensor, token, head). Pure; ConfigError as for :func:`strided_descriptors`.
    """
    src_t = strides_table(src_strides, "src_strides")
    dst_t = strides_table(dst_strides, "dst_strides")
    _check_at_least("src_page_size", src_page_size, 1)
    _check_at_least("dst_page_size", dst_page_size, 1)
    tokens = int(np.lcm(src_page_size, dst_page_size))
    offsets = np.arange(tokens, dtype=np.int64)

    def sample(table: I64Array, page_size: int) -> tuple[U64Array, U64Array, I64Array]:
        regions = int(table[:, 0].max()) + 1 if table.size else 1
        span = np.uint64(1 << 44)  # far beyond any table's reach: regions never look adjacent
        bases = np.arange(regions, dtype=np.uint64) * span + span
        lengths = np.full(regions, span >> np.uint64(1), dtype=np.uint64)
        slots = 2 * (offsets // page_size) * page_size + offsets % page_size
        return bases, lengths, slots

    src_b, src_len, src_s = sample(src_t, src_page_size)
    dst_b, dst_len, dst_s = sample(dst_t, dst_page_size)
    src, _, _ = strided_descriptors(
        src_b, src_len, src_t, dst_b, dst_len, dst_t, head_bytes, src_s, dst_s, src_page_size,
        dst_page_size, src_head_start, dst_head_start, num_heads, src_heads_local, dst_heads_local,
    )  # fmt: skip
    return src.size / (tokens / min(src_page_size, dst_page_size))
