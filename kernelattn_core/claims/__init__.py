"""Claims that classes declare (data) — the checkers live in :mod:`kernelattn_core.verify`."""

from .types import (
    Claim,
    ConsistentAttention,
    ErrorDecay,
    EstimateVariance,
    KernelClosedForm,
    KernelMatchesExpression,
    MaclaurinCoefficients,
    NonNegativeCoefficients,
    PmfSumsToOne,
    PositiveDefinite,
    PositiveFeatures,
    QuadratureIdentity,
    SpectralDensityIntegral,
    SymbolicExpectation,
    UnbiasedAttention,
    UnbiasedKernelEstimate,
)

__all__ = [
    "Claim",
    "ConsistentAttention",
    "ErrorDecay",
    "EstimateVariance",
    "KernelClosedForm",
    "KernelMatchesExpression",
    "MaclaurinCoefficients",
    "NonNegativeCoefficients",
    "PmfSumsToOne",
    "PositiveDefinite",
    "PositiveFeatures",
    "QuadratureIdentity",
    "SpectralDensityIntegral",
    "SymbolicExpectation",
    "UnbiasedAttention",
    "UnbiasedKernelEstimate",
]
