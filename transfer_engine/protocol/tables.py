"""Descriptor tables made once per (local pool, remote pool), and each WRITE as two index arrays.

NIXL's cheap way to post many WRITEs between the same two pools is to prepare one descriptor list per
side once (``prep_xfer_dlist``) and make each WRITE from index arrays into them
(``make_prepped_xfer(op, local_list, local_idx, remote_list, remote_idx, notif)``: descriptor
``local_idx[i]`` of the local list goes to descriptor ``remote_idx[i]`` of the remote one, equal
lengths). This module is the arithmetic of that, pure (numpy only; no torch, NIXL, ZMQ or anyio):

1. :func:`decide_table`, once per (writer rank, reader rank) pair at handshake: the coarsest *entry*
   both layouts share, returned as a :class:`TableSpec`. An entry is a box of ``kv x layers x
   heads x tokens`` (sizes ``2 or 1``, :attr:`~TableSpec.layers_per_entry`,
   :attr:`~TableSpec.heads_per_entry`, :attr:`~TableSpec.tokens_per_entry`) of ``head_bytes``
   runs that is ONE contiguous byte run on each side, with the same byte order on both, so entry
   ``i`` of one side and entry ``j`` of the other move as one descriptor pair. Pages of unequal
   size share runs of at most ``gcd(page sizes)`` tokens; a head slice (hetero TP) is split into
   at most ``num_heads`` heads per entry.
2. :func:`side_entries`, once per side and pair: ``(addr, length)`` of every entry of the side's
   whole pool (every tensor, every page), the list to prepare. Page-major: entry
   ``(slot_group * num_units + unit) * head_groups + head_group``, where ``slot_group = page *
   groups_per_page + token_group``; its size never depends on the other side's pool.
3. :func:`write_indices` (or :func:`chunk_groups` once per chunk, then :func:`group_indices` per
   layer group), per WRITE: the two int32 index arrays, from outer sums of the chunk's page ids
   and the group's entry units. No sort, no per-head Python loop.

Contracts:

- Strides tables are ``descriptors.STRIDE_FIELDS`` rows, one per KV tensor in the engine's order
  ``[K_0..K_{L-1}, V_0..V_{L-1}]`` (``[C_0..C_{L-1}]`` for MLA), equal counts on both sides; head
  ``h`` of token ``n`` of page ``b`` of tensor ``t`` starts at ``bases[region] + offset + b * block +
  h * head + n * token``. A table built from them moves exactly the bytes
  ``descriptors.strided_descriptors`` moves for the same pages and head slice (tests/unit/test_tables.py
  checks the pairs of byte runs on every layout case).
- *Units*: the tensors of one entry. ``kv_fused`` puts K and V of a layer in one entry (vLLM's
  layouts: a head's K and V sit side by side); ``layers_per_entry = m`` puts ``m`` consecutive
  layers in one (block-major layouts: a block holds every layer). Unit ``u`` is layers
  ``[u * m, (u + 1) * m)`` (K and V when fused); unfused, units ``[0, L/m)`` are K's and ``[L/m,
  2L/m)`` V's. A layer group can be written from a table only if its tensors are whole units:
  decide with ``group_layers`` equal to the layers per group (groups starting at multiples of it)
  and ``m`` divides ``gcd(num_layers, group_layers)``; ``group_layers=None`` allows whole chunks
  only, so a block-major layout gets one entry per block of every layer. A pair that writes both
  whole chunks and layer groups of a block-major layout keeps two specs and two tables.
- Chunks: ``src_pages`` are the writer's pages of the chunk, its first token at the start of
  ``src_pages[0]``; ``dst_pages`` the reader's pages of the request, the chunk starting at request
  token ``dst_start_token``; ``num_tokens`` defaults to what both page lists hold (as
  ``descriptors.chunk_tokens`` clips it). ``dst_start_token`` and ``num_tokens`` are multiples of
  ``tokens_per_entry`` (always so for whole source pages: it divides both page sizes). Indices are
  valid for the tables when every page is below its side's ``num_pages``: the caller checks pages
  against its pool (as the worker does) and the transport checks indices against the lists.
- Memory: a side's table holds :meth:`TableSpec.table_entries` entries, 8 bytes each here (the
  length column is one broadcast value), 24 in the ``(addr, len, dev)`` array NIXL is given, plus
  NIXL's own per-descriptor copy. Coarse entries (``(layer, page)``: 64 layers x 100K pages = 6.4M)
  are small; per-token entries (hetero TP across an NHD layout: ``(layer, token)``) are
  ``page_size`` times more, and per-(token, head) entries ``heads`` times more again: compute
  :meth:`TableSpec.table_entries` before preparing, and fall back to per-WRITE lists when too big.
- Bad input raises :class:`~transfer_engine.errors.ConfigError` naming the value; nothing is cached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from transfer_engine.errors import ConfigError
from transfer_engine.protocol.descriptors import (
    check_head_slice,
    check_table_regions,
    index_array,
    region_arrays,
    strides_pair,
    strides_table,
)

__all__ = [
    "Side",
    "TableSpec",
    "chunk_groups",
    "decide_table",
    "group_factors",
    "group_indices",
    "outer_sums",
    "side_entries",
    "units_of",
    "write_factors",
    "write_indices",
]

Side = Literal["src", "dst"]
U64Array = npt.NDArray[np.uint64]
I64Array = npt.NDArray[np.int64]
I32Array = npt.NDArray[np.int32]

_INDEX_LIMIT = 2**31
"""NIXL takes int32 indices: a table never holds more entries than this."""
_PAGES_PER_STEP = 1 << 16
"""Pages filled per numpy pass in :func:`side_entries`: bounds its temporaries."""


def _check_int(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or int(value) < minimum:
        raise ConfigError(f"{name}={value!r} must be an integer >= {minimum}")
    return int(value)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)}, reverse=True)


def _uniform(values: I64Array) -> int | None:
    """The one value of ``values`` if they are all equal and positive, else None."""
    if values.size == 0 or int(values.min()) != int(values.max()) or int(values[0]) <= 0:
        return None
    return int(values[0])


def _same_run(a: I64Array, b: I64Array) -> int | None:
    """The uniform positive offset of rows ``b`` past rows ``a`` when each pair shares its region and
    its block, head and token strides (so ``b``'s every head sits that far past ``a``'s), else None."""
    if a.shape[0] == 0:
        return None
    if not ((a[:, 0] == b[:, 0]).all() and (a[:, 2:] == b[:, 2:]).all()):
        return None
    return _uniform(b[:, 1] - a[:, 1])


class _SideStrides:
    """The strides one side's table offers each box dimension (None where it offers none)."""

    def __init__(self, table: I64Array, num_layers: int, mla: bool) -> None:
        self.table, self.num_layers, self.mla = table, num_layers, mla
        self.head = _uniform(table[:, 3])
        self.token = _uniform(table[:, 4])
        self.kv = None if mla else _same_run(table[:num_layers], table[num_layers:])
        self._layers: dict[int, int | None] = {}

    def layer(self, m: int) -> int | None:
        """The stride from one layer to the next inside units of ``m`` layers (K's and V's alike)."""
        if m not in self._layers:
            L = self.num_layers
            within = np.arange(L - 1) % m != m - 1
            parts = [self.table[:L]] if self.mla else [self.table[:L], self.table[L:]]
            found = {_same_run(p[:-1][within], p[1:][within]) for p in parts}
            self._layers[m] = found.pop() if len(found) == 1 else None
        return self._layers[m]

    def of(self, dim: str, size: int) -> int | None:
        if dim == "layer":
            return self.layer(size)
        value: int | None = getattr(self, dim)
        return value


@dataclass(frozen=True, slots=True)
class TableSpec:
    """What one (writer rank, reader rank) pair's tables hold (:func:`decide_table`; the module
    docstring). Immutable and hashable: a key for the prepared lists."""

    head_bytes: int
    num_layers: int
    mla: bool
    num_heads: int
    """Heads moved per token (the writer's head slice)."""
    src_page_size: int
    dst_page_size: int
    src_head_start: int
    dst_head_start: int
    layers_per_entry: int
    kv_fused: bool
    heads_per_entry: int
    tokens_per_entry: int
    order: tuple[tuple[str, int, int], ...]
    """The entry's dimensions of size > 1, innermost first: ``(name, size, stride in bytes)``, the
    same on both sides (``kv``, ``layer``, ``head``, ``token``); the first stride is ``head_bytes``."""

    @property
    def entry_bytes(self) -> int:
        """Bytes of one entry, on either side."""
        return (
            self.head_bytes
            * (2 if self.kv_fused else 1)
            * self.layers_per_entry
            * self.heads_per_entry
            * self.tokens_per_entry
        )

    @property
    def num_tensors(self) -> int:
        return self.num_layers if self.mla else 2 * self.num_layers

    @property
    def tensors_per_entry(self) -> int:
        return self.layers_per_entry * (2 if self.kv_fused else 1)

    @property
    def num_units(self) -> int:
        """Entries per (token group, head group): tensor units of the module docstring."""
        return self.num_tensors // self.tensors_per_entry

    @property
    def head_groups(self) -> int:
        """Entries across the head slice per (unit, token group)."""
        return self.num_heads // self.heads_per_entry

    def page_size(self, side: Side) -> int:
        return self.src_page_size if _side(side) == "src" else self.dst_page_size

    def head_start(self, side: Side) -> int:
        return self.src_head_start if _side(side) == "src" else self.dst_head_start

    def groups_per_page(self, side: Side) -> int:
        """Token groups (of ``tokens_per_entry`` tokens) per page of ``side``."""
        return self.page_size(side) // self.tokens_per_entry

    def entries_per_page(self, side: Side) -> int:
        """Entries per (unit, page) of ``side``: ``groups_per_page * head_groups``."""
        return self.groups_per_page(side) * self.head_groups

    def table_entries(self, side: Side, num_pages: int) -> int:
        """Entries of ``side``'s table over a pool of ``num_pages`` pages."""
        return num_pages * self.entries_per_page(side) * self.num_units

    def unit_rows(self, unit: int) -> list[int]:
        """The tensor indices (strides rows) entry unit ``unit`` holds, in row order."""
        L, m = self.num_layers, self.layers_per_entry
        per_kind = L // m
        if self.mla or self.kv_fused:
            first = unit * m
            rows = list(range(first, first + m))
            return rows if self.mla else rows + [L + r for r in rows]
        kind, u = divmod(unit, per_kind)
        return list(range(kind * L + u * m, kind * L + (u + 1) * m))

    @property
    def granularity(self) -> str:
        """The entry in words, e.g. ``(layer, page)``, ``(tensor, token, head)``, ``(every layer, page)``."""
        L, m = self.num_layers, self.layers_per_entry
        layers = self.kv_fused or self.mla
        if m == L > 1 and layers:
            parts = ["every layer"]
        elif m > 1:
            parts = [f"{m} layers" if layers else f"{m} tensors"]
        else:
            parts = ["layer" if layers else "tensor"]
        g = self.tokens_per_entry
        if g == self.src_page_size == self.dst_page_size:
            parts.append("page")
        else:
            parts.append("token" if g == 1 else f"{g} tokens")
        k = self.heads_per_entry
        if k < self.num_heads:
            parts.append("head" if k == 1 else f"{k} heads")
        return f"({', '.join(parts)})"


def _side(side: object) -> Side:
    if side == "src" or side == "dst":
        return side
    raise ConfigError(f"side={side!r} must be 'src' or 'dst'")


def decide_table(
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
    *,
    mla: bool = False,
    group_layers: int | None = None,
) -> TableSpec:
    """The coarsest entry the two layouts share for moving heads ``[src_head_start, +num_heads)`` of
    every tensor to heads ``[dst_head_start, +num_heads)`` (arguments as
    ``descriptors.strided_descriptors``'; ``mla``: the tables list ``L`` latents, else ``2L`` K/V).

    Every box of ``kv x layers x heads x tokens`` whose sizes divide their bounds (2, ``gcd(L,
    group_layers)``, ``num_heads``, ``gcd(page sizes)``) is tried, largest first; it is taken when
    each dimension of size > 1 has one stride over all tensors, equal on both sides, and the
    dimensions sorted by stride pack without gaps from ``head_bytes`` (one contiguous run, the same
    byte order on both sides). The box of one head of one token of one tensor always qualifies.
    Called once per pair at handshake (a few ms at most). Raises :class:`ConfigError` naming the
    value: tables of other sizes or shapes, a head slice outside a side's heads, a bound below 1.
    """
    src_t, dst_t = strides_pair(src_strides, dst_strides)
    count = src_t.shape[0]
    if count == 0 or (not mla and count % 2):
        raise ConfigError(
            f"src_strides describes {count} tensors; expected {'L >= 1 latents' if mla else '2L >= 2 (K and V of each layer)'}"
        )
    num_layers = count if mla else count // 2
    head_bytes = _check_int("head_bytes", head_bytes, 1)
    src_ps = _check_int("src_page_size", src_page_size, 1)
    dst_ps = _check_int("dst_page_size", dst_page_size, 1)
    num_heads = _check_int("num_heads", num_heads, 1)
    starts = {}
    for side, start, held in (
        ("src", src_head_start, src_heads_local),
        ("dst", dst_head_start, dst_heads_local),
    ):
        starts[side] = _check_int(f"{side}_head_start", start, 0)
        _check_int(f"{side}_heads_local", held, 1)
        check_head_slice(side, starts[side], num_heads, held)
    if group_layers is None:
        max_layers = num_layers
    else:
        max_layers = math.gcd(num_layers, _check_int("group_layers", group_layers, 1))
    sides = (_SideStrides(src_t, num_layers, mla), _SideStrides(dst_t, num_layers, mla))
    candidates = [
        (kv * m * k * g, kv, g, k, m)
        for m in _divisors(max_layers)
        for kv in ((1,) if mla else (2, 1))
        for k in _divisors(num_heads)
        for g in _divisors(math.gcd(src_ps, dst_ps))
    ]
    candidates.sort(reverse=True)
    for _, kv, g, k, m in candidates:
        order = _packed(sides, head_bytes, (("kv", kv), ("layer", m), ("head", k), ("token", g)))
        if order is not None:
            return TableSpec(
                head_bytes=head_bytes,
                num_layers=num_layers,
                mla=mla,
                num_heads=num_heads,
                src_page_size=src_ps,
                dst_page_size=dst_ps,
                src_head_start=starts["src"],
                dst_head_start=starts["dst"],
                layers_per_entry=m,
                kv_fused=kv == 2,
                heads_per_entry=k,
                tokens_per_entry=g,
                order=order,
            )
    raise AssertionError("the one-head box always qualifies")  # pragma: no cover


def _packed(
    sides: tuple[_SideStrides, _SideStrides], head_bytes: int, dims: tuple[tuple[str, int], ...]
) -> tuple[tuple[str, int, int], ...] | None:
    """``dims`` (name, size) as ``order`` when they form one gap-free run of equal strides on both
    sides (see :func:`decide_table`), else None."""
    placed = []
    for name, size in dims:
        if size == 1:
            continue
        stride = sides[0].of(name, size)
        if stride is None or stride != sides[1].of(name, size):
            return None
        placed.append((stride, name, size))
    placed.sort()
    expected = head_bytes
    for stride, _, size in placed:
        if stride != expected:
            return None
        expected = stride * size
    return tuple((name, size, stride) for stride, name, size in placed)


def side_entries(
    spec: TableSpec,
    side: Side,
    bases: npt.ArrayLike,
    lengths: npt.ArrayLike,
    strides: npt.ArrayLike,
    num_pages: int,
) -> tuple[U64Array, U64Array]:
    """``(addr, length)`` of every entry of ``side``'s table over its whole pool (``num_pages`` pages
    of every tensor), in the table order of the module docstring: the list to prepare once.

    ``bases``/``lengths``: the side's registered regions; ``strides``: its strides table, which must
    offer the spec's entry (the one :func:`decide_table` was given). ``addr`` is uint64 of
    :meth:`TableSpec.table_entries` entries; ``length`` a read-only broadcast of ``entry_bytes``
    over it. Vectorized over pages (a bounded number of numpy passes per 64K pages): measured in
    docs/PERF.md, "Planning from descriptor tables". Raises :class:`ConfigError` naming the tensor
    when an entry leaves its region or a tensor names a region that is not there, and naming the
    value for bad arguments.
    """
    side = _side(side)
    base, length = region_arrays(side, bases, lengths)
    table = strides_table(strides, f"{side}_strides")
    if table.shape[0] != spec.num_tensors:
        raise ConfigError(f"{side}_strides describes {table.shape[0]} tensors, the spec {spec.num_tensors}")
    num_pages = _check_int("num_pages", num_pages, 1)
    check_table_regions(side, table, base.size)
    offered = _SideStrides(table, spec.num_layers, spec.mla)
    for name, size, stride in spec.order:
        got = offered.of(name, size)
        if got != stride:
            raise ConfigError(
                f"{side}_strides give the {name} dimension stride {got}, the spec's entries need {stride}"
            )
    total = spec.table_entries(side, num_pages)
    if total >= _INDEX_LIMIT:
        raise ConfigError(
            f"{side} table of {total} entries ({spec.granularity} over {num_pages} pages) exceeds NIXL's "
            f"int32 indices"
        )
    firsts = np.array([spec.unit_rows(u)[0] for u in range(spec.num_units)], dtype=np.int64)
    rows = table[firsts]
    g, per_page, heads = spec.tokens_per_entry, spec.groups_per_page(side), spec.head_groups
    h0, k = spec.head_start(side), spec.heads_per_entry
    # Check every unit's last entry (strides are >= 0: it is the farthest) against its region.
    for u, (region, offset, block, head, token) in enumerate(rows.tolist()):
        end = offset + (num_pages - 1) * block + (per_page - 1) * g * token
        end += (h0 + (heads - 1) * k) * head + spec.entry_bytes
        if end > int(length[region]):
            raise ConfigError(
                f"{side} tensor {int(firsts[u])}: an entry ends {end} bytes into region {region}, which has "
                f"{int(length[region])} bytes"
            )
    u64 = np.uint64
    units = spec.num_units
    start = base[rows[:, 0]] + rows[:, 1].astype(u64)  # (units,)
    within = (
        np.arange(per_page, dtype=u64)[:, None] * (rows[:, 4] * g).astype(u64)[None, :]
    )  # (groups, units)
    across = ((h0 + np.arange(heads) * k)[None, :] * rows[:, 3][:, None]).astype(u64)  # (units, heads)
    # One page's entries, flat (group, unit, head), and each one's page stride: every page is then
    # two passes with long inner loops (a short innermost axis costs numpy a loop per few entries).
    fixed = (start[None, :, None] + within[:, :, None] + across[None, :, :]).reshape(-1)
    block = np.broadcast_to(rows[:, 2].astype(u64)[None, :, None], (per_page, units, heads)).reshape(-1)
    out = np.empty((num_pages, fixed.size), dtype=u64)
    for p0 in range(0, num_pages, _PAGES_PER_STEP):
        p1 = min(num_pages, p0 + _PAGES_PER_STEP)
        view = out[p0:p1]
        np.multiply(np.arange(p0, p1, dtype=u64)[:, None], block[None, :], out=view)
        np.add(view, fixed[None, :], out=view)
    addr = out.reshape(-1)
    return addr, np.broadcast_to(u64(spec.entry_bytes), addr.shape)


def chunk_groups(
    spec: TableSpec,
    src_pages: npt.ArrayLike,
    dst_pages: npt.ArrayLike,
    *,
    dst_start_token: int = 0,
    num_tokens: int | None = None,
) -> tuple[I64Array, I64Array]:
    """The slot groups (``page * groups_per_page + token_group``) of a chunk's tokens on each side,
    int64 in token order: one per ``tokens_per_entry`` tokens (pages and tokens as the module
    docstring says). Computed once per chunk, shared by its layer groups (:func:`group_indices`).
    Raises :class:`ConfigError` naming the value when the tokens do not lie inside either side's
    pages or do not start and end on a token group."""
    src = index_array(src_pages, "src_pages")
    dst = index_array(dst_pages, "dst_pages")
    g = spec.tokens_per_entry
    rs, rd = spec.src_page_size // g, spec.dst_page_size // g
    start = _check_int("dst_start_token", dst_start_token, 0)
    src_cap, dst_cap = src.size * spec.src_page_size, dst.size * spec.dst_page_size
    tokens = (
        max(0, min(src_cap, dst_cap - start))
        if num_tokens is None
        else _check_int("num_tokens", num_tokens, 0)
    )
    if tokens > src_cap or start + tokens > dst_cap:
        raise ConfigError(
            f"num_tokens={tokens} from dst_start_token={start} do not fit {src.size} src pages of "
            f"{spec.src_page_size} and {dst.size} dst pages of {spec.dst_page_size}"
        )
    if start % g or tokens % g:
        raise ConfigError(
            f"dst_start_token={start} and num_tokens={tokens} must be multiples of the entries' {g} tokens"
        )
    n, q0 = tokens // g, start // g
    if rs == 1:
        src_groups = src[:n]
    else:
        src_groups = (src[: -(-n // rs), None] * rs + np.arange(rs)).reshape(-1)[:n]
    if rd == 1:
        dst_groups = dst[q0 : q0 + n]
    else:
        first = q0 // rd
        last = -(-(q0 + n) // rd)
        dst_groups = (dst[first:last, None] * rd + np.arange(rd)).reshape(-1)[q0 - first * rd :][:n]
    return src_groups, dst_groups


def units_of(spec: TableSpec, rows: npt.ArrayLike | None) -> I64Array:
    """The entry units (module docstring) holding exactly the tensors ``rows``, ascending; every unit
    when None. :class:`ConfigError` when ``rows`` repeat a tensor, name one outside the tables, or
    hold part of a unit (a layer group that does not start or end on ``layers_per_entry``)."""
    if rows is None:
        return np.arange(spec.num_units, dtype=np.int64)
    r = np.asarray(rows)
    if r.ndim != 1 or r.size == 0 or not np.issubdtype(r.dtype, np.integer):
        raise ConfigError(f"rows must be a non-empty 1-D integer array, got {r.dtype} {r.shape}")
    if int(r.min()) < 0 or int(r.max()) >= spec.num_tensors:
        raise ConfigError(f"rows {r.tolist()} name a tensor outside [0, {spec.num_tensors})")
    if np.unique(r).size != r.size:
        raise ConfigError(f"rows {r.tolist()} repeat a tensor")
    L, m = spec.num_layers, spec.layers_per_entry
    if spec.mla:
        unit = r // m
    elif spec.kv_fused:
        unit = (r % L) // m
    else:
        unit = (r % L) // m + (r // L) * (L // m)
    counts = np.bincount(unit, minlength=spec.num_units)
    partial = np.flatnonzero((counts > 0) & (counts != spec.tensors_per_entry))
    if partial.size:
        u = int(partial[0])
        raise ConfigError(
            f"rows {r.tolist()} hold part of entry unit {u} (tensors {spec.unit_rows(u)}): the table's "
            f"entries are {spec.granularity}"
        )
    return np.flatnonzero(counts).astype(np.int64)


def group_factors(
    spec: TableSpec, groups: tuple[I64Array, I64Array], rows: npt.ArrayLike | None = None
) -> tuple[I32Array, I32Array, I32Array]:
    """``(offsets, src_cols, dst_cols)`` int32: the WRITE :func:`group_indices` lists, as the two factors
    of its outer sums. Pair ``(u, j)``, unit-major, is entry ``offsets[u] + src_cols[j]`` onto entry
    ``offsets[u] + dst_cols[j]``: ``offsets`` one per entry unit of ``rows``, the columns one per
    (token group, head group) of the chunk. The copy kernel takes them as they are
    (``kernels.copy.copy_outer``): a WRITE of U units over C columns sends U + 2C integers, not 2UC.
    Raises as :func:`group_indices`."""
    units = units_of(spec, rows)
    src_g, dst_g = groups
    step = spec.num_units * spec.head_groups
    top = max(int(src_g.max()), int(dst_g.max())) if src_g.size else 0
    if (top + 1) * step > _INDEX_LIMIT:
        raise ConfigError(f"page slot group {top} gives table indices beyond int32 ({spec.granularity})")
    i32 = np.int32
    src32, dst32 = src_g.astype(i32) * i32(step), dst_g.astype(i32) * i32(step)
    heads = spec.head_groups
    if heads > 1:  # (token, head): a token group's head groups are adjacent entries
        within = np.arange(heads, dtype=i32)[None, :]
        src32, dst32 = (src32[:, None] + within).reshape(-1), (dst32[:, None] + within).reshape(-1)
    return (units * heads).astype(i32), src32, dst32


def group_indices(
    spec: TableSpec, groups: tuple[I64Array, I64Array], rows: npt.ArrayLike | None = None
) -> tuple[I32Array, I32Array]:
    """``(src_idx, dst_idx)`` int32, equal lengths: the WRITE of the tensors ``rows`` (a layer group's,
    ``protocol.layers.group_tensors``; None: every tensor) over the chunk whose :func:`chunk_groups`
    are ``groups``. Unit-major, then token order, then head group, so runs of pages consecutive on
    both sides stay adjacent (NIXL merges adjacent descriptors). The outer sums of
    :func:`group_factors` (one long pass per unit: numpy's inner loops stay long); raises
    :class:`ConfigError` as :func:`units_of`, or when an index would not fit in int32."""
    offsets, src_cols, dst_cols = group_factors(spec, groups, rows)
    return outer_sums(offsets, src_cols), outer_sums(offsets, dst_cols)


def outer_sums(offsets: I32Array, cols: I32Array) -> I32Array:
    """``offsets[u] + cols[j]`` for every ``(u, j)``, unit-major, int32: one side of a WRITE's entries
    from :func:`group_factors`."""
    return (offsets[:, None] + cols[None, :]).reshape(-1)


def write_indices(
    spec: TableSpec,
    src_pages: npt.ArrayLike,
    dst_pages: npt.ArrayLike,
    rows: npt.ArrayLike | None = None,
    *,
    dst_start_token: int = 0,
    num_tokens: int | None = None,
) -> tuple[I32Array, I32Array]:
    """``(src_idx, dst_idx)`` int32 of one WRITE: :func:`group_indices` of :func:`chunk_groups`.
    Per WRITE, on the engine's loop: tens of microseconds for a 16K-token layer group of a
    (layer, page) table (docs/PERF.md, "Planning from descriptor tables")."""
    offsets, src_cols, dst_cols = write_factors(
        spec, src_pages, dst_pages, rows, dst_start_token=dst_start_token, num_tokens=num_tokens
    )
    return outer_sums(offsets, src_cols), outer_sums(offsets, dst_cols)


def write_factors(
    spec: TableSpec,
    src_pages: npt.ArrayLike,
    dst_pages: npt.ArrayLike,
    rows: npt.ArrayLike | None = None,
    *,
    dst_start_token: int = 0,
    num_tokens: int | None = None,
) -> tuple[I32Array, I32Array, I32Array]:
    """``(offsets, src_cols, dst_cols)`` int32 of one WRITE: :func:`group_factors` of
    :func:`chunk_groups`, the factors of :func:`write_indices`' outer sums."""
    groups = chunk_groups(spec, src_pages, dst_pages, dst_start_token=dst_start_token, num_tokens=num_tokens)
    return group_factors(spec, groups, rows)
