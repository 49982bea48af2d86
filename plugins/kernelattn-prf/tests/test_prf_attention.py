"""The maps through kernelattn_core.create: registry, causal and padded attention, dtypes, half precision."""

from __future__ import annotations

import math

import pytest
import torch
from kernelattn_prf import ComplexExponentialFeatures, HyperbolicComplexExponentialFeatures, PositiveRandomFeatures

import kernelattn_core as ka
from kernelattn_core.toolkit import kernel_attention_naive

NAMES = ["prf", "prf-hyperbolic", "cexp", "hcexp"]


def qkv(b: int, h: int, n: int, d: int, dtype: torch.dtype, seed: int, mean: float = 0.0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g, dtype=torch.float64) + mean
    k = 0.5 * torch.randn(b, h, n, d, generator=g, dtype=torch.float64) - 0.5 * mean
    v = torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def reference(est, q, k, v, causal, mask):  # type: ignore[no-untyped-def]
    """Quadratic reference: the map's own kernel estimate matrix, masked and row-normalised."""
    qs, ks = est.transform(q, k)
    kmat = est.feature_map.kernel_estimate(qs, ks)  # [B, H, N, M]
    return kernel_attention_naive(kmat, v, causal=causal, key_padding_mask=mask)


def test_prf_registry_lists_the_maps() -> None:
    reg = ka.get_registry()
    for name in NAMES:
        cls = reg.feature_map(name)
        assert cls.name == name and cls.kernel == "softmax" and cls.log_space and cls.positive and cls.unbiased
    assert "cexp" in reg.experiments()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("padded", [False, True])
def test_prf_create_attention_matches_quadratic_reference(
    name: str, causal: bool, dtype: torch.dtype, padded: bool
) -> None:
    est = ka.create(name, num_features=64, seed=0)
    q, k, v = qkv(2, 2, 12, 8, dtype, seed=1, mean=0.5)
    mask = None
    if padded:
        mask = torch.zeros(2, 12, dtype=torch.bool)
        mask[0, 9:] = True
        mask[1, :2] = True  # leading padding: causal rows 0 and 1 see no key
    out = est(q, k, v, causal=causal, key_padding_mask=mask)
    assert out.dtype == dtype and out.shape == v.shape
    ref = reference(est, q, k, v, causal, mask)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    err = float((out - ref).norm() / ref.norm())
    print(name, causal, dtype, padded, "rel err", err)
    assert err < tol
    if padded and causal:
        assert float(out[1, :, :2].abs().max()) == 0.0  # rows with no visible key give zeros


@pytest.mark.parametrize("name", NAMES)
def test_prf_gradients_match_the_reference(name: str) -> None:
    est = ka.create(name, num_features=16, seed=3).double()
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 10, 4, torch.float64, seed=2))
    out = est(q, k, v, causal=True)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref = reference(est, q, k, v, True, None)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        assert float((g - r).norm() / r.norm()) < 1e-9


@pytest.mark.parametrize("name", ["prf", "hcexp"])
def test_prf_attention_converges_to_softmax(name: str) -> None:
    q, k, v = qkv(1, 2, 16, 8, torch.float64, seed=4)
    q = 0.5 * q  # moderate logits: PRF's variance grows like exp(|x + y|^2)
    exact = ka.create("softmax")(q, k, v)
    errs = []
    for m in (16, 4096):
        est = ka.create(name, num_features=m, seed=5, orthogonal=True).double()
        errs.append(float((est(q, k, v) - exact).norm() / exact.norm()))
    print(name, "errors", errs)
    assert errs[1] < 0.05 and errs[1] < errs[0] / 4


@pytest.mark.parametrize("name", NAMES)
def test_prf_eval_outputs_are_causal_and_ignore_padded_keys(name: str) -> None:
    est = ka.create(name, num_features=32, seed=6).double()
    q, k, v = qkv(1, 1, 10, 4, torch.float64, seed=7, mean=0.3)
    est.train()
    est(q, k, v)  # statistics from one training batch (adapted maps)
    est.eval()
    out = est(q, k, v, causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 6:] += 3.0
    v2[:, :, 6:] -= 2.0
    out2 = est(q, k2, v2, causal=True)
    assert torch.equal(out[:, :, :6], out2[:, :, :6])  # earlier outputs never see later keys
    mask = torch.zeros(1, 10, dtype=torch.bool)
    mask[0, 6:] = True
    assert torch.allclose(est(q, k, v, key_padding_mask=mask), est(q, k2, v2, key_padding_mask=mask), atol=1e-12)


def test_cexp_causal_training_never_sees_the_future() -> None:
    """Causal training sets A from earlier batches only: later keys of this batch never
    reach earlier outputs, with or without use_batch_stats. The non-causal control shows
    that batch statistics are really used there (the same change of later keys moves A)."""
    q, k, v = qkv(1, 1, 10, 4, torch.float64, seed=8, mean=0.3)
    k2 = k.clone()
    k2[:, :, 6:] += 3.0
    for use_batch in (True, False):
        outs, scales = [], []
        for keys in (k, k2):
            for causal in (True, False):
                est = ka.create("cexp", num_features=32, seed=9, rule="variance", use_batch_stats=use_batch).double()
                est.train()
                est(q, 0.5 * k, v)  # an earlier batch for the running statistics
                out = est(q, keys, v, causal=causal)
                if causal:
                    outs.append(out)
                else:
                    scales.append(est.feature_map.scale.clone())
        assert torch.equal(outs[0][:, :, :6], outs[1][:, :, :6])
        assert (not torch.equal(scales[0], scales[1])) == use_batch  # batch statistics used only when asked


def test_cexp_eval_without_statistics_is_plain_prf_and_batch_independent() -> None:
    q, k, v = qkv(2, 1, 8, 4, torch.float64, seed=3, mean=0.5)
    cexp = ka.create("cexp", num_features=16, seed=1, rule="variance").double().eval()
    prf = ka.create("prf", num_features=16, seed=1).double().eval()
    torch.testing.assert_close(cexp(q, k, v), prf(q, k, v), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cexp(q[:1], k[:1], v[:1]), cexp(q, k, v)[:1], rtol=1e-12, atol=1e-12)


def test_cexp_statistics_ignore_padded_keys() -> None:
    q, k, v = qkv(1, 1, 8, 4, torch.float64, seed=5, mean=0.4)
    mask = torch.zeros(1, 8, dtype=torch.bool)
    mask[0, 5:] = True
    k2 = k.clone()
    k2[:, :, 5:] = 40.0  # would dominate the key statistics if counted
    outs = []
    for keys in (k, k2):
        est = ka.create("cexp", num_features=16, seed=2, rule="variance").double().train()
        outs.append(est(q, keys, v, key_padding_mask=mask))
        assert torch.isfinite(est.feature_map.scale).all()
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_prf_half_precision_finite_up_to_norm_ten(name: str, dtype: torch.dtype, causal: bool) -> None:
    """Inputs whose norm after the d^{-1/4} scaling is up to 10 give finite outputs in half precision."""
    d, n = 16, 96
    g = torch.Generator().manual_seed(10)
    q = torch.randn(2, 2, n, d, generator=g)
    k = torch.randn(2, 2, n, d, generator=g)
    radius = torch.linspace(0.5, 10.0, n).view(1, 1, n, 1) * d**0.25  # scaled norms 0.5 .. 10
    q = q / q.norm(dim=-1, keepdim=True) * radius
    k = k / k.norm(dim=-1, keepdim=True) * radius.flip(2)
    v = torch.randn(2, 2, n, d, generator=g)
    est = ka.create(name, num_features=64, seed=11)
    est.train()
    out = est(q.to(dtype), k.to(dtype), v.to(dtype), causal=causal)
    assert out.dtype == dtype
    assert bool(torch.isfinite(out).all())
    assert float(out.float().abs().max()) <= float(v.abs().max()) * 1.01  # convex combinations of values
    scaled = (q * d**-0.25).norm(dim=-1).max()
    assert float(scaled) == pytest.approx(10.0, rel=1e-5)


def test_prf_half_precision_negative_control_without_log_space() -> None:
    """Negative control: the same features formed directly in float16 (no log space, no
    stabiliser) overflow or underflow, and attention becomes non-finite."""
    d, n = 16, 32
    fm = PositiveRandomFeatures(d, 64, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, d, generator=g)
    x = (x / x.norm(dim=-1, keepdim=True) * torch.linspace(0.5, 10, n).view(n, 1)).half()
    w = fm.omega.half()
    phi = torch.exp(x @ w.T - 0.5 * (x * x).sum(-1, keepdim=True)) / math.sqrt(64)  # float16 throughout
    v = torch.randn(n, d, generator=g).half()
    out = (phi @ (phi.T @ v)) / (phi @ phi.sum(0)).unsqueeze(-1)
    assert not bool(torch.isfinite(out).all())


def test_prf_adapted_maps_report_options() -> None:
    est = ka.create("cexp", num_features=8, rule="full", momentum=0.5, orthogonal=True, norm="fixed")
    fm = est.feature_map
    assert isinstance(fm, ComplexExponentialFeatures)
    assert (fm.rule, fm.momentum, fm.orthogonal, fm.norm) == ("full", 0.5, True, "fixed")
    assert isinstance(ka.create("hcexp").feature_map, HyperbolicComplexExponentialFeatures)
    with pytest.raises(ka.InputError, match="rule"):
        ka.create("cexp", rule="nope")
