"""The vLLM KV connector (``KVConnectorBase_V1``) over this engine; see :mod:`.connector`.

:func:`pool_from_vllm` (``layouts.py``) makes the engine's pool over the KV caches a vLLM rank
registered, whatever the attention backend's layout; vLLM itself is not imported.
"""

from .layouts import VllmKV, pool_from_vllm

__all__ = ["VllmKV", "pool_from_vllm"]
