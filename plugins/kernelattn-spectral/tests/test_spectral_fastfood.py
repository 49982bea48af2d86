"""FastFood: the fast Walsh–Hadamard transform against the explicit matrix, the projection
against the materialised V, the RBF / softmax targets of the fixed variant, and options."""

from __future__ import annotations

import math

import pytest
import torch
from kernelattn_spectral import FastFoodPRFFeatureMap, FastFoodRKSFeatureMap, fwht
from kernelattn_spectral.kernels import GaussianPRFKernel, SpectralMixtureKernel
from kernelattn_spectral.naive import fastfood_matrix, hadamard_matrix

from kernelattn_core.toolkit import InputError

Z_MAX = 5.5  # Bonferroni over <= 16 pairs at a 1e-6 false-failure rate is z ~ 5.3


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: intra-op threads only add overhead (and contention on shared CI cores)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _pairs(d: int, p: int, seed: int, norm: float = 0.8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(p, d, generator=g, dtype=torch.float64)
    y = torch.randn(p, d, generator=g, dtype=torch.float64)
    scale = norm * torch.linspace(0.4, 1.0, p, dtype=torch.float64).unsqueeze(-1)
    return x / x.norm(dim=-1, keepdim=True) * scale, y / y.norm(dim=-1, keepdim=True) * scale


def _mc_estimates(fm, x: torch.Tensor, y: torch.Tensor, redraws: int, seed: int) -> torch.Tensor:
    """Single-pair estimates over independent redraws, ``[R, P]``."""
    g = torch.Generator().manual_seed(seed)
    est = []
    with torch.no_grad():
        for _ in range(redraws):
            fm.redraw(generator=g)
            est.append((fm.query(x) * fm.key(y)).sum(-1))  # [P]
    return torch.stack(est)


def _z(est: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (est.mean(0) - target) / (est.std(0) / math.sqrt(est.shape[0]))


@pytest.mark.parametrize("d", [1, 2, 4, 8, 64, 256])
def test_fwht_equals_explicit_hadamard(d: int) -> None:
    x = torch.randn(3, 5, d, dtype=torch.float64)
    h = hadamard_matrix(d)
    torch.testing.assert_close(fwht(x), x @ h.T, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h @ h.T, d * torch.eye(d, dtype=torch.float64))


def test_fwht_gradient_equals_explicit() -> None:
    d = 32
    x = torch.randn(4, d, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, d, dtype=torch.float64)
    (g_fast,) = torch.autograd.grad((fwht(x) * w).sum(), x)
    (g_ref,) = torch.autograd.grad((x @ hadamard_matrix(d).T * w).sum(), x)
    torch.testing.assert_close(g_fast, g_ref, rtol=1e-12, atol=1e-12)


def test_fwht_negative_control_detects_wrong_sign() -> None:
    """The comparison would catch a transform with one wrong sign."""
    d = 16
    h_bad = hadamard_matrix(d).clone()
    h_bad[3, 5] *= -1
    x = torch.randn(7, d, dtype=torch.float64)
    assert (fwht(x) - x @ h_bad.T).abs().max() > 1e-3


def test_fwht_rejects_non_power_of_two() -> None:
    with pytest.raises(InputError, match="power of two"):
        fwht(torch.randn(2, 12))


@pytest.mark.parametrize("learn", ["sgb", "s", "none"])
@pytest.mark.parametrize("cls", [FastFoodRKSFeatureMap, FastFoodPRFFeatureMap])
def test_projection_equals_materialised_matrix(cls, learn: str) -> None:
    d, m = 16, 48
    fm = cls(d, m, learn=learn, bandwidth=1.3, generator=torch.Generator().manual_seed(0)).double()
    v_ref = fastfood_matrix(fm.s.detach(), fm.G.detach(), fm.B.detach(), fm.perm, 1.3)  # [M, d]
    x = torch.randn(5, d, dtype=torch.float64)
    torch.testing.assert_close(fm.project(x), x @ v_ref.T, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(fm.matrix(), v_ref, rtol=1e-10, atol=1e-12)
    # rows of V have norm |s_i| / sigma
    torch.testing.assert_close(v_ref.norm(dim=-1), fm.s.detach().reshape(-1).abs() / 1.3, rtol=1e-10, atol=0)
    # gradients of the fast path equal those of the explicit matrices
    if learn != "none":
        w = torch.randn(5, m, dtype=torch.float64)
        (g_fast,) = torch.autograd.grad((fm.project(x) * w).sum(), fm.s)
        s_ref = fm.s.detach().clone().requires_grad_(True)
        v = fastfood_matrix(s_ref, fm.G.detach(), fm.B.detach(), fm.perm, 1.3)
        (g_ref,) = torch.autograd.grad((x @ v.T * w).sum(), s_ref)
        torch.testing.assert_close(g_fast, g_ref, rtol=1e-10, atol=1e-12)


def test_fastfood_errors() -> None:
    with pytest.raises(InputError, match="power of two"):
        FastFoodRKSFeatureMap(12, 24)
    with pytest.raises(InputError, match=r"d \| M"):
        FastFoodRKSFeatureMap(16, 24)
    with pytest.raises(InputError, match="learn"):
        FastFoodRKSFeatureMap(16, 32, learn="sg")
    with pytest.raises(InputError, match="bandwidth"):
        FastFoodPRFFeatureMap(16, 32, bandwidth=0.0)


@pytest.mark.parametrize("d", [16, 64])
def test_fixed_fastfood_rks_is_unbiased_for_rbf(d: int) -> None:
    sigma = 1.2
    fm = FastFoodRKSFeatureMap(d, 64, learn="none", bandwidth=sigma).double()
    x, y = _pairs(d, 8, seed=1, norm=1.5)
    target = SpectralMixtureKernel(bandwidth=sigma)(x.unsqueeze(-2), y.unsqueeze(-2)).reshape(-1)
    est = _mc_estimates(fm, x, y, redraws=800, seed=2)
    z = _z(est, target)
    assert z.abs().max() < Z_MAX, z
    # negative control: the same estimates against the RBF of another bandwidth
    wrong = SpectralMixtureKernel(bandwidth=sigma * 1.15)(x.unsqueeze(-2), y.unsqueeze(-2)).reshape(-1)
    z_bad = _z(est, wrong)
    assert z_bad.abs().max() > 3 * Z_MAX, z_bad


def test_fixed_fastfood_prf_is_unbiased_for_softmax() -> None:
    d = 16
    fm = FastFoodPRFFeatureMap(d, 32, learn="none").double()
    x, y = _pairs(d, 8, seed=3, norm=0.9)
    target = (x * y).sum(-1).exp()  # softmax kernel e^{x.y}
    torch.testing.assert_close(GaussianPRFKernel()(x.unsqueeze(-2), y.unsqueeze(-2)).reshape(-1), target)
    z = _z(_mc_estimates(fm, x, y, redraws=800, seed=4), target)
    assert z.abs().max() < Z_MAX, z
    # negative control: dropping the chi_d row lengths (S = 1/|G|) biases the estimate
    fm_bad = FastFoodPRFFeatureMap(d, 32, learn="none").double()
    original = fm_bad._redraw

    def redraw_without_s(generator):  # type: ignore[no-untyped-def]
        original(generator)
        fm_bad.s.fill_(math.sqrt(d) * 0.8)

    fm_bad._redraw = redraw_without_s  # type: ignore[method-assign]
    z_bad = _z(_mc_estimates(fm_bad, x, y, redraws=400, seed=4), target)
    assert z_bad.abs().max() > 2 * Z_MAX, z_bad


def test_fastfood_initialisation_approximates_rbf_matrix() -> None:
    """A single SGB map at initialisation (M = 8 d) approximates the RBF kernel matrix."""
    d, sigma = 32, 1.0
    x = torch.randn(20, d, dtype=torch.float64) * 0.15
    fm = FastFoodRKSFeatureMap(d, 8 * d, bandwidth=sigma, generator=torch.Generator().manual_seed(5)).double()
    k_hat = fm.kernel_estimate(x, x)
    k = SpectralMixtureKernel(bandwidth=sigma)(x, x)
    err = (k_hat - k).abs().max().item()
    assert err < 0.25, err  # Hoeffding-scale error for 256 frequencies
    assert (k - torch.ones_like(k)).abs().max() > 0.5  # the kernel is far from constant: the test is not vacuous


def test_variants_learnable_and_redrawn() -> None:
    g = torch.Generator().manual_seed(0)
    fms = {learn: FastFoodRKSFeatureMap(8, 16, learn=learn, generator=g) for learn in ("sgb", "s", "none")}
    names = {k: sorted(n for n, _ in fm.named_parameters()) for k, fm in fms.items()}
    assert names == {"sgb": ["B", "G", "s"], "s": ["s"], "none": []}
    for learn, fm in fms.items():
        before = {n: getattr(fm, n).detach().clone() for n in ("s", "G", "B", "perm")}
        fm.redraw(generator=torch.Generator().manual_seed(1))
        for n in ("s", "G", "B"):
            changed = not torch.equal(before[n], getattr(fm, n).detach())
            assert changed == (n not in {"sgb": "sGB", "s": "s", "none": ""}[learn]), (learn, n)
        assert not torch.equal(before["perm"], fm.perm)
