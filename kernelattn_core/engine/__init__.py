"""The attention engine: the public entry point, backends and references.

* ``api.py``: :func:`kernel_attention`.
* ``backends.py``: backends described by data, chosen at run time.
* ``torch_backend.py``: the linear-time torch implementation (non-causal and chunked causal).
* ``naive.py``: quadratic references that every fast path is tested against.
"""

from .api import kernel_attention
from .backends import Backend, Problem, backends, register_backend, select_backend
from .torch_backend import CausalState

__all__ = ["Backend", "CausalState", "Problem", "backends", "kernel_attention", "register_backend", "select_backend"]
