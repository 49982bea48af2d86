"""Feature maps: shapes, fast path against the naive reference, identity rule, errors, state."""

from __future__ import annotations

import math

import pytest
import torch
from kernelattn_prf import (
    ComplexExponentialFeatures,
    HyperbolicComplexExponentialFeatures,
    HyperbolicPositiveRandomFeatures,
    PositiveRandomFeatures,
)
from kernelattn_prf.naive import features_naive, kernel_estimate_naive

from kernelattn_core import InputError

MAPS = [
    PositiveRandomFeatures,
    HyperbolicPositiveRandomFeatures,
    ComplexExponentialFeatures,
    HyperbolicComplexExponentialFeatures,
]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


@pytest.mark.parametrize("cls", MAPS)
def test_prf_shapes_and_log_space(cls: type) -> None:
    fm = cls(head_dim=8, num_features=12, generator=gen(0))
    x = torch.randn(2, 3, 5, 8)
    assert fm.feature_dim == (24 if cls.two_sided else 12)
    assert fm.query(x).shape == (2, 3, 5, fm.feature_dim)
    assert fm.omega.shape == (12, 8)
    torch.testing.assert_close(fm.query_log(x).exp(), fm.query(x))


def _maps_with_matrices() -> list[tuple[str, PositiveRandomFeatures]]:
    d = 5
    a_full = torch.eye(d) + 0.3 * torch.randn(d, d, generator=gen(3))
    return [
        ("prf", PositiveRandomFeatures(head_dim=d, num_features=7, generator=gen(1))),
        ("prf-hyp", HyperbolicPositiveRandomFeatures(head_dim=d, num_features=7, generator=gen(1))),
        ("cexp-diag", ComplexExponentialFeatures(d, 7, rule="fixed", matrix=[0.5, 1, 2, 1.5, 0.7], generator=gen(1))),
        ("hcexp-full", HyperbolicComplexExponentialFeatures(d, 7, rule="fixed", matrix=a_full, generator=gen(1))),
    ]


@pytest.mark.parametrize("case", range(4))
def test_prf_fast_matches_naive_outputs_and_gradients(case: int) -> None:
    label, fm = _maps_with_matrices()[case]
    fm = fm.double()
    x = (0.4 * torch.randn(6, 5, generator=gen(10), dtype=torch.float64)).requires_grad_()
    y = (0.4 * torch.randn(6, 5, generator=gen(11), dtype=torch.float64)).requires_grad_()
    a_q, a_k = fm.matrices() if isinstance(fm, ComplexExponentialFeatures) else (torch.eye(5),) * 2
    a_q, a_k = a_q.double(), a_k.double()
    fast_q, fast_k = fm.query(x), fm.key(y)
    ref_q = features_naive(x, fm.omega, a_q, fm.two_sided)
    ref_k = features_naive(y, fm.omega, a_k, fm.two_sided)
    print(label, "max abs diff", float((fast_q - ref_q).detach().abs().max()))
    assert rel_rms(fast_q, ref_q) < 1e-12 and rel_rms(fast_k, ref_k) < 1e-12
    fast = (fast_q * fast_k).sum(-1)  # paired estimates
    ref = kernel_estimate_naive(x, y, fm.omega, a_q, a_k, fm.two_sided)
    assert rel_rms(fast, ref) < 1e-12
    g_fast = torch.autograd.grad(fast.sum(), (x, y))
    g_ref = torch.autograd.grad(ref.sum(), (x, y))
    for gf, gr in zip(g_fast, g_ref):
        assert rel_rms(gf, gr) < 1e-10


def test_prf_naive_reference_catches_a_wrong_normaliser() -> None:
    """Negative control: a map whose log features miss the -|x|^2/2 term differs from the reference."""
    fm = PositiveRandomFeatures(head_dim=4, num_features=5, generator=gen(0)).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    wrong = (x @ fm.omega.T - 0.5 * math.log(5)).exp()
    ref = features_naive(x, fm.omega, torch.eye(4, dtype=torch.float64), False)
    assert rel_rms(wrong, ref) > 0.1


@pytest.mark.parametrize(
    ("plain", "adapted"),
    [
        (PositiveRandomFeatures, ComplexExponentialFeatures),
        (HyperbolicPositiveRandomFeatures, HyperbolicComplexExponentialFeatures),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_prf_identity_rule_is_prf_bit_for_bit(plain: type, adapted: type, dtype: torch.dtype) -> None:
    p = plain(head_dim=16, num_features=33, generator=gen(5)).to(dtype)
    c = adapted(head_dim=16, num_features=33, rule="identity", generator=gen(5)).to(dtype)
    x = torch.randn(4, 16, dtype=dtype)
    c.prepare(x, x)
    assert torch.equal(p.omega, c.omega)
    assert torch.equal(p.query_log(x), c.query_log(x)) and torch.equal(p.key_log(x), c.key_log(x))
    assert torch.equal(p.kernel_estimate(x, x), c.kernel_estimate(x, x))


def test_prf_adapted_map_is_prf_of_transformed_inputs() -> None:
    """CEXP with A equals PRF on (Ax, A^{-T} y), same omega."""
    a = torch.tensor([0.5, 2.0, 1.3, 0.8], dtype=torch.float64)
    c = ComplexExponentialFeatures(4, 9, rule="fixed", matrix=a, generator=gen(2)).double()
    p = PositiveRandomFeatures(4, 9, generator=gen(2)).double()
    x, y = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    torch.testing.assert_close(c.scale, a, rtol=1e-7, atol=0)  # stored in the module's (float32) precision
    c.set_matrix(a)  # now in float64
    assert torch.equal(c.scale, a)
    torch.testing.assert_close(c.query(x), p.query(x * a), rtol=1e-14, atol=0)
    torch.testing.assert_close(c.key(y), p.key(y / a), rtol=1e-14, atol=0)


def test_prf_orthogonal_invariance_of_the_estimate() -> None:
    """Replacing A by QA (Q orthogonal) and omega by Q omega leaves every estimate unchanged."""
    d = 4
    g = gen(7)
    a = torch.eye(d, dtype=torch.float64) + 0.3 * torch.randn(d, d, generator=g, dtype=torch.float64)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    c1 = ComplexExponentialFeatures(d, 6, rule="fixed", matrix=a, generator=gen(8)).double()
    c2 = ComplexExponentialFeatures(d, 6, rule="fixed", matrix=q @ a, generator=gen(8)).double()
    c1.set_matrix(a)  # full float64 precision
    c2.set_matrix(q @ a)
    c2.omega.copy_(c1.omega @ q.T)  # omega_i -> Q omega_i
    x, y = torch.randn(5, d, dtype=torch.float64), torch.randn(5, d, dtype=torch.float64)
    torch.testing.assert_close(c2.kernel_estimate(x, y), c1.kernel_estimate(x, y), rtol=1e-12, atol=0)


def test_prf_errors_name_the_argument() -> None:
    with pytest.raises(InputError, match="orthogonal"):
        PositiveRandomFeatures(orthogonal="yes")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="norm"):
        PositiveRandomFeatures(norm="gaussian")
    with pytest.raises(InputError, match="rule"):
        ComplexExponentialFeatures(rule="optimal")
    with pytest.raises(InputError, match="momentum"):
        ComplexExponentialFeatures(momentum=0.0)
    with pytest.raises(InputError, match="eps"):
        ComplexExponentialFeatures(eps=-1.0)
    with pytest.raises(InputError, match="matrix"):
        ComplexExponentialFeatures(rule="fixed")
    with pytest.raises(InputError, match="matrix"):
        ComplexExponentialFeatures(rule="means", matrix=2.0)
    with pytest.raises(InputError, match="invertible"):
        ComplexExponentialFeatures(head_dim=2, rule="fixed", matrix=torch.ones(2, 2))
    with pytest.raises(InputError, match=r"\[d\]"):
        ComplexExponentialFeatures(head_dim=3, rule="fixed", matrix=[1.0, 2.0])
    with pytest.raises(InputError, match="last dimension"):
        PositiveRandomFeatures(head_dim=3).query(torch.randn(2, 4))


@pytest.mark.parametrize("rule", ["means", "variance", "full"])
def test_prf_state_dict_round_trip_restores_draws_and_statistics(rule: str) -> None:
    fm = HyperbolicComplexExponentialFeatures(head_dim=6, num_features=10, rule=rule, orthogonal=True, generator=gen(0))
    fm.train()
    q, k = torch.randn(2, 3, 20, 6) + 1.0, 0.5 * torch.randn(2, 3, 20, 6) - 0.3
    fm.prepare(q, k)
    fm.eval()
    fresh = HyperbolicComplexExponentialFeatures(num_features=10, rule=rule, orthogonal=True)  # unbuilt
    fresh.load_state_dict(fm.state_dict())
    fresh.eval()
    x = torch.randn(4, 6)
    fm.prepare(x, x)
    fresh.prepare(x, x)
    assert torch.equal(fresh.query(x), fm.query(x)) and torch.equal(fresh.key(x), fm.key(x))
