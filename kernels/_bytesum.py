"""The checksum of a contiguous region: what the integrity sums share (docs/INTEGRITY.md).

The definition (``kernels/checksum.py`` states it): ``sum((i + 1) * w_i) mod 2**64`` over the
region's 32-bit little-endian words, each read as unsigned, ``i`` counted from the region's
``start`` in a larger whole. Here: the combine every summing kernel reduces with
(:func:`combine`), the contiguous kernel and its entry point :func:`checksum_bytes` with the
numpy/torch reference, and the argument checks. ``kernels/checksum.py`` (the sum over KV pages)
and ``kernels/gather.py`` (a gather that sums what it writes, or sums it by a second read) both
build on this module, and neither imports the other.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from ._common import Impl, KernelInputError, check_stream, launcher, resolve_impl, triton_int

__all__ = [
    "MASK64",
    "WORD",
    "as_int64",
    "check_out",
    "checksum_bytes",
    "checksum_bytes_reference",
    "combine",
    "finish",
    "host_sum",
    "words_of",
]

WORD = 4
"""Bytes per checksummed word: every checksummed region is a whole number of them."""
MASK64 = (1 << 64) - 1

_BYTES_BLOCK = 4096
"""Words one program of the contiguous kernel sums (16 KiB)."""


@triton.jit
def combine(a, b):  # the reductions' combine (a plain jit function: it also runs under the interpreter)
    return a + b


@triton.jit(do_not_specialize=["n", "start"])
def _bytes_kernel(
    words,  # *i32 [n]: the region, contiguous
    partials,  # *i64 [cdiv(n, BLOCK)]: one sum per program
    n,
    start,  # word offset of words[0] in the checksummed whole
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    w = tl.load(words + offs, mask=ok, other=0).to(tl.int64) & 0xFFFFFFFF
    tl.store(partials + pid, tl.reduce(w * (offs + start + 1), 0, combine))


def words_of(buf: torch.Tensor, name: str) -> torch.Tensor:
    """``buf`` (contiguous, any dtype) as a 1-D int32 view; its size and address must be word-aligned."""
    if not isinstance(buf, torch.Tensor):
        raise KernelInputError(f"{name} must be a tensor, got {type(buf).__name__}")
    if not buf.is_contiguous():
        raise KernelInputError(f"{name} must be contiguous; its strides are {buf.stride()}")
    nbytes = buf.numel() * buf.element_size()
    if nbytes % WORD or buf.data_ptr() % WORD:
        raise KernelInputError(
            f"{name} ({nbytes} bytes at {buf.data_ptr():#x}) is not a whole number of aligned {WORD}-byte words"
        )
    return buf.reshape(-1).view(torch.uint8).view(torch.int32)


def check_out(device: torch.device, out: torch.Tensor | None) -> None:
    if out is None:
        return
    if out.dtype != torch.int64 or out.numel() < 1:
        raise KernelInputError(f"out is {out.dtype} of {out.numel()} items; expected int64 [1]")
    if out.device != device and not (device.type == "cuda" and out.device.type == "cpu"):
        raise KernelInputError(f"out is on {out.device}, the data on {device}")


def finish(total: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Put the int64 sum ``total`` into ``out`` on the current stream, or return it.

    Called inside the entry point's ``launcher``: the current stream is then the sum's, so the copy
    into ``out`` (pinned host memory, read by the caller once an event after it completed) is
    ordered after the sum, and before that event. Enqueued on any other stream, it would read
    ``total`` before the sum wrote it, and land after the event the caller waits for."""
    if out is None:
        return total.reshape(1)
    out.reshape(-1)[:1].copy_(total.reshape(1), non_blocking=True)
    return out


_REF_BLOCK = 1 << 14
"""Words the CPU reference sums at a time: its uint64 temporaries stay in cache."""
_LOCAL = np.arange(1, _REF_BLOCK + 1, dtype=np.uint64)


def as_int64(value: int) -> int:
    """``value`` mod 2**64 as the signed int64 holding the same bits."""
    value &= MASK64
    return value - (1 << 64) if value >> 63 else value


def host_sum(words: np.ndarray, start: int) -> int:
    """The checksum of uint32 ``words`` (host memory) from word offset ``start``: block by block, a
    block at offset ``o`` adds ``(start + o) * sum(w) + sum((j + 1) * w_j)``, with one weight vector
    for every block; Python ints carry the offsets (numpy's wrap-around stays inside its arrays)."""
    total = 0
    for offset in range(0, words.size, _REF_BLOCK):
        block = words[offset : offset + _REF_BLOCK].astype(np.uint64)
        weighted = int(np.dot(block, _LOCAL[: block.size]))
        total += (start + offset) * int(block.sum(dtype=np.uint64)) + weighted
    return total & MASK64


def checksum_bytes_reference(buf: torch.Tensor, start: int = 0) -> torch.Tensor:
    """The checksum of the contiguous ``buf`` without Triton (the CPU implementation); int64 ``[1]``
    on its device. Host memory is summed with numpy a cache-sized block at a time; device memory
    with torch in one pass."""
    words = words_of(buf, "buf")
    if words.device.type == "cpu":
        value = host_sum(words.numpy().view(np.uint32), start)
        return torch.tensor([as_int64(value)], dtype=torch.int64)
    wide = words.to(torch.int64) & 0xFFFFFFFF
    pos = torch.arange(start + 1, start + 1 + words.numel(), dtype=torch.int64, device=words.device)
    return (wide * pos).sum().reshape(1)


def checksum_bytes(
    buf: torch.Tensor,
    *,
    start: int = 0,
    stream: torch.cuda.Stream | None = None,
    impl: Impl = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Checksum of a contiguous region ``buf`` (a staging lease or a landed ring block).

    ``buf``: contiguous, any dtype, a whole number of 4-byte words at a 4-byte-aligned address; on
    CUDA, or pinned host memory read by a CUDA kernel when ``stream`` is given, or on CPU.
    ``start``: the word offset of ``buf``'s first word in a larger checksummed whole.
    ``out``: optional int64 ``[1]`` receiving the sum (pinned host memory lets the caller read it
    without a synchronisation once the stream passed this point). Enqueued on ``stream`` (default:
    the current stream of ``buf``'s device); returns ``out`` or a new int64 ``[1]`` tensor.
    """
    if not isinstance(start, int) or start < 0:
        raise KernelInputError(f"start={start!r} must be an int >= 0")
    words = words_of(buf, "buf")
    device = words.device if stream is None else stream.device
    if stream is not None and words.device != device:
        # an empty tensor owns no allocation, so it never reads as pinned: nothing is read from it
        if not (words.device.type == "cpu" and (words.is_pinned() or words.numel() == 0)):
            raise KernelInputError(f"buf is on {words.device}; the stream on {device}")
    check_stream(stream, device)
    check_out(device, out)
    which = resolve_impl(impl, device)
    with launcher(device, stream):
        if which == "torch" or words.numel() == 0:
            return finish(checksum_bytes_reference(words, start), out)
        kernel = _bytes_kernel if which == "jit" else triton_int(_bytes_kernel)
        programs = triton.cdiv(words.numel(), _BYTES_BLOCK)
        partials = torch.empty(programs, dtype=torch.int64, device=device)
        kernel[(programs,)](words, partials, words.numel(), start, BLOCK=_BYTES_BLOCK)  # type: ignore[index]
        return finish(partials.sum(), out)
