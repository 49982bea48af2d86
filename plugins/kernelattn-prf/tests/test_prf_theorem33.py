"""Theorem 3.3 of the CEXP paper: the radius (chi-square quantile) with a coverage test,
and the Hotelling reading for estimated parameters (spec 004 §2.4)."""

from __future__ import annotations

import math

import pytest
import torch
from kernelattn_prf.theory import (
    chi2_quantile,
    hcexp_relative_rms_bound,
    hotelling_new_observation_quantile,
    theorem33_radius,
)


@pytest.mark.parametrize(
    ("q", "dof", "value"),
    [(0.99736945, 6, 20.1254), (0.999789301169, 50, 93.052003), (0.999947321130, 50, 98.416594)],
)
def test_chi2_quantile_reference_values(q: float, dof: int, value: float) -> None:
    assert chi2_quantile(q, dof) == pytest.approx(value, abs=1e-4)


def test_chi2_quantile_closed_form_in_two_dimensions() -> None:
    for q in (0.1, 0.5, 0.707106781187, 0.99):
        assert chi2_quantile(q, 2) == pytest.approx(-2 * math.log1p(-q), rel=1e-12)


def _setting(d: int = 6) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    mu_x, mu_y = (
        0.3 * torch.randn(d, generator=g, dtype=torch.float64),
        0.3 * torch.randn(d, generator=g, dtype=torch.float64),
    )
    var_x = 0.2 + torch.rand(d, generator=g, dtype=torch.float64)
    var_y = 0.2 + torch.rand(d, generator=g, dtype=torch.float64)
    a = torch.diag(((var_y + mu_y**2) / (var_x + mu_x**2)) ** 0.25)  # Lemma 3.4
    return a, mu_x, torch.diag(var_x), mu_y, torch.diag(var_y)


def _coverage(r: float, s: int, trials: int, a, mu_x, cov_x, mu_y, cov_y) -> float:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(11)
    d = a.shape[0]
    a_inv_t = torch.linalg.inv(a).T
    lx, ly = torch.linalg.cholesky(cov_x), torch.linalg.cholesky(cov_y)
    x = mu_x + torch.randn(trials, s, d, generator=g, dtype=torch.float64) @ lx.T
    y = mu_y + torch.randn(trials, s, d, generator=g, dtype=torch.float64) @ ly.T
    nx = (x @ a.T).norm(dim=-1).amax(-1)
    ny = (y @ a_inv_t.T).norm(dim=-1).amax(-1)
    return float(((nx <= r) & (ny <= r)).double().mean())


def test_theorem33_radius_covers_with_probability_p_and_a_wrong_exponent_does_not() -> None:
    a, mu_x, cov_x, mu_y, cov_y = _setting()
    p, s = 0.9, 20
    r = theorem33_radius(a, mu_x, cov_x, mu_y, cov_y, p, s)
    covered = _coverage(r, s, 4000, a, mu_x, cov_x, mu_y, cov_y)
    assert covered >= p  # the theorem's guarantee (conservative: Rayleigh + union of 2s events)
    # isotropic, centred case: Rayleigh is tight and coverage is exactly p = q^(2s)
    eye, zero = torch.eye(6, dtype=torch.float64), torch.zeros(6, dtype=torch.float64)
    r_iso = theorem33_radius(eye, zero, eye, zero, eye, p, s)
    assert r_iso == pytest.approx(math.sqrt(chi2_quantile(p ** (1 / (2 * s)), 6)), rel=1e-12)
    trials = 4000
    hit = _coverage(r_iso, s, trials, eye, zero, eye, zero, eye)
    assert abs(hit - p) < 3 * math.sqrt(p * (1 - p) / trials)
    # negative control: the per-point quantile chi2(p) instead of chi2(p^(1/2s)) covers ~p^(2s)
    r_wrong = math.sqrt(chi2_quantile(p, 6))
    assert _coverage(r_wrong, s, trials, eye, zero, eye, zero, eye) < 0.05
    assert math.isfinite(hcexp_relative_rms_bound(r, 64))


def test_hotelling_new_observation_coverage() -> None:
    """With mean and covariance estimated from n samples, a new observation's T^2 falls
    below the Hotelling quantile with probability q (Monte Carlo, 3 standard errors);
    the chi-square quantile (known parameters) under-covers at n = 12."""
    n, d, q, trials = 12, 4, 0.9, 4000
    g = torch.Generator().manual_seed(5)
    samples = torch.randn(trials, n + 1, d, generator=g, dtype=torch.float64)
    train, new = samples[:, :n], samples[:, n]
    mean = train.mean(1)
    cov = (train - mean[:, None]).transpose(1, 2) @ (train - mean[:, None]) / (n - 1)
    diff = (new - mean).unsqueeze(-1)
    t2 = (diff.transpose(1, 2) @ torch.linalg.solve(cov, diff)).reshape(-1)
    hit = float((t2 <= hotelling_new_observation_quantile(q, n, d)).double().mean())
    se = math.sqrt(q * (1 - q) / trials)
    assert abs(hit - q) < 3 * se
    assert float((t2 <= chi2_quantile(q, d)).double().mean()) < q - 5 * se
