"""Registration of the ``fourier`` plugin (entry point ``fourier``)."""

from __future__ import annotations

from kernelattn_core import hookimpl

from .estimators import RFAAttention, RFAGateAttention, TrigSoftmaxAttention
from .feature_maps import RandomFourierFeatures, RFAFeatures, TrigSoftmaxFeatures
from .kernels import GaussianKernel, LaplacianKernel, MaternKernel


@hookimpl
def kernelattn_kernels() -> list[type]:
    return [GaussianKernel, LaplacianKernel, MaternKernel]


@hookimpl
def kernelattn_feature_maps() -> list[type]:
    return [RandomFourierFeatures, TrigSoftmaxFeatures, RFAFeatures]


@hookimpl
def kernelattn_estimators() -> list[type]:
    return [TrigSoftmaxAttention, RFAAttention, RFAGateAttention]
