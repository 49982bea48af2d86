"""kernelattn-hybrid: the learned ``hedgehog`` feature map and ``sliding-window``
attention (exact local softmax + feature map outside the window, one normaliser; with
``heavy_keys``, each head's most attended keys exact too)."""

from .estimator import SlidingWindowAttention
from .heavy import HeavyKeys, estimated_key_mass, select_heavy_keys
from .hedgehog import HedgehogFeatureMap

__all__ = ["HeavyKeys", "HedgehogFeatureMap", "SlidingWindowAttention", "estimated_key_mass", "select_heavy_keys"]
