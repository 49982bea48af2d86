"""Kernels: values, spectral densities (HP001 by quadrature) and samplers."""

from __future__ import annotations

import math
from fractions import Fraction

import mpmath as mp
import pytest
import torch
from kernelattn_fourier import kernels as K

import kernelattn_core as ka
from kernelattn_core.toolkit import kernel_attention_naive

ALL = [K.GaussianKernel(1.3), K.LaplacianKernel(0.7), *(K.MaternKernel(1.1, nu) for nu in (0.5, 1.5, 2.5))]


@pytest.mark.parametrize("kern", ALL, ids=repr)
def test_fast_matrix_equals_pointwise_g(kern: K.SpectralKernel) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 7, 5, generator=g, dtype=torch.float64)
    k = torch.randn(2, 9, 5, generator=g, dtype=torch.float64)
    fast = kern(q, k)
    naive = kern.g(q.unsqueeze(-2) - k.unsqueeze(-3))  # [2, 7, 9]
    assert torch.allclose(fast, naive, rtol=1e-10, atol=1e-13), float((fast - naive).abs().max())
    assert torch.allclose(kern.log_evaluate(q, k).exp(), naive, rtol=1e-10, atol=1e-13)
    assert torch.allclose(kern(q, q).diagonal(dim1=-2, dim2=-1), torch.ones(2, 7, dtype=torch.float64))


@pytest.mark.parametrize("kern", ALL, ids=repr)
def test_torch_kernel_matches_mpmath(kern: K.SpectralKernel) -> None:
    delta = [0.3, -1.2, 0.5]
    want = float(kern.g_mp([mp.mpf(t) for t in delta]))
    got = float(kern.g(torch.tensor(delta, dtype=torch.float64)))
    assert got == pytest.approx(want, rel=1e-13)


@pytest.mark.parametrize("kern", ALL, ids=repr)
def test_log_density_matches_mpmath(kern: K.SpectralKernel) -> None:
    omega = [0.4, -2.0, 0.9]
    want = float(mp.log(kern.spectral_density_mp([mp.mpf(w) for w in omega])))
    got = float(kern.log_spectral_density(torch.tensor(omega, dtype=torch.float64)))
    assert got == pytest.approx(want, rel=1e-12)


def test_known_closed_forms_and_which_laplacian() -> None:
    d = torch.tensor([0.3, -0.4], dtype=torch.float64)
    assert float(K.LaplacianKernel(2.0).g(d)) == pytest.approx(math.exp(-0.7 / 2.0))  # L1 distance
    assert float(K.MaternKernel(2.0, 0.5).g(d)) == pytest.approx(math.exp(-0.5 / 2.0))  # L2 distance
    z = math.sqrt(3) * 0.5 / 2.0
    assert float(K.MaternKernel(2.0, "3/2").g(d)) == pytest.approx((1 + z) * math.exp(-z))
    assert float(K.GaussianKernel(2.0).g(d)) == pytest.approx(math.exp(-0.25 / 8.0))


# --------------------------------------------------------------------------- HP001
HP_CLAIMS = [c for cls in (K.LaplacianKernel, K.MaternKernel) for c in cls.claims if c.rule == "HP001"]


@pytest.mark.parametrize("claim", HP_CLAIMS, ids=lambda c: c.label)
def test_hp001_spectral_density_is_inverse_fourier_transform(claim) -> None:  # type: ignore[no-untyped-def]
    value, target, note = claim.evaluate(claim.dps)
    with mp.workdps(claim.dps):
        rel = abs(value - target) / abs(target)
        assert rel < mp.mpf(10) ** (-claim.digits), (note, mp.nstr(rel, 5))


def test_hp001_negative_control_wrong_degrees_of_freedom() -> None:
    """The same quadrature catches a Student-t with the wrong degrees of freedom."""
    with mp.workdps(30):
        kern = K.MaternKernel(1.3, 1.5)
        rho = mp.mpf("0.9")
        value = mp.quad(lambda r: kern.radial_mp(r) * mp.cos(rho * r), [0, mp.inf]) / mp.pi
        wrong = K.MaternKernel(1.3, 2.5).spectral_density_mp([rho])
        assert abs(value - wrong) / wrong > 1e-2
        # and a Gaussian density in place of the Cauchy for the Laplacian
        lap = K.LaplacianKernel(1.3)
        value = mp.quad(lambda t: lap.g_mp([t]) * mp.cos(rho * t), [0, mp.inf]) / mp.pi
        assert abs(value - K.GaussianKernel(1.3).spectral_density_mp([rho])) / value > 1e-2


# --------------------------------------------------------------------------- samplers
def _draw(seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)

    def draw(kind: str, shape: tuple[int, ...]) -> torch.Tensor:
        if kind == "normal":
            return torch.randn(shape, generator=g, dtype=torch.float64)
        return torch.rand(shape, generator=g, dtype=torch.float64)

    return draw


def _cos_z(kern: K.SpectralKernel, omega: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
    c = torch.cos(deltas @ omega.T)  # [P, n]
    se = c.std(-1) / math.sqrt(omega.shape[0])
    return (c.mean(-1) - kern.g(deltas)) / se


@pytest.mark.parametrize("kern", ALL, ids=repr)
def test_sampler_is_the_spectral_density(kern: K.SpectralKernel) -> None:
    """Bochner by Monte Carlo: the mean of cos(w.delta) over sampled w is g(delta)."""
    deltas = torch.randn(8, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    omega = kern.sample_frequencies(200_000, 3, _draw(2))
    z = _cos_z(kern, omega, deltas)
    assert z.abs().max() < 5.0, z


def test_sampler_negative_control() -> None:
    """A Student-t with 5 degrees of freedom does not give the Matérn-3/2 kernel."""
    deltas = torch.randn(8, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    omega = K.MaternKernel(1.1, 2.5).sample_frequencies(200_000, 3, _draw(2))
    assert _cos_z(K.MaternKernel(1.1, 1.5), omega, deltas).abs().max() > 10.0


def test_sampler_moments() -> None:
    draw = _draw(3)
    n, d, ell = 200_000, 4, 0.5
    gauss = K.GaussianKernel(ell).sample_frequencies(n, d, draw)
    assert float(gauss.square().sum(-1).mean()) == pytest.approx(d / ell**2, rel=0.01)
    cauchy = K.LaplacianKernel(ell).sample_frequencies(n, d, draw)
    assert float(cauchy.abs().median()) == pytest.approx(1 / ell, rel=0.02)  # Cauchy: median |w| = scale
    t5 = K.MaternKernel(ell, 2.5).sample_frequencies(n, d, draw)  # E[w_i^2] = s^2 k/(k-2)
    assert float(t5.square().mean()) == pytest.approx(5 / 3 / ell**2, rel=0.05)


# --------------------------------------------------------------------------- options and registry
def test_bad_options() -> None:
    with pytest.raises(ka.InputError, match="lengthscale"):
        K.GaussianKernel(-1.0)
    with pytest.raises(ka.InputError, match="nu"):
        K.MaternKernel(1.0, 1.0)
    assert K.check_nu("5/2") == Fraction(5, 2)
    with pytest.raises(ka.InputError, match="nu"):
        K.make_kernel("gaussian", 1.0, 0.5)


@pytest.mark.parametrize("name", ["gaussian", "laplacian", "matern"])
def test_exact_attention_through_registry(name: str) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.tensor([[False, False, True, False, False, True]])
    out = ka.create(name)(q, k, v, causal=True, key_padding_mask=mask)
    s = 4 ** (-0.25)
    kern = ka.get_registry().kernel(name)()
    ref = kernel_attention_naive(kern(q * s, k * s), v, causal=True, key_padding_mask=mask)
    assert torch.allclose(out, ref, rtol=1e-10, atol=1e-12)
