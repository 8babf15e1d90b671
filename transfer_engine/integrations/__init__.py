"""Adapters that plug the engine into serving systems; each lives in its own subpackage and imports
its serving system only there, so ``import transfer_engine`` never needs one installed."""
