"""Bad input at the public API raises the typed error and leaves nothing half-registered."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from transfer_engine.config import EngineConfig
from transfer_engine.engine import TransferEngine
from transfer_engine.errors import (
    ConfigError,
    LayoutError,
    LocalProtocolError,
    PeerUnreachableError,
    RoomInUseError,
)
from transfer_engine.memory.layout import KVLayout, KVPool

from .harness import cluster, free_port, run_room, small_layout


@pytest.mark.anyio
async def test_bad_pages_and_room_reuse() -> None:
    async with cluster(small_layout(), 1, 1) as c:
        p, d = c.prefill[0], c.decode[0]
        with pytest.raises(LayoutError, match="page 64"):
            await d.receiver(1, c.bootstrap, np.array([0, 64]))
        with pytest.raises(ConfigError, match="room=-1"):
            await d.receiver(-1, c.bootstrap, np.array([0]))
        assert d.leaks()["rooms"] == 0
        sender = p.sender(7)
        with pytest.raises(RoomInUseError, match="room 7"):
            p.sender(7)
        with pytest.raises(LayoutError, match="page 99"):
            await sender.send(np.array([1, 99]))
        with pytest.raises(LayoutError, match="aux_slot=8"):
            await sender.send(np.array([1]), aux_slot=8)
        # nothing was queued by the failed calls: the room still completes with what follows
        receiver = await d.receiver(7, c.bootstrap, np.array([5]))
        with pytest.raises(RoomInUseError):
            await d.receiver(7, c.bootstrap, np.array([6]))
        await sender.send(np.array([3]), last=True)
        with pytest.raises(LocalProtocolError, match="last chunk"):
            await sender.send(np.array([4]))
        await sender.wait()
        await receiver.wait()
        # the id is free again once the room ended
        await run_room(c, 7, np.array([10, 11]), np.array([20, 21]), [2])
        c.assert_no_leaks()


@pytest.mark.anyio
async def test_unreachable_bootstrap() -> None:
    layout = small_layout()
    pool = KVPool.allocate(layout, 1, 0, 8)
    cfg = EngineConfig(role="decode", connect_timeout=0.3, bootstrap_port=free_port())
    async with TransferEngine(cfg, pool) as d:
        nowhere = f"tcp://127.0.0.1:{free_port()}"
        with pytest.raises(PeerUnreachableError, match=nowhere):
            await d.receiver(1, nowhere, np.array([0]))
        assert all(v == 0 for v in d.leaks().values()), d.leaks()
        assert not d.instances and not d.peers


@pytest.mark.anyio
async def test_layout_mismatch_is_refused() -> None:
    other = KVLayout(num_layers=3, num_heads=8, head_dim=32, dtype=torch.bfloat16, page_size=4)
    async with cluster(small_layout(), 1, 1, decode_layout=other) as c:
        d = c.decode[0]
        with pytest.raises(LayoutError, match="layout mismatch"):
            await d.receiver(1, c.bootstrap, np.array([0]))
        assert d.leaks()["rooms"] == 0 and not d.instances
        assert not c.prefill[0].peers
        c.assert_no_leaks()


def test_config_must_match_pool() -> None:
    pool = KVPool.allocate(small_layout(), 2, 1, 4)
    with pytest.raises(ConfigError, match="tp_size/tp_rank=1/0"):
        TransferEngine(EngineConfig(role="prefill"), pool)
