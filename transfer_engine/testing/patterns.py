"""Deterministic KV contents for the examples, tests and benchmarks, so every received byte is checked.

The value of element ``dim`` of global head ``head`` of token ``token`` of KV tensor ``tensor`` of
room ``room`` is a hash of those five numbers, written as the raw bits of the pool's dtype (an
integer view: bf16/fp16 as int16, fp32 as int32, fp8/int8 as int8). The prefill fills the pages of a
room; the decode recomputes the values for the heads and tokens it holds and compares bits.
"""

from __future__ import annotations

import numpy as np
import torch

from transfer_engine.memory.layout import KVPool
from transfer_engine.protocol import heads as head_math
from transfer_engine.protocol.layers import group_tensors

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def global_heads(pool: KVPool) -> torch.Tensor:
    """The global head index of each local head of this rank (0 for MLA)."""
    layout = pool.layout
    if layout.mla:
        return torch.zeros(1, dtype=torch.int64)
    start, stop = head_math.owned_heads(layout.num_heads, pool.tp_size, pool.tp_rank)
    return torch.arange(start, stop, dtype=torch.int64)


def values(
    room: int, tensor: int, heads: torch.Tensor, tokens: torch.Tensor, head_dim: int, itemsize: int
) -> torch.Tensor:
    """``[tokens, heads, head_dim]`` integers of the dtype's width: the expected bits."""
    dims = torch.arange(head_dim, dtype=torch.int64, device=tokens.device)
    x = (
        (room % 1_000_003) * 1_000_003
        + tensor * 7_919
        + heads.view(1, -1, 1) * 104_729
        + tokens.view(-1, 1, 1) * 131
        + dims.view(1, 1, -1)
    )
    x = (x * 2_654_435_761) & 0xFFFFFFFF
    x = (x ^ (x >> 13)) & ((1 << (8 * itemsize - 1)) - 1)
    return x.to(_INT_VIEW[itemsize])


def _slots(pages: np.ndarray, page_size: int, num_tokens: int) -> torch.Tensor:
    offsets = np.arange(num_tokens)
    return torch.from_numpy(
        np.asarray(pages, dtype=np.int64)[offsets // page_size] * page_size + offsets % page_size
    )


def slot_index(tensor: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Index of ``slots`` into a ``[num_slots, H, D]`` tensor or a ``[num_blocks, block_size, H, D]`` view."""
    if tensor.dim() == 3:
        return (slots,)
    block_size = tensor.shape[1]
    return (torch.div(slots, block_size, rounding_mode="floor"), slots % block_size)


def fill(pool: KVPool, room: int, pages: np.ndarray, layers: tuple[int, int] | None = None) -> None:
    """Write the room's pattern into every slot of ``pages`` (request order) on a prefill rank;
    ``layers=(a, b)``: only the KV tensors of layers ``[a, b)`` (as a layer-wise forward does)."""
    num_tokens = len(pages) * pool.layout.page_size
    slots = _slots(pages, pool.layout.page_size, num_tokens).to(pool.device)
    tokens = torch.arange(num_tokens, dtype=torch.int64, device=pool.device)
    hs = global_heads(pool).to(pool.device)
    chosen = (
        None
        if layers is None
        else set(group_tensors(pool.layout.num_layers, pool.layout.mla, *layers).tolist())
    )
    for t, tensor in enumerate(pool.kv_views):
        if chosen is not None and t not in chosen:
            continue
        expected = values(room, t, hs, tokens, pool.layout.head_dim, pool.itemsize)
        tensor.view(_INT_VIEW[pool.itemsize])[slot_index(tensor, slots)] = expected


def mismatches(pool: KVPool, room: int, pages: np.ndarray, num_tokens: int) -> int:
    """How many elements of the first ``num_tokens`` tokens in ``pages`` differ from the pattern."""
    slots = _slots(pages, pool.layout.page_size, num_tokens).to(pool.device)
    tokens = torch.arange(num_tokens, dtype=torch.int64, device=pool.device)
    hs = global_heads(pool).to(pool.device)
    bad = 0
    for t, tensor in enumerate(pool.kv_views):
        expected = values(room, t, hs, tokens, pool.layout.head_dim, pool.itemsize)
        got = tensor.view(_INT_VIEW[pool.itemsize])[slot_index(tensor, slots)]
        bad += int((got != expected).sum())
    return bad


def aux_bytes(room: int, item_bytes: int) -> torch.Tensor:
    """The aux item of a room: ``item_bytes`` bytes derived from the room id."""
    # Only the low byte of room * 17 matters, and (room & 0xFF) keeps the product inside int64 for
    # every room id up to 2**63.
    x = (torch.arange(item_bytes, dtype=torch.int64) * 31 + (room & 0xFF) * 17 + 5) & 0xFF
    return x.to(torch.uint8)


def fill_aux(pool: KVPool, room: int, slot: int) -> None:
    assert pool.aux is not None
    pool.aux[slot] = aux_bytes(room, pool.aux.shape[1]).to(pool.aux.device)


def aux_ok(pool: KVPool, room: int, slot: int) -> bool:
    assert pool.aux is not None
    return bool(torch.equal(pool.aux[slot].cpu(), aux_bytes(room, pool.aux.shape[1])))


def received_tokens(
    prefill_pages: int, prefill_page_size: int, decode_pages: int, decode_page_size: int
) -> int:
    """Tokens a decode rank holds after a transfer: the prefill's pages, clipped to the decode's."""
    return min(prefill_pages * prefill_page_size, decode_pages * decode_page_size)
