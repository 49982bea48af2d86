"""Reliability of the trigonometric softmax features (issue #15): finite outputs and
gradients up to scaled input norm 10 in every dtype, without changing the estimate."""

from __future__ import annotations

import math

import pytest
import torch

import kernelattn_core as ka


def _at_norm(norm, shape=(2, 2, 16, 8), seed=0):
    """Rows of norm ``norm`` in the scaled coordinates the map sees (x d^(-1/4) by the estimator)."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return x / x.norm(dim=-1, keepdim=True) * norm * shape[-1] ** 0.25


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["trig-softmax", "trig-softmax-features"])
def test_fourier_trig_softmax_finite_at_scaled_norm_10(name, dtype, causal) -> None:
    est = ka.create(name, num_features=32, seed=0)
    q = _at_norm(10.0, seed=1).to(dtype).requires_grad_()
    k = _at_norm(10.0, seed=2).to(dtype).requires_grad_()
    v = torch.randn(2, 2, 16, 8).to(dtype)
    out = est(q, k, v, causal=causal)
    assert torch.isfinite(out).all(), f"{name} {dtype} causal={causal}: non-finite output"
    gq, gk = torch.autograd.grad(out.float().sum(), (q, k))
    assert torch.isfinite(gq).all() and torch.isfinite(gk).all()


def test_fourier_trig_softmax_raw_query_features_only_drop_a_per_query_factor() -> None:
    """The engine's query features are phi_q(x) e^{-|x|^2/2}: the same attention as the
    plain features at moderate norms (float64), to rounding."""
    est = ka.create("trig-softmax", num_features=64, seed=0).double()
    q, k, v = _at_norm(1.0, seed=1), _at_norm(1.0, seed=2), torch.randn(2, 2, 16, 8, dtype=torch.float64)
    out = est(q, k, v)
    fm = est.feature_map
    s = 8**-0.25
    phi_q, phi_k = fm.query(q * s), fm.key(k * s)  # the exact features
    raw = fm.raw_features(q * s, query=True)
    torch.testing.assert_close(raw * torch.exp(0.5 * (q * s).pow(2).sum(-1, keepdim=True)), phi_q)
    a = phi_q @ phi_k.transpose(-1, -2)
    ref = est.normalizer.normalize(a @ v, a.sum(-1))  # signed-row, invariant to the per-query factor
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    assert math.isfinite(float(out.abs().max()))
