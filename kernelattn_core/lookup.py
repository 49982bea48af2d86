"""Deprecated: name lookup now lives in :mod:`kernelattn_core.registry`.

``kernelattn_core.lookup.resolve``, ``resolve_class`` and ``install_resolver`` still work
and warn with a :class:`DeprecationWarning` when used from outside the core; use
``kernelattn_core.registry.resolve`` / ``resolve_class`` (or, in a plugin,
:mod:`kernelattn_core.toolkit`). It imports the registry on first use.
"""

from __future__ import annotations

import sys
import warnings

_MOVED = ("install_resolver", "resolve", "resolve_class")


def __getattr__(name: str) -> object:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    caller = sys._getframe(1).f_globals.get("__name__", "")
    if not (caller == "kernelattn_core" or caller.startswith("kernelattn_core.")):
        warnings.warn(
            f"kernelattn_core.lookup.{name} is deprecated (spec 1.1's additions): use kernelattn_core.registry.{name}, "
            f"or kernelattn_core.toolkit in a plugin",
            DeprecationWarning,
            stacklevel=2,
        )
    from . import registry

    return getattr(registry, name)


def __dir__() -> list[str]:
    return sorted(_MOVED)
