"""Name lookup for the core's own modules, without importing the registry.

The interfaces and the built-in estimators need to turn a registry name into a class
(``FeatureMap.target_kernel``, ``ExactAttention("gaussian")``). Importing the registry
there would close a circle (the registry imports the interfaces and the built-ins), so
the dependency is inverted: :mod:`kernelattn_core.registry` installs a resolver here
when it is imported, and the rest of the core calls :func:`resolve`. When nothing is
installed yet (``import kernelattn_core`` is lazy and does not load the registry), the
first lookup loads the default registry: this module is the one place below the
registry that may name it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import KernelAttnError

#: ``resolver(name, kind)`` gives the registry entry (``.name``, ``.kind``, ``.cls``)
_resolver: Callable[[str, str | None], Any] | None = None


def install_resolver(resolver: Callable[[str, str | None], Any]) -> None:
    """Make ``resolver(name, kind)`` the lookup used by the core (the registry calls this)."""
    global _resolver
    _resolver = resolver


def resolve(name: str, kind: str | None = None) -> Any:
    """The registry entry of ``name`` (optionally of one ``kind``: ``"kernel"``,
    ``"feature_map"``, ``"normalizer"``, ``"estimator"``); raises
    :class:`~kernelattn_core.errors.UnknownNameError` listing the available names."""
    if _resolver is None:
        from . import registry  # noqa: F401  # installs the default resolver on import
    if _resolver is None:  # pragma: no cover - registry.py always installs one
        raise KernelAttnError(f"no registry is installed to look up {name!r}")
    return _resolver(name, kind)


def resolve_class(name: str, kind: str) -> type:
    """The class registered as ``name`` of ``kind``."""
    return resolve(name, kind).cls
