"""LARA: reductions (E2, E3), Eq. 10 = Eq. 28 = log space (E1), landmarks (E9),
weights and policies, the degenerate C = 1 case (E4), masks, causal refusal."""

from __future__ import annotations

import pytest
import torch
from kernelattn_sampling import functional as fn
from kernelattn_sampling import naive
from kernelattn_sampling.lara import (
    Proposals,
    lara_from_samples,
    make_proposals,
    pooled_means,
    r_prime,
    segment_lengths,
    segment_means,
    weight_table,
)

import kernelattn_core as ka

D64 = torch.float64


def _qkv(n=6, m=None, d=4, dv=3, b=2, h=2, seed=0, scale=0.6):
    g = torch.Generator().manual_seed(seed)
    m = n if m is None else m
    q = torch.randn(b, h, n, d, generator=g, dtype=D64) * scale
    k = torch.randn(b, h, m, d, generator=g, dtype=D64) * scale
    v = torch.randn(b, h, m, dv, generator=g, dtype=D64)
    return q, k, v


def test_sampling_lara_equals_rfa_with_standard_normal_proposals_and_constant_weights() -> None:
    """E2: q_c = N(0, I), alpha = 1/C gives RFA with S = C on the same omega (float64, 1e-12)."""
    q, k, v = _qkv(n=9, m=7)
    c = 5
    omega = torch.randn(c, 4, generator=torch.Generator().manual_seed(1), dtype=D64)
    props = Proposals(torch.zeros(2, 2, c, 4, dtype=D64))
    lara = lara_from_samples(q, k, v, omega.expand(2, 2, c, 4), torch.arange(c), props, weighting="constant")
    rfa = fn.rfa_from_samples(q, k, v, omega, None)
    diff = float((lara - rfa).abs().max())
    print("E2 max abs diff", diff)
    assert diff < 1e-12
    # and RFA's log-space form equals the plain Eq. 2
    torch.testing.assert_close(rfa[1, 0], naive.rfa_naive(q[1, 0], k[1, 0], v[1, 0], omega), rtol=1e-12, atol=1e-12)


def test_sampling_lara_module_equals_rfa_snis_module_on_its_samples() -> None:
    """E2 through the registered estimators: lara(standard-normal, constant) on rfa-snis' omega."""
    q, k, v = _qkv(n=8)
    rfa = ka.create("rfa-snis", num_features=8).double().eval()
    out = rfa(q, k, v)
    omega = rfa.features.omega.to(D64)  # the samples, in scaled coordinates
    qs, ks = q * 4**-0.25, k * 4**-0.25
    props = Proposals(torch.zeros(2, 2, 8, 4, dtype=D64))
    lara = lara_from_samples(qs, ks, v, omega.expand(2, 2, 8, 4), torch.arange(8), props, weighting="constant")
    assert float((lara - out).abs().max()) < 1e-12


def test_sampling_lara_equals_ra_with_exact_targets_and_delta_weights() -> None:
    """E3: C = N, q_n = p_n (eq32 with the tokens as landmarks), alpha = delta gives RA, S = 1, same draws."""
    q, k, v = _qkv(n=6, m=6)
    probs = fn.softmax_probs(q, k, None, False)
    omega = fn.ra_samples(q, k, probs, 1, 1.0, torch.Generator().manual_seed(3))  # [B, H, N, 1, d]
    ra = fn.ra_from_samples(omega, k, v)
    q_land, k_land, _ = ka.create("lara", num_features=16).landmarks_of(q, k, None)
    assert torch.equal(q_land, q)  # N <= C: the tokens themselves
    props = make_proposals("eq32", q_land, k_land, k, None)
    lara = lara_from_samples(q, k, v, omega[:, :, :, 0], torch.arange(6), props, weighting="delta")
    diff = float((lara - ra).abs().max())
    print("E3 max abs diff", diff)
    assert diff < 1e-12


def test_sampling_lara_module_equals_ra_module_with_same_generator() -> None:
    """E3 through the modules: the same generator seed gives the same draws and the same output."""
    q, k, v = _qkv(n=5, m=5)
    lara = ka.create(
        "lara", num_features=5, proposal="eq32", weighting="delta", generator=torch.Generator().manual_seed(9)
    )
    ra = ka.create("ra", num_features=1, generator=torch.Generator().manual_seed(9))
    a, b = lara.double().train()(q, k, v), ra.double().train()(q, k, v)
    assert float((a - b).abs().max()) < 1e-12


def _gaussian_case(seed=0, beta=0.05):
    q, k, v = _qkv(n=7, m=6, b=1, h=1, seed=seed)
    c = 3
    q_land, _ = segment_means(q, c)
    k_land, _ = segment_means(k, c)
    props = make_proposals("eq34", q_land, k_land, k, None)
    omega, owner = props.sample(1.0, torch.Generator().manual_seed(seed + 1), antithetic=True)
    return q, k, v, q_land, props, omega, owner


@pytest.mark.parametrize("weighting", ["balance", "decoupled", "coupled", "constant"])
def test_sampling_lara_log_space_equals_eq10_and_eq28(weighting: str) -> None:
    """E1: the log-space estimator equals Eq. 10 and Eq. 28 (Alg. 3 corrected) in plain form,
    outputs and gradients (positive weights)."""
    q, k, v, q_land, props, omega, owner = _gaussian_case()
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    fast = lara_from_samples(q, k, v, omega, owner, props, weighting=weighting, q_land=q_land, beta=0.05)
    lr = props.log_ratio(omega)
    table = weight_table(weighting, lr, omega, r_prime(q, q_land), beta=0.05)  # [1, 1, N, S, C]
    alpha = table[0, 0][:, torch.arange(len(owner)), owner]  # [N, S]
    assert bool((alpha > 0).all())
    dens = naive.gaussian_density(omega[0, 0], props.mean[0, 0][owner])  # q_c(omega_s)
    ref28 = naive.lara_naive(q[0, 0], k[0, 0], v[0, 0], omega[0, 0], owner, dens, alpha)
    ref10 = naive.lara_eq10_naive(q[0, 0], k[0, 0], v[0, 0], omega[0, 0], dens, alpha)
    print(
        "E1 max abs diff", float((fast[0, 0] - ref28).detach().abs().max()), float((ref10 - ref28).detach().abs().max())
    )
    torch.testing.assert_close(fast[0, 0], ref28, rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(ref10, ref28, rtol=1e-11, atol=1e-12)
    g_fast = torch.autograd.grad(fast.sum(), (q, k, v))
    g_ref = torch.autograd.grad(ref28.sum(), (q, k, v))
    for a, b in zip(g_fast, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_sampling_lara_signed_policy_is_exact_with_negative_weights_and_clamp_differs() -> None:
    """A4: with beta = 3 some weights are negative; 'signed' equals the plain Eq. 28, 'clamp' does not."""
    q, k, v, q_land, props, omega, owner = _gaussian_case(seed=2)
    lr = props.log_ratio(omega)
    alpha = weight_table("decoupled", lr, omega, r_prime(q, q_land), beta=3.0)[0, 0][:, torch.arange(len(owner)), owner]
    assert bool((alpha < 0).any())
    dens = naive.gaussian_density(omega[0, 0], props.mean[0, 0][owner])
    ref = naive.lara_naive(q[0, 0], k[0, 0], v[0, 0], omega[0, 0], owner, dens, alpha)
    signed = lara_from_samples(q, k, v, omega, owner, props, q_land=q_land, beta=3.0, negative_weights="signed")
    clamp = lara_from_samples(q, k, v, omega, owner, props, q_land=q_land, beta=3.0, negative_weights="clamp")
    torch.testing.assert_close(signed[0, 0], ref, rtol=1e-10, atol=1e-12)
    assert float((clamp[0, 0] - ref).abs().max()) > 1e-6


def test_sampling_lara_fast_weights_equal_the_reference_table() -> None:
    """The realized-weight fast path is the reference table gathered at each sample's proposal."""
    from kernelattn_sampling.lara import realized_weights

    q, _k, _v, q_land, props, omega, owner = _gaussian_case(seed=4)
    lr, rp = props.log_ratio(omega), r_prime(q, q_land)
    for kind in ("balance", "decoupled", "coupled", "constant"):
        table = weight_table(kind, lr, omega, rp, beta=1.5)[0, 0][:, torch.arange(len(owner)), owner]
        w, is_log = realized_weights(kind, lr, omega, owner, rp, 1.5, q.shape[-2])
        w = w.exp() if is_log else w
        torch.testing.assert_close(w[0, 0].expand_as(table), table, rtol=1e-12, atol=1e-14)


def test_sampling_lara_segment_means_uneven_split_and_short_sequences() -> None:
    """E9: the released code's split when C does not divide N; tokens themselves when N <= C."""
    assert segment_lengths(10, 4) == [2, 2, 3, 3]
    assert segment_lengths(12, 4) == [3, 3, 3, 3]
    assert segment_lengths(3, 4) == [1, 1, 1]
    x = torch.randn(1, 1, 10, 3, dtype=D64)
    for n, c in ((10, 4), (10, 3), (7, 7), (3, 5), (9, 1)):
        got, _ = segment_means(x[:, :, :n], c)
        torch.testing.assert_close(got[0, 0], naive.segment_means_naive(x[0, 0, :n], c), rtol=1e-14, atol=1e-15)


def test_sampling_lara_pool2d_landmarks_and_option_errors() -> None:
    x = torch.arange(16, dtype=D64).reshape(1, 1, 16, 1)  # 4 x 4 grid, row-major
    pooled, _ = pooled_means(x, (4, 4), (2, 2))
    assert pooled.flatten().tolist() == [2.5, 4.5, 10.5, 12.5]
    est = ka.create("lara", num_features=4, landmarks="pool2d", grid=(4, 4)).double().eval()
    q, k, v = _qkv(n=16)
    assert torch.isfinite(est(q, k, v)).all()
    with pytest.raises(ka.InputError, match="grid"):
        est(*_qkv(n=15))
    with pytest.raises(ka.InputError, match="not a square"):
        ka.create("lara", num_features=6, landmarks="pool2d", grid=(4, 4))
    with pytest.raises(ka.InputError, match="weighting"):
        ka.create("lara", weighting="optimal")
    with pytest.raises(ka.InputError, match="head_dim"):
        ka.create("lara", landmark_projection=True)
    for kwargs in ({"grid": 2}, {"grid": (4, 0)}, {"pool": 0}, {"grid": (4, 4), "pool": (2.0, 2)}):
        name = "pool" if "pool" in kwargs else "grid"
        with pytest.raises(ka.InputError, match=rf"{name}: expected a pair of integers >= 1"):
            ka.create("lara", num_features=4, landmarks="pool2d", **{"grid": (4, 4), **kwargs})


def test_sampling_lara_is_non_causal_with_a_clear_error() -> None:
    q, k, v = _qkv()
    with pytest.raises(ka.InputError, match="non-causal"):
        ka.create("lara")(q, k, v, causal=True)


def test_sampling_lara_single_proposal_gives_identical_rows() -> None:
    """E4: with C = 1 and one sample the self-normalised output does not depend on the query."""
    q, k, v = _qkv(n=6)
    out = ka.create("lara", num_features=1).double().train()(q, k, v)
    assert float((out - out[:, :, :1]).abs().max()) < 1e-12


def test_sampling_lara_eval_uses_proposal_means_and_is_deterministic() -> None:
    q, k, v = _qkv(n=12)
    est = ka.create("lara", num_features=4).double().eval()
    q_land, k_land, _ = est.landmarks_of(q * 4**-0.25, k * 4**-0.25, None)
    mu = q_land + k_land
    expected = lara_from_samples(q * 4**-0.25, k * 4**-0.25, v, mu, torch.arange(4), Proposals(mu), q_land=q_land)
    out = est(q, k, v)
    assert torch.equal(out, est(q, k, v))
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-13)
    est.train()
    assert not torch.equal(est(q, k, v), out)


@pytest.mark.parametrize("proposal", ["eq34", "eq35", "eq33", "eq32"])
@pytest.mark.parametrize("weighting", ["decoupled", "coupled", "balance"])
def test_sampling_lara_padding_is_excluded(proposal: str, weighting: str) -> None:
    """Padded keys (content and values) do not change any output, in training draws too."""
    q, k, v = _qkv(n=9, m=9)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[0, 6:] = True
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 6:] = 5.0
    v2[0, :, 6:] = 1e3
    outs = []
    for kk, vv in ((k, v), (k2, v2)):
        est = ka.create(
            "lara", num_features=3, proposal=proposal, weighting=weighting, generator=torch.Generator().manual_seed(0)
        )
        outs.append(est.double().train()(q, kk, vv, key_padding_mask=mask))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-10, atol=1e-10)
    assert float(outs[0].abs().max()) < 10


@pytest.mark.parametrize("train", [False, True])
def test_sampling_lara_a_sequence_with_every_key_padded_gives_zeros_and_finite_gradients(train: bool) -> None:
    """The documented convention (a query with no key gets zeros); r' of such a sequence was
    a softmax over no query (0/0), NaN in its output and in its inputs' gradients."""
    q, k, v = (t.requires_grad_(True) for t in _qkv(n=6, m=6))
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[1] = True
    est = ka.create("lara", num_features=3, generator=torch.Generator().manual_seed(0)).double().train(train)
    out = est(q, k, v, key_padding_mask=mask)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    out[0].sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
        assert torch.equal(t.grad[1], torch.zeros_like(t.grad[1]))


def test_sampling_lara_options_run_and_learned_projection_gets_gradients() -> None:
    q, k, v = _qkv(n=10, d=8)
    est = ka.create("lara", num_features=4, landmark_projection=True, head_dim=8, antithetic=True).double().train()
    est(q, k, v).sum().backward()
    assert est.q_proj[0].weight.grad is not None and float(est.q_proj[0].weight.grad.abs().sum()) > 0
    for opts in ({"noise_std": "code"}, {"r_axis": "landmark"}, {"negative_weights": "signed", "beta": 2.0}):
        out = ka.create("lara", num_features=4, **opts).double().train()(q, k, v)
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", ["ra", "ra-biased", "rfa-snis", "lara"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sampling_half_precision_stays_finite(name: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=g) * 3 for _ in range(3))
    torch.manual_seed(0)
    out = ka.create(name, num_features=8)(q.to(dtype), k.to(dtype), v.to(dtype))
    assert out.dtype == dtype and torch.isfinite(out).all()
