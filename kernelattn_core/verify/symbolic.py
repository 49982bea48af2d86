"""Symbolic checks with SymPy: exact coefficients, pmfs, symbolic expectations."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import sympy

from ..claims import MaclaurinCoefficients, NonNegativeCoefficients, PmfSumsToOne, SymbolicExpectation
from ..interfaces.kernel import DotProductKernel
from .result import CheckResult, verdict


def as_sympy(value: Fraction | float | int) -> sympy.Expr:
    """An exact SymPy number for a Fraction or int; a Float otherwise."""
    if isinstance(value, Fraction):
        return sympy.Rational(value.numerator, value.denominator)
    if isinstance(value, int):
        return sympy.Integer(value)
    return sympy.Float(value, 30)


def taylor_coefficients(expr: sympy.Expr, t: sympy.Symbol, order: int) -> list[sympy.Expr]:
    """Exact Taylor coefficients :math:`[f^{(n)}(0)/n!]_{n \\le order}` of ``expr`` in ``t``."""
    series = sympy.series(expr, t, 0, order + 1).removeO()
    return [sympy.nsimplify(sympy.expand(series).coeff(t, n)) for n in range(order + 1)]


def check_coefficients(kernel: DotProductKernel, claim: MaclaurinCoefficients, **ids: str) -> CheckResult:
    """KN001: ``kernel.coefficient(n)`` equals SymPy's Taylor coefficient exactly."""
    t = sympy.Symbol("t")
    expected = taylor_coefficients(kernel.sympy_expr(t), t, claim.order)
    mismatches = []
    inexact = []
    for n, exp in enumerate(expected):
        got = kernel.coefficient(n)
        if not isinstance(got, Fraction | int):
            inexact.append(n)
        if sympy.simplify(as_sympy(got) - exp) != 0:
            mismatches.append((n, str(exp), str(got)))
    numbers: dict[str, Any] = {"order": claim.order, "mismatches": len(mismatches), "inexact_terms": len(inexact)}
    if mismatches:
        n, exp, got = mismatches[0]
        numbers.update({"first_bad_n": n, "sympy_a_n": exp, "plugin_a_n": got})
    return CheckResult(
        MaclaurinCoefficients.rule,
        claim=f"a_n == Taylor coefficient of {kernel.sympy_expr(t)} for n <= {claim.order}",
        numbers=numbers,
        verdict=verdict(not mismatches),
        **ids,
    )


def check_nonnegative(kernel: DotProductKernel, claim: NonNegativeCoefficients, **ids: str) -> CheckResult:
    """KN002: every :math:`a_n \\ge 0`."""
    negative = [n for n in range(claim.order + 1) if as_sympy(kernel.coefficient(n)) < 0]
    numbers: dict[str, Any] = {"order": claim.order, "negative_terms": len(negative)}
    if negative:
        numbers["first_negative_n"] = negative[0]
        numbers["a_n"] = str(kernel.coefficient(negative[0]))
    return CheckResult(
        NonNegativeCoefficients.rule,
        claim=f"a_n >= 0 for n <= {claim.order}",
        numbers=numbers,
        verdict=verdict(not negative),
        **ids,
    )


def check_pmf(claim: PmfSumsToOne, **ids: str) -> CheckResult:
    """SP001: :math:`\\sum_n \\mathrm{pmf}(n) = 1` exactly (free parameters symbolic)."""
    if claim.pmf is None:
        raise ValueError("PmfSumsToOne.pmf is not set")
    n = sympy.Symbol("n", integer=True, nonnegative=True)
    pmf = claim.pmf(n)
    upper = sympy.oo if claim.stop is None else claim.stop
    total = sympy.simplify(sympy.summation(pmf, (n, claim.start, upper)))
    if isinstance(total, sympy.Piecewise):  # convergence conditions: take the branch under the assumptions
        total = sympy.simplify(total.args[0][0])
    residual = sympy.simplify(total - 1)
    return CheckResult(
        PmfSumsToOne.rule,
        claim=f"sum over n >= {claim.start} of {claim.label} {pmf} == 1",
        numbers={"sum": str(total), "sum_minus_one": str(residual)},
        verdict=verdict(residual == 0),
        **ids,
    )


def check_symbolic_expectation(claim: SymbolicExpectation, **ids: str) -> CheckResult:
    """FM005: the symbolic expectation of the estimator simplifies to the kernel."""
    if claim.derive is None:
        raise ValueError("SymbolicExpectation.derive is not set")
    expectation, target, note = claim.derive()
    residual = sympy.simplify(expectation - target)
    if residual != 0:  # a second, stronger attempt before declaring a mismatch
        residual = sympy.simplify(sympy.expand(sympy.powsimp(sympy.expand_power_exp(residual), force=True)))
    return CheckResult(
        SymbolicExpectation.rule,
        claim=f"E[estimator] == {target} ({note})",
        numbers={"expectation": str(expectation), "target": str(target), "difference": str(residual)},
        verdict=verdict(residual == 0),
        **ids,
    )
