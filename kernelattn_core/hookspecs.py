"""The hook specification: every hook a kernelattn plugin may implement.

A plugin is a module (or any object) with functions marked by
:data:`kernelattn_core.hookimpl`, exposed through the ``kernelattn`` entry-point
group::

    [project.entry-points.kernelattn]
    myplugin = "my_package.plugin"

Each hook is called once per plugin when the registry is built (built-ins first,
then entry points: the shipped plugins first, then the others, each in name order).
Every hook returns a list of classes; all answers are collected (no
first-result-wins). Each class carries a unique registry ``name``
(lower case letters, digits and ``-``), unique across all four kinds so that
:func:`kernelattn_core.create` can resolve any name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from .experiments import Experiment
    from .interfaces import AttentionEstimator, FeatureMap, Kernel, Normalizer

PROJECT = "kernelattn"

#: Version of the plugin specification (hooks, interface contracts, claims) this core
#: provides, ``"MAJOR.MINOR"``. A plugin states the version it was written against with a
#: module-level ``KERNELATTN_SPEC = "1.1"`` beside its hook implementations (no statement:
#: ``"1.0"``, the first published spec); it loads when the major versions agree and its
#: minor version is not newer than the core's. Within a major version nothing a plugin
#: relies on is removed without a deprecation: see ``spec/plugins.rst`` (versions and
#: deprecation policy).
SPEC_VERSION = "1.1"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def kernelattn_kernels() -> list[type[Kernel]]:
    """Return the :class:`~kernelattn_core.interfaces.Kernel` subclasses the plugin provides.

    Called once when the registry is built. Each class must be a concrete subclass of
    ``Kernel`` with a unique ``name``; a :class:`~kernelattn_core.interfaces.DotProductKernel`
    must also implement ``f``, ``sympy_expr`` and ``coefficient``.
    """


@hookspec
def kernelattn_feature_maps() -> list[type[FeatureMap]]:
    """Return the :class:`~kernelattn_core.interfaces.FeatureMap` subclasses the plugin provides.

    Called once when the registry is built. Each class declares its capability data
    (``kernel``, ``unbiased``, ``positive``, ``learnable``, ``random``, ``log_space``)
    at class level; ``kernel``, when set, must name a registered kernel.
    """


@hookspec
def kernelattn_normalizers() -> list[type[Normalizer]]:
    """Return the :class:`~kernelattn_core.interfaces.Normalizer` subclasses the plugin provides.

    Called once when the registry is built. A normaliser must be invariant to a
    common positive per-query factor of ``num`` and ``den``.
    """


@hookspec
def kernelattn_estimators() -> list[type[AttentionEstimator]]:
    """Return the :class:`~kernelattn_core.interfaces.AttentionEstimator` subclasses the plugin provides.

    Called once when the registry is built. Use this for estimators that are not a
    feature map plus a normaliser (importance sampling, presets). Every estimator
    takes ``num_features`` as its budget option when ``has_budget`` is true.
    """


@hookspec
def kernelattn_experiments() -> list[Experiment]:
    """Return :class:`~kernelattn_core.experiments.Experiment` records: reproductions of
    a paper's experiments, run as ``kernelattn experiment NAME [options]``.

    Called once when the registry is built; names are unique across plugins.
    """
