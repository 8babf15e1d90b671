"""The KV layout a rank hands the engine, and the checks that its tensors match it.

The engine never allocates the KV cache of a serving system: it is given per-layer tensors and
validates them once, at construction. :meth:`KVPool.allocate` exists for the examples, tests and
benchmarks, which have no serving system to borrow a pool from.

Serving systems lay their KV out in other ways than our contiguous ``[num_slots, heads_local,
head_dim]`` per K and V. :meth:`KVPool.from_views` takes any of them as per-tensor views of logical
shape ``[num_blocks, block_size, heads_local, head_dim]`` over the memory the system allocated; the
functions ``views_*`` below build those views for the layouts the serving systems use, and the pool
describes them to peers as strides (``messages.KVStrides``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from transfer_engine.errors import LayoutError
from transfer_engine.protocol import descriptors, heads
from transfer_engine.protocol.messages import KVStrides, LayoutInfo, MemRegion

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "bfloat16",
        "float16",
        "float32",
        "float8_e4m3fn",
        "float8_e5m2",
        "int8",
        "uint8",
    )
    if hasattr(torch, name)
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; LayoutError for dtypes the engine does not move."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise LayoutError(f"dtype {dtype} is not supported; use one of {sorted(_DTYPES)}")
    return name


def dtype_of(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; LayoutError naming the value otherwise."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise LayoutError(f"dtype {name!r} is not supported; use one of {sorted(_DTYPES)}") from None


@dataclass(frozen=True)
class KVLayout:
    """The model-wide shape of the KV cache, identical on every rank of both sides except ``page_size``."""

    num_layers: int
    num_heads: int
    """Total KV heads of the model, unsharded (ignored for MLA)."""
    head_dim: int
    """Elements per head; for MLA the whole latent width (e.g. 576)."""
    dtype: torch.dtype
    page_size: int
    mla: bool = False

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_heads", "head_dim", "page_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"{field}={value!r} must be a positive integer")
        if not isinstance(self.dtype, torch.dtype):
            raise LayoutError(f"dtype={self.dtype!r} must be a torch.dtype such as torch.bfloat16")
        dtype_name(self.dtype)

    @property
    def num_kv_tensors(self) -> int:
        return self.num_layers if self.mla else 2 * self.num_layers

    def heads_local(self, tp_size: int) -> int:
        return 1 if self.mla else heads.heads_per_rank(self.num_heads, tp_size)


class KVPool:
    """One rank's KV cache as the engine sees it: 2L tensors (K then V) or L MLA latents, plus aux.

    Each KV tensor is ``[num_slots, heads_local, head_dim]``, contiguous, all of one dtype and on one
    device; ``num_slots = num_pages * page_size``. ``aux`` is ``[num_aux_slots, item_bytes]`` uint8 on
    any device (the first output token, logprobs...). Construction validates everything and raises
    :class:`LayoutError` naming the first bad value; a pool is immutable afterwards.
    """

    def __init__(
        self,
        layout: KVLayout,
        tp_size: int,
        tp_rank: int,
        tensors: Sequence[torch.Tensor],
        aux: torch.Tensor | None = None,
    ) -> None:
        self._init_common(layout, tp_size, tp_rank, tensors, aux)
        self._validate()
        first = self.tensors[0]
        self.strides: tuple[KVStrides, ...] | None = None
        """Set by :meth:`from_views`; None for contiguous ``[num_slots, heads_local, head_dim]`` tensors."""
        self.kv_views: tuple[torch.Tensor, ...] = self.tensors
        """The KV tensors in engine order as the staging kernels take them (``transfer_engine.kernels``):
        the ``[num_slots, heads_local, head_dim]`` tensors, or the views given to :meth:`from_views`."""
        self._set_sizes(first.shape[0] // layout.page_size, first)

    def _init_common(
        self,
        layout: KVLayout,
        tp_size: int,
        tp_rank: int,
        tensors: Sequence[torch.Tensor],
        aux: torch.Tensor | None,
    ) -> None:
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise LayoutError(f"tp_rank={tp_rank} is not a rank of tp_size={tp_size}")
        if not layout.mla:
            heads.validate_split(layout.num_heads, tp_size, tp_size)
        self.layout = layout
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.tensors: tuple[torch.Tensor, ...] = tuple(tensors)
        """The registered memory: the KV tensors themselves, or what :meth:`from_views` views live in."""
        self.aux = aux
        self.heads_local = layout.heads_local(tp_size)

    def _set_sizes(self, num_pages: int, first: torch.Tensor) -> None:
        self.num_pages = num_pages
        self.num_slots = num_pages * self.layout.page_size
        self.device = first.device
        self.itemsize = first.element_size()
        self.head_bytes = self.layout.head_dim * self.itemsize
        self.slot_bytes = self.heads_local * self.head_bytes
        self.page_bytes = self.slot_bytes * self.layout.page_size

    @classmethod
    def from_views(
        cls,
        layout: KVLayout,
        tp_size: int,
        tp_rank: int,
        views: Sequence[torch.Tensor],
        memory: Sequence[torch.Tensor],
        aux: torch.Tensor | None = None,
    ) -> KVPool:
        """A pool over KV laid out in any way a serving system lays it out.

        ``views`` are the KV tensors in the engine's order (``K_0..K_{L-1}, V_0..V_{L-1}``, or the
        ``L`` MLA latents), each a view of logical shape ``[num_blocks, block_size, heads_local,
        head_dim]`` with any strides, except that each head's ``head_dim`` elements are contiguous;
        ``block_size`` is ``layout.page_size`` and ``num_blocks`` is equal across views. ``memory`` is
        what gets registered with NIXL: contiguous tensors that every view lies inside (a view may
        share its tensor with others, as vLLM's K and V share a layer's tensor). The ``views_*``
        functions of this module build ``views`` for the serving systems' layouts. Raises
        :class:`LayoutError` naming the first bad value. Every path moves such a pool: the direct
        and slice paths from its strides, the staged and host paths' kernels from the views
        themselves (``kv_views``), into and out of the same staging format as any other layout.
        """
        pool = cls.__new__(cls)
        pool._init_common(layout, tp_size, tp_rank, memory, aux)
        pool.strides = pool._validate_views(tuple(views))
        pool.kv_views = tuple(views)
        pool._set_sizes(views[0].shape[0], views[0])  # the views' dtype: memory may be raw bytes
        return pool

    def _validate_views(self, views: tuple[torch.Tensor, ...]) -> tuple[KVStrides, ...]:
        layout = self.layout
        if len(views) != layout.num_kv_tensors:
            raise LayoutError(
                f"got {len(views)} KV views, expected {layout.num_kv_tensors} for L={layout.num_layers}"
            )
        if not self.tensors:
            raise LayoutError("memory is empty; pass the tensors the views live in")
        spans: list[tuple[int, int]] = []
        for i, t in enumerate(self.tensors):
            if not isinstance(t, torch.Tensor):
                raise LayoutError(f"memory tensor {i} is a {type(t).__name__}, expected a torch.Tensor")
            if not t.is_contiguous():
                raise LayoutError(f"memory tensor {i} has strides {t.stride()}; it must be contiguous")
            if t.device != self.tensors[0].device:
                raise LayoutError(f"memory tensor {i} is on {t.device}, expected {self.tensors[0].device}")
            spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
        expected: tuple[int, ...] | None = None
        out: list[KVStrides] = []
        for i, v in enumerate(views):
            if not isinstance(v, torch.Tensor):
                raise LayoutError(f"KV view {i} is a {type(v).__name__}, expected a torch.Tensor")
            if expected is None:
                expected = (
                    (v.shape[0], layout.page_size, self.heads_local, layout.head_dim) if v.dim() == 4 else ()
                )
            if v.dim() != 4 or tuple(v.shape) != expected or v.shape[0] < 1:
                raise LayoutError(
                    f"KV view {i} has shape {tuple(v.shape)}, expected [num_blocks, {layout.page_size}, "
                    f"{self.heads_local}, {layout.head_dim}] with num_blocks >= 1 and equal across views"
                )
            if v.dtype != layout.dtype:
                raise LayoutError(f"KV view {i} has dtype {v.dtype}, expected {layout.dtype}")
            if v.device != self.tensors[0].device:
                raise LayoutError(f"KV view {i} is on {v.device}, expected {self.tensors[0].device}")
            block, token, head, element = v.stride()
            if element != 1 and layout.head_dim > 1:
                raise LayoutError(
                    f"KV view {i} has strides {v.stride()}; each head's elements must be contiguous"
                )
            if min(block, token, head) < 0:
                raise LayoutError(f"KV view {i} has negative strides {v.stride()}")
            size = v.element_size()
            start = v.data_ptr()
            end = start + size * (1 + sum((n - 1) * st for n, st in zip(v.shape, v.stride(), strict=True)))
            region = next((r for r, (lo, hi) in enumerate(spans) if lo <= start and end <= hi), None)
            if region is None:
                raise LayoutError(
                    f"KV view {i} spans [{start:#x}, {end:#x}), which lies inside no memory tensor; "
                    "pass the tensors the views were taken from as memory"
                )
            out.append(
                KVStrides(
                    region=region,
                    offset=start - spans[region][0],
                    block=block * size,
                    head=head * size,
                    token=token * size,
                )
            )
        return tuple(out)

    def _validate(self) -> None:
        layout = self.layout
        expected = layout.num_kv_tensors
        if len(self.tensors) != expected:
            raise LayoutError(
                f"got {len(self.tensors)} KV tensors, expected {expected} "
                f"({'L latents' if layout.mla else '2L: K_0..K_{L-1}, V_0..V_{L-1}'}) for L={layout.num_layers}"
            )
        for i, t in enumerate(self.tensors):
            if not isinstance(t, torch.Tensor):
                raise LayoutError(f"KV tensor {i} is a {type(t).__name__}, expected a torch.Tensor")
        first = self.tensors[0]
        if first.dim() != 3 or tuple(first.shape[1:]) != (self.heads_local, layout.head_dim):
            raise LayoutError(
                f"KV tensor 0 has shape {tuple(first.shape)}, expected [num_slots, {self.heads_local}, {layout.head_dim}]"
            )
        shape = (first.shape[0], self.heads_local, layout.head_dim)
        if shape[0] == 0 or shape[0] % layout.page_size:
            raise LayoutError(
                f"num_slots={shape[0]} is not a positive multiple of page_size={layout.page_size}"
            )
        for i, t in enumerate(self.tensors):
            if tuple(t.shape) != shape:
                raise LayoutError(f"KV tensor {i} has shape {tuple(t.shape)}, expected {list(shape)}")
            if t.dtype != layout.dtype:
                raise LayoutError(f"KV tensor {i} has dtype {t.dtype}, expected {layout.dtype}")
            if t.device != first.device:
                raise LayoutError(f"KV tensor {i} is on {t.device}, expected {first.device}")
            if not t.is_contiguous():
                raise LayoutError(f"KV tensor {i} has strides {t.stride()}; it must be contiguous")
        if self.aux is not None:
            aux = self.aux
            if not isinstance(aux, torch.Tensor):
                raise LayoutError(f"aux is a {type(aux).__name__}, expected a torch.Tensor")
            if aux.dim() != 2 or aux.dtype != torch.uint8 or not aux.is_contiguous() or 0 in aux.shape:
                raise LayoutError(
                    f"aux must be a contiguous uint8 [num_aux_slots, item_bytes] tensor with both sizes >= 1, got "
                    f"{aux.dtype} {tuple(aux.shape)} strides {aux.stride()}"
                )

    @classmethod
    def allocate(
        cls,
        layout: KVLayout,
        tp_size: int,
        tp_rank: int,
        num_pages: int,
        *,
        device: str | torch.device = "cpu",
        aux_slots: int = 0,
        aux_item_bytes: int = 0,
        page_major: bool = False,
    ) -> KVPool:
        """A zeroed pool of ``num_pages`` pages, for the examples, tests and benchmarks.

        ``page_major``: one buffer ``[num_pages, L, 2, page_size, heads_local, head_dim]`` (MLA:
        ``[num_pages, L, page_size, 1, kv_dim]``) where a page holds every layer's K and V, as vLLM's
        block-major cache layouts do (:func:`views_page_major`), instead of one tensor per K and V.
        Between two such pools a run of pages is one contiguous range on each side: the descriptor
        tables' entry is (every layer, page), and a one-page room is one WRITE of one descriptor
        (docs/DECISIONS.md, "Descriptor tables made once per peer")."""
        heads_local = layout.heads_local(tp_size)
        if page_major:
            kv = 1 if layout.mla else 2
            memory = torch.zeros(
                num_pages, layout.num_layers, kv, layout.page_size, heads_local, layout.head_dim,
                dtype=layout.dtype, device=device,
            )  # fmt: skip
            aux = (
                torch.zeros(aux_slots, aux_item_bytes, dtype=torch.uint8, device=device)
                if aux_slots
                else None
            )
            return cls.from_views(layout, tp_size, tp_rank, views_page_major(memory), [memory], aux)
        slots = num_pages * layout.page_size
        tensors = [
            torch.zeros(slots, heads_local, layout.head_dim, dtype=layout.dtype, device=device)
            for _ in range(layout.num_kv_tensors)
        ]
        aux = torch.zeros(aux_slots, aux_item_bytes, dtype=torch.uint8, device=device) if aux_slots else None
        return cls(layout, tp_size, tp_rank, tensors, aux)

    @property
    def mem_type(self) -> str:
        """NIXL memory type of the KV tensors."""
        return "VRAM" if self.device.type == "cuda" else "DRAM"

    @property
    def device_id(self) -> int:
        return (self.device.index or 0) if self.device.type == "cuda" else 0

    def info(self) -> LayoutInfo:
        """The layout as it travels in ``PeerHello``/``RegisterRank``."""
        layout = self.layout
        return LayoutInfo(
            num_layers=layout.num_layers,
            num_heads=1 if layout.mla else layout.num_heads,
            head_dim=layout.head_dim,
            dtype=dtype_name(layout.dtype),
            page_size=layout.page_size,
            mla=layout.mla,
            num_pages=self.num_pages,
            aux_item_bytes=0 if self.aux is None else self.aux.shape[1],
            num_aux_slots=0 if self.aux is None else self.aux.shape[0],
            strides=None if self.strides is None else list(self.strides),
        )

    def regions(self) -> list[MemRegion]:
        """The KV tensors as registered memory ranges, in tensor order."""
        dev = self.device_id
        return [MemRegion(t.data_ptr(), t.numel() * t.element_size(), dev) for t in self.tensors]

    @cached_property
    def region_lengths(self) -> np.ndarray:
        """Bytes of each registered tensor, in ``regions()`` order (uint64)."""
        return np.array([t.numel() * t.element_size() for t in self.tensors], dtype=np.uint64)

    @cached_property
    def stride_rows(self) -> np.ndarray:
        """This pool's strides table (``descriptors.STRIDE_FIELDS``), whatever its layout."""
        return stride_rows_of(self.info(), self.heads_local)

    def aux_region(self) -> MemRegion | None:
        if self.aux is None:
            return None
        dev = (self.aux.device.index or 0) if self.aux.device.type == "cuda" else 0
        return MemRegion(self.aux.data_ptr(), self.aux.numel(), dev)

    def check_pages(self, pages: Sequence[int], what: str = "pages") -> None:
        """LayoutError naming the first page outside ``[0, num_pages)``."""
        for p in pages:
            if not 0 <= p < self.num_pages:
                raise LayoutError(f"{what} contains page {p}, outside [0, {self.num_pages})")

    def check_aux_slot(self, slot: int | None) -> None:
        if slot is None:
            return
        if self.aux is None:
            raise LayoutError(f"aux_slot={slot} given but this engine's pool has no aux buffer")
        if not 0 <= slot < self.aux.shape[0]:
            raise LayoutError(f"aux_slot={slot} outside [0, {self.aux.shape[0]})")


def stride_rows_of(info: LayoutInfo, heads_local: int) -> np.ndarray:
    """The strides table (int64, ``descriptors.STRIDE_FIELDS``) of a rank described by ``info``:
    its ``strides``, or those of contiguous ``[num_slots, heads_local, head_dim]`` tensors."""
    if info.strides is not None:
        return np.array(
            [(s.region, s.offset, s.block, s.head, s.token) for s in info.strides], dtype=np.int64
        ).reshape(-1, len(descriptors.STRIDE_FIELDS))
    head_bytes = info.head_dim * dtype_of(info.dtype).itemsize
    return descriptors.contiguous_strides(info.num_kv_tensors, heads_local, head_bytes, info.page_size)


def views_page_major(memory: torch.Tensor) -> list[torch.Tensor]:
    """A page-major pool (``KVPool.allocate(page_major=True)``): one buffer ``[num_pages, L, kv,
    page_size, heads_local, head_dim]``, ``kv`` 2 (K then V) or 1 (MLA's latent); page ``p`` of
    layer ``l`` is ``memory[p, l]``. Memory: ``[memory]``."""
    layers, kv = memory.shape[1], memory.shape[2]
    return [memory[:, layer, k] for k in range(kv) for layer in range(layers)]


def views_contiguous(
    k: Sequence[torch.Tensor], v: Sequence[torch.Tensor], page_size: int
) -> list[torch.Tensor]:
    """Our layout and SGLang's ``MHATokenToKVPool``: per layer ``k[l]``, ``v[l]`` of ``[num_slots,
    heads_local, head_dim]``, page ``p`` being slots ``[p * page_size, (p + 1) * page_size)``. Memory:
    ``[*k, *v]``."""
    return [t.view(t.shape[0] // page_size, page_size, *t.shape[1:]) for t in (*k, *v)]


def views_vllm_cpu(layers: Sequence[torch.Tensor], head_dim: int) -> list[torch.Tensor]:
    """vLLM's CPU attention backend: per layer ``[num_blocks, heads_local, block_size, 2 * head_dim]``,
    head-major inside a block, K and V side by side in the last dimension. Memory: ``layers``."""
    ks = [t[..., :head_dim].transpose(1, 2) for t in layers]
    vs = [t[..., head_dim:].transpose(1, 2) for t in layers]
    return [*ks, *vs]


def views_flash_nhd(layers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """vLLM's FlashAttention backend, NHD: per layer ``(2, num_blocks, block_size, heads_local,
    head_dim)``, K at index 0 and V at 1. Memory: ``layers``."""
    return [*(t[0] for t in layers), *(t[1] for t in layers)]


def views_flash_hnd(layers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """vLLM's FlashAttention backend, HND: in memory per layer ``(2, num_blocks, heads_local,
    block_size, head_dim)`` (what NIXL connectors ask for with heterogeneous TP). Memory: ``layers``."""
    return [*(t[0].transpose(1, 2) for t in layers), *(t[1].transpose(1, 2) for t in layers)]
