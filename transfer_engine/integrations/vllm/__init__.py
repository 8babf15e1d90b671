"""The vLLM KV connector (``KVConnectorBase_V1``) over this engine; see :mod:`.connector`."""
