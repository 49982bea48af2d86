"""Attention through the entry point: rff, trig-softmax and rfa against the quadratic
reference, causality, masks, dtypes, and the signed-row normaliser."""

from __future__ import annotations

import pytest
import torch
from kernelattn_fourier import naive
from kernelattn_fourier.estimators import RFAAttention, TrigSoftmaxAttention
from kernelattn_fourier.normalizers import SignedRowNormalizer

import kernelattn_core as ka
from kernelattn_core.toolkit import feature_attention_naive

CASES = [("rff", {"num_features": 64}), ("trig-softmax", {}), ("rfa", {})]


def _qkv(dtype: torch.dtype = torch.float64, n: int = 10, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 3, n, 8, generator=g, dtype=torch.float64).to(dtype) for _ in range(3))


def _reference(est, q, k, v, causal, mask):  # type: ignore[no-untyped-def]
    """Quadratic reference: full feature matrix, masks, then the estimator's normaliser."""
    qs, ks = est.transform(q, k)
    fm = est.feature_map
    num, den = feature_attention_naive(
        fm.query(qs), fm.key(ks), v, log_space=False, causal=causal, key_padding_mask=mask
    )
    norm = est.normalizer
    if isinstance(norm, SignedRowNormalizer):
        return naive.signed_row_naive(num, den, norm.eps)
    return norm.normalize(num, den)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("name", "options"), CASES)
def test_entry_point_matches_quadratic_reference(name: str, options: dict, causal: bool) -> None:
    assert ka.get_registry().plugin_of(name).name == "fourier"
    est = ka.create(name, seed=0, chunk_size=4, **options).double()
    q, k, v = _qkv()
    q.requires_grad_(True)
    v.requires_grad_(True)
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[1, 6:] = True
    out = est(q, k, v, causal=causal, key_padding_mask=mask)
    ref = _reference(est, q, k, v, causal, mask)
    print("max abs diff", float((out - ref).detach().abs().max()))
    assert torch.allclose(out, ref, rtol=1e-9, atol=1e-11)
    w = torch.randn_like(out)
    g_out = torch.autograd.grad((out * w).sum(), (q, v))
    g_ref = torch.autograd.grad((ref * w).sum(), (q, v))
    for a, b in zip(g_out, g_ref):
        assert torch.allclose(a, b, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize(("name", "options"), CASES)
def test_causal_no_leak_and_padding_ignored(name: str, options: dict) -> None:
    est = ka.create(name, seed=1, chunk_size=3, **options).double().eval()
    q, k, v = _qkv()
    out = est(q, k, v, causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 7:] += 5.0
    v2[:, :, 7:] -= 3.0
    out2 = est(q, k2, v2, causal=True)
    assert torch.allclose(out[:, :, :7], out2[:, :, :7], rtol=1e-12, atol=1e-12)
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[:, 7:] = True
    a = est(q, k, v, key_padding_mask=mask)
    b = est(q, k2, v2, key_padding_mask=mask)
    assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    mask[0] = True  # every key of batch 0 padded: zeros, not NaN
    c = est(q, k, v, key_padding_mask=mask)
    assert torch.equal(c[0], torch.zeros_like(c[0])) and torch.isfinite(c).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("name", "options"), CASES)
def test_dtypes_finite(name: str, options: dict, dtype: torch.dtype) -> None:
    est = ka.create(name, seed=0, **options).eval()
    q, k, v = _qkv(dtype, n=40)
    for causal in (False, True):
        out = est(q, k, v, causal=causal)
        assert out.dtype == dtype and torch.isfinite(out).all()


def test_trig_softmax_error_shrinks_with_features() -> None:
    q, k, v = _qkv(n=32, seed=3)
    q, k = 0.5 * q, 0.5 * k
    exact = ka.create("softmax")(q, k, v)
    err = {}
    for m in (8, 512):
        errs = [
            float((ka.create("trig-softmax", num_features=m, seed=s).double()(q, k, v) - exact).norm() / exact.norm())
            for s in range(4)
        ]
        err[m] = sum(errs) / len(errs)
    print("trig-softmax relative error", err)
    assert err[512] < 0.5 * err[8]


def test_rfa_scale_is_learned_per_head() -> None:
    est = RFAAttention(num_features=16, num_heads=3, seed=0)
    q, k, v = _qkv(torch.float32)
    est(q, k, v).square().sum().backward()
    grad = est.feature_map.log_scale.grad
    assert grad is not None and grad.shape == (3,) and bool((grad != 0).all())
    assert TrigSoftmaxAttention.name == "trig-softmax" and isinstance(
        TrigSoftmaxAttention().normalizer, SignedRowNormalizer
    )


# --------------------------------------------------------------------------- signed-row
def test_signed_row_equals_ratio_when_well_conditioned_and_naive() -> None:
    g = torch.Generator().manual_seed(0)
    num = torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64)
    den = 1.0 + torch.rand(2, 3, 5, generator=g, dtype=torch.float64)
    out = SignedRowNormalizer(1e-2).normalize(num, den)
    ratio = num / den.unsqueeze(-1)
    assert torch.allclose(out, ratio, rtol=1e-3)  # shrink 1/(1 + eps^2 r^2), r <= ~3
    assert torch.allclose(out, naive.signed_row_naive(num, den, 1e-2), rtol=1e-12)
    neg = SignedRowNormalizer(1e-2).normalize(num, -den)  # the sign is kept
    assert torch.allclose(neg, -out, rtol=1e-12)


def test_signed_row_invariance_bound_and_negative_control() -> None:
    g = torch.Generator().manual_seed(1)
    num = torch.randn(1, 1, 200, 8, generator=g, dtype=torch.float64)
    den = torch.linspace(-1e-3, 1e-3, 200, dtype=torch.float64).reshape(1, 1, 200)  # near zero, both signs
    norm = SignedRowNormalizer(1e-2)
    out = norm.normalize(num, den)
    c = torch.exp(torch.randn(1, 1, 200, generator=g, dtype=torch.float64) * 5)  # per-query positive factor
    assert torch.allclose(norm.normalize(num * c.unsqueeze(-1), den * c), out, rtol=1e-10)
    rms = out.square().mean(-1).sqrt()
    assert float(rms.max()) <= 1 / (2 * 1e-2) + 1e-9
    plain = ka.get_registry().normalizer("row")().normalize(num, den)  # negative control: explodes
    assert float(plain.square().mean(-1).sqrt().max()) > 1e4
    zero = norm.normalize(torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 2))
    assert torch.equal(zero, torch.zeros_like(zero))
    big = norm.normalize(torch.full((1, 1, 1, 4), 1e30), torch.full((1, 1, 1), 2e30))  # no overflow in squares
    assert torch.allclose(big, torch.full_like(big, 0.5), rtol=1e-3)
    with pytest.raises(ka.InputError, match="eps"):
        SignedRowNormalizer(-1.0)
