"""The KV layout a rank hands the engine, and the checks that its tensors match it.

The engine never allocates the KV cache of a serving system: it is given per-layer tensors and
validates them once, at construction. :meth:`KVPool.allocate` exists for the examples, tests and
benchmarks, which have no serving system to borrow a pool from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from transfer_engine.errors import LayoutError
from transfer_engine.protocol import heads
from transfer_engine.protocol.messages import LayoutInfo, MemRegion

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
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise LayoutError(f"tp_rank={tp_rank} is not a rank of tp_size={tp_size}")
        if not layout.mla:
            heads.validate_split(layout.num_heads, tp_size, tp_size)
        self.layout = layout
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.tensors: tuple[torch.Tensor, ...] = tuple(tensors)
        self.aux = aux
        self.heads_local = layout.heads_local(tp_size)
        self._validate()
        first = self.tensors[0]
        self.num_slots = first.shape[0]
        self.num_pages = self.num_slots // layout.page_size
        self.device = first.device
        self.itemsize = first.element_size()
        self.head_bytes = layout.head_dim * self.itemsize
        self.slot_bytes = self.heads_local * self.head_bytes
        self.page_bytes = self.slot_bytes * layout.page_size

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
    ) -> KVPool:
        """A zeroed pool of ``num_pages`` pages, for the examples, tests and benchmarks."""
        heads_local = layout.heads_local(tp_size)
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
        )

    def regions(self) -> list[MemRegion]:
        """The KV tensors as registered memory ranges, in tensor order."""
        dev = self.device_id
        return [MemRegion(t.data_ptr(), t.numel() * t.element_size(), dev) for t in self.tensors]

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
