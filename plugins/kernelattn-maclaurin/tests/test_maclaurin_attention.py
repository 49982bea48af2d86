"""RMFA, ppSBN and SchoenbAt / Macformer: fast == reference, masks, registry use, half
precision, and the consistency-not-unbiasedness claim (AT002) measured directly."""

from __future__ import annotations

import math

import pytest
import torch
from kernelattn_maclaurin import PPSBN, RandomMaclaurinFeatures, SchoenbAt
from kernelattn_maclaurin.naive import kernelized_attention_naive, pre_sbn_naive, rmfa_naive

import kernelattn_core as ka
from kernelattn_core.toolkit import DomainError, InputError


def _qkv(b=2, h=2, n=9, d=8, dv=5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g, dtype=dtype)
    k = torch.randn(b, h, n, d, generator=g, dtype=dtype)
    v = torch.randn(b, h, n, dv, generator=g, dtype=dtype)
    return q, k, v


# --------------------------------------------------------------------------- linear form == quadratic form
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("name", ["rmfa", "schoenbat"])
def test_linear_rmfa_equals_the_quadratic_reference(name, causal, masked):
    q, k, v = _qkv()
    q, k, v = (t.requires_grad_() for t in (0.5 * q, 0.5 * k, v))
    est = ka.create(name, num_features=48, seed=3, mode="released", chunk_size=4).double()
    mask = torch.zeros(2, 9, dtype=torch.bool)
    if masked:
        mask[0, 6:] = True
        mask[1, 1:3] = True  # every query keeps a key (see the fully-masked tests below)
    out = est(q, k, v, causal=causal, key_padding_mask=mask if masked else None)
    qs, ks = est.transform(q, k)
    phi_q, phi_k = est.feature_map.query(qs), est.feature_map.key(ks)
    ref = rmfa_naive(phi_q, phi_k, v, causal=causal, key_padding_mask=mask if masked else None)
    ref = est.normalizer.post(ref)
    rel = float((out - ref).detach().norm() / ref.detach().norm())
    print("max abs diff", float((out - ref).detach().abs().max()))
    assert rel < 1e-10
    w = torch.randn_like(out)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    grads_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for g, r in zip(grads, grads_ref):
        assert float((g - r).norm() / r.norm()) < 1e-8


def _fully_masked_grads(name):
    q, k, v = _qkv(b=1)
    q, k, v = (t.requires_grad_() for t in (0.5 * q, 0.5 * k, v))
    mask = torch.zeros(1, 9, dtype=torch.bool)
    mask[0, :2] = True  # causal queries 0 and 1 see no key
    est = ka.create(name, num_features=32, seed=0).double()
    out = est(q, k, v, causal=True, key_padding_mask=mask)
    assert torch.equal(out[..., :2, :], torch.zeros_like(out[..., :2, :]))
    return torch.autograd.grad((3.0 * out).sum(), (q, k, v))


def test_fully_masked_queries_have_finite_gradients_with_ppsbn():
    assert all(torch.isfinite(g).all() for g in _fully_masked_grads("schoenbat"))


def test_fully_masked_queries_have_finite_gradients_with_the_core_row_normaliser():
    assert all(torch.isfinite(g).all() for g in _fully_masked_grads("rmfa"))


def test_causal_outputs_do_not_depend_on_later_tokens():
    q, k, v = _qkv(n=12)
    est = ka.create("schoenbat", num_features=32, seed=0).double()
    out = est(q, k, v, causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[..., 8:, :] = 100 * torch.randn_like(k2[..., 8:, :])
    v2[..., 8:, :] = 7.0
    out2 = est(q, k2, v2, causal=True)
    assert torch.equal(out[..., :8, :], out2[..., :8, :])


def test_step_by_step_decoding_equals_causal_forward():
    q, k, v = _qkv(n=10)
    est = ka.create("schoenbat", num_features=32, seed=4, kernel="sqrt").double()
    full = est(q, k, v, causal=True)
    state, outs = None, []
    for t in range(0, 10, 3):
        out, state = est.step(q[..., t : t + 3, :], k[..., t : t + 3, :], v[..., t : t + 3, :], state)
        outs.append(out)
    assert torch.allclose(torch.cat(outs, dim=2), full, rtol=1e-10, atol=1e-12)
    with pytest.raises(InputError, match="stats='batch' cannot decode"):
        ka.create("schoenbat", num_features=32, stats="batch").double().step(q, k, v)


def test_padded_keys_are_ignored():
    q, k, v = _qkv(b=1)
    mask = torch.zeros(1, 9, dtype=torch.bool)
    mask[0, 5:] = True
    for name, opts in (("rmfa", {}), ("schoenbat", {}), ("schoenbat", {"stats": "batch"})):
        est = ka.create(name, num_features=32, seed=1, **opts).double()
        out = est(q, k, v, key_padding_mask=mask)
        k2, v2 = k.clone(), v.clone()
        k2[..., 5:, :] = 50.0
        v2[..., 5:, :] = -3.0
        assert torch.allclose(out, est(q, k2, v2, key_padding_mask=mask), rtol=1e-12, atol=1e-12), name


# --------------------------------------------------------------------------- registry and module use
def test_create_and_kernel_attention_with_every_name():
    x = torch.randn(2, 7, 32)
    for name in ("rmfa", "schoenbat", "macformer"):
        attn = ka.KernelAttention(32, 4, estimator=name, num_features=24, kernel="logi", seed=0, batch_first=True)
        out, weights = attn(0.1 * x if name == "rmfa" else x)
        assert out.shape == x.shape and weights is None and torch.isfinite(out).all()
    assert isinstance(ka.create("macformer"), SchoenbAt)
    assert ka.create("schoenbat").num_features == 128
    est = ka.create("rmf", num_features=16, normalizer="ppsbn")  # feature-map name + the normaliser
    assert isinstance(est.normalizer, PPSBN) and isinstance(est.feature_map, RandomMaclaurinFeatures)
    assert ka.create("inv")(*(0.2 * t for t in _qkv())).shape == (2, 2, 9, 5)  # exact attention, kernel name
    with pytest.raises(InputError, match="unknown option"):
        ka.create("schoenbat", nonsense=1)


def test_state_dict_reload_gives_identical_outputs():
    a = ka.KernelAttention(
        16, 2, estimator="schoenbat", num_features=24, seed=5, kernel="sqrt", batch_first=True
    ).double()
    b = ka.KernelAttention(
        16, 2, estimator="schoenbat", num_features=24, seed=6, kernel="sqrt", batch_first=True
    ).double()
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    a(x)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a(x)[0], b(x)[0])


def test_exp_and_trigh_give_bitwise_identical_attention():
    q, k, v = _qkv()
    out = [ka.create("schoenbat", kernel=kern, num_features=40, seed=2).double()(q, k, v) for kern in ("exp", "trigh")]
    assert torch.equal(out[0], out[1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_inputs_stay_finite(dtype):
    q, k, v = _qkv(n=300, d=16, dtype=torch.float32)
    est = ka.create("schoenbat", num_features=64, seed=0, kernel="inv", mode="released")
    with torch.no_grad():
        out = est(q.to(dtype), (4 * k).to(dtype), v.to(dtype), causal=True)
        ref = est(q, 4 * k, v, causal=True)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert float((out.float() - ref).norm() / ref.norm()) < 0.05


def test_ppsbn_keeps_radius_one_kernels_in_their_domain_while_rmfa_refuses():
    q, k, v = _qkv(d=16)
    out = ka.create("schoenbat", kernel="inv", num_features=32, seed=0).double()(50 * q, 50 * k, v)
    assert torch.isfinite(out).all()
    with pytest.raises(DomainError, match="normalizer='ppsbn'"):
        ka.create("rmfa", kernel="inv", num_features=32, seed=0).double()(50 * q, 50 * k, v)


# --------------------------------------------------------------------------- ppSBN
def test_pre_scaling_rows_are_centred_with_norm_d_to_minus_quarter():
    q, k, _ = _qkv(d=16)
    norm = PPSBN()
    qs, ks = norm.pre(3 * q + 1, k)
    for x in (qs, ks):
        assert float(x.mean(-1).abs().max()) < 1e-12
        assert torch.allclose(x.norm(dim=-1), torch.full((), 16**-0.25, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(qs, pre_sbn_naive(3 * q + 1) * 16**-0.25, atol=1e-13)
    t = qs @ ks.transpose(-1, -2)
    assert float(t.abs().max()) <= 16**-0.5 + 1e-12


def test_pre_scaling_constant_row_gives_zero_not_nan():
    x = torch.ones(1, 1, 2, 4, dtype=torch.float64)
    x[..., 1, :] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    out, _ = PPSBN().pre(x, x)
    assert torch.equal(out[0, 0, 0], torch.zeros(4, dtype=torch.float64)) and torch.isfinite(out).all()


def test_batch_statistics_standardise_each_feature_over_batch_and_tokens():
    q, _, _ = _qkv(d=6)
    norm = PPSBN(stats="batch", bn_eps=0.0)
    rows = norm.standardize(q)
    mean = q.mean(dim=(0, 2), keepdim=True)
    std = q.std(dim=(0, 2), unbiased=False, keepdim=True)
    manual = (q - mean) / std
    assert torch.allclose(rows, manual / manual.norm(dim=-1, keepdim=True), atol=1e-12)
    est = ka.create("schoenbat", stats="batch", num_features=16, seed=0)
    with pytest.raises(InputError, match="causality leak"):
        est(*_qkv(dtype=torch.float32), causal=True)


def test_post_scaling_signed_power_and_gradients():
    norm = PPSBN().double()
    a = torch.tensor([-8.0, -1.0, 0.0, 0.5, 27.0], dtype=torch.float64)
    assert torch.allclose(norm.post(a), a, rtol=1e-14)  # gamma = beta = 1: identity
    with torch.no_grad():
        norm.gamma.fill_(2.0)
        norm.beta.fill_(1.0 / 3.0)
    out = norm.post(a)
    assert torch.allclose(out, torch.tensor([-4.0, -2.0, 0.0, 2 * 0.5 ** (1 / 3), 6.0], dtype=torch.float64))
    out.sum().backward()
    assert torch.isfinite(norm.beta.grad) and torch.isfinite(norm.gamma.grad)
    off = PPSBN(power=False)
    assert off.beta is None and torch.equal(off.post(a.float()), a.float())
    per_channel = PPSBN(channels=3)
    assert per_channel.gamma.shape == (3,) and per_channel.beta.shape == (3,)
    with pytest.raises(InputError, match="channels = 3"):
        per_channel.post(torch.ones(2, 4))


def test_gamma_and_beta_train():
    q, k, v = _qkv()
    est = ka.create("schoenbat", num_features=32, seed=0).double()
    target = 2.0 * est(q, k, v).detach()
    opt = torch.optim.SGD(est.parameters(), lr=0.1)
    first = None
    for _ in range(30):
        loss = ((est(q, k, v) - target) ** 2).mean()
        first = float(loss.detach()) if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.2 * first


# --------------------------------------------------------------------------- AT002: consistent, not unbiased
def _many_draws(q, k, v, budget, draws, seed, mode):
    """``draws`` independent RMFA draws at budget D, vectorised: one big map, features shuffled
    (i.i.d. features are exchangeable) and split into groups of D."""
    c = 1 if mode == "released" else 0
    fm = RandomMaclaurinFeatures(num_features=draws * (budget - c) + c, mode=mode).double()
    fm.build(q.shape[-1], generator=torch.Generator().manual_seed(seed))
    perm = c + torch.randperm(draws * (budget - c), generator=torch.Generator().manual_seed(seed + 1))
    fq = (fm.query(q)[:, perm] * math.sqrt(draws)).unflatten(-1, (draws, budget - c))  # [n, R, D]
    fk = (fm.key(k)[:, perm] * math.sqrt(draws)).unflatten(-1, (draws, budget - c))
    a = torch.einsum("nrd,mrd->rnm", fq, fk)  # [R, n, m]
    if c:
        a = a + 1.0  # the deterministic constant feature: sqrt(a_0)^2 = 1
    num, den = a @ v, a.sum(-1)
    return num / den.unsqueeze(-1), num, den


def test_rmfa_is_biased_at_finite_budget_and_the_bias_shrinks_with_budget():
    """Numerator and denominator are unbiased; the ratio is not (papers' unbiasedness theorem
    is wrong); its bias falls roughly as 1/D (measured: 0.0079 at D=16, 0.0017 at D=64)."""
    d, n, draws = 4, 6, 20000
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(n, d, generator=g, dtype=torch.float64) for _ in range(2))
    q, k = (x / x.norm(dim=-1, keepdim=True) * d**-0.25 for x in (q, k))
    v = 2 * torch.rand(n, 3, generator=g, dtype=torch.float64) - 1
    a = (q @ k.T).exp()
    exact_num, exact_den = a @ v, a.sum(-1)
    exact = exact_num / exact_den.unsqueeze(-1)
    assert torch.allclose(exact, kernelized_attention_naive(q, k, v, torch.exp))
    bias = {}
    for budget in (16, 64):
        out, num, den = _many_draws(q, k, v, budget, draws, seed=budget, mode="released")
        se = lambda x: x.std(0) / math.sqrt(draws)  # noqa: E731
        # positive control: numerator and denominator are unbiased (|z| < 5 on every entry)
        assert float(((num.mean(0) - exact_num) / se(num)).abs().max()) < 5
        assert float(((den.mean(0) - exact_den) / se(den)).abs().max()) < 5
        err = out - exact
        z = err.mean(0) / se(err)
        bias[budget] = float(err.mean(0).abs().max())
        if budget == 16:
            assert float(z.abs().max()) > 8  # the ratio's bias is detected
    print("max |bias| by D:", bias)
    assert bias[64] < bias[16] / 2.5


def test_maclaurin_ppsbn_batch_statistics_refuse_causal_in_pre() -> None:
    """Issue #15: ppSBN batch statistics span every position; told causal=True (as
    feature-map attention does for any map: prf, rmf, ...), pre() refuses with a clear
    error instead of leaking later tokens."""

    q, k = torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 4)
    with pytest.raises(InputError, match="stats='token'"):
        PPSBN(stats="batch").pre(q, k, causal=True)
    # token statistics are per row: causal-safe, accepted, and a later token changes no earlier row
    a, _ = PPSBN(stats="token").pre(q, k, causal=True)
    q2 = q.clone()
    q2[:, :, 4:] = 100.0
    b, _ = PPSBN(stats="token").pre(q2, k, causal=True)
    torch.testing.assert_close(a[:, :, :4], b[:, :, :4])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_maclaurin_schoenbat_finite_in_every_dtype_up_to_scaled_norm_10(dtype, d, causal) -> None:
    """Issue #15: fp16 at d = 1 gave NaN (bn_eps = 1e-12 underflows float16, a one-feature
    row is constant: 0/0). Outputs and q gradients are finite up to scaled norm 10."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, d, generator=g) for _ in range(3))
    est = ka.create("schoenbat", num_features=16, seed=0)
    for norm in (0.5, 10.0):
        qq = (q / q.norm(dim=-1, keepdim=True) * norm * d**0.25).to(dtype).requires_grad_()
        kk = (k / k.norm(dim=-1, keepdim=True) * norm * d**0.25).to(dtype)
        out = est(qq, kk, v.to(dtype), causal=causal)
        assert torch.isfinite(out).all(), f"{dtype} d={d} norm={norm}"
        (grad,) = torch.autograd.grad(out.float().sum(), qq)
        assert torch.isfinite(grad).all()


def test_maclaurin_ppsbn_half_standardisation_matches_float32() -> None:
    x = torch.randn(2, 2, 5, 6)
    x[0, 0, 0] = 3.0  # a constant row: the zero row
    ref = PPSBN().standardize(x)
    half = PPSBN().standardize(x.half())
    assert half.dtype == torch.float16
    torch.testing.assert_close(half.float(), ref, rtol=2e-3, atol=2e-3)
    assert bool((ref[0, 0, 0] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_maclaurin_ppsbn_constant_row_has_a_zero_finite_gradient(dtype: torch.dtype) -> None:
    """A constant row (always the case where two bfloat16 entries round alike at d = 2)
    maps to the zero row; its gradient is zero, not NaN (the clamped-norm division sent
    g / tiny through 1 / root: inf - inf in the backward). Other rows keep theirs."""
    x = torch.tensor([[[[1.5, 1.5], [0.3, -0.7], [2.0, 2.0]]]], dtype=dtype, requires_grad=True)
    out = PPSBN().standardize(x)
    (out.float() * torch.tensor([1.0, 2.0])).sum().backward()
    assert bool((out[0, 0, 0] == 0).all()) and bool((out[0, 0, 2] == 0).all())
    assert bool(torch.isfinite(x.grad).all())
    assert bool((x.grad[0, 0, 0] == 0).all()) and bool((x.grad[0, 0, 2] == 0).all())
    # the non-constant row: unit row of a 2-vector, gradient ~ 0 (exact 0 for d = 2 up to rounding)
    torch.testing.assert_close(out[0, 0, 1].float().abs(), torch.full((2,), 2**-0.5), rtol=1e-2, atol=1e-2)


def test_maclaurin_schoenbat_bfloat16_gradient_finite_at_a_constant_row() -> None:
    """The fuzz case that found it: schoenbat, bfloat16, d = 2, scaled norm 1.9."""
    from kernelattn_core.toolkit import fuzz_tensors as _tensors

    torch.manual_seed(0)
    est = ka.create("schoenbat", num_features=16, seed=0).eval()
    q, k, v = (t.requires_grad_() for t in _tensors(18302, 1, 2, 21, 21, 2, 3, 1.9, torch.bfloat16))
    est(q, k, v, causal=False).float().square().mean().backward()
    assert all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v))
