"""Theorems 2 and 3 of Macformer / SchoenbAt as executable statements (spec 001 §6.2-6.3;
tests D3, D5, M6)."""

from __future__ import annotations

import math

import pytest
import torch
from kernelattn_maclaurin.theory import (
    premise_violation_rate,
    required_features,
    theorem2_bound,
    theorem3_counterexample,
)

from kernelattn_core.toolkit import InputError

# spec 001 §6.2, L = 1: bound values and the smallest D with bound <= 0.05
TABLE = {
    (64, 0.05): 118,
    (64, 0.1): 92.9,
    (64, 0.25): 17.3,
    (64, 0.5): 0.0429,
    (128, 0.05): 218,
    (128, 0.1): 135,
    (128, 0.25): 4.69,
    (128, 0.5): 2.88e-5,
    (256, 0.25): 0.172,
    (1024, 0.1): 12.2,
    (4096, 0.1): 1.04e-5,
}


@pytest.mark.parametrize(("key", "value"), TABLE.items(), ids=[f"D{k[0]}-eps{k[1]}" for k in TABLE])
def test_d5_theorem2_calculator_reproduces_the_table(key: tuple[int, float], value: float) -> None:
    assert theorem2_bound(*key) == pytest.approx(value, rel=6e-3)


@pytest.mark.parametrize(("eps", "d_min"), [(0.05, 10347), (0.1, 2285), (0.25, 301), (0.5, 63)])
def test_d5_required_features(eps: float, d_min: int) -> None:
    assert required_features(eps, 0.05) == d_min
    assert theorem2_bound(d_min, eps) <= 0.05 < theorem2_bound(d_min - 1, eps)


def test_d5_bound_scales_with_L_and_rejects_bad_input() -> None:
    assert theorem2_bound(128, 1.0, bound=2.0) == pytest.approx(theorem2_bound(128, 0.5))
    assert required_features(0.2, 0.05, bound=2.0) == required_features(0.1, 0.05)
    assert math.isclose(theorem2_bound(1, 0.1), 2 * math.exp(-0.005))
    with pytest.raises(InputError, match="eps"):
        theorem2_bound(10, 0.0)
    with pytest.raises(InputError, match="num_features"):
        theorem2_bound(0, 0.1)


def test_m6_theorem2_premise_fails_with_positive_probability() -> None:
    low = premise_violation_rate(num_features=2, trials=600, seed=0)
    high = premise_violation_rate(num_features=64, trials=100, seed=1)
    assert low > 0.01  # spec: about 5 % of entries at D = 2 (d = 4, N = 8)
    assert high < low  # the violation shrinks as D grows


def test_d3_theorem3_is_not_an_identity() -> None:
    left, right, r = theorem3_counterexample(seq_len=5, dim=4, seed=0)
    assert left.tolist() == pytest.approx([1.0] * 5, abs=1e-15)  # convex combination of ones
    assert r > 1
    assert bool((right > 1.01).all())  # every entry of the "restored" side is off by more than 1 %
    # spec 001 §3.1: sigma is a variance (pre-SBN divides by sqrt(sigma + eps)); with
    # standard deviations r was 14.04, not the spec's 15.08
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, generator=g, dtype=torch.float64)
    k = torch.randn(5, 4, generator=g, dtype=torch.float64)
    expected = float(torch.linalg.matrix_norm(q, ord=2) * torch.linalg.matrix_norm(k, ord=2)) * math.sqrt(
        float(q.var() * k.var())
    )
    assert r == pytest.approx(expected, rel=1e-9)


@pytest.mark.slow
def test_m5_nmse_falls_as_one_over_d_with_the_papers_magnitude() -> None:
    from kernelattn_maclaurin.theory import loglog_slope, nmse_by_budget

    values = nmse_by_budget((16, 64, 256), n=200, dim=64, repeats=4)
    assert loglog_slope(values) == pytest.approx(-1.0, abs=0.25)
    assert 1e-4 < values[256] < 6e-4  # spec anchor: 3.0e-4 at n = 200, d = 64, D = 256
