"""SGLang's ``KVArgs`` read into the engine's pool, and what this backend refuses at start (pure).

See :mod:`transfer_engine.integrations.sglang.conn` for how SGLang's contract maps to the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from sglang.srt.disaggregation.base.conn import KVArgs

from transfer_engine import ConfigError, KVLayout, LayoutError

__all__ = ["PoolDescription", "fill_head_counts", "pool_from_kv_args", "refuse_unsupported"]


@dataclass(frozen=True)
class PoolDescription:
    """What the engine is told about SGLang's pool: a byte layout and its buffers in engine order."""

    layout: KVLayout
    kv_data_ptrs: list[int]
    kv_data_lens: list[int]
    kv_item_lens: list[int]
    target_layers: int
    draft_layers: int


def _ints(args: KVArgs, name: str) -> list[int]:
    values = list(getattr(args, name, None) or [])
    for i, value in enumerate(values):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
            raise LayoutError(f"KVArgs.{name}[{i}]={value!r} must be a non-negative integer")
    return [int(v) for v in values]


def _halves(ids: list[int], what: str) -> None:
    """K and V entries of one model carry the same layer ids, increasing."""
    half = len(ids) // 2
    if ids[:half] != ids[half:]:
        raise ConfigError(f"kv_layer_ids {what} {ids}: the V entries' ids differ from the K entries'")
    if any(b <= a for a, b in zip(ids[:half], ids[1:half], strict=False)):
        raise ConfigError(f"kv_layer_ids {what} {ids[:half]}: layer ids must increase")


def pool_from_kv_args(args: KVArgs, is_mla: bool) -> PoolDescription:
    """The engine's byte layout and buffer order from the ``KVArgs`` SGLang builds.

    The entries are the target model's buffers (K of every layer, then V; one latent per layer for
    MLA), then ``num_draft_entries`` of the draft model's in the same order. The engine gets the
    target's layers then the draft's, K before V, each head ``kv_item_lens / (page_size *
    kv_head_num)`` bytes wide. Raises LayoutError / ConfigError naming the first value that does
    not fit; reads no dtype name.
    """
    ptrs, lens, items = _ints(args, "kv_data_ptrs"), _ints(args, "kv_data_lens"), _ints(args, "kv_item_lens")
    if not ptrs or not len(ptrs) == len(lens) == len(items):
        raise LayoutError(
            f"got {len(ptrs)} kv_data_ptrs, {len(lens)} kv_data_lens and {len(items)} kv_item_lens; "
            "need the same number (at least one) of each"
        )
    layout_name = getattr(args, "kv_layout", None)
    if layout_name is not None and str(layout_name).lower() != "nhd":
        raise ConfigError(
            f"KVArgs.kv_layout={layout_name!r}: only token-major (NHD) pools are supported, "
            "not pools with a byte layout of their own (DeepSeek V4)"
        )
    if getattr(args, "mla_compression_ratios", None):
        raise ConfigError(
            f"KVArgs.mla_compression_ratios={args.mla_compression_ratios!r}: compressed-MLA pools "
            "(DeepSeek V4) are not supported"
        )
    draft = int(getattr(args, "num_draft_entries", 0) or 0)
    if not 0 <= draft < len(ptrs):
        raise ConfigError(f"num_draft_entries={draft} must be in [0, {len(ptrs)}) kv_data_ptrs")
    target = len(ptrs) - draft
    per_layer = 1 if is_mla else 2
    for count, what in ((target, "target"), (draft, "draft")):
        if count % per_layer:
            raise LayoutError(
                f"{count} {what} kv_data_ptrs (num_draft_entries={draft}): an MHA pool has K then V "
                "buffers, an even count"
            )
    ids = _ints(args, "kv_layer_ids")
    if ids:
        if len(ids) != len(ptrs):
            raise ConfigError(f"kv_layer_ids has {len(ids)} ids for {len(ptrs)} kv_data_ptrs")
        if not is_mla:
            _halves(ids[:target], "of the target")
            if draft:
                _halves(ids[target:], "of the draft")
    page_size = int(args.page_size)
    if page_size < 1:
        raise LayoutError(f"page_size={page_size} must be a positive integer")
    heads_local = 1 if is_mla else int(args.kv_head_num)
    if heads_local < 1:
        raise LayoutError(f"kv_head_num={heads_local} must be a positive integer")
    row = page_size * heads_local
    head_bytes, rest = divmod(items[0], row)
    if rest or head_bytes < 1:
        raise LayoutError(
            f"kv_item_lens[0]={items[0]} is not page_size={page_size} x kv_head_num={heads_local} x "
            "a whole number of bytes per head"
        )
    for i, (item, length) in enumerate(zip(items, lens, strict=True)):
        if item != items[0]:
            part = "draft" if i >= target else "target"
            raise LayoutError(
                f"kv_item_lens[{i}]={item} ({part}) differs from kv_item_lens[0]={items[0]}: target and "
                "draft buffers must have the same page width"
            )
        if length != lens[0]:
            raise LayoutError(f"kv_data_lens[{i}]={length} differs from kv_data_lens[0]={lens[0]}")
    target_layers, draft_layers = target // per_layer, draft // per_layer
    start = getattr(args, "prefill_start_layer", None)
    if start not in (None, 0):
        raise ConfigError(f"prefill_start_layer={start}: pipeline stages (--pp-size > 1) are not supported")
    # SGLang fills it with its pool's ``end_layer``, the last layer (inclusive: ``layer_num - 1``),
    # or, for a layer-sharded pool, with the layer after the last (exclusive).
    end = getattr(args, "prefill_end_layer", None)
    if end is not None and int(end) not in (target_layers - 1, target_layers):
        raise ConfigError(
            f"prefill_end_layer={end}, but the pool holds {target_layers} target layers from layer 0 "
            f"(its last layer is {target_layers - 1})"
        )
    if is_mla:
        order = list(range(len(ptrs)))
        num_heads = 1
    else:
        t, d = target // 2, draft // 2
        keys = [*range(t), *range(target, target + d)]
        order = [*keys, *(i + t for i in range(t)), *(target + d + i for i in range(d))]
        num_heads = int(args.total_kv_head_num)
    layout = KVLayout(target_layers + draft_layers, num_heads, head_bytes, torch.uint8, page_size, mla=is_mla)
    return PoolDescription(
        layout,
        [ptrs[i] for i in order],
        [lens[i] for i in order],
        [items[i] for i in order],
        target_layers,
        draft_layers,
    )


# --- what is refused at start (pure) --------------------------------------------------------------


def refuse_unsupported(args: KVArgs, server_args: Any) -> None:
    """ConfigError naming the flag of the first thing this backend does not support."""
    states = list(getattr(args, "state_types", None) or [])
    state_ptrs = [p for group in getattr(args, "state_data_ptrs", None) or [] for p in group]
    if states or state_ptrs:
        names = [str(getattr(s, "value", s)) for s in states]
        raise ConfigError(
            f"KVArgs.state_types={names}: hybrid-model state buffers (Mamba/GDN, SWA, DSA/NSA) are not "
            "supported by --disaggregation-transfer-backend transfer_engine"
        )
    if getattr(args, "is_hybrid_mla_backend", False):
        raise ConfigError("KVArgs.is_hybrid_mla_backend=True: hybrid MLA pools are not supported")
    pp = int(getattr(server_args, "pp_size", 1) or 1)
    if pp > 1:
        raise ConfigError(f"--pp-size={pp}: pipeline-parallel prefill is not supported")
    dp = int(getattr(server_args, "attn_dp_size", 1) or 1)
    if getattr(server_args, "enable_dp_attention", False) or dp > 1:
        raise ConfigError(
            f"--enable-dp-attention (attention DP size {dp}, --dp-size="
            f"{getattr(server_args, 'dp_size', 1)}): DP attention is not supported"
        )
    cp = int(getattr(server_args, "attn_cp_size", 1) or 1)
    if cp > 1:
        raise ConfigError(f"--attn-cp-size={cp}: attention context parallelism is not supported")


def fill_head_counts(args: KVArgs, server_args: Any, tp_size: int) -> None:
    """``kv_head_num`` and ``total_kv_head_num`` where SGLang leaves them unset, as its decode does.

    SGLang's decode fills them only for its staging buffer; the model's KV head count is in the model
    config the server arguments name, and each rank holds ``total // tp_size`` heads (one at least:
    GQA heads are replicated past the head count), as its pools are built.
    """
    total = int(getattr(args, "total_kv_head_num", 0) or 0)
    if total < 1:
        from sglang.srt.configs.model_config import ModelConfig

        total = int(ModelConfig.from_server_args(server_args).get_total_num_kv_heads())
    args.total_kv_head_num = total
    args.kv_head_num = max(1, total // tp_size)
