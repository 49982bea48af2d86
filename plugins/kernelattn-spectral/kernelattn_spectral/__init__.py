"""kernelattn-spectral: learned spectral kernels ("On Learning the Transformer Kernel").

Feature maps ``gmm-rks``, ``gmm-prf``, ``fastfood-rks``, ``fastfood-prf``, ``generative-rks``,
``generative-prf`` and their closed-form target kernels ``spectral-gmm`` and ``spectral-prf``.
"""

from .fastfood import FastFoodPRFFeatureMap, FastFoodRKSFeatureMap
from .generative import GenerativePRFFeatureMap, GenerativeRKSFeatureMap
from .gmm import GMMPRFFeatureMap, GMMRKSFeatureMap
from .hadamard import fwht
from .kernels import GaussianPRFKernel, SpectralMixtureKernel

__all__ = [
    "FastFoodPRFFeatureMap",
    "FastFoodRKSFeatureMap",
    "GMMPRFFeatureMap",
    "GMMRKSFeatureMap",
    "GaussianPRFKernel",
    "GenerativePRFFeatureMap",
    "GenerativeRKSFeatureMap",
    "SpectralMixtureKernel",
    "fwht",
]
