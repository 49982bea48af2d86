"""kernelattn-everyclaim: a frozen third-party-style plugin written against plugin spec 1.0."""

from .classes import CoshKernel, LogPRF, SampledAttention, SelfNormalisedPRF, SoftPlusMap

__all__ = ["CoshKernel", "LogPRF", "SampledAttention", "SelfNormalisedPRF", "SoftPlusMap"]
