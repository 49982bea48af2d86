"""kernelattn-maclaurin: random Maclaurin features for dot-product kernels, RMFA, and
SchoenbAt / Macformer attention (ppSBN + RMFA).

Registry names: kernels ``exp``, ``inv``, ``logi``, ``trigh``, ``sqrt``, ``polynomial``;
feature map ``rmf``; normalizer ``ppsbn``; estimators ``rmfa`` and ``schoenbat``
(alias ``macformer``); experiments ``rmfa-error`` and ``rmfa-speed``.
"""

from .estimators import RMFA, SchoenbAt
from .feature_maps import RandomMaclaurinFeatures, degree_distribution, derive_expectation
from .kernels import (
    PAPER_TABLE_1,
    ExpKernel,
    InvKernel,
    LogiKernel,
    PolynomialKernel,
    SqrtKernel,
    TrighKernel,
    UserKernel,
)
from .normalizers import PPSBN
from .sampling import DegreeDistribution
from .variance import InfiniteVarianceWarning, fourth_moment, rmf_variance

__all__ = [
    "PAPER_TABLE_1",
    "PPSBN",
    "RMFA",
    "DegreeDistribution",
    "ExpKernel",
    "InfiniteVarianceWarning",
    "InvKernel",
    "LogiKernel",
    "PolynomialKernel",
    "RandomMaclaurinFeatures",
    "SchoenbAt",
    "SqrtKernel",
    "TrighKernel",
    "UserKernel",
    "degree_distribution",
    "derive_expectation",
    "fourth_moment",
    "rmf_variance",
]
