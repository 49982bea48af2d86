"""Registration of the built-in classes (registered before any entry point)."""

from __future__ import annotations

from ..hookspecs import hookimpl
from .estimators import ExactAttention, FeatureMapAttention
from .feature_maps import EluFeatureMap
from .kernels import SoftmaxKernel
from .normalizers import RowNormalizer, SignedRowNormalizer


@hookimpl
def kernelattn_kernels():  # type: ignore[no-untyped-def]
    return [SoftmaxKernel]


@hookimpl
def kernelattn_feature_maps():  # type: ignore[no-untyped-def]
    return [EluFeatureMap]


@hookimpl
def kernelattn_normalizers():  # type: ignore[no-untyped-def]
    return [RowNormalizer, SignedRowNormalizer]


@hookimpl
def kernelattn_estimators():  # type: ignore[no-untyped-def]
    return [ExactAttention, FeatureMapAttention]
