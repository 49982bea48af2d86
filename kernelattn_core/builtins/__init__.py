"""Classes built into the core: the softmax kernel, exact attention, the
``elu(x)+1`` feature map, the row normaliser and feature-map attention."""

from .estimators import ExactAttention, FeatureMapAttention
from .feature_maps import EluFeatureMap
from .kernels import SoftmaxKernel
from .normalizers import RowNormalizer, SignedRowNormalizer

__all__ = [
    "EluFeatureMap",
    "ExactAttention",
    "FeatureMapAttention",
    "RowNormalizer",
    "SignedRowNormalizer",
    "SoftmaxKernel",
]
