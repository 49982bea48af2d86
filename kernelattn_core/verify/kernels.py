"""Checks of kernels that need not be dot-product kernels (KN004-KN006).

* KN004: the torch kernel against a closed form evaluated in mpmath at 30 digits.
* KN005: a shift-invariant kernel against the Fourier transform of its spectral
  density (Bochner), an mpmath integral in one dimension.
* KN006: Gram matrices on random point sets are symmetric positive semi-definite.
"""

from __future__ import annotations

import math
from typing import Any

import mpmath
import torch

from ..claims import KernelClosedForm, PositiveDefinite, SpectralDensityIntegral
from ..interfaces.kernel import DotProductKernel, Kernel
from .result import CheckResult, digits_agreed, verdict

SEED = 20_261_123


def _points(d: int, n: int, norm_range: tuple[float, float], g: torch.Generator) -> torch.Tensor:
    """``[n, d]`` float64: random directions with norms uniform in ``norm_range``."""
    u = torch.randn(n, d, generator=g, dtype=torch.float64)
    r = norm_range[0] + (norm_range[1] - norm_range[0]) * torch.rand(n, 1, generator=g, dtype=torch.float64)
    return u / u.norm(dim=-1, keepdim=True) * r


def _gram(kernel: Kernel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``[N, M]`` :math:`K(x_i, y_j)` for ``x [N, d]``, ``y [M, d]`` (float64)."""
    with torch.no_grad():
        return kernel(x[None, None], y[None, None])[0, 0].to(torch.float64)


def check_closed_form(kernel: Kernel, claim: KernelClosedForm, **ids: str) -> CheckResult:
    """KN004: ``K(x_i, y_i)`` (torch, float64) against ``expression`` at 30 digits."""
    if claim.expression is None:
        raise ValueError("KernelClosedForm.expression is not set")
    worst, count = math.inf, 0
    for d in claim.dims:
        g = torch.Generator().manual_seed(SEED + d)
        if claim.inputs is not None:
            x, y = claim.inputs(d, claim.points, g)
        else:
            x, y = _points(d, claim.points, claim.norm_range, g), _points(d, claim.points, claim.norm_range, g)
        got = torch.diagonal(_gram(kernel, x, y)).tolist()
        with mpmath.workdps(30):
            for i, value in enumerate(got):
                exact = claim.expression([mpmath.mpf(v) for v in x[i].tolist()], [mpmath.mpf(v) for v in y[i].tolist()])
                worst = min(worst, digits_agreed(value, float(exact)))
                count += 1
    return CheckResult(
        KernelClosedForm.rule,
        claim=f"torch K(x, y) == closed form (mpmath, 30 digits), d in {list(claim.dims)}",
        numbers={
            "points": count,
            "min_digits_agreed": round(worst, 2) if math.isfinite(worst) else "all",
            "digits_required": claim.digits,
        },
        verdict=verdict(worst >= claim.digits),
        **ids,
    )


def check_spectral_integral(kernel: Any, claim: SpectralDensityIntegral, **ids: str) -> CheckResult:
    """KN005: :math:`g(\\delta) = 2\\int_0^\\infty p(\\omega)\\cos(\\omega\\delta)d\\omega` in d = 1."""
    density = claim.density or getattr(kernel, "spectral_density_mp", None)  # declared (a control) or the kernel's
    if density is None:
        raise TypeError(f"{type(kernel).__name__} has no spectral_density_mp(omega): KN005 needs the declared density")
    x = torch.tensor([[0.0]], dtype=torch.float64)
    y = torch.tensor([[dlt] for dlt in claim.deltas], dtype=torch.float64)
    got = _gram(kernel, x, y)[0].tolist()  # [len(deltas)]
    worst = math.inf
    values = []
    with mpmath.workdps(claim.dps):
        for dlt, value in zip(claim.deltas, got):
            delta = mpmath.mpf(dlt)
            if delta == 0:
                integral = 2 * mpmath.quad(lambda w: density([w]), [0, 1, 4, 16, mpmath.inf])
            else:  # oscillatory tail (heavy for Cauchy / Student-t densities): mpmath's quadosc
                integral = 2 * mpmath.quadosc(
                    lambda w, delta=delta: density([w]) * mpmath.cos(w * delta), [0, mpmath.inf], omega=delta
                )
            values.append(float(integral))
            worst = min(worst, digits_agreed(value, float(integral)))
    return CheckResult(
        SpectralDensityIntegral.rule,
        claim=f"g(delta) == 2 int_0^inf p(w) cos(w delta) dw (d = 1) at delta in {list(claim.deltas)}"
        + (f", p = {claim.label}" if claim.label else ""),
        numbers={
            "torch": [float(f"{v:.12g}") for v in got],
            "integral": [float(f"{v:.12g}") for v in values],
            "min_digits_agreed": round(worst, 2) if math.isfinite(worst) else "all",
            "digits_required": claim.digits,
        },
        verdict=verdict(worst >= claim.digits),
        **ids,
    )


def check_positive_definite(kernel: Kernel, claim: PositiveDefinite, **ids: str) -> CheckResult:
    """KN006: smallest eigenvalue of symmetric Gram matrices on random point sets."""
    lo, hi = claim.norm_range
    if isinstance(kernel, DotProductKernel) and math.isfinite(kernel.radius):
        hi = min(hi, 0.9 * math.sqrt(kernel.radius))
        lo = min(lo, hi / 2)
    worst_ratio, worst_asym = math.inf, 0.0
    for d in claim.dims:
        g = torch.Generator().manual_seed(SEED + 31 * d)
        for _ in range(claim.sets):
            x = _points(d, claim.size, (lo, hi), g)
            gram = _gram(kernel, x, x)
            scale = float(gram.abs().max()).__abs__() or 1.0
            worst_asym = max(worst_asym, float((gram - gram.T).abs().max()) / scale)
            eig = torch.linalg.eigvalsh(0.5 * (gram + gram.T))
            worst_ratio = min(worst_ratio, float(eig.min()) / max(float(eig.abs().max()), 1e-300))
    ok = worst_ratio > -1e-10 and worst_asym < 1e-12
    return CheckResult(
        PositiveDefinite.rule,
        claim=(
            f"Gram matrices{f' of {claim.label}' if claim.label else ''} on {claim.sets} sets of {claim.size} "
            f"points, d in {list(claim.dims)}, |x| in [{lo:.3g}, {hi:.3g}] are symmetric PSD"
        ),
        numbers={
            "min_eig_over_max": float(f"{worst_ratio:.3g}"),
            "max_asymmetry": float(f"{worst_asym:.3g}"),
            "threshold": -1e-10,
        },
        verdict=verdict(ok),
        **ids,
    )
