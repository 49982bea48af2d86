"""Registration of the spectral plugin (entry point ``spectral``)."""

from __future__ import annotations

from kernelattn_core import hookimpl

from .fastfood import FastFoodPRFFeatureMap, FastFoodRKSFeatureMap
from .generative import GenerativePRFFeatureMap, GenerativeRKSFeatureMap
from .gmm import GMMPRFFeatureMap, GMMRKSFeatureMap
from .kernels import GaussianPRFKernel, SpectralMixtureKernel


@hookimpl
def kernelattn_kernels():  # type: ignore[no-untyped-def]
    return [SpectralMixtureKernel, GaussianPRFKernel]


@hookimpl
def kernelattn_feature_maps():  # type: ignore[no-untyped-def]
    return [
        GMMRKSFeatureMap,
        GMMPRFFeatureMap,
        FastFoodRKSFeatureMap,
        FastFoodPRFFeatureMap,
        GenerativeRKSFeatureMap,
        GenerativePRFFeatureMap,
    ]
