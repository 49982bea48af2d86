"""Registration: the only module the ``kernelattn`` entry point names."""

from kernelattn_core import hookimpl

from .feature_map import AntitheticPRF


@hookimpl
def kernelattn_feature_maps():
    return [AntitheticPRF]
