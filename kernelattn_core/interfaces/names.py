"""How the classes below the registry receive what a *name* stands for.

Names (``"gaussian"``, ``"row"``) are resolved by the registry
(:func:`kernelattn_core.registry.resolve`) and by :func:`kernelattn_core.create`, which
hands classes and instances to the estimators it builds: on that path nothing below the
registry looks a name up. Two older spellings still carry a name below it, and this
module is where they meet the registry without importing it (the registry sits above the
interfaces):

* a constructor given a name directly (``ExactAttention("gaussian")``,
  ``FeatureMapAttention("rff", normalizer="row")``);
* a feature map that declares its target only by name (``kernel = "softmax"``, spec 1.0/1.1)
  and no :attr:`~kernelattn_core.interfaces.FeatureMap.target_kernel_class`.

:mod:`kernelattn_core.registry` installs its lookup here when it is imported (and
``import kernelattn_core`` imports it before handing out any class that takes names);
this module never imports the registry, so the import graph has no circle.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ..errors import InputError, KernelAttnError

#: ``resolver(name, kind)`` gives the registry entry (``.name``, ``.kind``, ``.cls``)
_resolver: Callable[[str, str | None], Any] | None = None


def install_resolver(resolver: Callable[[str, str | None], Any]) -> None:
    """Make ``resolver(name, kind)`` the lookup of names given below the registry (the
    registry installs its own when it is imported)."""
    global _resolver
    _resolver = resolver


def resolve_class(name: str, kind: str) -> type:
    """The class registered as ``name`` of ``kind``, through the installed registry.

    Raises
    ------
    KernelAttnError
        When no registry is loaded yet (import :mod:`kernelattn_core.registry`, or build the
        object with :func:`kernelattn_core.create`, which resolves names itself).
    """
    if _resolver is None:
        raise KernelAttnError(
            f"cannot resolve the {kind.replace('_', ' ')} name {name!r}: no registry is loaded; use "
            f"kernelattn_core.create(...) or import kernelattn_core.registry first, or pass a class or instance"
        )
    return _resolver(name, kind).cls


def construct(kind: str, cls: type, owner: str, options: dict[str, Any]) -> Any:
    """``cls(**options)`` with an error that names unknown options and the accepted ones.

    Parameters
    ----------
    kind : str
        What ``cls`` is, for the message (``"estimator"``, ``"feature map"``).
    cls : type
        The class to build.
    owner : str
        Who asks, for the message (``"create('prf')"``).
    options : dict
        Keyword arguments for ``cls``.

    Raises
    ------
    InputError
        An option ``cls.__init__`` does not accept, listing the accepted ones.
    """
    if cls.__init__ is object.__init__:  # a class without options: (self, /, *args, **kwargs) would accept anything
        params: dict[str, inspect.Parameter] = {}
        accepts_any = False
    else:
        params = dict(inspect.signature(cls.__init__).parameters)
        accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if not accepts_any:
        accepted = [n for n, p in params.items() if n != "self" and p.kind is not inspect.Parameter.VAR_POSITIONAL]
        unknown = sorted(set(options) - set(accepted))
        if unknown and not accepted:
            raise InputError(
                f"{owner}: {kind} {getattr(cls, 'name', cls.__name__)!r} takes no options, got option(s) {unknown}"
            )
        if unknown:
            raise InputError(
                f"{owner}: unknown option(s) {unknown} for {kind} {getattr(cls, 'name', cls.__name__)!r}; "
                f"accepted options: {accepted}"
            )
    return cls(**options)


__all__ = ["construct", "install_resolver", "resolve_class"]
