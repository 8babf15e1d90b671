"""Actors of the engine: one module per actor (docs/ARCHITECTURE.md)."""
