"""vLLM's KV caches as the engine's pool: zero-copy views, whatever the attention backend.

What vLLM 0.32 registers (``register_kv_caches``: layer name -> tensor), read from its sources:

- every layer's cache is a view of logical shape ``[num_blocks, H, block_size, C]`` into ONE
  backing buffer (``vllm/v1/worker/utils.py``, ``allocate_kv_cache``: a flat int8 tensor;
  ``vllm/v1/kv_cache_interface.py``, ``create_kv_cache_views``), viewed as the spec's dtype;
- ``C`` is a KV head's content: K then V side by side (``2 * head_size`` elements) for every
  K/V backend (FlashAttention, FlashInfer, Triton, CPU: ``AttentionSpec.state_content_size_bytes``),
  one latent (``kv_lora_rank + rope_dim``) with ``H = 1`` for MLA, replicated over TP;
- the memory order of the five axes ``[L, B, H, N, C]`` (layer, block, head, token, content) is the
  model-wide ``KVCacheLayout`` (``vllm/v1/kv_cache_layout.py``), resolved once from what the
  backends support (``vllm/v1/attention/backends/utils.py``, ``resolve_kv_cache_layout``):
  ``LBNHC`` (NHD, the default: FlashAttention, FlashInfer before Blackwell), ``LBHNC`` (HND: the
  CPU backend, FlashInfer on Blackwell), ``LHBNC``, and the cross-layer ``BLHNC``/``BLNHC``/``BHLNC``
  (one block of every layer side by side). Pages may be padded (MLA alignment);
- a manager block may be split into kernel blocks (``group_kernel_blocks``): the view then has
  ``ratio`` times more blocks of ``block_size / ratio`` tokens.

:func:`pool_from_vllm` takes that dict and the layout's name and builds a :class:`KVPool` over the
same memory: each layer's K and V (or latent) as a ``[blocks, tokens, heads, head_dim]`` view, and
the backing buffer(s) as the registered memory. The pool's pages are the view's (kernel) blocks;
:attr:`VllmKV.pages_of` turns vLLM's block ids into them. Bytes are bytes: a dtype of one byte
(vLLM's fp8 caches are uint8, ``fp8_inc`` is float8_e4m3fn) and any dtype the engine does not know
travels as uint8, its head ``itemsize`` times wider; both sides must agree on it. Bad input raises
:class:`LayoutError` naming the layer and the value; nothing is registered then.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from transfer_engine import KVLayout, KVPool
from transfer_engine.errors import LayoutError

__all__ = ["LAYOUTS", "VllmKV", "byte_dtype", "layer_stride_order", "pool_from_vllm"]

LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
"""vLLM's ``KVCacheLayout`` names -> the axes of ``[L, B, H, N, C]`` from outermost to innermost in
memory. ``NHD`` and ``HND`` are accepted as vLLM's legacy names for ``LBNHC`` and ``LBHNC``."""

_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}

_ENGINE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.uint8)
"""Dtypes that travel as themselves; every other one travels as bytes (:func:`byte_dtype`)."""


def layer_stride_order(layout: str) -> tuple[int, ...]:
    """The memory order (outermost first) of one layer's ``[B, H, N, C]`` axes under ``layout``."""
    name = _ALIASES.get(layout, layout)
    if name not in LAYOUTS:
        raise LayoutError(f"KV cache layout {layout!r} is not one of vLLM's: {sorted(LAYOUTS)} (or NHD/HND)")
    return tuple(axis - 1 for axis in LAYOUTS[name] if axis != 0)


def byte_dtype(dtype: torch.dtype) -> bool:
    """Whether KV of ``dtype`` travels as uint8 bytes: one-byte floats (fp8) and unknown dtypes."""
    return dtype not in _ENGINE_DTYPES


@dataclass(frozen=True)
class VllmKV:
    """A rank's vLLM KV caches as an engine pool (see the module docstring)."""

    pool: KVPool
    layer_names: tuple[str, ...]
    """The layers in engine order (the order vLLM registered them in)."""
    block_ratio: int
    """Pool pages (kernel blocks) per vLLM block."""

    @property
    def block_size(self) -> int:
        """vLLM's block size, in tokens."""
        return self.pool.layout.page_size * self.block_ratio

    def layer_index(self, name: str) -> int:
        """The engine index of layer ``name``; LayoutError for a name vLLM did not register."""
        try:
            return self.layer_names.index(name)
        except ValueError:
            raise LayoutError(f"layer {name!r} is not one of the registered KV cache layers") from None

    def pages_of(self, block_ids: object) -> np.ndarray:
        """vLLM block ids -> the pool's pages, in token order (block ``b`` is pages
        ``b * ratio .. b * ratio + ratio - 1``). LayoutError for a block outside the cache."""
        blocks = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        num_blocks = self.pool.num_pages // self.block_ratio
        bad = blocks[(blocks < 0) | (blocks >= num_blocks)]
        if bad.size:
            raise LayoutError(f"block id {int(bad[0])} is outside the KV cache's [0, {num_blocks})")
        if self.block_ratio == 1:
            return blocks
        return (blocks[:, None] * self.block_ratio + np.arange(self.block_ratio)).reshape(-1)


def _check_order(name: str, t: torch.Tensor, order: tuple[int, ...], layout: str) -> None:
    """LayoutError unless ``t``'s strides put its axes in ``order`` (size-1 axes may sit anywhere)."""
    placed = [axis for axis in order if t.shape[axis] > 1]
    strides = [t.stride(axis) for axis in placed]
    if any(a < b for a, b in zip(strides, strides[1:], strict=False)) or (strides and strides[-1] != 1):
        raise LayoutError(
            f"layer {name!r} has shape {tuple(t.shape)} and strides {t.stride()}, which are not vLLM's "
            f"{layout} layout (axes [B, H, N, C] in memory order {order})"
        )


def _backing(t: torch.Tensor) -> torch.Tensor:
    """The whole buffer ``t`` views, as a contiguous uint8 tensor (no copy)."""
    storage = t.untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8, device=t.device)
    return raw.set_(storage, 0, (storage.nbytes(),), (1,))


def pool_from_vllm(
    kv_caches: Mapping[str, torch.Tensor],
    *,
    layout: str,
    block_size: int,
    head_size: int | None,
    tp_size: int,
    tp_rank: int,
    num_kv_heads: int | None = None,
    aux: torch.Tensor | None = None,
) -> VllmKV:
    """A pool over the KV caches one vLLM rank registered, without copies.

    ``layout``: vLLM's resolved ``KVCacheLayout`` name (``cache_config.kv_cache_layout``), checked
    against every tensor's strides. ``block_size``: vLLM's (manager) block size; a view with fewer
    tokens per block is split into kernel blocks. ``head_size``: the K (and V) head size, each layer
    holding ``[blocks, H, N, 2 * head_size]``; None for MLA, each layer holding ``[blocks, 1, N,
    latent]``. ``num_kv_heads``: the model's KV heads over all ranks (default ``H * tp_size``).
    ``aux``: the pool's aux buffer. Raises LayoutError naming the first layer or value that does not fit.
    """
    order = layer_stride_order(layout)
    items = list(kv_caches.items())
    if not items:
        raise LayoutError("no KV cache layers were registered")
    name0, first = items[0]
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise LayoutError(f"layer {name!r} is a {type(t).__name__}, expected a torch.Tensor")
        if t.dim() != 4:
            raise LayoutError(
                f"layer {name!r} has shape {tuple(t.shape)}; vLLM's caches are [num_blocks, H, block_size, C]"
            )
        if (t.shape, t.dtype, t.device) != (first.shape, first.dtype, first.device):
            raise LayoutError(
                f"layer {name!r} is {t.dtype} {tuple(t.shape)} on {t.device}, layer {name0!r} is "
                f"{first.dtype} {tuple(first.shape)} on {first.device}: one cache group of equal layers is needed"
            )
        _check_order(name, t, order, layout)
    _, heads_local, tokens, content = first.shape
    if tokens < 1 or block_size % tokens:
        raise LayoutError(
            f"layer {name0!r} holds {tokens} tokens per block, which does not divide block_size={block_size}"
        )
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
    caches = [t.view(torch.uint8) if as_bytes else t for _, t in items]
    head_dim = elements * (first.element_size() if as_bytes else 1)
    kv_layout = KVLayout(
        num_layers=len(items),
        num_heads=1 if mla else (num_kv_heads or heads_local * tp_size),
        head_dim=head_dim,
        dtype=torch.uint8 if as_bytes else first.dtype,
        page_size=tokens,
        mla=mla,
    )
    per_token = [t.transpose(1, 2) for t in caches]  # [blocks, N, H, C]
    if mla:
        views = per_token
    else:
        views = [t[..., :head_dim] for t in per_token] + [t[..., head_dim:] for t in per_token]
    memory: dict[int, torch.Tensor] = {}
    for t in caches:
        raw = _backing(t)
        memory.setdefault(raw.data_ptr(), raw)
    pool = KVPool.from_views(kv_layout, tp_size, tp_rank, views, list(memory.values()), aux)
    return VllmKV(pool, tuple(name for name, _ in items), block_size // tokens)
