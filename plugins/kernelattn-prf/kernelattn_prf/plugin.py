"""Registration of the kernelattn-prf classes (entry point ``prf``)."""

from __future__ import annotations

from kernelattn_core import hookimpl

from .feature_maps import (
    ComplexExponentialFeatures,
    HyperbolicComplexExponentialFeatures,
    HyperbolicPositiveRandomFeatures,
    PositiveRandomFeatures,
)


@hookimpl
def kernelattn_feature_maps():  # type: ignore[no-untyped-def]
    return [
        PositiveRandomFeatures,
        HyperbolicPositiveRandomFeatures,
        ComplexExponentialFeatures,
        HyperbolicComplexExponentialFeatures,
    ]


@hookimpl
def kernelattn_experiments():  # type: ignore[no-untyped-def]
    from .experiments import CEXP_EXPERIMENT

    return [CEXP_EXPERIMENT]
