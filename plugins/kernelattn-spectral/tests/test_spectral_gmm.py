"""GMM-RKS and GMM-PRF: frequencies against the naive reference, unbiasedness against the
closed forms (SymPy 1-D, mpmath 2-D, Monte Carlo at d = 16), reparameterisation gradients,
the AA^T erratum, and the redraw schedule."""

from __future__ import annotations

import itertools
import math

import mpmath as mp
import pytest
import sympy as sp
import torch
from kernelattn_spectral import GMMPRFFeatureMap, GMMRKSFeatureMap
from kernelattn_spectral import claims as C
from kernelattn_spectral.kernels import GaussianPRFKernel, SpectralMixtureKernel
from kernelattn_spectral.naive import gmm_frequencies, prf_kernel_estimate, rks_kernel_estimate

import kernelattn_core as ka
from kernelattn_core.toolkit import InputError

Z_MAX = 5.5  # Bonferroni over <= 40 coordinates at a ~1e-6 false-failure rate is z ~ 5.6; pairs <= 8: 5.3


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: intra-op threads only add overhead (and contention on shared CI cores)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _pairs(d: int, p: int, seed: int, norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(p, d, generator=g, dtype=torch.float64)
    y = torch.randn(p, d, generator=g, dtype=torch.float64)
    scale = norm * torch.linspace(0.4, 1.0, p, dtype=torch.float64).unsqueeze(-1)
    return x / x.norm(dim=-1, keepdim=True) * scale, y / y.norm(dim=-1, keepdim=True) * scale


def _random_params(fm, seed: int) -> None:
    """Non-trivial learned-looking parameters: random means and factors / scales."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        fm.means.copy_(0.6 * torch.randn(fm.means.shape, generator=g, dtype=torch.float64))
        if isinstance(fm, GMMRKSFeatureMap):
            d = fm.head_dim
            fm.factors.copy_(torch.eye(d, dtype=torch.float64) + 0.3 * torch.randn(fm.factors.shape, generator=g))
        else:
            fm.log_scales.copy_(0.25 * torch.randn(fm.log_scales.shape, generator=g, dtype=torch.float64))


def _estimates(fm, x, y, redraws: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    out = []
    with torch.no_grad():
        for _ in range(redraws):
            fm.redraw(generator=g)
            out.append((fm.query(x) * fm.key(y)).sum(-1))
    return torch.stack(out)  # [R, P]


def _z(est: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (est.mean(0) - target) / (est.std(0) / math.sqrt(est.shape[0]))


# ---------------------------------------------------------------- references
@pytest.mark.parametrize("share_noise", [True, False])
@pytest.mark.parametrize("cls", [GMMRKSFeatureMap, GMMPRFFeatureMap])
def test_frequencies_and_estimates_match_naive(cls, share_noise: bool) -> None:
    fm = cls(3, 12, components=3, share_noise=share_noise, generator=torch.Generator().manual_seed(0)).double()
    _random_params(fm, 1)
    factors = fm.factors if cls is GMMRKSFeatureMap else fm.scales()
    omega_ref = gmm_frequencies(fm.means, factors, fm.noise)
    torch.testing.assert_close(fm.frequencies(), omega_ref, rtol=1e-12, atol=1e-12)
    x, y = _pairs(3, 2, seed=2, norm=1.0)
    ref = rks_kernel_estimate if cls is GMMRKSFeatureMap else prf_kernel_estimate
    est = fm.kernel_estimate(x, y)
    for i in range(2):
        for j in range(2):
            torch.testing.assert_close(est[i, j], ref(omega_ref, x[i], y[j]), rtol=1e-12, atol=1e-12)
    # gradients of the vectorised path equal those of the naive loops
    (g_fast,) = torch.autograd.grad(est.sum(), fm.means)
    (g_ref,) = torch.autograd.grad(
        sum(ref(gmm_frequencies(fm.means, factors, fm.noise), x[i], y[j]) for i in range(2) for j in range(2)),
        fm.means,
    )
    torch.testing.assert_close(g_fast, g_ref, rtol=1e-10, atol=1e-12)


def test_reparameterisation_covariance_is_a_at() -> None:
    """Erratum 1: omega = A n + mu has covariance A A^T (not A)."""
    d = 3
    fm = GMMRKSFeatureMap(d, 200000, components=1, generator=torch.Generator().manual_seed(0)).double()
    a = torch.tensor([[0.9, 0.0, 0.0], [-0.4, 0.7, 0.0], [0.3, 0.2, 0.5]], dtype=torch.float64)
    with torch.no_grad():
        fm.factors.copy_(a.unsqueeze(0))
        fm.means.copy_(torch.tensor([[0.3, -0.5, 0.1]]))
    w = fm.frequencies().detach()
    cov = torch.cov(w.T)
    assert (cov - a @ a.T).abs().max() < 0.02
    assert (cov - a).abs().max() > 0.2  # the paper's reading (covariance A) is far off
    assert (w.mean(0) - fm.means[0]).abs().max() < 0.01


# ---------------------------------------------------------------- symbolic and high precision
def test_fm005_rks_symbolic_expectation() -> None:
    expectation, target, note = C.derive_rks_1d()
    assert sp.simplify(expectation - target) == 0, note
    # negative control: the paper's covariance reading exp(-a delta^2 / 2) is rejected
    a, delta, mu = (next(s for s in expectation.free_symbols if s.name == n) for n in ("a", "delta", "mu"))
    wrong = sp.exp(-a * delta**2 / 2) * sp.cos(mu * delta)
    assert sp.simplify(expectation - wrong) != 0


def test_fm005_prf_symbolic_expectation() -> None:
    expectation, target, note = C.derive_prf_1d()
    assert sp.simplify(expectation - target) == 0, note
    q, k, a, mu = (next(s for s in expectation.free_symbols if s.name == n) for n in ("q", "k", "a", "mu"))
    assert sp.simplify(expectation.subs({mu: 0, a: 1}) - sp.exp(q * k)) == 0  # softmax limit
    wrong = target * sp.exp(-(q**2) / 2)  # negative control: a missing query factor is caught
    assert sp.simplify(expectation - wrong) != 0


@pytest.mark.parametrize(
    ("evaluate", "closed_form"),
    [(C.evaluate_gmm_rks_2d, C.gmm_rks_closed_form_2d), (C.evaluate_gmm_prf_2d, C.gmm_prf_closed_form_2d)],
)
def test_hp001_quadrature_2d(evaluate, closed_form) -> None:
    value, target, _ = evaluate(40)
    assert abs(value - target) < mp.mpf(10) ** -25 * abs(target)
    if evaluate is C.evaluate_gmm_rks_2d:  # negative control: covariance A instead of A A^T
        assert abs(value - C.gmm_rks_closed_form_2d(40, paper_covariance=True)) > 1e-3


def test_torch_kernels_match_mpmath_closed_forms() -> None:
    x = torch.tensor([[float(v) for v in C.X_2D]], dtype=torch.float64)
    y = torch.tensor([[float(v) for v in C.Y_2D]], dtype=torch.float64)
    means = torch.tensor([[float(v) for v in row] for row in C.MEANS_2D], dtype=torch.float64)
    factors = torch.tensor([[[float(v) for v in r] for r in f] for f in C.FACTORS_2D], dtype=torch.float64)
    scales = torch.tensor([[float(v) for v in row] for row in C.SCALES_2D], dtype=torch.float64)
    rks = SpectralMixtureKernel(means, factors)(x, y).item()
    prf = GaussianPRFKernel(means, scales)(x, y).item()
    assert rks == pytest.approx(float(C.gmm_rks_closed_form_2d(30)), rel=1e-13)
    assert prf == pytest.approx(float(C.gmm_prf_closed_form_2d(30)), rel=1e-13)
    # full factors that are diagonal give the same PRF kernel as diagonal scales
    prf_full = GaussianPRFKernel(means, torch.diag_embed(scales))(x, y).item()
    assert prf_full == pytest.approx(prf, rel=1e-13)


def test_kernel_defaults_are_rbf_and_softmax() -> None:
    x, y = torch.randn(4, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    sq = torch.cdist(x, y).pow(2)
    torch.testing.assert_close(SpectralMixtureKernel(bandwidth=0.7)(x, y), torch.exp(-sq / (2 * 0.49)))
    torch.testing.assert_close(GaussianPRFKernel()(x, y), torch.exp(x @ y.T))
    q, k, v = torch.randn(3, 1, 2, 6, 4, dtype=torch.float64).unbind(0)
    torch.testing.assert_close(ka.create("spectral-prf")(q, k, v), ka.create("softmax")(q, k, v))


def test_kernel_errors() -> None:
    with pytest.raises(InputError, match="factors"):
        SpectralMixtureKernel(torch.zeros(2, 3), torch.zeros(2, 3, 4))
    with pytest.raises(InputError, match="factors"):
        SpectralMixtureKernel(torch.zeros(2, 3), torch.zeros(3, 3, 3))
    with pytest.raises(InputError, match="bandwidth"):
        GaussianPRFKernel(bandwidth=-1.0)
    with pytest.raises(InputError, match="means"):
        SpectralMixtureKernel(torch.zeros(2, 3))(torch.zeros(1, 4), torch.zeros(1, 4))


# ---------------------------------------------------------------- Monte Carlo at realistic d
@pytest.mark.parametrize("cls", [GMMRKSFeatureMap, GMMPRFFeatureMap])
def test_mc_unbiased_for_exact_kernel_with_learned_parameters(cls) -> None:
    d = 16
    fm = cls(d, 48, components=3, generator=torch.Generator().manual_seed(0)).double()
    _random_params(fm, 7)
    x, y = _pairs(d, 8, seed=3, norm=0.8)
    target = fm.exact_kernel(x.unsqueeze(-2), y.unsqueeze(-2)).reshape(-1).detach()
    est = _estimates(fm, x, y, redraws=1000, seed=4)
    z = _z(est, target)
    assert z.abs().max() < Z_MAX, z
    # negative control: the wrong normalisation 1/sqrt(M) (per component) instead of 1/sqrt(CM)
    z_bad = _z(est * fm.components, target)
    assert z_bad.abs().max() > 3 * Z_MAX, z_bad
    if cls is GMMRKSFeatureMap:  # negative control: Eq. 4 read literally (covariance A_c, not A_c A_c^T)
        a, m = fm.factors.detach(), fm.means.detach()
        delta = x - y  # [P, d]
        quad = torch.einsum("pi,cij,pj->pc", delta, a, delta)
        paper = (torch.exp(-0.5 * quad) * torch.cos(delta @ m.T)).mean(-1)
        assert _z(est, paper).abs().max() > 3 * Z_MAX


# ---------------------------------------------------------------- reparameterisation gradients
@pytest.mark.parametrize("cls", [GMMRKSFeatureMap, GMMPRFFeatureMap])
def test_reparameterisation_gradient_is_unbiased(cls) -> None:
    d = 4
    fm = cls(d, 64, components=2, generator=torch.Generator().manual_seed(0)).double()
    _random_params(fm, 11)
    params = [fm.means, fm.factors if cls is GMMRKSFeatureMap else fm.log_scales]
    x, y = _pairs(d, 1, seed=5, norm=0.9)
    target = torch.cat([g.reshape(-1) for g in torch.autograd.grad(fm.exact_kernel(x, y).sum(), params)])
    g = torch.Generator().manual_seed(6)
    grads = []
    for _ in range(400):
        fm.redraw(generator=g)
        est = (fm.query(x) * fm.key(y)).sum()
        grads.append(torch.cat([t.reshape(-1) for t in torch.autograd.grad(est, params)]))
    grads = torch.stack(grads)  # [R, P]
    z = _z(grads, target)
    assert z.abs().max() < Z_MAX, z
    assert target.abs().max() > 0.05  # a non-trivial gradient
    if cls is GMMRKSFeatureMap:  # negative control: the gradient of the paper-covariance kernel
        a = fm.factors.detach().clone().requires_grad_(True)
        m = fm.means.detach().clone().requires_grad_(True)
        delta = (x - y)[0]
        paper = (torch.exp(-0.5 * torch.einsum("i,cij,j->c", delta, a, delta)) * torch.cos(m @ delta)).mean()
        wrong = torch.cat([t.reshape(-1) for t in torch.autograd.grad(paper, [m, a])])
        assert _z(grads, wrong).abs().max() > 2 * Z_MAX


# ---------------------------------------------------------------- options, redraw and state
def test_gmm_options_and_errors() -> None:
    with pytest.raises(InputError, match="multiple of components"):
        GMMRKSFeatureMap(4, 10, components=3)
    with pytest.raises(InputError, match="components"):
        GMMPRFFeatureMap(4, 10, components=0)
    with pytest.raises(InputError, match="mean_init_std"):
        GMMPRFFeatureMap(4, 10, mean_init_std=-1.0)
    fm = GMMRKSFeatureMap(4, 10, components=2, mean_init_std=0.0)
    assert fm.feature_dim == 20 and fm.samples_per_component == 5
    assert torch.equal(fm.means.detach(), torch.zeros(2, 4))
    assert GMMPRFFeatureMap(4, 10).feature_dim == 10
    assert sorted(n for n, _ in GMMRKSFeatureMap(4, 10).named_parameters()) == ["factors", "means"]
    assert sorted(n for n, _ in GMMPRFFeatureMap(4, 10).named_parameters()) == ["log_scales", "means"]


def test_redraw_schedule_eval_freeze_and_state_dict() -> None:
    attn = ka.create("gmm-rks", num_features=16, redraw_every=3, seed=5, head_dim=4)
    fm = attn.feature_map
    q = torch.randn(1, 1, 5, 4)
    noises = []
    for _ in range(7):
        attn(q, q, q)
        noises.append(fm.noise.clone())
    changed = [not torch.equal(a, b) for a, b in itertools.pairwise(noises)]
    assert changed == [False, False, True, False, False, True]
    means_before = fm.means.detach().clone()
    attn.eval()
    out1, out2 = attn(q, q, q), attn(q, q, q)
    assert torch.equal(out1, out2)
    assert torch.equal(fm.means.detach(), means_before)  # redraws never reset learned parameters
    clone = ka.create("gmm-rks", num_features=16, redraw_every=3, seed=0)
    clone.load_state_dict(attn.state_dict())
    clone.eval()
    assert torch.equal(clone(q, q, q), out1)
