"""merge_regions: what the engine registers with NIXL (KVPool.registration)."""

from __future__ import annotations

import torch

from transfer_engine.layout import KVLayout, KVPool, merge_regions
from transfer_engine.protocol.messages import MemRegion


def test_touching_and_overlapping_ranges_merge_per_device() -> None:
    regions = [
        MemRegion(200, 100, 0),  # touches the next one
        MemRegion(100, 100, 0),
        MemRegion(250, 100, 0),  # overlaps
        MemRegion(300, 50, 1),  # same addresses, another device: kept apart
        MemRegion(500, 10, 0),  # a gap: kept apart
    ]
    assert merge_regions(regions) == [
        MemRegion(100, 250, 0),
        MemRegion(500, 10, 0),
        MemRegion(300, 50, 1),
    ]
    assert merge_regions([]) == []


def test_allocated_pool_registers_one_region_covering_every_tensor() -> None:
    layout = KVLayout(num_layers=3, num_heads=2, head_dim=8, dtype=torch.bfloat16, page_size=4)
    pool = KVPool.allocate(layout, 1, 0, 5)
    (region,) = pool.registration()
    assert len(pool.regions()) == 6
    assert region.addr == min(r.addr for r in pool.regions())
    assert region.length == sum(r.length for r in pool.regions())
    pool.tensors[1].fill_(1)  # the views do not alias each other
    assert int(pool.tensors[0].count_nonzero()) == 0 and int(pool.tensors[2].count_nonzero()) == 0
