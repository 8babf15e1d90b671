"""The bootstrap registry SGLang runs beside the prefill's HTTP server."""

from __future__ import annotations

from sglang.srt.disaggregation.base.conn import BaseKVBootstrapServer

from transfer_engine import Curve, EngineConfig
from transfer_engine.facade import BootstrapServer
from transfer_engine.integrations.sglang.settings import WILDCARD_LOOPBACK

__all__ = ["KVBootstrapServer"]


class KVBootstrapServer(BaseKVBootstrapServer):
    """The bootstrap registry at ``tcp://host:port`` (:class:`~transfer_engine.facade.BootstrapServer`).

    Prefill ranks register their control endpoints here; decode ranks ask it for the prefill
    instance's topology. ``close()`` stops it and joins its thread. CURVE keys come from the
    ``TE_CURVE_*`` variables, as for the engines.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        curve = Curve.from_config(EngineConfig.from_env(role="prefill"))
        self._server = BootstrapServer(host, port, curve=curve)
        self._server.start()
        self.port = self._server.port

    @property
    def endpoint(self) -> str:
        return f"tcp://{WILDCARD_LOOPBACK.get(self.host, self.host)}:{self.port}"

    def close(self) -> None:
        self._server.stop()
