"""Registration: the only module the ``kernelattn`` entry point names."""

from kernelattn_core import hookimpl

from .feature_map import AntitheticPRF

#: the plugin spec this plugin is written against (spec/plugins.rst, "Versions"); a core
#: providing another major version, or an older minor one, refuses to load it
KERNELATTN_SPEC = "1.1"


@hookimpl
def kernelattn_feature_maps():
    return [AntitheticPRF]
