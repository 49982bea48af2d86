"""Lemma 3.1 (closed-form MSE, FM003), the corrected bound W(r) of Lemma 3.2, and
hyperbolic beating plain at equal feature count."""

from __future__ import annotations

import math

import mpmath as mp
import pytest
import sympy as sp
import torch
from kernelattn_prf import (
    ComplexExponentialFeatures,
    HyperbolicComplexExponentialFeatures,
    HyperbolicPositiveRandomFeatures,
    PositiveRandomFeatures,
)
from kernelattn_prf.diagnostics import grouped_estimates, per_omega_estimates
from kernelattn_prf.theory import (
    cexp_mse,
    derive_lemma31_1d,
    estimate_variance,
    hcexp_mse,
    hcexp_relative_rms_bound,
    max_relative_error_w,
    max_relative_error_w_printed,
)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _map(cls: type, d: int, m: int, seed: int, a: torch.Tensor | None):  # type: ignore[no-untyped-def]
    if a is None:
        return cls(d, m, generator=gen(seed)).double()
    fm = cls(d, m, rule="fixed", matrix=a, generator=gen(seed)).double()
    fm.set_matrix(a)
    return fm


def _pairs(d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = gen(seed)
    x = 0.35 * torch.randn(6, d, generator=g, dtype=torch.float64)
    y = 0.35 * torch.randn(6, d, generator=g, dtype=torch.float64)
    return x, y


A4 = torch.tensor([1.3, 0.7, 1.1, 0.9], dtype=torch.float64)
CASES = [
    (PositiveRandomFeatures, None),
    (HyperbolicPositiveRandomFeatures, None),
    (ComplexExponentialFeatures, A4),
    (HyperbolicComplexExponentialFeatures, A4),
    (ComplexExponentialFeatures, torch.eye(4, dtype=torch.float64) + 0.2 * torch.ones(4, 4, dtype=torch.float64)),
]


def _variance_z(single: torch.Tensor, closed: torch.Tensor) -> torch.Tensor:
    """z-score of the sample variance of ``single [n, R]`` against ``closed [n]`` (fourth-moment standard error)."""
    r = single.shape[-1]
    c = single - single.mean(-1, keepdim=True)
    var = (c * c).mean(-1)
    m4 = (c**4).mean(-1)
    se = ((m4 - var * var) / r).sqrt()
    return (var - closed) / se


@pytest.mark.parametrize("case", range(len(CASES)))
def test_prf_lemma31_variance_matches_monte_carlo(case: int) -> None:
    cls, a = CASES[case]
    fm = _map(cls, 4, 400_000, 21 + case, a)  # iid rows: one map = many independent single-omega draws
    x, y = _pairs(4, 7)
    single = per_omega_estimates(fm, x, y)  # [6, R]
    one = _map(cls, 4, 1, 0, a)  # the same map with m = 1
    closed = estimate_variance(x, y, one)
    z = _variance_z(single, closed)
    rel = (single.var(-1) / closed - 1).abs()
    print(cls.name, "z =", [round(v, 2) for v in z.tolist()], "max rel diff", float(rel.max()))
    assert z.abs().max() < 5 and rel.max() < 0.25
    # at m features the MSE is the per-omega variance / m
    fm_m = _map(cls, 4, 16, 0, a)
    torch.testing.assert_close(estimate_variance(x, y, fm_m), closed / 16, rtol=1e-12, atol=0)


def test_prf_lemma31_test_catches_the_wrong_formula() -> None:
    """Negative control: the one-sided formula applied to the hyperbolic map fails the same test."""
    fm = _map(HyperbolicPositiveRandomFeatures, 4, 400_000, 3, None)
    x, y = _pairs(4, 7)
    single = per_omega_estimates(fm, x, y)
    z_sq = ((x + y) ** 2).sum(-1)
    wrong = cexp_mse(z_sq, (x * y).sum(-1).exp(), 1)
    assert _variance_z(single, wrong).abs().max() > 10


def test_prf_lemma31_spec_anchor_2d() -> None:
    """Spec §3 anchor: x = (0.5, -0.3), y = (0.2, 0.4), A = diag(2, 0.5), m = 1."""
    x = torch.tensor([[0.5, -0.3]], dtype=torch.float64)
    y = torch.tensor([[0.2, 0.4]], dtype=torch.float64)
    a = torch.tensor([2.0, 0.5], dtype=torch.float64)
    expected = {
        "cexp": 3.955234198488681,
        "hcexp": 1.591110897546584,
        "prf": 0.623284545842159,
        "prf-hyperbolic": 0.122621679531913,
    }
    maps = {
        "cexp": _map(ComplexExponentialFeatures, 2, 1, 0, a),
        "hcexp": _map(HyperbolicComplexExponentialFeatures, 2, 1, 0, a),
        "prf": _map(PositiveRandomFeatures, 2, 1, 0, None),
        "prf-hyperbolic": _map(HyperbolicPositiveRandomFeatures, 2, 1, 0, None),
    }
    for name, fm in maps.items():
        assert float(estimate_variance(x, y, fm)) == pytest.approx(expected[name], rel=1e-13), name
    z = x * a + y / a
    assert float((z * z).sum()) == pytest.approx(1.6325, rel=1e-14)


@pytest.mark.parametrize(
    ("x", "y", "a", "cexp_ref", "hcexp_ref"),
    [
        ("0.8", "-0.3", "1.7", "1.8923692523466644262", "0.71303140324136420374"),
        ("5", "0.5", "0.3162", "3268869.2113605961502", "1634360.4024697200266"),
    ],
)
def test_prf_lemma31_high_precision_quadrature(x: str, y: str, a: str, cexp_ref: str, hcexp_ref: str) -> None:
    """Per-omega variance by mpmath quadrature (30 digits) = Lemma 3.1 = the spec's reference values."""
    with mp.workdps(30):  # local precision: no global side effect on other tests
        x, y, a = mp.mpf(x), mp.mpf(y), mp.mpf(a)  # type: ignore[assignment]
        xp, yp = a * x, y / a
        zz, norm, sm = xp + yp, (xp**2 + yp**2) / 2, mp.e ** (x * y)
        phi = lambda w: mp.e ** (-(w**2) / 2) / mp.sqrt(2 * mp.pi)  # noqa: E731
        second_c = mp.quad(lambda w: mp.e ** (2 * (w * zz - norm)) * phi(w), [-mp.inf, 0, mp.inf])
        second_h = mp.quad(lambda w: (mp.cosh(w * zz) * mp.e ** (-norm)) ** 2 * phi(w), [-mp.inf, 0, mp.inf])
        t = zz**2
        lemma_c = mp.e**t * sm**2 * (1 - mp.e ** (-t))
        lemma_h = mp.e**t * sm**2 * (1 - mp.e ** (-t)) ** 2 / 2
        assert abs((second_c - sm**2) / lemma_c - 1) < mp.mpf(10) ** -20
        assert abs((second_h - sm**2) / lemma_h - 1) < mp.mpf(10) ** -20
        assert abs(lemma_c / mp.mpf(cexp_ref) - 1) < mp.mpf(10) ** -18
        assert abs(lemma_h / mp.mpf(hcexp_ref) - 1) < mp.mpf(10) ** -18
    # the float64 closed forms agree
    tt, smt = torch.tensor(float(t), dtype=torch.float64), torch.tensor(float(sm), dtype=torch.float64)
    assert float(cexp_mse(tt, smt, 1)) == pytest.approx(float(lemma_c), rel=1e-12)
    assert float(hcexp_mse(tt, smt, 1)) == pytest.approx(float(lemma_h), rel=1e-12)


@pytest.mark.parametrize("two_sided", [False, True])
def test_prf_lemma31_symbolic_1d(two_sided: bool) -> None:
    variance, lemma = derive_lemma31_1d(two_sided)
    assert sp.simplify(variance - lemma) == 0
    if two_sided:  # negative control: the unsquared factor is wrong for HCEXP
        x, y = sp.symbols("x y", real=True)
        a = sp.symbols("a", positive=True)
        t = (a * x + y / a) ** 2
        wrong = sp.exp(t) * sp.exp(2 * x * y) * (1 - sp.exp(-t)) / 2
        assert sp.simplify(variance - wrong) != 0


# --------------------------------------------------------------------------- Lemma 3.2, corrected
def test_prf_w_corrected_values_and_identity() -> None:
    """W(r) = e^{2r^2}(1 - e^{-4r^2}) = 2 sinh(2 r^2), with the spec's numbers."""
    for r, value in [(0.25, 0.2506515505), (0.5, 1.0421906110), (1.0, 7.2537208157)]:
        assert max_relative_error_w(r) == pytest.approx(value, abs=1e-9)
        assert max_relative_error_w(r) == pytest.approx(math.exp(2 * r * r) * (1 - math.exp(-4 * r * r)), rel=1e-14)
    t = sp.symbols("t", positive=True)
    assert sp.simplify((sp.exp(t / 2) * (1 - sp.exp(-t)) - 2 * sp.sinh(t / 2)).rewrite(sp.exp)) == 0


def test_prf_w_printed_sign_error_regression() -> None:
    """The paper's printed W(r) = e^{2r^2}(1 - e^{4r^2}) is negative: it cannot bound an RMS error.
    Fails if the printed form ever replaces the corrected one."""
    for r in (0.1, 0.25, 0.5, 1.0):
        assert max_relative_error_w_printed(r) < 0 < max_relative_error_w(r)
    assert max_relative_error_w_printed(0.5) == pytest.approx(-2.83297, abs=1e-5)
    # the bound is attained by an aligned pair of norm r: relative RMS = W(r) / sqrt(2m)
    r, m = 0.5, 64
    x = torch.zeros(1, 3, dtype=torch.float64)
    x[0, 0] = r
    fm = _map(HyperbolicPositiveRandomFeatures, 3, m, 0, None)
    rms = float(estimate_variance(x, x, fm).sqrt() / (x * x).sum().exp())
    assert rms == pytest.approx(hcexp_relative_rms_bound(r, m), rel=1e-12)
    assert rms > max_relative_error_w_printed(r) / math.sqrt(2 * m)


def test_prf_w_bounds_the_relative_rms_on_a_region() -> None:
    """Every pair with |Ax|, |A^{-T} y| <= r has relative RMS error <= W(r)/sqrt(2m), by closed form
    and by Monte Carlo at the extremal (aligned) pair."""
    r, m, d = 0.6, 8, 5
    a = torch.tensor([1.5, 0.8, 1.2, 0.6, 1.0], dtype=torch.float64)
    fm = _map(HyperbolicComplexExponentialFeatures, d, m, 0, a)
    g = gen(1)
    xp = torch.randn(500, d, generator=g, dtype=torch.float64)
    yp = torch.randn(500, d, generator=g, dtype=torch.float64)
    xp = xp / xp.norm(dim=-1, keepdim=True) * r * torch.rand(500, 1, generator=g, dtype=torch.float64)
    yp = yp / yp.norm(dim=-1, keepdim=True) * r * torch.rand(500, 1, generator=g, dtype=torch.float64)
    x, y = xp / a, yp * a  # so that A x = xp, A^{-T} y = yp
    rel = estimate_variance(x, y, fm).sqrt() / (x * y).sum(-1).exp()
    bound = hcexp_relative_rms_bound(r, m)
    assert float(rel.max()) <= bound
    # Monte Carlo at the aligned pair (equality case)
    e = torch.zeros(1, d, dtype=torch.float64)
    e[0, 0] = r
    big = _map(HyperbolicComplexExponentialFeatures, d, m * 40_000, 5, a)
    est = grouped_estimates(per_omega_estimates(big, e / a, e * a), m)  # 40000 maps with m omegas
    sm = float((e / a * e * a).sum().exp())
    mc_rel = float(((est - sm) ** 2).mean().sqrt()) / sm
    print("aligned pair: MC relative RMS", mc_rel, "bound", bound)
    assert mc_rel == pytest.approx(bound, rel=0.05)


# --------------------------------------------------------------------------- hyperbolic vs plain
@pytest.mark.parametrize(
    ("plain", "hyper", "a"),
    [
        (PositiveRandomFeatures, HyperbolicPositiveRandomFeatures, None),
        (
            ComplexExponentialFeatures,
            HyperbolicComplexExponentialFeatures,
            torch.linspace(0.7, 1.4, 16, dtype=torch.float64),
        ),
    ],
)
def test_prf_hyperbolic_beats_plain_at_equal_feature_count(plain: type, hyper: type, a: torch.Tensor | None) -> None:
    """2m plain features vs m two-sided omegas (2m features): MSE ratio = 1 - exp(-|z|^2) < 1."""
    d, m, reps = 16, 8, 20_000
    g = gen(4)
    x = 0.15 * torch.randn(6, d, generator=g, dtype=torch.float64)
    y = 0.15 * torch.randn(6, d, generator=g, dtype=torch.float64)
    sm = (x * y).sum(-1).exp()
    p = grouped_estimates(per_omega_estimates(_map(plain, d, 2 * m * reps, 1, a), x, y), 2 * m)  # [6, reps]
    h = grouped_estimates(per_omega_estimates(_map(hyper, d, m * reps, 2, a), x, y), m)
    assert _map(plain, d, 2 * m, 0, a).feature_dim == _map(hyper, d, m, 0, a).feature_dim
    mse_p = ((p - sm[:, None]) ** 2).mean(-1)
    mse_h = ((h - sm[:, None]) ** 2).mean(-1)
    one = _map(plain, d, 1, 0, a)
    z = one.transform(x, query=True) + one.transform(y, query=False)
    predicted = -torch.expm1(-(z * z).sum(-1))  # 1 - exp(-|z|^2)
    ratio = mse_h / mse_p
    print("ratio", ratio.tolist(), "predicted", predicted.tolist())
    assert bool((mse_h < mse_p).all())
    assert float(((ratio / predicted) - 1).abs().max()) < 0.15
