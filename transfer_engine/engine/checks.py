"""The checks of the arguments a caller gives the engine and its handles: room ids and a decode
room's pages. Each raises the engine's typed error naming the bad value and changes nothing, so a
caller on another thread (the blocking facade) can run them before it hands anything to the loop."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from transfer_engine.errors import ConfigError, LayoutError
from transfer_engine.memory.layout import KVPool

MAX_ROOM_ID = (1 << 63) - 1


def pages_array(pages: Sequence[int] | np.ndarray | Any, pool: KVPool, what: str) -> np.ndarray:
    """``pages`` (a sequence, array or tensor of page indices) as a 1-D int64 array; ConfigError for
    anything else or an empty one, LayoutError naming the first page outside ``pool``."""
    arr = np.asarray(pages.cpu() if hasattr(pages, "cpu") else pages)
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise ConfigError(
            f"{what} must be a non-empty 1-D sequence of integers, got {arr.dtype} shape {arr.shape}"
        )
    arr = arr.astype(np.int64)
    bad = np.flatnonzero((arr < 0) | (arr >= pool.num_pages))
    if bad.size:
        raise LayoutError(f"{what} contains page {int(arr[bad[0]])}, outside [0, {pool.num_pages})")
    return arr


def check_pages(
    pool: KVPool, pages: Sequence[int] | np.ndarray | Any, aux_slot: int | None, decode_prefix_len: int
) -> np.ndarray:
    """A decode room's pages (with its aux slot and cached prefix, as ``receiver()`` and
    ``request()`` take them) as an int64 array; ConfigError/LayoutError naming a bad argument."""
    arr = pages_array(pages, pool, "pages")
    pool.check_aux_slot(aux_slot)
    page_size = pool.layout.page_size
    if (
        not isinstance(decode_prefix_len, int)
        or isinstance(decode_prefix_len, bool)
        or decode_prefix_len < 0
        or decode_prefix_len % page_size
    ):
        raise ConfigError(
            f"decode_prefix_len={decode_prefix_len!r} must be a non-negative multiple of page_size={page_size}"
        )
    return arr


def check_room(room: int) -> None:
    """ConfigError unless ``room`` is a room id: an integer in ``[0, MAX_ROOM_ID]``."""
    if not isinstance(room, int) or not 0 <= room <= MAX_ROOM_ID:
        raise ConfigError(f"room={room!r} must be an integer in [0, 2**63)")
