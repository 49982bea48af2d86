"""Feature maps: fast vs naive, unbiasedness (FM001), variance (FM003), FM005,
orthogonal frequencies, and the module contract (state, dtypes, errors)."""

from __future__ import annotations

import math

import pytest
import sympy as sp
import torch
from kernelattn_fourier import claims as C
from kernelattn_fourier import naive
from kernelattn_fourier.feature_maps import RandomFourierFeatures, RFAFeatures, TrigSoftmaxFeatures
from kernelattn_fourier.kernels import GaussianKernel
from kernelattn_fourier.sampling import haar_orthogonal, orthogonal_frequencies

import kernelattn_core as ka


def _pairs(d: int, n: int, lo: float, hi: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, d, generator=g, dtype=torch.float64), torch.randn(n, d, generator=g, dtype=torch.float64)
    rx = lo + (hi - lo) * torch.rand(n, 1, generator=g, dtype=torch.float64)
    ry = lo + (hi - lo) * torch.rand(n, 1, generator=g, dtype=torch.float64)
    return x / x.norm(dim=-1, keepdim=True) * rx, y / y.norm(dim=-1, keepdim=True) * ry


def _grouped_estimates(fm, x: torch.Tensor, y: torch.Tensor, groups: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """``[pairs, groups]`` kernel estimates of independent maps with ``m = total / groups``
    frequencies, read off one large map (the frequencies are i.i.d., or independent
    orthogonal blocks when ``m`` is a multiple of ``d``)."""
    total = fm.num_features
    prod = fm.query(x) * fm.key(y)  # [P, D]
    single = prod[:, :total] + prod[:, total:] if prod.shape[-1] == 2 * total else prod  # [P, total]
    return (single * total).reshape(x.shape[0], groups, total // groups).mean(-1)


def _z(est: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (est.mean(-1) - target) / (est.std(-1) / math.sqrt(est.shape[-1]))


# --------------------------------------------------------------------------- fast vs naive
def test_rff_fast_equals_naive_outputs_and_gradients() -> None:
    for variant in ("cos-sin", "offset"):
        fm = RandomFourierFeatures(
            5, 7, kernel="matern", nu=2.5, variant=variant, generator=torch.Generator().manual_seed(0)
        )
        fm = fm.double()
        x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
        phase = fm.phase if variant == "offset" else None
        fast, ref = fm.query(x), naive.rff_features_naive(x, fm.omega, phase)
        print("max abs diff", float((fast - ref).detach().abs().max()))
        assert torch.allclose(fast, ref, rtol=1e-12, atol=1e-14)
        w = torch.randn_like(fast)
        (ga,) = torch.autograd.grad((fast * w).sum(), x)
        (gb,) = torch.autograd.grad((ref * w).sum(), x)
        assert torch.allclose(ga, gb, rtol=1e-12, atol=1e-14)


def test_trig_softmax_and_rfa_fast_equal_naive() -> None:
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    fm = TrigSoftmaxFeatures(5, 6).double()
    w = torch.randn(4, 12, dtype=torch.float64)
    a, b = fm.query(x), naive.trig_softmax_features_naive(x, fm.omega)
    assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)
    ga, gb = (torch.autograd.grad((t * w).sum(), x)[0] for t in (a, b))
    assert torch.allclose(ga, gb, rtol=1e-12, atol=1e-14)
    rfa = RFAFeatures(5, 6, init_scale=0.7).double()
    sigma = float(rfa.sigma().detach())  # the float32-initialised parameter, cast to float64
    assert float(sigma) == pytest.approx(0.7, rel=1e-7)
    a, b = rfa.query(x), naive.rfa_features_naive(x, rfa.omega, sigma)
    assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)
    ga, gb = (torch.autograd.grad((t * w).sum(), x)[0] for t in (a, b))
    assert torch.allclose(ga, gb, rtol=1e-10, atol=1e-13)


# --------------------------------------------------------------------------- FM001
RFF_CASES = [
    {},
    {"orthogonal": True},
    {"variant": "offset"},
    {"kernel": "laplacian", "lengthscale": 0.8},
    {"kernel": "matern", "nu": 0.5},
    {"kernel": "matern", "nu": 1.5, "orthogonal": True},
    {"kernel": "matern", "nu": 2.5, "lengthscale": 1.7},
]


@pytest.mark.parametrize("options", RFF_CASES, ids=str)
def test_fm001_rff_unbiased(options: dict) -> None:
    d, groups, m = 8, 4000, 8
    fm = RandomFourierFeatures(d, groups * m, generator=torch.Generator().manual_seed(11), **options).double()
    x, y = _pairs(d, 8, 0.2, 2.0, seed=3)
    z = _z(_grouped_estimates(fm, x, y, groups), fm.target_kernel().g(x - y))
    assert z.abs().max() < 5.0, z  # Bonferroni over 8 pairs: false-failure rate < 1e-5


def test_fm001_negative_control_wrong_lengthscale() -> None:
    d, groups, m = 8, 4000, 8
    fm = RandomFourierFeatures(d, groups * m, generator=torch.Generator().manual_seed(11)).double()
    x, y = _pairs(d, 8, 0.2, 2.0, seed=3)
    z = _z(_grouped_estimates(fm, x, y, groups), GaussianKernel(1.2).g(x - y))
    assert z.abs().max() > 10.0


def test_fm001_trig_softmax_unbiased_for_exp_and_negative_control() -> None:
    d, groups, m = 16, 4000, 8
    fm = TrigSoftmaxFeatures(d, groups * m, generator=torch.Generator().manual_seed(5)).double()
    x, y = _pairs(d, 8, 0.2, 1.0, seed=4)
    target = (x * y).sum(-1).exp()
    est = _grouped_estimates(fm, x, y, groups)
    assert _z(est, target).abs().max() < 5.0
    # negative control: without the e^{|x|^2/2} e^{|y|^2/2} factor the map is biased
    norms = torch.exp(0.5 * ((x * x).sum(-1) + (y * y).sum(-1)))
    assert _z(est / norms[:, None], target).abs().max() > 10.0
    assert bool((est < 0).any()), "trig-softmax estimates can be negative (positive=False)"


def test_fm001_rfa_kernel_on_the_sphere() -> None:
    d, groups, m = 8, 4000, 8
    fm = RFAFeatures(d, groups * m, init_scale=0.8, generator=torch.Generator().manual_seed(6)).double()
    x, y = _pairs(d, 8, 0.2, 3.0, seed=5)
    xh, yh = x / x.norm(dim=-1, keepdim=True), y / y.norm(dim=-1, keepdim=True)
    with torch.no_grad():
        est = _grouped_estimates(fm, x, y, groups)
    target = torch.exp(-((xh - yh) ** 2).sum(-1) / (2 * 0.8**2))
    assert _z(est, target).abs().max() < 5.0
    # features depend only on the direction
    assert torch.allclose(fm.query(3.0 * x), fm.query(x), atol=1e-12)


# --------------------------------------------------------------------------- FM003
def _variance_z(est: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """z-scores of the sample variance of ``est [P, R]`` against ``var [P]``, with the
    standard error of a sample variance from the fourth central moment."""
    c = est - est.mean(-1, keepdim=True)
    s2 = c.square().mean(-1)
    m4 = c.pow(4).mean(-1)
    se = ((m4 - s2**2) / est.shape[-1]).sqrt()
    return (s2 - var) / se


@pytest.mark.parametrize("variant", ["cos-sin", "offset"])
@pytest.mark.parametrize("kernel", ["gaussian", "matern"])
def test_fm003_variance_closed_form(variant: str, kernel: str) -> None:
    d, groups, m = 16, 20000, 4
    fm = RandomFourierFeatures(
        d, groups * m, kernel=kernel, variant=variant, generator=torch.Generator().manual_seed(7)
    )
    fm = fm.double()
    x, y = _pairs(d, 6, 0.2, 2.0, seed=8)
    est = _grouped_estimates(fm, x, y, groups)
    small = RandomFourierFeatures(d, m, kernel=kernel, variant=variant).double()
    assert _variance_z(est, C.rff_variance(x, y, small)).abs().max() < 5.0
    if kernel == "gaussian" and variant == "cos-sin":  # the form, divided by m
        k = fm.target_kernel().g(x - y)
        assert torch.allclose(C.rff_variance(x, y, small), 0.5 * (1 - k**2) ** 2 / m)
        # negative controls: the per-frequency formula without 1/m, and the offset formula
        assert _variance_z(est, 0.5 * (1 - k**2) ** 2).abs().min() > 10.0
        off = RandomFourierFeatures(d, m, variant="offset").double()
        assert _variance_z(est, C.rff_variance(x, y, off)).abs().min() > 10.0


def test_fm003_trig_softmax_variance() -> None:
    d, groups, m = 16, 20000, 4
    fm = TrigSoftmaxFeatures(d, groups * m, generator=torch.Generator().manual_seed(9)).double()
    x, y = _pairs(d, 6, 0.2, 1.0, seed=10)
    est = _grouped_estimates(fm, x, y, groups)
    assert _variance_z(est, C.trig_softmax_variance(x, y, TrigSoftmaxFeatures(d, m))).abs().max() < 5.0


def test_offset_map_has_larger_variance_measured() -> None:
    """Measured at equal frequencies m and at equal feature dimension D."""
    d, groups = 16, 20000
    x, y = _pairs(d, 6, 0.2, 2.0, seed=12)
    var = {}
    for variant, m in (("cos-sin", 4), ("offset", 4), ("offset", 8)):
        fm = RandomFourierFeatures(d, groups * m, variant=variant, generator=torch.Generator().manual_seed(13)).double()
        var[variant, m] = _grouped_estimates(fm, x, y, groups).var(-1)
    ratio_m = var["offset", 4] / var["cos-sin", 4]
    ratio_d = var["offset", 8] / var["cos-sin", 4]  # both D = 8
    print("offset/cos-sin variance ratio at equal m:", ratio_m.tolist(), "at equal D:", ratio_d.tolist())
    k2 = GaussianKernel(1.0).g(x - y) ** 2
    theory_m = ((1 - k2) ** 2 + 1) / (1 - k2) ** 2  # (½(1-K²)² + ½) / ½(1-K²)²
    theory_d = theory_m / 2
    assert bool((ratio_m > 1.5).all()) and float(ratio_d.mean()) > 1.0 and bool((theory_d >= 1).all())
    assert float((ratio_m / theory_m - 1).abs().max()) < 0.1
    assert float((ratio_d / theory_d - 1).abs().max()) < 0.1


# --------------------------------------------------------------------------- FM005 (symbolic)
def test_fm005_symbolic_expectations() -> None:
    for derive in (C.derive_gaussian_cos_expectation, C.derive_trig_softmax_expectation, C.derive_gaussian_variance):
        expectation, target, note = derive()
        assert sp.simplify(expectation - target) == 0, note
    # negative control: the same expectation is not the kernel with a doubled lengthscale
    expectation, target, _ = C.derive_gaussian_cos_expectation()
    ell = sp.Symbol("ell", positive=True)
    assert sp.simplify(expectation - target.subs(ell, 2 * ell)) != 0


# --------------------------------------------------------------------------- orthogonal frequencies
def test_haar_sign_correction_with_negative_control() -> None:
    g = torch.randn(20000, 2, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    q = haar_orthogonal(g)
    # Haar: Q_11 is symmetric about 0 (uniform angle); standard error ~ 0.71/sqrt(20000)
    assert abs(float(q[:, 0, 0].mean())) < 0.03
    assert abs(float((q[:, 0, 0] < 0).double().mean()) - 0.5) < 0.02
    plain = haar_orthogonal(g, sign_correction=False)
    assert float(plain[:, 0, 0].mean()) < -0.5  # LAPACK's sign convention: not Haar
    assert torch.allclose(q @ q.transpose(-1, -2), torch.eye(2, dtype=torch.float64).expand(20000, 2, 2), atol=1e-12)


def test_orthogonal_blocks_and_radial_law() -> None:
    d, m = 6, 15
    g = torch.Generator().manual_seed(1)

    def draw(kind: str, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=g, dtype=torch.float64)

    w = orthogonal_frequencies(GaussianKernel(0.5), m, d, draw)
    assert w.shape == (m, d)
    unit = w / w.norm(dim=-1, keepdim=True)
    gram = unit[:d] @ unit[:d].T
    assert torch.allclose(gram, torch.eye(d, dtype=torch.float64), atol=1e-12)
    big = orthogonal_frequencies(GaussianKernel(0.5), 60000, d, draw)
    assert float(big.square().sum(-1).mean()) == pytest.approx(d / 0.25, rel=0.02)  # chi^2_d / l^2


def test_orthogonal_reduces_variance_measured() -> None:
    d, groups, m = 16, 4000, 16
    x, y = _pairs(d, 6, 0.5, 1.5, seed=14)
    var = {}
    for orth in (False, True):
        fm = RandomFourierFeatures(d, groups * m, orthogonal=orth, generator=torch.Generator().manual_seed(15)).double()
        var[orth] = _grouped_estimates(fm, x, y, groups).var(-1)
    print("orthogonal/iid variance ratio:", (var[True] / var[False]).tolist())
    assert float((var[True] / var[False]).mean()) < 0.9


# --------------------------------------------------------------------------- module contract
def test_state_dict_roundtrip_and_generator_determinism() -> None:
    a = RandomFourierFeatures(4, 8, variant="offset", generator=torch.Generator().manual_seed(3))
    b = RandomFourierFeatures(4, 8, variant="offset", generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.omega, b.omega) and torch.equal(a.phase, b.phase)
    c = RandomFourierFeatures(num_features=8, variant="offset")
    c.load_state_dict(a.state_dict())
    x = torch.randn(3, 4)
    assert torch.equal(c.query(x), a.query(x))
    assert torch.isfinite(a.omega).all() and torch.isfinite(a.phase).all()
    r = RFAFeatures(4, 8, num_heads=2, init_scale=0.5)
    r2 = RFAFeatures(num_features=8, num_heads=2)
    r2.load_state_dict(r.state_dict())
    xh = torch.randn(1, 2, 3, 4)
    assert torch.equal(r2.query(xh), r.query(xh))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_dtypes(dtype: torch.dtype) -> None:
    x = torch.randn(3, 4).to(dtype)
    for fm in (RandomFourierFeatures(4, 8), TrigSoftmaxFeatures(4, 8), RFAFeatures(4, 8)):
        out = fm.query(x)
        assert out.dtype == dtype and torch.isfinite(out).all()


def test_feature_dims_flags_and_instance_kernel() -> None:
    assert RandomFourierFeatures(4, 8).feature_dim == 16
    assert RandomFourierFeatures(4, 8, variant="offset").feature_dim == 8
    fm = RandomFourierFeatures(4, 8, kernel="laplacian", lengthscale=2.0)
    assert fm.kernel == "laplacian" and RandomFourierFeatures.kernel == "gaussian"
    assert fm.target_kernel().lengthscale == 2.0
    assert not TrigSoftmaxFeatures.positive and TrigSoftmaxFeatures.unbiased and TrigSoftmaxFeatures.kernel == "softmax"
    assert RFAFeatures.learnable and RFAFeatures.kernel is None


def test_bad_options_name_the_argument() -> None:
    with pytest.raises(ka.InputError, match="variant"):
        RandomFourierFeatures(4, 8, variant="sin")
    with pytest.raises(ka.InputError, match="orthogonal"):
        RandomFourierFeatures(4, 8, kernel="laplacian", orthogonal=True)
    with pytest.raises(ka.InputError, match="kernel"):
        RandomFourierFeatures(4, 8, kernel="softmax")
    with pytest.raises(ka.InputError, match="nu"):
        RandomFourierFeatures(4, 8, nu=0.5)
    with pytest.raises(ka.InputError, match="num_heads"):
        RFAFeatures(4, 8, num_heads=0)
    with pytest.raises(ka.InputError, match="num_heads = 2"):
        RFAFeatures(4, 8, num_heads=2).query(torch.randn(1, 3, 5, 4))
    with pytest.raises(ka.InputError, match="unknown option"):
        ka.create("rff", bogus=1)


def test_rfa_per_head_scale_and_gradient() -> None:
    fm = RFAFeatures(4, 16, num_heads=2, init_scale=1.0)
    with torch.no_grad():
        fm.log_scale.copy_(torch.log(torch.tensor([0.5, 2.0])))
    x = torch.randn(1, 2, 3, 4)
    for h, s in enumerate((0.5, 2.0)):
        ref = naive.rfa_features_naive(x[0, h], fm.omega, s)
        assert torch.allclose(fm.query(x)[0, h], ref, atol=1e-5)
    fm.query(x).sum().backward()
    assert fm.log_scale.grad is not None and bool((fm.log_scale.grad != 0).all())
    frozen = RFAFeatures(4, 16, learn_scale=False)
    assert not frozen.log_scale.requires_grad
