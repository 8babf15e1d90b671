"""Which network devices UCX gets for a control-plane host (transport/binding.py), table-driven."""

from __future__ import annotations

import pytest

from transfer_engine.transport.binding import (
    Interfaces,
    bound_params,
    net_devices,
    user_chose_devices,
    with_net_devices,
)

HOSTS = {"192.0.2.2": "eth0", "10.1.0.7": "eth1"}
ONE_NIC = Interfaces(("lo", "eth0"), frozenset({"lo"}), {"127.0.0.1": "lo", "192.0.2.2": "eth0"})
TWO_NICS = Interfaces(("lo", "eth0", "eth1"), frozenset({"lo"}), {"127.0.0.1": "lo", **HOSTS})
RDMA_ONE = Interfaces(ONE_NIC.names, ONE_NIC.loopback, ONE_NIC.addresses, rdma=True)
RDMA_TWO = Interfaces(TWO_NICS.names, TWO_NICS.loopback, TWO_NICS.addresses, rdma=True)


@pytest.mark.parametrize(
    ("host", "interfaces", "expected"),
    [
        ("127.0.0.1", ONE_NIC, "lo"),
        ("127.0.0.2", TWO_NICS, "lo"),
        ("localhost", RDMA_TWO, "lo"),
        ("::1", ONE_NIC, "lo"),
        ("0.0.0.0", ONE_NIC, None),
        ("::", ONE_NIC, None),
        ("*", ONE_NIC, None),
        ("192.0.2.2", ONE_NIC, "eth0"),
        ("192.0.2.2", TWO_NICS, "eth0"),
        ("10.1.0.7", TWO_NICS, "eth1"),
        ("192.0.2.2", RDMA_ONE, None),  # nothing else to exclude, and the RDMA ports must stay
        ("192.0.2.2", RDMA_TWO, "^eth1"),
        ("203.0.113.9", TWO_NICS, None),  # not an address of this machine
        ("127.0.0.1", Interfaces(("eth0",), frozenset(), {}), None),  # no loopback interface
    ],
)
def test_net_devices(host: str, interfaces: Interfaces, expected: str | None) -> None:
    assert net_devices(host, interfaces) == expected


@pytest.mark.parametrize(
    ("params", "environ", "chosen"),
    [
        ({}, {}, False),
        ({}, {"UCX_NET_DEVICES": "mlx5_0:1"}, True),
        ({}, {"UCX_NET_DEVICES": ""}, False),
        ({"ucx_devices": "mlx5_0:1"}, {}, True),
        ({"device_list": "mlx5_1"}, {}, True),
        ({"ucx_devices": " "}, {}, False),
        ({"engine_config": "RNDV_THRESH=8k"}, {}, False),
        ({"engine_config": "RNDV_THRESH=8k,NET_DEVICES=eth2"}, {}, True),
        ({"engine_config": "net_devices=eth2"}, {}, True),
    ],
)
def test_user_choice_wins(params: dict[str, str], environ: dict[str, str], chosen: bool) -> None:
    assert user_chose_devices(params, environ) is chosen
    if chosen:
        assert bound_params("UCX", params, "127.0.0.1", environ) == params


def test_engine_config_is_extended_not_replaced() -> None:
    assert with_net_devices({}, "lo") == {"engine_config": "NET_DEVICES=lo"}
    assert with_net_devices({"engine_config": "RNDV_THRESH=8k", "num_threads": "4"}, "lo") == {
        "engine_config": "RNDV_THRESH=8k,NET_DEVICES=lo",
        "num_threads": "4",
    }
    assert with_net_devices({"num_threads": "4"}, None) == {"num_threads": "4"}


def test_other_backends_are_left_alone() -> None:
    assert bound_params("LIBFABRIC", {"a": "1"}, "127.0.0.1", {}) == {"a": "1"}


def test_loopback_on_this_machine() -> None:
    """This machine has a loopback interface: the default host gets it."""
    params = bound_params("UCX", {}, "127.0.0.1", {})
    assert params["engine_config"].startswith("NET_DEVICES=")
    assert params["engine_config"] != "NET_DEVICES="
