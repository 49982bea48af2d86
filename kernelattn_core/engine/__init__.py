"""The attention engine: backends, the grouped and chunked causal paths, references.

:func:`~kernelattn_core.kernel_attention`, the public entry point, is defined at the top
level (:mod:`kernelattn_core.api`, beside ``create``); ``kernelattn_core.engine.kernel_attention``
and ``kernelattn_core.engine.api`` still resolve to it (deprecated). Sequence-parallel
attention is :mod:`kernelattn_core.distributed`.

* ``backends.py``: backends described by data, chosen at run time.
* ``grouped.py``: how the torch backend runs: features and attention per group of
  positions, with its own backward (no whole-sequence feature tensor, forward or backward).
* ``torch_backend.py``: feature attention on given features (non-causal, and the causal
  preparation: masks, non-finite quarantine, stabilisers); decoding state.
* ``chunked.py``: the vectorised causal core and its transposed recurrence.
* ``naive.py``: quadratic references that every fast path is tested against.
"""

from typing import Any

from .backends import Backend, Problem, backends, register_backend, select_backend
from .chunked import CausalState

__all__ = ["Backend", "CausalState", "Problem", "backends", "register_backend", "select_backend"]


def __getattr__(name: str) -> Any:
    if name == "kernel_attention":  # moved to kernelattn_core.api; the alias module warns
        from . import api

        return api.kernel_attention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
