"""Registration: the module a ``kernelattn`` entry point would name (no KERNELATTN_SPEC: 1.0)."""

from kernelattn_core import hookimpl

from .classes import CoshKernel, LogPRF, SampledAttention, SelfNormalisedPRF, SoftPlusMap


@hookimpl
def kernelattn_kernels():
    return [CoshKernel]


@hookimpl
def kernelattn_feature_maps():
    return [LogPRF, SoftPlusMap]


@hookimpl
def kernelattn_estimators():
    return [SampledAttention, SelfNormalisedPRF]
