"""Registration of the hybrid plugin (entry point ``hybrid``)."""

from __future__ import annotations

from kernelattn_core import hookimpl

from .estimator import SlidingWindowAttention
from .hedgehog import HedgehogFeatureMap


@hookimpl
def kernelattn_feature_maps():  # type: ignore[no-untyped-def]
    return [HedgehogFeatureMap]


@hookimpl
def kernelattn_estimators():  # type: ignore[no-untyped-def]
    return [SlidingWindowAttention]
