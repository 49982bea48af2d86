"""Claims that classes declare (data) — the checkers live in :mod:`kernelattn_core.verify`."""

from .types import (
    Claim,
    ConsistentAttention,
    ErrorDecay,
    EstimateVariance,
    KernelMatchesExpression,
    MaclaurinCoefficients,
    NonNegativeCoefficients,
    PmfSumsToOne,
    PositiveFeatures,
    QuadratureIdentity,
    SymbolicExpectation,
    UnbiasedAttention,
    UnbiasedKernelEstimate,
)

__all__ = [
    "Claim",
    "ConsistentAttention",
    "ErrorDecay",
    "EstimateVariance",
    "KernelMatchesExpression",
    "MaclaurinCoefficients",
    "NonNegativeCoefficients",
    "PmfSumsToOne",
    "PositiveFeatures",
    "QuadratureIdentity",
    "SymbolicExpectation",
    "UnbiasedAttention",
    "UnbiasedKernelEstimate",
]
