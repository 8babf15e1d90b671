"""Path choice: the policy of ``EngineConfig.path`` applied to one room with one prefill instance
(:func:`transfer_engine.protocol.paths.choose_path` decides ``auto``, from the room's pages when
they are known).
"""

from __future__ import annotations

import logging

import numpy as np

from transfer_engine.config import EngineConfig
from transfer_engine.engine.started import Started, host_staging
from transfer_engine.errors import ConfigError
from transfer_engine.memory.layout import KVPool, stride_rows_of
from transfer_engine.protocol import descriptors, heads
from transfer_engine.protocol.paths import (
    CPU_CROSSOVER,
    GPU_CROSSOVER,
    choose_kernel,
    choose_path,
    direct_descriptors_at_least,
    is_staged,
)
from transfer_engine.runtime.peers import PrefillInstance

log = logging.getLogger("transfer_engine.engine")


class PathPolicy:
    """Which path (direct, slice, staged, host) a decode rank's rooms with one prefill instance take:
    ``EngineConfig.path`` applied to the instance, the pool and whether this rank runs a staging ring."""

    def __init__(self, config: EngineConfig, pool: KVPool, started: Started) -> None:
        self.config = config
        self.pool = pool
        self._started = started
        self._slice_pieces_of: dict[str, float] = {}
        """Per prefill bootstrap: the slice path's descriptors per page (see :meth:`_slice_pieces`)."""
        self._kernel_told: set[str] = set()
        """Prefill bootstraps whose kernel-path fallback was logged (once each)."""

    def forget(self, bootstrap: str) -> None:
        """Drop what was measured of the instance behind ``bootstrap`` (one of its ranks died)."""
        self._slice_pieces_of.pop(bootstrap, None)
        self._kernel_told.discard(bootstrap)

    def choose(self, instance: PrefillInstance, pages: np.ndarray | None = None) -> tuple[str, str]:
        """The path of a room with ``instance``, and why. ``pages``: the room's pages on this rank,
        when known: under ``auto`` the direct plan's descriptors for them (at least one per KV tensor
        and run of consecutive pages) are weighed against the crossover of the pool's memory."""
        layout = self.pool.layout
        policy = self.config.path
        same_pages = all(p.layout.page_size == layout.page_size for p in instance.ranks)
        equal = instance.tp_size == self.config.tp_size or layout.mla
        staged = "host" if host_staging(self.config) else "staged"
        if policy == "auto":
            kernel, why_kernel = choose_kernel(
                enabled=self.config.kernel_path, mapped=[(p.mapped, p.unmapped) for p in instance.ranks]
            )
            if kernel:
                return "kernel", why_kernel
            if self.config.kernel_path and instance.bootstrap not in self._kernel_told:
                self._kernel_told.add(instance.bootstrap)
                log.info("rooms with %s fall back to NIXL: %s", instance.bootstrap, why_kernel)
            has_ring = self._started.ring is not None
            pieces = self._slice_pieces(instance) if has_ring and not (equal and same_pages) else float("inf")
            tensors = layout.num_kv_tensors
            choice = choose_path(
                equal_tp=equal, same_pages=same_pages, has_ring=has_ring, host=host_staging(self.config),
                slice_pieces=pieces, num_tensors=tensors,
                direct_descriptors=None if pages is None else direct_descriptors_at_least(pages, tensors),
                nbytes=0 if pages is None else len(pages) * self.pool.page_bytes * tensors,
                crossover=GPU_CROSSOVER if self.pool.device.type == "cuda" else CPU_CROSSOVER,
            )  # fmt: skip
            return choice.path.value, choice.reason
        if policy == "direct":
            if not equal:
                raise ConfigError(
                    f"path=direct needs equal TP or MLA; prefill tp {instance.tp_size}, decode tp {self.config.tp_size}"
                )
            if not same_pages:
                raise ConfigError("path=direct needs equal page sizes on prefill and decode")
            return "direct", "path=direct"
        if policy == "slice":
            return "slice", "path=slice"
        assert is_staged(policy) and self._started.ring is not None  # the ring exists for these policies
        return staged, f"path={policy}"

    def _slice_pieces(self, instance: PrefillInstance) -> float:
        """Slice-path descriptors per page from the worst writer of this rank (``path=auto``), once
        per instance; infinite between contiguous pools, which keep staged for hetero TP or pages."""
        found = self._slice_pieces_of.get(instance.bootstrap)
        if found is not None:
            return found
        pool = self.pool
        pieces = float("inf")
        if pool.strides is not None or any(p.layout.strides is not None for p in instance.ranks):
            layout = pool.layout
            writers = heads.writers_of(
                layout.num_heads, instance.tp_size, self.config.tp_size, self.config.tp_rank, layout.mla
            )
            src_heads = layout.heads_local(instance.tp_size)
            pieces = max(
                descriptors.slice_pieces_per_page(
                    stride_rows_of(instance.ranks[w.prefill_rank].layout, src_heads),
                    pool.stride_rows,
                    pool.head_bytes,
                    instance.ranks[w.prefill_rank].layout.page_size,
                    layout.page_size,
                    w.src_head_start,
                    w.dst_head_start,
                    w.num_heads,
                    src_heads,
                    pool.heads_local,
                )
                for w in writers
            )
        self._slice_pieces_of[instance.bootstrap] = pieces
        return pieces
