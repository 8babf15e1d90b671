"""KV pools from memory that serving systems own: raw pointers (SGLang). vLLM's per-layer caches
become a pool in ``integrations/vllm/layouts.py`` (``pool_from_vllm``, exported by the root).

Nothing here copies or allocates KV: each function builds zero-copy tensor views of the caller's
memory and hands them to :class:`~transfer_engine.memory.layout.KVPool`, whose constructor validates them
as for any pool. The caller keeps the memory alive (and unmoved) for as long as the pool is used.
Bad input raises :class:`LayoutError` naming the bad value; nothing is registered then.

- :func:`pool_from_pointers`: SGLang's ``KVArgs`` shape. ``kv_data_ptrs`` are the K buffers of
  every layer, then the V buffers (one latent buffer per layer for MLA); ``kv_data_lens`` their
  byte lengths; ``kv_item_lens`` the bytes of one page of one buffer.
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

__all__ = ["AuxBuffers", "check_disjoint", "pool_from_pointers", "view_of"]


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
