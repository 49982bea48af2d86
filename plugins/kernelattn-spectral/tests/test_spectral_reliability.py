"""Reliability of the spectral-gmm kernel (issue #15): a row-scaled kernel matrix whose
attention has finite outputs and gradients at scaled norm 10, and masks that replace."""

from __future__ import annotations

import pytest
import torch
from kernelattn_spectral.kernels import SpectralMixtureKernel

D64 = torch.float64


def _kernel(d=4, dtype=D64):
    g = torch.Generator().manual_seed(0)
    return SpectralMixtureKernel(
        torch.randn(3, d, generator=g, dtype=dtype), torch.rand(3, d, generator=g, dtype=dtype) + 0.5
    )


def _attend(w, v):
    den = w.sum(-1, keepdim=True)
    return (w @ v) / torch.where(den == 0, torch.ones_like(den), den)


def _rows(norm, shape=(2, 2, 8, 4), seed=0, dtype=torch.float32):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=D64)
    return (x / x.norm(dim=-1, keepdim=True) * norm).to(dtype)


def test_spectral_row_scaled_matrix_is_the_kernel_up_to_a_per_row_factor() -> None:
    kern = _kernel()
    q, k, v = _rows(0.8, dtype=D64), _rows(0.8, seed=1, dtype=D64), _rows(1.0, seed=2, dtype=D64)
    full = kern(q, k)
    scaled = kern.row_scaled_matrix(q, k)
    ratio = full / scaled
    torch.testing.assert_close(ratio, ratio[..., :1].expand_as(ratio))  # one factor per row
    assert bool((ratio > 0).all())
    torch.testing.assert_close(_attend(scaled, v), _attend(full, v), rtol=1e-12, atol=1e-12)
    tril = torch.ones(8, 8, dtype=torch.bool).tril()
    torch.testing.assert_close(
        _attend(kern.row_scaled_matrix(q, k, tril), v), _attend(full.masked_fill(~tril, 0.0), v), rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize(("seed", "causal"), [(1, False), (3, False), (0, True), (1, True)])
def test_spectral_row_scaled_attention_finite_gradients_at_norm_10(seed, causal) -> None:
    """The default kernel (RBF) at input norm 10: every kernel value of some rows is
    subnormal, and the plain matrix gives NaN q gradients (the negative control)."""
    kern = SpectralMixtureKernel()
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 2, 8, 4, generator=g) for _ in range(3))
    q = (q / q.norm(dim=-1, keepdim=True) * 10).requires_grad_()
    k = (k / k.norm(dim=-1, keepdim=True) * 10).requires_grad_()
    allowed = torch.ones(8, 8, dtype=torch.bool).tril() if causal else None
    plain = kern(q, k) if allowed is None else kern(q, k).masked_fill(~allowed, 0.0)
    (gp,) = torch.autograd.grad(_attend(plain, v).sum(), q)
    assert not torch.isfinite(gp).all(), "negative control: the plain kernel matrix gives NaN gradients here"
    out = _attend(kern.row_scaled_matrix(q, k, allowed), v)
    assert torch.isfinite(out).all()
    gq, gk = torch.autograd.grad(out.sum(), (q, k))
    assert torch.isfinite(gq).all() and torch.isfinite(gk).all()


def test_spectral_row_scaled_matrix_future_nan_key_reaches_no_earlier_row() -> None:
    kern = _kernel()
    q, k, v = _rows(1.0, dtype=D64), _rows(1.0, seed=1, dtype=D64), _rows(1.0, seed=2, dtype=D64)
    k2 = k.clone()
    k2[:, :, 6] = float("nan")
    tril = torch.ones(8, 8, dtype=torch.bool).tril()
    qq = q.clone().requires_grad_()
    out = _attend(kern.row_scaled_matrix(qq, k2, tril), v)
    ref = _attend(kern.row_scaled_matrix(q, k, tril), v)
    torch.testing.assert_close(out[:, :, :6], ref[:, :, :6])
    (g,) = torch.autograd.grad(out[:, :, :6].sum(), qq)
    assert torch.isfinite(g[:, :, :6]).all()
