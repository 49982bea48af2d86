"""Kernels: exact coefficients (KN001), non-negativity (KN002), expressions (KN003), the
papers' Table 1 errata, radius and domain checks, user kernels."""

from __future__ import annotations

import math
from fractions import Fraction

import mpmath
import pytest
import sympy
import torch
from kernelattn_maclaurin import PAPER_TABLE_1, PolynomialKernel, UserKernel
from kernelattn_maclaurin.kernels import KERNELS, ExpKernel, InvKernel, LogiKernel, SqrtKernel, TrighKernel

from kernelattn_core import get_registry
from kernelattn_core.toolkit import DomainError, InputError

ORDER = 24
T = sympy.Symbol("t")
NAMED = [cls() for cls in KERNELS if cls is not PolynomialKernel] + [
    PolynomialKernel(c=1, degree=3),
    PolynomialKernel(c=Fraction(1, 2), degree=7),
    PolynomialKernel(c=0, degree=4),
]


def series_coefficients(expr: sympy.Expr, order: int) -> list[sympy.Rational]:
    poly = sympy.series(expr, T, 0, order + 1).removeO()
    return [sympy.Poly(poly, T).coeff_monomial(T**n) for n in range(order + 1)]


@pytest.mark.parametrize("kernel", NAMED, ids=repr)
def test_coefficients_equal_sympy_series_exactly(kernel):
    """KN001: every coefficient is the exact Taylor coefficient (rational equality, no tolerance)."""
    want = series_coefficients(kernel.sympy_expr(T), ORDER)
    got = [kernel.coefficient(n) for n in range(ORDER + 1)]
    assert all(isinstance(a, Fraction) for a in got)
    for n, (a, b) in enumerate(zip(got, want)):
        assert sympy.Rational(a.numerator, a.denominator) == b, f"a_{n}: {a} != {b}"
    assert all(a >= 0 for a in got)  # KN002


@pytest.mark.parametrize("kernel", NAMED, ids=repr)
def test_log_coefficients_match_exact_values(kernel):
    n_max = 60
    exact = torch.tensor(
        [math.log(kernel.coefficient(n)) if kernel.coefficient(n) > 0 else -math.inf for n in range(n_max + 1)],
        dtype=torch.float64,
    )
    fast = kernel.log_coefficients(n_max)
    finite = torch.isfinite(exact)
    assert torch.equal(finite, torch.isfinite(fast))
    assert torch.allclose(fast[finite], exact[finite], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernel", NAMED, ids=repr)
def test_torch_kernel_matches_expression_at_30_digits(kernel):
    """KN003: f(t) in float64 equals the SymPy expression evaluated by mpmath at 30 digits."""
    ts = [-0.9, -0.5, -0.1, 0.0, 0.05, 0.3, 0.7, 0.95]
    got = kernel.f(torch.tensor(ts, dtype=torch.float64))
    fn = sympy.lambdify(T, kernel.sympy_expr(T), modules="mpmath")
    with mpmath.workdps(30):
        for t, g in zip(ts, got.tolist()):
            want = fn(mpmath.mpf(t))
            assert abs(g - float(want)) <= 1e-13 * max(1.0, abs(float(want)))


def test_first_coefficients_as_listed_in_the_specs():
    assert SqrtKernel().coefficients(8) == [Fraction(x) for x in ("1", "1/2", "1/8", "1/16", "5/128", "7/256")] + [
        Fraction(21, 1024),
        Fraction(33, 2048),
        Fraction(429, 32768),
    ]
    assert LogiKernel().coefficients(5) == [Fraction(1, max(1, n)) for n in range(6)]
    assert InvKernel().coefficients(4) == [Fraction(1)] * 5
    assert ExpKernel().coefficient(5) == Fraction(1, 120)


# --------------------------------------------------------------------------- errata regression (negative controls)
def test_printed_logi_coefficients_are_wrong():
    """Table 1 prints 1/min(1, N): division by zero at N = 0 and 1 (not 1/N) for N >= 2."""
    with pytest.raises(ZeroDivisionError):
        PAPER_TABLE_1["logi"](0)
    true = series_coefficients(LogiKernel().sympy_expr(T), 10)
    printed = [PAPER_TABLE_1["logi"](n) for n in range(1, 11)]
    mismatches = [n for n in range(1, 11) if sympy.Rational(printed[n - 1]) != true[n]]
    assert mismatches == list(range(2, 11))
    assert PAPER_TABLE_1["logi"](4) == 1 and LogiKernel().coefficient(4) == Fraction(1, 4)


def test_printed_sqrt_coefficients_are_wrong_from_degree_four():
    true = series_coefficients(SqrtKernel().sympy_expr(T), 12)
    printed = [sympy.Rational(PAPER_TABLE_1["sqrt"](n)) for n in range(13)]
    mismatches = [n for n in range(13) if printed[n] != true[n]]
    assert mismatches == list(range(4, 13))
    assert PAPER_TABLE_1["sqrt"](4) == Fraction(5, 384) and SqrtKernel().coefficient(4) == Fraction(5, 128)
    assert PAPER_TABLE_1["sqrt"](5) == Fraction(7, 3840) and SqrtKernel().coefficient(5) == Fraction(7, 256)


def test_printed_exp_inv_trigh_coefficients_are_right():
    for name, cls in (("exp", ExpKernel), ("inv", InvKernel), ("trigh", TrighKernel)):
        assert [PAPER_TABLE_1[name](n) for n in range(15)] == cls().coefficients(14)


def test_trigh_is_exactly_exp():
    assert sympy.simplify(sympy.sinh(T) + sympy.cosh(T) - sympy.exp(T)) == 0
    t = torch.linspace(-3, 3, 13, dtype=torch.float64)
    assert torch.equal(TrighKernel().f(t), ExpKernel().f(t))
    assert TrighKernel().coefficients(30) == ExpKernel().coefficients(30)
    assert "identical" in TrighKernel.__doc__.lower()


# --------------------------------------------------------------------------- radius and domain
@pytest.mark.parametrize(
    ("kernel", "radius"),
    [(ExpKernel(), math.inf), (InvKernel(), 1.0), (LogiKernel(), 1.0), (SqrtKernel(), 1.0), (TrighKernel(), math.inf)],
    ids=repr,
)
def test_radius_agrees_with_the_ratio_test(kernel, radius):
    ratios = [kernel.coefficient(n) / kernel.coefficient(n + 1) for n in (200, 400)]
    assert kernel.radius == radius
    if math.isinf(radius):
        assert ratios[1] > ratios[0] > 100  # a_n / a_{n+1} = n + 1 grows without bound
    else:
        assert abs(float(ratios[1]) - 1.0) < 0.005 and abs(float(ratios[1]) - 1) < abs(float(ratios[0]) - 1) + 1e-15


@pytest.mark.parametrize("name", ["inv", "logi", "sqrt"])
def test_domain_check_rejects_inputs_outside_the_radius(name):
    kernel = get_registry().kernel(name)()
    q = torch.tensor([[1.2, 0.0]], dtype=torch.float64)
    with pytest.raises(DomainError, match=r"\|<q, k>\| < 1"):
        kernel(q, q)
    ok = kernel(0.9 * q / 1.2, q / 1.2)
    assert torch.isfinite(ok).all()


def test_entire_kernels_have_no_domain_limit():
    q = torch.tensor([[3.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(ExpKernel()(q, q), torch.tensor([[math.exp(9.0)]], dtype=torch.float64))
    assert PolynomialKernel(c=1, degree=2)(q, q).item() == 100.0


def test_polynomial_rejects_bad_parameters():
    with pytest.raises(InputError, match="c: expected a finite number >= 0"):
        PolynomialKernel(c=-1, degree=3)
    with pytest.raises(InputError, match="degree"):
        PolynomialKernel(c=1, degree=2.5)
    assert PolynomialKernel(c=2, degree=3).coefficients(5) == [8, 12, 6, 1, 0, 0]


# --------------------------------------------------------------------------- user kernels
def test_user_kernel_from_sympy_expression():
    k = UserKernel("exp(t) / (1 - t)", radius=1.0)
    want = series_coefficients(sympy.exp(T) / (1 - T), 20)
    assert [sympy.Rational(k.coefficient(n).numerator, k.coefficient(n).denominator) for n in range(21)] == want
    t = torch.tensor([0.1, -0.4], dtype=torch.float64)
    assert torch.allclose(k.f(t), t.exp() / (1 - t))
    with pytest.raises(DomainError):
        k(torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64))


def test_user_kernel_from_coefficient_function():
    k = UserKernel(coefficients=lambda n: Fraction(1, 2**n), radius=2.0)  # 1 / (1 - t/2)
    t = torch.tensor([0.5, -1.0], dtype=torch.float64)
    assert torch.allclose(k.f(t), 1 / (1 - t / 2), rtol=1e-12)
    poly = UserKernel(coefficients=lambda n: [1, 2, 1][n] if n < 3 else 0)  # (1 + t)^2, exact
    assert torch.equal(poly.f(t), (1 + t) ** 2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"expr": "cos(t)"}, r"negative Maclaurin coefficient a_2 = -1/2"),
        ({"expr": "1 - log(1 + t)"}, r"a_1 = -1"),
        ({"coefficients": lambda n: (-1) ** n}, r"a_1 = -1"),
    ],
)
def test_user_kernel_with_a_negative_coefficient_is_refused(kwargs, match):
    with pytest.raises(InputError, match=match):
        UserKernel(**kwargs)


def test_user_kernel_needs_exactly_one_definition():
    with pytest.raises(InputError, match="exactly one"):
        UserKernel()
    with pytest.raises(InputError, match="exactly one"):
        UserKernel("exp(t)", coefficients=lambda n: 1)
