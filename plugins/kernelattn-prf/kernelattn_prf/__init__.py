"""kernelattn-prf: positive random features (Performer FAVOR+), hyperbolic and orthogonal
features, and CEXP / HCEXP adapted to query and key distributions.

Registry names: ``prf``, ``prf-hyperbolic``, ``cexp``, ``hcexp`` (feature maps) and the
experiment ``cexp`` (``kernelattn experiment cexp``).
"""

from .feature_maps import (
    ComplexExponentialFeatures,
    HyperbolicComplexExponentialFeatures,
    HyperbolicPositiveRandomFeatures,
    PositiveRandomFeatures,
)

__all__ = [
    "ComplexExponentialFeatures",
    "HyperbolicComplexExponentialFeatures",
    "HyperbolicPositiveRandomFeatures",
    "PositiveRandomFeatures",
]
