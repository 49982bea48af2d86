"""kernelattn-example: the tutorial plugin."""

from .feature_map import AntitheticPRF

__all__ = ["AntitheticPRF"]
