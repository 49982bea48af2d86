"""Symbolic checks with SymPy: exact coefficients, pmfs, symbolic expectations."""

from __future__ import annotations

import math
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
    coefficient = claim.coefficients or kernel.coefficient  # a declared table (negative control) or the runtime's
    mismatches = []
    inexact = []
    for n, exp in enumerate(expected):
        got = coefficient(n)
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
        claim=f"{claim.label or 'a_n'} == Taylor coefficient of {kernel.sympy_expr(t)} for n <= {claim.order}",
        numbers=numbers,
        verdict=verdict(not mismatches),
        **ids,
    )


def check_nonnegative(kernel: DotProductKernel, claim: NonNegativeCoefficients, **ids: str) -> CheckResult:
    """KN002: every :math:`a_n \\ge 0`, and the runtime's log-coefficient table (when the
    kernel has ``log_coefficients``) equals :math:`\\log a_n` to 12 digits."""
    coefficient = claim.coefficients or kernel.coefficient  # a declared table (negative control) or the runtime's
    coeffs = [coefficient(n) for n in range(claim.order + 1)]
    negative = [n for n, a in enumerate(coeffs) if as_sympy(a) < 0]
    numbers: dict[str, Any] = {"order": claim.order, "negative_terms": len(negative)}
    if negative:
        numbers["first_negative_n"] = negative[0]
        numbers["a_n"] = str(coeffs[negative[0]])
    runtime_bad: list[int] = []
    table = getattr(kernel, "log_coefficients", None) if claim.coefficients is None else None
    if callable(table):
        logs = [float(v) for v in table(claim.order)]
        for n, (a, la) in enumerate(zip(coeffs, logs)):
            a = float(a)
            if a > 0:
                good = math.isfinite(la) and abs(la - math.log(a)) <= 1e-12 * max(1.0, abs(math.log(a)))
            else:
                good = la == -math.inf and a == 0
            if not good:
                runtime_bad.append(n)
        numbers["runtime_log_table_mismatches"] = len(runtime_bad)
        if runtime_bad:
            n = runtime_bad[0]
            numbers.update({"first_runtime_mismatch_n": n, "log_a_n": logs[n], "a_n_declared": str(coeffs[n])})
    return CheckResult(
        NonNegativeCoefficients.rule,
        claim=f"{claim.label or 'a_n'} >= 0 for n <= {claim.order}"
        + (" and the runtime log-coefficient table equals log a_n" if callable(table) else ""),
        numbers=numbers,
        verdict=verdict(not negative and not runtime_bad),
        **ids,
    )


def chi2_quantile(prob: float, dof: int) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (relative error below
    1% for ``dof >= 3`` in the far tail; enough for a 1e-6 false-failure threshold)."""
    from statistics import NormalDist

    z = NormalDist().inv_cdf(prob)
    h = 2.0 / (9.0 * dof)
    return dof * (1.0 - h + z * math.sqrt(h)) ** 3


def _runtime_law(claim: PmfSumsToOne, pmf: sympy.Expr, n: sympy.Symbol) -> dict[str, Any]:
    """Compare the law the class samples from with the declared pmf: values to 12 digits
    on the first 40 support points, and (when it samples by inversion) a chi-square test
    of ``claim.draws`` samples. Returns numbers with a ``runtime_ok`` verdict."""
    import torch

    from .result import FALSE_FAILURE_RATE

    assert claim.runtime is not None
    law, values = claim.runtime()
    subs = {s: values[s.name] for s in pmf.free_symbols if s.name in values}
    stop = claim.start + 39 if claim.stop is None else min(claim.stop, claim.start + 39)
    support = list(range(claim.start, stop + 1))
    declared = [float(pmf.subs(subs).subs(n, k)) for k in support]
    got = [float(law.pmf(k)) for k in support]
    worst = max(abs(g - e) / max(abs(e), 1e-300) for g, e in zip(got, declared))
    out: dict[str, Any] = {"runtime_max_rel_diff": float(f"{worst:.3g}")}
    ok = worst <= 1e-12
    if hasattr(law, "sample"):
        u = torch.rand(claim.draws, generator=torch.Generator().manual_seed(20_261_125), dtype=torch.float64)
        draws = law.sample(u)
        # bins: each support point with expected count >= 5, the rest pooled into a tail bin
        expected = [claim.draws * p for p in declared]
        keep = [i for i, e in enumerate(expected) if e >= 5]
        counts = [int((draws == support[i]).sum()) for i in keep]
        tail_obs = claim.draws - sum(counts)
        tail_exp = claim.draws - sum(expected[i] for i in keep)
        chi2 = sum((c - expected[i]) ** 2 / expected[i] for c, i in zip(counts, keep))
        dof = len(keep) - 1
        if tail_exp >= 5:
            chi2 += (tail_obs - tail_exp) ** 2 / tail_exp
            dof += 1
        elif tail_obs > max(5.0, 10 * tail_exp):
            chi2 = math.inf
        limit = chi2_quantile(1 - FALSE_FAILURE_RATE, max(dof, 1))
        out.update({"sampler_chi2": round(chi2, 2), "chi2_limit": round(limit, 2), "sampler_draws": claim.draws})
        ok = ok and chi2 < limit
    out["runtime_ok"] = ok
    return out


def check_pmf(claim: PmfSumsToOne, **ids: str) -> CheckResult:
    """SP001: :math:`\\sum_n \\mathrm{pmf}(n) = 1` exactly (free parameters symbolic), and,
    with ``claim.runtime``, the runtime law equals the declared pmf and samples from it."""
    if claim.pmf is None:
        raise ValueError("PmfSumsToOne.pmf is not set")
    n = sympy.Symbol("n", integer=True, nonnegative=True)
    pmf = claim.pmf(n)
    upper = sympy.oo if claim.stop is None else claim.stop
    total = sympy.simplify(sympy.summation(pmf, (n, claim.start, upper)))
    if isinstance(total, sympy.Piecewise):  # convergence conditions: take the branch under the assumptions
        total = sympy.simplify(total.args[0][0])
    residual = sympy.simplify(total - 1)
    numbers: dict[str, Any] = {"sum": str(total), "sum_minus_one": str(residual)}
    ok = residual == 0
    if claim.runtime is not None:
        numbers.update(_runtime_law(claim, pmf, n))
        ok = ok and numbers["runtime_ok"]
    return CheckResult(
        PmfSumsToOne.rule,
        claim=f"sum over n >= {claim.start} of {claim.label} {pmf} == 1"
        + ("; the runtime law equals it and samples from it" if claim.runtime is not None else ""),
        numbers=numbers,
        verdict=verdict(ok),
        **ids,
    )


def _wants_map(derive: Any) -> bool:
    import inspect

    try:
        return "feature_map" in inspect.signature(derive).parameters
    except (TypeError, ValueError):
        return False


def check_symbolic_expectation(claim: SymbolicExpectation, feature_map: Any = None, **ids: str) -> CheckResult:
    """FM005: the symbolic expectation of the estimator simplifies to the kernel.

    ``feature_map`` is the registered class; a ``derive`` that takes ``feature_map``
    receives it built (``head_dim=claim.dim``) with fixed seed."""
    if claim.derive is None:
        raise ValueError("SymbolicExpectation.derive is not set")
    if _wants_map(claim.derive):
        import torch

        if feature_map is None:
            raise ValueError("FM005: this derive() reads the runtime map; pass feature_map")
        fm = feature_map(num_features=claim.num_features, **dict(claim.options))
        fm.build(claim.dim, generator=torch.Generator().manual_seed(20_261_121))
        expectation, target, note = claim.derive(feature_map=fm)
    else:
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
