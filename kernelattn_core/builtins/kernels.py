"""Kernels built into the core."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import TYPE_CHECKING, ClassVar

import torch

from ..interfaces.kernel import DotProductKernel

if TYPE_CHECKING:
    import sympy


class SoftmaxKernel(DotProductKernel):
    """The softmax kernel :math:`K(q, k) = \\exp(\\langle q, k \\rangle)`.

    .. math:: f(t) = e^t = \\sum_{n \\ge 0} \\frac{t^n}{n!}, \\qquad a_n = \\frac{1}{n!},

    entire (infinite radius of convergence). Under the package's scaling convention
    (:math:`d^{-1/4}` on q and k) exact attention with this kernel is standard
    softmax attention, ``torch.nn.functional.scaled_dot_product_attention``.
    """

    name: ClassVar[str] = "softmax"
    positive: ClassVar[bool] = True
    radius: ClassVar[float] = math.inf

    def f(self, t: torch.Tensor) -> torch.Tensor:
        return t.exp()

    def sympy_expr(self, t: sympy.Symbol) -> sympy.Expr:
        import sympy

        return sympy.exp(t)

    def coefficient(self, n: int) -> Fraction:
        return Fraction(1, math.factorial(n))

    def log_evaluate(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return q @ k.transpose(-1, -2)  # [..., N, M]
