"""Test-only plugin for the verification framework: correct classes (positive
controls) and deliberately wrong ones (negative controls) that must fail."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import ClassVar

import mpmath
import sympy
import torch

import kernelattn_core as ka
from kernelattn_core import claims as C
from kernelattn_core import hookimpl

from .toy_plugin import ToyPRF, ToyTrig

# --------------------------------------------------------------------------- kernels


class GoodExp(ka.DotProductKernel):
    """exp(t) with exact coefficients 1/n!."""

    name: ClassVar[str] = "good-exp"
    positive: ClassVar[bool] = True

    def f(self, t):  # type: ignore[no-untyped-def]
        return t.exp()

    def sympy_expr(self, t):  # type: ignore[no-untyped-def]
        return sympy.exp(t)

    def coefficient(self, n: int) -> Fraction:
        return Fraction(1, math.factorial(n))


class OffByOneTerm(GoodExp):
    """Negative control: a_5 is 1/5! + 1/1000."""

    name: ClassVar[str] = "off-by-one-term"

    def coefficient(self, n: int) -> Fraction:
        return super().coefficient(n) + (Fraction(1, 1000) if n == 5 else 0)


class NegativeCoefficient(GoodExp):
    """Negative control: exp(-t) claims a_n = (-1)^n/n! honestly, but these are not >= 0."""

    name: ClassVar[str] = "negative-coefficient"

    def f(self, t):  # type: ignore[no-untyped-def]
        return (-t).exp()

    def sympy_expr(self, t):  # type: ignore[no-untyped-def]
        return sympy.exp(-t)

    def coefficient(self, n: int) -> Fraction:
        return Fraction((-1) ** n, math.factorial(n))


class WrongTorchFunction(GoodExp):
    """Negative control: f(t) uses a float32 round trip, so it agrees with exp to ~7 digits only."""

    name: ClassVar[str] = "wrong-torch-function"

    def f(self, t):  # type: ignore[no-untyped-def]
        return t.float().exp().double()


# --------------------------------------------------------------------------- pmfs


# sympy needs p > 1 for convergence; declare it through a substitution p = 1 + s, s > 0
def geometric_pmf_s(n):  # type: ignore[no-untyped-def]
    s = sympy.Symbol("s", positive=True)
    p = 1 + s
    return (p - 1) / p ** (n + 1)


def papers_pmf_s(n):  # type: ignore[no-untyped-def]
    s = sympy.Symbol("s", positive=True)
    return 1 / (1 + s) ** (n + 1)


# --------------------------------------------------------------------------- symbolic expectation


def prf_expectation_1d():  # type: ignore[no-untyped-def]
    x, y, w = sympy.symbols("x y omega", real=True)
    integrand = (
        sympy.exp(w * x - x**2 / 2) * sympy.exp(w * y - y**2 / 2) * sympy.exp(-(w**2) / 2) / sympy.sqrt(2 * sympy.pi)
    )
    return sympy.integrate(integrand, (w, -sympy.oo, sympy.oo)), sympy.exp(x * y), "Gaussian integral, 1-D"


def wrong_expectation_1d():  # type: ignore[no-untyped-def]
    """Negative control: drops the -|x|^2/2 factor of one side."""
    x, y, w = sympy.symbols("x y omega", real=True)
    integrand = sympy.exp(w * x) * sympy.exp(w * y - y**2 / 2) * sympy.exp(-(w**2) / 2) / sympy.sqrt(2 * sympy.pi)
    return sympy.integrate(integrand, (w, -sympy.oo, sympy.oo)), sympy.exp(x * y), "Gaussian integral, 1-D"


# --------------------------------------------------------------------------- quadrature


def gaussian_moment(dps: int):  # type: ignore[no-untyped-def]
    """E[exp(w x)] for w ~ N(0,1) at x = 0.7 by quadrature equals exp(x^2/2)."""
    x = mpmath.mpf("0.7")
    value = mpmath.quad(lambda w: mpmath.exp(w * x - w**2 / 2), [-mpmath.inf, mpmath.inf]) / mpmath.sqrt(2 * mpmath.pi)
    return value, mpmath.exp(x**2 / 2), "1-D Gaussian moment generating function"


def gaussian_moment_truncated(dps: int):  # type: ignore[no-untyped-def]
    """Negative control: the integral truncated at |w| < 8 misses ~1e-15 of the mass."""
    x = mpmath.mpf("0.7")
    value = mpmath.quad(lambda w: mpmath.exp(w * x - w**2 / 2), [-8, 8]) / mpmath.sqrt(2 * mpmath.pi)
    return value, mpmath.exp(x**2 / 2), "truncated quadrature"


# --------------------------------------------------------------------------- feature maps


def prf_variance(x, y, fm):  # type: ignore[no-untyped-def]
    """Var of the PRF estimate with m features: (exp(2|x+y|^2 - |x|^2 - |y|^2) - e^{2xy}) / m."""
    second = (2 * ((x + y) ** 2).sum(-1)).exp() * (-(x * x).sum(-1) - (y * y).sum(-1)).exp()
    return (second - (2 * (x * y).sum(-1)).exp()) / fm.num_features


def prf_variance_wrong(x, y, fm):  # type: ignore[no-untyped-def]
    """Negative control: 20 % too large."""
    return 1.2 * prf_variance(x, y, fm)


class CheckedPRF(ToyPRF):
    """The toy PRF with its true claims (positive control)."""

    name: ClassVar[str] = "checked-prf"
    claims: ClassVar[tuple] = (
        C.UnbiasedKernelEstimate(dims=(8, 32)),
        C.EstimateVariance(variance=prf_variance),
        C.ErrorDecay(),
        C.SymbolicExpectation(derive=prf_expectation_1d),
        C.QuadratureIdentity(evaluate=gaussian_moment, label="Gaussian MGF"),
    )


class BiasedPRF(ToyPRF):
    """Negative control: a normaliser off by 3 % makes the estimate biased."""

    name: ClassVar[str] = "biased-prf"
    claims: ClassVar[tuple] = (C.UnbiasedKernelEstimate(dims=(8,)),)

    def _features(self, x, is_query):  # type: ignore[no-untyped-def]
        return super()._features(x, is_query) + 0.5 * math.log(1.03)


class WronglyPositive(ToyTrig):
    """Negative control: trigonometric features flagged positive."""

    name: ClassVar[str] = "wrongly-positive"
    positive: ClassVar[bool] = True


class WrongClaims(ToyPRF):
    """Negative controls for the variance, decay, symbolic and quadrature checkers."""

    name: ClassVar[str] = "wrong-claims"
    claims: ClassVar[tuple] = (
        C.EstimateVariance(variance=prf_variance_wrong),
        C.ErrorDecay(slope=-2.0),
        C.SymbolicExpectation(derive=wrong_expectation_1d),
        C.QuadratureIdentity(evaluate=gaussian_moment_truncated, label="truncated"),
    )


# --------------------------------------------------------------------------- estimators


class ToyRandomizedAttention(ka.AttentionEstimator):
    """Unbiased for softmax attention: average of values at ``num_features`` key indices
    drawn from the exact softmax row (positive control of AT001)."""

    name: ClassVar[str] = "toy-ra"
    unbiased: ClassVar[bool] = True
    random: ClassVar[bool] = True
    has_budget: ClassVar[bool] = True
    supports_causal: ClassVar[bool] = False
    claims: ClassVar[tuple] = (
        C.UnbiasedAttention(num_features=2),
        C.ConsistentAttention(biased_at_finite_budget=False),
    )

    def __init__(self, num_features: int = 1, *, scale: float | None = None) -> None:
        super().__init__(scale=scale)
        self.num_features = num_features

    def _attend(self, q, k, v, causal, key_padding_mask):  # type: ignore[no-untyped-def]
        logits = q @ k.transpose(-1, -2)  # [B, H, N, M]
        if key_padding_mask is not None:
            logits = logits.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
        probs = logits.softmax(-1)
        b, h, n, m = probs.shape
        idx = torch.multinomial(probs.reshape(-1, m), self.num_features, replacement=True)  # [BHN, S]
        picked = torch.gather(
            v.unsqueeze(2).expand(b, h, n, m, v.shape[-1]).reshape(b * h * n, m, -1),
            1,
            idx.unsqueeze(-1).expand(-1, -1, v.shape[-1]),
        )  # [BHN, S, dv]
        return picked.mean(1).reshape(b, h, n, -1)


class FalselyUnbiased(ka.FeatureMapAttention):
    """Negative control: self-normalised PRF attention (biased at finite budget)
    claiming unbiasedness at one feature."""

    name: ClassVar[str] = "falsely-unbiased"
    claims: ClassVar[tuple] = (C.UnbiasedAttention(num_features=1),)

    def __init__(self, num_features: int = 1, **options) -> None:  # type: ignore[no-untyped-def]
        super().__init__("toy-prf", num_features=num_features, **options)


class ConsistentPRF(FalselyUnbiased):
    """Positive control of AT002: self-normalised, biased at finite budget, consistent."""

    name: ClassVar[str] = "consistent-prf"
    claims: ClassVar[tuple] = (C.ConsistentAttention(biased_at_finite_budget=True),)


class NotConsistent(ka.FeatureMapAttention):
    """Negative control of AT002: the elu map's error does not shrink with the budget."""

    name: ClassVar[str] = "not-consistent"
    claims: ClassVar[tuple] = (C.ConsistentAttention(),)

    def __init__(self, num_features: int = 1, **options) -> None:  # type: ignore[no-untyped-def]
        super().__init__("elu", **options)


class WrongLimitPRF(ConsistentPRF):
    """Negative control of AT002 (a wrong limit): self-normalised PRF attention at a
    temperature off by 30 % (queries scaled by 1.3 before the features): its bias falls as
    the budget grows, but towards softmax attention of logits 1.3 times too large (an RMS
    limit bias of 0.048 on the AT002 inputs, largest element 0.15)."""

    name: ClassVar[str] = "wrong-limit-prf"
    claims: ClassVar[tuple] = (C.ConsistentAttention(biased_at_finite_budget=True),)

    def _attend(self, q, k, v, causal, key_padding_mask):  # type: ignore[no-untyped-def]
        return super()._attend(q * 1.3, k, v, causal, key_padding_mask)


class OffsetPRF(ConsistentPRF):
    """A consistent estimator plus a fixed offset on every output (``OFFSET``): it converges
    to softmax attention + offset. Used to measure the limit bias AT002 detects."""

    name: ClassVar[str] = "offset-prf"
    OFFSET: ClassVar[float] = 0.02

    def _attend(self, q, k, v, causal, key_padding_mask):  # type: ignore[no-untyped-def]
        return super()._attend(q, k, v, causal, key_padding_mask) + self.OFFSET


def _causal_naive(est, q, k, v, key_padding_mask, diagonal):  # type: ignore[no-untyped-def]
    """Row-normalised feature attention over keys ``j <= t + diagonal`` (the full matrix)."""
    fm = est.feature_map
    if not fm.built:
        est.redraw_policy.initial(fm, q.shape[-1])
    phi_q, phi_k = fm.query(q), fm.key(k)
    a = phi_q @ phi_k.transpose(-1, -2)
    keep = torch.ones(a.shape[-2:], dtype=torch.bool).tril(diagonal)
    if key_padding_mask is not None:
        keep = keep & ~key_padding_mask[:, None, None, :]
    a = a * keep
    den = a.sum(-1, keepdim=True)
    return (a @ v) / torch.where(den == 0, torch.ones_like(den), den)


class DropsOwnKey(ka.FeatureMapAttention):
    """Negative control of EN001: causal rows see keys ``j < t`` only (the diagonal dropped,
    an off-by-one of the causal mask); non-causal calls are right."""

    name: ClassVar[str] = "drops-own-key"

    def __init__(self, num_features: int = 16, **options) -> None:  # type: ignore[no-untyped-def]
        super().__init__("toy-prf", num_features=num_features, **options)

    def _attend(self, q, k, v, causal, key_padding_mask):  # type: ignore[no-untyped-def]
        if not causal:
            return super()._attend(q, k, v, causal, key_padding_mask)
        return _causal_naive(self, q, k, v, key_padding_mask, -1)


class NormalizerSeesFuture(DropsOwnKey):
    """Negative control of EN002: a causal numerator over a non-causal normaliser (the
    denominator sums every key: a cumulative sum forgotten)."""

    name: ClassVar[str] = "normalizer-sees-future"

    def _attend(self, q, k, v, causal, key_padding_mask):  # type: ignore[no-untyped-def]
        if not causal:
            return ka.FeatureMapAttention._attend(self, q, k, v, causal, key_padding_mask)
        fm = self.feature_map
        phi_q, phi_k = fm.query(q), fm.key(k)
        a = phi_q @ phi_k.transpose(-1, -2)
        num = (a * torch.ones(a.shape[-2:]).tril()) @ v
        return num / a.sum(-1, keepdim=True)


class PaddingInNormalizer(DropsOwnKey):
    """Negative control of EN003: padded keys are removed from the values only and still
    counted in the normaliser."""

    name: ClassVar[str] = "padding-in-normalizer"

    def _attend(self, q, k, v, causal, key_padding_mask):  # type: ignore[no-untyped-def]
        if key_padding_mask is None:
            return ka.FeatureMapAttention._attend(self, q, k, v, causal, key_padding_mask)
        fm = self.feature_map
        phi_q, phi_k = fm.query(q), fm.key(k)
        a = phi_q @ phi_k.transpose(-1, -2)
        if causal:
            a = a * torch.ones(a.shape[-2:]).tril()
        v = v.masked_fill(key_padding_mask[:, None, :, None], 0.0)
        return (a @ v) / a.sum(-1, keepdim=True)


def toy_prf_features(fm, generator):  # type: ignore[no-untyped-def]
    """RT001 for toy-prf: log-features :math:`\\omega^\\top x - |x|^2/2 - \\log(m)/2`."""
    x = torch.randn(5, fm.head_dim, generator=generator, dtype=torch.float64)
    want = x @ fm.omega.T - 0.5 * (x * x).sum(-1, keepdim=True) - 0.5 * math.log(fm.num_features)
    return fm.query_log(x), want, "omega.x - |x|^2/2 - log(m)/2"


def toy_prf_features_wrong(fm, generator):  # type: ignore[no-untyped-def]
    """Negative control of RT001: the closed form without the 1/sqrt(m) normalisation."""
    value, want, _ = toy_prf_features(fm, generator)
    return value, want + 0.5 * math.log(fm.num_features), "without the 1/sqrt(m)"


class IdentifiedPRF(ToyPRF):
    """Runtime identities (RT001) of the toy PRF: the true one and a wrong one."""

    name: ClassVar[str] = "identified-prf"
    claims: ClassVar[tuple] = (
        C.RuntimeIdentity(evaluate=toy_prf_features, label="toy-prf log-features"),
        C.RuntimeIdentity(evaluate=toy_prf_features_wrong, label="toy-prf log-features", expect="fail"),
    )


@hookimpl
def kernelattn_kernels():  # type: ignore[no-untyped-def]
    return [GoodExp, OffByOneTerm, NegativeCoefficient, WrongTorchFunction]


@hookimpl
def kernelattn_feature_maps():  # type: ignore[no-untyped-def]
    return [CheckedPRF, BiasedPRF, WronglyPositive, WrongClaims, IdentifiedPRF]


@hookimpl
def kernelattn_estimators():  # type: ignore[no-untyped-def]
    return [
        ToyRandomizedAttention,
        FalselyUnbiased,
        ConsistentPRF,
        NotConsistent,
        WrongLimitPRF,
        OffsetPRF,
        DropsOwnKey,
        NormalizerSeesFuture,
        PaddingInNormalizer,
    ]
