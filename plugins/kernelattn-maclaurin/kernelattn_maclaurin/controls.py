"""Declared negative controls of the kernel claims (``expect="fail"``): formulas as the
papers print them, and a kernel the plugin refuses to build.

Each is attached to a registered kernel's ``claims`` in :mod:`kernelattn_maclaurin.kernels`
so that ``kernelattn verify`` shows every kernel checker rejecting a false statement
for a stated reason:

* KN001 on ``sqrt``: Table 1's printed coefficient :math:`\\max(1, 2N-3)/(2^N N!)` is not
  the Taylor series of :math:`2 - \\sqrt{1 - t}` from :math:`N = 4` on (:math:`5/384` vs
  :math:`5/128`; SchoenbAt spec erratum 2).
* KN003 on ``logi``: Table 1's printed coefficients :math:`1/\\min(1, N)` are 1 for every
  :math:`N \\ge 1`, so (with :math:`a_0 = 1`) they sum to :math:`1/(1 - t)`, the ``inv``
  kernel, not :math:`1 - \\log(1 - t)` (erratum 1).
* KN002 and KN006 on ``polynomial``: :math:`(c + t)^3` with the offset :math:`c = -1` that
  :class:`~kernelattn_maclaurin.kernels.PolynomialKernel` refuses has negative
  coefficients :math:`a_0 = -1, a_2 = -3`, so it is not positive definite on the sphere
  (Schoenberg): its Gram matrices have negative eigenvalues (the diagonal
  :math:`(|x|^2 - 1)^3` is negative for :math:`|x| < 1`).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, ClassVar

import torch

from kernelattn_core import DotProductKernel

from .kernels import PAPER_TABLE_1

#: The offset of the negative-offset polynomial control, and its degree.
NEGATIVE_OFFSET, DEGREE = -1, 3


def printed_sqrt_coefficient(n: int) -> Fraction:
    """Table 1's sqrt row as printed: :math:`\\max(1, 2N-3)/(2^N N!)`."""
    return PAPER_TABLE_1["sqrt"](n)


def printed_logi_expression(t: Any) -> Any:
    """What Table 1's printed logi coefficients sum to: :math:`1 + \\sum_{N\\ge1} t^N = 1/(1 - t)`
    (with the true :math:`a_0 = 1`; the printed :math:`1/\\min(1, 0)` divides by zero)."""
    return 1 / (1 - t)


def negative_offset_coefficient(n: int) -> Fraction:
    """:math:`a_n = \\binom{3}{n} c^{3-n}` of :math:`(c + t)^3` at :math:`c = -1`."""
    return Fraction(math.comb(DEGREE, n) * NEGATIVE_OFFSET ** (DEGREE - n)) if n <= DEGREE else Fraction(0)


class NegativeOffsetPolynomial(DotProductKernel):
    """:math:`f(t) = (t - 1)^3`: the polynomial kernel with the negative offset that
    ``PolynomialKernel`` refuses (not registered; the subject of the KN006 control)."""

    name: ClassVar[str] = "polynomial(c=-1)"

    def f(self, t: torch.Tensor) -> torch.Tensor:
        return (t + NEGATIVE_OFFSET) ** DEGREE

    def sympy_expr(self, t: Any) -> Any:
        return (t + NEGATIVE_OFFSET) ** DEGREE

    def coefficient(self, n: int) -> Fraction:
        return negative_offset_coefficient(n)


__all__ = [
    "NegativeOffsetPolynomial",
    "negative_offset_coefficient",
    "printed_logi_expression",
    "printed_sqrt_coefficient",
]
