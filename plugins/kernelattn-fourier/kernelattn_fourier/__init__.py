"""kernelattn-fourier: random Fourier features for shift-invariant kernels
(``gaussian``, ``laplacian``, ``matern``; map ``rff``), trigonometric softmax features
(``trig-softmax``) random feature attention (``rfa``) and its gated causal form (``rfa-gate``), with the ``signed-row``
normaliser for estimates that can be negative."""

from .estimators import RFAAttention, RFAGateAttention, TrigSoftmaxAttention
from .feature_maps import RandomFourierFeatures, RFAFeatures, TrigSoftmaxFeatures
from .kernels import GaussianKernel, LaplacianKernel, MaternKernel, SpectralKernel
from .normalizers import SignedRowNormalizer
from .sampling import haar_orthogonal, orthogonal_frequencies

__all__ = [
    "GaussianKernel",
    "LaplacianKernel",
    "MaternKernel",
    "RFAAttention",
    "RFAFeatures",
    "RFAGateAttention",
    "RandomFourierFeatures",
    "SignedRowNormalizer",
    "SpectralKernel",
    "TrigSoftmaxAttention",
    "TrigSoftmaxFeatures",
    "haar_orthogonal",
    "orthogonal_frequencies",
]
