"""The link probe's settings and decisions, pure: the floor's configuration, what a decode makes of a
probe (``engine.handshake.link_verdict``), and the cost signal seeded from it (``CostBook.seed``)."""

from __future__ import annotations

import math

import pytest

from transfer_engine.config import EngineConfig
from transfer_engine.engine.handshake import link_verdict
from transfer_engine.errors import ConfigError, SlowLinkError
from transfer_engine.protocol.cost import DEFAULT_PRIOR_RATE, CostBook
from transfer_engine.transport.probe import LinkProbe

MB4 = 4 << 20


def test_defaults_set_no_floor() -> None:
    cfg = EngineConfig(role="decode")
    assert (cfg.min_link_gbps, cfg.refuse_tcp_link) == (0.0, False)


def test_from_env() -> None:
    cfg = EngineConfig.from_env({"TE_ROLE": "decode", "TE_MIN_LINK_GBPS": "2.5", "TE_REFUSE_TCP_LINK": "1"})
    assert (cfg.min_link_gbps, cfg.refuse_tcp_link) == (2.5, True)
    assert (
        EngineConfig.from_env({"TE_ROLE": "decode", "TE_REFUSE_TCP_LINK": "false"}).refuse_tcp_link is False
    )


@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf])
def test_a_bad_floor_is_named(value: float) -> None:
    with pytest.raises(ConfigError, match=r"min_link_gbps=.* must be a number of GB/s >= 0"):
        EngineConfig(role="decode", min_link_gbps=value)


@pytest.mark.parametrize(
    ("env", "field"),
    [({"TE_MIN_LINK_GBPS": "fast"}, "min_link_gbps"), ({"TE_REFUSE_TCP_LINK": "2"}, "refuse_tcp_link")],
)
def test_a_bad_variable_is_named(env: dict[str, str], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        EngineConfig.from_env({"TE_ROLE": "decode", **env})


def probe(transport: str, seconds: float, devices: str = "lo") -> LinkProbe:
    return LinkProbe("te-prefill-0", MB4, seconds, transport, devices, MB4 if transport == "tcp" else 0)


@pytest.mark.parametrize(
    ("transport", "gbps", "min_gbps", "refuse_tcp", "mem", "verdict", "why"),
    [
        ("shm", 4.0, 0.0, False, "DRAM", "ok", ""),
        ("shm", 4.0, 2.0, True, "DRAM", "ok", ""),
        ("shm", 4.0, 8.0, False, "DRAM", "refuse", "below min_link_gbps=8"),
        ("cuda_ipc", 100.0, 300.0, False, "VRAM", "refuse", "nvidia-smi topo -m"),
        ("rdma", 20.0, 40.0, False, "VRAM", "refuse", "UCX_NET_DEVICES names the NIC"),
        ("tcp", 1.0, 0.0, False, "DRAM", "ok", ""),  # a host pool's TCP is no news
        ("tcp", 1.0, 0.0, False, "VRAM", "warn", "TCP where RDMA or NVLink was expected"),
        ("tcp", 1.0, 0.0, True, "DRAM", "refuse", "TCP where RDMA or NVLink was expected"),
        ("tcp", 1.0, 0.5, True, "VRAM", "refuse", "UCX_NET_DEVICES"),
        ("tcp", 1.0, 2.0, False, "VRAM", "refuse", "below min_link_gbps=2"),
    ],
)
def test_link_verdict(
    transport: str, gbps: float, min_gbps: float, refuse_tcp: bool, mem: str, verdict: str, why: str
) -> None:
    got, error = link_verdict(
        probe(transport, MB4 / (gbps * 1e9)), min_gbps=min_gbps, refuse_tcp=refuse_tcp, mem_type=mem
    )
    assert got == verdict
    if verdict == "ok":
        assert error is None
    else:
        assert isinstance(error, SlowLinkError) and (error.peer, error.transport) == (
            "te-prefill-0",
            transport,
        )
        assert error.gbps == pytest.approx(gbps) and why in str(error), error


def test_the_cost_signal_starts_from_the_seeded_rate_until_rooms_measure_one() -> None:
    book = CostBook(prior_rate=DEFAULT_PRIOR_RATE)
    book.seed("tcp://p:1", 2e9)
    assert book.estimate("tcp://p:1", 4_000_000) == pytest.approx(0.002)
    assert book.estimate("tcp://other:1", 4_000_000) == pytest.approx(4_000_000 / DEFAULT_PRIOR_RATE)
    book.queued(1, "tcp://p:1", 1_000_000)
    assert book.estimate("tcp://p:1", 1_000_000) == pytest.approx(0.001)  # behind the queued room
    book.started(1, 10.0)
    book.moved(1, 1_000_000, 10.5)  # measured: 2 MB/s
    book.ended(1, 10.5, ok=True)
    assert book.loads()["tcp://p:1"].rate == pytest.approx(2e6)
    assert book.estimate("tcp://p:1", 2_000_000) == pytest.approx(1.0)  # the measure wins over the seed
    book.seed("tcp://p:1", 8e9)  # a new handshake's probe: the measured rate still wins
    assert book.estimate("tcp://p:1", 2_000_000) == pytest.approx(1.0)


@pytest.mark.parametrize("rate", [0.0, -1.0, math.inf, math.nan])
def test_a_bad_seed_is_named(rate: float) -> None:
    with pytest.raises(ValueError, match="prior_rate="):
        CostBook(prior_rate=1.0).seed("tcp://p:1", rate)
