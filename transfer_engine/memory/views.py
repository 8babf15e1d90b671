"""KV pools from memory that serving systems own: raw pointers (SGLang), per-layer caches with K and V
side by side (vLLM's, through ``integrations/vllm/layouts.py``: ``pool_from_vllm``, exported by
``transfer_engine.integrations.vllm``).

Nothing here copies or allocates KV: each function builds zero-copy tensor views of the caller's
memory and hands them to :class:`~transfer_engine.memory.layout.KVPool`, whose constructor validates them
as for any pool. The caller keeps the memory alive (and unmoved) for as long as the pool is used.
Bad input raises :class:`LayoutError` naming the bad value; nothing is registered then.

- :func:`pool_from_pointers`: SGLang's ``KVArgs`` shape. ``kv_data_ptrs`` are the K buffers of
  every layer, then the V buffers (one latent buffer per layer for MLA); ``kv_data_lens`` their
  byte lengths; ``kv_item_lens`` the bytes of one page of one buffer.
- :func:`pool_from_caches`: one cache tensor per layer, ``[blocks, H, N, C]`` in a given memory
  order of its axes, ``C`` holding a head's K then V (or an MLA latent), all views into backing
  buffers that are registered whole. Bytes are bytes: one-byte floats and dtypes the engine does not
  know travel as uint8 (:func:`byte_dtype`).
- :class:`AuxBuffers`: several aux buffers of different item sizes (SGLang's metadata buffers:
  first output token, logprobs...). The engine moves one aux item per room, so their items are
  packed into one row of a pool aux tensor before the last chunk is sent, and unpacked from it on
  the decode side once the room ended.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

from transfer_engine.errors import LayoutError
from transfer_engine.memory.layout import KVLayout, KVPool

__all__ = ["AuxBuffers", "byte_dtype", "check_disjoint", "pool_from_caches", "pool_from_pointers", "view_of"]

_ENGINE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.uint8)
"""Dtypes that travel as themselves; every other one travels as bytes (:func:`byte_dtype`)."""


class _CudaArray:
    """``__cuda_array_interface__`` of a device range, so torch can view it without a copy."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


def view_of(ptr: int, nbytes: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """A uint8 tensor viewing ``nbytes`` at address ``ptr`` on ``device`` (no copy, no ownership)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        buf = (ctypes.c_uint8 * nbytes).from_address(ptr)
        return torch.frombuffer(buf, dtype=torch.uint8)
    if dev.type == "cuda":
        return torch.as_tensor(_CudaArray(ptr, nbytes), device=dev)
    raise LayoutError(f"device={dev} is not supported; use cpu or cuda")


def _int_list(values: Sequence[Any], what: str) -> list[int]:
    out = []
    for i, v in enumerate(values):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise LayoutError(f"{what}[{i}]={v!r} must be a non-negative integer")
        out.append(int(v))
    return out


def check_disjoint(ranges: Sequence[tuple[str, int, int]]) -> None:
    """LayoutError naming two ``(name, address, length)`` ranges that overlap, or a null/empty one."""
    for name, ptr, length in ranges:
        if ptr == 0 or length <= 0:
            raise LayoutError(f"{name}: address {ptr:#x} length {length} is not a usable memory range")
    ordered = sorted(ranges, key=lambda r: r[1])
    for (a, ap, al), (b, bp, _) in zip(ordered, ordered[1:], strict=False):
        if ap + al > bp:
            raise LayoutError(f"{a} [{ap:#x}, {ap + al:#x}) overlaps {b} starting at {bp:#x}")


def pool_from_pointers(
    layout: KVLayout,
    tp_size: int,
    tp_rank: int,
    kv_data_ptrs: Sequence[int],
    kv_data_lens: Sequence[int],
    kv_item_lens: Sequence[int],
    *,
    device: str | torch.device = "cpu",
    aux: torch.Tensor | None = None,
) -> KVPool:
    """A pool over raw KV buffers (SGLang's ``KVArgs``); see the module docstring.

    Every buffer must hold a whole number of pages of ``kv_item_lens[i]`` bytes, which must equal
    ``page_size * heads_local * head_dim * itemsize``; all buffers must have the same length and no
    two may overlap. LayoutError names the first buffer that breaks a rule.
    """
    ptrs = _int_list(kv_data_ptrs, "kv_data_ptrs")
    lens = _int_list(kv_data_lens, "kv_data_lens")
    items = _int_list(kv_item_lens, "kv_item_lens")
    expected = layout.num_kv_tensors
    if not len(ptrs) == len(lens) == len(items) == expected:
        raise LayoutError(
            f"got {len(ptrs)} kv_data_ptrs, {len(lens)} kv_data_lens and {len(items)} kv_item_lens; the "
            f"layout needs {expected} ({'one latent per layer' if layout.mla else 'K of every layer, then V'})"
        )
    heads_local = layout.heads_local(tp_size)
    itemsize = torch.empty(0, dtype=layout.dtype).element_size()
    page_bytes = layout.page_size * heads_local * layout.head_dim * itemsize
    for i, (length, item) in enumerate(zip(lens, items, strict=True)):
        if item != page_bytes:
            raise LayoutError(
                f"kv_item_lens[{i}]={item}, but a page of page_size={layout.page_size} x {heads_local} heads x "
                f"head_dim={layout.head_dim} x {itemsize} bytes is {page_bytes}"
            )
        if length == 0 or length % item:
            raise LayoutError(
                f"kv_data_lens[{i}]={length} is not a positive multiple of kv_item_lens[{i}]={item}"
            )
        if length != lens[0]:
            raise LayoutError(f"kv_data_lens[{i}]={length} differs from kv_data_lens[0]={lens[0]}")
    check_disjoint([(f"kv_data_ptrs[{i}]", p, n) for i, (p, n) in enumerate(zip(ptrs, lens, strict=True))])
    slots = lens[0] // page_bytes * layout.page_size
    tensors = [
        view_of(p, n, device).view(layout.dtype).view(slots, heads_local, layout.head_dim)
        for p, n in zip(ptrs, lens, strict=True)
    ]
    return KVPool(layout, tp_size, tp_rank, tensors, aux)


def byte_dtype(dtype: torch.dtype) -> bool:
    """Whether KV of ``dtype`` travels as uint8 bytes: one-byte floats (fp8) and unknown dtypes."""
    return dtype not in _ENGINE_DTYPES


def _check_order(name: str, t: torch.Tensor, order: Sequence[int], order_name: str) -> None:
    """LayoutError unless ``t``'s strides put its axes in ``order`` (size-1 axes may sit anywhere)."""
    placed = [axis for axis in order if t.shape[axis] > 1]
    strides = [t.stride(axis) for axis in placed]
    if any(a < b for a, b in zip(strides, strides[1:], strict=False)) or (strides and strides[-1] != 1):
        raise LayoutError(
            f"layer {name!r} has shape {tuple(t.shape)} and strides {t.stride()}, which are not "
            f"{order_name} (axes [B, H, N, C] in memory order {tuple(order)})"
        )


def _backing(t: torch.Tensor) -> torch.Tensor:
    """The whole buffer ``t`` views, as a contiguous uint8 tensor (no copy)."""
    storage = t.untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8, device=t.device)
    return raw.set_(storage, 0, (storage.nbytes(),), (1,))


def pool_from_caches(
    caches: Sequence[tuple[str, torch.Tensor]],
    *,
    order: Sequence[int],
    order_name: str,
    head_size: int | None,
    tp_size: int,
    tp_rank: int,
    num_kv_heads: int | None = None,
    aux: torch.Tensor | None = None,
) -> KVPool:
    """A pool over per-layer KV caches, without copies; see the module docstring.

    ``caches``: ``(layer name, tensor)`` in engine order, each of logical shape ``[blocks, H, N, C]``
    (``N`` tokens per block), all of one shape, dtype and device, each a view into a backing buffer
    that is registered whole (several layers may share one). ``order``: the memory order of the
    axes ``[B, H, N, C]`` (0..3, outermost first), checked against every tensor's strides;
    ``order_name`` names it in errors ("vLLM's LBNHC layout"). ``head_size``: the K (and V) head size, ``C`` being ``2 *
    head_size`` (K then V); None for MLA, ``H == 1`` and ``C`` one latent. ``num_kv_heads``: the
    model's KV heads over all ranks (default ``H * tp_size``). ``aux``: the pool's aux buffer. The
    pool's pages are the caches' blocks of ``N`` tokens. Raises LayoutError naming the first layer or
    value that does not fit.
    """
    if not caches:
        raise LayoutError("no KV cache layers were registered")
    name0, first = caches[0]
    for name, t in caches:
        if not isinstance(t, torch.Tensor):
            raise LayoutError(f"layer {name!r} is a {type(t).__name__}, expected a torch.Tensor")
        if t.dim() != 4:
            raise LayoutError(
                f"layer {name!r} has shape {tuple(t.shape)}; the caches are [num_blocks, H, N, C]"
            )
        if (t.shape, t.dtype, t.device) != (first.shape, first.dtype, first.device):
            raise LayoutError(
                f"layer {name!r} is {t.dtype} {tuple(t.shape)} on {t.device}, layer {name0!r} is "
                f"{first.dtype} {tuple(first.shape)} on {first.device}: one cache group of equal layers is needed"
            )
        _check_order(name, t, order, order_name)
    _, heads_local, tokens, content = first.shape
    if tokens < 1:
        raise LayoutError(f"layer {name0!r} holds no tokens per block: shape {tuple(first.shape)}")
    mla = head_size is None
    if head_size is None:
        if heads_local != 1:
            raise LayoutError(
                f"layer {name0!r} has {heads_local} heads; an MLA cache has one latent per token"
            )
        elements = content
    elif content != 2 * head_size:
        raise LayoutError(
            f"layer {name0!r} holds {content} elements per head, expected K and V of head_size={head_size}"
        )
    else:
        elements = head_size
    as_bytes = byte_dtype(first.dtype)
    tensors = [t.view(torch.uint8) if as_bytes else t for _, t in caches]
    head_dim = elements * (first.element_size() if as_bytes else 1)
    layout = KVLayout(
        num_layers=len(caches),
        num_heads=1 if mla else (num_kv_heads or heads_local * tp_size),
        head_dim=head_dim,
        dtype=torch.uint8 if as_bytes else first.dtype,
        page_size=tokens,
        mla=mla,
    )
    per_token = [t.transpose(1, 2) for t in tensors]  # [blocks, N, H, C]
    if mla:
        views = per_token
    else:
        views = [t[..., :head_dim] for t in per_token] + [t[..., head_dim:] for t in per_token]
    memory: dict[int, torch.Tensor] = {}
    for t in tensors:
        raw = _backing(t)
        memory.setdefault(raw.data_ptr(), raw)
    return KVPool.from_views(layout, tp_size, tp_rank, views, list(memory.values()), aux)


class AuxBuffers:
    """Several aux buffers of different item sizes, packed per slot into one pool aux tensor.

    ``ptrs``/``lens``/``item_lens`` describe the buffers (SGLang's ``aux_data_*``); every buffer
    holds the same number of slots. :attr:`packed` is a ``[slots, sum(item_lens)]`` uint8 tensor on
    ``device`` to give :class:`KVPool` as its ``aux``. :meth:`pack` copies slot ``i`` of every buffer
    into row ``i`` (prefill, before the last chunk is sent); :meth:`unpack` copies row ``i`` back
    into the buffers (decode, once the room succeeded). Both run on the caller's thread; on CUDA
    they are ordered on the current stream.
    """

    def __init__(
        self,
        ptrs: Sequence[int],
        lens: Sequence[int],
        item_lens: Sequence[int],
        *,
        device: str | torch.device = "cpu",
    ) -> None:
        p = _int_list(ptrs, "aux_data_ptrs")
        n = _int_list(lens, "aux_data_lens")
        items = _int_list(item_lens, "aux_item_lens")
        if not p or not len(p) == len(n) == len(items):
            raise LayoutError(
                f"got {len(p)} aux_data_ptrs, {len(n)} aux_data_lens and {len(items)} aux_item_lens; "
                "need the same number (at least one) of each"
            )
        for i, (length, item) in enumerate(zip(n, items, strict=True)):
            if item == 0 or length % item:
                raise LayoutError(
                    f"aux_data_lens[{i}]={length} is not a multiple of aux_item_lens[{i}]={item}"
                )
        slots = n[0] // items[0]
        for i, (length, item) in enumerate(zip(n, items, strict=True)):
            if length // item != slots:
                raise LayoutError(
                    f"aux buffer {i} holds {length // item} slots of {item} bytes, buffer 0 holds {slots}"
                )
        check_disjoint([(f"aux_data_ptrs[{i}]", a, b) for i, (a, b) in enumerate(zip(p, n, strict=True))])
        self.num_slots = slots
        self.item_lens = items
        self.buffers = [
            view_of(a, b, device).view(slots, item) for a, b, item in zip(p, n, items, strict=True)
        ]
        self.packed = torch.zeros(slots, sum(items), dtype=torch.uint8, device=device)
        self._offsets = [sum(items[:i]) for i in range(len(items))]

    def _check(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise LayoutError(f"aux slot {slot!r} outside [0, {self.num_slots})")

    def pack(self, slot: int) -> None:
        """Copy slot ``slot`` of every buffer into row ``slot`` of :attr:`packed`."""
        self._check(slot)
        for buf, off, item in zip(self.buffers, self._offsets, self.item_lens, strict=True):
            self.packed[slot, off : off + item].copy_(buf[slot])

    def unpack(self, slot: int) -> None:
        """Copy row ``slot`` of :attr:`packed` back into slot ``slot`` of every buffer."""
        self._check(slot)
        for buf, off, item in zip(self.buffers, self._offsets, self.item_lens, strict=True):
            buf[slot].copy_(self.packed[slot, off : off + item])
