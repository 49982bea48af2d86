"""Interface contracts of Kernel, FeatureMap, Normalizer and AttentionEstimator."""

from __future__ import annotations

import io
import math
from fractions import Fraction

import pytest
import sympy
import torch

import kernelattn_core as ka

from .conftest import qkv
from .toy_plugin import ToyPRF


@pytest.mark.parametrize("cls", [ka.Kernel, ka.DotProductKernel, ka.FeatureMap, ka.AttentionEstimator])
def test_interfaces_are_abstract(cls: type) -> None:
    with pytest.raises(TypeError, match="abstract"):
        cls()


def test_softmax_kernel_coefficients_are_exact_and_match_sympy() -> None:
    kern = ka.SoftmaxKernel()
    t = sympy.Symbol("t")
    series = sympy.series(kern.sympy_expr(t), t, 0, 21).removeO()
    for n, a in enumerate(kern.coefficients(20)):
        assert isinstance(a, Fraction)
        assert sympy.Rational(a.numerator, a.denominator) == series.coeff(t, n)
    assert kern.family is ka.KernelFamily.DOT_PRODUCT and math.isinf(kern.radius)


def test_kernel_matrix_shape_and_values() -> None:
    q, k, _ = qkv(n=4, m=6, d=3)
    kmat = ka.SoftmaxKernel()(q, k)
    assert kmat.shape == (2, 3, 4, 6)
    torch.testing.assert_close(kmat, torch.exp(q @ k.transpose(-1, -2)))


def test_dot_product_domain_check_names_kernel_and_radius() -> None:
    class Inv(ka.DotProductKernel):
        name = "test-inv"
        radius = 1.0

        def f(self, t):  # type: ignore[no-untyped-def]
            return 1 / (1 - t)

        def sympy_expr(self, t):  # type: ignore[no-untyped-def]
            return 1 / (1 - t)

        def coefficient(self, n: int) -> Fraction:
            return Fraction(1)

    x = torch.tensor([[0.9, 0.9]])
    with pytest.raises(ka.DomainError, match="'test-inv' needs \\|<q, k>\\| < 1.0.*1.62"):
        Inv()(x, x)
    Inv()(x / 2, x / 2)


def test_elu_map_is_elu_plus_one_not_the_papers_max_formula() -> None:
    """Erratum (learning-kernel spec §2.7/§6): the paper's max(x+1, e^x) is e^x everywhere."""
    x = torch.linspace(-3, 3, 13, dtype=torch.float64).reshape(1, 13)
    fm = ka.EluFeatureMap(head_dim=13)
    phi = fm.query(x)
    expected = torch.where(x > 0, x + 1, x.exp())
    torch.testing.assert_close(phi, expected)
    papers = torch.maximum(x + 1, x.exp())
    assert not torch.allclose(phi, papers)  # the printed formula differs for x > 0
    assert (phi > 0).all()


def test_feature_map_lazy_build_and_feature_dim() -> None:
    fm = ToyPRF(num_features=7)
    assert not fm.built
    with pytest.raises(ka.InputError, match="feature_dim is known once"):
        fm.feature_dim
    out = fm.query(torch.randn(3, 5))
    assert fm.built and fm.head_dim == 5 and fm.feature_dim == 7 and out.shape == (3, 7)
    with pytest.raises(ka.InputError, match="expected last dimension d = 5"):
        fm.key(torch.randn(3, 4))


def test_feature_map_state_dict_loads_into_an_unbuilt_map() -> None:
    fm = ToyPRF(head_dim=4, num_features=6, generator=torch.Generator().manual_seed(1))
    buffer = io.BytesIO()
    torch.save(fm.state_dict(), buffer)
    buffer.seek(0)
    fresh = ToyPRF(num_features=6)
    fresh.load_state_dict(torch.load(buffer))
    x = torch.randn(2, 4)
    assert torch.equal(fresh.query(x), fm.query(x))


def test_draws_are_buffers_that_move_with_to_and_are_in_state_dict() -> None:
    fm = ToyPRF(head_dim=4, num_features=6)
    assert "omega" in fm.state_dict()
    fm64 = fm.to(torch.float64)
    assert fm64.omega.dtype == torch.float64


def test_redraw_is_the_only_source_of_randomness() -> None:
    fm = ToyPRF(head_dim=4, num_features=6, generator=torch.Generator().manual_seed(0))
    x = torch.randn(2, 4)
    first = fm.query(x)
    torch.manual_seed(123)  # global RNG activity does not change the features
    torch.randn(10)
    assert torch.equal(fm.query(x), first)
    fm.redraw(generator=torch.Generator().manual_seed(1))
    assert not torch.equal(fm.query(x), first)
    fm.redraw(generator=torch.Generator().manual_seed(0))
    assert torch.equal(fm.query(x), first)


def test_log_space_map_exposes_log_features_consistently() -> None:
    fm = ToyPRF(head_dim=4, num_features=6)
    x = torch.randn(3, 4, dtype=torch.float64)
    fm = fm.double()
    torch.testing.assert_close(fm.query_log(x).exp(), fm.query(x))
    with pytest.raises(ka.InputError, match="log-space maps"):
        ka.EluFeatureMap(head_dim=4).query_log(x)


def test_half_inputs_give_float32_log_features() -> None:
    fm = ToyPRF(head_dim=4, num_features=6)
    assert fm.key_log(torch.randn(2, 4, dtype=torch.float16)).dtype == torch.float32


def test_row_normalizer_stabiliser() -> None:
    norm = ka.RowNormalizer()
    num = torch.tensor([[2.0, 4.0], [0.0, 0.0], [1.0, 1.0]])
    den = torch.tensor([2.0, 0.0, -0.5])
    out = norm.normalize(num, den)
    torch.testing.assert_close(out, torch.tensor([[1.0, 2.0], [0.0, 0.0], [-2.0, -2.0]]))
    # invariant to a common positive per-query factor
    c = torch.tensor([3.0, 7.0, 0.25])
    torch.testing.assert_close(norm.normalize(num * c[:, None], den * c), out)


def test_estimator_scale_option() -> None:
    q, k, v = qkv(n=5, d=4)
    out = ka.create("softmax", scale=1.0)(q, k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=1.0)
    torch.testing.assert_close(out, ref)
    with pytest.raises(ka.InputError, match="scale: expected a positive finite number"):
        ka.create("softmax", scale=-1.0)


def test_estimator_float32_and_float64_preserved(use_registry) -> None:
    for dtype in (torch.float32, torch.float64):
        q, k, v = qkv(dtype=dtype)
        for name in ("softmax", "elu", "toy-prf"):
            est = ka.create(name)
            if dtype == torch.float64:
                est = est.double()
            assert est(q, k, v).dtype == dtype


def test_signed_row_normalizer_keeps_sign_bounds_output_and_matches_row_when_safe() -> None:
    norm = ka.SignedRowNormalizer(eps=1e-2)
    num = torch.tensor([[0.5, -1.0], [1e-3, 2e-3], [0.3, 0.3], [0.0, 0.0]], dtype=torch.float64)
    den = torch.tensor([2.0, 1e-9, -0.6, 0.0], dtype=torch.float64)
    out = norm.normalize(num, den)
    ratio = ka.RowNormalizer().normalize(num, den)
    torch.testing.assert_close(out[0], ratio[0], rtol=1e-4, atol=0)  # moderate ratio: plain division
    assert (out[2] < 0).all()  # negative denominator keeps its sign
    assert float(out.pow(2).mean(-1).sqrt().max()) <= 1 / (2 * 1e-2) + 1e-9  # RMS cap 1/(2 eps)
    assert float(ratio[1].abs().max()) > 1e5 and float(out[1].abs().max()) < 50  # bounded where row explodes
    assert (out[3] == 0).all()
    with pytest.raises(ka.InputError, match="eps: expected a finite number >= 0"):
        ka.SignedRowNormalizer(eps=-1.0)


def test_feature_map_default_normalizer_is_used_unless_overridden(use_registry) -> None:
    class SignedToy(ka.EluFeatureMap):
        default_normalizer = "signed-row"

    assert isinstance(ka.FeatureMapAttention(SignedToy(head_dim=4)).normalizer, ka.SignedRowNormalizer)
    est = ka.FeatureMapAttention(SignedToy(head_dim=4), normalizer="row")
    assert type(est.normalizer) is ka.RowNormalizer
    assert type(ka.create("elu").normalizer) is ka.RowNormalizer


def test_a_causal_only_estimator_is_refused_non_causal_by_the_base_class() -> None:
    from typing import ClassVar

    from kernelattn_core.errors import InputError

    class CausalOnly(ka.FeatureMapAttention):
        name: ClassVar[str] = "causal-only-test"
        supports_noncausal: ClassVar[bool] = False

        def __init__(self) -> None:
            super().__init__("elu")

    q = torch.randn(1, 1, 4, 2)
    est = CausalOnly()
    assert est(q, q, q, causal=True).shape == (1, 1, 4, 2)
    with pytest.raises(InputError, match="causal only"):
        est(q, q, q)
