"""Rules for A (means, variance, full), their guards, and the statistics lifecycle of prepare()."""

from __future__ import annotations

import pytest
import torch
from kernelattn_prf import ComplexExponentialFeatures, HyperbolicComplexExponentialFeatures
from kernelattn_prf.adaptation import (
    full_matrices,
    geometric_mean_matrix,
    means_scale,
    moments,
    surrogate_objective,
    variance_scale,
)

F64 = torch.float64


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_prf_variance_rule_worked_example() -> None:
    """Spec §2.5: sigma_x^2 = (0.5, 1), mu_x = (1, 0), sigma_y^2 = (0.1, 0.2), mu_y = (2, -1)."""
    a = variance_scale(
        torch.tensor([1.0, 0.0], dtype=F64),
        torch.tensor([0.5, 1.0], dtype=F64),
        torch.tensor([2.0, -1.0], dtype=F64),
        torch.tensor([0.1, 0.2], dtype=F64),
    )
    torch.testing.assert_close(a, torch.tensor([1.285799194671664, 1.046635139392106], dtype=F64), rtol=1e-14, atol=0)
    # the means rule on the same example: sqrt(2) and, unguarded, infinity; guarded, sqrt(1 / eps)
    b = means_scale(torch.tensor([1.0, 0.0], dtype=F64), torch.tensor([2.0, -1.0], dtype=F64), eps=1e-6)
    torch.testing.assert_close(b, torch.tensor([2**0.5, 1e3], dtype=F64), rtol=1e-14, atol=0)


def test_prf_variance_rule_with_zero_variance_is_the_means_rule() -> None:
    g = gen(0)
    mu_x, mu_y = torch.randn(7, generator=g, dtype=F64), torch.randn(7, generator=g, dtype=F64)
    zero = torch.zeros(7, dtype=F64)
    torch.testing.assert_close(variance_scale(mu_x, zero, mu_y, zero), means_scale(mu_x, mu_y), rtol=1e-14, atol=0)


def test_prf_variance_rule_minimises_the_surrogate() -> None:
    """Lemma 3.4: a = (S_y / S_x)^{1/4} minimises sum a^2 S_x + S_y / a^2; perturbations increase it."""
    g = gen(1)
    x = 0.5 * torch.randn(300, 5, generator=g, dtype=F64) + torch.randn(5, generator=g, dtype=F64)
    y = 0.2 * torch.randn(300, 5, generator=g, dtype=F64) - 0.3
    mx, my = moments(x, full=True), moments(y, full=True)
    a = variance_scale(mx.mean, mx.var, my.mean, my.var)
    assert mx.second is not None and my.second is not None
    best = surrogate_objective(torch.diag(a), torch.diag(1 / a), mx.second, my.second)
    for k in range(5):
        for f in (0.97, 1.03):
            b = a.clone()
            b[k] *= f
            assert surrogate_objective(torch.diag(b), torch.diag(1 / b), mx.second, my.second) > best


def test_prf_means_rule_minimises_z_for_the_pair_of_means() -> None:
    g = gen(2)
    mx, my = torch.randn(6, generator=g, dtype=F64), torch.randn(6, generator=g, dtype=F64)
    a = means_scale(mx, my)
    zz = ((a * mx + my / a) ** 2).sum()
    expected = 4 * (mx * my).clamp_min(0).sum()  # 4 sum_{x_i y_i > 0} x_i y_i
    torch.testing.assert_close(zz, expected, rtol=1e-12, atol=1e-12)
    for k in range(6):
        b = a.clone()
        b[k] *= 1.05
        assert ((b * mx + my / b) ** 2).sum() > zz


def test_prf_full_rule_solves_the_riccati_equation_and_beats_diagonal() -> None:
    """B M_x B = M_y, A^T A = B, A A^{-T}... inverse, minimum 2 tr((M_x^{1/2} M_y M_x^{1/2})^{1/2})."""
    g = gen(3)
    d = 5
    lx = torch.randn(d, d, generator=g, dtype=F64)
    ly = torch.randn(d, d, generator=g, dtype=F64)
    x = torch.randn(400, d, generator=g, dtype=F64) @ lx.T + torch.randn(d, generator=g, dtype=F64)
    y = 0.3 * torch.randn(400, d, generator=g, dtype=F64) @ ly.T
    mx, my = moments(x, full=True), moments(y, full=True)
    assert mx.second is not None and my.second is not None
    b = geometric_mean_matrix(mx.second, my.second, eps=1e-12)
    torch.testing.assert_close(b @ mx.second @ b, my.second, rtol=1e-9, atol=1e-9)
    a, a_inv_t = full_matrices(mx.second, my.second, eps=1e-12)
    torch.testing.assert_close(a.T @ a, b, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(a.T @ a_inv_t, torch.eye(d, dtype=F64), rtol=0, atol=1e-9)  # (A x).(A^-T y) = x.y
    value = surrogate_objective(a, a_inv_t, mx.second, my.second)
    lam, u = torch.linalg.eigh(mx.second)
    root = (u * lam.sqrt()) @ u.T
    inner = torch.linalg.eigvalsh(root @ my.second @ root)
    torch.testing.assert_close(value, 2 * inner.sqrt().sum(), rtol=1e-9, atol=0)
    diag = variance_scale(mx.mean, mx.var, my.mean, my.var)
    assert value < surrogate_objective(torch.diag(diag), torch.diag(1 / diag), mx.second, my.second)


@pytest.mark.parametrize("rule", ["means", "variance", "full"])
def test_prf_rules_are_guarded_against_zero_statistics(rule: str) -> None:
    """All-zero queries (zero means and variances): A is finite, and A = I where both sides are zero."""
    fm = ComplexExponentialFeatures(4, 8, rule=rule, generator=gen(0)).train()
    q = torch.zeros(2, 1, 10, 4)
    k = torch.zeros(2, 1, 10, 4)
    k[..., 0] = torch.randn(2, 1, 10)  # key component 0 non-zero, the rest zero
    fm.prepare(q, k)
    a_q, a_k = fm.matrices()
    assert bool(torch.isfinite(a_q).all()) and bool(torch.isfinite(a_k).all())
    torch.testing.assert_close(a_q[1:, 1:], torch.eye(3), rtol=0, atol=1e-3)
    out = fm.kernel_estimate(torch.randn(3, 4), torch.randn(3, 4))
    assert bool(torch.isfinite(out).all())


def test_prf_prepare_uses_batch_statistics_with_ddof_one() -> None:
    fm = ComplexExponentialFeatures(3, 8, rule="variance", generator=gen(0)).double().train()
    g = gen(1)
    q = torch.randn(2, 2, 6, 3, generator=g, dtype=F64) + 1.0
    k = 0.5 * torch.randn(2, 2, 6, 3, generator=g, dtype=F64) - 0.2
    fm.prepare(q, k)
    fq, fk = q.reshape(-1, 3), k.reshape(-1, 3)
    expected = ((fk.var(0, correction=1) + fk.mean(0) ** 2) / (fq.var(0, correction=1) + fq.mean(0) ** 2)) ** 0.25
    torch.testing.assert_close(fm.scale, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(fm.running_var_q, fq.var(0, correction=1), rtol=1e-12, atol=0)  # first batch


def test_prf_running_statistics_momentum_and_frozen_eval() -> None:
    fm = HyperbolicComplexExponentialFeatures(3, 8, rule="means", momentum=0.25, generator=gen(0)).double().train()
    g = gen(2)
    q1, k1 = torch.randn(40, 3, generator=g, dtype=F64) + 2, torch.randn(40, 3, generator=g, dtype=F64) + 1
    q2, k2 = torch.randn(40, 3, generator=g, dtype=F64) - 1, torch.randn(40, 3, generator=g, dtype=F64) + 3
    fm.prepare(q1, k1)
    fm.prepare(q2, k2)
    expected_mean_q = 0.75 * q1.mean(0) + 0.25 * q2.mean(0)
    torch.testing.assert_close(fm.running_mean_q, expected_mean_q, rtol=1e-12, atol=0)
    torch.testing.assert_close(fm.scale, means_scale(q2.mean(0), k2.mean(0)), rtol=1e-12, atol=0)  # batch stats
    assert int(fm.num_batches_tracked) == 2
    fm.eval()
    fm.prepare(q1 * 10, k1 * 10)  # eval: frozen, A from the running statistics
    torch.testing.assert_close(fm.running_mean_q, expected_mean_q, rtol=1e-12, atol=0)
    expected_mean_k = 0.75 * k1.mean(0) + 0.25 * k2.mean(0)
    torch.testing.assert_close(fm.scale, means_scale(expected_mean_q, expected_mean_k), rtol=1e-12, atol=0)


def test_prf_use_batch_stats_false_uses_earlier_batches_only() -> None:
    fm = ComplexExponentialFeatures(3, 8, rule="variance", use_batch_stats=False, generator=gen(0)).double().train()
    g = gen(3)
    q1, k1 = torch.randn(30, 3, generator=g, dtype=F64) + 1, torch.randn(30, 3, generator=g, dtype=F64)
    fm.prepare(q1, k1)
    torch.testing.assert_close(fm.scale, torch.ones(3, dtype=F64))  # nothing seen before: A = I
    fm.prepare(5 * q1, k1)
    m1q, m1k = moments(q1), moments(k1)
    torch.testing.assert_close(fm.scale, variance_scale(m1q.mean, m1q.var, m1k.mean, m1k.var), rtol=1e-12, atol=0)


def test_prf_fit_sets_statistics_from_data() -> None:
    fm = ComplexExponentialFeatures(4, 8, rule="full", generator=gen(0)).double()
    g = gen(4)
    x, y = torch.randn(50, 4, generator=g, dtype=F64) + 1, 0.3 * torch.randn(50, 4, generator=g, dtype=F64)
    fm.fit(x, y)
    mx, my = moments(x, full=True), moments(y, full=True)
    assert mx.second is not None and my.second is not None
    a, a_inv_t = full_matrices(mx.second, my.second, eps=1e-6)
    torch.testing.assert_close(fm.matrix_q, a, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(fm.matrix_k, a_inv_t, rtol=1e-10, atol=1e-12)


def test_prf_eval_before_any_statistics_is_identity_and_stores_nothing() -> None:
    """Eval never adapts to the batch at hand (its output would depend on the rest of the
    batch): before any statistics are tracked, A = I (plain PRF)."""
    fm = ComplexExponentialFeatures(3, 8, rule="means", generator=gen(0)).double().eval()
    g = gen(5)
    q, k = torch.randn(30, 3, generator=g, dtype=F64) + 2, torch.randn(30, 3, generator=g, dtype=F64) - 1
    fm.prepare(q, k)
    torch.testing.assert_close(fm.scale, torch.ones(3, dtype=F64), rtol=0, atol=0)
    assert not torch.allclose(means_scale(q.mean(0), k.mean(0)), torch.ones(3, dtype=F64))
    assert int(fm.num_batches_tracked) == 0
    torch.testing.assert_close(fm.running_mean_q, torch.zeros(3, dtype=F64))


def test_prf_moments_single_sample_and_identity_fit() -> None:
    m = moments(torch.tensor([[1.0, -2.0]], dtype=F64), full=True)
    assert m.count == 1 and torch.equal(m.var, torch.zeros(2, dtype=F64))  # ddof 0 for one sample, no NaN
    assert m.second is not None
    torch.testing.assert_close(m.second, torch.tensor([[1.0, -2.0], [-2.0, 4.0]], dtype=F64))
    fm = ComplexExponentialFeatures(2, 4, rule="identity", generator=gen(0))
    fm.fit(torch.randn(5, 2) + 3, torch.randn(5, 2))
    a_q, a_k = fm.matrices()
    assert torch.equal(a_q, torch.eye(2)) and torch.equal(a_k, torch.eye(2))


@pytest.mark.parametrize("name", ["cexp", "hcexp"])
@pytest.mark.parametrize("train", [True, False])
def test_prf_adaptive_map_refuses_another_head_dim_naming_the_input(name: str, train: bool) -> None:
    """Built for d = 16, given d = 8: refused before a statistic is copied into A (a
    RuntimeError from ``copy_`` before)."""
    import kernelattn_core as ka

    est = ka.create(name, head_dim=16).train(train)
    x = torch.randn(2, 2, 6, 8)
    with pytest.raises(ka.InputError, match=r"q: expected last dimension d = 16, got shape \(2, 2, 6, 8\)"):
        ka.kernel_attention(x, x, x, est)
