"""Decode scatter: a staging region holding several writers' blocks, back into the KV pages.

For each block ``b = (offset, dst_head_start, n)`` of ``blocks``, the bytes of ``region`` from
``offset`` on hold ``[T, tokens, n, head_dim]`` (T = len(kv)), and
``kv[t][slots[i], dst_head_start + j, :] = block[t, i, j, :]`` for every tensor, token and head.
This is the inverse of ``gather_heads`` (staged path: writers ordered by
``dst_head_start``, each its own block in the ring region). ``kv`` may be paged views ``[num_blocks,
block_size, H, D]`` as for the gather: the region's format does not depend on the KV layout.

One launch covers every block and tensor: the grid is (pieces / BLOCK, tensors, blocks). Each
block's token rows are split into equal power-of-two pieces (as in the gather) and each program
copies ``BLOCK`` consecutive (token, piece) pairs of one block of one tensor, about
``block_bytes``, in 16-byte vectors. ``region`` may be
device memory or pinned host memory (the kernel then reads the host directly). On CPU, the same
entry point runs the torch reference below, or the Triton kernel under Triton's interpreter.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ._common import (
    INT_VIEW,
    Impl,
    KernelInputError,
    KVTable,
    LaunchConfig,
    SlotIndex,
    as_kv_table,
    block_table,
    check_heads,
    check_stream,
    column_block,
    copy_unit,
    launcher,
    piece_block,
    prepare_slots,
    resolve_impl,
    slot_count,
    slot_rows,
    staging_view,
    triton_int,
)

__all__ = ["scatter_heads", "scatter_heads_reference"]

DEFAULT_CONFIG = LaunchConfig(block_bytes=8192, num_warps=4)
"""Launch shape for a device-memory ``region``. Small tiles: this kernel holds two per-row
addresses, and at 32 KiB/program its 168 registers leave 3 blocks per SM (71-77% of a copy on an
H200 against 89-93% at 8 KiB); see docs/PERF.md."""
HOST_CONFIG = LaunchConfig(block_bytes=8192, num_warps=4)
"""Launch shape for a pinned-host ``region``; see docs/PERF.md."""


@triton.jit(do_not_specialize=["tokens"])  # one compiled kernel for every room size
def _scatter_kernel(
    region,  # *UNIT: the staging region
    kv_base,  # *UNIT: kv[0]; tensor t starts at kv_base + table[t, 0]
    table,  # *i64 [T, 4]: (offset from kv[0], block, token and head strides) in units
    blocks,  # *i64 [NB, 3]: (offset in region in units, dst head start, heads)
    slots,  # *i32 | *i64 [tokens]
    tokens,
    VEC: tl.constexpr,  # units per aligned 16-byte vector: every offset below is a multiple
    DU: tl.constexpr,  # head_dim in units
    PIECE: tl.constexpr,  # units per piece of a block's row
    BLOCK: tl.constexpr,  # pieces per program
    EVEN: tl.constexpr,  # PIECE divides every block's row: no column mask
    HEADS_CONTIG: tl.constexpr,  # every head stride equals DU: a row is contiguous in kv too
    FLAT: tl.constexpr,  # every block stride is PAGE token strides: slot s is s * token stride
    PAGE: tl.constexpr,  # tokens per block (unused when FLAT)
):
    # A program copies BLOCK consecutive (token, piece) pairs of block b, tensor t: contiguous
    # in the region, one contiguous run of kv each. Programs past a narrower block's end are
    # fully masked.
    t = tl.program_id(1)
    b = tl.program_id(2)
    r_off = tl.multiple_of(tl.load(blocks + b * 3), VEC)
    head0 = tl.load(blocks + b * 3 + 1)
    row = tl.load(blocks + b * 3 + 2) * DU
    npiece = (row + PIECE - 1) // PIECE
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tok = r // npiece
    tok_ok = tok < tokens
    slot = tl.load(slots + tok, mask=tok_ok, other=0).to(tl.int64)
    t_off = tl.multiple_of(tl.load(table + t * 4), VEC)
    token_stride = tl.multiple_of(tl.load(table + t * 4 + 2), VEC)
    head_stride = tl.multiple_of(tl.load(table + t * 4 + 3), VEC)
    if FLAT:
        slot_off = slot * token_stride
    else:
        block_stride = tl.multiple_of(tl.load(table + t * 4 + 1), VEC)
        slot_off = (slot // PAGE) * block_stride + (slot % PAGE) * token_stride
    dst_row = tl.multiple_of(t_off + slot_off + head0 * head_stride, VEC)
    src_row = tl.multiple_of(r_off + (t.to(tl.int64) * tokens + tok) * row, VEC)
    cols = ((r % npiece) * PIECE)[:, None] + tl.arange(0, PIECE)[None, :]
    if HEADS_CONTIG:
        dst_cols = cols.to(tl.int64)
    else:
        dst_cols = (cols // DU).to(tl.int64) * head_stride + cols % DU
    src = region + (src_row[:, None] + cols)
    dst = kv_base + (dst_row[:, None] + dst_cols)
    if EVEN:
        mask = tok_ok[:, None]
    else:
        mask = tok_ok[:, None] & (cols < row)
    tl.store(dst, tl.load(src, mask=mask), mask=mask)


def scatter_heads_reference(
    region: torch.Tensor,
    kv: Sequence[torch.Tensor],
    slots: torch.Tensor,
    blocks: Sequence[tuple[int, int, int]],
) -> None:
    """Pure-torch scatter, the reference the kernel is tested against (and the CPU implementation).

    ``region``: 1-D contiguous tensor of kv's dtype, on kv's device or pinned host memory;
    ``kv``: as for ``gather_heads_reference``; ``blocks``: (offset in BYTES, dst head start,
    heads); ``slots``: int ``[tokens]`` on kv's device. One ``index_copy_`` per (block, tensor) on
    the current stream (an advanced-indexing write for views whose blocks do not merge into
    slots); copies through integer views, so every bit pattern survives. Repeated slots: one of
    the rows wins, unspecified which.
    """
    itemsize = kv[0].element_size()
    int_dtype = INT_VIEW[itemsize]
    tokens, head_dim = int(slots.numel()), int(kv[0].shape[-1])
    flat = region.view(int_dtype)
    dsts = [slot_rows(t.view(int_dtype), slots) for t in kv]
    for offset, head0, n in blocks:
        start = offset // itemsize
        part = flat[start : start + len(kv) * tokens * n * head_dim].view(len(kv), tokens, n, head_dim)
        if part.device != kv[0].device:
            part = part.to(kv[0].device, non_blocking=True)
        for t, (dst, index) in enumerate(dsts):
            heads = dst[..., head0 : head0 + n, :]
            if len(index) == 2:
                heads[index] = part[t]
            else:
                heads.index_copy_(0, slots, part[t])


def scatter_heads(
    region: torch.Tensor,
    kv: Sequence[torch.Tensor] | KVTable,
    slots: torch.Tensor | SlotIndex,
    blocks: Sequence[tuple[int, int, int]],
    *,
    stream: torch.cuda.Stream | None = None,
    impl: Impl = "auto",
    config: LaunchConfig | None = None,
) -> None:
    """Scatter every writer's block of ``region`` into heads of ``kv`` at ``slots``, in one launch.

    Shapes:
      - ``region``: contiguous tensor of kv's dtype (any shape) or a uint8 byte buffer, on kv's
        device, or in pinned host memory (host staging) when kv is on CUDA.
      - ``kv``: T tensors ``[num_slots, heads_local, head_dim]`` (MLA: ``[num_slots, 1, kv_dim]``)
        or paged views ``[num_blocks, block_size, heads_local, head_dim]``, as for
        ``gather_heads``; or a :class:`KVTable`.
      - ``slots``: int64/int32 ``[tokens]`` decode token-slot indices in HOST memory (range-checked
        here, then uploaded on ``stream``), or a :class:`SlotIndex`. No slot may repeat.
      - ``blocks``: one ``(offset, dst_head_start, num_heads)`` per writer. ``offset`` is in BYTES
        from the start of ``region`` (a multiple of the itemsize); the block there is
        ``[T, tokens, num_heads, head_dim]`` contiguous and must lie inside ``region``. Blocks may
        not overlap, in ``region`` or in destination heads.

    Stream: the slot and block-table uploads and the launch are enqueued on ``stream`` (default:
    the current stream of kv's device); nothing synchronizes. The KV pages are written, and the
    region may be freed, once that stream reaches this point.

    Every argument is checked before anything is enqueued; a bad one raises
    :class:`KernelInputError` naming it. Zero tokens: nothing is launched.
    ``impl``: as for ``gather_heads``.
    """
    layout = as_kv_table(kv)
    check_stream(stream, layout.device)
    tokens = slot_count(slots)
    flat, host = staging_view(region, "region", layout.dtype, layout.device)
    itemsize = layout.itemsize
    head_bytes_all = len(layout) * tokens * layout.head_dim * itemsize
    table_rows = _check_blocks(blocks, layout.heads, itemsize, head_bytes_all, flat.numel() * itemsize)
    which = resolve_impl(impl, layout.device)
    cfg = config or (HOST_CONFIG if host else DEFAULT_CONFIG)
    index = prepare_slots(slots, layout.num_slots, layout.device, stream=stream)
    if tokens == 0:
        return
    with launcher(layout.device, stream):
        if which == "torch":
            scatter_heads_reference(flat, layout.tensors, index.use(), blocks)
            return
        offsets_gcd = math.gcd(*(off for off, _, _ in table_rows))
        unit, vec = copy_unit(math.gcd(layout.byte_gcd, flat.data_ptr(), offsets_gcd))
        du = layout.head_dim * itemsize // unit
        piece, even = column_block(du * math.gcd(*(n for _, _, n in table_rows)))
        max_pieces = triton.cdiv(max(n for _, _, n in table_rows) * du, piece)
        block = piece_block(cfg.block_bytes, piece * unit)
        unit_dtype = INT_VIEW[unit]
        region_bytes = flat.view(torch.uint8)  # trailing bytes past the last whole unit hold no block
        blocks_on_device = block_table(tuple((off // unit, h, n) for off, h, n in table_rows), layout.device)
        kernel = _scatter_kernel if which == "jit" else triton_int(_scatter_kernel)
        grid = (triton.cdiv(tokens * max_pieces, block), len(layout), len(table_rows))
        kernel[grid](  # type: ignore[index]
            region_bytes[: region_bytes.numel() // unit * unit].view(unit_dtype),
            layout.tensors[0].view(torch.uint8).view(unit_dtype),
            layout.table(unit),
            blocks_on_device,
            index.use(),
            tokens,
            VEC=vec,
            DU=du,
            PIECE=piece,
            BLOCK=block,
            EVEN=even,
            HEADS_CONTIG=layout.heads_contiguous,
            FLAT=layout.flat,
            PAGE=1 if layout.flat else layout.block_size,
            num_warps=cfg.num_warps,
        )


def _check_blocks(
    blocks: Sequence[tuple[int, int, int]], heads: int, itemsize: int, head_bytes_all: int, region_bytes: int
) -> list[tuple[int, int, int]]:
    """Validate writer blocks; ``head_bytes_all``: bytes of one head over all tensors and tokens."""
    if isinstance(blocks, torch.Tensor) or not isinstance(blocks, Sequence) or len(blocks) == 0:
        raise KernelInputError(
            f"blocks must be a non-empty sequence of (offset, dst_head_start, num_heads), got {blocks!r}"
        )
    rows: list[tuple[int, int, int]] = []
    for i, block in enumerate(blocks):
        if len(block) != 3 or not all(isinstance(v, int) and not isinstance(v, bool) for v in block):
            raise KernelInputError(f"blocks[{i}]={block!r} is not (offset, dst_head_start, num_heads) ints")
        offset, head0, n = block
        check_heads(head0, n, heads, f"blocks[{i}] dst_head_start")
        size = n * head_bytes_all
        if offset < 0 or offset % itemsize or offset + size > region_bytes:
            raise KernelInputError(
                f"blocks[{i}] offset {offset} (+{size} bytes) is not an itemsize-aligned range inside "
                f"the {region_bytes}-byte region"
            )
        rows.append((offset, head0, n))
    by_head = sorted(rows, key=lambda r: r[1])
    for a, b in itertools.pairwise(by_head):
        if a[1] + a[2] > b[1]:
            raise KernelInputError(f"blocks {a} and {b} write overlapping destination heads")
    by_offset = sorted(rows)
    for a, b in itertools.pairwise(by_offset):
        if head_bytes_all and a[0] + a[2] * head_bytes_all > b[0]:
            raise KernelInputError(f"blocks {a} and {b} overlap in the region")
    return rows
