"""What the gather and scatter wrappers share: argument checks, the pointer table, slot upload.

Nothing here launches a kernel. Every check raises :class:`KernelInputError` naming the bad value,
and every check runs on the host before the caller launches anything, so a bad argument never
reaches the GPU and never forces a device synchronisation.

Addressing scheme shared by both kernels. All KV tensors of a layout are addressed from ONE base
pointer (the first tensor) plus a per-tensor offset in *copy units*: the table row of tensor ``t``
is ``(data_ptr(t) - data_ptr(kv[0]), block_stride(t), token_stride(t), head_stride(t))``, all in
units, and slot ``s`` of a pool of pages of ``block_size`` tokens starts at
``(s // block_size) * block_stride + (s % block_size) * token_stride``. A tensor
``[num_slots, heads, head_dim]`` is the case ``block_size = 1``; a layout whose every tensor has
``block_stride == block_size * token_stride`` is *flat*, and the kernels then address ``s *
token_stride`` (no division). A copy unit is the widest integer type (1, 2, 4 or 8 bytes) that
divides every address, stride and row width involved, so the kernels move bytes, whatever the dtype
(fp8 and int8 included), and stay exact.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import types
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from transfer_engine.errors import ConfigError

__all__ = [
    "SUPPORTED_DTYPES",
    "Impl",
    "KVTable",
    "KernelInputError",
    "LaunchConfig",
    "SlotIndex",
    "as_kv_table",
    "prepare_slots",
    "slot_rows",
]

Impl = Literal["auto", "triton", "torch"]

SUPPORTED_DTYPES: frozenset[torch.dtype] = frozenset(
    {
        torch.bfloat16,
        torch.float16,
        torch.float32,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.int8,
        torch.uint8,
    }
)

# Integer dtype of each item size: the reference copies through these views, so NaN payloads,
# negative zeros and fp8 bit patterns travel untouched.
INT_VIEW: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

_TABLE_CACHE_SIZE = 16


class KernelInputError(ConfigError):
    """Raised by a staging-kernel wrapper, before any launch, for an argument it cannot copy exactly."""


@dataclass(frozen=True)
class LaunchConfig:
    """Launch shape of a staging kernel. ``block_bytes``: bytes one program copies (rounded down to
    a power-of-two number of row pieces); ``num_warps``: warps per program. Defaults come from
    ``tools/bench_kernels.py`` sweeps recorded in ``docs/PERF.md``."""

    block_bytes: int = 32768
    num_warps: int = 4

    def __post_init__(self) -> None:
        if self.block_bytes < 16 or self.block_bytes & (self.block_bytes - 1):
            raise KernelInputError(f"block_bytes={self.block_bytes} must be a power of two >= 16")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise KernelInputError(f"num_warps={self.num_warps} must be one of 1, 2, 4, 8, 16")


def pow2_divisor(value: int, cap: int) -> int:
    """The largest power of two that divides ``value`` (0 counts as divisible by anything), at most ``cap``."""
    if value == 0:
        return cap
    return min(value & -value, cap)


def interpret_requested() -> bool:
    """True when ``TRITON_INTERPRET`` asks for Triton's interpreter (read at each call, not at import)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def resolve_impl(impl: str, device: torch.device) -> Literal["jit", "interpret", "torch"]:
    """Which implementation runs for KV on ``device``: compiled Triton, interpreted Triton, or torch."""
    if impl not in ("auto", "triton", "torch"):
        raise KernelInputError(f"impl={impl!r} must be 'auto', 'triton' or 'torch'")
    if impl == "torch":
        return "torch"
    if device.type == "cuda":
        return "jit"
    if impl == "triton" or interpret_requested():
        return "interpret"
    return "torch"


@dataclass(frozen=True, eq=False)
class KVTable:
    """A validated KV layout: the 2L (or L, for MLA) tensors and what the kernels need of them.

    Build it once per KV pool (``as_kv_table(kv)``) and pass it instead of the tensor list: the
    wrappers then skip re-validating 2L tensors on every call. It holds the tensors themselves,
    so it keeps the pool alive as long as it lives; the module-level cache holds only addresses.
    """

    tensors: tuple[torch.Tensor, ...]
    num_slots: int
    block_size: int
    """Tokens per block: ``shape[1]`` of ``[num_blocks, block_size, heads, head_dim]`` views, 1 for
    ``[num_slots, heads, head_dim]`` tensors."""
    heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    key: tuple[object, ...]
    """(dtype, shape, device, per-tensor (address, block, token and head strides)): equal keys, equal tables."""
    byte_gcd: int
    """gcd of every tensor's address, strides in bytes and ``head_dim`` in bytes."""
    heads_contiguous: bool
    """Every tensor's head stride equals ``head_dim``: a run of heads of one slot is contiguous."""
    flat: bool
    """Every tensor's block stride is ``block_size`` token strides: slot ``s`` is ``s * token_stride``."""
    _tables: dict[tuple[int, str], _Table] = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return len(self.tensors)

    @property
    def itemsize(self) -> int:
        return self.tensors[0].element_size()

    def table(self, unit: int) -> torch.Tensor:
        """int64 ``[len, 4]`` on the KV device: (offset from tensor 0, block stride, token stride, head
        stride), in ``unit``-byte units. On CUDA, the current stream is made to wait for its upload."""
        key = (unit, str(self.device))
        found = self._tables.get(key)
        if found is None:
            found = _table_for(self.key, self.itemsize, unit, self.device)
            self._tables[key] = found
        return found.use()


class _Table:
    """An uploaded pointer table, and the streams already ordered after its upload."""

    __slots__ = ("tensor", "ready", "ordered")

    def __init__(self, tensor: torch.Tensor, ready: torch.cuda.Event | None, origin: int) -> None:
        self.tensor = tensor
        self.ready = ready
        self.ordered = {origin}

    def use(self) -> torch.Tensor:
        if self.ready is None:
            return self.tensor
        index = self.tensor.get_device()
        stream = current_stream_id(index)
        if stream not in self.ordered:  # once per stream: later work on it is ordered anyway
            _wait_for_upload(self.tensor, self.ready, index)
            self.ordered.add(stream)
        return self.tensor


def current_stream_id(index: int) -> int:
    """The id of the current stream of CUDA device ``index`` (torch's C entry point: no Stream object)."""
    return int(torch._C._cuda_getCurrentStream(index)[0])


def use_on_current_stream(tensor: torch.Tensor, ready: torch.cuda.Event | None, origin: int) -> torch.Tensor:
    """Order the current stream after ``tensor``'s upload, and keep its memory until that stream's work ends.

    ``origin``: the id of the stream the upload was enqueued on. Used on that same stream, the
    tensor is already ordered (and was allocated there): nothing to wait for or record."""
    if ready is not None:
        index = tensor.get_device()
        if current_stream_id(index) != origin:
            _wait_for_upload(tensor, ready, index)
    return tensor


def _wait_for_upload(tensor: torch.Tensor, ready: torch.cuda.Event, index: int) -> None:
    """The current stream of device ``index`` waits for ``ready`` and keeps ``tensor``'s memory."""
    stream = torch.cuda.current_stream(index)
    stream.wait_event(ready)
    tensor.record_stream(stream)


_TABLES: OrderedDict[tuple[object, ...], _Table] = OrderedDict()
_BLOCK_TABLES: OrderedDict[tuple[object, ...], _Table] = OrderedDict()
_BLOCK_TABLE_CACHE_SIZE = 64


def _cached_table(
    cache: OrderedDict[tuple[object, ...], _Table],
    limit: int,
    key: tuple[object, ...],
    rows: Callable[[], Sequence[Sequence[int]]],
    device: torch.device,
) -> _Table:
    """The int64 table of ``rows()`` on ``device``, uploaded once per ``key`` and kept in ``cache``
    (least recently used first out, at most ``limit``)."""
    found = cache.get(key)
    if found is not None:
        cache.move_to_end(key)
        return found
    tensor, ready, origin = upload(torch.tensor(rows(), dtype=torch.int64), device)
    found = cache[key] = _Table(tensor, ready, origin)
    if len(cache) > limit:
        cache.popitem(last=False)
    return found


def _table_for(key: tuple[object, ...], itemsize: int, unit: int, device: torch.device) -> _Table:
    """The pointer table of a layout key, cached by key (addresses only: nothing keeps the pool alive)."""
    rows = key[3]
    assert isinstance(rows, tuple)
    base = rows[0][0]

    def data() -> list[tuple[int, ...]]:
        return [((ptr - base) // unit, *(st * itemsize // unit for st in strides)) for ptr, *strides in rows]

    return _cached_table(_TABLES, _TABLE_CACHE_SIZE, (*key, unit), data, device)


def block_table(rows: tuple[tuple[int, ...], ...], device: torch.device) -> torch.Tensor:
    """A small int64 table of ``rows`` on ``device`` (the scatter's per-writer blocks), uploaded once
    per distinct ``rows`` and kept in an LRU cache: a decode scatters the same few block layouts
    over and over, and each upload cost a pin, a copy and an event in the host call. The current
    stream is ordered after the upload, as for :meth:`KVTable.table`."""
    return _cached_table(
        _BLOCK_TABLES, _BLOCK_TABLE_CACHE_SIZE, (str(device), rows), lambda: rows, device
    ).use()


def upload(host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.cuda.Event | None, int]:
    """Copy a small host tensor to ``device`` on the current stream, asynchronously (from pinned
    memory), with an event that marks its arrival and the id of the stream it went on. On CPU: the
    tensor itself, no event, stream 0."""
    if device.type != "cuda":
        return host, None, 0
    if not host.is_pinned():
        host = host.pin_memory()
    tensor = host.to(device, non_blocking=True)
    stream = torch.cuda.current_stream(device)
    ready = torch.cuda.Event()
    ready.record(stream)
    return tensor, ready, int(stream.stream_id)


def as_kv_table(kv: Sequence[torch.Tensor] | KVTable) -> KVTable:
    """Validate a KV tensor list (or pass a ready :class:`KVTable` through).

    ``kv``: ``[K_0..K_{L-1}, V_0..V_{L-1}]``, or L MLA latents, each either ``[num_slots,
    heads_local, head_dim]`` (MLA: ``[num_slots, 1, kv_dim]``) or a view ``[num_blocks, block_size,
    heads_local, head_dim]`` of a paged layout (``KVPool.from_views``: vLLM CPU, FlashAttention NHD
    and HND...), slot ``s`` being token ``s % block_size`` of block ``s // block_size``. All of one
    dtype (see ``SUPPORTED_DTYPES``), shape and device; the last dim contiguous (stride 1); the other
    strides free and non-negative.
    """
    if isinstance(kv, KVTable):
        return kv
    if isinstance(kv, torch.Tensor) or not isinstance(kv, Sequence) or len(kv) == 0:
        raise KernelInputError(f"kv must be a non-empty sequence of tensors, got {type(kv).__name__}")
    first = kv[0]
    if not isinstance(first, torch.Tensor):
        raise KernelInputError(f"kv[0] is a {type(first).__name__}, not a tensor")
    if first.dim() not in (3, 4):
        raise KernelInputError(
            f"kv[0] has shape {tuple(first.shape)}; expected [num_slots, heads_local, head_dim] or "
            "[num_blocks, block_size, heads_local, head_dim]"
        )
    dtype, device, shape = first.dtype, first.device, first.shape
    if dtype not in SUPPORTED_DTYPES:
        raise KernelInputError(
            f"kv dtype {dtype} is not supported; one of {sorted(map(str, SUPPORTED_DTYPES))}"
        )
    if device.type not in ("cuda", "cpu"):
        raise KernelInputError(f"kv device {device} is neither cuda nor cpu")
    if 0 in shape:
        raise KernelInputError(f"kv[0] has an empty dimension: shape {tuple(shape)}")
    paged = len(shape) == 4
    num_blocks, block_size = (int(shape[0]), int(shape[1])) if paged else (int(shape[0]), 1)
    heads, head_dim = int(shape[-2]), int(shape[-1])
    itemsize = first.element_size()
    try:
        metas = [(t.dtype, t.get_device(), t.shape, t.stride(), t.data_ptr()) for t in kv]
    except AttributeError:
        bad = next(i for i, t in enumerate(kv) if not isinstance(t, torch.Tensor))
        raise KernelInputError(f"kv[{bad}] is a {type(kv[bad]).__name__}, not a tensor") from None
    device_index = first.get_device()
    rows = []
    g = head_dim * itemsize
    contiguous_heads = flat = True
    for i, (t_dtype, t_device, t_shape, strides, ptr) in enumerate(metas):
        if t_dtype != dtype:
            raise KernelInputError(f"kv[{i}] has dtype {t_dtype}, kv[0] has {dtype}")
        if t_device != device_index:
            raise KernelInputError(f"kv[{i}] is on {kv[i].device}, kv[0] is on {device}")
        if t_shape != shape:
            raise KernelInputError(f"kv[{i}] has shape {tuple(t_shape)}, kv[0] has {tuple(shape)}")
        if strides[-1] != 1:
            raise KernelInputError(
                f"kv[{i}] has stride {strides[-1]} in its last dim; it must be 1 (contiguous head_dim)"
            )
        if min(strides) < 0:
            raise KernelInputError(f"kv[{i}] has negative strides {strides}")
        bs, ts, hs = (strides[0], strides[1], strides[2]) if paged else (strides[0], strides[0], strides[1])
        # Strides of size-1 dims address nothing: normalise them so that equal layouts compare equal
        # and a paged view with one block (or one token per block) counts as flat.
        if block_size == 1:
            ts = bs
        if num_blocks == 1:
            bs = block_size * ts
        if heads == 1:
            hs = head_dim
        rows.append((ptr, bs, ts, hs))
        g = math.gcd(g, ptr, bs * itemsize, ts * itemsize, hs * itemsize)
        contiguous_heads = contiguous_heads and hs == head_dim
        flat = flat and bs == block_size * ts
    key = (dtype, tuple(shape), str(device), tuple(rows))
    return KVTable(
        tensors=tuple(kv),
        num_slots=num_blocks * block_size,
        block_size=block_size,
        heads=heads,
        head_dim=head_dim,
        dtype=dtype,
        device=device,
        key=key,
        byte_gcd=g,
        heads_contiguous=contiguous_heads,
        flat=flat,
    )


def slot_rows(tensor: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """``(view, index)`` such that ``view[index]`` are the ``[tokens, heads, head_dim]`` rows of ``slots``.

    ``tensor``: ``[num_slots, heads, head_dim]``, or a ``[num_blocks, block_size, heads, head_dim]``
    view; one that merges into ``[num_slots, ...]`` (flat) is viewed so, and ``index`` is then
    ``(slots,)`` for ``index_select``/``index_copy_``; otherwise ``index`` is ``(slots //
    block_size, slots % block_size)`` for advanced indexing. ``slots`` on the tensor's device.
    """
    if tensor.dim() == 3:
        return tensor, (slots,)
    blocks, block_size = tensor.shape[0], tensor.shape[1]
    if blocks == 1 or block_size == 1 or tensor.stride(0) == block_size * tensor.stride(1):
        return tensor.view(blocks * block_size, *tensor.shape[2:]), (slots,)
    return tensor, (torch.div(slots, block_size, rounding_mode="floor"), slots % block_size)


@dataclass(frozen=True)
class SlotIndex:
    """Token-slot indices checked on the host and ready on the KV device.

    ``tensor``: int32/int64 ``[tokens]`` contiguous, on ``device`` (uploaded on the stream given to
    :func:`prepare_slots`; use it on that stream, or on one ordered after it). ``low``/``high``:
    the smallest and largest slot, checked against the pool size at each use.
    """

    tensor: torch.Tensor
    low: int
    high: int
    ready: torch.cuda.Event | None = None
    origin: int = 0
    """Id of the stream the upload went on: a launch on that stream needs no wait."""

    def use(self) -> torch.Tensor:
        """The index tensor, with the current stream ordered after its upload."""
        return use_on_current_stream(self.tensor, self.ready, self.origin)

    @property
    def count(self) -> int:
        return int(self.tensor.numel())

    @property
    def device(self) -> torch.device:
        return self.tensor.device


def prepare_slots(
    slots: torch.Tensor | SlotIndex,
    num_slots: int,
    device: torch.device,
    *,
    stream: torch.cuda.Stream | None = None,
) -> SlotIndex:
    """Check host slot indices against ``[0, num_slots)`` and upload them to ``device``.

    ``slots``: a 1-D int32/int64 tensor in host memory. Host-side on purpose: its range is checked
    here, before any launch, without reading device memory. The upload to a CUDA device is
    asynchronous on ``stream`` (default: the current stream), from pinned memory. A ready
    :class:`SlotIndex` is only checked against ``num_slots`` and ``device``.
    """
    if isinstance(slots, SlotIndex):
        index = slots
        if index.device != device:
            raise KernelInputError(f"slots are on {index.device}, the KV on {device}")
    else:
        if not isinstance(slots, torch.Tensor):
            raise KernelInputError(f"slots must be a tensor or SlotIndex, got {type(slots).__name__}")
        if slots.dtype not in (torch.int32, torch.int64):
            raise KernelInputError(f"slots have dtype {slots.dtype}; expected torch.int64 or torch.int32")
        if slots.dim() != 1:
            raise KernelInputError(f"slots have shape {tuple(slots.shape)}; expected 1-D [tokens]")
        if slots.device.type != "cpu":
            raise KernelInputError(
                f"slots are on {slots.device}; pass them in host memory so their range is checked "
                "before launch without synchronizing (or reuse a SlotIndex from prepare_slots)"
            )
        host = slots.contiguous()
        if host.numel() == 0:
            low, high = 0, -1
        else:
            lo_t, hi_t = torch.aminmax(host)
            low, high = int(lo_t), int(hi_t)
        _check_range(host, low, high, num_slots)
        with launcher(device, stream):
            tensor, ready, origin = upload(host, device)
        return SlotIndex(tensor, low, high, ready, origin)
    _check_range(None, index.low, index.high, num_slots)
    return index


def _check_range(host: torch.Tensor | None, low: int, high: int, num_slots: int) -> None:
    if low >= 0 and high < num_slots:
        return
    if host is not None:
        bad = int(torch.nonzero((host < 0) | (host >= num_slots))[0, 0])
        raise KernelInputError(
            f"slot {int(host[bad])} at position {bad} is outside the KV pool [0, {num_slots})"
        )
    value = low if low < 0 else high
    raise KernelInputError(f"slot {value} is outside the KV pool [0, {num_slots})")


def staging_view(
    buf: torch.Tensor, name: str, dtype: torch.dtype, kv_device: torch.device
) -> tuple[torch.Tensor, bool]:
    """Check a staging tensor (gather's ``out``, scatter's ``region``) and view it as ``dtype`` items.

    ``buf``: contiguous, of the KV's ``dtype`` or uint8 (bytes, item-aligned; a partial last item
    is ignored). Returns ``(flat, host)``: a 1-D view of ``buf`` in ``dtype`` and whether it lives in pinned host memory while the KV is on a
    CUDA device (the host-staging variant).
    """
    if not isinstance(buf, torch.Tensor):
        raise KernelInputError(f"{name} must be a tensor, got {type(buf).__name__}")
    if buf.dtype != dtype and buf.dtype != torch.uint8:
        raise KernelInputError(
            f"{name} has dtype {buf.dtype}; the KV is {dtype} (or pass a uint8 byte buffer)"
        )
    if not buf.is_contiguous():
        raise KernelInputError(f"{name} must be contiguous; its strides are {buf.stride()}")
    host = False
    if buf.device != kv_device:
        if kv_device.type == "cuda" and buf.device.type == "cpu":
            if not buf.is_pinned():
                raise KernelInputError(
                    f"{name} is in pageable host memory; host staging needs pinned memory (pin_memory())"
                )
            host = True
        else:
            raise KernelInputError(f"{name} is on {buf.device}, the KV on {kv_device}")
    flat = buf.reshape(-1)
    if flat.dtype != dtype:
        itemsize = dtype.itemsize
        if flat.data_ptr() % itemsize:
            raise KernelInputError(
                f"{name} byte buffer at address {flat.data_ptr():#x} is not aligned to {dtype} items"
            )
        flat = flat[: flat.numel() // itemsize * itemsize].view(dtype)  # a partial last item is unused
    return flat, host


def copy_unit(byte_gcd: int) -> tuple[int, int]:
    """``(unit, vec)``: the copy unit in bytes (<= 8) and how many units form an aligned 16-byte vector."""
    unit = pow2_divisor(byte_gcd, 8)
    vec_bytes = pow2_divisor(byte_gcd, 16)
    return unit, max(1, vec_bytes // unit)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def column_block(row_units: int, cap: int = 256) -> tuple[int, bool]:
    """Units per piece of a row of ``row_units``, and whether the pieces tile the row exactly.

    A power of two (Triton blocks are), at most ``cap`` units (2 KiB of int64): the largest one
    dividing the row, unless that is under 16 units, when the row is covered by masked pieces.
    """
    even = pow2_divisor(row_units, cap)
    if even >= min(row_units, 16):
        return even, True
    return min(next_pow2(row_units), cap), False


def piece_block(block_bytes: int, piece_bytes: int) -> int:
    """Pieces per program: ``block_bytes`` worth, a power of two in ``[1, 4096]``.

    Not fewer for a small copy: BLOCK is a compile-time constant, and one that followed the token
    count made every new room size a new kernel, compiled on the engine's loop (0.5-2 s each on the
    GPU machine). A small copy's program masks the lanes past its tokens instead."""
    want = max(1, block_bytes // max(1, piece_bytes))
    return min(1 << (want.bit_length() - 1), 4096)


def check_stream(stream: torch.cuda.Stream | None, device: torch.device) -> None:
    if stream is None:
        return
    if device.type != "cuda":
        raise KernelInputError(f"a CUDA stream was given but the KV is on {device}")
    if not isinstance(stream, torch.cuda.Stream):
        raise KernelInputError(f"stream must be a torch.cuda.Stream, got {type(stream).__name__}")
    if indexed(stream.device) != indexed(device):
        raise KernelInputError(f"stream is on {stream.device}, the KV on {device}")


def indexed(device: torch.device) -> torch.device:
    """``device`` with its index: a CUDA device named without one (``torch.device("cuda")``) is the
    current device, as torch places tensors made there; any other device is returned as it is."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def check_heads(start: int, count: int, heads: int, name: str) -> None:
    """``[start, start + count)`` must be a non-empty range of ``heads`` local heads."""
    if not isinstance(start, int) or not isinstance(count, int):
        raise KernelInputError(f"{name}={start!r} and its head count {count!r} must be ints")
    if count < 1:
        raise KernelInputError(f"head count {count} for {name}={start} must be >= 1")
    if start < 0 or start + count > heads:
        raise KernelInputError(
            f"heads [{start}, {start + count}) ({name}={start}) exceed the {heads} local heads"
        )


def slot_count(slots: torch.Tensor | SlotIndex) -> int:
    """Tokens in ``slots`` without reading them (full checks happen in :func:`prepare_slots`)."""
    if isinstance(slots, SlotIndex):
        return slots.count
    if not isinstance(slots, torch.Tensor):
        raise KernelInputError(f"slots must be a tensor or SlotIndex, got {type(slots).__name__}")
    return int(slots.numel())


@contextlib.contextmanager
def launcher(device: torch.device, stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Make ``device`` and ``stream`` current for the launches inside (nothing on CPU).

    Through torch's C entry points, and only what differs: ``torch.cuda.device`` and
    ``torch.cuda.stream`` cost about 25 us a pair on the GPU machine, a sizeable part of a small
    copy's host call (docs/PERF.md, "The kernels' host calls")."""
    if device.type != "cuda":
        yield
        return
    index = torch.cuda.current_device() if device.index is None else device.index
    before = torch.cuda._exchange_device(index)
    try:
        if stream is None:
            yield
            return
        prev = torch._C._cuda_getCurrentStream(index)
        switch = prev[0] != stream.stream_id
        if switch:
            torch._C._cuda_setStream(
                stream_id=stream.stream_id, device_index=stream.device_index, device_type=stream.device_type
            )
        try:
            yield
        finally:
            if switch:
                torch._C._cuda_setStream(stream_id=prev[0], device_index=prev[1], device_type=prev[2])
    finally:
        if before != index:
            torch.cuda._exchange_device(before)


@functools.cache
def triton_int(kernel: object) -> object:
    """Triton's interpreter over ``kernel``'s Python source: how the kernel runs on CPU tensors.

    The kernel runs in a copy of its module's globals where every other ``@triton.jit`` function is
    interpreted too: a jit function called from a kernel (``kernels/copy.py``'s ``_move``) refuses
    to run outside a compiled kernel, and the kernels were made before ``TRITON_INTERPRET`` was set."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, InterpretedFunction):
        return kernel
    fn = kernel.fn  # type: ignore[attr-defined]
    scope = {
        name: InterpretedFunction(value.fn)
        if isinstance(value, JITFunction) and value is not kernel
        else value
        for name, value in fn.__globals__.items()
    }
    return InterpretedFunction(
        types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    )
