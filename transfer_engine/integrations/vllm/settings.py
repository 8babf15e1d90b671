"""The vLLM connector's engine settings: the connector's defaults, ``TE_*`` variables and
``kv_connector_extra_config`` merged into one rank's :class:`~transfer_engine.EngineConfig`, with
data-parallel ports placed (docs/vllm.md), and the connector-only ``engine_cpus``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from transfer_engine import EngineConfig
from transfer_engine.errors import ConfigError

__all__ = [
    "CONNECTOR_DEFAULTS",
    "CONNECTOR_ONLY",
    "MIN_ROOMS",
    "SET_BY_VLLM",
    "default_max_rooms",
    "engine_config",
    "engine_cpus",
]

CONNECTOR_DEFAULTS: dict[str, Any] = {
    "heartbeat_interval": 5.0,
    "connect_timeout": 30.0,
    "bootstrap_timeout": 120.0,
    "layers_per_write": 4,
}
"""Engine settings the connector picks unless ``TE_*`` variables or ``kv_connector_extra_config``
say otherwise: a peer is dead after two silent heartbeat intervals, and the first handshake may
take long, as vLLM's worker can hold the GIL for seconds on a loaded CPU box; a decode may take
``bootstrap_timeout`` to reach its prefill at all. A room waiting on a live peer is bounded by the
engine's ``room_lease`` (30 s), which the peer's heartbeats renew (docs/vllm.md)."""

MIN_ROOMS = 256
"""The fewest rooms (``max_rooms``) the connector gives an engine unless told otherwise."""


def default_max_rooms(max_num_seqs: int) -> int:
    """``max_rooms`` unless set: twice ``--max-num-seqs``, and at least :data:`MIN_ROOMS`, since
    vLLM's requests waiting for their KV do not count against ``--max-num-seqs`` (with
    ``--max-num-seqs 1`` a decode had three requests waiting on a busy prefill, each with a room)."""
    return max(2 * max_num_seqs, MIN_ROOMS)


CONNECTOR_ONLY = frozenset({"engine_cpus"})
SET_BY_VLLM = frozenset({"role", "tp_size", "tp_rank"})


def engine_cpus(value: object) -> frozenset[int]:
    """The CPUs the engine thread may run on: ``kv_connector_extra_config["engine_cpus"]`` (a list of
    CPU ids), or every CPU of the machine when unset (the kernel keeps only those the process's
    cpuset allows). Raises ConfigError naming a value that is not a non-empty list of CPU ids."""
    if value is None:
        return frozenset(range(os.cpu_count() or 1))
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in value)
    ):
        raise ConfigError(f"engine_cpus={value!r}: give a non-empty list of CPU ids, e.g. [2, 3]")
    return frozenset(value)


def engine_config(
    extra: Mapping[str, Any],
    environ: Mapping[str, str],
    *,
    is_prefill: bool,
    tp_size: int,
    tp_rank: int,
    dp_rank: int = 0,
    max_rooms: int = 4096,
) -> EngineConfig:
    """One rank's engine settings: :data:`CONNECTOR_DEFAULTS` (and ``max_rooms``), overridden by
    ``TE_<FIELD>`` variables in ``environ``, overridden by ``extra`` (``kv_connector_extra_config``);
    ``bootstrap_host`` defaults to ``host``. Data-parallel rank ``dp_rank`` binds ``bootstrap_port
    + dp_rank``; a non-zero ``introspect_port``/``metrics_port`` is offset by ``dp_rank * tp_size +
    tp_rank``. ConfigError names a key that is neither an engine setting nor ``engine_cpus``, one
    that vLLM sets, or a bad value."""
    fields = EngineConfig.__struct_fields__
    for key in extra:
        if key in SET_BY_VLLM:
            raise ConfigError(
                f"kv_connector_extra_config key {key!r}: vLLM sets it (kv_role, TP size and rank)"
            )
        if key not in fields and key not in CONNECTOR_ONLY:
            raise ConfigError(
                f"kv_connector_extra_config key {key!r} is not an engine setting (EngineConfig)"
            )
    from_env = {
        name: environ["TE_" + name.upper()]
        for name in fields
        if "TE_" + name.upper() in environ and name not in SET_BY_VLLM
    }
    ours = {k: v for k, v in extra.items() if k in fields}
    raw: dict[str, Any] = {**CONNECTOR_DEFAULTS, "max_rooms": max_rooms, **from_env, **ours}
    fixed = {"role": "prefill" if is_prefill else "decode", "tp_size": tp_size, "tp_rank": tp_rank}
    base = EngineConfig.from_env({}, **raw, **fixed)
    rank = dp_rank * tp_size + tp_rank
    placed: dict[str, Any] = {"bootstrap_port": base.bootstrap_port + dp_rank}
    if "bootstrap_host" not in from_env and "bootstrap_host" not in ours:
        placed["bootstrap_host"] = base.host
    if base.introspect_port:
        placed["introspect_port"] = base.introspect_port + rank
    if base.metrics_port:
        placed["metrics_port"] = base.metrics_port + rank
    return EngineConfig.from_env({}, **{**raw, **placed, **fixed})
