"""The degree distribution of random Maclaurin features.

A normalised (optionally truncated) geometric law on the degrees
:math:`\\{s, s+1, \\dots, c\\}` (``start`` :math:`s`, ``stop`` :math:`c`, possibly
:math:`\\infty`):

.. math:: P[N = n] = \\frac{p^{-(n+1)}}{Z}, \\qquad
          Z = \\sum_{k=s}^{c} p^{-(k+1)}, \\qquad p > 1 .

* Paper mode, :math:`s = 0`, :math:`c = \\infty`: :math:`P[N = n] = (p-1)\\,p^{-(n+1)}`.
  The papers print :math:`1/p^{n+1}`, which sums to :math:`1/(p-1)` and so is a
  probability law only at :math:`p = 2` (erratum).
* Released mode (the authors' code), :math:`s = 1`, :math:`c = 20`: the degree-0
  feature is replaced by a deterministic constant and the law is renormalised on
  :math:`\\{1, \\dots, 20\\}`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from kernelattn_core.toolkit import InputError


@dataclass(frozen=True)
class DegreeDistribution:
    """Normalised geometric law on ``{start, ..., stop}`` (``stop=None``: unbounded).

    Parameters
    ----------
    p : float
        Ratio :math:`p > 1` (the papers use 2).
    start : int
        Smallest degree (0 in paper mode, 1 when a constant feature replaces degree 0).
    stop : int, optional
        Largest degree (inclusive), ``None`` for none.
    """

    p: float = 2.0
    start: int = 0
    stop: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.p, bool) or not isinstance(self.p, int | float) or not (1 < self.p < math.inf):
            raise InputError(f"p: expected a finite number > 1 (the degree law is (p-1)/p^(n+1)), got {self.p!r}")
        if isinstance(self.start, bool) or not isinstance(self.start, int) or self.start < 0:
            raise InputError(f"start: expected an integer >= 0, got {self.start!r}")
        if self.stop is not None and (
            isinstance(self.stop, bool) or not isinstance(self.stop, int) or self.stop < self.start
        ):
            raise InputError(f"max_degree: expected an integer >= {self.start} or None, got {self.stop!r}")

    @property
    def truncated(self) -> bool:
        """Whether the support is finite."""
        return self.stop is not None

    @property
    def _tail(self) -> float:
        """:math:`p^{-L}` with :math:`L` the number of support points (0 when unbounded)."""
        return 0.0 if self.stop is None else self.p ** -(self.stop - self.start + 1)

    @property
    def log_normalizer(self) -> float:
        """:math:`\\log Z`."""
        lp = math.log(self.p)
        return -(self.start + 1) * lp + math.log1p(-self._tail) - math.log1p(-1.0 / self.p)

    def log_pmf(self, n: torch.Tensor) -> torch.Tensor:
        """:math:`\\log P[N = n]` (float64; :math:`-\\infty` off the support)."""
        n = torch.as_tensor(n, dtype=torch.float64)
        out = -(n + 1) * math.log(self.p) - self.log_normalizer
        off = n < self.start
        if self.stop is not None:
            off = off | (n > self.stop)
        return out.masked_fill(off, -math.inf)

    def pmf(self, n: int) -> float:
        """:math:`P[N = n]` as a float."""
        return math.exp(float(self.log_pmf(torch.tensor(float(n)))))

    def sample(self, u: torch.Tensor) -> torch.Tensor:
        """Degrees from uniforms ``u`` in ``[0, 1)`` by inversion (long tensor, same shape).

        :math:`N = s + \\lfloor -\\log(1 - u (1 - p^{-L})) / \\log p \\rfloor`, the inverse
        of :math:`P[N - s \\ge k] = (p^{-k} - p^{-L}) / (1 - p^{-L})`.
        """
        u = u.to(torch.float64)
        k = torch.floor(-torch.log1p(-u * (1.0 - self._tail)) / math.log(self.p))
        if self.stop is not None:
            k = k.clamp(max=self.stop - self.start)  # guards rounding at u -> 1
        return k.to(torch.long) + self.start

    def mean(self) -> float:
        """:math:`\\mathbb{E}[N]` (exact for the unbounded law, summed otherwise)."""
        if self.stop is None:
            return self.start + 1.0 / (self.p - 1.0)
        n = torch.arange(self.start, self.stop + 1, dtype=torch.float64)
        return float((n * self.log_pmf(n).exp()).sum())

    def sympy_pmf(self, n: Any, p: Any) -> Any:
        """The pmf as a SymPy expression in ``n`` and a symbol ``p`` (normaliser summed symbolically)."""
        import sympy

        k = sympy.Symbol("k", integer=True, nonnegative=True)
        z = sympy.Sum(p ** (-(k + 1)), (k, self.start, sympy.oo if self.stop is None else self.stop)).doit()
        if self.stop is None:
            z = sympy.simplify(z.args[0][0] if isinstance(z, sympy.Piecewise) else z)
        return p ** (-(n + 1)) / z
