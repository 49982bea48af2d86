"""Registration of the kernelattn-sampling classes (entry point ``sampling``)."""

from __future__ import annotations

from kernelattn_core import hookimpl

from .estimators import RFASNIS, LinearRandomizedAttention, RandomizedAttention, RandomizedAttentionBiased


@hookimpl
def kernelattn_estimators():  # type: ignore[no-untyped-def]
    return [RandomizedAttention, RandomizedAttentionBiased, RFASNIS, LinearRandomizedAttention]


@hookimpl
def kernelattn_experiments():  # type: ignore[no-untyped-def]
    from .experiments import LARA_EFFICIENCY

    return [LARA_EFFICIENCY]
