"""The connector's settings: ``engine_cpus`` is checked before any engine starts."""

from __future__ import annotations

import os
import warnings

import pytest

from transfer_engine.errors import ConfigError

with warnings.catch_warnings():  # vLLM's own imports warn about torch APIs it uses (warnings are errors here)
    warnings.simplefilter("ignore", DeprecationWarning)
    from transfer_engine.integrations.vllm.connector import engine_cpus

pytestmark = pytest.mark.timeout(60)


def test_engine_cpus_default_is_every_cpu_and_a_list_is_kept() -> None:
    assert engine_cpus(None) == frozenset(range(os.cpu_count() or 1))
    assert engine_cpus([1, 0]) == frozenset({0, 1})


@pytest.mark.parametrize("bad", [[], "0-1", [0, -1], [0, 1.0], [True], 3])
def test_engine_cpus_rejects_anything_but_cpu_ids_naming_the_value(bad: object) -> None:
    with pytest.raises(ConfigError, match="engine_cpus="):
        engine_cpus(bad)
