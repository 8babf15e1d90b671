"""The connector's settings, checked before any engine starts: ``engine_cpus``, and the engine's
settings merged from the connector's defaults, ``TE_*`` variables and ``kv_connector_extra_config``
(that order, the last winning; docs/vllm.md)."""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path

import pytest

from transfer_engine import EngineConfig
from transfer_engine.errors import ConfigError

with warnings.catch_warnings():  # vLLM's own imports warn about torch APIs it uses (warnings are errors here)
    warnings.simplefilter("ignore", DeprecationWarning)
    from transfer_engine.integrations.vllm.settings import CONNECTOR_DEFAULTS, engine_config, engine_cpus

pytestmark = pytest.mark.timeout(60)


def test_engine_cpus_default_is_every_cpu_and_a_list_is_kept() -> None:
    assert engine_cpus(None) == frozenset(range(os.cpu_count() or 1))
    assert engine_cpus([1, 0]) == frozenset({0, 1})


@pytest.mark.parametrize("bad", [[], "0-1", [0, -1], [0, 1.0], [True], 3])
def test_engine_cpus_rejects_anything_but_cpu_ids_naming_the_value(bad: object) -> None:
    with pytest.raises(ConfigError, match="engine_cpus="):
        engine_cpus(bad)


def config(extra: Mapping[str, object], environ: dict[str, str], **kw: int) -> EngineConfig:
    return engine_config(extra, environ, is_prefill=True, tp_size=kw.get("tp_size", 1),
                         tp_rank=kw.get("tp_rank", 0), dp_rank=kw.get("dp_rank", 0), max_rooms=16)  # fmt: skip


def test_extra_config_wins_over_te_variables_which_win_over_the_connector_s_defaults() -> None:
    assert config({}, {}).heartbeat_interval == CONNECTOR_DEFAULTS["heartbeat_interval"]
    env = {"TE_HEARTBEAT_INTERVAL": "7.5", "TE_CONNECT_TIMEOUT": "9", "TE_BOOTSTRAP_PORT": "9100"}
    merged = config({"heartbeat_interval": 2.0}, env)
    assert merged.heartbeat_interval == 2.0  # extra_config
    assert merged.connect_timeout == 9.0 and merged.bootstrap_port == 9100  # TE_*
    assert merged.bootstrap_timeout == CONNECTOR_DEFAULTS["bootstrap_timeout"]  # the connector's
    assert merged.max_rooms == 16 and merged.role == "prefill"


def test_te_variables_turn_curve_on_under_vllm(tmp_path: Path) -> None:
    zmq_auth = pytest.importorskip("zmq.auth")
    keys = tmp_path / "keys"
    keys.mkdir()
    _, secret = zmq_auth.create_certificates(str(keys), "prefill")
    env = {"TE_CURVE_SECRET_KEY_FILE": secret, "TE_CURVE_PUBLIC_KEYS_DIR": str(keys)}
    assert config({}, env).curve_secret_key_file == secret
    with pytest.raises(ConfigError, match="curve_public_keys_dir"):  # a half-set pair is refused
        config({"curve_public_keys_dir": ""}, env)


def test_host_is_the_bootstrap_host_unless_that_is_set() -> None:
    assert config({"host": "10.0.0.5"}, {}).bootstrap_endpoint == "tcp://10.0.0.5:8998"
    assert config({"host": "10.0.0.5", "bootstrap_host": "10.0.0.6"}, {}).bootstrap_host == "10.0.0.6"
    assert config({}, {"TE_BOOTSTRAP_HOST": "10.0.0.7", "TE_HOST": "10.0.0.5"}).bootstrap_host == "10.0.0.7"


def test_each_data_parallel_engine_binds_its_own_bootstrap_and_each_rank_its_own_ports() -> None:
    extra = {"bootstrap_port": 9000, "introspect_port": 9500, "metrics_port": 9600}
    ports = {
        (dp, tp): (c.bootstrap_port, c.introspect_port, c.metrics_port)
        for dp in range(2)
        for tp in range(2)
        for c in [config(extra, {}, tp_size=2, tp_rank=tp, dp_rank=dp)]
    }
    assert ports == {
        (0, 0): (9000, 9500, 9600), (0, 1): (9000, 9501, 9601),
        (1, 0): (9001, 9502, 9602), (1, 1): (9001, 9503, 9603),
    }  # fmt: skip
    assert config({}, {}, tp_rank=0, dp_rank=1).introspect_port == 0  # 0 still picks a free port


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"bootstrap_prot": 1}, "'bootstrap_prot' is not an engine setting"),
        ({"tp_size": 2}, "'tp_size': vLLM sets it"),
        ({"heartbeat_interval": -1}, "heartbeat_interval=-1"),
        ({"bootstrap_port": "x"}, "bootstrap_port"),
    ],
)
def test_bad_extra_config_is_refused_naming_the_key(extra: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(named)):
        config(extra, {})
