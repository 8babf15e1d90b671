"""SGLang transfer backend: ``--disaggregation-transfer-backend transfer_engine``.

:class:`KVManager`, :class:`KVSender`, :class:`KVReceiver` and :class:`KVBootstrapServer`
subclass SGLang's own base classes (``sglang.srt.disaggregation.base.conn``) and follow their
contract; :func:`register` is the ``sglang.srt.plugins`` entry point that makes SGLang select them.
Importing this package imports SGLang's base module (the ``sglang`` extra).
"""

from transfer_engine.integrations.sglang.conn import KVBootstrapServer, KVManager, KVReceiver, KVSender
from transfer_engine.integrations.sglang.plugin import BACKEND, register

__all__ = ["BACKEND", "KVBootstrapServer", "KVManager", "KVReceiver", "KVSender", "register"]
