"""The Gaussian integral behind the KL-Transformer's Lemma S.2 (spec 002 §3.3, test S2).

The paper's Eq. 34 applies the half-line value of Abramowitz & Stegun 7.4.6 on the
whole line:

.. math:: \\text{printed: } \\int_{\\mathbb R^m} e^{-t^\\top A t}\\cos(2t^\\top x)\\,dt
          = \\frac{\\pi^{m/2}}{2^m |A|^{1/2}} e^{-x^\\top A^{-1} x},
          \\qquad
          \\text{correct: } \\pi^{m/2} |A|^{-1/2} e^{-x^\\top A^{-1} x},

off by :math:`2^m`. :func:`eq34_quadrature` evaluates the integral by mpmath
quadrature (diagonal :math:`A`, one or two dimensions) to compare with both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mpmath


def eq34_corrected(x: Sequence[Any], a_diag: Sequence[Any]) -> Any:
    """:math:`\\pi^{m/2}|A|^{-1/2} e^{-x^\\top A^{-1}x}` for diagonal :math:`A` (mpmath)."""
    m = len(x)
    det = mpmath.fprod(mpmath.mpf(a) for a in a_diag)
    quad = mpmath.fsum(mpmath.mpf(xi) ** 2 / mpmath.mpf(a) for xi, a in zip(x, a_diag))
    return mpmath.pi ** (mpmath.mpf(m) / 2) / mpmath.sqrt(det) * mpmath.exp(-quad)


def eq34_printed(x: Sequence[Any], a_diag: Sequence[Any]) -> Any:
    """The paper's Eq. 34, with the spurious :math:`2^{-m}`."""
    return eq34_corrected(x, a_diag) / 2 ** len(x)


def eq34_quadrature(x: Sequence[Any], a_diag: Sequence[Any]) -> Any:
    """:math:`\\int_{\\mathbb R^m} e^{-t^\\top At}\\cos(2t^\\top x)\\,dt` by quadrature (m = 1 or 2).

    The integrand is even in :math:`t`, so :math:`\\cos(2t^\\top x) = \\prod` of cosines
    minus sine cross terms that integrate to zero; the integral factorises over the
    coordinates of a diagonal :math:`A` and each factor is one 1-D quadrature.
    """
    out = mpmath.mpf(1)
    for xi, a in zip(x, a_diag):
        xi, a = mpmath.mpf(xi), mpmath.mpf(a)
        out *= mpmath.quad(
            lambda t, xi=xi, a=a: mpmath.exp(-a * t * t) * mpmath.cos(2 * xi * t), [-mpmath.inf, 0, mpmath.inf]
        )
    return out


# --------------------------------------------------------------------------- HP001 claims
_X, _A = ("0.4", "-1.1"), ("0.8", "2.5")


def hp_eq34_corrected(dps: int) -> tuple[Any, Any, str]:
    """HP001: the 2-D Gaussian cosine integral by quadrature equals the corrected Eq. 34."""
    with mpmath.workdps(dps):
        return eq34_quadrature(_X, _A), eq34_corrected(_X, _A), f"x = {_X}, diag A = {_A}"


def hp_eq34_printed(dps: int) -> tuple[Any, Any, str]:
    """HP001 negative control: the printed Eq. 34 (with :math:`2^{-m}`) against quadrature."""
    with mpmath.workdps(dps):
        return eq34_quadrature(_X, _A), eq34_printed(_X, _A), f"printed Eq. 34, x = {_X}, diag A = {_A}"
