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

:func:`pool_from_vllm` (exported by ``transfer_engine.integrations.vllm``) takes that dict and the
layout's name and builds a :class:`KVPool` over the same memory, through the package's generic
builder of pools over per-layer caches (``transfer_engine.pool_from_caches``, in
``memory/views.py``): each layer's K and V (or latent) as a ``[blocks, tokens, heads, head_dim]``
view, and the backing buffer(s) as the registered memory. What is vLLM's stays here: the layout
names and their axis orders, the manager blocks split into kernel blocks, the layer names. The
pool's pages are the view's (kernel) blocks; :attr:`VllmKV.pages_of` turns vLLM's block ids into
them. Bytes are bytes: a dtype of one byte (vLLM's fp8 caches are uint8, ``fp8_inc`` is
float8_e4m3fn) and any dtype the engine does not know travels as uint8, its head ``itemsize`` times
wider; both sides must agree on it. Bad input raises :class:`LayoutError` naming the layer and the
value; nothing is registered then.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from transfer_engine import KVPool, pool_from_caches
from transfer_engine.errors import LayoutError

__all__ = ["LAYOUTS", "VllmKV", "layer_stride_order", "pool_from_vllm"]

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


def layer_stride_order(layout: str) -> tuple[int, ...]:
    """The memory order (outermost first) of one layer's ``[B, H, N, C]`` axes under ``layout``."""
    name = _ALIASES.get(layout, layout)
    if name not in LAYOUTS:
        raise LayoutError(f"KV cache layout {layout!r} is not one of vLLM's: {sorted(LAYOUTS)} (or NHD/HND)")
    return tuple(axis - 1 for axis in LAYOUTS[name] if axis != 0)


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
    pool = pool_from_caches(
        list(kv_caches.items()),
        order=order,
        order_name=f"vLLM's {layout} layout",
        head_size=head_size,
        tp_size=tp_size,
        tp_rank=tp_rank,
        num_kv_heads=num_kv_heads,
        aux=aux,
    )
    tokens = pool.layout.page_size
    if block_size % tokens:
        raise LayoutError(
            f"layer {next(iter(kv_caches))!r} holds {tokens} tokens per block, which does not divide "
            f"block_size={block_size}"
        )
    return VllmKV(pool, tuple(kv_caches), block_size // tokens)
