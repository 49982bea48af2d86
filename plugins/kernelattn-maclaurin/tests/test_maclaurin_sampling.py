"""The degree law (SP001): normalisation for symbolic p, the papers' erratum, sampling."""

from __future__ import annotations

import math

import pytest
import sympy
import torch
from kernelattn_maclaurin import DegreeDistribution, degree_distribution
from kernelattn_maclaurin.feature_maps import RandomMaclaurinFeatures

from kernelattn_core.toolkit import InputError

N = sympy.Symbol("n", integer=True, nonnegative=True)
Q = sympy.Symbol("q", positive=True)  # p = 1 + q covers every p > 1


def _sum(expr, start, stop=sympy.oo):
    total = sympy.Sum(expr, (N, start, stop)).doit()
    if isinstance(total, sympy.Piecewise):
        total = total.args[0][0]
    return sympy.simplify(total)


def test_normalised_geometric_pmf_sums_to_one_for_symbolic_p():
    """SP001: sum_n (p-1)/p^(n+1) = 1 for every p > 1 (p = 1 + q, q > 0 symbolic)."""
    pmf = DegreeDistribution(2.0, 0, None).sympy_pmf(N, 1 + Q)
    assert sympy.simplify(pmf - Q / (1 + Q) ** (N + 1)) == 0
    assert _sum(pmf, 0) == 1


def test_papers_pmf_does_not_sum_to_one_unless_p_is_two():
    """Negative control: the printed 1/p^(n+1) sums to 1/(p-1), i.e. 1/q."""
    total = _sum(1 / (1 + Q) ** (N + 1), 0)
    assert sympy.simplify(total - 1 / Q) == 0
    assert total.subs(Q, 1) == 1  # p = 2: the only p where the papers' form is a law
    assert total.subs(Q, 2) == sympy.Rational(1, 2)  # p = 3


def test_released_truncated_law_sums_to_one_for_symbolic_p():
    pmf = DegreeDistribution(2.0, 1, 20).sympy_pmf(N, 1 + Q)
    assert sympy.simplify(sympy.Sum(pmf, (N, 1, 20)).doit()) == 1


@pytest.mark.parametrize(("start", "stop"), [(0, None), (0, 5), (1, 20), (2, 3)])
@pytest.mark.parametrize("p", [1.3, 2.0, 3.5])
def test_log_pmf_sums_to_one_numerically(p, start, stop):
    dist = DegreeDistribution(p, start, stop)
    top = stop if stop is not None else 400
    n = torch.arange(0, top + 1, dtype=torch.float64)
    total = float(dist.log_pmf(n).exp().sum())
    assert abs(total - 1.0) < 1e-12
    assert float(dist.log_pmf(torch.tensor([start - 1.0])).exp()) == 0.0


@pytest.mark.parametrize("dist", [DegreeDistribution(2.0), DegreeDistribution(3.0), DegreeDistribution(2.0, 1, 4)])
def test_sampler_frequencies_match_the_pmf(dist):
    """Inversion sampling: each degree's count is within 5 binomial standard errors."""
    g = torch.Generator().manual_seed(3)
    draws = 200_000
    n = dist.sample(torch.rand(draws, generator=g, dtype=torch.float64))
    for k in range(dist.start, dist.start + 6):
        prob = dist.pmf(k)
        count = int((n == k).sum())
        se = math.sqrt(draws * prob * (1 - prob)) + 1e-9
        assert abs(count - draws * prob) < 5 * se + 1e-9, (k, count, draws * prob)
    assert int(n.min()) >= dist.start
    if dist.stop is not None:
        assert int(n.max()) <= dist.stop
    assert abs(float(n.double().mean()) - dist.mean()) < 0.02


def test_sampler_negative_control_detects_the_papers_weights():
    """The sampler really follows (p-1)/p^(n+1): at p = 3 P[N=0] = 2/3, not the papers' 1/3."""
    dist = DegreeDistribution(3.0)
    n = dist.sample(torch.rand(100_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    frac0 = float((n == 0).double().mean())
    assert abs(frac0 - 2 / 3) < 0.01 and abs(frac0 - 1 / 3) > 0.3


def test_modes_and_bad_parameters():
    assert degree_distribution(2.0, "paper", None) == DegreeDistribution(2.0, 0, None)
    assert degree_distribution(2.0, "released", None) == DegreeDistribution(2.0, 1, 20)
    for bad in (1.0, 0.5, math.inf, True):
        with pytest.raises(InputError, match="p: expected a finite number > 1"):
            DegreeDistribution(bad)
    with pytest.raises(InputError, match="mode"):
        degree_distribution(2.0, "other", None)
    with pytest.raises(InputError, match="max_degree"):
        RandomMaclaurinFeatures(head_dim=4, num_features=8, mode="released", max_degree=0)
