"""The attention engine: the public entry point, backends and references.

* ``api.py``: :func:`kernel_attention`.
* ``backends.py``: backends described by data, chosen at run time.
* ``grouped.py``: how the torch backend runs: features and attention per group of
  positions, with its own backward (no whole-sequence feature tensor, forward or backward).
* ``torch_backend.py``: feature attention on given features (non-causal, and the causal
  preparation: masks, non-finite quarantine, stabilisers); decoding state.
* ``chunked.py``: the vectorised causal core and its transposed recurrence.
* ``naive.py``: quadratic references that every fast path is tested against.
"""

from .api import kernel_attention
from .backends import Backend, Problem, backends, register_backend, select_backend
from .torch_backend import CausalState

__all__ = ["Backend", "CausalState", "Problem", "backends", "kernel_attention", "register_backend", "select_backend"]
