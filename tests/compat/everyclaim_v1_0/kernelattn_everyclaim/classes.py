"""A third-party plugin written against plugin spec 1.0 (the published docs of the first
release) that declares every claim family 1.0 had: FM001-FM005, KN001-KN003, SP001,
AT001, AT002, HP001. Frozen: it must keep passing ``kernelattn verify`` and the
conformance kit unchanged (``tests/compat/test_compat.py``).

Written as an author following the 1.0 docs would: imports from ``kernelattn_core`` and
``kernelattn_core.claims`` only, claims with 1.0 fields, ``PositiveFeatures`` declared on
a log-space map (allowed by 1.0), AT002 with 1.0's two budgets.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import ClassVar

import mpmath
import sympy
import torch

import kernelattn_core as ka
from kernelattn_core.claims import (
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


# --------------------------------------------------------------------------- closed forms
def prf_variance(x, y, fm):
    second = (2 * ((x + y) ** 2).sum(-1)).exp() * (-(x * x).sum(-1) - (y * y).sum(-1)).exp()
    return (second - (2 * (x * y).sum(-1)).exp()) / fm.num_features


def prf_expectation():
    x, y, w = sympy.symbols("x y omega", real=True)
    density = sympy.exp(-(w**2) / 2) / sympy.sqrt(2 * sympy.pi)
    integrand = sympy.exp(w * x - x**2 / 2) * sympy.exp(w * y - y**2 / 2) * density
    return sympy.integrate(integrand, (w, -sympy.oo, sympy.oo)), sympy.exp(x * y), "1-D Gaussian integral"


def geometric_pmf(n):
    s = sympy.Symbol("s", positive=True)
    return s / (1 + s) ** (n + 1)


def gaussian_mgf(dps):
    x = mpmath.mpf("0.6")
    value = mpmath.quad(lambda w: mpmath.exp(w * x - w**2 / 2), [-mpmath.inf, mpmath.inf]) / mpmath.sqrt(2 * mpmath.pi)
    return value, mpmath.exp(x**2 / 2), "E[exp(w x)], w ~ N(0, 1)"


# --------------------------------------------------------------------------- classes
class CoshKernel(ka.DotProductKernel):
    """cosh(t) + sinh(t) = exp(t), by its even and odd parts."""

    name: ClassVar[str] = "everyclaim-exp"
    positive: ClassVar[bool] = True
    claims: ClassVar[tuple] = (
        MaclaurinCoefficients(order=16),
        NonNegativeCoefficients(order=16),
        KernelMatchesExpression(digits=12),
    )

    def f(self, t):
        return torch.cosh(t) + torch.sinh(t)

    def sympy_expr(self, t):
        return sympy.cosh(t) + sympy.sinh(t)

    def coefficient(self, n):
        return Fraction(1, math.factorial(n))


class LogPRF(ka.FeatureMap):
    """Positive random features for exp(x.y) in log space."""

    name: ClassVar[str] = "everyclaim-prf"
    kernel: ClassVar[str] = "softmax"
    unbiased: ClassVar[bool] = True
    positive: ClassVar[bool] = True
    log_space: ClassVar[bool] = True
    default_num_features: ClassVar[int] = 32
    claims: ClassVar[tuple] = (
        UnbiasedKernelEstimate(dims=(8,), redraws=1000),
        PositiveFeatures(),  # allowed on a log-space map in spec 1.0 (deprecated since 1.1)
        EstimateVariance(variance=prf_variance, redraws=8000),
        ErrorDecay(budgets=(8, 32, 128), redraws=100),
        SymbolicExpectation(derive=prf_expectation),
        PmfSumsToOne(pmf=geometric_pmf, label="geometric pmf"),
        QuadratureIdentity(evaluate=gaussian_mgf, label="Gaussian MGF"),
    )

    def _build(self, head_dim):
        self.register_buffer("omega", torch.empty(self.num_features, head_dim))

    def _redraw(self, generator):
        self.omega.copy_(self._draw("normal", tuple(self.omega.shape), self.omega, generator))

    def _feature_dim(self):
        return self.num_features

    def _features(self, x, is_query):
        w = self.omega.to(x.dtype)
        return x @ w.T - 0.5 * (x * x).sum(-1, keepdim=True) - 0.5 * math.log(self.num_features)


class SoftPlusMap(ka.FeatureMap):
    """A positive deterministic map computed directly (not log space)."""

    name: ClassVar[str] = "everyclaim-softplus"
    positive: ClassVar[bool] = True
    random: ClassVar[bool] = False
    has_budget: ClassVar[bool] = False
    claims: ClassVar[tuple] = (PositiveFeatures(max_norm=6.0),)

    def _build(self, head_dim):
        pass

    def _feature_dim(self):
        return self.head_dim

    def _features(self, x, is_query):
        return torch.nn.functional.softplus(x) + 1e-6


class SampledAttention(ka.AttentionEstimator):
    """Unbiased for softmax attention: values at indices drawn from the exact softmax row
    (in training mode; eval mode draws from a fixed seed, so it is deterministic)."""

    name: ClassVar[str] = "everyclaim-sampled"
    unbiased: ClassVar[bool] = True
    random: ClassVar[bool] = True
    has_budget: ClassVar[bool] = True
    supports_causal: ClassVar[bool] = False
    claims: ClassVar[tuple] = (
        UnbiasedAttention(num_features=2, redraws=2000),
        ConsistentAttention(biased_at_finite_budget=False, budgets=(4, 64), redraws=300),
    )

    def __init__(self, num_features=1, *, scale=None):
        super().__init__(scale=scale)
        self.num_features = num_features

    def _attend(self, q, k, v, causal, key_padding_mask):
        logits = q @ k.transpose(-1, -2)
        if key_padding_mask is not None:
            logits = logits.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
        probs = logits.softmax(-1)
        b, h, n, m = probs.shape
        generator = None if self.training else torch.Generator().manual_seed(0)
        idx = torch.multinomial(probs.reshape(-1, m), self.num_features, replacement=True, generator=generator)
        picked = torch.gather(
            v.unsqueeze(2).expand(b, h, n, m, v.shape[-1]).reshape(b * h * n, m, -1),
            1,
            idx.unsqueeze(-1).expand(-1, -1, v.shape[-1]),
        )
        return picked.mean(1).reshape(b, h, n, -1)


class SelfNormalisedPRF(ka.FeatureMapAttention):
    """Self-normalised PRF attention: biased at finite budget, consistent (AT002 of 1.0)."""

    name: ClassVar[str] = "everyclaim-sn-prf"
    claims: ClassVar[tuple] = (ConsistentAttention(biased_at_finite_budget=True, budgets=(4, 64)),)

    def __init__(self, num_features=4, **options):
        super().__init__("everyclaim-prf", num_features=num_features, **options)
