"""kernelattn-hybrid: the learned ``hedgehog`` feature map and ``sliding-window``
attention (exact local softmax + feature map outside the window, one normaliser)."""

from .estimator import SlidingWindowAttention
from .hedgehog import HedgehogFeatureMap

__all__ = ["HedgehogFeatureMap", "SlidingWindowAttention"]
