"""Actors of the engine: one module per actor (DESIGN §7)."""
