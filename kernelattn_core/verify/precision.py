"""High-precision checks with mpmath."""

from __future__ import annotations

import math
from typing import Any

import mpmath
import sympy
import torch

from ..claims import KernelMatchesExpression, QuadratureIdentity
from ..interfaces.kernel import DotProductKernel
from .result import CheckResult, digits_agreed, verdict


def check_quadrature(claim: QuadratureIdentity, **ids: str) -> CheckResult:
    """HP001: ``evaluate(dps)`` gives value and target agreeing to ``digits`` digits."""
    if claim.evaluate is None:
        raise ValueError("QuadratureIdentity.evaluate is not set")
    dps = max(claim.dps, 30)
    with mpmath.workdps(dps):
        value, target, note = claim.evaluate(dps)
        agreed = digits_agreed(mpmath.mpf(value), mpmath.mpf(target)) if target != value else math.inf
    numbers: dict[str, Any] = {
        "value": mpmath.nstr(value, 30),
        "target": mpmath.nstr(target, 30),
        "digits_agreed": round(float(agreed), 2) if math.isfinite(agreed) else "all",
        "digits_required": claim.digits,
        "dps": dps,
    }
    return CheckResult(
        QuadratureIdentity.rule,
        claim=f"{claim.label or note}: value == target to {claim.digits} digits ({note})",
        numbers=numbers,
        verdict=verdict(agreed >= claim.digits),
        **ids,
    )


def check_kernel_expression(kernel: DotProductKernel, claim: KernelMatchesExpression, **ids: str) -> CheckResult:
    """KN003: the torch ``f(t)`` equals the SymPy expression evaluated at 30 digits."""
    t = sympy.Symbol("t")
    expr = claim.expression(t) if claim.expression is not None else kernel.sympy_expr(t)  # declared or the kernel's
    f = sympy.lambdify(t, expr, modules="mpmath")
    bound = 0.9 * kernel.radius if math.isfinite(kernel.radius) else 3.0
    points = [bound * (i / 10 - 1) for i in range(21)]  # -bound .. bound
    worst = math.inf
    with mpmath.workdps(30):
        exact = [f(mpmath.mpf(p)) for p in points]
    got = kernel.f(torch.tensor(points, dtype=torch.float64)).tolist()
    for g, e in zip(got, exact):
        worst = min(worst, digits_agreed(g, float(e)))
    return CheckResult(
        KernelMatchesExpression.rule,
        claim=f"torch f(t) == {expr}{f' ({claim.label})' if claim.label else ''} on |t| <= {bound:.3g}",
        numbers={"points": len(points), "min_digits_agreed": round(worst, 2) if math.isfinite(worst) else "all"},
        verdict=verdict(worst >= claim.digits),
        **ids,
    )
