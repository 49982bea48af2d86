"""Random Maclaurin features: fast == naive, unbiasedness (FM001, FM005), variance (FM003),
domain and infinite-variance checks, state dicts."""

from __future__ import annotations

import itertools
import math

import pytest
import sympy
import torch
from kernelattn_maclaurin import InfiniteVarianceWarning, RandomMaclaurinFeatures, derive_expectation, rmf_variance
from kernelattn_maclaurin.naive import rmf_features_naive

import kernelattn_core as ka
from kernelattn_core.toolkit import DomainError, InputError

BIG = 200_000  # features of one Monte Carlo map: the per-feature products are i.i.d. samples


def _pair(d: int, nx: float, ny: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(2, d, generator=g, dtype=torch.float64)
    y = y + 0.8 * x  # correlated: <x, y> far from 0
    return nx * x / x.norm(), ny * y / y.norm()


def _per_feature_samples(fm: RandomMaclaurinFeatures, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The i.i.d. single-feature estimates phi_i(x) phi_i(y) (random part, unscaled by 1/R)."""
    prod = fm.query(x) * fm.key(y)
    if fm.mode == "released":
        prod = prod[1:]
    return prod * fm.num_random


def _map(seed: int = 0, **options) -> RandomMaclaurinFeatures:
    g = torch.Generator().manual_seed(seed)
    return RandomMaclaurinFeatures(generator=g, **options).double()


# --------------------------------------------------------------------------- fast path == reference
@pytest.mark.parametrize(
    "options",
    [
        {"kernel": "exp"},
        {"kernel": "inv", "p": 1.5},
        {"kernel": "sqrt", "mode": "released"},
        {"kernel": "logi", "projection": "gaussian", "max_degree": 4},
        {"kernel": "polynomial", "kernel_options": {"c": 1, "degree": 3}, "p": 4.0},
    ],
    ids=str,
)
def test_fast_features_equal_the_naive_reference_with_gradients(options):
    fm = _map(1, head_dim=6, num_features=40, **options)
    x = (0.4 * torch.randn(3, 5, 6, dtype=torch.float64)).requires_grad_()
    fast = fm.query(x)
    ref = rmf_features_naive(fm, x)
    assert fast.shape == (3, 5, 40)
    rel = float((fast - ref).detach().norm() / ref.detach().norm())
    print("max abs diff", float((fast - ref).detach().abs().max()))
    assert rel < 1e-13
    w = torch.randn_like(fast)
    (g_fast,) = torch.autograd.grad((fast * w).sum(), x)
    (g_ref,) = torch.autograd.grad((ref * w).sum(), x)
    assert float((g_fast - g_ref).norm() / g_ref.norm()) < 1e-12
    assert torch.equal(fm.query(x), fm.key(x))  # the same draws for queries and keys


def test_features_run_in_float32_and_half_inputs():
    fm = RandomMaclaurinFeatures(head_dim=8, num_features=32, generator=torch.Generator().manual_seed(0))
    x = 0.3 * torch.randn(4, 8)
    ref = fm.double().query(x.double())
    fm.float()
    assert fm.query(x).dtype == torch.float32
    assert torch.allclose(fm.query(x).double(), ref, rtol=1e-4, atol=1e-5)
    assert fm.query(x.half()).dtype == torch.float16


def test_degrees_are_grouped_and_weights_follow_the_corrected_formula():
    fm = _map(2, head_dim=5, num_features=500, kernel="logi", p=3.0)
    degrees = fm.degrees
    assert torch.equal(degrees, degrees.sort().values)
    assert fm.omega.shape == (int(degrees.sum()), 5)
    assert set(fm.omega.unique().tolist()) <= {-1.0, 1.0}
    for i in (0, 250, 499):
        n = int(degrees[i])
        a = 1.0 / max(1, n)
        want = math.sqrt(a / ((3 - 1) * 3.0 ** -(n + 1)) / 500)
        assert math.isclose(float(fm.weights[i]), want, rel_tol=1e-12)
    released = _map(2, head_dim=5, num_features=10, kernel="sqrt", mode="released")
    assert float(released.weights[0]) == 1.0  # sqrt(a_0)
    assert int(released.degrees.min()) >= 1 and int(released.degrees.max()) <= 20
    assert released.feature_dim == 10 and released.num_random == 9


def test_state_dict_round_trip_with_a_different_draw_size():
    a = _map(0, head_dim=7, num_features=64, kernel="inv")
    b = _map(5, head_dim=7, num_features=64, kernel="inv")
    assert a.omega.shape != b.omega.shape or not torch.equal(a.omega, b.omega)
    b.load_state_dict(a.state_dict())
    x = 0.2 * torch.randn(3, 7, dtype=torch.float64)
    assert torch.equal(a.query(x), b.query(x))
    c = RandomMaclaurinFeatures(num_features=64, kernel="inv").double()  # unbuilt
    c.load_state_dict(a.state_dict())
    assert torch.equal(a.query(x), c.query(x))


def test_redraw_changes_the_draw_and_is_reproducible():
    fm = _map(0, head_dim=4, num_features=16)
    x = 0.5 * torch.randn(2, 4, dtype=torch.float64)
    before = fm.query(x)
    fm.redraw(generator=torch.Generator().manual_seed(9))
    after = fm.query(x)
    fm.redraw(generator=torch.Generator().manual_seed(9))
    assert not torch.equal(before, after) and torch.equal(after, fm.query(x))


def test_exp_and_trigh_give_bitwise_identical_features():
    x = 0.4 * torch.randn(3, 6, dtype=torch.float64)
    assert torch.equal(
        _map(4, head_dim=6, num_features=50).query(x), _map(4, head_dim=6, num_features=50, kernel="trigh").query(x)
    )


def test_bad_options_are_refused():
    with pytest.raises(InputError, match="projection"):
        RandomMaclaurinFeatures(head_dim=4, projection="orthogonal")
    with pytest.raises(InputError, match="D >= 2"):
        RandomMaclaurinFeatures(head_dim=4, num_features=1, mode="released")
    with pytest.raises(Exception, match="unknown kernel name 'nope'"):
        RandomMaclaurinFeatures(head_dim=4, kernel="nope")


# --------------------------------------------------------------------------- FM005 symbolic unbiasedness
@pytest.mark.parametrize("kernel", ["exp", "inv", "logi", "sqrt", "trigh"])
def test_symbolic_expectation_equals_the_kernel(kernel):
    expectation, target, note = derive_expectation(kernel)
    assert sympy.simplify(expectation - target) == 0, (expectation, target)
    assert "Rademacher" in note


def test_rademacher_enumeration_gives_inner_product_powers_and_fourth_moment():
    """Exact enumeration over {+-1}^3 (and pairs of sign vectors for two factors)."""
    d = 3
    xs = sympy.symbols("x1:4", real=True)
    ys = sympy.symbols("y1:4", real=True)
    dot = sum(a * b for a, b in zip(xs, ys))
    signs = list(itertools.product((-1, 1), repeat=d))

    def proj(w, v):
        return sum(wi * vi for wi, vi in zip(w, v))

    one = sum(proj(w, xs) * proj(w, ys) for w in signs) / len(signs)
    two = sum(proj(w, xs) * proj(w, ys) * proj(u, xs) * proj(u, ys) for w in signs for u in signs) / len(signs) ** 2
    fourth = sum(proj(w, xs) ** 2 * proj(w, ys) ** 2 for w in signs) / len(signs)
    nx2, ny2 = sum(a * a for a in xs), sum(b * b for b in ys)
    m_r = nx2 * ny2 + 2 * dot**2 - 2 * sum(a * a * b * b for a, b in zip(xs, ys))
    assert sympy.expand(one - dot) == 0
    assert sympy.expand(two - dot**2) == 0
    assert sympy.expand(fourth - m_r) == 0


def test_symbolic_negative_control_papers_weight_with_p_not_two():
    """With the papers' weight a_N p^(N+1) and the true law (p-1)/p^(N+1), E = (p-1) f: biased."""
    n = sympy.Symbol("n", integer=True, nonnegative=True)
    q, s = sympy.Symbol("q", positive=True), sympy.Symbol("s")
    p = 1 + q
    law = q / p ** (n + 1)
    expectation = sympy.Sum(sympy.simplify(law * p ** (n + 1) / sympy.factorial(n) * s**n), (n, 0, sympy.oo)).doit()
    assert sympy.simplify(expectation - q * sympy.exp(s)) == 0
    assert sympy.simplify(expectation - sympy.exp(s)) != 0


# --------------------------------------------------------------------------- FM001 Monte Carlo unbiasedness
@pytest.mark.parametrize(
    "options",
    [
        {"kernel": "exp"},
        {"kernel": "exp", "p": 3.0, "projection": "gaussian"},
        {"kernel": "inv"},
        {"kernel": "logi", "p": 1.7},
        {"kernel": "sqrt"},
        {"kernel": "polynomial", "kernel_options": {"c": 0.5, "degree": 3}},
        {"kernel": "exp", "mode": "released"},
        {"kernel": "inv", "mode": "released", "max_degree": 60},
    ],
    ids=str,
)
def test_kernel_estimate_is_unbiased(options):
    fm = _map(11, head_dim=8, num_features=BIG, **options)
    x, y = _pair(8, 0.55, 0.6)
    samples = _per_feature_samples(fm, x, y)
    a0 = float(fm.target.coefficient(0)) if fm.mode == "released" else 0.0
    target = float(fm.target.f((x * y).sum())) - a0
    z = (float(samples.mean()) - target) / (float(samples.std()) / math.sqrt(samples.numel()))
    assert abs(z) < 5, z
    full = float(fm.kernel_estimate(x[None], y[None]))  # the whole map's estimate: same mean
    assert abs(full - target - a0) < 5 * float(samples.std()) / math.sqrt(samples.numel())


def test_unbiasedness_test_catches_the_papers_weight_at_p_three():
    """Negative control: replace the weights by the printed sqrt(a_N p^(N+1)) at p = 3."""
    fm = _map(11, head_dim=8, num_features=BIG, kernel="exp", p=3.0)
    n = fm.degrees.double()
    fm.weights = torch.exp(0.5 * (-torch.lgamma(n + 1) + (n + 1) * math.log(3.0))) / math.sqrt(BIG)
    x, y = _pair(8, 0.55, 0.6)
    samples = _per_feature_samples(fm, x, y)
    z = (float(samples.mean()) - math.exp(float((x * y).sum()))) / (float(samples.std()) / math.sqrt(BIG))
    assert abs(z) > 50


# --------------------------------------------------------------------------- FM003 variance
@pytest.mark.parametrize(
    "options",
    [
        {"kernel": "exp"},
        {"kernel": "inv"},
        {"kernel": "logi"},
        {"kernel": "sqrt", "projection": "gaussian"},
        {"kernel": "exp", "mode": "released"},
        {"kernel": "logi", "max_degree": 3, "p": 2.5},
    ],
    ids=str,
)
def test_closed_form_variance_matches_monte_carlo(options):
    fm = _map(21, head_dim=8, num_features=BIG, **options)
    x, y = _pair(8, 0.5, 0.55, seed=1)
    samples = _per_feature_samples(fm, x, y)
    centred = samples - samples.mean()
    var_mc = float((centred**2).mean())
    se = math.sqrt(float((centred**4).mean()) - var_mc**2) / math.sqrt(samples.numel())
    one = dict(options, num_features=2 if options.get("mode") == "released" else 1)
    var_th = float(rmf_variance(x, y, fm.target, **{k: v for k, v in one.items() if k != "kernel"}))
    assert abs(var_mc - var_th) < 5 * se, (var_mc, var_th, se)
    # the map's own helper divides by R
    assert math.isclose(float(fm.variance(x, y)), var_th / fm.num_random, rel_tol=1e-12)


def test_variance_negative_control_wrong_moment_is_detected():
    """Using the Gaussian fourth moment for Rademacher features is visibly wrong at d = 2."""
    fm = _map(3, head_dim=2, num_features=BIG, kernel="exp")
    x = torch.tensor([0.9, 0.0], dtype=torch.float64)
    y = torch.tensor([0.9, 0.0], dtype=torch.float64)
    samples = _per_feature_samples(fm, x, y)
    var_mc = float(samples.var())
    right = float(rmf_variance(x, y, fm.target, projection="rademacher"))
    wrong = float(rmf_variance(x, y, fm.target, projection="gaussian"))
    assert abs(var_mc - right) / right < 0.03
    assert abs(var_mc - wrong) / wrong > 0.2


def test_released_mode_has_much_lower_variance():
    """exp, d = 16, unit rows scaled by d^(-1/4): the deterministic constant removes most variance."""
    x, y = _pair(16, 0.5, 0.5, seed=2)  # norms 16^(-1/4)
    from kernelattn_maclaurin import ExpKernel

    paper = float(rmf_variance(x, y, ExpKernel()))
    released = float(rmf_variance(x, y, ExpKernel(), mode="released", num_features=2))
    assert 1.0 < paper < 1.3 and released < paper / 5


def test_variance_is_infinite_exactly_when_p_m_reaches_r_squared():
    from kernelattn_maclaurin import InvKernel, fourth_moment

    x, y = _pair(8, 0.7, 0.7, seed=4)
    m = float(fourth_moment(x, y))
    p_inf = 1.0 / m + 1e-9  # p m just above 1
    p_fin = 1.0 / m - 1e-3
    assert math.isinf(float(rmf_variance(x, y, InvKernel(), p=max(p_inf, 1.0001))))
    assert math.isfinite(float(rmf_variance(x, y, InvKernel(), p=p_fin)))
    assert math.isfinite(float(rmf_variance(x, y, InvKernel(), p=max(p_inf, 1.0001), max_degree=30)))


# --------------------------------------------------------------------------- domain and warning
def test_infinite_variance_warning_and_domain_error():
    fm = _map(0, head_dim=8, num_features=64, kernel="inv")
    x = torch.full((1, 8), 0.7 / math.sqrt(8), dtype=torch.float64)  # t = 0.49 < 1, but 2 m >= 1
    with pytest.warns(InfiniteVarianceWarning, match="infinite variance"):
        fm.kernel_estimate(x, x)
    capped = _map(0, head_dim=8, num_features=64, kernel="inv", max_degree=30)
    capped.kernel_estimate(x, x)  # no warning: a degree cap makes every variance finite
    _map(0, head_dim=8, num_features=64, kernel="exp").kernel_estimate(3 * x, 3 * x)  # entire: never
    small = 0.5 * x
    fm.kernel_estimate(small, small)  # 2 m < 1: no warning
    with pytest.raises(DomainError, match=r"needs \|<q, k>\| < 1"):
        fm.kernel_estimate(1.5 * x, 1.5 * x)
    unchecked = _map(0, head_dim=8, num_features=64, kernel="inv", check=False)
    unchecked.kernel_estimate(1.5 * x, 1.5 * x)


@pytest.mark.parametrize("kernel", ["inv", "logi", "sqrt"])
def test_maclaurin_rmf_causal_domain_check_sees_only_earlier_keys(kernel) -> None:
    """Issue #15: with causal=True a later key out of the domain (|<q, k>| >= 1) made an
    in-range prefix raise DomainError. Only pairs j <= i are checked now; the same data
    without the causal mask still raises."""

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    q = q / q.norm(dim=-1, keepdim=True) * 0.5 * 4**0.25  # |<q, k>| <= 0.25 after the scaling
    k = k / k.norm(dim=-1, keepdim=True) * 0.5 * 4**0.25
    far = k.clone()
    far[:, :, 5] = far[:, :, 5] / far[:, :, 5].norm(dim=-1, keepdim=True) * 40.0  # only row 5 sees it
    q2 = q.clone()
    q2[:, :, 5] = far[:, :, 5] * 0  # row 5 itself stays in the domain (zero query)
    est = ka.create("rmf", kernel=kernel, num_features=16, seed=0).double()
    a = est(q2, k, v, causal=True)
    b = est(q2, far, v, causal=True)
    torch.testing.assert_close(a[:, :, :5], b[:, :, :5])
    with pytest.raises(DomainError, match="radius"):
        est(q2, far, v)


@pytest.mark.parametrize("kernel", ["inv", "logi", "sqrt"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_row_does_not_refuse_the_whole_call(kernel: str, bad: float) -> None:
    """A NaN or inf row (a padded token's query in self-attention) is quarantined by
    attention: the domain check leaves it out instead of refusing every row with
    ``max |<q, k>| = inf`` (issue 25: inv, logi and sqrt refused the call)."""
    est = ka.create("rmfa", kernel=kernel, num_features=16, seed=0).double()
    q = 0.1 * torch.rand(1, 2, 6, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    k, v = q.clone(), q.clone()
    q[0, :, 4] = bad  # positive keys: <q, k> = +inf exactly, no NaN to hide it
    out = est(q, k, v)
    assert bool(torch.isnan(out[0, :, 4]).all())
    rows = [0, 1, 2, 3, 5]
    assert bool(torch.isfinite(out[0, :, rows]).all())
    q[0, :, 4] = 100.0  # a finite row out of the domain is still refused
    with pytest.raises(ka.DomainError, match="radius of convergence"):
        est(q, k, v)
