"""Integrity checksums of KV bytes: a position-weighted sum of 32-bit words (docs/INTEGRITY.md).

The checksum of a byte string of ``n`` 32-bit little-endian words ``w_0 .. w_{n-1}`` is

    ``sum((i + 1) * w_i for i in range(n)) mod 2**64``  (each ``w_i`` read as unsigned)

It is cheap (one multiply-add per word, one read of the bytes), order-sensitive (moving a word
moves its weight), and changes under any single flipped bit of a region below 32 GiB (the change
``2**b * (i + 1)`` is not a multiple of ``2**64``). Regions add: the checksum of a concatenation
is the sum of each part's checksum taken with its word offset (``start``).

What a chunk's checksum covers is its **gather layout**: the bytes ``gather_heads`` would write
for it, ``[T, tokens, num_heads, head_dim]`` over the tensors the WRITE carries (every layer's K
and V, or one layer group's). The prefill takes it as its gather copies the pages into a staging
lease (``gather_heads(checksum=...)``: the same weighted words, in the gather kernel) or straight
over its KV pages (:func:`checksum_heads`, no copy); the decode over its destination pages after they landed (:func:`checksum_heads` with the
decode's slots and head slice). Equal bytes in equal order give equal sums on both sides, whatever
the page sizes, strides or paths.

Entry points enqueue their work and return an int64 ``[1]`` tensor that holds the sum once the
stream reaches it; :func:`checksum_value` reads it as an unsigned int (it synchronizes on CUDA
only if the caller has not already waited for the stream). On CUDA tensors they launch Triton
kernels (one launch, then one ``sum`` of the per-program partials); on CPU a vectorized torch
reference, or the Triton kernels under Triton's interpreter (``TRITON_INTERPRET=1`` or
``impl="triton"``). :func:`checksum_numpy` is the definition written out, for tests and tools.
The contiguous sum (:func:`checksum_bytes`) lives in ``kernels/_bytesum.py``, which the gather's
sum shares, and is re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from ._bytesum import (
    MASK64,
    WORD,
    as_int64,
    check_out,
    checksum_bytes,
    checksum_bytes_reference,
    combine,
    finish,
    host_sum,
)
from ._common import (
    INT_VIEW,
    Impl,
    KernelInputError,
    KVTable,
    SlotIndex,
    as_kv_table,
    check_heads,
    check_stream,
    column_block,
    launcher,
    piece_block,
    prepare_slots,
    resolve_impl,
    slot_count,
    slot_rows,
    triton_int,
)

__all__ = [
    "MASK64",
    "WORD",
    "checksum_bytes",
    "checksum_bytes_reference",
    "checksum_heads",
    "checksum_heads_reference",
    "checksum_numpy",
    "checksum_value",
]

_HEADS_BLOCK_BYTES = 16384
"""Bytes one program of the paged kernel sums."""


@triton.jit(do_not_specialize=["tokens", "head_start"])
def _heads_kernel(
    kv_base,  # *i32: kv[0]; tensor t starts at kv_base + table[t, 0]
    table,  # *i64 [T, 4]: (offset from kv[0], block, token and head strides) in words
    slots,  # *i32 | *i64 [tokens]
    partials,  # *i64 [T, programs]: one sum per program
    tokens,
    head_start,
    DU: tl.constexpr,  # head_dim in words
    ROW: tl.constexpr,  # words per (tensor, token): num_heads * DU
    PIECE: tl.constexpr,  # words per piece: a row is NPIECE pieces
    NPIECE: tl.constexpr,
    BLOCK: tl.constexpr,  # pieces per program
    EVEN: tl.constexpr,  # PIECE * NPIECE == ROW: no column mask
    HEADS_CONTIG: tl.constexpr,
    FLAT: tl.constexpr,
    PAGE: tl.constexpr,
):
    # The gather kernel's addressing (kernels/gather.py), summing instead of storing: word ``c`` of
    # token ``tok`` of tensor ``t`` sits at position (t * tokens + tok) * ROW + c of the gather layout.
    t = tl.program_id(1)
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tok = r // NPIECE
    tok_ok = tok < tokens
    slot = tl.load(slots + tok, mask=tok_ok, other=0).to(tl.int64)
    t_off = tl.load(table + t * 4)
    token_stride = tl.load(table + t * 4 + 2)
    head_stride = tl.load(table + t * 4 + 3)
    if FLAT:
        slot_off = slot * token_stride
    else:
        block_stride = tl.load(table + t * 4 + 1)
        slot_off = (slot // PAGE) * block_stride + (slot % PAGE) * token_stride
    src_row = t_off + slot_off + head_start * head_stride
    cols = ((r % NPIECE) * PIECE)[:, None] + tl.arange(0, PIECE)[None, :]
    if HEADS_CONTIG:
        src_cols = cols.to(tl.int64)
    else:
        src_cols = (cols // DU).to(tl.int64) * head_stride + cols % DU
    if EVEN:
        mask = tok_ok[:, None]
    else:
        mask = tok_ok[:, None] & (cols < ROW)
    w = tl.load(kv_base + (src_row[:, None] + src_cols), mask=mask, other=0).to(tl.int64) & 0xFFFFFFFF
    pos = (t.to(tl.int64) * tokens + tok)[:, None] * ROW + cols + 1
    tl.store(
        partials + t * tl.num_programs(0) + tl.program_id(0),
        tl.reduce(tl.reduce(w * pos, 1, combine), 0, combine),
    )


def checksum_numpy(data: bytes | bytearray | memoryview | np.ndarray, start: int = 0) -> int:
    """The checksum's definition over ``data`` (a whole number of words), its first word at ``start``."""
    raw = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.view(np.uint8)
    if raw.size % WORD:
        raise KernelInputError(f"{raw.size} bytes are not a whole number of {WORD}-byte words")
    words = raw.reshape(-1).view("<u4").astype(np.uint64)
    pos = np.arange(start + 1, start + 1 + words.size, dtype=np.uint64)
    return int((words * pos).sum(dtype=np.uint64))


def checksum_value(result: torch.Tensor) -> int:
    """The checksum held in ``result`` (what an entry point returned) as an unsigned 64-bit int.

    Reading a CUDA tensor waits for its stream: call it once the stream's work is known complete
    (after the event the caller waits for anyway), or on a pinned-host ``out``."""
    return int(result.reshape(-1)[0].item()) & MASK64


def _host_heads_sum(layout: KVTable, slots: np.ndarray, head_start: int, num_heads: int) -> int:
    """The checksum of the gather layout of ``slots`` over host KV, with numpy: one tensor at a time,
    its head slice's rows taken by fancy indexing (a copy of just those bytes) and summed at their
    offset in the layout. (torch's CPU ``index_select`` took 100x longer on the loaded CPU box.)"""
    int_dtype = INT_VIEW[layout.itemsize]
    tokens = slots.size
    row_words = num_heads * layout.head_dim * layout.itemsize // WORD
    where = (slots,) if layout.tensors[0].dim() == 3 else np.divmod(slots, layout.block_size)
    total = 0
    for t, tensor in enumerate(layout.tensors):
        heads = tensor.view(int_dtype).numpy()[..., head_start : head_start + num_heads, :]
        rows = np.ascontiguousarray(heads[where])
        total += host_sum(rows.reshape(-1).view(np.uint32), t * tokens * row_words)
    return total & MASK64


def checksum_heads_reference(
    kv: Sequence[torch.Tensor] | KVTable, slots: torch.Tensor, head_start: int, num_heads: int
) -> torch.Tensor:
    """The checksum of the gather layout of ``slots`` without Triton (the CPU implementation); int64
    ``[1]`` on kv's device. Host KV: numpy, one tensor at a time (:func:`_host_heads_sum`); device
    KV: the head slice's rows of each tensor taken by indexing (``slot_rows``), then
    :func:`checksum_bytes_reference` over them in the gather layout."""
    layout = as_kv_table(kv)
    if layout.device.type == "cpu":
        value = _host_heads_sum(layout, slots.numpy().astype(np.int64, copy=False), head_start, num_heads)
        return torch.tensor([as_int64(value)], dtype=torch.int64)
    index = slots.to(layout.device)
    int_dtype = INT_VIEW[layout.itemsize]
    rows = []
    for tensor in layout.tensors:
        src, where = slot_rows(tensor.view(int_dtype), index)
        rows.append(src[..., head_start : head_start + num_heads, :][where])
    return checksum_bytes_reference(torch.stack(rows))


def checksum_heads(
    kv: Sequence[torch.Tensor] | KVTable,
    slots: torch.Tensor | SlotIndex,
    head_start: int,
    num_heads: int,
    *,
    stream: torch.cuda.Stream | None = None,
    impl: Impl = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Checksum of heads ``[head_start, head_start + num_heads)`` of ``slots`` of every tensor of ``kv``,
    taken in the gather layout ``[T, tokens, num_heads, head_dim]`` without writing it anywhere.

    Shapes as :func:`~transfer_engine.kernels.gather_heads`: ``kv`` T tensors (every layer's K and
    V, or a layer group's) ``[num_slots, heads, head_dim]`` or paged ``[num_blocks, block_size,
    heads, head_dim]``, or a :class:`KVTable`; ``slots`` int32/int64 ``[tokens]`` in host memory, or
    a :class:`SlotIndex`. Every tensor address, stride and ``head_dim`` must be a whole number of
    4-byte words (the Triton path reads words; KV layouts in use are). ``out`` as
    :func:`checksum_bytes`. Enqueued on ``stream`` (default: the current stream of kv's device);
    nothing synchronizes. Zero tokens: the checksum is 0, nothing is launched.
    """
    layout = as_kv_table(kv)
    check_stream(stream, layout.device)
    check_heads(head_start, num_heads, layout.heads, "head_start")
    tokens = slot_count(slots)
    check_out(layout.device, out)
    which = resolve_impl(impl, layout.device)
    if layout.byte_gcd % WORD:
        raise KernelInputError(
            f"kv addresses, strides or head_dim bytes (gcd {layout.byte_gcd}) are not whole {WORD}-byte words"
        )
    index = prepare_slots(slots, layout.num_slots, layout.device, stream=stream)
    with launcher(layout.device, stream):
        if tokens == 0:
            return finish(torch.zeros(1, dtype=torch.int64, device=layout.device), out)
        if which == "torch":
            return finish(checksum_heads_reference(layout, index.use(), head_start, num_heads), out)
        du = layout.head_dim * layout.itemsize // WORD
        row = num_heads * du
        piece, even = column_block(row)
        npiece = triton.cdiv(row, piece)
        block = piece_block(_HEADS_BLOCK_BYTES, piece * WORD)
        programs = triton.cdiv(tokens * npiece, block)
        partials = torch.empty((len(layout), programs), dtype=torch.int64, device=layout.device)
        kernel = _heads_kernel if which == "jit" else triton_int(_heads_kernel)
        kernel[(programs, len(layout))](  # type: ignore[index]
            layout.tensors[0].view(torch.uint8).view(torch.int32),
            layout.table(WORD),
            index.use(),
            partials,
            tokens,
            head_start,
            DU=du,
            ROW=row,
            PIECE=piece,
            NPIECE=npiece,
            BLOCK=block,
            EVEN=even,
            HEADS_CONTIG=layout.heads_contiguous,
            FLAT=layout.flat,
            PAGE=1 if layout.flat else layout.block_size,
        )
        return finish(partials.sum(), out)
