"""Orthogonal random features: block orthogonality, Haar sign correction, norms, lower MSE."""

from __future__ import annotations

import math

import pytest
import torch
from kernelattn_prf import HyperbolicPositiveRandomFeatures, PositiveRandomFeatures
from kernelattn_prf.diagnostics import grouped_estimates, per_omega_estimates
from kernelattn_prf.naive import gram_schmidt_orthogonal
from kernelattn_prf.sampling import haar_orthogonal


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(("d", "m"), [(8, 20), (16, 64), (64, 100)])
@pytest.mark.parametrize("norm", ["chi", "fixed"])
def test_prf_rows_orthogonal_within_each_block(d: int, m: int, norm: str) -> None:
    fm = PositiveRandomFeatures(d, m, orthogonal=True, norm=norm, generator=gen(0))  # float32 buffers
    w = fm.omega
    for start in range(0, m, d):
        block = w[start : start + d]  # [<=d, d]
        unit = block / block.norm(dim=-1, keepdim=True)
        gram = unit @ unit.T
        assert float((gram - torch.eye(block.shape[0])).abs().max()) < 1e-5
    if norm == "fixed":
        torch.testing.assert_close(w.norm(dim=-1), torch.full((m,), math.sqrt(d)), rtol=1e-5, atol=0)
    # rows of different blocks are not orthogonal (negative control of the check above)
    if m > d:
        cross = (w[0] / w[0].norm()) @ (w[d] / w[d].norm())
        assert abs(float(cross)) > 1e-5


def test_prf_chi_norms_have_the_gaussian_second_moment() -> None:
    """chi norms: E|w|^2 = d, so every row is marginally N(0, I) (mean of |w|^2 / d within 4 se)."""
    d, m = 16, 16 * 2000
    w = PositiveRandomFeatures(d, m, orthogonal=True, generator=gen(1)).double().omega
    sq = (w * w).sum(-1) / d  # chi^2_d / d: mean 1, variance 2/d
    assert abs(float(sq.mean()) - 1) < 4 * math.sqrt(2 / d / m)
    assert float(sq.var()) == pytest.approx(2 / d, rel=0.1)


def test_prf_sign_corrected_qr_equals_gram_schmidt() -> None:
    """QR with the sign correction is the QR with positive diag(R), which Gram-Schmidt computes."""
    g = torch.randn(5, 6, 6, generator=gen(2), dtype=torch.float64)
    torch.testing.assert_close(haar_orthogonal(g), gram_schmidt_orthogonal(g), rtol=0, atol=1e-10)
    q_raw, _ = torch.linalg.qr(g)
    assert not torch.allclose(q_raw, gram_schmidt_orthogonal(g), atol=1e-6)  # raw QR differs in signs


def test_prf_haar_diagonal_has_zero_mean() -> None:
    """Haar: E[Q_ii] = 0. LAPACK's Householder QR fixes the signs of diag(R) by convention,
    so the diagonal of the raw Q is biased (negative control): its mean is far from zero,
    while the sign-corrected one's is within noise."""
    n, d = 4000, 4
    g = torch.randn(n, d, d, generator=gen(3), dtype=torch.float64)
    q = haar_orthogonal(g)
    q_raw, _ = torch.linalg.qr(g)
    se = 1 / math.sqrt(d * n)  # Var(Q_ii) = 1/d under Haar
    diag = torch.diagonal(q, dim1=-2, dim2=-1)  # [n, d]
    diag_raw = torch.diagonal(q_raw, dim1=-2, dim2=-1)
    assert float(diag.mean(0).abs().max()) < 5 * se
    assert float(diag_raw.mean(0).abs().max()) > 20 * se


@pytest.mark.parametrize("cls", [PositiveRandomFeatures, HyperbolicPositiveRandomFeatures])
def test_prf_orthogonal_has_lower_kernel_mse_than_iid(cls: type) -> None:
    """Equal m = d: the block-orthogonal estimator's MSE is below the iid one's."""
    d, reps = 16, 8000
    g = gen(4)
    x = torch.randn(8, d, generator=g, dtype=torch.float64)
    y = torch.randn(8, d, generator=g, dtype=torch.float64)
    x = x / x.norm(dim=-1, keepdim=True) * 0.8
    y = y / y.norm(dim=-1, keepdim=True) * 0.8
    sm = (x * y).sum(-1).exp()
    mses = {}
    for orth in (False, True):
        fm = cls(d, d * reps, orthogonal=orth, generator=gen(5)).double()
        est = grouped_estimates(per_omega_estimates(fm, x, y), d)  # reps maps with m = d
        mses[orth] = float((((est - sm[:, None]) / sm[:, None]) ** 2).mean())
    print(cls.name, "relative MSE iid", mses[False], "orthogonal", mses[True])
    assert mses[True] < 0.95 * mses[False]  # measured ratios 0.68-0.85 (PRF), 0.36-0.44 (hyperbolic) over seeds


def test_prf_redraw_is_deterministic_and_buffers_move() -> None:
    a = PositiveRandomFeatures(8, 20, orthogonal=True, generator=gen(9))
    b = PositiveRandomFeatures(8, 20, orthogonal=True, generator=gen(9))
    assert torch.equal(a.omega, b.omega)
    before = a.omega.clone()
    a.redraw(generator=gen(10))
    assert not torch.equal(before, a.omega)
    assert "omega" in a.state_dict()
