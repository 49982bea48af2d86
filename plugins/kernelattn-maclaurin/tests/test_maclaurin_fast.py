"""The hand-written backward passes of ``fast.py`` against their composed forms and the
row-by-row references of ``naive.py``: outputs, gradients (gradcheck in float64) and
second derivatives (gradgradcheck, the ``create_graph`` route)."""

from __future__ import annotations

import pytest
import torch
from kernelattn_maclaurin.fast import (
    degree_products,
    degree_products_composed,
    signed_power,
    signed_power_composed,
    unit_rows,
    unit_rows_composed,
)
from kernelattn_maclaurin.feature_maps import RandomMaclaurinFeatures
from kernelattn_maclaurin.naive import pre_sbn_naive, rmf_features_naive


def _map(**options) -> RandomMaclaurinFeatures:
    fm = RandomMaclaurinFeatures(generator=torch.Generator().manual_seed(3), **options)
    fm.build(5)
    return fm.double()


def _args(fm: RandomMaclaurinFeatures, x: torch.Tensor):
    return fm.omega.to(x.dtype), fm.weights.to(x.dtype), tuple(fm.groups()), fm.mode == "released"


@pytest.mark.parametrize(
    "options",
    [{"num_features": 24}, {"num_features": 24, "mode": "released", "max_degree": 6}, {"num_features": 12, "p": 1.3}],
    ids=str,
)
def test_degree_products_equal_the_references_with_gradients(options) -> None:
    fm = _map(**options)
    assert max(n for n, _ in fm.groups()) >= 3  # the prefix/suffix branch runs
    x = (0.5 * torch.randn(2, 7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))).requires_grad_()
    fast = degree_products(x, *_args(fm, x))
    w = torch.randn(fast.shape, dtype=torch.float64)
    for ref in (degree_products_composed(x, *_args(fm, x)), rmf_features_naive(fm, x)):
        torch.testing.assert_close(fast, ref, rtol=1e-13, atol=1e-15)
        (g_fast,) = torch.autograd.grad((fast * w).sum(), x, retain_graph=True)
        (g_ref,) = torch.autograd.grad((ref * w).sum(), x)
        torch.testing.assert_close(g_fast, g_ref, rtol=1e-12, atol=1e-14)
    x3 = x.detach()[:1, :3].clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: degree_products(t, *_args(fm, t)), (x3,))
    assert torch.autograd.gradgradcheck(lambda t: degree_products(t, *_args(fm, t)), (x3,))


def test_degree_products_gradient_is_exact_where_a_factor_is_zero() -> None:
    """``prod``'s own backward divides by the factors; the co-products here do not, so a
    zero factor (a projection orthogonal to x) still gives the other factors' product."""
    fm = _map(num_features=24)
    omega = fm.omega.clone()
    x = torch.zeros(1, 5, dtype=torch.float64)
    x[0, 0] = 0.7
    omega[:, 0] = torch.where(torch.arange(omega.shape[0]) % 2 == 0, 0.0, omega[:, 0])  # half the factors are 0
    xs = x.clone().requires_grad_()
    args = (omega, fm.weights.double(), tuple(fm.groups()), False)
    w = torch.randn(1, 24, dtype=torch.float64)
    (g_fast,) = torch.autograd.grad((degree_products(xs, *args) * w).sum(), xs)
    (g_ref,) = torch.autograd.grad((degree_products_composed(xs, *args) * w).sum(), xs)
    assert bool((g_ref != 0).any())
    torch.testing.assert_close(g_fast, g_ref, rtol=1e-12, atol=1e-14)


def test_unit_rows_equal_the_references_and_zero_a_constant_row() -> None:
    x = torch.randn(2, 3, 4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x[0, 0, 1] = 2.5  # constant row
    xs = x.clone().requires_grad_()
    fast = unit_rows(xs, 0.5)
    torch.testing.assert_close(fast, 0.5 * pre_sbn_naive(x).nan_to_num(0.0), rtol=1e-13, atol=1e-15)
    assert bool((fast[0, 0, 1] == 0).all())
    w = torch.randn(fast.shape, dtype=torch.float64)
    (g_fast,) = torch.autograd.grad((fast * w).sum(), xs)
    xr = x.clone().requires_grad_()
    (g_ref,) = torch.autograd.grad((unit_rows_composed(xr, 0.5) * w).sum(), xr)
    torch.testing.assert_close(g_fast, g_ref, rtol=1e-12, atol=1e-14)
    assert bool((g_fast[0, 0, 1] == 0).all())
    x3 = x[1, :1, :2].clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: unit_rows(t, 0.7), (x3,))
    assert torch.autograd.gradgradcheck(lambda t: unit_rows(t, 0.7), (x3,))


@pytest.mark.parametrize("channels", [None, 4])
def test_signed_power_equals_the_composed_form_with_gradients(channels) -> None:
    shape = () if channels is None else (channels,)
    a = torch.randn(2, 3, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    a[0, 0, 0] = 0.0  # at the clamp: a zero gradient in a, a finite one in beta
    beta = (0.7 + 0.2 * torch.rand(shape, dtype=torch.float64)).requires_grad_()
    gamma = (1.5 + torch.rand(shape, dtype=torch.float64)).requires_grad_()
    inputs = (a.clone().requires_grad_(), beta, gamma)
    w = torch.randn(a.shape, dtype=torch.float64)
    fast = signed_power(*inputs)
    ref = signed_power_composed(*inputs)
    torch.testing.assert_close(fast, ref, rtol=1e-14, atol=0.0)
    g_fast = torch.autograd.grad((fast * w).sum(), inputs)
    g_ref = torch.autograd.grad((ref * w).sum(), inputs)
    for gf, gr in zip(g_fast, g_ref):
        assert bool(torch.isfinite(gf).all())
        torch.testing.assert_close(gf, gr, rtol=1e-12, atol=1e-14)
    assert bool((g_fast[0][0, 0, 0] == 0).all())
    small = (a[1, :1, :2].clone().requires_grad_(), beta, gamma)  # away from 0: smooth
    assert torch.autograd.gradcheck(signed_power, small)
    assert torch.autograd.gradgradcheck(signed_power, small)
