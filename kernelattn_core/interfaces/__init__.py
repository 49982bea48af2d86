"""Abstract interfaces that plugins subclass: kernels, feature maps, normalizers
and attention estimators. ``spec/`` states each contract in prose."""

from .estimator import AttentionEstimator
from .feature_map import FeatureMap, FusedFeatureSpec
from .kernel import DotProductKernel, Kernel, KernelFamily, ShiftInvariantKernel
from .normalizer import Normalizer

__all__ = [
    "AttentionEstimator",
    "DotProductKernel",
    "FeatureMap",
    "FusedFeatureSpec",
    "Kernel",
    "KernelFamily",
    "Normalizer",
    "ShiftInvariantKernel",
]
