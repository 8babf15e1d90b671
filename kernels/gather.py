"""Prefill gather: a head slice of a chunk's tokens, from every layer's K and V, into one buffer.

``out[t, i, j, :] = kv[t][slots[i], head_start + j, :]`` for every tensor ``t`` of ``kv``, token
``i`` and head ``j < num_heads``: the staging layout (``[K_0..K_{L-1},
V_0..V_{L-1}]``, each ``[tokens, n, head_dim]``), or, for MLA, ``[L, tokens, 1, kv_dim]``. For
paged views ``[num_blocks, block_size, H, D]`` (vLLM CPU, FlashAttention NHD/HND), ``kv[t][s]``
reads token ``s % block_size`` of block ``s // block_size``; the staging layout is the same.

One launch covers every tensor: the grid is (pieces / BLOCK, tensors). A token's row
(``num_heads * head_dim`` items of one slot) is split into equal power-of-two pieces (one piece
for rows up to 2 KiB; nine of 128 bytes for a 576-wide bf16 MLA latent), and each program copies
``BLOCK`` consecutive (token, piece) pairs of one tensor, about ``block_bytes``, in 16-byte
vectors. ``out`` may be device memory or pinned host memory (the kernel then writes the
host directly, through its mapped address). On CPU, the same entry point runs the torch
reference below, or the Triton kernel under Triton's interpreter (``TRITON_INTERPRET=1`` or
``impl="triton"``).

With ``checksum`` (integrity, docs/INTEGRITY.md) the same kernel also sums what it writes, as
``kernels.checksum`` defines the sum over the gather layout (its combine and the contiguous sum
of a second read come from ``kernels/_bytesum.py``): each program adds its words' weighted
sum into one partial, and one ``sum`` of the partials lands in ``checksum``. The bytes are read
once, for both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ._bytesum import checksum_bytes, combine
from ._common import (
    INT_VIEW,
    Impl,
    KernelInputError,
    KVTable,
    LaunchConfig,
    SlotIndex,
    as_kv_table,
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

__all__ = ["gather_heads", "gather_heads_reference"]

DEFAULT_CONFIG = LaunchConfig(block_bytes=32768, num_warps=4)
"""Launch shape for device-memory ``out`` (93-96% of a device copy on an H200); see docs/PERF.md."""
HOST_CONFIG = LaunchConfig(block_bytes=32768, num_warps=4)
"""Launch shape for pinned-host ``out``; see docs/PERF.md."""


@triton.jit(do_not_specialize=["tokens", "head_start"])  # one compiled kernel for every room size
def _gather_kernel(
    kv_base,  # *UNIT: kv[0]; tensor t starts at kv_base + table[t, 0]
    table,  # *i64 [T, 4]: (offset from kv[0], block, token and head strides) in units
    slots,  # *i32 | *i64 [tokens]
    out,  # *UNIT [T, tokens, ROW], contiguous
    tokens,
    head_start,
    VEC: tl.constexpr,  # units per aligned 16-byte vector: every offset below is a multiple
    DU: tl.constexpr,  # head_dim in units
    ROW: tl.constexpr,  # units per (tensor, token): num_heads * DU
    PIECE: tl.constexpr,  # units per piece: a row is NPIECE pieces
    NPIECE: tl.constexpr,
    BLOCK: tl.constexpr,  # pieces per program
    EVEN: tl.constexpr,  # PIECE * NPIECE == ROW: no column mask
    HEADS_CONTIG: tl.constexpr,  # every head stride equals DU: a row is contiguous in kv too
    FLAT: tl.constexpr,  # every block stride is PAGE token strides: slot s is s * token stride
    PAGE: tl.constexpr,  # tokens per block (unused when FLAT)
    partials=None,  # *i64 [T, programs]: each program's checksum of what it wrote (SUM)
    SUM: tl.constexpr = False,  # also sum the 32-bit words written (kernels/checksum.py)
    WORDS: tl.constexpr = 1,  # 32-bit words per unit when SUM: 1 (4-byte units) or 2 (8-byte)
):
    # A program copies BLOCK consecutive pieces of tensor t's output, i.e. the (token, piece)
    # pairs r = BLOCK * pid + [0, BLOCK): contiguous in `out`, one contiguous run of kv each.
    t = tl.program_id(1)
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tok = r // NPIECE
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
    src_row = tl.multiple_of(t_off + slot_off + head_start * head_stride, VEC)
    dst_row = tl.multiple_of((t.to(tl.int64) * tokens + tok) * ROW, VEC)
    cols = ((r % NPIECE) * PIECE)[:, None] + tl.arange(0, PIECE)[None, :]
    if HEADS_CONTIG:
        src_cols = cols.to(tl.int64)
    else:
        src_cols = (cols // DU).to(tl.int64) * head_stride + cols % DU
    src = kv_base + (src_row[:, None] + src_cols)
    dst = out + (dst_row[:, None] + cols)
    if EVEN:
        mask = tok_ok[:, None]
    else:
        mask = tok_ok[:, None] & (cols < ROW)
    values = tl.load(src, mask=mask)
    tl.store(dst, values, mask=mask)
    if SUM:
        # unit u of the gather layout holds words [u * WORDS, (u + 1) * WORDS): word i weighs i + 1
        unit = dst_row[:, None] + cols
        wide = values.to(tl.int64)
        if WORDS == 2:
            part = (wide & 0xFFFFFFFF) * (2 * unit + 1) + ((wide >> 32) & 0xFFFFFFFF) * (2 * unit + 2)
        else:
            part = (wide & 0xFFFFFFFF) * (unit + 1)
        part = tl.where(mask, part, 0)
        tl.store(
            partials + t * tl.num_programs(0) + tl.program_id(0),
            tl.reduce(tl.reduce(part, 1, combine), 0, combine),
        )


def gather_heads_reference(
    kv: Sequence[torch.Tensor], slots: torch.Tensor, head_start: int, num_heads: int, out: torch.Tensor
) -> None:
    """Pure-torch gather, the reference the kernel is tested against (and the CPU implementation).

    ``kv``: T tensors ``[num_slots, heads_local, head_dim]`` or paged views ``[num_blocks,
    block_size, heads_local, head_dim]``; ``slots``: int ``[tokens]`` on kv's device; ``out``:
    contiguous ``[T, tokens, num_heads, head_dim]`` of kv's dtype, on kv's device or in pinned host
    memory. Copies through integer views, so every bit pattern survives. One ``index_select`` per
    tensor on the current stream (one advanced-indexing read and a copy for views whose blocks do
    not merge into slots); no per-token Python loop.
    """
    int_dtype = INT_VIEW[kv[0].element_size()]
    out_int = out.view(int_dtype)
    for t, tensor in enumerate(kv):
        src, index = slot_rows(tensor.view(int_dtype), slots)
        part = src[..., head_start : head_start + num_heads, :]
        if len(index) == 2:
            out_int[t].copy_(part[index], non_blocking=True)
        elif out.device == src.device:
            torch.index_select(part, 0, slots, out=out_int[t])
        else:
            out_int[t].copy_(part.index_select(0, slots), non_blocking=True)


def gather_heads(
    kv: Sequence[torch.Tensor] | KVTable,
    slots: torch.Tensor | SlotIndex,
    head_start: int,
    num_heads: int,
    out: torch.Tensor,
    *,
    stream: torch.cuda.Stream | None = None,
    impl: Impl = "auto",
    config: LaunchConfig | None = None,
    checksum: torch.Tensor | None = None,
) -> None:
    """Gather heads ``[head_start, head_start + num_heads)`` of ``slots`` from every KV tensor into ``out``.

    Shapes:
      - ``kv``: T tensors (2L for K/V: ``[K_0..K_{L-1}, V_0..V_{L-1}]``; L for MLA), each
        ``[num_slots, heads_local, head_dim]`` (MLA: ``[num_slots, 1, kv_dim]``) or each a paged
        view ``[num_blocks, block_size, heads_local, head_dim]`` (slot ``s``: block ``s //
        block_size``, token ``s % block_size``), one dtype, shape and device; last dim stride 1,
        the other strides free. Or a :class:`KVTable` built by ``as_kv_table`` once per pool
        (skips re-validating T tensors per call).
      - ``slots``: int64/int32 ``[tokens]`` token-slot indices, in HOST memory (range-checked here
        without touching the device, then uploaded on ``stream``), or a :class:`SlotIndex`.
      - ``out``: contiguous ``[T, tokens, num_heads, head_dim]`` of kv's dtype, or a contiguous
        uint8 byte buffer whose first ``T*tokens*num_heads*head_dim*itemsize`` bytes receive that
        layout. On kv's device, or in pinned host memory (host staging) when kv is on CUDA.

    Stream: everything (slot upload, launch) is enqueued on ``stream`` (default: the current
    stream of kv's device); nothing synchronizes. ``out`` is complete when that stream reaches
    this point; ``slots`` host memory may be reused as soon as this returns.

    ``checksum``: int64 ``[1]`` on kv's device or in pinned host memory (CPU kv: on CPU), which
    receives the checksum of what was written (``kernels.checksum``, the gather layout from word
    0) on ``stream`` too: read it once the stream passed this point. The layout must then be a
    whole number of 4-byte words. With 4- or 8-byte copy units the kernel sums as it copies; with
    narrower units (rows of an odd number of 16-bit heads' bytes), a second read sums the output.

    Every argument is checked before anything is enqueued; a bad one raises
    :class:`KernelInputError` naming it. Zero tokens: nothing is launched.
    ``impl``: "auto" (Triton on CUDA; on CPU the torch reference, or the interpreted kernel when
    ``TRITON_INTERPRET=1``), "triton", or "torch" (the reference, on any device).
    """
    layout = as_kv_table(kv)
    check_stream(stream, layout.device)
    check_heads(head_start, num_heads, layout.heads, "head_start")
    tokens = slot_count(slots)
    shape = (len(layout), tokens, num_heads, layout.head_dim)
    numel = math.prod(shape)
    flat, host = staging_view(out, "out", layout.dtype, layout.device)
    if out.dtype == torch.uint8 and out.dim() == 1:
        if flat.numel() < numel:
            raise KernelInputError(
                f"out holds {out.numel()} bytes; the gather needs {numel * layout.itemsize} bytes for {shape}"
            )
    elif out.dtype != layout.dtype or tuple(out.shape) != shape:
        raise KernelInputError(
            f"out is {out.dtype} {tuple(out.shape)}; expected {layout.dtype} {shape} or a 1-D uint8 byte buffer"
        )
    which = resolve_impl(impl, layout.device)
    cfg = config or (HOST_CONFIG if host else DEFAULT_CONFIG)
    if checksum is not None:
        _check_checksum(checksum, layout.device, numel * layout.itemsize)
    index = prepare_slots(slots, layout.num_slots, layout.device, stream=stream)
    if tokens == 0:
        if checksum is not None:
            with launcher(layout.device, stream):
                checksum.reshape(-1)[:1].zero_()
        return
    target = flat[:numel]
    with launcher(layout.device, stream):
        unit, vec = copy_unit(math.gcd(layout.byte_gcd, target.data_ptr()))
        if which == "torch" or (checksum is not None and unit < 4):
            if which == "torch":
                gather_heads_reference(layout.tensors, index.use(), head_start, num_heads, target.view(shape))
            else:
                gather_heads(
                    layout, index, head_start, num_heads, out, stream=stream, impl=impl, config=config
                )
            if checksum is not None:  # a second read of what was written
                checksum_bytes(target.view(torch.uint8), stream=stream, impl=impl, out=checksum)
            return
        du = layout.head_dim * layout.itemsize // unit
        row = num_heads * du
        piece, even = column_block(row)
        npiece = triton.cdiv(row, piece)
        block = piece_block(cfg.block_bytes, piece * unit)
        unit_dtype = INT_VIEW[unit]
        kernel = _gather_kernel if which == "jit" else triton_int(_gather_kernel)
        grid = (triton.cdiv(tokens * npiece, block), len(layout))
        partials = (
            None if checksum is None else torch.empty(grid[::-1], dtype=torch.int64, device=layout.device)
        )
        kernel[grid](  # type: ignore[index]
            layout.tensors[0].view(torch.uint8).view(unit_dtype),
            layout.table(unit),
            index.use(),
            target.view(torch.uint8).view(unit_dtype),
            tokens,
            head_start,
            VEC=vec,
            DU=du,
            ROW=row,
            PIECE=piece,
            NPIECE=npiece,
            BLOCK=block,
            EVEN=even,
            HEADS_CONTIG=layout.heads_contiguous,
            FLAT=layout.flat,
            PAGE=1 if layout.flat else layout.block_size,
            partials=partials,
            SUM=partials is not None,
            WORDS=max(1, unit // 4),
            num_warps=cfg.num_warps,
        )
        if checksum is not None and partials is not None:
            checksum.reshape(-1)[:1].copy_(partials.sum().reshape(1), non_blocking=True)


def _check_checksum(checksum: torch.Tensor, device: torch.device, nbytes: int) -> None:
    """A gather's ``checksum`` output: int64 ``[1]`` where the sum may land; whole words to sum."""
    if not isinstance(checksum, torch.Tensor) or checksum.dtype != torch.int64 or checksum.numel() < 1:
        raise KernelInputError(f"checksum must be an int64 tensor of 1 item, got {checksum!r:.60}")
    if checksum.device != device and not (device.type == "cuda" and checksum.device.type == "cpu"):
        raise KernelInputError(f"checksum is on {checksum.device}, the KV on {device}")
    if nbytes % 4:
        raise KernelInputError(f"the gather's {nbytes} bytes are not whole 4-byte words: no checksum")
