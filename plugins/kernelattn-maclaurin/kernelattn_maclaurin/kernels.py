"""Dot-product kernels with exact Maclaurin coefficients.

Every kernel here is :math:`K(x, y) = f(\\langle x, y\\rangle)` with

.. math:: f(t) = \\sum_{n \\ge 0} a_n t^n, \\qquad a_n \\ge 0,

so that it is positive definite on the unit ball (Schoenberg) and random Maclaurin
features (:mod:`kernelattn_maclaurin.feature_maps`) estimate it without bias. The
coefficients are the true Taylor coefficients, as exact :class:`fractions.Fraction`;
Table 1 of the SchoenbAt / Macformer papers prints two of them wrongly (see
:data:`PAPER_TABLE_1` and the errata in the README).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from fractions import Fraction
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kernelattn_core import DotProductKernel
from kernelattn_core.toolkit import InputError, KernelMatchesExpression, MaclaurinCoefficients, NonNegativeCoefficients

if TYPE_CHECKING:
    import sympy

_KERNEL_CLAIMS = (MaclaurinCoefficients(order=24), NonNegativeCoefficients(order=40), KernelMatchesExpression())


class MaclaurinKernel(DotProductKernel):
    """Base of the dot-product kernels of this plugin.

    Adds :meth:`log_coefficients` (float64 :math:`\\log a_n`, :math:`-\\infty` for
    :math:`a_n = 0`), used by the variance formulas and the feature weights.
    """

    def log_coefficients(self, n_max: int) -> torch.Tensor:
        """``[n_max + 1]`` float64 tensor of :math:`\\log a_n` (exact rationals, then one rounding)."""
        return torch.tensor([_log_fraction(self.coefficient(n)) for n in range(n_max + 1)], dtype=torch.float64)


def _log_fraction(a: Fraction | float) -> float:
    if a == 0:
        return -math.inf
    if a < 0:
        raise InputError(f"coefficient: expected a non-negative Maclaurin coefficient, got {a}")
    if isinstance(a, Fraction):
        return math.log(a.numerator) - math.log(a.denominator)  # exact for huge integers
    return math.log(a)


class ExpKernel(MaclaurinKernel):
    """The exponential dot-product kernel (softmax attention).

    .. math:: f(t) = e^t, \\qquad a_n = \\frac{1}{n!}, \\qquad R = \\infty .

    The same function as the core's ``softmax`` kernel, registered under the papers'
    name ``exp`` so that every kernel of Table 1 has its own registry entry.
    """

    name: ClassVar[str] = "exp"
    positive: ClassVar[bool] = True
    radius: ClassVar[float] = math.inf
    claims: ClassVar[tuple[Any, ...]] = _KERNEL_CLAIMS

    def f(self, t: torch.Tensor) -> torch.Tensor:
        return t.exp()

    def sympy_expr(self, t: sympy.Symbol) -> sympy.Expr:
        import sympy

        return sympy.exp(t)

    def coefficient(self, n: int) -> Fraction:
        return Fraction(1, math.factorial(_check_order(n)))

    def log_evaluate(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return q @ k.transpose(-1, -2)  # [..., N, M]

    def log_coefficients(self, n_max: int) -> torch.Tensor:
        n = torch.arange(n_max + 1, dtype=torch.float64)
        return -torch.lgamma(n + 1)


class TrighKernel(ExpKernel):
    """The papers' "trigh" kernel :math:`f(t) = \\sinh t + \\cosh t`.

    **This is exactly the exponential kernel**: :math:`\\sinh t + \\cosh t = e^t`, so
    :math:`a_n = 1/n!` and every estimate made with it is identical to ``exp`` (the
    same seed gives bit-identical features). It is kept as a named alias class only
    because the papers report it as a separate kernel; their differing results for
    ``exp`` and ``trigh`` (e.g. Retrieval accuracy 70.74 vs 74.23 in Macformer's
    Table 2) can only be run-to-run noise. :meth:`sympy_expr` returns the literal
    :math:`\\sinh t + \\cosh t` so the coefficient check proves the identity.
    """

    name: ClassVar[str] = "trigh"

    def sympy_expr(self, t: sympy.Symbol) -> sympy.Expr:
        import sympy

        return sympy.sinh(t) + sympy.cosh(t)


class InvKernel(MaclaurinKernel):
    """The inverse kernel.

    .. math:: f(t) = \\frac{1}{1 - t}, \\qquad a_n = 1, \\qquad R = 1 .

    Defined for :math:`|t| < 1` only (:meth:`check_domain`); positive there.
    """

    name: ClassVar[str] = "inv"
    positive: ClassVar[bool] = True
    radius: ClassVar[float] = 1.0
    claims: ClassVar[tuple[Any, ...]] = _KERNEL_CLAIMS

    def f(self, t: torch.Tensor) -> torch.Tensor:
        return 1.0 / (1.0 - t)

    def sympy_expr(self, t: sympy.Symbol) -> sympy.Expr:
        return 1 / (1 - t)

    def coefficient(self, n: int) -> Fraction:
        _check_order(n)
        return Fraction(1)

    def log_coefficients(self, n_max: int) -> torch.Tensor:
        return torch.zeros(n_max + 1, dtype=torch.float64)


class LogiKernel(MaclaurinKernel):
    """The logarithmic kernel.

    .. math:: f(t) = 1 - \\log(1 - t), \\qquad a_0 = 1,\\ a_n = \\frac{1}{n}\\ (n \\ge 1),
              \\qquad R = 1 .

    That is :math:`a_n = 1/\\max(1, n)`. The papers print :math:`1/\\min(1, N)`, which
    divides by zero at :math:`N = 0` and gives 1 for every :math:`N \\ge 1` (erratum).
    """

    name: ClassVar[str] = "logi"
    positive: ClassVar[bool] = True
    radius: ClassVar[float] = 1.0
    claims: ClassVar[tuple[Any, ...]] = _KERNEL_CLAIMS

    def f(self, t: torch.Tensor) -> torch.Tensor:
        return 1.0 - torch.log1p(-t)

    def sympy_expr(self, t: sympy.Symbol) -> sympy.Expr:
        import sympy

        return 1 - sympy.log(1 - t)

    def coefficient(self, n: int) -> Fraction:
        return Fraction(1, max(1, _check_order(n)))

    def log_coefficients(self, n_max: int) -> torch.Tensor:
        n = torch.arange(n_max + 1, dtype=torch.float64)
        return -n.clamp_min(1).log()


class SqrtKernel(MaclaurinKernel):
    """The square-root kernel.

    .. math:: f(t) = 2 - \\sqrt{1 - t}, \\qquad a_0 = 1,\\ a_1 = \\tfrac12,\\
              a_n = \\frac{(2n-3)!!}{2^n n!} = \\frac{\\binom{2n}{n}}{(2n-1)\\,4^n}\\ (n \\ge 1),
              \\qquad R = 1 .

    First terms :math:`1, \\tfrac12, \\tfrac18, \\tfrac1{16}, \\tfrac5{128}, \\tfrac7{256}`.
    The papers print :math:`\\max(1, 2N-3)/(2^N N!)`, wrong from :math:`N = 4` on
    (:math:`5/384` instead of :math:`5/128`; erratum). The series converges at
    :math:`|t| = 1` (:math:`\\sum a_n = 2`), but the domain check keeps :math:`|t| < 1`
    like the other radius-one kernels.
    """

    name: ClassVar[str] = "sqrt"
    positive: ClassVar[bool] = True
    radius: ClassVar[float] = 1.0
    claims: ClassVar[tuple[Any, ...]] = _KERNEL_CLAIMS

    def f(self, t: torch.Tensor) -> torch.Tensor:
        return 2.0 - torch.sqrt(1.0 - t)

    def sympy_expr(self, t: sympy.Symbol) -> sympy.Expr:
        import sympy

        return 2 - sympy.sqrt(1 - t)

    def coefficient(self, n: int) -> Fraction:
        if _check_order(n) == 0:
            return Fraction(1)
        return Fraction(math.comb(2 * n, n), (2 * n - 1) * 4**n)

    def log_coefficients(self, n_max: int) -> torch.Tensor:
        n = torch.arange(n_max + 1, dtype=torch.float64)
        out = torch.lgamma(2 * n + 1) - 2 * torch.lgamma(n + 1) - (2 * n - 1).abs().log() - n * math.log(4.0)
        out[0] = 0.0  # a_0 = 1
        return out


class PolynomialKernel(MaclaurinKernel):
    """The polynomial kernel.

    .. math:: f(t) = (c + t)^p, \\qquad a_n = \\binom{p}{n} c^{\\,p - n}\\ (n \\le p),\\
              a_n = 0\\ (n > p), \\qquad R = \\infty .

    Parameters
    ----------
    c : int, float or Fraction
        Offset :math:`c \\ge 0` (a negative offset gives negative odd coefficients,
        which no Maclaurin feature map can sample). Floats are taken at their exact
        binary value.
    degree : int
        The power :math:`p \\ge 0`.
    """

    name: ClassVar[str] = "polynomial"
    positive: ClassVar[bool] = False
    radius: ClassVar[float] = math.inf
    claims: ClassVar[tuple[Any, ...]] = (
        MaclaurinCoefficients(order=24, options={"c": 1, "degree": 3}),
        NonNegativeCoefficients(order=24, options={"c": 2, "degree": 5}),
        KernelMatchesExpression(options={"c": 1, "degree": 3}),
    )

    def __init__(self, c: int | float | Fraction = 1, degree: int = 2) -> None:
        if isinstance(c, bool) or not isinstance(c, int | float | Fraction) or not math.isfinite(c) or c < 0:
            raise InputError(
                f"c: expected a finite number >= 0 (negative offsets give negative coefficients), got {c!r}"
            )
        if isinstance(degree, bool) or not isinstance(degree, int) or degree < 0:
            raise InputError(f"degree: expected an integer >= 0, got {degree!r}")
        self.c = Fraction(c)
        self.degree = degree

    def f(self, t: torch.Tensor) -> torch.Tensor:
        return (float(self.c) + t) ** self.degree

    def sympy_expr(self, t: sympy.Symbol) -> sympy.Expr:
        import sympy

        return (sympy.Rational(self.c.numerator, self.c.denominator) + t) ** self.degree

    def coefficient(self, n: int) -> Fraction:
        if _check_order(n) > self.degree:
            return Fraction(0)
        return math.comb(self.degree, n) * self.c ** (self.degree - n)

    def __repr__(self) -> str:
        return f"PolynomialKernel(c={self.c}, degree={self.degree})"


class UserKernel(MaclaurinKernel):
    """A user's dot-product kernel, from a SymPy expression or a coefficient function.

    Give exactly one of ``expr`` and ``coefficients``.

    * ``expr``: a SymPy expression (or a string SymPy parses) in one free symbol
      :math:`t`. Coefficients are its Taylor coefficients at 0 (computed by SymPy,
      exact rationals, cached); :meth:`f` is the expression compiled for torch.
    * ``coefficients``: ``n -> a_n`` (int, Fraction, or float). :meth:`f` is the
      callable ``f`` when given, else the series truncated after ``terms`` terms
      (exact for polynomials); :meth:`sympy_expr` is the same truncated polynomial.

    Construction checks :math:`a_n \\ge 0` for :math:`n \\le` ``check_order`` and
    raises :class:`~kernelattn_core.errors.InputError` naming the first negative one:
    a negative coefficient cannot be sampled by random Maclaurin features, and the
    kernel is then not positive definite on every sphere (Schoenberg).

    This class is not registered (it needs arguments); pass an instance as
    ``kernel=`` to ``rmf`` / ``rmfa`` / ``schoenbat``.

    Parameters
    ----------
    expr : sympy.Expr or str, optional
    coefficients : callable, optional
    f : callable, optional
        Torch function of ``t`` (only with ``coefficients``).
    radius : float
        Radius of convergence :math:`R` (``inf`` by default; give it for non-entire
        functions so that the domain check applies).
    positive : bool
        Whether :math:`f > 0` on the domain.
    check_order : int
        Coefficients checked for non-negativity.
    terms : int
        Series terms used for ``f`` when only ``coefficients`` is given.
    name : str
        A label for messages.

    Examples
    --------
    >>> k = UserKernel("exp(t) / (1 - t)", radius=1.0)
    >>> k.coefficient(2)
    Fraction(5, 2)
    >>> UserKernel(coefficients=lambda n: 1 if n < 3 else 0).coefficient(5)
    Fraction(0, 1)
    """

    name: ClassVar[str] = "user"

    def __init__(
        self,
        expr: Any = None,
        *,
        coefficients: Callable[[int], Any] | None = None,
        f: Callable[[torch.Tensor], torch.Tensor] | None = None,
        radius: float = math.inf,
        positive: bool = False,
        check_order: int = 24,
        terms: int = 64,
        name: str = "user",
    ) -> None:
        import sympy

        if (expr is None) == (coefficients is None):
            raise InputError(
                "expr, coefficients: expected exactly one of a SymPy expression and a coefficient function"
            )
        if not (isinstance(radius, int | float) and radius > 0):
            raise InputError(f"radius: expected a positive number (math.inf for entire functions), got {radius!r}")
        self.radius = float(radius)  # instance value overrides the class default
        self.positive = bool(positive)
        self.label = name
        self.terms = terms
        self._cache: list[Fraction] = []
        self._first_order = check_order + 1
        self._symbol = sympy.Symbol("t")
        if expr is not None:
            if f is not None:
                raise InputError("f: only with coefficients=; an expression is compiled for torch")
            expr = sympy.sympify(expr) if isinstance(expr, str) else expr
            free = sorted(expr.free_symbols, key=str)
            if len(free) > 1:
                raise InputError(f"expr: expected an expression in one symbol t, got free symbols {free}")
            if free:
                expr = expr.subs(free[0], self._symbol)
            self._expr = expr
            self._coef_fn = None
            self._torch_fn = sympy.lambdify(self._symbol, expr, modules="torch")
        else:
            if not callable(coefficients):
                raise InputError(f"coefficients: expected a callable n -> a_n, got {type(coefficients).__name__}")
            self._expr = None
            self._coef_fn = coefficients
            self._torch_fn = f
        for n in range(check_order + 1):
            a = self.coefficient(n)
            if a < 0:
                raise InputError(
                    f"{'expr' if expr is not None else 'coefficients'}: kernel {name!r} has a negative Maclaurin "
                    f"coefficient a_{n} = {a}; random Maclaurin features need a_n >= 0 for every n "
                    "(Schoenberg's condition)"
                )

    def coefficient(self, n: int) -> Fraction | float:
        _check_order(n)
        if self._coef_fn is not None:
            a = self._coef_fn(n)
            if isinstance(a, bool) or not isinstance(a, int | float | Fraction):
                raise InputError(f"coefficients: expected a number for a_{n}, got {a!r}")
            return Fraction(a) if isinstance(a, int) else a
        if n >= len(self._cache):
            import sympy

            order = max(2 * len(self._cache), n + 1, self._first_order)
            series = sympy.series(self._expr, self._symbol, 0, order).removeO()
            poly = sympy.Poly(series, self._symbol)
            values = [poly.coeff_monomial(self._symbol**i) for i in range(order)]
            self._cache = [_to_fraction(v) for v in values]
        return self._cache[n]

    def sympy_expr(self, t: sympy.Symbol) -> sympy.Expr:
        import sympy

        if self._expr is not None:
            return self._expr.subs(self._symbol, t)
        return sum((_to_sympy(self.coefficient(n)) * t**n for n in range(self.terms)), sympy.Integer(0))

    def f(self, t: torch.Tensor) -> torch.Tensor:
        if self._torch_fn is not None:
            out = self._torch_fn(t)
            return out if isinstance(out, torch.Tensor) else torch.full_like(t, float(out))
        out = torch.zeros_like(t)
        for n in reversed(range(self.terms)):  # Horner over the truncated series
            out = out * t + float(self.coefficient(n))
        return out

    def __repr__(self) -> str:
        what = f"expr={self._expr}" if self._expr is not None else "coefficients=<function>"
        return f"UserKernel({what}, radius={self.radius})"


def _check_order(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise InputError(f"n: expected an integer order >= 0, got {n!r}")
    return n


def _to_fraction(value: Any) -> Fraction | float:
    import sympy

    value = sympy.nsimplify(value) if not isinstance(value, sympy.Rational) else value
    if isinstance(value, sympy.Rational):
        return Fraction(int(value.p), int(value.q))
    return float(value)  # irrational coefficient (e.g. a constant like pi): best float


def _to_sympy(a: Fraction | float) -> Any:
    import sympy

    return sympy.Rational(a.numerator, a.denominator) if isinstance(a, Fraction) else sympy.Float(a)


def resolve_kernel(kernel: Any, options: dict[str, Any] | None = None) -> DotProductKernel:
    """A dot-product kernel instance from a registry name or an instance."""
    if options is not None and not isinstance(options, dict):
        raise InputError(f"kernel_options: expected a dict of the kernel's options, got {options!r}")
    options = dict(options or {})
    if isinstance(kernel, DotProductKernel):
        if options:
            raise InputError(f"kernel_options: {sorted(options)} given with a kernel instance; pass a name instead")
        return kernel
    if not isinstance(kernel, str):
        raise InputError(
            f"kernel: expected a registry name (exp, inv, logi, trigh, sqrt, polynomial, ...) or a "
            f"DotProductKernel instance, got {type(kernel).__name__}"
        )
    from kernelattn_core import get_registry

    cls = get_registry().kernel(kernel)
    if not issubclass(cls, DotProductKernel):
        raise InputError(f"kernel: random Maclaurin features need a dot-product kernel, {kernel!r} is {cls.family}")
    accepted = _kernel_options(cls)
    unknown = sorted(set(options) - set(accepted)) if accepted is not None else []
    if unknown:
        takes = f"takes the options {accepted}" if accepted else "takes no options"
        raise InputError(f"kernel_options: kernel {kernel!r} {takes}, got {unknown}")
    return cls(**options)


def _kernel_options(cls: type) -> list[str] | None:
    """The keyword options ``cls(...)`` accepts (``None``: any, a ``**kwargs`` constructor)."""
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):  # pragma: no cover - a constructor without a signature
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.kind in kinds]


# --------------------------------------------------------------------------- the papers' Table 1, as printed
def _paper_logi(n: int) -> Fraction:
    return Fraction(1, min(1, n))  # ZeroDivisionError at n = 0, 1 for every n >= 1


def _paper_sqrt(n: int) -> Fraction:
    return Fraction(max(1, 2 * n - 3), 2**n * math.factorial(n))


#: Coefficient formulas exactly as printed in Table 1 of SchoenbAt / Macformer. Kept
#: only so that regression tests can show where they differ from the true series
#: (``logi`` at every ``n``, ``sqrt`` from ``n = 4``).
PAPER_TABLE_1: dict[str, Callable[[int], Fraction]] = {
    "exp": lambda n: Fraction(1, math.factorial(n)),
    "inv": lambda n: Fraction(1),
    "logi": _paper_logi,
    "trigh": lambda n: Fraction(1, math.factorial(n)),
    "sqrt": _paper_sqrt,
}


def _declare_negative_controls() -> None:
    """Attach the declared negative controls (:mod:`kernelattn_maclaurin.controls`) to the
    kernels' claims, so ``kernelattn verify`` shows KN001, KN002, KN003 and KN006 failing
    as expected."""
    from kernelattn_core.toolkit import PositiveDefinite

    from . import controls

    SqrtKernel.claims = (
        *_KERNEL_CLAIMS,
        MaclaurinCoefficients(
            order=24,
            coefficients=controls.printed_sqrt_coefficient,
            label="Table 1's printed sqrt a_N = max(1, 2N-3)/(2^N N!)",
            expect="fail",
        ),
    )
    LogiKernel.claims = (
        *_KERNEL_CLAIMS,
        KernelMatchesExpression(
            expression=controls.printed_logi_expression,
            label="the sum of Table 1's printed logi a_N = 1/min(1, N)",
            expect="fail",
        ),
    )
    PolynomialKernel.claims = (
        *PolynomialKernel.claims,
        PositiveDefinite(),  # the implied claim, declared since a PositiveDefinite control is declared
        NonNegativeCoefficients(
            order=24, coefficients=controls.negative_offset_coefficient, label="a_n of (t - 1)^3", expect="fail"
        ),
        PositiveDefinite(subject=controls.NegativeOffsetPolynomial, label="(t - 1)^3", expect="fail"),
    )


_declare_negative_controls()

KERNELS: tuple[type[MaclaurinKernel], ...] = (
    ExpKernel,
    InvKernel,
    LogiKernel,
    TrighKernel,
    SqrtKernel,
    PolynomialKernel,
)
