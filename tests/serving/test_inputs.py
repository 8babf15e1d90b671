"""Bad input to the serving example: a typed error (or HTTP 400) that names the value, nothing started."""

from __future__ import annotations

import aiohttp
import pytest
import torch

from examples.serving.frontdoor import FrontDoor
from examples.serving.model import ModelConfig, Seq, TPModel
from examples.serving.run import ClusterSpec
from transfer_engine import ConfigError, KVPool
from transfer_engine.testing.cluster import free_port

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize(
    "fields,named",
    [
        ({"chunk_tokens": 20, "page_size": 16}, "chunk_tokens=20"),
        ({"prefill_tp": 0}, "prefill_tp=0"),
        ({"decode_tp": 3}, "tp_size=3"),
        ({"max_batch_tokens": 8, "chunk_tokens": 16, "page_size": 16}, "max_batch_tokens=8"),
        ({"device": "tpu"}, "device='tpu'"),
        ({"num_pages": 2, "max_tokens": 100, "page_size": 16}, "num_pages=2"),
    ],
)
def test_cluster_spec_names_the_bad_value(fields: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace("(", r"\(")):
        ClusterSpec(**fields).check()  # type: ignore[arg-type]


def test_model_rejects_bad_shapes_and_short_page_tables() -> None:
    with pytest.raises(ConfigError, match="kv_heads=3"):
        ModelConfig(heads=6, kv_heads=3).check(2)
    with pytest.raises(ConfigError, match="head_dim=15"):
        ModelConfig(head_dim=15).check(1)
    cfg = ModelConfig(layers=1)
    model = TPModel(cfg)
    pool = KVPool.allocate(cfg.kv_layout(torch.float32, 4), 1, 0, 8)
    before = [t.clone() for t in pool.tensors]
    with pytest.raises(ConfigError, match="page table has 1"):
        model.forward([Seq(list(range(6)), 0, [3])], pool)
    assert all(torch.equal(a, b) for a, b in zip(before, pool.tensors, strict=True))  # nothing written


@pytest.mark.timeout(30)
async def test_front_door_answers_400_naming_the_value() -> None:
    front = FrontDoor(free_port(), [free_port()], "tcp://127.0.0.1:1", vocab=512)
    url = await front.start()
    try:
        async with aiohttp.ClientSession() as session:
            for body, named in [
                ({"prompt": [1, 99999]}, "99999"),
                ({"prompt": []}, "prompt=[]"),
                ({"prompt": [1], "max_new_tokens": 0}, "max_new_tokens=0"),
                ({"prompt": [1], "layerwise": "yes"}, "layerwise='yes'"),
            ]:
                async with session.post(f"{url}/generate", json=body) as resp:
                    assert resp.status == 400
                    assert named in await resp.text()
        assert front.pending == {}
    finally:
        await front.close()
