"""kernelattn-core: interfaces, plugin registry and engine of kernelized attention.

Public vocabulary
-----------------
:func:`create`, :func:`list_plugins`, :func:`kernel_attention`, :class:`KernelAttention`,
:func:`convert_attention`, :func:`distill_attention`,
:data:`hookimpl`, and the interfaces :class:`Kernel`, :class:`FeatureMap`,
:class:`Normalizer`, :class:`AttentionEstimator`.
"""

from .api import create, list_plugins
from .builtins import (
    EluFeatureMap,
    ExactAttention,
    FeatureMapAttention,
    RowNormalizer,
    SignedRowNormalizer,
    SoftmaxKernel,
)
from .convert import convert_attention, distill_attention
from .engine import kernel_attention
from .errors import DomainError, InputError, KernelAttnError, PluginError, PluginWarning, UnknownNameError
from .hookspecs import hookimpl
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
