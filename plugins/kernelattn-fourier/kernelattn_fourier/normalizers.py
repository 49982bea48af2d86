"""The ``signed-row`` normaliser lives in the core (any map with signed features uses it);
re-exported here for the code that imported it from this plugin."""

from kernelattn_core.toolkit import SignedRowNormalizer

__all__ = ["SignedRowNormalizer"]
