"""Our vLLM connector with its notifications slowed: for the tests of routing by the transfer cost.

vLLM loads it by ``kv_connector_module_path="tests.vllm.slowed_connector"`` and
``kv_connector="SlowedConnector"`` (the server's working directory is the repository's root). Its
engine's transport is the real one wrapped in the fault-injecting transport: every KV chunk's
notification is delivered ``SLOWED_DELAY_S`` seconds (the variable) late, as a congested link would
make it, so each room on this instance ends that much later and its engine measures a lower rate.
The bytes still move over NIXL, and the room still checks them. The agent is named by the
connector's ``agent_name`` setting, which the test sets.
"""

from __future__ import annotations

import os

from transfer_engine import EngineConfig
from transfer_engine.errors import ConfigError
from transfer_engine.integrations.vllm.connector import TransferEngineConnector
from transfer_engine.protocol import messages as m
from transfer_engine.transport.faults import Fault, FaultyTransport, Rule, matching
from transfer_engine.transport.nixl import NixlTransport, default_params

DELAY_VARIABLE = "SLOWED_DELAY_S"


class SlowedConnector(TransferEngineConnector):
    """:class:`TransferEngineConnector` whose engine's NIXL notifications of KV chunks come late."""

    def make_transport(self, config: EngineConfig) -> FaultyTransport:
        if config.agent_name is None:
            raise ConfigError("SlowedConnector needs agent_name in kv_connector_extra_config")
        delay = float(os.environ[DELAY_VARIABLE])
        late = Rule(Fault.DELAY, match=matching(m.ChunkLanded), times=None, delay_s=delay)
        params = default_params(config.nixl_backend, config.nixl_params, "cpu")
        nixl = NixlTransport(
            config.agent_name, config.nixl_backend, params, progress_thread=config.nixl_progress_thread
        )
        return FaultyTransport(nixl, notifs=[late])
