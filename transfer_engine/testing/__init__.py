"""Helpers shared by the tests, tools and examples: in-process clusters and free ports (:mod:`.cluster`), and deterministic KV contents so every received byte is checked (:mod:`.patterns`)."""
