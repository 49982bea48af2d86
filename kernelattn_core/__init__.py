"""kernelattn-core: interfaces, plugin registry and engine of kernelized attention.

Public vocabulary
-----------------
:func:`create`, :func:`list_plugins`, :func:`kernel_attention`, :class:`KernelAttention`,
:func:`convert_attention`, :func:`distill_attention`,
:data:`hookimpl`, and the interfaces :class:`Kernel`, :class:`FeatureMap`,
:class:`Normalizer`, :class:`AttentionEstimator`.
"""

from typing import TYPE_CHECKING

from .errors import DomainError, InputError, KernelAttnError, PluginError, PluginWarning, ReplayError, UnknownNameError
from .hookspecs import hookimpl

# Everything that needs torch is imported on first use (PEP 562), so that
# ``kernelattn --help`` and the CLI's argument parsing answer without importing torch.
_LAZY = {
    "create": "api",
    "list_plugins": "api",
    "EluFeatureMap": "builtins",
    "ExactAttention": "builtins",
    "FeatureMapAttention": "builtins",
    "RowNormalizer": "builtins",
    "SignedRowNormalizer": "builtins",
    "SoftmaxKernel": "builtins",
    "kernel_attention": "api",
    "convert_attention": "convert",
    "distill_attention": "convert",
    "AttentionEstimator": "interfaces",
    "DotProductKernel": "interfaces",
    "FeatureMap": "interfaces",
    "Kernel": "interfaces",
    "KernelFamily": "interfaces",
    "Normalizer": "interfaces",
    "ShiftInvariantKernel": "interfaces",
    "KernelAttention": "module",
    "RedrawPolicy": "redraw",
    "Registry": "registry",
    "get_registry": "registry",
    "reload_plugins": "registry",
}

if TYPE_CHECKING:
    from .api import create, kernel_attention, list_plugins
    from .builtins import (
        EluFeatureMap,
        ExactAttention,
        FeatureMapAttention,
        RowNormalizer,
        SignedRowNormalizer,
        SoftmaxKernel,
    )
    from .convert import convert_attention, distill_attention
    from .interfaces import (
        AttentionEstimator,
        DotProductKernel,
        FeatureMap,
        Kernel,
        KernelFamily,
        Normalizer,
        ShiftInvariantKernel,
    )
    from .module import KernelAttention
    from .redraw import RedrawPolicy
    from .registry import Registry, get_registry, reload_plugins

__all__ = [
    "AttentionEstimator",
    "DomainError",
    "DotProductKernel",
    "EluFeatureMap",
    "ExactAttention",
    "FeatureMap",
    "FeatureMapAttention",
    "InputError",
    "Kernel",
    "KernelAttention",
    "KernelAttnError",
    "KernelFamily",
    "Normalizer",
    "PluginError",
    "PluginWarning",
    "RedrawPolicy",
    "Registry",
    "ReplayError",
    "RowNormalizer",
    "ShiftInvariantKernel",
    "SignedRowNormalizer",
    "SoftmaxKernel",
    "UnknownNameError",
    "convert_attention",
    "create",
    "distill_attention",
    "get_registry",
    "hookimpl",
    "kernel_attention",
    "list_plugins",
    "reload_plugins",
]


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    # the registry first: it installs the name lookup that constructors given a name
    # (``ExactAttention("gaussian")``) use below it (see kernelattn_core.interfaces.names)
    from . import registry  # noqa: F401

    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
