"""Unbiasedness (FM001 by Monte Carlo at d = 16 and 64; FM005 symbolically) and positivity (FM002)."""

from __future__ import annotations

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
    _gaussian_expectation,
    derive_cexp_1d,
    derive_hcexp_1d,
    derive_prf_1d,
    derive_prf_hyperbolic_1d,
    gaussian_mgf,
)

Z_MAX = 5.0  # per pair; 8 pairs -> false-failure rate below 1e-5 under normality


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def pairs(n: int, d: int, lo: float, hi: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random directions with norms uniform in [lo, hi] (float64)."""
    g = gen(seed)
    out = []
    for _ in range(2):
        u = torch.randn(n, d, generator=g, dtype=torch.float64)
        r = lo + (hi - lo) * torch.rand(n, 1, generator=g, dtype=torch.float64)
        out.append(u / u.norm(dim=-1, keepdim=True) * r)
    return out[0], out[1]


def z_scores(fm, x: torch.Tensor, y: torch.Tensor, group: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """z-score of the mean of independent group estimates against exp(x.y), per pair."""
    est = grouped_estimates(per_omega_estimates(fm, x, y), group)  # [n, R]
    sm = (x * y).sum(-1).exp()
    return (est.mean(-1) - sm) / (est.std(-1) / est.shape[-1] ** 0.5)


def _fitted(cls: type, d: int, m: int, rule: str, orthogonal: bool, seed: int):  # type: ignore[no-untyped-def]
    fm = cls(head_dim=d, num_features=m, rule=rule, orthogonal=orthogonal, generator=gen(seed)).double()
    g = gen(seed + 100)
    data_q = 0.3 * torch.randn(200, d, generator=g, dtype=torch.float64) + 0.2
    data_k = 0.1 * torch.randn(200, d, generator=g, dtype=torch.float64) + 0.4 * torch.rand(d, generator=g)
    return fm.fit(data_q, data_k).eval()


CASES = [
    ("prf", lambda d, m, o, s: PositiveRandomFeatures(d, m, orthogonal=o, generator=gen(s)).double()),
    (
        "prf-hyperbolic",
        lambda d, m, o, s: HyperbolicPositiveRandomFeatures(d, m, orthogonal=o, generator=gen(s)).double(),
    ),
    ("cexp-variance", lambda d, m, o, s: _fitted(ComplexExponentialFeatures, d, m, "variance", o, s)),
    ("hcexp-means", lambda d, m, o, s: _fitted(HyperbolicComplexExponentialFeatures, d, m, "means", o, s)),
    ("cexp-full", lambda d, m, o, s: _fitted(ComplexExponentialFeatures, d, m, "full", o, s)),
]


@pytest.mark.parametrize("d", [16, 64])
@pytest.mark.parametrize("orthogonal", [False, True])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_prf_monte_carlo_unbiased(case: int, orthogonal: bool, d: int) -> None:
    label, make = CASES[case]
    blocks = 3000 if d == 16 else 300
    fm = make(d, d * blocks, orthogonal, 11 + case)
    if hasattr(fm, "matrices") and label != "prf":
        a_q, _ = fm.matrices()
        assert not torch.allclose(a_q, torch.eye(d, dtype=a_q.dtype))  # a non-trivial A is under test
    x, y = pairs(8, d, 0.2, 1.0, seed=3 + d)
    z = z_scores(fm, x, y, group=d)  # one orthogonal block per group (iid: any grouping)
    print(label, d, orthogonal, "z =", [round(v, 2) for v in z.tolist()])
    assert z.abs().max() < Z_MAX


def test_prf_monte_carlo_catches_a_biased_map() -> None:
    """Negative control: orthogonal rows of fixed norm sqrt(d) are not N(0, I) and the
    same z-test flags the bias (E exp(w.z) over the sphere != exp(|z|^2 / 2))."""
    d = 16
    fm = PositiveRandomFeatures(d, d * 12000, orthogonal=True, norm="fixed", generator=gen(0)).double()
    x, y = pairs(8, d, 0.6, 1.0, seed=5)
    z = z_scores(fm, x, y, group=d)
    print("fixed-norm z =", [round(v, 2) for v in z.tolist()])
    assert z.abs().max() > 2 * Z_MAX


@pytest.mark.parametrize(
    "derive", [derive_prf_1d, derive_prf_hyperbolic_1d, derive_cexp_1d, derive_hcexp_1d], ids=lambda f: f.__name__
)
def test_prf_symbolic_expectation_is_the_softmax_kernel(derive) -> None:  # type: ignore[no-untyped-def]
    expectation, target, note = derive()
    assert note
    assert sp.simplify(expectation - target) == 0


def test_prf_symbolic_mgf_is_the_gaussian_integral() -> None:
    s, mgf = gaussian_mgf()
    assert sp.simplify(mgf - sp.exp(s**2 / 2)) == 0


def test_prf_symbolic_check_catches_a_wrong_normaliser() -> None:
    """Negative control: exp(w u - u^2) (normaliser doubled) does not average to exp(xy),
    neither by the term-wise expectation nor by direct integration."""
    w, x, y = sp.symbols("omega x y", real=True)
    expr = sp.exp(w * x - x**2) * sp.exp(w * y - y**2)
    assert sp.simplify(_gaussian_expectation(expr, w) - sp.exp(x * y)) != 0
    density = sp.exp(-(w**2) / 2) / sp.sqrt(2 * sp.pi)
    direct = sp.integrate(expr * density, (w, -sp.oo, sp.oo))
    assert sp.simplify(direct - _gaussian_expectation(expr, w)) == 0


@pytest.mark.parametrize(
    "fm",
    [
        PositiveRandomFeatures(16, 64, generator=gen(0)),
        HyperbolicPositiveRandomFeatures(16, 64, orthogonal=True, generator=gen(0)),
        ComplexExponentialFeatures(16, 64, rule="fixed", matrix=2.0, generator=gen(0)),
        HyperbolicComplexExponentialFeatures(16, 64, rule="fixed", matrix=0.5, generator=gen(0)),
    ],
    ids=["prf", "prf-hyperbolic-orth", "cexp", "hcexp"],
)
def test_prf_features_positive_and_finite_log_features(fm) -> None:  # type: ignore[no-untyped-def]
    """FM002: features > 0; log features finite at norm 10 (where exp itself underflows)."""
    x = torch.randn(64, 16)
    for scale in (0.1, 1.0, 3.0):
        xs = x / x.norm(dim=-1, keepdim=True) * scale
        assert bool((fm.query(xs) > 0).all()) and bool((fm.key(xs) > 0).all())
    big = x / x.norm(dim=-1, keepdim=True) * 10.0
    assert bool(torch.isfinite(fm.query_log(big)).all()) and bool(torch.isfinite(fm.key_log(big)).all())
