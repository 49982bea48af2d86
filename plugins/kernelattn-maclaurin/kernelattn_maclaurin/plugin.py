"""Registration of the maclaurin plugin's classes (nothing else happens here)."""

from __future__ import annotations

from kernelattn_core import hookimpl

from .estimators import RMFA, SchoenbAt
from .feature_maps import RandomMaclaurinFeatures
from .kernels import KERNELS
from .normalizers import PPSBN


@hookimpl
def kernelattn_kernels():  # type: ignore[no-untyped-def]
    return list(KERNELS)


@hookimpl
def kernelattn_feature_maps():  # type: ignore[no-untyped-def]
    return [RandomMaclaurinFeatures]


@hookimpl
def kernelattn_normalizers():  # type: ignore[no-untyped-def]
    return [PPSBN]


@hookimpl
def kernelattn_estimators():  # type: ignore[no-untyped-def]
    return [RMFA, SchoenbAt]


@hookimpl
def kernelattn_experiments():  # type: ignore[no-untyped-def]
    from .experiments import EXPERIMENTS

    return list(EXPERIMENTS)
