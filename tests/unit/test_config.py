"""Engine configuration: TE_* variables, overrides, CLI flags, and errors that name the bad field."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import msgspec
import pytest

from transfer_engine.config import TUNER_FIELDS, USER_FIELDS, EngineConfig
from transfer_engine.errors import ConfigError
from transfer_engine.transport.posting import default_params


@pytest.fixture(autouse=True)
def _no_te_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests that read os.environ see only the TE_* variables they set themselves."""
    for key in list(os.environ):
        if key.startswith("TE_"):
            monkeypatch.delenv(key)


def test_defaults() -> None:
    cfg = EngineConfig(role="prefill")
    assert (cfg.tp_size, cfg.tp_rank, cfg.host, cfg.bootstrap_port) == (1, 0, "127.0.0.1", 8998)
    assert (cfg.path, cfg.staging_memory, cfg.ring_bytes, cfg.waiting_timeout) == ("auto", "device", 0, None)
    assert cfg.nixl_params == {}
    assert cfg.bootstrap_endpoint == "tcp://127.0.0.1:8998"


def test_from_env_converts_every_kind_of_field() -> None:
    env = {
        "TE_ROLE": "decode",
        "TE_TP_SIZE": "4",
        "TE_TP_RANK": "3",
        "TE_HOST": "10.0.0.7",
        "TE_BOOTSTRAP_PORT": "9000",
        "TE_HOST_BOOTSTRAP": "true",
        "TE_PATH": "staged",
        "TE_STAGING_MEMORY": "host",
        "TE_RING_BYTES": "1048576",
        "TE_TRANSFER_TIMEOUT": "2.5",
        "TE_WAITING_TIMEOUT": "7",
        "TE_NIXL_BACKEND": "UCX_MO",
        "TE_NIXL_PARAMS": "num_threads=4, progress=yes",
        "TE_UNRELATED": "ignored",
        "ROLE": "prefill",
    }
    cfg = EngineConfig.from_env(env)
    assert cfg.role == "decode"
    assert (cfg.tp_size, cfg.tp_rank) == (4, 3)
    assert cfg.host == "10.0.0.7"
    assert cfg.bootstrap_port == 9000
    assert cfg.host_bootstrap is True and cfg.hosts_bootstrap is True
    assert (cfg.path, cfg.staging_memory) == ("staged", "host")
    assert cfg.ring_bytes == 1 << 20
    assert cfg.transfer_timeout == 2.5
    assert cfg.waiting_timeout == 7.0
    assert cfg.nixl_backend == "UCX_MO"
    assert cfg.nixl_params == {"num_threads": "4", "progress": "yes"}


def test_from_env_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TE_ROLE", "decode")
    monkeypatch.setenv("TE_NUM_WORKERS", "8")
    cfg = EngineConfig.from_env()
    assert (cfg.role, cfg.num_workers) == ("decode", 8)


def test_explicit_environ_ignores_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TE_TP_SIZE", "not a number")
    assert EngineConfig.from_env({"TE_ROLE": "prefill"}).tp_size == 1


def test_overrides_beat_environment_and_none_is_ignored() -> None:
    env = {"TE_ROLE": "decode", "TE_TP_SIZE": "4", "TE_TP_RANK": "1"}
    cfg = EngineConfig.from_env(env, tp_size=2, tp_rank=None, nixl_params={"x": "y"})
    assert (cfg.role, cfg.tp_size, cfg.tp_rank, cfg.nixl_params) == ("decode", 2, 1, {"x": "y"})
    assert EngineConfig.from_env({}, role="prefill", nixl_params="a=1").nixl_params == {"a": "1"}


@pytest.mark.parametrize(
    ("text", "params"),
    [
        ("a=1,b=2", {"a": "1", "b": "2"}),
        ("", {}),
        (" a = 1 , , b=2,", {"a": "1", "b": "2"}),
        ("k=", {"k": ""}),
        ("url=x=y", {"url": "x=y"}),
        ("a=1,a=2", {"a": "2"}),
    ],
)
def test_nixl_params_parsing(text: str, params: dict[str, str]) -> None:
    assert EngineConfig.from_env({"TE_ROLE": "prefill", "TE_NIXL_PARAMS": text}).nixl_params == params


@pytest.mark.parametrize("text", ["a=1,b", "=1", "a=1, =2"])
def test_malformed_nixl_params(text: str) -> None:
    with pytest.raises(ConfigError, match="nixl_params item"):
        EngineConfig.from_env({"TE_ROLE": "prefill", "TE_NIXL_PARAMS": text})


@pytest.mark.parametrize(
    ("env", "field"),
    [
        ({"TE_TP_SIZE": "two"}, "tp_size"),
        ({"TE_TP_SIZE": "0"}, "tp_size"),
        ({"TE_TP_SIZE": "2", "TE_TP_RANK": "2"}, "tp_rank"),
        ({"TE_TP_RANK": "-1"}, "tp_rank"),
        ({"TE_ROLE": "router"}, "role"),
        ({"TE_PATH": "fast"}, "path"),
        ({"TE_STAGING_MEMORY": "disk"}, "staging_memory"),
        ({"TE_NUM_WORKERS": "0"}, "num_workers"),
        ({"TE_BOOTSTRAP_TIMEOUT": "0"}, "bootstrap_timeout"),
        ({"TE_TRANSFER_TIMEOUT": "-1"}, "transfer_timeout"),
        ({"TE_WAITING_TIMEOUT": "0"}, "waiting_timeout"),
        ({"TE_HEARTBEAT_INTERVAL": "0"}, "heartbeat_interval"),
        ({"TE_CONNECT_TIMEOUT": "soon"}, "connect_timeout"),
        ({"TE_POLL_INTERVAL": "0"}, "poll_interval"),
        ({"TE_RING_BYTES": "-1"}, "ring_bytes"),
        ({"TE_RING_BYTES": "1.5"}, "ring_bytes"),
        ({"TE_STAGING_BYTES": "-4096"}, "staging_bytes"),
        ({"TE_STAGING_CHUNK_PAGES": "0"}, "staging_chunk_pages"),
        ({"TE_CONTROL_PORT": "65536"}, "control_port"),
        ({"TE_BOOTSTRAP_PORT": "-1"}, "bootstrap_port"),
        ({"TE_HOST_BOOTSTRAP": "maybe"}, "host_bootstrap"),
    ],
)
def test_invalid_env_values_name_the_field(env: dict[str, str], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        EngineConfig.from_env({"TE_ROLE": "prefill", **env})


def test_missing_role_is_named() -> None:
    with pytest.raises(ConfigError, match="role"):
        EngineConfig.from_env({})


def test_unknown_override_is_named() -> None:
    with pytest.raises(ConfigError, match="ring_size"):
        EngineConfig.from_env({"TE_ROLE": "prefill"}, ring_size=4)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"role": "router"}, "role"),
        ({"tp_size": 0}, "tp_size"),
        ({"tp_size": 2, "tp_rank": 2}, "tp_rank"),
        ({"num_workers": 0}, "num_workers"),
        ({"path": "fast"}, "path"),
        ({"staging_memory": "disk"}, "staging_memory"),
        ({"transfer_timeout": 0.0}, "transfer_timeout"),
        ({"waiting_timeout": -1.0}, "waiting_timeout"),
        ({"poll_interval": 0.0}, "poll_interval"),
        ({"poll_relaxed": 0.0}, "poll_relaxed"),
        ({"ring_bytes": -1}, "ring_bytes"),
        ({"staging_bytes": -1}, "staging_bytes"),
        ({"staging_chunk_pages": 0}, "staging_chunk_pages"),
        ({"control_port": 70000}, "control_port"),
    ],
)
def test_direct_construction_validates(kwargs: dict[str, Any], field: str) -> None:
    args: dict[str, Any] = {"role": "prefill", **kwargs}
    with pytest.raises(ConfigError, match=rf"{field}="):
        EngineConfig(**args)


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="tp_size"):
        EngineConfig(role="prefill", tp_size=0)


def test_config_is_frozen() -> None:
    cfg = EngineConfig(role="prefill")
    with pytest.raises(AttributeError):
        cfg.tp_size = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "hosts"),
    [
        ({"role": "prefill"}, True),
        ({"role": "prefill", "tp_size": 2, "tp_rank": 1}, False),
        ({"role": "decode"}, False),
        ({"role": "prefill", "host_bootstrap": False}, False),
        ({"role": "decode", "host_bootstrap": True}, True),
    ],
)
def test_hosts_bootstrap(kwargs: dict[str, Any], hosts: bool) -> None:
    assert EngineConfig(**kwargs).hosts_bootstrap is hosts


# ---------------------------------------------------------------- CLI flags


def parser(skip: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--other", default="x")
    EngineConfig.add_arguments(p, skip=skip)
    return p


def test_every_field_has_a_flag_defaulting_to_none() -> None:
    args = parser().parse_args([])
    for name in EngineConfig.__struct_fields__:
        assert getattr(args, name) is None, name


def test_flags_parse_into_a_config() -> None:
    args = parser().parse_args(
        [
            "--role",
            "decode",
            "--tp-size",
            "2",
            "--tp-rank",
            "1",
            "--ring-bytes",
            "4096",
            "--nixl-params",
            "a=1,b=2",
            "--waiting-timeout",
            "3.5",
            "--host-bootstrap",
            "false",
        ]
    )
    cfg = EngineConfig.from_args(args)
    assert (cfg.role, cfg.tp_size, cfg.tp_rank, cfg.ring_bytes) == ("decode", 2, 1, 4096)
    assert cfg.nixl_params == {"a": "1", "b": "2"}
    assert cfg.waiting_timeout == 3.5
    assert cfg.host_bootstrap is False


def test_precedence_env_then_flags_then_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TE_ROLE", "prefill")
    monkeypatch.setenv("TE_TP_SIZE", "8")
    monkeypatch.setenv("TE_TP_RANK", "5")
    monkeypatch.setenv("TE_NUM_WORKERS", "3")
    args = parser().parse_args(["--tp-size", "4", "--tp-rank", "2"])
    cfg = EngineConfig.from_args(args, tp_rank=1)
    assert (cfg.role, cfg.tp_size, cfg.tp_rank, cfg.num_workers) == ("prefill", 4, 1, 3)


def test_bad_flag_value_names_the_field() -> None:
    args = parser().parse_args(["--role", "prefill", "--num-workers", "many"])
    with pytest.raises(ConfigError, match="num_workers"):
        EngineConfig.from_args(args)


def test_skipped_fields_have_no_flag() -> None:
    p = parser(skip=("role", "tp_rank"))
    args = p.parse_args([])
    assert not hasattr(args, "role") and not hasattr(args, "tp_rank")
    assert hasattr(args, "tp_size")
    _, unknown = p.parse_known_args(["--role", "decode", "--tp-size", "2"])
    assert unknown == ["--role", "decode"]
    assert EngineConfig.from_args(args, role="decode").role == "decode"


def test_from_args_ignores_foreign_arguments() -> None:
    args = parser().parse_args(["--role", "decode", "--other", "y"])
    assert EngineConfig.from_args(args).role == "decode"


def test_round_trips_through_msgspec() -> None:
    cfg = EngineConfig(role="decode", tp_size=2, tp_rank=1, nixl_params={"a": "1"}, waiting_timeout=4.0)
    assert msgspec.convert(msgspec.to_builtins(cfg), EngineConfig) == cfg


@pytest.mark.parametrize(
    ("backend", "params", "device", "expected"),
    [
        ("UCX", {}, "cuda", {"num_threads": "4", "split_batch_size": "16"}),
        ("UCX", {"x": "y"}, "cuda", {"x": "y", "num_threads": "4", "split_batch_size": "16"}),
        ("UCX", {"num_threads": "0"}, "cuda", {"num_threads": "0"}),
        ("UCX", {"num_threads": "2"}, "cuda", {"num_threads": "2"}),
        ("UCX", {}, "cpu", {}),
        ("LIBFABRIC", {}, "cuda", {}),
    ],
)
def test_posting_threads_by_default_on_gpu_pools_only(
    backend: str, params: dict[str, str], device: str, expected: dict[str, str]
) -> None:
    given = dict(params)
    assert default_params(backend, params, device) == expected
    assert params == given  # the config's own dict is not changed


CONFIGURATION = Path(__file__).resolve().parents[2] / "docs" / "CONFIGURATION.md"


def _table_rows() -> list[list[str]]:
    """The rows of docs/CONFIGURATION.md's field table (the one whose header starts ``| Field |``)."""
    lines = CONFIGURATION.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| Field |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return rows


def _default_cell(info: msgspec.structs.FieldInfo) -> str:
    if info.default is not msgspec.NODEFAULT:
        return f"`{info.default!r}`"
    if info.default_factory is not msgspec.NODEFAULT:
        return f"`{info.default_factory()!r}`"
    return "(required)"


def test_fields_are_users_or_tuners_in_the_class_order() -> None:
    """A new field goes into USER_FIELDS or TUNER_FIELDS (config.py) and into docs/CONFIGURATION.md."""
    assert USER_FIELDS + TUNER_FIELDS == EngineConfig.__struct_fields__


def test_configuration_doc_has_one_row_per_field_with_its_variable_default_and_group() -> None:
    rows = _table_rows()
    fields = msgspec.structs.fields(EngineConfig)
    documented, declared = [row[0] for row in rows], [f"`{info.name}`" for info in fields]
    assert documented == declared, f"docs/CONFIGURATION.md's table lacks or misplaces a field of {declared}"
    for row, info in zip(rows, fields, strict=True):
        assert len(row) == 5, row
        name, variable, default, who, meaning = row
        assert variable == f"`TE_{info.name.upper()}`", row
        assert default == _default_cell(info), row
        assert who == ("user" if info.name in USER_FIELDS else "tuner"), row
        assert meaning, row
